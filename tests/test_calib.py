"""Calibrated packs through a real transformers forward, on tiny BERT and Llama models built here (random
weights, a word-level vocabulary, no downloads): block discovery, AWQ folding exactness, pack --method
gptq|awq end to end, and `qtool eval` numbers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtool.quant import calib  # noqa: E402

WORDS = ("the a model weight layer block group scale zero point input output token text quantized dense "
         "error value key query order column row matrix small large first last each every one two three "
         "four five six seven eight nine ten is are was be has have with from into over under").split()
TEXT = "\n\n".join(" ".join(WORDS[(7 * k + 3 * j) % len(WORDS)] for j in range(12 + k % 9)) + "."
                   for k in range(120))


def _tokenizer(tmp_path):
    """A word-level tokenizer over WORDS that wraps sequences in [CLS] ... [SEP], as BERT's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: k for k, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "."] + WORDS)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                              ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def _save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tok = _tokenizer(d)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so folding into them is visible
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return _save(model, tok, d / "model")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    tok = _tokenizer(d)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    return _save(transformers.BertModel(cfg), tok, d / "model")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "calib.txt"
    p.write_text(TEXT)
    return p


def _model(path):
    from qtool.quant import hf

    return hf.build_model(path)


def _samples(tok, n=4, L=32):
    from qtool.quant import hf

    s, _ = calib.token_windows(hf.tokenize(tok, TEXT), n, L, specials=hf.specials(tok))
    return s


def test_block_discovery_is_structural(tiny_llama, tiny_bert):
    m, _, causal = _model(tiny_llama)
    assert causal and calib.find_blocks(m)[0] == "model.layers"
    m, _, causal = _model(tiny_bert)
    assert not causal and calib.find_blocks(m)[0] == "encoder.layer"


def _block_groups(model, tok):
    name, blocks = calib.find_blocks(model)
    inputs = calib.capture_block_inputs(model, blocks, _samples(tok, 2), "cpu")
    block = blocks[0]
    lins = {id(m): calib._Linear(f"{name}.0.{n}", m, 4, 32) for n, m in block.named_modules()
            if isinstance(m, torch.nn.Linear)}
    groups, producer = calib._groups(block, lins, inputs[0])
    return block, inputs, groups, producer


def test_awq_folds_leave_the_dense_llama_unchanged(tiny_llama):
    model, tok, _ = _model(tiny_llama)
    x = _samples(tok, 1)[0]
    with torch.no_grad():
        before = model(input_ids=x).logits
        block, inputs, groups, producer = _block_groups(model, tok)
        order = [lin for g in groups for lin in g]
        names = [[lin.name.rsplit(".", 1)[-1] for lin in g] for g in groups]
        assert names == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
        reference = calib._run(block, inputs)
        targets = []
        for g in groups:
            cands = calib._fold_candidates(block, g, producer.get(id(g[0].mod)), order)
            targets.append(next(t for t in cands if calib._fold_is_exact(block, t, g, inputs, reference)))
        assert targets == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"]
        # gate_proj feeds down_proj through SiLU: not a place for scales
        down = groups[3]
        assert not calib._fold_is_exact(block, "mlp.gate_proj", down, inputs, reference)
        g = torch.Generator().manual_seed(5)
        for t, grp in zip(targets, groups):
            calib._apply_fold(block, t, grp, torch.rand(64 if t != "mlp.up_proj" else 128, generator=g) + 0.5)
        after = model(input_ids=x).logits
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4)


