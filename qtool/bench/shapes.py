"""The linear-layer shapes a benchmark runs: named models or explicit `KxN` lists.

Shapes are K x N (in_features x out_features) of one decoder layer's projections. The model table is read
from configs/models.yaml when that file exists (`models: {name: {arch, hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, head_dim}}`, each architecture's `layers` giving in/out as
hidden_size / intermediate_size / q_size / kv_size); the built-in table below covers the two Llama 3 models
when it does not (Llama 3 configs: 8B hidden 4096, MLP 14336, 32 heads, 8 KV heads; 70B hidden 8192,
MLP 28672, 64 heads, 8 KV heads; head_dim 128).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qtool.errors import UsageError
from qtool.spec import INT32_MAX

BUILTIN_MODELS = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128),
}

# Kernels index K, N and M with 32-bit integers.
MAX_DIM = INT32_MAX

# The batch sizes `qtool bench` sweeps by default: on a GPU the whole decode-to-prefill curve (batches of 3, 5,
# 12 or 40 are what serving traffic gives; a dispatch tuned at a few points can be weak between them), on the CPU
# three points.
GPU_BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CPU_BATCH_SIZES = (1, 16, 256)

# Small enough that the CPU bench (and its test) finishes in seconds, awkward enough to exercise masks.
CPU_DEFAULT = "512x384,1024x256"


@dataclass(frozen=True)
class Shape:
    name: str
    K: int  # noqa: N815 - GEMM names
    N: int  # noqa: N815

    def to_dict(self) -> dict:
        return {"name": self.name, "K": self.K, "N": self.N}


def _model_table() -> dict[str, dict]:
    """name -> model row; rows from configs/models.yaml (schema qtool.models/v1) carry their
    architecture's layer list under "_layers" and its fused layers under "_fused"."""
    from qtool.paths import CONFIG_DIR

    table = {k: dict(v) for k, v in BUILTIN_MODELS.items()}
    path = CONFIG_DIR / "models.yaml"
    if not path.is_file():
        return table
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        return table
    if not isinstance(data, dict):
        return table
    archs = data.get("architectures") if isinstance(data.get("architectures"), dict) else {}
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    for name, row in models.items():
        if not isinstance(row, dict):
            continue
        row = dict(row)
        arch = archs.get(row.get("arch"))
        if isinstance(arch, dict) and isinstance(arch.get("layers"), list):
            row["_layers"] = arch["layers"]
            row["_fused"] = arch.get("fused")
        table[str(name).lower()] = row
    return table


def _width(expr, sizes: dict[str, int], name: str) -> int:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str) and expr in sizes:
        return sizes[expr]
    raise UsageError(f"configs/models.yaml: model '{name}': layer width {expr!r} is not a number or one of "
                     f"{', '.join(sizes)}", fix="fix the layer table or give --shapes KxN")


# How tensor parallelism splits each projection of the built-in layer list: column layers split N, row layers K.
BUILTIN_PARALLEL = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
                    "gate_proj": "column", "up_proj": "column", "down_proj": "row"}
# The layers a serving engine builds as one GEMM (vLLM's QKVParallelLinear and MergedColumnParallelLinear), for the
# built-in layer list; configs/models.yaml gives each architecture's own under `fused`.
BUILTIN_FUSED = [{"name": "qkv_proj", "parts": ["q_proj", "k_proj", "v_proj"]},
                 {"name": "gate_up_proj", "parts": ["gate_proj", "up_proj"]}]
MAX_TP = 64

# full name, K, N, how tensor parallelism splits it, the attention heads along the split dimension
Layer = tuple[str, int, int, str, tuple]


