"""The contract rows for the float and int8 layouts: does vLLM's loader find a scheme for each config group,
and do block-scaled layers fit the layers vLLM builds from them?

Facts (vLLM main, vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py,
`_get_scheme_from_parts`, and quantization/utils/fp8_utils.py `validate_fp8_block_shape`):
- A compressed-tensors config group becomes a scheme by a first-match walk over its `weights` and
  `input_activations` arguments; a group no rule takes fails the load with "No compressed-tensors compatible
  scheme was found". The rules are SCHEMES below, in vLLM's order. The W8A8 and W8A16 rules (and W4A4 NVFP4)
  apply only when the group's format is one of ACTIVATION_FORMATS (`is_activation_quantization_format`).
- MXFP8 (vLLM 0.19, PR 38815: `_is_mxfp8`, CompressedTensorsW8A8Mxfp8 for linear and MoE layers): a group whose
  weights are 8-bit symmetric floats with strategy group, group_size 32 and scale_dtype torch.uint8 (E8M0 bytes)
  loads as that scheme whatever its format and input activations (the rule comes before the activation-format
  ones); 8-bit float weights per group of 32 with another scale dtype match no rule.
- Block-scaled FP8 weights (`quant_method: fp8` with `weight_block_size`, compressed-tensors strategy
  `block`): when vLLM merges layers into one (q/k/v -> qkv_proj, gate/up -> gate_up_proj), every part but
  the last must have out_features a multiple of the block's rows, or weight creation raises ("is not divisible
  by weight quantization block_n"). With tensor parallelism the rule holds for every rank's share, the last
  part included; the check here is for one GPU (tensor-parallel size 1) and says so.

Only groups these rules describe are judged: float weights, and 8-bit integer weights (INT8 W8A8); the integer
W4A16 groups are the select rows' business (qtool.validate.contract). compressed-tensors' defaults fill absent
arguments (num_bits 8, type int, symmetric true, dynamic false; a strategy from group_size).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.report.validate import CheckResult

NAME = "contract"
ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")
# the formats whose groups SCHEMES judge
JUDGED_FORMATS = ACTIVATION_FORMATS + ("mxfp4-pack-quantized", "mxfp8-quantized")


@dataclass(frozen=True)
class Args:
    """One QuantizationArgs as the loader reads it."""

    num_bits: int
    type: str
    symmetric: bool
    dynamic: bool
    strategy: str
    group_size: int | None
    scale_dtype: str | None = None  # as serialized ("torch.uint8"); None when absent


def _args(raw: Any) -> Args | None:
    if not isinstance(raw, dict):
        return None
    g = raw.get("group_size")
    strategy = raw.get("strategy")
    if strategy is None:  # compressed-tensors' validator: a group size decides
        strategy = "tensor" if g is None else "channel" if g == -1 else "group"
    return Args(int(raw.get("num_bits", 8)), str(raw.get("type", "int")).lower(), bool(raw.get("symmetric", True)),
                bool(raw.get("dynamic", False)) if raw.get("dynamic") != "local" else True, str(strategy).lower(),
                g if isinstance(g, int) else None,
                str(raw["scale_dtype"]) if raw.get("scale_dtype") is not None else None)


def _nvfp4(a: Args | None) -> bool:
    return (a is not None and a.strategy == "tensor_group" and a.type == "float" and a.num_bits == 4
            and a.group_size == 16 and a.symmetric)


def _mxfp8(w: Args) -> bool:
    return (w.strategy == "group" and w.type == "float" and w.num_bits == 8 and w.group_size == 32 and w.symmetric
            and w.scale_dtype in ("torch.uint8", "uint8"))


def _static_fp8_weights(w: Args) -> bool:
    return w.type == "float" and w.symmetric and not w.dynamic and w.strategy in ("tensor", "channel", "block")


def _int8_weights(w: Args, a: Args) -> bool:
    return w.num_bits == a.num_bits == 8 and w.strategy in ("tensor", "channel") and w.symmetric and not w.dynamic


# (scheme, needs an activation format, rule(weights, activations or None)), in vLLM's order
SCHEMES = (
    ("CompressedTensorsW4A16Fp4", False, lambda w, a: _nvfp4(w) and a is None),
    ("CompressedTensorsW4A16Mxfp4", False,
     lambda w, a: w.strategy == "group" and w.type == "float" and w.num_bits == 4 and w.group_size == 32
     and w.symmetric),
    ("CompressedTensorsW8A8Mxfp8", False, lambda w, a: _mxfp8(w)),
    ("CompressedTensorsW4A4Fp4", True, lambda w, a: _nvfp4(w) and _nvfp4(a)),
    ("CompressedTensorsW8A8Fp8", True,
     lambda w, a: a is not None and a.type == "float" and _static_fp8_weights(w)
     and (a.dynamic or (a.symmetric and a.strategy == "tensor"))),
    ("CompressedTensorsW8A16Fp8", True, lambda w, a: _static_fp8_weights(w)),
    ("CompressedTensorsW8A8Int8 (static activations)", True,
     lambda w, a: a is not None and _int8_weights(w, a) and a.strategy == "tensor" and not a.dynamic),
    ("CompressedTensorsW8A8Int8 (dynamic per-token activations)", True,
     lambda w, a: a is not None and _int8_weights(w, a) and a.strategy == "token" and a.dynamic),
)


def scheme_for(weights: Args, acts: Args | None, fmt: str) -> str | None:
    """The vLLM scheme a config group loads as, or None (the load fails)."""
    for name, needs_act_format, rule in SCHEMES:
        if needs_act_format and fmt not in ACTIVATION_FORMATS:
            continue
        if rule(weights, acts):
            return name
    return None


def _why_not(w: Args, a: Args | None, fmt: str) -> str:
    """The first reason a judged group has no scheme, in words."""
    if w.type == "float" and w.num_bits == 8:
        if not w.symmetric or w.dynamic:
            return "FP8 weights must be symmetric and static"
        if w.strategy == "group" and w.group_size == 32:
            return (f"FP8 weights per group of 32 load as MXFP8 only with scale_dtype torch.uint8 (E8M0), not "
                    f"{w.scale_dtype or 'none'}")
        return f"FP8 weight strategy '{w.strategy}': vLLM reads tensor, channel or block (or MXFP8's group of 32)"
    if w.type == "int":
        if a is None:
            return "INT8 weights need input_activations (W8A8): vLLM has no W8A16 int8 scheme"
        if w.strategy not in ("tensor", "channel"):
            return f"INT8 weight strategy '{w.strategy}': vLLM's W8A8 reads tensor or channel"
        if not w.symmetric:
            return "INT8 weights must be symmetric"
        return (f"INT8 activations '{a.strategy}' {'dynamic' if a.dynamic else 'static'}: vLLM reads dynamic "
                "per-token or static per-tensor")
    if fmt not in JUDGED_FORMATS:
        return f"format {fmt}"
    return (f"{w.num_bits}-bit {w.type} weights, strategy {w.strategy}, group {w.group_size}: no NVFP4 (tensor_group "
            "of 16) or MXFP4 (group of 32) rule matches")


def _judged(w: Args, fmt: str) -> bool:
    return fmt in JUDGED_FORMATS and (w.type == "float" or (w.type == "int" and w.num_bits == 8))


def check(raw: dict | None, report, path: Path) -> list[CheckResult]:
    """The rows for `raw` (the quantization config): [] when it holds nothing these rules describe."""
    if not isinstance(raw, dict):
        return []
    method = str(raw.get("quant_method", "")).lower()
    out: list[CheckResult] = []
    blocks: list[tuple[list[str], tuple[int, int]]] = []  # (targets, block) of block-scaled groups
    if method == "compressed-tensors":
        groups = raw.get("config_groups") if isinstance(raw.get("config_groups"), dict) else {}
        top = str(raw.get("format") or "")
        for gname, g in groups.items():
            if not isinstance(g, dict):
                continue
            w, a = _args(g.get("weights")), _args(g.get("input_activations"))
            fmt = str(g.get("format") or top)
            if w is None or not _judged(w, fmt):
                continue
            scheme = scheme_for(w, a, fmt)
            what = f"vLLM compressed-tensors group {gname} ({fmt}, {w.num_bits}-bit {w.type} {w.strategy} weights)"
            if scheme is None:
                out.append(CheckResult(NAME, None, "fail", f"{what}: no scheme takes it, the load fails ('No "
                                                           f"compressed-tensors compatible scheme was found'): "
                                                           f"{_why_not(w, a, fmt)}"))
            else:
                out.append(CheckResult(NAME, None, "pass", f"{what}: loads as {scheme}"))
            bs = (g.get("weights") or {}).get("block_structure")
            if w.strategy == "block" and _pair(bs):
                targets = g.get("targets") if isinstance(g.get("targets"), list) else []
                blocks.append(([str(t) for t in targets], (int(bs[0]), int(bs[1]))))
    elif method == "fp8" and _pair(raw.get("weight_block_size")):
        bs = raw["weight_block_size"]
        blocks.append((["Linear"], (int(bs[0]), int(bs[1]))))
    if blocks:
        out += _merged_block_rows(report, blocks, _model_config(path))
    return out


def _pair(v: Any) -> bool:
    return isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v)


def _targeted(name: str, targets: list[str]) -> bool:
    """compressed-tensors target matching: `re:` regexes, layer class names (Linear), or module names."""
    for t in targets:
        if t.startswith("re:"):
            try:
                if re.match(t[3:], name):
                    return True
            except re.error:
                continue
        elif t == "Linear" or name == t or name.endswith("." + t):
            return True
    return False


def _model_config(path: Path) -> dict:
    """The checkpoint's config.json, or {} (a lone file, or none beside it)."""
    from qtool.io.checkpoint import model_config

    return model_config(path)


