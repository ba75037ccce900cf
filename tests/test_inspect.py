"""`qtool inspect` end to end: foreign fixtures, qtool-written checkpoints, mislabelled GPTQ v1/v2 files,
broken checkpoints (truncated, missing shard, bad index), GGUF files, the JSON schema and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.inspect import inspect_path
from qtool.inspect.report import MODULE_KEYS, REPORT_KEYS
from qtool.packing.bitstream import pack_stream
from tests.conftest import fixture_path

runner = CliRunner()


def cli(*args: str):
    """(result, exit code the command returns); main() turns that return value into the process status."""
    res = runner.invoke(app, list(args), standalone_mode=False)
    if res.exception is not None:
        raise res.exception
    return res, res.return_value or 0

# fixture folder -> (format, bits, group_size, sym)
FIXTURES = {
    "gptqmodel-gptq-v1-4bit-g128-sym": ("gptq", 4, 128, True),
    "gptqmodel-gptq-v2-4bit-g128-asym": ("gptq_v2", 4, 128, False),
    "gptqmodel-gptq-v1-4bit-g128-asym-wordborrow": ("gptq", 4, 128, False),
    "gptqmodel-gptq-3bit-g128-asym": ("gptq_v2", 3, 128, False),
    "gptqmodel-gptq_p-5bit-g64-asym": ("gptq_p", 5, 64, False),
    "gptqmodel-awq-gemm-4bit-g128": ("awq", 4, 128, False),
    "compressed-tensors-w4a16-g128": ("ct", 4, 128, True),
    "compressed-tensors-w4a16-g128-asym": ("ct", 4, 128, False),
}
SHAPES = {"attention.self.query": (64, 384), "attention.self.key": (64, 384), "attention.self.value": (64, 384),
          "attention.output.dense": (64, 384), "intermediate.dense": (128, 384), "output.dense": (32, 1536)}
GGUF_FIXTURE = "gguf-q4_0-q4_1-q8_0/gguf-q4_0-q4_1-q8_0.gguf"


def _module_fields(r):
    return {m.name.removeprefix("encoder.layer.0."): (m.scheme.format, m.scheme.bits, m.scheme.group_size,
                                                      m.scheme.sym, m.scheme.desc_act,
                                                      (m.out_features, m.in_features)) for m in r.modules}


# A fixture directory holds the foreign tool's reference beside the model: inspect names it as not read.
REF_NOTE = "reference.safetensors not read"


def _findings(r) -> list:
    """The warnings and errors other than the one about the fixture's reference file, which must be there."""
    notes = [a for a in r.anomalies if a.severity != "info"]
    assert [a.severity for a in notes if a.message.startswith(REF_NOTE)] == ["warning"], notes
    return [a for a in notes if not a.message.startswith(REF_NOTE)]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_detected_header_only(name, fixtures_dir):
    fmt, bits, g, sym = FIXTURES[name]
    r = inspect_path(fixture_path(name))
    assert r.container == "safetensors" and r.format == fmt
    assert _module_fields(r) == {k: (fmt, bits, g, sym, False, shape) for k, shape in SHAPES.items()}
    assert _findings(r) == []
    assert r.bytes_total == sum(t.bytes for t in r.tensors)
    assert r.tensor_count == len(load_file(fixture_path(name) / "model.safetensors"))


def _ref_stats(w: torch.Tensor) -> dict:
    w = w.to(torch.float64)
    return {"mean": float(w.mean()), "std": float(w.std(unbiased=False)), "absmax": float(w.abs().max())}


def _close(a: dict, b: dict) -> bool:
    return all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) for k in ("mean", "std", "absmax"))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_deep_stats_match_reference(name, fixtures_dir):
    """--deep decodes every fixture through the format modules; its statistics equal the foreign tool's own
    dequantized reference (the decode is bit-exact, so they agree to rounding of the statistics)."""
    fmt, bits, g, sym = FIXTURES[name]
    r = inspect_path(fixture_path(name), deep=True)
    ref = load_file(fixture_path(name) / "reference.safetensors")
    assert _findings(r) == [], r.anomalies
    for m in r.modules:
        key = next(k for k in ref if k.startswith(m.name))
        assert _close(m.stats, _ref_stats(ref[key])), (m.name, m.stats, _ref_stats(ref[key]))
        assert (m.scheme.format, m.scheme.sym, m.scheme.desc_act) == (fmt, sym, False)
    if name.endswith("wordborrow"):
        assert any("whole-word" in a.message and a.severity == "info" for a in r.anomalies)


