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

BUILTIN_MODELS = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128),
}

# Kernels index K and N with 32-bit integers.
MAX_DIM = 2**31 - 1

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
    architecture's layer list under "_layers"."""
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
        table[str(name).lower()] = row
    return table


def _width(expr, sizes: dict[str, int], name: str) -> int:
    if isinstance(expr, int):
        return expr
    if isinstance(expr, str) and expr in sizes:
        return sizes[expr]
    raise UsageError(f"configs/models.yaml: model '{name}': layer width {expr!r} is not a number or one of "
                     f"{', '.join(sizes)}", fix="fix the layer table or give --shapes KxN")


def _layers_of(name: str, row: dict) -> list[Shape]:
    try:
        h = int(row["hidden_size"])
        inter = int(row["intermediate_size"])
        heads = int(row["num_attention_heads"])
        kv = int(row.get("num_key_value_heads") or heads)
        hd = int(row.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"configs/models.yaml: model '{name}' lacks hidden_size / intermediate_size / "
                         f"num_attention_heads", fix="add them or give --shapes KxN") from None
    sizes = {"hidden_size": h, "intermediate_size": inter, "q_size": heads * hd, "kv_size": kv * hd}
    if isinstance(row.get("_layers"), list):
        out = []
        for item in row["_layers"]:
            if not isinstance(item, dict) or "name" not in item:
                continue
            short = str(item["name"]).rsplit(".", 1)[-1] if "proj" in str(item["name"]) else str(item["name"])
            out.append(Shape(short, _width(item.get("in"), sizes, name), _width(item.get("out"), sizes, name)))
        if out:
            return out
    return [Shape("q_proj", h, heads * hd), Shape("k_proj", h, kv * hd), Shape("v_proj", h, kv * hd),
            Shape("o_proj", heads * hd, h), Shape("gate_proj", h, inter), Shape("up_proj", h, inter),
            Shape("down_proj", inter, h)]


def parse_shapes(spec: str | None, device_type: str) -> list[Shape]:
    """'llama-3-70b', 'llama-3-8b,4096x4096', '4096x1024,8192x8192' -> shapes; None -> a default for the
    device (Llama-3-8B on a GPU, two small layers on the CPU)."""
    if not spec:
        spec = "llama-3-8b" if device_type == "cuda" else CPU_DEFAULT
    table = _model_table()
    out: list[Shape] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*[xX]\s*(\d+)", part)
        if m:
            k, n = int(m.group(1)), int(m.group(2))
            if not (0 < k <= MAX_DIM and 0 < n <= MAX_DIM):
                raise UsageError(f"--shapes {part[:40]} is out of range", fix=f"allowed: K and N from 1 to {MAX_DIM}")
            out.append(Shape(f"{k}x{n}", k, n))
        elif part.lower() in table:
            out += _layers_of(part.lower(), table[part.lower()])
        else:
            raise UsageError(f"--shapes: unknown model or shape '{part}'",
                             fix=f"use KxN (e.g. 4096x14336) or one of: {', '.join(sorted(table))}")
    if not out:
        raise UsageError("--shapes is empty", fix="give a model name or KxN list")
    return out