def _shard(layers: list[Layer], tp: int, name: str) -> list[Layer]:
    """One GPU's shard of each layer under tp-way tensor parallelism as vLLM and SGLang cut it: column layers'
    N and row layers' K split by tp, by whole attention heads where the width is heads (a key/value head copied
    to each rank where there are fewer than ranks); replicated layers whole. The shard keeps no heads: it is
    not split again."""
    from qtool.kernels.select import split_width

    out = []
    for lname, k, n, par, heads in layers:
        if par not in ("row", "column"):
            out.append((lname, k, n, par, ()))
            continue
        part, why = split_width(k if par == "row" else n, heads, tp)
        if why:
            raise UsageError(f"--shapes {name}@tp{tp}: {_short(lname)} ({k}x{n}) does not split {tp} ways: {why}",
                             fix="use a tensor-parallel degree that divides the layer's width and heads")
        out.append((lname, part if par == "row" else k, part if par == "column" else n, par, ()))
    return out


def _fuse(layers: list[Layer], rules: list, name: str) -> list[Layer]:
    """Each rule's parts (all present, one K, split by N) as one layer of their summed N, in the first part's
    place: what the serving engine launches. Applied to the shards, as the engine shards each part."""
    index = {lname: i for i, (lname, *_) in enumerate(layers)}
    out: list[Layer | None] = list(layers)
    applied = 0
    for rule in rules:
        parts = rule.get("parts") if isinstance(rule, dict) else None
        if not isinstance(parts, list) or not any(str(p) in index for p in parts):
            continue
        if missing := [str(p) for p in parts if str(p) not in index]:
            raise UsageError(f"configs/models.yaml: model '{name}': fused layer {rule.get('name')!r} names "
                             f"{missing[0]!r}, which is not one of its layers", fix="fix its `fused` list")
        group = [layers[index[str(p)]] for p in parts]
        if len({k for _, k, *_ in group}) != 1 or any(par != "column" for _, _, _, par, _ in group):
            raise UsageError(f"configs/models.yaml: model '{name}': fused layer {rule.get('name')!r} joins layers "
                             f"of different in-widths or not split by N", fix="fix its `fused` list")
        out[index[str(parts[0])]] = (str(rule.get("name", parts[0])), group[0][1], sum(n for _, _, n, *_ in group),
                                     "column", ())
        for p in parts[1:]:
            out[index[str(p)]] = None
        applied += 1
    if not applied:
        raise UsageError(f"--shapes {name}+fused: the model has no layers a serving engine fuses",
                         fix="drop +fused, or give its architecture a `fused` list in configs/models.yaml")
    return [x for x in out if x is not None]


def _short(lname: str) -> str:
    return lname.rsplit(".", 1)[-1] if "proj" in lname else lname


def _layers_of(name: str, row: dict, tp: int = 1, fused: bool = False) -> list[Shape]:
    try:
        h = int(row["hidden_size"])
        inter = int(row["intermediate_size"])
        heads = int(row["num_attention_heads"])
        kv = int(row.get("num_key_value_heads") or heads)
        hd = int(row.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"configs/models.yaml: model '{name}' lacks hidden_size / intermediate_size / "
                         f"num_attention_heads", fix="add them or give --shapes KxN") from None
    from qtool.kernels.select import width_heads

    sizes = {"hidden_size": h, "intermediate_size": inter, "q_size": heads * hd, "kv_size": kv * hd}
    by_heads = width_heads(heads, kv, hd)

    def split_heads(k_expr, n_expr, par: str) -> tuple:
        expr = k_expr if par == "row" else n_expr
        return by_heads.get(expr, ()) if isinstance(expr, str) else ()

    layers: list[Layer] = []
    if isinstance(row.get("_layers"), list):
        layers = [(str(item["name"]), _width(item.get("in"), sizes, name), _width(item.get("out"), sizes, name),
                   par, split_heads(item.get("in"), item.get("out"), par))
                  for item in row["_layers"] if isinstance(item, dict) and "name" in item
                  for par in (str(item.get("parallel", "column")),)]
        rules = row.get("_fused") if isinstance(row.get("_fused"), list) else []
    if not layers:
        layers = [("q_proj", "hidden_size", "q_size"), ("k_proj", "hidden_size", "kv_size"),
                  ("v_proj", "hidden_size", "kv_size"), ("o_proj", "q_size", "hidden_size"),
                  ("gate_proj", "hidden_size", "intermediate_size"), ("up_proj", "hidden_size", "intermediate_size"),
                  ("down_proj", "intermediate_size", "hidden_size")]
        layers = [(n, sizes[k], sizes[o], BUILTIN_PARALLEL[n], split_heads(k, o, BUILTIN_PARALLEL[n]))
                  for n, k, o in layers]
        rules = BUILTIN_FUSED
    if tp > 1:
        layers = _shard(layers, tp, name)
    if fused:
        layers = _fuse(layers, rules, name)
    suffix = f"/tp{tp}" if tp > 1 else ""
    return [Shape(_short(lname) + suffix, k, n) for lname, k, n, *_ in layers]