def test_quantized_activations_are_shown(fixtures_dir):
    """compressed-tensors' own W4A8 file (int4 weights, fp8 inputs): the JSON module and the summary say fp8;
    a weight-only file shows neither."""
    res, code = cli("inspect", str(fixture_path("ct-w4a8/compressed-tensors-w4afp8")), "--json")
    assert code == 0 and {m["activations"] for m in json.loads(res.stdout)["modules"]} == {"fp8"}
    res, _ = cli("inspect", str(fixture_path("ct-w4a8/compressed-tensors-w4afp8")))
    assert "activations     fp8" in res.stdout
    res, _ = cli("inspect", str(fixture_path("compressed-tensors-w4a16-g128")), "--json")
    assert all("activations" not in m for m in json.loads(res.stdout)["modules"])
    res, _ = cli("inspect", str(fixture_path("compressed-tensors-w4a16-g128")))
    assert "activations" not in res.stdout


def test_gguf_fixture(fixtures_dir):
    r = inspect_path(fixture_path(GGUF_FIXTURE), deep=True)
    got = {m.name: (m.scheme.format, m.scheme.bits, m.scheme.group_size, m.scheme.sym, (m.out_features, m.in_features)) for m in r.modules}
    q40, q41, q80 = ("gguf:Q4_0", 4, 32, True), ("gguf:Q4_1", 4, 32, False), ("gguf:Q8_0", 8, 32, True)
    assert got == {"blk.0.attn_q": (*q40, (64, 384)), "blk.0.attn_k": (*q40, (64, 384)),
                   "blk.0.attn_v": (*q40, (64, 384)), "blk.0.attn_output": (*q41, (64, 384)),
                   "blk.0.ffn_up": (*q41, (128, 384)), "blk.0.ffn_down": (*q80, (32, 1536))}
    # a fixture of six tensors, not a model: llama.cpp would refuse it for the missing hyperparameters and
    # tokenizer, and inspect says so
    assert r.container == "gguf" and r.format == "gguf:Q4_0" and [a.message[:45] for a in r.anomalies] == [
        "llama.cpp will not load it: missing hyperpara", "llama.cpp will not load it: no tokenizer (tok"]
    assert r.metadata["general.architecture"] == "bert" and r.metadata["general.file_type"] == 2
    assert r.metadata["qtool.gguf"]["file_type_name"] == "MOSTLY_Q4_0"
    assert r.metadata["qtool.gguf"]["tensor_types"]["Q4_1"] == {"tensors": 2, "bytes": 15360 + 30720, "bpw": 5.0}
    ref = load_file(fixture_path("gguf-q4_0-q4_1-q8_0/reference.safetensors"))
    for m in r.modules:
        assert _close(m.stats, _ref_stats(ref[m.name + ".weight"])), m.name
    assert r.bytes_total == 142592 - 1152  # data section of the file


# --- checkpoints written here ---------------------------------------------------------------------------