def test_post_norm_bert_refuses_the_fold(tiny_bert):
    model, tok, _ = _model(tiny_bert)
    with torch.no_grad():
        block, inputs, groups, producer = _block_groups(model, tok)
        order = [lin for g in groups for lin in g]
        reference = calib._run(block, inputs)
        qkv = groups[0]
        assert [lin.name.rsplit(".", 1)[-1] for lin in qkv] == ["query", "key", "value"]
        # the block's input is also its residual: nothing inside the block produces it
        assert calib._fold_candidates(block, qkv, producer.get(id(qkv[0].mod)), order) == []
        # attention.output.dense reads value's output through softmax-weighted sums: value can absorb scales
        o = groups[1]
        cands = calib._fold_candidates(block, o, producer.get(id(o[0].mod)), order)
        ok = [t for t in cands if calib._fold_is_exact(block, t, o, inputs, reference)]
        assert ok == ["attention.self.value"]


def _pack(src, out, *args):
    from qtool.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["pack", str(src), "-o", str(out), "-q", *args])
    assert e.value.code == 0


def _eval(q, ref, *args):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "qtool", "eval", str(q), "--reference", str(ref), "--json", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_pack_gptq_act_order_llama(tiny_llama, text_file, tmp_path):
    out = tmp_path / "gptq"
    _pack(tiny_llama, out, "--method", "gptq", "--act-order", "--true-sequential", "--group-size", "32",
          "--calib", str(text_file), "--calib-samples", "8", "--calib-seqlen", "32", "--eval", "--device", "cpu",
          "--damp", "0.05")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["desc_act"] is True and cfg["quant_method"] == "gptq" and cfg["meta"]["damp_percent"] == 0.05
    rep = json.loads((out / "report.json").read_text())
    cal = rep["calibration"]
    assert cal["samples"] == 8 and cal["true_sequential"] and cal["blocks"] == "model.layers" and cal["damp"] == 0.05
    assert len(cal["layers"]) == 14
    assert all(lay["loss"] < lay["rtn_loss"] for lay in cal["layers"])
    ev = rep["evaluation"]
    assert ev["kind"] == "causal" and ev["ppl_quant"] > 0 and ev["ppl_dense"] > 0
    assert "perplexity" in (out / "report.md").read_text()
    from qtool.inspect import inspect_path

    mods = [m for m in inspect_path(out).modules if m.scheme.format == "gptq"]
    assert len(mods) == 14 and all(m.scheme.desc_act for m in mods)


def test_pack_gptq_mse_and_seed_reach_the_quantizer_and_the_records(tiny_bert, text_file, tmp_path):
    from safetensors.torch import load_file

    common = ("--method", "gptq", "--group-size", "32", "--bits", "3", "--calib", str(text_file),
              "--calib-samples", "8", "--calib-seqlen", "32", "--device", "cpu")
    runs = {}
    for name, extra in (("minmax", ("--no-mse",)), ("mse", ("--mse",)), ("seed1", ("--mse", "--calib-seed", "1"))):
        _pack(tiny_bert, tmp_path / name, *common, *extra)
        rep = json.loads((tmp_path / name / "report.json").read_text())
        cfg = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        runs[name] = (rep, cfg, load_file(str(tmp_path / name / "model.safetensors")))
    for name, mse, seed in (("minmax", False, 0), ("mse", True, 0), ("seed1", True, 1)):
        rep, cfg, _ = runs[name]
        assert rep["calibration"]["mse"] is mse and rep["calibration"]["seed"] == seed
        assert cfg["meta"]["mse"] == (2.0 if mse else 0.0)
        scales = "clip-searched (--mse)" if mse else "min-max"
        assert any(f"seed {seed}," in n and f"{scales} group scales" in n for n in rep["notes"])
        assert all(lay["loss"] < lay["rtn_loss"] for lay in rep["calibration"]["layers"])
    scales = [k for k in runs["mse"][2] if k.endswith(".scales")]
    assert scales and any(not torch.equal(runs["mse"][2][k], runs["minmax"][2][k]) for k in scales)
    # another seed draws other windows, so other Hessians
    assert any(not torch.equal(runs["mse"][2][k], runs["seed1"][2][k]) for k in scales)
    mean = [sum(lay["loss"] for lay in runs[n][0]["calibration"]["layers"]) for n in ("minmax", "mse")]
    assert mean[1] < mean[0]  # at 3 bits the clip search lowers the calibration loss


