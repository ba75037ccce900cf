"""A GGUF written as a Hugging Face directory only where transformers would run the same model: an architecture
qtool maps, every block tensor named, Llama's bias flags from the biases present, the tokenizer from the first
file of a split set or a directory, and the metadata config.json cannot carry named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from qtool.errors import InputError
from qtool.pack import PackJob, run_pack
from qtool.repack.dense import DenseJob, plan_dense, run_dense
from qtool.repack.plan import RepackJob
from qtool.repack.run import run_repack
from tests.test_interop import LAYERS, H, _llama_dir


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    """test_interop's tiny Llama as GGUF Q8_0 (with its tokenizer), written once for the module."""
    tmp = tmp_path_factory.mktemp("g2h")
    run_pack(PackJob(_llama_dir(tmp / "llama"), tmp / "g32", to="gptq", bits=8, group_size=32, sym=True))
    run_repack(RepackJob(tmp / "g32", "q8_0", tmp / "m.gguf"))
    return tmp / "m.gguf"


def rewrite(src: Path, dst: Path, arch: str | None = None, add: dict | None = None, kv: dict | None = None,
            split: int = 1) -> Path:
    """`src` written again by the gguf package, with another architecture name, added float tensors, added
    metadata (key -> (value, GGUFValueType)); split > 1: as a split set <stem>-0000k-of-0000n.gguf whose
    first file alone holds the metadata (gguf-split's layout). Returns the first file."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    tensors += [(name, data, None) for name, data in (add or {}).items()]
    per = -(-len(tensors) // split)
    files = [dst if split == 1 else dst.with_name(f"{dst.stem}-{k + 1:05d}-of-{split:05d}.gguf") for k in range(split)]
    for k, path in enumerate(files):
        w = gguf.GGUFWriter(str(path), arch)
        if k == 0:
            for f in r.fields.values():
                if f.name.startswith("GGUF.") or f.name == "general.architecture":
                    continue
                name = arch + f.name[len(old):] if f.name.startswith(old + ".") else f.name
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
            for key, (value, vtype) in (kv or {}).items():
                w.add_key_value(key, value, vtype)
        if split > 1:
            w.add_uint16("split.no", k)
            w.add_uint16("split.count", split)
            w.add_int32("split.tensors.count", len(tensors))
        for name, data, qt in tensors[k * per:(k + 1) * per]:
            w.add_tensor(name, data, raw_dtype=qt if data.dtype == np.uint8 else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return files[0]


def test_an_architecture_without_a_transformers_mapping_is_refused(llama_gguf, tmp_path):
    qwen = rewrite(llama_gguf, tmp_path / "qwen2.gguf", arch="qwen2")
    for run in (lambda: run_dense(DenseJob(qwen, tmp_path / "d")), lambda: run_repack(RepackJob(qwen, "ct",
                                                                                                tmp_path / "c"))):
        with pytest.raises(InputError, match=r"qwen2.gguf: qtool writes a transformers config for GGUF architectures"):
            run()
    assert not (tmp_path / "d").exists() and not (tmp_path / "c").exists()


def test_block_tensors_transformers_has_no_name_for_are_refused(llama_gguf, tmp_path):
    experts = np.zeros((4, 96, H), np.float32)  # a mixture of experts: no place in LlamaForCausalLM
    moe = rewrite(llama_gguf, tmp_path / "moe.gguf", add={"blk.0.ffn_gate_exps.weight": experts})
    with pytest.raises(InputError, match=r"1 tensors of the transformer blocks have no name in transformers' "
                                         r"LlamaForCausalLM \(e.g. blk.0.ffn_gate_exps.weight\)"):
        plan_dense(DenseJob(moe, tmp_path / "d", dry_run=True))
    with pytest.raises(InputError, match="blk.0.ffn_gate_exps.weight"):
        run_repack(RepackJob(moe, "gptq", tmp_path / "q", allow_lossy=True))


def test_llama_attention_biases_set_the_flag_transformers_reads(llama_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    g = np.random.default_rng(0)
    kv_rows = 2 * H // 4
    sizes = {"attn_q": H, "attn_k": kv_rows, "attn_v": kv_rows, "attn_output": H}
    biases = {f"blk.{b}.{p}.bias": (g.standard_normal(n) * 0.1).astype(np.float32)
              for b in range(LAYERS) for p, n in sizes.items()}
    full = rewrite(llama_gguf, tmp_path / "bias.gguf", add=biases)
    run_dense(DenseJob(full, tmp_path / "d", dtype="fp32"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["attention_bias"] is True and "mlp_bias" not in cfg
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32)
    q = model.model.layers[1].self_attn.q_proj.bias.detach().numpy()
    o = model.model.layers[1].self_attn.o_proj.bias.detach().numpy()
    assert np.array_equal(o, biases["blk.1.attn_output.bias"])  # read, not initialised
    # q's rows are put back from llama.cpp's rotary pair order: the same values, permuted
    assert sorted(q.tolist()) == sorted(biases["blk.1.attn_q.bias"].tolist())
    partial = rewrite(llama_gguf, tmp_path / "qkv.gguf", add={k: v for k, v in biases.items() if "output" not in k})
    with pytest.raises(InputError, match="lacks blk.0.attn_output.bias"):
        plan_dense(DenseJob(partial, tmp_path / "p", dry_run=True))


def test_keys_config_json_does_not_carry_are_named(llama_gguf, tmp_path):
    f32 = gguf.GGUFValueType.FLOAT32
    attn = rewrite(llama_gguf, tmp_path / "af.gguf", kv={"llama.rope.scaling.attn_factor": (0.6, f32)})
    _, plan = plan_dense(DenseJob(attn, tmp_path / "d", dry_run=True))
    assert any("1 GGUF key(s) of llama have no config.json entry here and are not carried "
               "(llama.rope.scaling.attn_factor = 0.6" in w for w in plan.warnings), plan.warnings
    _, plan = plan_dense(DenseJob(llama_gguf, tmp_path / "d", dry_run=True))
    assert not any("not carried" in w for w in plan.warnings), plan.warnings


def test_a_directory_holding_the_gguf_gets_its_tokenizer(llama_gguf, tmp_path):
    (tmp_path / "in").mkdir()
    shutil.copy(llama_gguf, tmp_path / "in" / "model.gguf")
    run_dense(DenseJob(tmp_path / "in", tmp_path / "d"))
    run_repack(RepackJob(tmp_path / "in", "gptq", tmp_path / "q", allow_lossy=True))
    for out in (tmp_path / "d", tmp_path / "q"):
        tok = json.loads((out / "tokenizer.json").read_text())
        assert tok["model"]["type"] == "BPE" and len(tok["model"]["vocab"]) > 0
        assert "model.layers.0.self_attn.q_proj.weight" in load_file(out / "model.safetensors") or \
            "model.layers.0.self_attn.q_proj.qweight" in load_file(out / "model.safetensors")


def test_the_second_file_of_a_split_set_gets_the_sets_tokenizer(llama_gguf, tmp_path):
    first = rewrite(llama_gguf, tmp_path / "m.gguf", split=2)
    second = first.with_name("m-00002-of-00002.gguf")
    _, plan = plan_dense(DenseJob(second, tmp_path / "d", dry_run=True))
    assert not any("tokenizer" in w for w in plan.warnings), plan.warnings
    r = run_dense(DenseJob(second, tmp_path / "d"))
    assert not any("tokenizer" in w for w in r.plan.warnings), r.plan.warnings
    assert json.loads((tmp_path / "d" / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_bert_vocab_keeps_bracketed_reserved_tokens_whole(tmp_path):
    """llama.cpp's BERT vocabulary marks word-initial pieces with U+2581 and drops "##" from the others; an
    older converter left "[unused0]" as a NORMAL token with no marker: it is a whole token, not "##[unused0]"."""
    from qtool.io.hf_gguf import hf_tokenizer_files

    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "bert")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "[unused0]", "\u2581hello", "lo", "[CLS]"])
    w.add_token_types([3, 1, 1, 1, 3])
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    files, warns = hf_tokenizer_files(tmp_path / "b.gguf")
    assert files["vocab.txt"].split("\n")[:5] == ["[PAD]", "[unused0]", "hello", "##lo", "[CLS]"] and warns == []


def test_a_float_gguf_becomes_a_hugging_face_model(llama_gguf, tmp_path):
    """A GGUF of F16 weights has no quantized module, and is still converted: transformers' names, q/k rows
    back in its order, config and tokenizer; the same weights as the Q8_0 file it was decoded from."""
    r = gguf.GGUFReader(llama_gguf)
    w = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    for f in r.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            w.add_key_value(f.name, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.array(t.data)
        w.add_tensor(t.name, gguf.quants.dequantize(data, t.tensor_type).astype(np.float16)
                     if data.dtype == np.uint8 else data)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    run_dense(DenseJob(tmp_path / "f16.gguf", tmp_path / "a", dtype="fp32"))
    run_dense(DenseJob(llama_gguf, tmp_path / "b", dtype="fp32"))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and "model.layers.0.self_attn.q_proj.weight" in a
    for k in a:  # Q8_0 values are fp16-exact products of an int8 and an fp16 scale only up to rounding
        assert torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-3), k
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def test_the_tokenizer_adds_the_bos_the_gguf_adds(llama_gguf, tmp_path):
    """transformers 5 adds BOS only through tokenizer.json's post-processor (it ignores tokenizer_config.json's
    add_bos_token there): a GGUF that says add_bos_token gets a template that adds it."""
    transformers = pytest.importorskip("transformers")
    kv = gguf.GGUFReader(llama_gguf).fields
    bos = kv["tokenizer.ggml.bos_token_id"].contents()
    token = kv["tokenizer.ggml.tokens"].contents()[bos]
    src = rewrite(llama_gguf, tmp_path / "bos.gguf", kv={"tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL)})
    run_dense(DenseJob(src, tmp_path / "d"))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "d")
    ids = tok("abc abc")["input_ids"]
    assert ids[0] == bos and ids.count(bos) == 1 and tok.convert_ids_to_tokens(bos) == token
    assert tok("abc", "abc")["input_ids"].count(bos) == 2
    run_dense(DenseJob(llama_gguf, tmp_path / "plain"))  # no add_bos_token: nothing is added
    assert bos not in transformers.AutoTokenizer.from_pretrained(tmp_path / "plain")("abc abc")["input_ids"]


def test_an_encoders_pooling_goes_back_to_sentence_transformers(tmp_path):
    """bert.pooling_type (MEAN from the source's 1_Pooling) becomes modules.json + 1_Pooling/config.json again,
    which sentence-transformers loads; the key is then carried, not named as lost."""
    from tests.test_interop import _bert_dir

    run_pack(PackJob(_bert_dir(tmp_path / "bert"), tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "b.gguf"))
    r = run_dense(DenseJob(tmp_path / "b.gguf", tmp_path / "d", dtype="fp32"))
    assert not any("pooling_type" in w for w in r.plan.warnings), r.plan.warnings
    pool = json.loads((tmp_path / "d" / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_mean_tokens"] is True and pool["pooling_mode_cls_token"] is False
    assert pool["word_embedding_dimension"] == H
    assert [m["path"] for m in json.loads((tmp_path / "d" / "modules.json").read_text())] == ["", "1_Pooling"]
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(tmp_path / "d"), device="cpu")
    assert model.encode(["w1 w2"]).shape == (1, H)