def gptq_module(o: int, i: int, bits: int, g: int, zeros: torch.Tensor | None, stored: str, seed: int) -> dict:
    """GPTQ tensors built with the bit-stream packer. zeros: true zeros uint8 [n_groups, O] (None = sym);
    stored: "v1" writes z - 1 per field, "v2" writes z."""
    gen = torch.Generator().manual_seed(seed)
    ng = i // g
    codes = torch.randint(0, 1 << bits, (i, o), generator=gen, dtype=torch.uint8)
    z = zeros if zeros is not None else torch.full((ng, o), 1 << (bits - 1), dtype=torch.uint8)
    zs = ((z.to(torch.int16) - 1) & ((1 << bits) - 1)).to(torch.uint8) if stored == "v1" else z
    return {"qweight": pack_stream(codes, bits, dim=0), "qzeros": pack_stream(zs, bits, dim=1),
            "scales": (torch.rand(ng, o, generator=gen) * 0.01 + 0.001).half(),
            "g_idx": (torch.arange(i, dtype=torch.int32) // g), "bias": torch.zeros(o, dtype=torch.float16)}


def write_gptq(root: Path, stored: str, claim: str | None, sym: bool = True, bits: int = 4, layers: int = 2,
               shards: int = 1, config_name: str = "config.json") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.float16)}
    for layer in range(layers):
        for k, (proj, o, i) in enumerate((("self_attn.q_proj", 64, 64), ("mlp.down_proj", 64, 128))):
            zeros = None
            if not sym:
                zeros = torch.randint(1, 1 << bits, (i // 32, o), generator=torch.Generator().manual_seed(k),
                                      dtype=torch.uint8)
            for s, t in gptq_module(o, i, bits, 32, zeros, stored, seed=layer * 10 + k).items():
                tensors[f"model.layers.{layer}.{proj}.{s}"] = t
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(64, dtype=torch.float16)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        wm = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
            save_file(part, str(root / fn), metadata={"format": "pt"})
            wm.update({n: fn for n in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    if claim is not None:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": False, "sym": sym,
              "checkpoint_format": claim}
        body = {"model_type": "llama", "quantization_config": qc} if config_name == "config.json" else qc
        (root / config_name).write_text(json.dumps(body))
    return root


def test_written_gptq_header_only(tmp_path):
    r = inspect_path(write_gptq(tmp_path / "m", "v2", "gptq_v2"))
    q = [m for m in r.modules if m.quantized]
    assert [(m.name, m.scheme.format, m.scheme.bits, m.scheme.group_size, m.in_features, m.out_features) for m in q] == [
        ("model.layers.0.mlp.down_proj", "gptq_v2", 4, 32, 128, 64),
        ("model.layers.0.self_attn.q_proj", "gptq_v2", 4, 32, 64, 64),
        ("model.layers.1.mlp.down_proj", "gptq_v2", 4, 32, 128, 64),
        ("model.layers.1.self_attn.q_proj", "gptq_v2", 4, 32, 64, 64)]
    dense = [m.name for m in r.modules if not m.quantized]
    assert dense == ["model.embed_tokens"]
    pats = {(p.pattern, p.count, p.format, p.shape) for p in r.patterns()}
    assert ("model.layers.#.mlp.down_proj", 2, "gptq_v2", "64 x 128") in pats
    assert ("model.layers.#.input_layernorm.weight", 2, "F16", "64") in pats
    # bytes: every tensor once; quantized = the four modules (qweight, qzeros, scales, g_idx, bias)
    per = {64: 64 * 64 // 2 + 2 * 64 // 2 + 2 * 64 * 2 + 64 * 4 + 128, 128: 128 * 64 // 2 + 4 * 64 // 2 +
           4 * 64 * 2 + 128 * 4 + 128}
    assert r.quantized_bytes == 2 * (per[64] + per[128])
    assert r.bytes_total == r.quantized_bytes + 100 * 64 * 2 + 2 * 64 * 2
    params = 2 * (64 * 64 + 64 + 128 * 64 + 64) + 100 * 64 + 2 * 64
    assert r.bpw == pytest.approx(8 * r.bytes_total / params)


@pytest.mark.parametrize("stored,claim,bad", [("v2", "gptq", True), ("v1", "gptq_v2", True),
                                              ("v1", "gptq", False), ("v2", "gptq_v2", False)])
def test_mislabelled_v1_v2_found_by_deep(tmp_path, stored, claim, bad):
    root = write_gptq(tmp_path / "m", stored, claim)
    shallow = inspect_path(root)
    assert not shallow.has_errors()  # headers cannot tell v1 from v2
    r = inspect_path(root, deep=True)
    errors = [a for a in r.anomalies if a.severity == "error"]
    if not bad:
        assert errors == [] and {m.scheme.sym for m in r.modules if m.quantized} == {True}
        return
    assert len(errors) == 1 and errors[0].tensor == "model.layers.0.mlp.down_proj"
    if claim == "gptq":
        assert errors[0].message.startswith("config says gptq (v1) but zeros decode to 9 under v1 — it is v2; fix: "
                                            "checkpoint_format: gptq_v2 (4 modules; also ")
    else:
        assert errors[0].message.startswith("config says gptq_v2 but zeros decode to 7 under v2 — it is v1; fix: "
                                            "checkpoint_format: gptq (4 modules; also ")
    # the modules are reported as what the data says, and decode symmetric
    want = "gptq_v2" if stored == "v2" else "gptq"
    assert {(m.scheme.format, m.scheme.sym) for m in r.modules if m.quantized} == {(want, True)}
    # strict CLI exits 1, plain exits 0
    assert cli("inspect", str(root), "--deep")[1] == 0
    assert cli("inspect", str(root), "--deep", "--strict")[1] == 1


def test_no_config_infers_convention_from_data(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", None)
    r = inspect_path(root)
    assert r.format == "gptq" and any("no quantization config" in a.message for a in r.anomalies)
    r = inspect_path(root, deep=True)
    assert r.format == "gptq_v2"
    assert any(a.severity == "info" and "no config: zeros read as 8 under v2" in a.message for a in r.anomalies)


def test_quantize_config_json_and_disagreement(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2", config_name="quantize_config.json")
    r = inspect_path(root)
    assert r.format == "gptq_v2" and r.config_source == "quantize_config.json"
    (root / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq"}}))
    r = inspect_path(root)
    assert r.config_source == "config.json quantization_config" and r.format == "gptq"
    w = [a.message for a in r.anomalies if a.severity == "warning"]
    assert any("checkpoint_format='gptq' but quantize_config.json says 'gptq_v2'" in m for m in w)
    # lm_head too: transformers reads config.json's, GPTQModel quantize_config.json's
    q = json.loads((root / "quantize_config.json").read_text())
    (root / "quantize_config.json").write_text(json.dumps(q | {"lm_head": True}))
    (root / "config.json").write_text(json.dumps({"quantization_config": q | {"lm_head": False}}))
    w = [a.message for a in inspect_path(root).anomalies if a.severity == "warning"]
    assert any("lm_head=False but quantize_config.json says True" in m for m in w), w


def test_asym_and_deep_checks_of_bad_data(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2", sym=False)
    r = inspect_path(root, deep=True)
    assert not r.has_errors() and {m.scheme.sym for m in r.modules if m.quantized} == {False}
    # poison scales and g_idx of one module
    f = root / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.1.mlp.down_proj.scales"][0, 0] = float("nan")
    t["model.layers.1.mlp.down_proj.scales"][1, 0] = 0.0
    t["model.layers.0.self_attn.q_proj.g_idx"][5] = 7   # only 2 groups
    t["model.layers.0.mlp.down_proj.g_idx"][:32] = 1    # group 0 empty
    save_file(t, str(f), metadata={"format": "pt"})
    r = inspect_path(root, deep=True)
    got = {(a.severity, a.tensor, a.message) for a in r.anomalies}
    assert ("error", "model.layers.1.mlp.down_proj", "'scales' has NaN/Inf values") in got
    assert ("warning", "model.layers.1.mlp.down_proj", "'scales' has zero scales (their groups dequantize to 0)") in got
    assert ("error", "model.layers.1.mlp.down_proj", "dequantized weight has NaN/Inf values") in got
    assert ("error", "model.layers.0.self_attn.q_proj", "'g_idx' values span [0, 7] but there are 2 groups") in got
    assert ("error", "model.layers.0.mlp.down_proj", "'g_idx' leaves 1 of 4 groups without input channels") in got
    assert ("warning", "model.layers.0.mlp.down_proj", "'g_idx' group sizes range 0..64, not 32 per group") in got
    bad = next(m for m in r.modules if m.name == "model.layers.1.mlp.down_proj")
    assert math.isfinite(bad.stats["std"])  # statistics over the finite values


# --- broken checkpoints ----------------------------------------------------------------------------------

def test_truncated_safetensors(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2")
    f = root / "model.safetensors"
    raw = f.read_bytes()
    cut_at = len(raw) - 60
    f.write_bytes(raw[:cut_at])
    r = inspect_path(root, deep=True)
    errs = [a.message for a in r.anomalies if a.severity == "error"]
    n = r.tensor_count
    cut = {t.name for t in r.tensors if not t.complete}
    assert cut and n == len(load_file_names(raw))
    assert f"model.safetensors: truncated: {cut_at} of {len(raw)} bytes; {n - len(cut)} of {n} tensors complete" \
        in errs
    assert any(m.startswith("data truncated: module not checked") for m in errs)
    # every module whose tensors are all complete was still decoded and checked
    for m in r.modules:
        assert (m.stats is not None) == (not cut & set(m.tensor_names)), m.name
    assert sum(1 for m in r.modules if m.stats) >= 3


def load_file_names(raw: bytes) -> list[str]:
    import struct

    n = struct.unpack("<Q", raw[:8])[0]
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]


def test_missing_shard_and_bad_index(tmp_path):
    root = write_gptq(tmp_path / "m", "v2", "gptq_v2", shards=3)
    r = inspect_path(root)
    assert not r.has_errors() and len(r.files) == 3 and r.format == "gptq_v2"
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    (root / "model-00002-of-00003.safetensors").unlink()
    n2 = sum(1 for v in idx["weight_map"].values() if v == "model-00002-of-00003.safetensors")
    r = inspect_path(root / "model.safetensors.index.json")
    assert [a.message for a in r.anomalies if a.severity == "error"][0] == (
        f"shard 'model-00002-of-00003.safetensors' named by the index is missing ({n2} tensors unavailable); "
        "fix: download the missing shard")
    assert len(r.files) == 2
    # an index that names a tensor no shard holds
    root2 = write_gptq(tmp_path / "n", "v2", "gptq_v2", shards=2)
    idx = json.loads((root2 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.9.mlp.down_proj.qweight"] = "model-00001-of-00002.safetensors"
    (root2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = inspect_path(root2)
    assert [(a.severity, a.tensor) for a in r.anomalies] == [("error", "model.layers.9.mlp.down_proj.qweight")]
    assert "does not hold it" in r.anomalies[0].message
    res, code = cli("inspect", str(root2), "--strict")
    assert code == 1 and "does not hold it" in res.stdout


def test_truncated_and_split_gguf(tmp_path, fixtures_dir):
    src = fixture_path(GGUF_FIXTURE)
    raw = src.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(raw[:100000])
    r = inspect_path(p, deep=True)
    # tensors in file order: q, q.bias, k, k.bias, v, v.bias, output ... ; data ends at 1152 + offsets
    from qtool.io.gguf_reader import read_gguf_header

    h = read_gguf_header(src)
    k = sum(1 for t in h.tensors if t.start + t.nbytes <= 100000)
    first = next(t.name for t in h.tensors if t.start + t.nbytes > 100000)
    assert (("error", None, f"cut.gguf: truncated: 100000 of {len(raw)} bytes; {k} of 12 tensors complete; "
                            f"first incomplete tensor '{first}'")
            in {(a.severity, a.tensor, a.message) for a in r.anomalies})
    assert sum(1 for m in r.modules if m.stats) == sum(1 for t in h.tensors if t.name.endswith(".weight")
                                                        and t.start + t.nbytes <= 100000)
    res, code = cli("inspect", str(p), "--json", "--strict")
    assert code == 1 and json.loads(res.stdout)["container"] == "gguf"


def test_split_gguf_missing_member(tmp_path):
    from tests.test_gguf_reader import TENSORS, write_gguf

    write_gguf(tmp_path / "model.gguf", split_max_tensors=2)
    first = tmp_path / "model-00001-of-00003.gguf"
    r = inspect_path(first, deep=True)
    assert not_loaders(r.anomalies) == [] and len(r.files) == 3 and len(r.modules) == 4
    got = {m.name: (m.scheme.format, m.scheme.bits, m.scheme.group_size, m.scheme.sym) for m in r.modules}
    assert got == {"blk.0.attn_q": ("gguf:Q4_0", 4, 32, True), "blk.0.attn_k": ("gguf:Q4_1", 4, 32, False),
                   "blk.0.ffn_up": ("gguf:Q8_0", 8, 32, True), "blk.0.ffn_down": ("gguf:Q6_K", 6, 256, True)}
    assert r.tensor_count == len(TENSORS)
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    r = inspect_path(tmp_path)  # the directory names the set too
    assert [a.message for a in not_loaders(r.anomalies)] == ["split file model-00002-of-00003.gguf is missing; fix: download "
                                                "it next to the others"]
    assert r.tensor_count == 3


def test_gguf_deep_matches_gguf_dequantize(tmp_path):
    import numpy as np
    from gguf.quants import dequantize

    from tests.test_gguf_reader import TENSORS, write_gguf

    src = write_gguf(tmp_path / "m.gguf")
    r = inspect_path(tmp_path / "m.gguf", deep=True)
    for name, qtype, _shape in TENSORS:
        if qtype.name == "F32":
            continue
        w = dequantize(src[name], qtype).astype(np.float64)
        m = next(m for m in r.modules if m.name + ".weight" == name)
        assert _close(m.stats, {"mean": w.mean(), "std": w.std(), "absmax": np.abs(w).max()}), name


# --- JSON schema and CLI -----------------------------------------------------------------------------------

def _check_schema(d: dict) -> None:
    assert tuple(d) == REPORT_KEYS
    assert isinstance(d["path"], str) and d["container"] in ("safetensors", "gguf")
    assert isinstance(d["format"], str) and isinstance(d["tensor_count"], int)
    assert isinstance(d["bytes_total"], int) and (d["bpw"] is None or isinstance(d["bpw"], float))
    assert isinstance(d["metadata"], dict)
    for m in d["modules"]:
        assert tuple(k for k in m if k != "stats") == MODULE_KEYS
        assert isinstance(m["name"], str) and isinstance(m["bytes"], int)
        for k in ("bits", "group_size", "in_features", "out_features"):
            assert m[k] is None or isinstance(m[k], int)
        for k in ("sym", "desc_act"):
            assert m[k] is None or isinstance(m[k], bool)
    for a in d["anomalies"]:
        assert tuple(a) == ("severity", "tensor", "message") and a["severity"] in ("error", "warning", "info")


def test_json_schema_cli(tmp_path, fixtures_dir):
    for path in (fixture_path("gptqmodel-gptq-v1-4bit-g128-sym"), fixture_path(GGUF_FIXTURE),
                 write_gptq(tmp_path / "m", "v1", None)):
        res = runner.invoke(app, ["inspect", str(path), "--json"])
        assert res.exit_code == 0, res.output
        d = json.loads(res.stdout)
        _check_schema(d)
        assert d["path"] == str(path)
    d = json.loads(runner.invoke(app, ["inspect", str(fixture_path("gptqmodel-gptq-v1-4bit-g128-sym")),
                                       "--json"]).stdout)
    assert d["format"] == "gptq" and d["tensor_count"] == 30 and d["bytes_total"] == 116800
    assert d["metadata"]["checkpoint_format"] == "gptq"
    assert [(a["severity"], a["message"][:len(REF_NOTE)]) for a in d["anomalies"]] == [("warning", REF_NOTE)]
    assert [m["name"] for m in d["modules"]] == sorted(f"encoder.layer.0.{k}" for k in SHAPES)
    assert d["modules"][2] == {"name": "encoder.layer.0.attention.self.query", "format": "gptq", "bits": 4,
                               "group_size": 128, "sym": True, "desc_act": False, "in_features": 384,
                               "out_features": 64, "bytes": 12288 + 96 + 384 + 1536 + 128}
    d = json.loads(runner.invoke(app, ["inspect", str(fixture_path(GGUF_FIXTURE)), "--json", "--tensors",
                                       "--deep"]).stdout)
    assert len(d["tensors"]) == 12 and set(d["tensors"][0]) == {"name", "dtype", "shape", "bytes", "file",
                                                                "complete"}
    assert d["tensors"][0]["shape"] == [384, 64] and set(d["modules"][0]["stats"]) == {"mean", "std", "absmax"}


def test_cli_human_output_and_sanitizing(tmp_path, fixtures_dir):
    res = runner.invoke(app, ["inspect", str(fixture_path("gptqmodel-awq-gemm-4bit-g128")), "--tensors"])
    assert res.exit_code == 0
    out = res.stdout
    for s in ("container", "safetensors (1 file)", "format", "awq", "group size", "128",
              "encoder.layer.#.intermediate.dense", "128 x 384", REF_NOTE,
              "encoder.layer.0.output.dense.qweight"):
        assert s in out, s
    # a tensor name with a terminal escape is printed escaped, never raw
    root = tmp_path / "evil"
    root.mkdir()
    save_file({"a\x1b[31m.weight": torch.zeros(4, 4, dtype=torch.float16)}, str(root / "model.safetensors"))
    res = runner.invoke(app, ["inspect", str(root), "--tensors"])
    assert res.exit_code == 0 and "\x1b[31m" not in res.stdout and "\\x1b" in res.stdout
    # quiet prints nothing; an unreadable path is a usage error (exit 2 through main)
    assert runner.invoke(app, ["inspect", str(root), "-q"]).stdout == ""


def test_cli_config_file(tmp_path, fixtures_dir):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("tensors: true\ndeep: true\n")
    res = runner.invoke(app, ["inspect", str(fixture_path("compressed-tensors-w4a16-g128")), "--config", str(cfg),
                              "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["format"] == "ct" and len(d["tensors"]) == 6 * 4 and "stats" in d["modules"][0]


def test_not_a_checkpoint(tmp_path):
    from qtool.errors import InputError

    with pytest.raises(InputError):
        inspect_path(tmp_path / "nope")
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" * 10)
    with pytest.raises(InputError, match="not a GGUF file"):
        inspect_path(p)


def test_qtool_marlin_checkpoint(tmp_path):
    """A Marlin file written with the marlin format module and its metadata contract: detected as marlin with
    the unpadded shape and act-order; --deep decodes it back to the packed Plain's statistics."""
    from qtool.formats import Plain, dequantize, get_format
    from qtool.formats import marlin as mf

    gen = torch.Generator().manual_seed(3)
    o, i, g = 96, 192, 64
    plain = Plain(torch.randint(0, 16, (o, i), generator=gen, dtype=torch.uint8),
                  (torch.rand(o, i // g, generator=gen) * 0.01 + 0.001).half(), None,
                  (torch.randperm(i, generator=gen) // g).to(torch.int32), 4, g)
    tensors = {f"layer.q.{k}": v for k, v in get_format("marlin").pack(plain).items()}
    root = tmp_path / "marlin"
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"),
              metadata=mf.contract(mf.summarize({"layer.q": mf.module_meta(plain)})))
    r = inspect_path(root, deep=True)
    assert [(m.name, m.scheme.format, m.scheme.bits, m.scheme.group_size, m.scheme.sym, m.scheme.desc_act,
             m.in_features, m.out_features) for m in r.modules] == [("layer.q", "marlin", 4, 64, True, True, i, o)]
    assert r.config_source is None and not [a for a in not_loaders(r.anomalies) if a.severity != "info"], r.anomalies
    assert _close(r.modules[0].stats, _ref_stats(dequantize(plain)))


@pytest.mark.parametrize("to,sym", [("gptq", True), ("gptq_v2", False), ("gptq_p", False), ("awq", False)])
def test_checkpoints_packed_by_qtool(tmp_path, to, sym):
    """`qtool pack` output is recognised as what was asked for, and --deep decodes it to weights close to
    the dense source."""
    gen = torch.Generator().manual_seed(1)
    src = tmp_path / "dense"
    src.mkdir()
    dense = {f"model.layers.{k}.mlp.up_proj.weight": torch.randn(64, 256, generator=gen).half() for k in range(2)}
    dense["model.norm.weight"] = torch.ones(256, dtype=torch.float16)
    save_file(dense, str(src / "model.safetensors"))
    out = tmp_path / to
    res = runner.invoke(app, ["pack", str(src), "-o", str(out), "--to", to, "--bits", "4", "--group-size", "64",
                              "--sym" if sym else "--asym", "-q"])
    assert res.exit_code == 0, res.output
    r = inspect_path(out, deep=True)
    assert r.format == to and not [a for a in not_loaders(r.anomalies) if a.severity != "info"], r.anomalies
    for m in r.modules:
        assert (m.scheme.format, m.scheme.bits, m.scheme.group_size, m.in_features, m.out_features) == (to, 4, 64, 256, 64)
        assert m.scheme.desc_act is False and m.scheme.sym is sym
        ref = _ref_stats(dense[m.name + ".weight"])
        assert abs(m.stats["std"] - ref["std"]) < 0.05 * ref["std"]
        assert abs(m.stats["mean"] - ref["mean"]) < 0.02


def test_unreadable_safetensors_is_an_input_error(tmp_path):
    from qtool.errors import InputError

    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(InputError, match="nothing readable: bad.safetensors: unreadable header"):
        inspect_path(p)
    from qtool.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["inspect", str(p)])
    assert e.value.code == 2


def not_loaders(anomalies):
    """The anomalies other than qtool.inspect.loadable's warnings (synthetic files carry no tokenizer or
    model_type)."""
    return [a for a in anomalies if "will not load it" not in a.message]
