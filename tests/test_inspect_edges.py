"""`qtool inspect` at the edges: what it does not read is named, what it reads is checked whole (biases, norms,
loose tensors), JSON stays strict JSON, and files the safetensors library refuses are refused."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import InputError
from qtool.inspect import inspect_path
from qtool.io.safetensors_header import read_header
from tests.conftest import write_llama
from tests.test_fp8_commands import qtool


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as strict parsers (JavaScript, jq, Go) do."""
    def bad(c):
        raise ValueError(f"non-JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def _model(d: Path, **extra: torch.Tensor) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    t = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).half(),
         "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g).half(),
         "model.norm.weight": torch.ones(64).half(), **extra}
    return write_llama(d, t, "float16")


def _messages(r) -> list[tuple[str, str | None, str]]:
    return [(a.severity, a.tensor, a.message) for a in r.anomalies]


def test_unread_files_and_folders_are_named(tmp_path):
    d = _model(tmp_path / "m")
    save_file({"x": torch.zeros(2)}, d / "extra.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    (d / "2_Dense").mkdir()
    save_file({"linear.weight": torch.zeros(2, 2)}, d / "2_Dense" / "model.safetensors")
    (d / "1_Pooling").mkdir()  # no weights: nothing to say
    (d / "1_Pooling" / "config.json").write_text("{}")
    msgs = [m for s, _, m in _messages(inspect_path(d)) if s == "warning"]
    assert any(m.startswith("extra.safetensors not read") for m in msgs), msgs
    assert any(m.startswith("pytorch_model.bin not read (a pickle, never loaded)") for m in msgs), msgs
    assert any(m.startswith("sub-folder '2_Dense' holds weights (model.safetensors)") for m in msgs), msgs
    assert not any("1_Pooling" in m for m in msgs)
    # a file the user names is the whole request: nothing beside it is reported
    assert not any("not read" in m for _, _, m in _messages(inspect_path(d / "model.safetensors")))


def test_shards_outside_the_index_and_safetensors_beside_gguf(tmp_path):
    d = _model(tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    save_file({"x": torch.zeros(2)}, d / "model-00002-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.self_attn.q_proj.bias": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00001-of-00002.safetensors"}}))
    msgs = [m for _, _, m in _messages(inspect_path(d))]
    assert any(m.startswith("model-00002-of-00002.safetensors not read") for m in msgs), msgs

    from tests.test_gguf_reader import write_gguf

    g = tmp_path / "g"
    g.mkdir()
    write_gguf(g / "m.gguf")
    save_file({"x": torch.zeros(2)}, g / "weights.safetensors")
    r = inspect_path(g)
    assert r.container == "gguf"
    assert any(m.startswith("weights.safetensors not read") for _, _, m in _messages(r))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_config_fifo_and_device_do_not_block(tmp_path):
    d = _model(tmp_path / "m")
    os.symlink("/dev/zero", d / "modules.json")
    r = inspect_path(d)
    assert any(m.startswith("modules.json not read: is not a regular file") for _, _, m in _messages(r))
    (d / "modules.json").unlink()
    os.mkfifo(d / "modules.json")  # a read would block for ever
    r = inspect_path(d)
    assert any(m.startswith("modules.json not read") for _, _, m in _messages(r))


def test_deep_checks_biases_norms_and_loose_tensors(tmp_path):
    d = _model(tmp_path / "m", **{"extra_scale": torch.tensor([1.0, float("inf")])})
    from safetensors.torch import load_file

    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.bias"][3] = float("nan")
    t["model.norm.weight"][:] = float("nan")
    save_file(t, d / "model.safetensors")
    header_only = inspect_path(d)
    assert not any("NaN" in m for _, _, m in _messages(header_only))
    got = [(s, n, m) for s, n, m in _messages(inspect_path(d, deep=True)) if m.startswith("has NaN/Inf values")]
    assert len(got) == 1 and got[0][0] == "error", got
    named = {got[0][1], *(x.strip("'") for x in got[0][2].split("also ")[1].rstrip(")").split(", "))}
    assert named == {"model.layers.0.self_attn.q_proj.bias", "model.norm.weight", "extra_scale"}
    code, out = qtool("inspect", d, "--deep", "--strict", "-q")
    assert code == 1


def _gguf(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    return _gguf_kv(path, {"llama.block_count": (1, "UINT32")}, tensors)


def test_deep_gguf_checks_norms_and_reads_the_first_duplicate(tmp_path):
    q = np.ones((8, 32), dtype=np.float32)
    p = _gguf(tmp_path / "nan.gguf", {"blk.0.attn_q.weight": q, "blk.0.attn_norm.weight": np.full(32, np.nan,
                                                                                                 dtype=np.float32)})
    assert ("error", "blk.0.attn_norm.weight", "has NaN/Inf values") in _messages(inspect_path(p, deep=True))
    p = _gguf(tmp_path / "ok.gguf", {"blk.0.attn_q.weight": q, "blk.0.attn_norm.weight": np.ones(32, np.float32)})
    assert not [a for a in inspect_path(p, deep=True).anomalies if a.severity == "error"]

    # a second entry of one name (attn_k renamed in place): the header report ignores it, and --deep reads
    # the first too, so the NaN data of the second is not charged to the module
    p = _gguf(tmp_path / "two.gguf", {"blk.0.attn_q.weight": q, "blk.0.attn_k.weight": np.full_like(q, np.nan)})
    raw = p.read_bytes()
    assert raw.count(b"blk.0.attn_k.weight") == 1
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(raw.replace(b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"))
    msgs = _messages(inspect_path(dup, deep=True))
    assert any("appears twice" in m for _, _, m in msgs), msgs
    assert not any("NaN" in m for _, _, m in msgs), msgs


def test_json_is_strict_json(tmp_path):
    p = tmp_path / "zero.safetensors"
    save_file({"a.weight": torch.zeros(0, 4)}, p)
    code, out = qtool("inspect", p, "--deep", "--json")
    d = _strict_json(out)
    assert code == 0 and "stats" not in d["modules"][0]
    assert any(a["message"] == "weight has no elements (a dimension is 0)" for a in d["anomalies"])

    import gguf

    g = tmp_path / "inf.gguf"
    w = gguf.GGUFWriter(str(g), "llama")
    w.add_float32("llama.rope.freq_base", float("inf"))
    w.add_tensor("blk.0.attn_q.weight", np.ones((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, out = qtool("inspect", g, "--json")
    assert _strict_json(out)["metadata"]["llama.rope.freq_base"] == "inf"

    from qtool.cli.common import _plain

    assert _plain({"a": [1.5, math.nan, -math.inf, (2, None)], 3: Path("x")}) == \
        {"a": [1.5, "nan", "-inf", [2, None]], "3": "x"}


def _raw_safetensors(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_header_refuses_what_the_safetensors_library_refuses(tmp_path):
    dup = _raw_safetensors(tmp_path / "dup.safetensors",
                           b'{"a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
                           b'"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}', bytes(20))
    with pytest.raises(InputError, match="names this entry twice") as e:
        read_header(dup)
    assert e.value.tensor == "a.weight"
    gap = _raw_safetensors(tmp_path / "gap.safetensors",
                           b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', bytes(16))
    with pytest.raises(InputError, match="8 bytes before this tensor's data belong to no tensor"):
        read_header(gap)
    tail = _raw_safetensors(tmp_path / "tail.safetensors",
                            b'{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}', bytes(56))
    with pytest.raises(InputError, match="40 bytes after the last tensor's data"):
        read_header(tail)
    ok = _raw_safetensors(tmp_path / "ok.safetensors",
                          b'{"b":{"dtype":"F32","shape":[0],"data_offsets":[16,16]},'
                          b'"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}', bytes(16))
    assert set(read_header(ok)[0]) == {"a", "b"}
    for p in (dup, gap, tail):
        code, out = qtool("inspect", p)
        assert code == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out


@pytest.mark.parametrize("bs", [[0, 128], [-64, 64], "128x128", [128], [True, 128]])
def test_bad_weight_block_size_is_an_error(tmp_path, bs):
    d = tmp_path / "dense"
    _model(d)
    code, out = qtool("pack", d, "-o", tmp_path / "fp8", "--to", "fp8", "--block", "32x32", "-q")
    assert code == 0, out
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = bs
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    r = inspect_path(tmp_path / "fp8")
    assert any(s == "error" and "'weight_block_size' must be two positive integers" in m
               for s, _, m in _messages(r)), _messages(r)


def test_per_tensor_scales_are_not_called_per_channel(tmp_path):
    d = tmp_path / "dense"
    _model(d)
    for strategy, said in (("tensor", "per tensor"), ("channel", "per channel")):
        out_dir = tmp_path / strategy
        code, out = qtool("pack", d, "-o", out_dir, "--to", "ct_fp8", "--strategy", strategy, "-q")
        assert code == 0, out
        code, out = qtool("inspect", out_dir)
        assert code == 0 and f"-1 ({said})" in out, out
        code, out = qtool("inspect", out_dir, "--json")
        assert {m.get("weight_scale") for m in json.loads(out)["modules"] if m["format"] != "dense"} == {strategy}


def test_gguf_header_messages_do_not_contradict_the_file(tmp_path):
    from qtool.io.gguf_reader import read_gguf_header
    from tests.test_gguf_reader import write_gguf

    write_gguf(tmp_path / "m.gguf")
    raw = bytearray((tmp_path / "m.gguf").read_bytes())
    raw[16:24] = struct.pack("<Q", 999_999)  # kv count: far more keys than the file holds
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(raw))
    h = read_gguf_header(p)
    msg = h.truncation_message()
    assert msg.startswith(f"header unreadable from byte {h.header_end} of the {len(raw)}-byte file"), msg
    assert "of at least" not in msg


@pytest.mark.parametrize("dtype,nbytes", [("F4", 32), ("F8_E8M0", 64), ("F8_E4M3", 64)])
def test_packed_weight_without_its_scales_is_unknown_not_empty(tmp_path, dtype, nbytes):
    """An FP4/FP8 weight that no layout claims (its scales are missing) is an unknown layout (an error), never
    a checkpoint with nothing in it."""
    p = _raw_safetensors(tmp_path / "w.safetensors",
                         json.dumps({"lin.weight": {"dtype": dtype, "shape": [8, 8],
                                                    "data_offsets": [0, nbytes]}}).encode(), bytes(nbytes))
    r = inspect_path(p)
    assert r.format == "unknown" and [m.scheme.format for m in r.modules] == ["unknown"]
    want = "FP8 weight without weight_scale" if dtype == "F8_E4M3" else "unknown quantized layout"
    assert any(s == "error" and m.startswith(want) for s, _, m in _messages(r)), _messages(r)


def test_a_normalize_module_needs_no_folder(tmp_path):
    """sentence-transformers' Normalize reads no file (all-MiniLM-L6-v2 ships no 2_Normalize/); a Pooling
    module without its folder is still a loader failure."""
    d = _model(tmp_path / "m")
    (d / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    msgs = [m for _, _, m in _messages(inspect_path(d))]
    assert any("modules.json names '1_Pooling'" in m for m in msgs)
    assert not any("2_Normalize" in m for m in msgs), msgs
    # sentence-transformers 6 names the module by its new path
    (d / "modules.json").write_text(json.dumps([
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}]))
    assert not any("2_Normalize" in m for _, _, m in _messages(inspect_path(d)))


def test_k_quant_group_is_said_to_be_a_super_block(tmp_path):
    """A K-quant's group is the 256-weight super-block (where engines split rows), with finer scales inside:
    the summary says both, so Q4_K does not read as coarser than a GPTQ g128 file."""
    import gguf

    Q = gguf.GGMLQuantizationType
    q4k = np.random.default_rng(0).integers(0, 255, (8, 144), dtype=np.uint8)  # one Q4_K block per row
    q8 = gguf.quants.quantize(np.ones((8, 32), np.float32), Q.Q8_0)
    for name, blocks, qtype, said in (("k", q4k, Q.Q4_K, "256 (super-blocks; a sub-block scale per 32 weights "
                                                          "inside)"), ("q8", q8, Q.Q8_0, None)):
        path = tmp_path / f"{name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=qtype)
        for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
            step()
        code, out = qtool("inspect", path)
        line = next(x for x in out.splitlines() if "group size" in x)
        assert code == 0 and (said in line if said else line.split()[-1] == "32"), line


def test_deep_reads_each_module_against_its_dynamic_override(tmp_path):
    """GPTQModel's `dynamic` makes one module asymmetric with act-order in a sym, no-act-order checkpoint: deep
    checks it against its own claims (no 'config says sym' error), and a module the override does not name
    still gets the file-level claims."""
    from qtool.formats import get_format
    from tests.test_formats_gptq import random_plain

    fmt = get_format("gptq_v2")
    t = {}
    for name, sym, act in (("up_proj", True, False), ("down_proj", False, True), ("gate_proj", False, False)):
        for k, v in fmt.pack(random_plain(1, 4, 64, 256, 128, sym, act)).items():
            t[f"model.layers.0.mlp.{name}.{k}"] = v
    save_file(t, str(tmp_path / "model.safetensors"))
    q = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq_v2", "dynamic": {r"+:^model\.layers\.0\.mlp\.down_proj$": {"sym": False,
                                                                                              "desc_act": True}}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": q}))
    from qtool.inspect.core import inspect_path

    r = inspect_path(tmp_path, deep=True)
    said = [(a.tensor, a.message) for a in r.anomalies if a.severity in ("error", "warning")]
    assert not [s for s in said if s[0] == "model.layers.0.mlp.down_proj"], said
    assert any(s[0] == "model.layers.0.mlp.gate_proj" and "config says sym" in s[1] for s in said), said


def _gptq_with_head(d: Path, head: str, **config) -> Path:
    """A GPTQ checkpoint whose LM head is `head` ("quantized" or "dense"), with quantization_config `config`
    over a 4-bit g64 base that leaves out "lm_head" unless `config` gives it."""
    from qtool.formats import get_format
    from tests.test_formats_gptq import random_plain

    d.mkdir(parents=True, exist_ok=True)
    fmt = get_format("gptq")
    t = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in fmt.pack(random_plain(0, 4, 64, 128, 64, True, False)).items()}
    if head == "quantized":
        t |= {f"lm_head.{k}": v for k, v in fmt.pack(random_plain(1, 4, 96, 128, 64, True, False)).items()}
    else:
        t["lm_head.weight"] = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)).half()
    save_file(t, str(d / "model.safetensors"))
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", **config}
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return d


@pytest.mark.parametrize("head,config,said", [
    ("quantized", {"lm_head": False}, 'says "lm_head": false but the LM head lm_head is quantized (gptq)'),
    ("quantized", {}, 'has no "lm_head" key (loaders default it to false) but the LM head lm_head is quantized'),
    ("dense", {"lm_head": True}, 'says "lm_head": true but the LM head lm_head is dense'),
    ("quantized", {"lm_head": True}, None),
    ("dense", {"lm_head": False}, None),
    ("dense", {}, None),
    # a GPTQModel "-:" exclusion keeps the head dense whatever the flag says
    ("dense", {"lm_head": True, "dynamic": {r"-:^lm_head$": {}}}, None),
])
def test_lm_head_flag_against_the_head_the_file_holds(tmp_path, head, config, said):
    """vLLM and GPTQModel build the LM head packed only under "lm_head": true: a flag the tensors contradict is
    an error naming the module, the key and the fix; a flag they agree with says nothing."""
    r = inspect_path(_gptq_with_head(tmp_path / "m", head, **config))
    found = [(s, t, m) for s, t, m in _messages(r) if "lm_head" in m]
    if said is None:
        assert found == [], found
        return
    assert len(found) == 1 and found[0][:2] == ("error", "lm_head"), found
    msg = found[0][2]
    assert msg.startswith("config.json quantization_config " + said), msg
    want = "true" if head == "quantized" else "false"
    assert f'fix: set "lm_head": {want} in config.json quantization_config' in msg, msg
    code, out = qtool("inspect", tmp_path / "m", "--strict")
    assert code == 1 and "lm_head" in out and f'"lm_head": {want}' in out, out


def test_lm_head_flag_that_is_not_a_boolean_is_said(tmp_path):
    r = inspect_path(_gptq_with_head(tmp_path / "m", "quantized", lm_head="false"))
    found = [(s, t, m) for s, t, m in _messages(r) if "lm_head" in m]
    assert len(found) == 1 and found[0][0] == "warning" and "not true or false" in found[0][2], found


def _gguf_kv(path: Path, kv: dict, tensors: dict[str, np.ndarray] | None = None, arch: str = "llama") -> Path:
    """A GGUF written by the gguf package whose listed keys ({key: (value, GGUFValueType name)}) replace the
    writer's own."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, (v, t) in kv.items():
        w.kv_data[0].pop(k, None)
        w.add_key_value(k, v, gguf.GGUFValueType[t])
    for name, x in (tensors or {"blk.0.attn_q.weight": np.ones((4, 32), np.float32)}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("key,value,vtype,says", [
    ("llama.block_count", "one", "STRING", "llama.block_count is STRING ('one'), expected UINT32"),
    ("llama.context_length", 4096, "UINT64", "llama.context_length is UINT64 (4096), expected UINT32"),
    ("tokenizer.ggml.model", 5, "UINT32", "tokenizer.ggml.model is UINT32 (5), expected STRING"),
    ("split.count", "3", "STRING", "split.count is STRING ('3'), expected UINT16"),
    ("general.architecture", 7, "UINT32", "general.architecture is UINT32 (7), expected STRING"),
])
def test_a_key_of_the_wrong_type_is_named(tmp_path, key, value, vtype, says):
    """llama.cpp checks each key's stored type exactly; a present key of the wrong type is not "missing"."""
    msgs = [m for _, _, m in _messages(inspect_path(_gguf_kv(tmp_path / "k.gguf", {key: (value, vtype)})))]
    assert any(says in m and m.startswith("llama.cpp will not load it") for m in msgs), msgs
    assert not any("has no general.architecture" in m for m in msgs), msgs


def test_a_header_cut_inside_the_metadata_claims_no_key_is_missing(tmp_path):
    from tests.test_gguf_reader import write_gguf

    write_gguf(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "m.gguf").read_bytes()[:60])  # inside general.architecture's record
    msgs = [m for _, _, m in _messages(inspect_path(cut))]
    assert any("header unreadable from byte" in m for m in msgs), msgs
    assert not any("llama.cpp will not load it" in m for m in msgs), msgs


def test_an_unknown_gguf_type_is_named_and_its_size_is_not_taken_as_zero(tmp_path):
    from tests.attacks.generate_corpus import T_Q4_0, gguf_bytes, kv_str, q4_0_rows, tensor_info

    p = tmp_path / "u.gguf"
    p.write_bytes(gguf_bytes([kv_str("general.architecture", "llama")],
                             [tensor_info("blk.0.attn_q.weight", (64, 32), 9999, 0),
                              tensor_info("blk.0.attn_k.weight", (64, 32), T_Q4_0, 1152)],
                             q4_0_rows(32, 64, 1) + q4_0_rows(32, 64, 2)))
    r = inspect_path(p)
    m = {x.name: x for x in r.modules}["blk.0.attn_q"]
    assert m.scheme.format == "gguf:UNKNOWN_9999" and m.scheme.sym is None and m.scheme.desc_act is None
    d = r.to_dict(tensors=True)
    assert d["bpw"] is None and r.quantized_bpw is None
    assert {t["name"]: t["bytes"] for t in d["tensors"]} == {"blk.0.attn_q.weight": None,
                                                            "blk.0.attn_k.weight": 1152}
    assert d["metadata"]["qtool.gguf"]["tensor_types"]["UNKNOWN_9999"]["bytes"] is None
    assert ("error", "blk.0.attn_q.weight", "unknown tensor type id 9999") in _messages(r)
    code, out = qtool("inspect", p, "--tensors")
    assert code == 0 and "1 tensor of unknown size not counted" in out and "0.000" not in out, out


def test_a_gguf_named_safetensors_is_read_and_the_name_is_flagged(tmp_path):
    p = _gguf_kv(tmp_path / "model.safetensors", {})
    r = inspect_path(p)
    assert r.container == "gguf"
    assert any(a.severity == "warning" and "is a GGUF file named '.safetensors'" in a.message for a in r.anomalies)
    code, out = qtool("inspect", _gguf_kv(tmp_path / "x.gguf", {}), "--json")
    assert not any("GGUF file named" in a["message"] for a in json.loads(out)["anomalies"])

    st = tmp_path / "st.gguf"
    save_file({"a.weight": torch.ones(4, 4)}, st)
    code, out = qtool("inspect", st)
    assert code == 2 and "holds a safetensors header" in out and "rename it to .safetensors" in out, out
    assert len(out.strip().splitlines()) == 1


def test_split_members_out_of_place_or_beside_the_set_are_named(tmp_path):
    from tests.test_gguf_reader import _split3

    files = _split3(tmp_path)
    assert not [m for s, _, m in _messages(inspect_path(files[0])) if s == "error" or "m-0000" in m]
    stray = tmp_path / "m-00004-of-00003.gguf"
    stray.write_bytes(files[0].read_bytes())
    want = ("warning", None, "m-00004-of-00003.gguf beside the 3-file set is not part of it (not read); fix: remove "
                             "it, or re-download the set if the split changed")
    assert want in _messages(inspect_path(files[1]))
    msgs = _messages(inspect_path(tmp_path))  # once, not again as an unread file of the directory
    assert want in msgs and sum("m-00004-of-00003.gguf" in m for _, _, m in msgs) == 1, msgs
    stray.unlink()

    # files 2 and 3 swapped by name: llama.cpp refuses the set ("invalid split file idx")
    tmp = files[1].with_name("tmp")
    files[1].rename(tmp)
    files[2].rename(files[1])
    tmp.rename(files[2])
    errs = [m for s, _, m in _messages(inspect_path(files[0])) if s == "error"]
    assert errs == ["m-00002-of-00003.gguf holds split.no 2, the header of file 3, but is named as file 2: llama.cpp "
                    "refuses the set (\"invalid split file idx\"); fix: restore the original file names or "
                    "re-download the set",
                    "m-00003-of-00003.gguf holds split.no 1, the header of file 2, but is named as file 3: llama.cpp "
                    "refuses the set (\"invalid split file idx\"); fix: restore the original file names or "
                    "re-download the set"], errs


def test_float64_weights_past_float32_range_are_finite(tmp_path):
    p = tmp_path / "f64.safetensors"
    save_file({"l.weight": torch.tensor([[1e300, -1e300] * 4] * 4, dtype=torch.float64)}, p)
    code, out = qtool("inspect", p, "--deep", "--json", "--strict")
    d = _strict_json(out)
    assert code == 0 and not d["anomalies"], d["anomalies"]
    assert d["modules"][0]["stats"] == {"mean": 0.0, "std": 1e300, "absmax": 1e300}

    g = _gguf_kv(tmp_path / "f64.gguf", {}, {"blk.0.attn_q.weight": np.full((4, 32), 1e308),
                                             "blk.0.attn_norm.weight": np.full(32, 1e300)})
    code, out = qtool("inspect", g, "--deep", "--json")
    d = _strict_json(out)
    assert d["modules"][0]["stats"] == {"mean": 1e308, "std": 0.0, "absmax": 1e308}
    assert not [a for a in d["anomalies"] if "NaN" in a["message"] or "unavailable" in a["message"]], d["anomalies"]


def test_a_checkpoint_without_tensors_is_not_called_clean(tmp_path):
    p = tmp_path / "none.safetensors"
    save_file({}, p)
    assert ("warning", None, "the checkpoint holds no tensors: there are no weights to describe or check; fix: "
                             "point at the model's weight files") in _messages(inspect_path(p))
    code, out = qtool("inspect", p)
    assert code == 0 and "no anomalies" not in out
