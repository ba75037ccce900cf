"""Quantization configs: reading every synonym the ecosystem writes (each format module writes its own).

Readers (FORMATS.md): `config.json["quantization_config"]` and/or `quantize_config.json`; keys `quant_method`,
`bits` (w_bit, wbits), `group_size` (q_group_size), `desc_act`, `sym` (zero_point = not sym),
`checkpoint_format` / `format` / `version`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qtool.errors import InputError

# GPTQ-family checkpoint_format values -> qtool format ids.
_GPTQ_FORMATS = {"gptq": "gptq", "gptq_v2": "gptq_v2", "gptq_p": "gptq_p", "marlin": "marlin"}
_AWQ_VERSIONS = {"gemm": "awq", "gemv": "awq_gemv", "gemv_fast": "awq_gemv_fast", "marlin": "marlin"}


@dataclass(frozen=True)
class QuantConfig:
    """A normalised quantization config.

    format: the qtool format id the config implies ("gptq", "gptq_v2", "gptq_p", "awq", "awq_gemv",
            "awq_gemv_fast", "marlin", "ct", "ct_fp8", "nvfp4", "mxfp4", "mxfp8", "modelopt_nvfp4",
            "gptoss_mxfp4", "fp8", "bnb", "qqq", "exl3") or None if unknown.
    """

    quant_method: str | None
    format: str | None
    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    checkpoint_format: str | None
    raw: dict = field(default_factory=dict)


def _first(d: dict, *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _int(v: Any, key: str, source: object) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"quantization config '{key}' must be an integer, got {v!r}", path=source)
    return v


def _bool(v: Any, key: str, source: object) -> bool | None:
    if v is None:
        return None
    if not isinstance(v, bool):
        raise InputError(f"quantization config '{key}' must be true/false, got {v!r}", path=source)
    return v


def parse_quant_config(raw: dict | None, source: object = None) -> QuantConfig | None:
    """Normalise a raw config dict; None when there is none. `source` names the file in errors."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InputError("quantization config is not a JSON object", path=source)
    method = _first(raw, "quant_method", "method")
    method = str(method).lower() if method is not None else None
    if method == "compressed-tensors":
        return _parse_ct(raw, source)
    bits = _int(_first(raw, "bits", "w_bit", "wbits"), "bits", source)
    group = _int(_first(raw, "group_size", "q_group_size"), "group_size", source)
    desc = _bool(raw.get("desc_act"), "desc_act", source)
    sym = _bool(raw.get("sym"), "sym", source)
    if sym is None and raw.get("zero_point") is not None:
        zp = _bool(raw.get("zero_point"), "zero_point", source)
        sym = not zp
    ckpt = _first(raw, "checkpoint_format", "format", "version")
    ckpt = str(ckpt).lower() if ckpt is not None else None
    fmt = None
    if method == "gptq":
        fmt = _GPTQ_FORMATS.get(ckpt or "gptq")
        if ckpt in _AWQ_VERSIONS and ckpt != "marlin":  # GPTQModel labels RTN->gemm exports as gptq/gemm
            fmt = _AWQ_VERSIONS[ckpt]
    elif method == "awq":
        fmt = _AWQ_VERSIONS.get(ckpt or "gemm")
    elif method in ("marlin", "qqq", "exl3"):
        fmt = method
    elif method == "fp8":
        fmt, bits = "fp8", bits or 8
        bs = raw.get("weight_block_size")
        if bs is not None and not (isinstance(bs, list) and len(bs) == 2 and
                                   all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)):
            raise InputError(f"quantization config 'weight_block_size' must be two positive integers [rows, "
                             f"columns] or null, got {str(bs)[:40]}", path=source)
    elif method == "modelopt":
        nested = raw.get("quantization") if isinstance(raw.get("quantization"), dict) else {}
        algo = str(raw.get("quant_algo") or nested.get("quant_algo") or "").upper()
        fmt = {"NVFP4": "modelopt_nvfp4"}.get(algo)
        bits = bits or (4 if fmt else None)
    elif method == "mxfp4":  # transformers' Mxfp4Config (gpt-oss)
        fmt, bits = "gptoss_mxfp4", bits or 4
    elif method == "bitsandbytes":
        fmt = "bnb"
        if raw.get("load_in_4bit"):
            bits = 4
        elif raw.get("load_in_8bit"):
            bits = 8
    return QuantConfig(method, fmt, bits, group, sym, desc, ckpt, dict(raw))


def _parse_ct(raw: dict, source: object) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    weights = None
    if isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and isinstance(g.get("weights"), dict):
                weights = g["weights"]
                break
    fmt_name = str(raw.get("format") or "").lower()
    fmt = {"pack-quantized": "ct", "float-quantized": "ct_fp8", "nvfp4-pack-quantized": "nvfp4",
           "mxfp4-pack-quantized": "mxfp4", "mxfp8-quantized": "mxfp8",
           "naive-quantized": "ct_naive"}.get(fmt_name)
    bits = group = sym = desc = None
    if weights:
        bits = _int(weights.get("num_bits"), "num_bits", source)
        group = _int(weights.get("group_size"), "group_size", source)
        if weights.get("strategy") == "channel":
            group = -1
        sym = _bool(weights.get("symmetric"), "symmetric", source)
        desc = weights.get("actorder") not in (None, False, "static", "weight")
    return QuantConfig("compressed-tensors", fmt, bits, group, sym, desc, fmt_name or None, dict(raw))