def _prefused_parts(m, rule: dict, cfg: dict) -> list[tuple[str, int]] | None:
    """A merged layer stored already merged (Phi-3's qkv_proj, gate_up_proj): its parts' row counts from the
    config, which vLLM's merged layer is created with, or None."""
    if not (m.name == rule["name"] or m.name.endswith("." + rule["name"])) or m.out_features is None:
        return None
    names = [p.rsplit(".", 1)[-1] for p in rule["parts"]]
    heads, kv, hidden = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads"), cfg.get("hidden_size")
    ints = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (heads, hidden))
    if names == ["q_proj", "k_proj", "v_proj"] and ints:
        dim = cfg.get("head_dim") or hidden // heads
        kv = kv if isinstance(kv, int) and kv > 0 else heads
        sizes = [heads * dim, kv * dim, kv * dim]
    elif len(names) == 2 and m.out_features % 2 == 0:  # gate and up: two halves
        sizes = [m.out_features // 2] * 2
    else:
        return None
    return list(zip(names, sizes)) if sum(sizes) == m.out_features else None


def _merged_block_rows(report, blocks: list[tuple[list[str], tuple[int, int]]],
                       cfg: dict | None = None) -> list[CheckResult]:
    """Every part of a layer vLLM merges but the last must hold whole block rows (validate_fp8_block_shape),
    whether the checkpoint stores the parts apart or merged already (their sizes then from config.json); one
    row per failing layer pattern (layers numbered alike collapse to `#`)."""
    from qtool.inspect.detect import collapse_layers
    from qtool.select.plan import fused_parts, fused_rules

    rules = fused_rules()
    by_name = {m.name: m for m in report.modules if m.quantized}
    out, checked, seen = [], set(), set()
    for m in by_name.values():
        block = next((b for targets, b in blocks if _targeted(m.name, targets)), None)
        if block is None:
            continue
        for rule in rules:
            merged = _prefused_parts(m, rule, cfg or {})
            found = fused_parts(m.name, rule, by_name)
            if merged is not None:
                prefix = m.name[: len(m.name) - len(rule["name"])]
            elif found is None or any(p is None for p in found[1]):
                continue
            else:
                prefix, parts = found
                merged = [(p.name.rsplit(".", 1)[-1], p.out_features) for p in parts]
            if prefix + rule["name"] in checked:  # one layer, named by two architectures' rules
                continue
            checked.add(prefix + rule["name"])
            bad = [(n, rows) for n, rows in merged[:-1] if rows is not None and rows % block[0]]
            where = collapse_layers(prefix + rule["name"])
            if bad and where not in seen:
                seen.add(where)
                sizes = ", ".join(f"{n} {rows}" for n, rows in bad)
                out.append(CheckResult(NAME, where, "fail",
                                       f"vLLM merges {', '.join(rule['parts'])} into {rule['name']}, and every part but "
                                       f"the last must hold whole {block[0]}x{block[1]} blocks of rows: {sizes} is not "
                                       f"a multiple of {block[0]} (weight creation raises at load, tensor-parallel "
                                       "size 1); fix: a block whose rows divide those parts, or per-channel scales"))
    if checked and not out:
        out.append(CheckResult(NAME, None, "pass", f"{len(checked)} merged layers hold whole FP8 weight blocks in every part "
                                                  "(vLLM's block-shape rule, tensor-parallel size 1)"))
    return out