def digits_value(digits: str) -> int:
    """A size or degree of ASCII digits (surrounding blanks allowed); one past MAX_DIM for any longer number
    (int() refuses over 4300 digits, and the range checks name the limit)."""
    digits = digits.strip().lstrip("0")
    return int(digits or "0") if len(digits) <= len(str(MAX_DIM)) else MAX_DIM + 1


def parse_shapes(spec: str | None, device_type: str) -> list[Shape]:
    """'llama-3-70b', 'llama-3-8b,4096x4096', '4096x1024,8192x8192', 'llama-3-70b@tp4' (one GPU's shard under
    4-way tensor parallelism), 'llama-3-8b+fused' or 'llama-3-70b@tp2+fused' (q/k/v and gate/up as the one GEMM
    each that a serving engine launches) -> shapes; None -> a default for the device (Llama-3-8B on a GPU, two
    small layers on the CPU)."""
    if spec is None:  # an empty --shapes "" is refused below, not taken for the default
        spec = "llama-3-8b" if device_type == "cuda" else CPU_DEFAULT
    table = _model_table()
    out: list[Shape] = []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    for part in parts:
        before = len(out)
        m = re.fullmatch(r"([0-9]+)\s*[xX]\s*([0-9]+)", part)
        if m:
            k, n = digits_value(m.group(1)), digits_value(m.group(2))
            if not (0 < k <= MAX_DIM and 0 < n <= MAX_DIM):
                raise UsageError(f"--shapes {part[:40]} is out of range", fix=f"allowed: K and N from 1 to {MAX_DIM}")
            out.append(Shape(f"{k}x{n}", k, n))
        elif (t := re.fullmatch(r"(.+?)(?:@tp([0-9]+))?(\+fused)?", part.lower())) and t.group(1) in table:
            tp = digits_value(t.group(2) or "1")
            if not 1 <= tp <= MAX_TP:
                raise UsageError(f"--shapes {part[:40]}: the tensor-parallel degree is out of range",
                                 fix=f"use @tp1 to @tp{MAX_TP}, e.g. llama-3-70b@tp2")
            out += _layers_of(t.group(1), table[t.group(1)], tp, fused=bool(t.group(3)))
            # named as parsed, so llama-3-8b@tp1 and LLAMA-3-8B are llama-3-8b and a model given twice is seen
            part = t.group(1) + (f"@tp{tp}" if tp > 1 else "") + (t.group(3) or "")
        else:
            raise UsageError(f"--shapes: unknown model or shape '{part[:60]}'",
                             fix=f"use KxN (e.g. 4096x14336), MODEL, MODEL@tpN, MODEL+fused or MODEL@tpN+fused with "
                                 f"a model of: {', '.join(sorted(table))}")
        if len(parts) > 1 and not m:  # several models name their layers alike (q_proj/tp8): say whose
            out[before:] = [Shape(f"{part}:{s.name}", s.K, s.N) for s in out[before:]]
    if not out:
        raise UsageError("--shapes is empty", fix="give a model name or KxN list")
    seen: set[str] = set()
    for s in out:  # results pair each kernel's row with the dense row of its shape by name
        if s.name in seen:
            raise UsageError(f"--shapes names '{s.name}' twice", fix="give each shape or model once")
        seen.add(s.name)
    return out