def test_gptq_driver_runs_one_gptq_per_input_and_hands_it_the_hessian(tiny_llama, monkeypatch):
    # q/k/v (gate/up) share one Hessian: GPTQ runs once on their stacked rows and takes H over, so it can free
    # it while it works
    from qtool.quant import gptq as gptq_mod
    from qtool.quant.calib import CalibSettings, calibrate

    calls, real = [], gptq_mod.gptq_quantize

    def spy(W, H, *a, **k):
        calls.append(("+".join(n.rsplit(".", 1)[-1] for n in k["name"].split(", ")), k["consume"], W.shape[0]))
        return real(W, H, *a, **k)

    monkeypatch.setattr(gptq_mod, "gptq_quantize", spy)
    model, tok, _ = _model(tiny_llama)
    targets = {n: (4, 32) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n}
    calibrate(model, _samples(tok), targets, CalibSettings("gptq", True))
    # one GPTQ per group of linears reading one input, on their stacked rows, each taking its Hessian over
    assert calls == 2 * [("q_proj+k_proj+v_proj", True, 192), ("o_proj", True, 64), ("gate_proj+up_proj", True, 256),
                         ("down_proj", True, 64)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_peak_gpu_memory_is_one_block_and_its_hessians():
    from qtool.quant.calib import CalibSettings, calibrate

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).eval()
    # 512 x 256 tokens: their hidden states are 256 MiB in fp32, twice (a block's inputs and outputs), more
    # than the bound below allows: they must stay in host memory
    samples = [torch.randint(0, 1000, (1, 256)) for _ in range(512)]
    targets = {n: (4, 128) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    calibrate(model, samples, targets, CalibSettings("gptq", True, act_order=True, device="cuda"))
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    hessians = 4 * (3 * 512 * 512 + 2048 * 2048)  # fp32: q/k/v, o, gate/up (512) and down (2048)
    # one batch's (4096 tokens) activations in fp32 (the MLP's are 32 MiB each), with room for temporaries and
    # cuBLAS workspaces: 512 MiB, less than the 2 x 256 MiB of stored hidden states plus a batch's activations
    batch = 4096 * 2048 * 4 * 16
    assert torch.cuda.max_memory_allocated() - base <= block + hessians + batch


def test_gptq_bf16_forward_quantizes_the_stored_weights(tiny_llama):
    # the forward runs in bf16, but every linear is quantized from its float32 weight as loaded
    from qtool.formats.plain import dequantize
    from qtool.quant.calib import CalibSettings, calibrate

    model, tok, _ = _model(tiny_llama)
    ref = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = {n: (4, 32) for n in ref if n.startswith("model.layers.")}
    res = calibrate(model, _samples(tok), targets, CalibSettings("gptq", True, forward_dtype=torch.bfloat16))
    assert next(model.parameters()).dtype == torch.bfloat16 and len(res.layers) == len(targets)
    for name, lr in res.layers.items():
        W = ref[name]
        assert lr.loss < lr.rtn_loss
        assert lr.rel_error == pytest.approx(float((W.double() - dequantize(lr.plain, torch.float64)).norm()
                                                   / W.double().norm()), rel=1e-6)
        assert float((W.bfloat16().float() - W).abs().max()) > 0  # bf16 copies would differ from these


def test_pack_awq_llama_writes_folded_norms_consistently(tiny_llama, text_file, tmp_path):
    out = tmp_path / "awq"
    _pack(tiny_llama, out, "--method", "awq", "--to", "awq", "--group-size", "32", "--calib", str(text_file),
          "--calib-samples", "8", "--calib-seqlen", "32")
    from safetensors.torch import load_file

    src = load_file(str(tiny_llama / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(src[norm], got[norm])  # scales were folded into the norm and the norm was written
    rep = json.loads((out / "report.json").read_text())
    assert any("folded into input_layernorm" in n for n in rep["notes"])
    # the checkpoint as written (folded norms + quantized scaled weights) is close to the dense model
    ev = _eval(out, tiny_llama, "--text", str(text_file), "--seqlen", "32")
    assert ev["ppl_quant"] == pytest.approx(ev["ppl_dense"], rel=0.05)
    # its layers read rescaled inputs, so eval says it cannot compare them one by one
    assert ev["layers"] == [] and "AWQ folded its scales" in ev["notes"][0]
    assert all(lay["loss"] < lay["rtn_loss"] * 1.0001 for lay in rep["calibration"]["layers"])
    # validate against the dense model: the folded norms differ by design (skipped, saying why), not failures
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "qtool", "validate", str(out), "--reference", str(tiny_llama),
                        "--checks", "reference", "--device", "cpu", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    skips = [c["detail"] for c in json.loads(r.stdout)["checks"] if c["status"] == "skip"]
    assert any("differ from the reference as AWQ makes them" in d for d in skips), skips


def test_eval_numbers_on_tiny_bert(tiny_bert, text_file, tmp_path):
    lo, hi = tmp_path / "b2", tmp_path / "b8"
    _pack(tiny_bert, lo, "--bits", "2", "--group-size", "32")
    _pack(tiny_bert, hi, "--bits", "8", "--group-size", "32")
    e_lo, e_hi = _eval(lo, tiny_bert, "--text", str(text_file)), _eval(hi, tiny_bert, "--text", str(text_file))
    assert e_hi["kind"] == "encoder" and e_hi["sentences"] == 64
    assert e_hi["cos_mean"] > 0.999 and e_hi["sim_drift_max"] < 0.01
    assert e_lo["cos_mean"] < e_hi["cos_mean"] and e_lo["cos_min"] <= e_lo["cos_mean"]
    assert max(x["rel_error"] for x in e_hi["layers"]) < 0.01 < min(x["rel_error"] for x in e_lo["layers"])


def test_calibration_options_need_a_calibrated_method(tiny_bert, tmp_path):
    from qtool.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["pack", str(tiny_bert), "-o", str(tmp_path / "x"), "--act-order"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["pack", str(tiny_bert), "-o", str(tmp_path / "x"), "--method", "gptq", "--act-order", "--to", "awq"])
    assert e.value.code == 2
    for args in (["--damp", "0.1"], ["--method", "gptq", "--damp", "0"], ["--method", "awq", "--damp", "0.1"],
                 ["--method", "awq", "--calib-dtype", "bf16"], ["--method", "gptq", "--calib-dtype", "int8"],
                 ["--mse"], ["--no-mse"], ["--method", "awq", "--mse"], ["--calib-seed", "1"],
                 ["--method", "gptq", "--calib-seed", "-1"], ["--method", "mse", "--mse"]):
        with pytest.raises(SystemExit) as e:
            main(["pack", str(tiny_bert), "-o", str(tmp_path / "x"), *args])
        assert e.value.code == 2
    assert not (tmp_path / "x").exists()


def test_eval_refuses_a_reference_with_holes_and_bad_devices(tiny_bert, tmp_path):
    """transformers fills a parameter the files lack with random values: a reference with a hole (or a
    quantized "reference") is refused, not compared; a device name torch does not know is a usage error."""
    import shutil

    from safetensors.torch import load_file, save_file

    from qtool.cli.main import main

    q = tmp_path / "q"
    _pack(tiny_bert, q, "--bits", "8", "--group-size", "32")
    holed = tmp_path / "holed"
    shutil.copytree(tiny_bert, holed)
    t = load_file(holed / "model.safetensors")
    gone = next(n for n in t if n.endswith("intermediate.dense.weight"))
    del t[gone]
    save_file(t, holed / "model.safetensors", metadata={"format": "pt"})
    for ref, device in ((holed, "cpu"), (q, "cpu"), (tiny_bert, "bogus"), (tiny_bert, "mps")):
        with pytest.raises(SystemExit) as e:
            main(["eval", str(q), "--reference", str(ref), "--device", device, "-q"])
        assert e.value.code == 2, (ref, device)


def test_short_text_windows_overlap_is_said():
    import torch as t

    s, note = calib.token_windows(t.arange(40), 16, 32)
    assert len(s) == 16 and "the calibration text has 40 tokens, fewer than the 16 x 32 asked for" in note
    s, note = calib.token_windows(t.arange(10_000), 4, 32)
    assert note == ""


def test_eval_of_an_encoder_with_few_positions(tiny_bert, tmp_path):
    """A paragraph longer than the encoder's 128 positions is cut to them (it was cut to 256 and crashed)."""
    q = tmp_path / "q"
    _pack(tiny_bert, q, "--bits", "8", "--group-size", "32")
    long = tmp_path / "long.txt"
    long.write_text(" ".join(WORDS[k % len(WORDS)] for k in range(400)) + ".\n\n" + TEXT)
    ev = _eval(q, tiny_bert, "--text", str(long))
    assert ev["kind"] == "encoder" and ev["cos_mean"] > 0.99


def test_gptq_fp16_overflow_is_named(tiny_llama, text_file, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    from qtool.cli.main import main

    big = tmp_path / "big"
    shutil.copytree(tiny_llama, big)
    t = load_file(big / "model.safetensors")
    for k in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        t[k] = t[k] * 3000
    save_file(t, big / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit) as e:
        main(["pack", str(big), "-o", str(tmp_path / "o"), "--method", "gptq", "--group-size", "32", "--calib",
              str(text_file), "--calib-samples", "4", "--calib-seqlen", "32", "--calib-dtype", "fp16", "-q"])
    assert e.value.code == 2 and not (tmp_path / "o").exists()
    # the overflow is named, not blamed on the samples (a Hessian "not positive definite")
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.down_proj" in err and "hold NaN/Inf" in err and "--calib-dtype fp32" in err, err


def test_awq_layers_the_forward_never_reaches_are_rtn_and_said(tmp_path, text_file):
    """A decoder BERT with cross-attention run without encoder states never calls its cross-attention linears:
    they get RTN, no loss, and no scale fold (GPTQ did this already)."""
    d = tmp_path / "xbert"
    tok = _tokenizer(tmp_path)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, max_position_embeddings=128, is_decoder=True,
                                  add_cross_attention=True, architectures=["BertLMHeadModel"])
    torch.manual_seed(0)
    _save(transformers.BertLMHeadModel(cfg), tok, d)
    out = tmp_path / "awq"
    _pack(d, out, "--method", "awq", "--to", "awq", "--group-size", "32", "--calib", str(text_file),
          "--calib-samples", "4", "--calib-seqlen", "32")
    rep = json.loads((out / "report.json").read_text())
    cross = [lay for lay in rep["calibration"]["layers"] if "crossattention" in lay["module"]]
    assert cross and all(lay["loss"] is None and "not reached" in lay["note"] for lay in cross), cross
    assert not any("crossattention" in n and "folded" in n for n in rep["notes"])


def test_an_untied_model_missing_its_lm_head_is_refused(tiny_llama, tmp_path):
    """transformers 5's _tied_weights_keys names lm_head for every Llama; only a config that ties the embeddings
    makes a missing lm_head.weight a tie rather than a hole filled with random values."""
    from safetensors.torch import load_file, save_file

    from qtool.errors import InputError

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    t = load_file(d / "model.safetensors")
    del t["lm_head.weight"]
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match="'lm_head.weight'"):
        _model(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    model = _model(d)[0]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _tiny(tmp_path, name, cfg, cls):
    tok = _tokenizer(tmp_path)
    torch.manual_seed(0)
    return _save(cls(cfg(vocab_size=len(tok))), tok, tmp_path / name)


def test_gpt2_conv1d_weights_are_refused_not_packed_along_the_wrong_axis(tmp_path):
    """GPT-2 keeps its projections in Conv1D, weights [in, out]: packing them as [out, in] scaled the wrong
    axis and wrote files no reader takes; and GPT2LMHeadModel is a causal LM, not an encoder."""
    from qtool.errors import InputError
    from qtool.pack import PackJob, run_pack
    from qtool.quant.hf import is_causal

    src = _tiny(tmp_path, "gpt2", lambda **kw: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, **kw),
                transformers.GPT2LMHeadModel)
    with pytest.raises(InputError, match="model_type 'gpt2' keeps its projections in transformers' Conv1D"):
        run_pack(PackJob(src, tmp_path / "out", to="gptq"))
    assert not (tmp_path / "out").exists()
    assert is_causal(json.loads((src / "config.json").read_text()))
    # the same layout under another model type is caught by its bias: [out] of a weight stored [in, out]
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "custom"}))
    with pytest.raises(InputError, match="attn.c_attn.weight.*its bias has 192 entries, the weight's second"):
        run_pack(PackJob(src, tmp_path / "out", to="gptq"))


