"""Layouts qtool must never call "dense, no anomalies": each fixture is a small safetensors file built here
from the layout's public facts (tensor names, dtypes, shapes), then inspected end to end. A layout qtool
knows is named with its true in/out features; anything else quantized-looking is an "unknown quantized
layout" error, under every mode including --strict."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from qtool.inspect import inspect_path
from tests.test_inspect import cli

MOD = "model.layers.0.mlp.down_proj"


def _write(root, tensors: dict, config: dict | None = None, name: str = "config.json"):
    root.mkdir(parents=True)
    tensors = {**tensors, "model.norm.weight": torch.ones(8, dtype=torch.float16)}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (root / name).write_text(json.dumps(config))
    return root


def _mods(r):
    return {m.name: (m.scheme.format, m.scheme.bits, m.scheme.group_size, m.in_features, m.out_features) for m in r.modules}


def _sev(r, severity):
    return [a.message for a in r.anomalies if a.severity == severity]


def _not_dense(r, root):
    assert r.format != "dense" and "dense" not in {m.scheme.format for m in r.modules if m.name == MOD}
    assert r.anomalies, "a quantized file is never 'no anomalies' when qtool cannot describe it fully"


# --- QQQ and EXL3 without a config ---------------------------------------------------------------------------

@pytest.mark.parametrize("group", [128, -1])
def test_qqq_without_config_is_named(tmp_path, group):
    k, n = 256, 128   # B [K/16, N*16/8], s_channel F32 [1, N], s_group F16 [K/g, N] (empty per channel)
    t = {f"{MOD}.B": torch.zeros(k // 16, n * 2, dtype=torch.int32),
         f"{MOD}.s_channel": torch.ones(1, n, dtype=torch.float32),
         f"{MOD}.s_group": torch.ones(k // group, n, dtype=torch.float16) if group > 0
         else torch.zeros(0, dtype=torch.float16),
         f"{MOD}.workspace": torch.zeros(n // 64 * 16, dtype=torch.int32)}
    r = inspect_path(_write(tmp_path / "qqq", t))
    _not_dense(r, tmp_path)
    assert _mods(r)[MOD] == ("qqq", 4, group, k, n) and r.format == "qqq"
    assert any("no quantization config" in m for m in _sev(r, "warning"))


def test_exl3_without_config_is_named(tmp_path):
    k, n, bits = 256, 128, 4   # trellis I16 [K/16, N/16, 16*bits], suh [K], svh [N]
    t = {f"{MOD}.trellis": torch.zeros(k // 16, n // 16, 16 * bits, dtype=torch.int16),
         f"{MOD}.suh": torch.ones(k, dtype=torch.float16), f"{MOD}.svh": torch.ones(n, dtype=torch.float16),
         f"{MOD}.mcg": torch.zeros(1, dtype=torch.int32)}
    r = inspect_path(_write(tmp_path / "exl3", t))
    _not_dense(r, tmp_path)
    assert _mods(r)[MOD] == ("exl3", bits, None, k, n)
    # a trellis whose sign vectors disagree with it is an error
    t[f"{MOD}.svh"] = torch.ones(n + 16, dtype=torch.float16)
    r = inspect_path(_write(tmp_path / "exl3-bad", t))
    assert any("EXL3 svh [144] != [128]" in m for m in _sev(r, "error"))


# --- LLM-AWQ, named by its version --------------------------------------------------------------------------

def _zeros_width(i: int, g: int) -> int:
    base = -(-(i // g) // 8)
    mult = 1 if g >= 128 else {64: 2, 32: 4}[g]
    return -(-base // mult) * mult


def _llm_awq(version: str, i: int = 512, o: int = 256, g: int = 128) -> dict:
    if version == "gemm":      # first release: qweight [I, O/8], qzeros [I/g, O/8], scales [I/g, O]
        return {"qweight": torch.zeros(i, o // 8, dtype=torch.int32),
                "qzeros": torch.zeros(i // g, o // 8, dtype=torch.int32),
                "scales": torch.ones(i // g, o, dtype=torch.float16)}
    w = _zeros_width(i, g)
    if version == "gemv":      # TinyChat: qweight [O, I/8], qzeros [O, W], scales [O, 8W]
        return {"qweight": torch.zeros(o, i // 8, dtype=torch.int32),
                "qzeros": torch.zeros(o, w, dtype=torch.int32), "scales": torch.ones(o, 8 * w, dtype=torch.float16)}
    # TinyChat 2: int16 qweight [O/4, I], scales and scaled_zeros F16 [8W, O]
    return {"qweight": torch.zeros(o // 4, i, dtype=torch.int16),
            "scales": torch.ones(8 * w, o, dtype=torch.float16),
            "scaled_zeros": torch.zeros(8 * w, o, dtype=torch.float16)}


@pytest.mark.parametrize("version,fmt", [("gemm", "awq"), ("gemv", "awq_gemv"), ("gemv_fast", "awq_gemv_fast")])
@pytest.mark.parametrize("with_config", [True, False])
def test_llm_awq_named_by_version(tmp_path, version, fmt, with_config):
    t = {f"{MOD}.{k}": v for k, v in _llm_awq(version).items()}
    cfg = {"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
                                   "version": version.upper()}} if with_config else None
    r = inspect_path(_write(tmp_path / version, t, cfg))
    assert _mods(r)[MOD] == (fmt, 4, 128, 512, 256), r.modules
    assert _sev(r, "error") == [], r.anomalies
    if version == "gemv_fast":
        assert "LLM-AWQ" in r.modules[0].detail


@pytest.mark.parametrize("claimed", ["gemm", "gemv"])
def test_llm_awq_version_that_contradicts_the_tensors_is_an_error(tmp_path, claimed):
    t = {f"{MOD}.{k}": v for k, v in _llm_awq("gemv_fast").items()}
    cfg = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": claimed}}
    root = _write(tmp_path / claimed, t, cfg)
    r = inspect_path(root)
    want = {"gemm": "awq", "gemv": "awq_gemv"}[claimed]
    assert any(f"config says {want} but the tensors have the AWQ GEMV_FAST layout" in m for m in _sev(r, "error"))
    assert cli("inspect", str(root), "--strict")[1] == 1


# --- GPTQ in int16 words -------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_config", [True, False])
def test_gptq_int16_words_is_not_awq_gemv_fast(tmp_path, with_config):
    i, o, g, bits = 512, 64, 128, 4   # qweight [I*b/16, O], qzeros [I/g, O*b/16], scales [I/g, O], g_idx [I]
    t = {f"{MOD}.qweight": torch.zeros(i * bits // 16, o, dtype=torch.int16),
         f"{MOD}.qzeros": torch.zeros(i // g, o * bits // 16, dtype=torch.int16),
         f"{MOD}.scales": torch.ones(i // g, o, dtype=torch.float16),
         f"{MOD}.g_idx": torch.arange(i, dtype=torch.int32) // g}
    cfg = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": True,
                                   "desc_act": False, "pack_dtype": "int16"}} if with_config else None
    root = _write(tmp_path / "gptq16", t, cfg)
    r = inspect_path(root)
    assert _mods(r)[MOD] == ("gptq_int16", bits, g, i, o)
    assert any("GPTQ packed in int16 words" in m for m in _sev(r, "warning"))
    assert _sev(r, "error") == []
    # repack says it cannot read the modules instead of decoding int16 words as int32 GPTQ
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError, match="qtool cannot read 'gptq_int16' modules") as e:
        cli("repack", str(root), "--to", "gptq_v2", "-o", str(tmp_path / "out"), "--dry-run")
    assert e.value.exit_code == 2


# --- MLX ----------------------------------------------------------------------------------------------------

def _mlx(o=128, i=512, bits=4, g=64) -> dict:
    return {f"{MOD}.weight": torch.zeros(o, i * bits // 32, dtype=torch.uint32),
            f"{MOD}.scales": torch.ones(o, i // g, dtype=torch.float16),
            f"{MOD}.biases": torch.zeros(o, i // g, dtype=torch.float16)}


def test_mlx_with_its_config_has_true_in_features(tmp_path):
    cfg = {"model_type": "llama", "quantization": {"group_size": 64, "bits": 4}}
    r = inspect_path(_write(tmp_path / "mlx", _mlx(), cfg))
    assert _mods(r)[MOD] == ("mlx", 4, 64, 512, 128)
    assert _sev(r, "error") == [] and not any("no scales" in a.message for a in r.anomalies)
    assert r.info_tail["config"].startswith("config.json quantization: bits 4, group_size 64")


def test_mlx_per_module_override(tmp_path):
    cfg = {"quantization": {"group_size": 64, "bits": 4, MOD: {"group_size": 32, "bits": 8}}}
    r = inspect_path(_write(tmp_path / "mlx8", _mlx(bits=8, g=32), cfg))
    assert _mods(r)[MOD] == ("mlx", 8, 32, 512, 128) and _sev(r, "error") == []


def test_mlx_without_config_is_an_error_not_a_guess(tmp_path):
    root = _write(tmp_path / "mlx", _mlx())
    r = inspect_path(root)
    fmt, bits, _g, i, _o = _mods(r)[MOD]
    assert fmt == "mlx" and bits is None and i is None  # never in_features 64 (the packed width)
    assert any("fits 2-bit/g128, 4-bit/g64, 8-bit/g32" in m for m in _sev(r, "error")), r.anomalies
    assert cli("inspect", str(root), "--strict")[1] == 1


# --- bitsandbytes NF4 ----------------------------------------------------------------------------------------

def _nf4(o=64, i=256, state=True, bias=False, block=64, scales=None, state_block=True) -> dict:
    n = o * i
    t = {f"{MOD}.weight": torch.zeros(-(-n // 2), 1, dtype=torch.uint8),
         f"{MOD}.weight.absmax": torch.ones(-(-n // block) if scales is None else scales, dtype=torch.float32),
         f"{MOD}.weight.quant_map": torch.linspace(-1, 1, 16)}
    if state:
        st = {"quant_type": "nf4", "dtype": "float16", "shape": [o, i]} | ({"blocksize": block} if state_block else {})
        blob = json.dumps(st).encode()
        t[f"{MOD}.weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(blob), dtype=torch.uint8)
    if bias:
        t[f"{MOD}.bias"] = torch.zeros(o, dtype=torch.float16)
    return t


BNB_CFG = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                   "bnb_4bit_quant_type": "nf4"}}


def test_bnb_nf4_features_from_quant_state(tmp_path):
    r = inspect_path(_write(tmp_path / "nf4", _nf4(), BNB_CFG))
    assert _mods(r)[MOD] == ("bnb", 4, 64, 256, 64) and _sev(r, "error") == []
    assert r.modules[0].n_weights == 64 * 256


def test_bnb_nf4_features_from_bias_without_state(tmp_path):
    r = inspect_path(_write(tmp_path / "nf4", _nf4(state=False, bias=True), BNB_CFG))
    assert _mods(r)[MOD][3:] == (256, 64)


def test_bnb_nf4_state_that_disagrees_is_an_error(tmp_path):
    t = _nf4()
    blob = json.dumps({"quant_type": "nf4", "shape": [64, 512]}).encode()
    t[f"{MOD}.weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(blob), dtype=torch.uint8)
    r = inspect_path(_write(tmp_path / "nf4", t, BNB_CFG))
    assert any("quant state says shape [64, 512] but the weight holds 16384 codes" in m for m in _sev(r, "error"))


@pytest.mark.parametrize("kw,group,error", [
    ({"o": 63, "i": 255}, 64, None),                      # 16065 codes: 252 blocks, the last one partial
    ({"block": 128}, 128, None),                          # the quant state's own block size
    ({"block": 256, "state_block": False}, 256, None),    # no block size recorded: the one absmax fits
    ({"scales": 253}, 64, "weight.absmax holds 253 scales, but 16384 codes in blocks of 64 need 256"),
    ({"scales": 253, "state_block": False}, None, "weight.absmax holds 253 scales: no bitsandbytes block size"),
])
def test_bnb_nf4_block_size_and_absmax_count(tmp_path, kw, group, error):
    r = inspect_path(_write(tmp_path / "nf4", _nf4(**kw), BNB_CFG))
    assert _mods(r)[MOD][2] == group
    errors = _sev(r, "error")
    assert (errors == []) if error is None else any(error in m for m in errors), errors


# --- the general rule: integer weights or sidecars no detector claims ----------------------------------------

UNKNOWN = {
    "int-weight": {f"{MOD}.weight": torch.zeros(64, 32, dtype=torch.uint8)},
    "u16-weight": {f"{MOD}.weight": torch.zeros(64, 32, dtype=torch.int16)},
    "exl2": {f"{MOD}.q_weight": torch.zeros(32, 64, dtype=torch.int32),
             f"{MOD}.q_scale": torch.zeros(2, 8, dtype=torch.int32),
             f"{MOD}.q_scale_max": torch.ones(2, dtype=torch.float16),
             f"{MOD}.q_groups": torch.zeros(4, dtype=torch.int16),
             f"{MOD}.q_invperm": torch.arange(256, dtype=torch.int32)},
    "float-weight-with-scales": {f"{MOD}.weight": torch.zeros(64, 32, dtype=torch.float16),
                                 f"{MOD}.scales": torch.ones(64, 1, dtype=torch.float16)},
    "hqq-like": {f"{MOD}.W_q": torch.zeros(64, 32, dtype=torch.uint8), f"{MOD}.zeros": torch.zeros(64, 1)},
}


@pytest.mark.parametrize("case", sorted(UNKNOWN))
def test_unclaimed_quantized_tensors_are_an_unknown_layout_error(tmp_path, case):
    root = _write(tmp_path / case, UNKNOWN[case])
    r = inspect_path(root)
    assert r.format == "unknown" and _mods(r)[MOD][0] == "unknown"
    errs = _sev(r, "error")
    assert any(m.startswith("unknown quantized layout:") and "fix:" in m for m in errs), r.anomalies
    assert cli("inspect", str(root), "--strict")[1] == 1
    assert cli("inspect", str(root))[1] == 0
    res, _ = cli("inspect", str(root))
    assert "no anomalies" not in res.output and "unknown quantized layout" in res.output
    d = json.loads(cli("inspect", str(root), "--json")[0].output)
    assert d["format"] == "unknown"


def test_dense_checkpoint_stays_dense(tmp_path):
    t = {f"{MOD}.weight": torch.zeros(64, 32, dtype=torch.float16), f"{MOD}.bias": torch.zeros(64),
         "model.embed_tokens.weight": torch.zeros(100, 32, dtype=torch.bfloat16),
         "model.rotary.inv_freq": torch.zeros(16), "model.position_ids": torch.arange(8)}
    r = inspect_path(_write(tmp_path / "dense", t))
    assert r.format == "dense" and [a.message[:41] for a in r.anomalies] == [
        "transformers will not load it: no config."]


def test_a_bias_that_does_not_match_the_outputs_is_an_error(tmp_path):
    """A Conv1D weight stored [in, out] (GPT-2) beside its bias [out] reads as [out, in] with the wrong count."""
    t = {f"{MOD}.weight": torch.zeros(64, 192, dtype=torch.float16), f"{MOD}.bias": torch.zeros(192, dtype=torch.float16)}
    r = inspect_path(_write(tmp_path / "c1d", t, {"model_type": "custom"}))
    assert any("bias has 192 entries but the weight 64 outputs" in m for m in _sev(r, "error")), r.anomalies
    t[f"{MOD}.bias"] = torch.zeros(64, dtype=torch.float16)
    assert _sev(inspect_path(_write(tmp_path / "ok", t, {"model_type": "custom"})), "error") == []
