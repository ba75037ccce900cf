"""`qtool pack` end to end: plans, outputs that foreign readers open, values decoded by layout facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import InputError, OutputError, SpecError, UsageError
from tests.conftest import write_llama
from tests.oracles.layouts import awq_unpack_cols, awq_weight, gptq_weight

O, I = 128, 256


def make_model(root, seed=0, heavy=False):
    """A tiny Llama-shaped dense checkpoint directory with config, tokenizer file, embeddings and norms."""
    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)

    def w(o, i):
        x = torch.randn(o, i, generator=g)
        if heavy:  # heavy tails make clipping matter
            x = x * torch.randn(o, i, generator=g).abs().pow(2)
        return x.to(torch.float16)

    t = {"model.embed_tokens.weight": w(100, I), "model.norm.weight": torch.ones(I, dtype=torch.float16),
         "lm_head.weight": w(100, I)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = w(O, I)
        t[p + "self_attn.o_proj.weight"] = w(I, O)
        t[p + "self_attn.o_proj.bias"] = torch.randn(I, generator=g).half()
        t[p + "mlp.down_proj.weight"] = w(I, 128)
        t[p + "input_layernorm.weight"] = torch.ones(I, dtype=torch.float16)
    write_llama(root, t, "float16")
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    return t


def invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def load(out):
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def decode(fmt, tensors, module, bits, group):
    q = lambda s: tensors[f"{module}.{s}"].numpy()  # noqa: E731
    if fmt == "awq":
        return awq_weight(q("qweight"), q("qzeros"), tensors[f"{module}.scales"].float().numpy(), group)
    return gptq_weight(q("qweight"), q("qzeros"), tensors[f"{module}.scales"].float().numpy(), q("g_idx"), bits,
                       planar=fmt == "gptq_p", v1=fmt == "gptq")


@pytest.mark.parametrize("fmt,bits,sym", [("gptq", 4, True), ("gptq_v2", 4, False), ("gptq_p", 3, False),
                                          ("awq", 4, False), ("gptq", 8, True), ("gptq_v2", 2, False)])
def test_pack_formats_decode_to_reported_error(tmp_path, fmt, bits, sym):
    src = make_model(tmp_path / "src")
    out = tmp_path / "out"
    r = invoke("pack", tmp_path / "src", "-o", out, "--to", fmt, "--bits", bits, "--group-size", 64,
               "--sym" if sym else "--asym", "--json")
    report = json.loads(r.stdout)
    tensors, meta = load(out)
    assert meta["format"] == "pt" and meta["qtool.format"] == fmt
    linear = [m for m in (f"model.layers.{k}.{n}" for k in range(2)
                          for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"))]
    assert sorted(t["module"] for t in report["tensors"]) == sorted(linear)
    for t in report["tensors"]:
        m = t["module"]
        assert f"{m}.weight" not in tensors
        w = src[f"{m}.weight"].double().numpy()
        what = decode(fmt, tensors, m, bits, 64)
        rel = np.linalg.norm(w - what) / np.linalg.norm(w)
        assert rel == pytest.approx(t["rel_error"], rel=1e-9, abs=1e-12)
        assert 0 < rel < {2: 0.7, 3: 0.3, 4: 0.15, 8: 0.01}[bits]
    # untouched tensors are byte-identical; embeddings, lm_head and norms stay dense
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.bias"):
        assert torch.equal(tensors[k].view(torch.int16), src[k].view(torch.int16))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"]) == (
        "awq" if fmt == "awq" else "gptq", bits, 64, sym)
    assert cfg["model_type"] == "llama"
    assert json.loads((out / "quantize_config.json").read_text()) == q
    assert (out / "tokenizer.json").read_text() == '{"vocab": {}}'
    assert json.loads((out / "report.json").read_text())["totals"] == report["totals"]
    assert "| module |" in (out / "report.md").read_text()


@pytest.mark.parametrize("bits", [3, 4])
def test_mse_beats_rtn(tmp_path, bits):
    make_model(tmp_path / "src", heavy=True)
    errs = {}
    for method in ("rtn", "mse"):
        r = invoke("pack", tmp_path / "src", "-o", tmp_path / method, "--to", "gptq_v2", "--bits", bits,
                   "--asym", "--method", method, "--json")
        errs[method] = json.loads(r.stdout)["totals"]["rel_error_mean"]
    assert errs["mse"] < errs["rtn"]


def test_tensor_type_override_and_dynamic_config(tmp_path):
    make_model(tmp_path / "src")
    out = tmp_path / "out"
    r = invoke("pack", tmp_path / "src", "-o", out, "--to", "gptq_v2", "--tensor-type", r"mlp\.down_proj=8:32",
               "--exclude", r"layers\.1\.self_attn\.q_proj", "--json")
    rep = json.loads(r.stdout)
    by = {t["module"]: t for t in rep["tensors"]}
    assert by["model.layers.0.mlp.down_proj"]["bits"] == 8 and by["model.layers.0.mlp.down_proj"]["group_size"] == 32
    assert by["model.layers.0.self_attn.q_proj"]["bits"] == 4
    assert "model.layers.1.self_attn.q_proj" not in by
    tensors, _ = load(out)
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (128 * 8 // 32, I)
    assert "model.layers.1.self_attn.q_proj.weight" in tensors
    dyn = json.loads((out / "config.json").read_text())["quantization_config"]["dynamic"]
    assert dyn[r"+:^model\.layers\.0\.mlp\.down_proj$"] == {"bits": 8, "group_size": 32}
    assert r"-:^model\.layers\.1\.self_attn\.q_proj$" in dyn


def test_sharded_output(tmp_path):
    make_model(tmp_path / "src")
    out = tmp_path / "out"
    invoke("pack", tmp_path / "src", "-o", out, "--max-shard-size", "40KB", "-q")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    from qtool.io.checkpoint import open_checkpoint

    ck = open_checkpoint(out)
    assert "model.layers.0.mlp.down_proj.qweight" in ck.tensors


def test_dry_run_writes_nothing(tmp_path):
    make_model(tmp_path / "src")
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "out", "--dry-run", "--json")
    plan = {p["module"]: p for p in json.loads(r.stdout)["plan"]}
    assert plan["model.embed_tokens"]["action"] == "keep" and "embedding" in plan["model.embed_tokens"]["reason"]
    assert plan["lm_head"]["action"] == "keep"
    assert plan["model.layers.0.mlp.down_proj"]["action"] == "quantize"
    assert not (tmp_path / "out").exists()


def test_existing_destination_refused_then_forced(tmp_path):
    make_model(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious").write_text("x")
    with pytest.raises(OutputError, match="destination exists"):
        invoke("pack", tmp_path / "src", "-o", out)
    assert (out / "precious").exists()
    with pytest.raises(OutputError, match="--force replaces only"):  # not an output qtool wrote
        invoke("pack", tmp_path / "src", "-o", out, "--force", "-q")
    assert (out / "precious").exists()
    prior = tmp_path / "prior"
    invoke("pack", tmp_path / "src", "-o", prior, "-q")
    (prior / "precious").write_text("x")
    invoke("pack", tmp_path / "src", "-o", prior, "--force", "-q")
    assert not (prior / "precious").exists() and (prior / "model.safetensors").exists()


def test_config_file_and_flag_override(tmp_path):
    make_model(tmp_path / "src")
    job = tmp_path / "job.yaml"
    job.write_text("to: gptq_p\nbits: 3\ngroup_size: 32\nsym: false\n")
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "out", "--config", job, "--bits", "5", "--json")
    rep = json.loads(r.stdout)
    assert rep["format"] == "gptq_p" and {t["bits"] for t in rep["tensors"]} == {5}
    assert {t["group_size"] for t in rep["tensors"]} == {32} and rep["sym"] is False


@pytest.mark.parametrize("args,err,msg", [
    (["{missing}"], InputError, "no such file"),
    (["{notst}"], InputError, "not a .safetensors"),
    (["{src}", "--to", "exl9"], UsageError, "pack cannot write 'exl9'"),
    (["{src}", "--bits", "9"], UsageError, "--bits 9 is outside 2..8"),
    (["{src}", "--group-size", "96"], UsageError, "group size 96 (--group-size) does not divide in_features"),
    (["{src}", "--to", "awq", "--bits", "3"], UsageError, "awq cannot hold 3-bit"),
    (["{src}", "--config", "{badyaml}"], SpecError, "unknown key 'bitz'"),
    (["{src}", "--include", "("], UsageError, "not a valid regular expression"),
])
def test_bad_inputs(tmp_path, args, err, msg):
    make_model(tmp_path / "src")
    (tmp_path / "x.txt").write_text("hello")
    (tmp_path / "bad.yaml").write_text("bitz: 4\n")
    fill = {"{src}": tmp_path / "src", "{missing}": tmp_path / "nope", "{notst}": tmp_path / "x.txt",
            "{badyaml}": tmp_path / "bad.yaml"}
    argv = ["pack"] + [str(fill.get(a, a)) for a in args] + ["-o", str(tmp_path / "out")]
    r = CliRunner().invoke(app, argv)
    assert isinstance(r.exception, err), (r.exception, r.output)
    assert msg in str(r.exception) and "\n" not in str(r.exception)
    assert not (tmp_path / "out").exists()


def test_source_already_quantized_is_refused(tmp_path):
    make_model(tmp_path / "src")
    invoke("pack", tmp_path / "src", "-o", tmp_path / "q", "-q")
    with pytest.raises(InputError, match="already quantized"):
        invoke("pack", tmp_path / "q", "-o", tmp_path / "q2")


def test_output_over_the_input_is_refused(tmp_path):
    src = tmp_path / "src"
    make_model(src)
    before = (src / "model.safetensors").read_bytes()
    for dest in (src, src / "sub", tmp_path):
        with pytest.raises(OutputError, match="overlaps the input"):
            invoke("pack", src, "-o", dest, "--force")
    assert (src / "model.safetensors").read_bytes() == before


def big_model(root, dtype=torch.bfloat16):
    """One linear weight whose first group's max |w| (2^21) needs a 4-bit scale beyond fp16's range."""
    root.mkdir(parents=True, exist_ok=True)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    w[0, 3] = 2.0 ** 21
    save_file({"model.layers.0.mlp.up_proj.weight": w.to(dtype)}, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_fp16_scale_overflow_refused_bf16_scales_written(tmp_path, fmt):
    big_model(tmp_path / "src")
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--to", fmt,
                                 "--group-size", "32"])
    assert r.exception.exit_code == 2 and not (tmp_path / "out").exists()
    msg = str(r.exception)
    assert str(tmp_path / "src") in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "max |w| = 2.09715e+06" in msg and "--dtype bf16" in msg and "\n" not in msg
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "out", "--to", fmt, "--group-size", 32, "--dtype", "bf16",
               "--json")
    rep = json.loads(r.stdout)
    assert 0 < rep["totals"]["rel_error_mean"] < 0.2
    tensors, _ = load(tmp_path / "out")
    s = tensors["model.layers.0.mlp.up_proj.scales"]
    assert s.dtype == torch.bfloat16 and bool(torch.isfinite(s.float()).all())
    w = decode(fmt, tensors, "model.layers.0.mlp.up_proj", 4, 32)
    assert np.isfinite(w).all()


def test_nan_error_metric_is_an_error(tmp_path, monkeypatch):
    import qtool.formats.plain as plain

    make_model(tmp_path / "src")
    monkeypatch.setattr(plain, "relative_error", lambda w, p: float("nan"))
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert r.exception.exit_code == 2 and "nan%" not in r.output and not (tmp_path / "out").exists()
    assert "not a number" in str(r.exception) and "model.layers.0.mlp.down_proj.weight" in str(r.exception)


def test_nan_weight_error_names_file_tensor_and_index(tmp_path):
    t = make_model(tmp_path / "src")
    t["model.layers.1.mlp.down_proj.weight"][17, 100] = float("inf")
    save_file(t, tmp_path / "src" / "model.safetensors")
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    msg = str(r.exception)
    assert r.exception.exit_code == 2 and not (tmp_path / "out").exists()
    assert msg.startswith(f"{tmp_path / 'src'}: tensor 'model.layers.1.mlp.down_proj.weight': the weight holds inf "
                          f"at [17, 100]")


def test_awq_defaults_to_asymmetric_and_says_so(tmp_path):
    make_model(tmp_path / "src")
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "awq", "--to", "awq", "--group-size", 64)
    assert "AWQ: asymmetric by convention" in r.stdout and "awq (rtn, asym" in r.stdout and "warning" not in r.stderr
    q = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert q["zero_point"] is True and q["sym"] is False
    assert "AWQ\\: asymmetric by convention" in (tmp_path / "awq" / "report.md").read_text()  # Markdown-escaped
    tensors, _ = load(tmp_path / "awq")
    # the zero points vary (not all the symmetric midpoint 8)
    assert (awq_unpack_cols(tensors["model.layers.0.mlp.down_proj.qzeros"].numpy()) != 8).any()
    # --sym opts in, with a warning on stderr (also under --json, whose stdout stays JSON)
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "awq-sym", "--to", "awq", "--group-size", 64, "--sym",
               "--json")
    rep = json.loads(r.stdout)
    assert rep["sym"] is True and any("vLLM" in w for w in rep["warnings"])
    assert "warning: symmetric AWQ (--sym): vLLM's AWQ path refuses it on CUDA" in r.stderr
    assert json.loads((tmp_path / "awq-sym" / "config.json").read_text())["quantization_config"]["zero_point"] is False
    # GPTQ layouts keep their symmetric default
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "gptq", "--dry-run", "--json")
    assert json.loads(r.stdout)["sym"] is True


@pytest.mark.parametrize("shape", [(0, 256), (256, 0)])
def test_empty_weight_kept_with_a_warning(tmp_path, shape):
    t = make_model(tmp_path / "src")
    t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(shape, dtype=torch.float16)
    save_file(t, tmp_path / "src" / "model.safetensors")
    r = invoke("pack", tmp_path / "src", "-o", tmp_path / "out", "--json")
    rep = json.loads(r.stdout)
    plan = {p["module"]: p for p in rep["plan"]}
    assert plan["model.layers.0.mlp.gate_proj"]["action"] == "keep"
    assert f"model.layers.0.mlp.gate_proj.weight: empty weight [{shape[0]}, {shape[1]}]" in r.stderr
    tensors, _ = load(tmp_path / "out")
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == shape
    assert "model.layers.0.mlp.down_proj.qweight" in tensors
    dyn = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["dynamic"]
    assert r"-:^model\.layers\.0\.mlp\.gate_proj$" in dyn


def test_memory_need_checked_before_anything_is_read(tmp_path, monkeypatch):
    import qtool.pack as pack

    make_model(tmp_path / "src")
    monkeypatch.setattr(pack, "available_bytes", lambda: (1 << 20, "memory available"))
    monkeypatch.setattr(pack.Checkpoint, "get", lambda *a, **k: pytest.fail("a tensor was read"))
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    msg = str(r.exception)
    assert r.exception.exit_code == 2 and not (tmp_path / "out").exists()
    info = pack.open_checkpoint(tmp_path / "src").tensors["model.layers.0.self_attn.q_proj.weight"]
    need = pack.module_bytes(info, 4, "gptq")
    assert f"needs about {need / (1 << 30):.2f} GiB ({need} bytes) but only 0.00 GiB (1048576 bytes)" in msg
    assert "memory available" in msg


def test_output_size_checked_against_free_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import qtool.pack as pack

    make_model(tmp_path / "src")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(OutputError, match=r"the output needs about 0\.00 GiB \(\d+ bytes\) but .* has 0\.00 GiB "
                                          r"\(4096 bytes\) free"):
        invoke("pack", tmp_path / "src", "-o", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    need = pack.output_bytes(pack.open_checkpoint(tmp_path / "src"), {})
    assert need == (tmp_path / "src" / "model.safetensors").stat().st_size - 8 - int.from_bytes(
        (tmp_path / "src" / "model.safetensors").read_bytes()[:8], "little") + len('{"vocab": {}}')


def test_transformers_5_dtype_key_is_kept_in_step(tmp_path):
    """transformers 5 names the model dtype `dtype`: a pack writes the scales' dtype under both names, so the
    two never disagree."""
    big_model(tmp_path / "src")
    cfg = {"model_type": "llama", "dtype": "float32"}
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    invoke("pack", tmp_path / "src", "-o", tmp_path / "out", "--to", "gptq", "--group-size", 32, "--dtype", "bf16")
    got = json.loads((tmp_path / "out" / "config.json").read_text())
    assert got["dtype"] == got["torch_dtype"] == "bfloat16"