def test_t5_relative_position_bias_stays_dense_and_eval_refuses_encoder_decoders(tmp_path):
    from qtool.errors import UsageError
    from qtool.evaluate import evaluate
    from qtool.pack import PackJob, run_pack

    src = _tiny(tmp_path, "t5", lambda **kw: transformers.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2,
                                                                    num_heads=4, **kw),
                transformers.T5ForConditionalGeneration)
    r = run_pack(PackJob(src, tmp_path / "q", to="gptq", group_size=64))
    kept = {p.module: p.reason for p in r.plan if "relative_attention_bias" in p.module}
    assert kept and all(why.startswith("embedding") for why in kept.values()), kept
    with pytest.raises(UsageError, match="an encoder-decoder model .*T5ForConditionalGeneration"):
        evaluate(tmp_path / "q", src)


def test_awq_folds_into_gemmas_one_plus_w_norms(tmp_path, text_file):
    """Gemma's RMSNorm multiplies by 1 + w: a fold must give w' = (1 + w) / s - 1 (as AutoAWQ does), which the
    fold trial finds where dividing w alone changes the block's output."""
    tok = _tokenizer(tmp_path)
    cfg = transformers.GemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(-0.5, 0.5)
    src = _save(model, tok, tmp_path / "gemma")
    m, tok2, _ = _model(src)
    _, blocks = calib.find_blocks(m)
    block = blocks[0]
    with torch.no_grad():
        inputs = calib.capture_block_inputs(m, blocks, calib.batches(_samples(tok2)), "cpu")
        reference = calib._run(block, inputs)
        lins = {id(x): calib._Linear(n, x, 4, 32) for n, x in block.named_modules()
                if isinstance(x, torch.nn.Linear)}
        qkv = calib._groups(block, lins, inputs[0])[0][0]
        assert calib._fold_is_exact(block, "input_layernorm", qkv, inputs, reference, offset=1.0)
        assert not calib._fold_is_exact(block, "input_layernorm", qkv, inputs, reference, offset=0.0)
    out = tmp_path / "awq"
    _pack(src, out, "--method", "awq", "--to", "awq", "--group-size", "32", "--calib", str(text_file),
          "--calib-samples", "8", "--calib-seqlen", "32")
    notes = json.loads((out / "report.json").read_text())["notes"]
    assert sum("folded into input_layernorm (its factor 1 + w)" in n for n in notes) == 2, notes
    e = _eval(out, src, "--text", str(text_file))
    assert abs(e["ppl_quant"] - e["ppl_dense"]) < 0.05 * e["ppl_dense"]
