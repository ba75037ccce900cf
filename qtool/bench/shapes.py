"""The linear-layer shapes a benchmark runs: named models or explicit `KxN` lists.

Shapes are K x N (in_features x out_features) of one decoder layer's projections. The model table is read
from configs/models.yaml when that file exists (keys: `models: {name: {hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads[, head_dim]}}` or an explicit `layers:` list); otherwise from the
built-in table below (Llama 3 configs: 8B hidden 4096, MLP 14336, 32 heads, 8 KV heads; 70B hidden 8192,
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
    from qtool.paths import CONFIG_DIR

    table = {k: dict(v) for k, v in BUILTIN_MODELS.items()}
    path = CONFIG_DIR / "models.yaml"
    if path.is_file():
        import yaml

        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            return table
        models = data.get("models", data) if isinstance(data, dict) else {}
        if isinstance(models, dict):
            for name, row in models.items():
                if isinstance(row, dict):
                    table[str(name).lower()] = row
    return table


def _layers_of(name: str, row: dict) -> list[Shape]:
    if isinstance(row.get("layers"), list):
        out = []
        for item in row["layers"]:
            try:
                out.append(Shape(str(item["name"]), int(item.get("in_features", item.get("K"))),
                                 int(item.get("out_features", item.get("N")))))
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"configs/models.yaml: model '{name}' has a malformed layers entry {item!r}",
                                 fix="give name, in_features, out_features") from None
        return out
    try:
        h = int(row["hidden_size"])
        inter = int(row["intermediate_size"])
        heads = int(row["num_attention_heads"])
        kv = int(row.get("num_key_value_heads", heads))
        hd = int(row.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"configs/models.yaml: model '{name}' lacks hidden_size / intermediate_size / "
                         f"num_attention_heads", fix="add them or give --shapes KxN") from None
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
            if k <= 0 or n <= 0:
                raise UsageError(f"--shapes: '{part}' must have positive K and N")
            out.append(Shape(f"{k}x{n}", k, n))
        elif part.lower() in table:
            out += _layers_of(part.lower(), table[part.lower()])
        else:
            raise UsageError(f"--shapes: unknown model or shape '{part}'",
                             fix=f"use KxN (e.g. 4096x14336) or one of: {', '.join(sorted(table))}")
    if not out:
        raise UsageError("--shapes is empty", fix="give a model name or KxN list")
    return out
