"""The layers `qtool select` asks about: from a checkpoint, a model name, or bare K,N shapes.

Everything here turns a source into `LayerGroup`s (one per distinct layer pattern + quantization + shape,
with layer numbers collapsed to '#'), applies the engine's view of the model (vLLM fuses q/k/v and
gate/up into one layer), and runs `select_kernel` once per group into a `SelectReport`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from qtool.errors import InputError, UsageError
from qtool.kernels.decls import (
    EngineDecls,
    is_int,
    is_str,
    list_of,
    load_engine,
    load_yaml,
    map_of,
    one_of,
    record,
    validate,
)
from qtool.kernels.devices import Device
from qtool.kernels.select import Heads, LayerQuant, select_kernel, width_heads
from qtool.paths import CONFIG_DIR
from qtool.report.select import SelectReport, layer_row
from qtool.scheme import QuantScheme
from qtool.spec import INT32_MAX

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn", "int8": "int8",
          "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float8_e4m3fn": "float8_e4m3fn"}

# What a bare `--format X` layer is when the flags leave it open: bits, group size, weight-scale granularity
# and the activations the layer is fed. W4A16 formats take the flags' 4-bit / g128; FP8 / INT8 layers are fed
# the model's activations (an engine's W8A8 method quantizes them, said in its row: act_quant); a W4A8 layer
# is fed FP8 activations.
SCALES = ("tensor", "channel", "group", "block")
SYNTHETIC: dict[str, dict[str, Any]] = {
    "gptq": {}, "gptq_v2": {}, "gptq_p": {}, "awq": {}, "marlin": {}, "ct": {},
    "fp8": {"bits": 8, "group_size": -1, "scale": "channel"},
    "int8": {"bits": 8, "group_size": -1, "scale": "channel"},
    "w4a8": {"bits": 4, "group_size": 128, "scale": "group", "act": "float8_e4m3fn"},
    "nvfp4": {"bits": 4, "group_size": 16, "scale": "group"},   # e2m1, FP8 scale per 16 inputs
    "mxfp4": {"bits": 4, "group_size": 32, "scale": "group"},   # e2m1, E8M0 scale per 32 inputs
    "mxfp8": {"bits": 8, "group_size": 32, "scale": "group"},   # e4m3, E8M0 scale per 32 inputs
    "bnb": {"bits": 4, "group_size": 64, "scale": "group"},     # bitsandbytes NF4/FP4, absmax per 64
    "gguf": {},                                                  # gguf:QTYPE, e.g. gguf:Q6_K
}
SIZE_KEYS = ("hidden_size", "intermediate_size", "q_size", "kv_size")

_WIDTH = lambda v, where: v if isinstance(v, int) and not isinstance(v, bool) else one_of(*SIZE_KEYS)(v, where)  # noqa: E731

MODELS_FILE = record({
    "schema": one_of("qtool.models/v1"),
    "architectures": map_of(is_str, record({
        "prefix": is_str,
        "layers": list_of(record({"name": is_str, "in": _WIDTH, "out": _WIDTH,
                                  "parallel": one_of("column", "row", "replicated")},
                                 required=("name", "in", "out", "parallel"))),
        "fused": list_of(record({"name": is_str, "parts": list_of(is_str)}, required=("name", "parts"))),
    }, required=("prefix", "layers"))),
    "parallel_rules": record({"column": list_of(is_str), "row": list_of(is_str)}),
    "models": map_of(is_str, record({
        "arch": is_str, "hidden_size": is_int, "intermediate_size": is_int, "num_attention_heads": is_int,
        "num_key_value_heads": is_int, "head_dim": is_int, "num_hidden_layers": is_int,
        "dtype": one_of("fp16", "bf16", "fp32"),
    }, required=("arch", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "num_hidden_layers"))),
}, required=("schema", "architectures", "models"))

_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class LayerGroup:
    """Identical layers: `pattern` is the module name with layer numbers as '#', `count` how many."""

    pattern: str
    count: int
    layer: LayerQuant


# The quantization --model / --layer ask about when no flag says otherwise (a checkpoint carries its own).
DEFAULT_SCHEME = QuantScheme(format="gptq", bits=4, group_size=128, sym=True, desc_act=False)


@dataclass(frozen=True)
class SyntheticLayer:
    """A --model / --layer quantization with the format's defaults filled in (SYNTHETIC): bits, group size,
    weight-scale granularity, block shape [rows, cols] of block scales, and the activations it is fed."""

    scheme: QuantScheme
    scale: str | None
    block: tuple[int, int] | None

    def activation(self, dtype: str | None, model_default: str = "float16") -> str:
        if dtype is not None:
            return dtype_name(dtype)
        return SYNTHETIC.get(str(self.scheme.format).split(":", 1)[0], {}).get("act", model_default)


# Formats whose weights carry one scale per group of K (a group of all of K: per channel), never per tensor or
# per block; and formats whose codes are floats, which have no zero point.
GROUP_SCALED = ("gptq", "gptq_v2", "gptq_p", "awq", "marlin", "bnb", "gguf")
FLOAT_CODED = ("fp8", "nvfp4", "mxfp4", "mxfp8")
# What a format fixes by definition (its SYNTHETIC row, or the GGUF qtype's): FP8 and INT8 codes are 8-bit, a
# W4A8 layer's 4-bit; NVFP4 / MX scale groups of 16 / 32 and a GGUF qtype its block. A flag asking for another
# value describes no layer of that format.
FIXED = {"fp8": ("bits",), "int8": ("bits",), "w4a8": ("bits",), "nvfp4": ("bits", "group_size"),
         "mxfp4": ("bits", "group_size"), "mxfp8": ("bits", "group_size"), "gguf": ("bits", "group_size")}
# Formats with no g_idx to order the inputs by (act-order): float codes, INT8's per-channel or block scales,
# bitsandbytes' blocks of the flattened weight.
NO_ACT_ORDER = (*FLOAT_CODED, "int8", "bnb")


def resolve_scheme(q: QuantScheme, scale: str | None = None, block: tuple[int, int] | None = None) -> SyntheticLayer:
    """Fill what the flags left open (bits / group_size None) from the format's row; refuse a format nothing
    knows, and flags the format contradicts (an answer for a layer other than the one asked about would be
    untrue). A scheme without a format is GPTQ's (DEFAULT_SCHEME)."""
    fmt = check_format(q.format or "gptq")
    family = fmt.split(":", 1)[0]
    if scale in ("tensor", "block") and family in GROUP_SCALED:
        raise UsageError(f"--scale {scale}: {fmt} weights carry one scale per group of inputs",
                         fix="use --scale group with --group-size G, or --scale channel (--group-size -1)")
    if block is not None and scale != "block":
        said = scale or f"{SYNTHETIC.get(family, {}).get('scale', 'group')} ({fmt}'s default)"
        raise UsageError(f"--block applies to --scale block, and the scale here is {said}",
                         fix="add --scale block, or drop --block")
    if q.sym is False and family in FLOAT_CODED:
        raise UsageError(f"--asym: {fmt} codes are floats, which have no zero point", fix="drop --asym")
    if scale == "channel" and q.group_size not in (None, -1) or scale == "group" and q.group_size == -1:
        raise UsageError(f"--scale {scale} with --group-size {q.group_size}: one scale per channel is "
                         "--group-size -1", fix="drop one of the two")
    if q.desc_act and family in NO_ACT_ORDER:
        raise UsageError(f"--desc-act: {fmt} has no g_idx, so no act-order", fix="drop --desc-act")
    d = dict(SYNTHETIC.get(family, {}))
    if fmt.startswith("gguf:"):
        d.update(gguf_defaults(fmt.split(":", 1)[1]))
    for key in FIXED.get(family, ()):
        asked = getattr(q, key)
        if asked is not None and asked != d[key]:
            flag = "--" + key.replace("_", "-")
            what = f"{d[key]}-bit codes" if key == "bits" else f"one scale per group of {d[key]} inputs"
            raise UsageError(f"{flag} {asked}: {fmt} has {what}", fix=f"drop {flag}")
    if "group_size" in FIXED.get(family, ()) and scale not in (None, "group"):
        raise UsageError(f"--scale {scale}: {fmt} has one scale per group of {d['group_size']} inputs",
                         fix="drop --scale")
    scale = scale or d.get("scale")
    block = block if block is not None else ((128, 128) if scale == "block" else None)
    group = q.group_size if q.group_size is not None else d.get("group_size", 128)
    if scale == "block" and block is not None:
        group = block[1]   # the K extent of a block, as inspect reports block-scaled layers
    scheme = replace(q, format=fmt, bits=q.bits if q.bits is not None else d.get("bits", 4), group_size=group,
                     sym=True if q.sym is None else q.sym, desc_act=bool(q.desc_act))
    return SyntheticLayer(scheme, scale, block)


def gguf_defaults(qtype: str) -> dict[str, int]:
    """Bits and block size of a GGML qtype by name (gguf.GGML_QUANT_SIZES), or a UsageError."""
    import gguf

    from qtool.io.gguf_reader import nominal_bits

    try:
        t = gguf.GGMLQuantizationType[qtype]
    except KeyError:
        raise UsageError(f"unknown GGUF qtype {qtype!r}",
                         fix="use a GGML type name, e.g. gguf:Q4_K, gguf:Q6_K, gguf:Q8_0") from None
    bits = nominal_bits(qtype)
    if bits is None or bits > 8:
        raise UsageError(f"gguf:{qtype} is not a quantized type", fix="use e.g. gguf:Q4_K")
    return {"bits": bits, "group_size": gguf.GGML_QUANT_SIZES[t][0]}


def check_format(fmt: str) -> str:
    """A --format value select can describe, or a UsageError listing them."""
    family, _, qtype = fmt.partition(":")
    if family == "gguf" and qtype:
        gguf_defaults(qtype)
        return fmt
    if family in SYNTHETIC and family != "gguf" and not qtype:
        return fmt
    if family == "gguf":
        raise UsageError("--format gguf needs its qtype", fix="e.g. --format gguf:Q6_K")
    close = difflib.get_close_matches(fmt, list(SYNTHETIC), n=1, cutoff=0.6)
    guess = f"did you mean '{close[0]}'? " if close else ""
    raise UsageError(f"unknown --format {fmt!r}",
                     fix=f"{guess}formats: {', '.join(k for k in SYNTHETIC if k != 'gguf')}, gguf:QTYPE")


# ------------------------------------------------------------------------------------------------------
# models.yaml
# ------------------------------------------------------------------------------------------------------

def load_models(config_dir: Path | None = None) -> dict[str, Any]:
    return _models_cached(str((config_dir or CONFIG_DIR) / "models.yaml"))


@lru_cache(maxsize=4)
def _models_cached(path: str) -> dict[str, Any]:
    p = Path(path)
    data = validate(load_yaml(p), MODELS_FILE, p)
    for name, m in data["models"].items():
        if m["arch"] not in data["architectures"]:
            from qtool.errors import SpecError

            raise SpecError(f"model {name!r} names undeclared architecture {m['arch']!r}", path=p)
    return data


def collapse(name: str) -> str:
    """'model.layers.12.mlp.down_proj' -> 'model.layers.#.mlp.down_proj'."""
    return _LAYER_NUMBER.sub("#", name)


def parallel_of(name: str, rules: dict[str, Sequence[str]]) -> str:
    """column / row / replicated for a module name, by the longest matching name suffix."""
    parts = name.split(".")
    best, best_len = "replicated", 0
    for kind in ("column", "row"):
        for rule in rules.get(kind, ()):
            r = rule.split(".")
            if len(r) > best_len and parts[-len(r):] == r:
                best, best_len = kind, len(r)
    return best


def parse_ints(flag: str, text: str, count: int | None = None) -> tuple[int, ...]:
    """`1,16,64` -> (1, 16, 64): integers 1..INT32_MAX (a width or row count no engine indexes past int32),
    `count` of them when given."""
    try:
        vals = tuple(int(x) for x in text.split(","))
        if any(not 1 <= v <= INT32_MAX for v in vals) or (count is not None and len(vals) != count):
            raise ValueError
    except ValueError:
        want = f"{count} integers" if count else "integers"
        raise UsageError(f"bad {flag} {text!r}", fix=f"write {want} from 1 to {INT32_MAX} separated by commas, "
                         "e.g. " + ("128,128" if count == 2 else "1,16,64")) from None
    return vals


def dtype_name(flag: str | None, default: str = "float16") -> str:
    if flag is None:
        return default
    try:
        return DTYPES[flag.lower()]
    except KeyError:
        raise UsageError(f"unknown --dtype {flag!r}", fix="use fp16, bf16, fp32, fp8 or int8") from None


def model_groups(model: str, q: QuantScheme, dtype: str | None = None,
                 config_dir: Path | None = None, scale: str | None = None,
                 block: tuple[int, int] | None = None) -> list[LayerGroup]:
    """One group per linear layer of one decoder block, counted over all blocks."""
    data = load_models(config_dir)
    if model not in data["models"]:
        close = difflib.get_close_matches(model, list(data["models"]), n=1, cutoff=0.5)
        guess = f"did you mean '{close[0]}'? " if close else ""
        raise UsageError(f"unknown model '{model}'",
                         fix=f"{guess}models: {', '.join(data['models'])} (configs/models.yaml)")
    m = data["models"][model]
    arch = data["architectures"][m["arch"]]
    sizes = {"hidden_size": m["hidden_size"], "intermediate_size": m["intermediate_size"],
             "q_size": m["num_attention_heads"] * m["head_dim"],
             "kv_size": m["num_key_value_heads"] * m["head_dim"]}
    syn = resolve_scheme(q, scale, block)
    q = syn.scheme
    act = syn.activation(dtype, DTYPES[m.get("dtype", "bf16")])
    heads = width_heads(m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"])
    prefix = arch["prefix"].replace("{i}", "#")
    out = []
    for row in arch["layers"]:
        k = sizes[row["in"]] if isinstance(row["in"], str) else row["in"]
        n = sizes[row["out"]] if isinstance(row["out"], str) else row["out"]
        name = f"{prefix}.{row['name']}"
        split = row["in"] if row["parallel"] == "row" else row["out"]
        layer = LayerQuant(name=name, in_features=k, out_features=n, scheme=q, act_dtype=act,
                           parallel=row["parallel"], scale=syn.scale, block=syn.block, heads=heads.get(split, ()))
        out.append(LayerGroup(name, m["num_hidden_layers"], layer))
    return out


def layer_groups(specs: Iterable[str], q: QuantScheme, dtype: str | None = None, scale: str | None = None,
                 block: tuple[int, int] | None = None) -> list[LayerGroup]:
    """`--layer K,N[,row|col]` -> one group each (default column-parallel)."""
    syn = resolve_scheme(q, scale, block)
    q = syn.scheme
    out = []
    for i, spec in enumerate(specs):
        parts = [p.strip() for p in spec.split(",")]
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            k, n = int(parts[0]), int(parts[1])
            parallel = {"row": "row", "col": "column", "column": "column",
                        "none": "replicated"}[parts[2].lower()] if len(parts) == 3 else "column"
            if not (1 <= k <= INT32_MAX and 1 <= n <= INT32_MAX):
                raise ValueError
        except (ValueError, KeyError):
            raise UsageError(f"bad --layer {spec!r}", fix=f"write K,N or K,N,row / K,N,col with K and N from 1 to "
                                                          f"{INT32_MAX}, e.g. --layer 28672,8192,row") from None
        name = f"layer{i}[K={k},N={n},{parallel}]"
        layer = LayerQuant(name=name, in_features=k, out_features=n, scheme=q,
                           act_dtype=syn.activation(dtype), parallel=parallel, scale=syn.scale, block=syn.block)
        out.append(LayerGroup(name, 1, layer))
    return out


# ------------------------------------------------------------------------------------------------------
# Checkpoints (through qtool.inspect)
# ------------------------------------------------------------------------------------------------------

def inspect_modules(path: Path) -> list[Any]:
    """The per-module view of a checkpoint: objects with name, scheme (format, bits, group_size, sym,
    desc_act), in_features, out_features (qtool.inspect's ModuleReport). The one place select depends on inspect."""
    from qtool.inspect import inspect_path

    report = inspect_path(path, deep=False)
    errors = [a for a in report.anomalies if a.severity == "error"]
    if errors:
        # A broken or self-contradicting checkpoint has no honest kernel plan: say what is wrong instead.
        first = errors[0]
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise InputError(f"{first.message}{more}", path=path, tensor=first.tensor,
                         fix="run `qtool inspect` on it for every problem")
    return list(report.modules)


def path_groups(path: Path, dtype: str | None = None, modules: Sequence[Any] | None = None,
               config_dir: Path | None = None) -> tuple[list[LayerGroup], list[str], list[str]]:
    """Distinct (pattern, quantization, shape) groups of a checkpoint's quantized linear modules, notes about
    modules left out (dense, expert stacks, missing a shape), and the patterns of the quantized modules no kernel
    can be chosen for (bits or shape unrecorded): a plan that leaves them out is no plan for the checkpoint."""
    mods = inspect_modules(path) if modules is None else list(modules)
    rules = load_models(config_dir).get("parallel_rules", {})
    heads = config_heads(path)
    groups: dict[tuple, list] = {}
    dense: dict[str, list[str]] = {}
    shapeless: dict[str, list[str]] = {}
    acts: set[str] = set()
    config_acts: set[str] = set()
    stacks: dict[str, list[str]] = {}
    for m in mods:
        s = m.scheme
        fmt = str(s.format)
        if fmt in ("dense", "unknown"):
            dense.setdefault(fmt, []).append(str(m.name))
            continue
        if (s.extra or {}).get("experts"):  # an [E, O, I] stack (GGUF, gpt-oss): fused-MoE weights
            stacks.setdefault(fmt, []).append(str(m.name))
            continue
        if s.bits is None or m.in_features is None or m.out_features is None:
            shapeless.setdefault(fmt, []).append(str(m.name))
            continue
        scale, block = scale_of(m)
        quantized_act = act_of(m)
        if fmt == "ct" and quantized_act is not None:
            # pack-quantized weights whose config also quantizes the activations: W4A8 (FP8 activations) or
            # WNA8 with int8 activations, each a method of its own in the engines
            fmt = {"float8_e4m3fn": "w4a8" if s.bits == 4 else fmt, "int8": "wna8_int8"}.get(quantized_act, fmt)
        if quantized_act is not None and dtype is None:
            # the config quantizes this layer's activations: that is the operand its kernel multiplies
            # (an explicit --dtype asks what would happen with other activations, and wins)
            act = quantized_act
            config_acts.add(f"{fmt}: {act}")
        else:
            act = dtype_name(dtype)
            acts.add(act)
        # what the header leaves open is read as the engines' defaults: one group, symmetric, no act-order
        scheme = replace(s, format=fmt, bits=int(s.bits),
                         group_size=int(s.group_size) if s.group_size is not None else -1,
                         sym=True if s.sym is None else bool(s.sym), desc_act=bool(s.desc_act))
        layer = LayerQuant(name=str(m.name), in_features=int(m.in_features), out_features=int(m.out_features),
                           scheme=scheme, act_dtype=act, parallel=parallel_of(str(m.name), rules), method=source_method(m),
                           scale=scale, block=block, heads=heads.get(str(m.name).rsplit(".", 1)[-1], ()))
        key = (collapse(layer.name), layer.in_features, layer.out_features, layer.format, layer.bits,
               layer.group_size, layer.sym, layer.desc_act, layer.scale, layer.block, layer.method)
        groups.setdefault(key, []).append(layer)
    if not groups and not dense and not shapeless and not stacks:
        raise InputError("no linear modules found", path=path, fix="run `qtool inspect` on it to see what it holds")
    out = [LayerGroup(key[0], len(layers), layers[0]) for key, layers in groups.items()]
    notes = [f"{len(n)} {fmt} module(s) not quantized: skipped ({named(n)})" for fmt, n in dense.items()]
    notes += [f"{len(n)} {fmt} mixture-of-experts stack(s) not planned: fused-MoE weights, which the engines run "
              f"through their MoE methods; select plans linear layers only ({named(n)})" for fmt, n in stacks.items()]
    notes += [f"{len(n)} {fmt} module(s) whose bits or [out, in] shape the checkpoint does not record: no kernel "
              f"can be chosen for them ({named(n)}; `qtool inspect --deep` reads what the data holds)"
              for fmt, n in shapeless.items()]
    if not out:
        why = [w for w, n in (("is a mixture-of-experts stack", stacks), ("lacks a shape or bits", shapeless)) if n]
        notes.append("no selectable layer: " + (f"every quantized module {' or '.join(why)}" if why
                                                else "no module is quantized"))
    if dtype is None and "float16" in acts:
        notes.append("activation dtype float16 assumed (--dtype bf16 to plan for bf16)")
    for fa in sorted(config_acts):
        notes.append(f"{fa} activations, as the checkpoint's config quantizes them (input_activations)")
    return out, notes, sorted({collapse(n) for names in shapeless.values() for n in names})


# How many module patterns a note names before it counts the rest (a model's layers collapse to a few).
NAMED_MAX = 8


def named(names: Iterable[str]) -> str:
    """The distinct patterns of module names (layer numbers as '#'), sorted: the first NAMED_MAX, then a count."""
    patterns = sorted({collapse(n) for n in names})
    more = len(patterns) - NAMED_MAX
    return ", ".join(patterns[:NAMED_MAX]) + (f", and {more} more" if more > 0 else "")


# The attention projections whose split dimension is heads, by the last part of the module name: q (and o's
# inputs) are the attention heads, k and v the key/value heads; a stored qkv_proj is all three.
HEAD_MODULES = {"q": ("q_proj", "query", "o_proj", "dense"), "kv": ("k_proj", "v_proj", "key", "value"),
                "qkv": ("qkv_proj",)}
# The config.json keys the heads are read from (a multimodal config holds them under text_config).
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim")


def config_heads(path: Path | None) -> dict[str, tuple[Heads, ...]]:
    """Module name ending -> the heads tensor parallelism splits it by, from the checkpoint's config.json
    (num_attention_heads, num_key_value_heads, head_dim); {} where there is none. A width that is not the heads'
    (an `o_proj` of another shape, a `dense` that is an MLP's) is split evenly: split_width checks the sum.
    A key given as anything but a positive integer (null: not given) is an InputError: read past, it would
    turn a TP degree that splits a head into one that passes."""
    from qtool.io.checkpoint import model_config

    if path is None:
        return {}
    cfg = model_config(path)
    where = ""
    if "num_attention_heads" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg, where = cfg["text_config"], "text_config."
    heads, kv, hidden, dim = (cfg.get(k) for k in HEAD_KEYS)
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0  # noqa: E731
    config = (path if path.is_dir() else path.parent) / "config.json"
    for key, value in zip(HEAD_KEYS, (heads, kv, hidden, dim)):
        if value is not None and not ok(value):
            raise InputError(f"{where}{key} is {json.dumps(value)[:40]}, not a positive integer", path=config,
                             fix=f"write the model's {key} as an integer, or remove the key")
    if ok(heads) and ok(kv) and heads % kv:
        raise InputError(f"{where}num_key_value_heads {kv} does not divide num_attention_heads {heads}", path=config,
                         fix="write the model's head counts: each key/value head serves a whole number of heads")
    if not ok(heads) or not (ok(dim) or ok(hidden) and hidden % heads == 0):
        return {}
    dim = dim if ok(dim) else hidden // heads
    kv = kv if ok(kv) else heads
    w = width_heads(heads, kv, dim)
    by_kind = {"q": w["q_size"], "kv": w["kv_size"], "qkv": w["q_size"] + 2 * w["kv_size"]}
    return {name: by_kind[kind] for kind, names in HEAD_MODULES.items() for name in names}


def scale_of(m: Any) -> tuple[str | None, tuple[int, int] | None]:
    """Weight-scale granularity of an inspected FP8 / INT8 module (inspect keeps it in the scheme's extra facts)
    and a block grid's [out, in] block; None for group-quantized formats, whose group_size says it."""
    grid = m.scheme.extra.get("weight_scale")
    block = m.scheme.extra.get("block")
    return grid, (tuple(block) if grid == "block" and block else None)



def act_of(m: Any) -> str | None:
    """The activation dtype an inspected module's config quantizes its inputs to (inspect keeps it in the
    scheme's extra facts, e.g. a compressed-tensors W4A8 group: fp8); None when the config leaves the
    activations alone."""
    act = m.scheme.extra.get("activations")
    return DTYPES[act] if act else None


def source_method(m: Any) -> str | None:
    """The quantization a serialized Marlin module came from. A qtool Marlin file from AWQ always keeps its
    qzeros (formats/marlin.py), so zero points mean AWQ; legacy B/s files are GPTQ's 4-bit symmetric."""
    if str(m.scheme.format) != "marlin":
        return None
    return "awq" if m.scheme.sym is False else "gptq"


# ------------------------------------------------------------------------------------------------------
# vLLM's fused layers
# ------------------------------------------------------------------------------------------------------

def fused_rules(config_dir: Path | None = None) -> list[dict]:
    """configs/models.yaml's `fused` entries of every architecture: {name, parts}."""
    return [f for arch in load_models(config_dir)["architectures"].values() for f in arch.get("fused", ())]


def fused_parts(name: str, rule: dict, lookup: Mapping[str, Any]) -> tuple[str, list[Any]] | None:
    """Where `name` is the rule's first part: the prefix before it and each part of the rule looked up by its
    full name (None where absent); None where `name` is not the first part."""
    first = rule["parts"][0]
    if not (name == first or name.endswith("." + first)):
        return None
    prefix = name[: len(name) - len(first)]
    return prefix, [lookup.get(prefix + p) for p in rule["parts"]]


def fuse_groups(groups: list[LayerGroup], config_dir: Path | None = None,
                engine: str = "vLLM") -> tuple[list[LayerGroup], list[str]]:
    """Merge groups vLLM builds as one layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj): same K, same
    quantization, N summed. Parts that are missing or differ stay separate."""
    by_pattern = {g.pattern: g for g in groups}
    used: set[str] = set()
    merged: dict[str, LayerGroup] = {}
    notes = []
    for rule in fused_rules(config_dir):
        for g in groups:
            found = fused_parts(g.pattern, rule, by_pattern)
            if found is None:
                continue
            prefix, parts = found
            if any(p is None or p.pattern in used for p in parts):
                continue
            lay = [p.layer for p in parts]
            same = {(x.in_features, x.format, x.bits, x.group_size, x.sym, x.desc_act) for x in lay}
            if len(same) != 1 or len({p.count for p in parts}) != 1:
                notes.append(f"{prefix + rule['name']}: parts differ in shape or quantization; kept separate")
                continue
            name = prefix + rule["name"]
            heads = tuple(h for x in lay for h in x.heads) if all(x.heads for x in lay) else ()
            fused = replace(lay[0], name=name, out_features=sum(x.out_features for x in lay), parallel="column",
                            heads=heads)
            merged[parts[0].pattern] = LayerGroup(name, parts[0].count, fused)
            used.update(p.pattern for p in parts)
    out = []
    for g in groups:
        if g.pattern in merged:
            out.append(merged[g.pattern])
        elif g.pattern not in used:
            out.append(g)
    if merged:
        notes.append(f"{engine} fuses " + ", ".join(sorted({g.pattern.rsplit('.', 1)[-1] for g in merged.values()}))
                     + " into one layer each (N summed)")
    return out, notes


# ------------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------------

def check_disabled(disabled: Iterable[str], decls: EngineDecls) -> frozenset[str]:
    names = set(decls.names())
    for d in disabled:
        if d not in names and "," in d and all(x.strip() in names for x in d.split(",")):
            # VLLM_DISABLED_KERNELS is one comma-separated list; --disable takes a kernel per flag
            raise UsageError(f"--disable {d!r}: one kernel per --disable",
                             fix=" ".join(f"--disable {x.strip()}" for x in d.split(",")))
        if d not in names:
            close = difflib.get_close_matches(d, sorted(names), n=1, cutoff=0.6)
            guess = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(f"--disable {d!r}: no such {decls.engine} kernel",
                             fix=f"{guess}see configs/kernels/{decls.engine}.yaml for names")
    return frozenset(disabled)


# a routed expert's linear (`mlp.experts.#.gate_proj`, Mixtral's `block_sparse_moe.experts.#.w1`), by pattern
EXPERT_PATTERN = re.compile(r"(^|\.)experts\.#\.")
EXPERTS_NOT_PLANNED = "mixture-of-experts expert layers not planned"  # the note's words (validate finds it)


def plan_select(groups: list[LayerGroup], device: Device, engine: str = "gptqmodel", tp: int = 1,
                disabled: Iterable[str] = (), notes: Sequence[str] = (), source: str | None = None,
                config_dir: Path | None = None, ms: Sequence[int] = (),
                unplanned: Sequence[str] = ()) -> SelectReport:
    """Run `select_kernel` for every group and collect the verdicts into one report.

    ms: batch rows M for which to resolve the kernel each call runs (M-bucketed backends).
    unplanned: patterns of quantized modules no kernel can be chosen for (path_groups)."""
    for m in ms:
        if m < 1:
            raise UsageError(f"--m {m}: batch rows must be >= 1")
    if tp < 1:
        raise UsageError(f"--tp {tp}: tensor-parallel size must be >= 1")
    decls = load_engine(engine, config_dir)
    off = check_disabled(disabled, decls)
    notes = list(notes)
    if decls.engine in ("vllm", "sglang"):
        groups, fuse_notes = fuse_groups(groups, config_dir, {"vllm": "vLLM", "sglang": "SGLang"}[decls.engine])
        notes += fuse_notes
    if decls.fused_moe:
        experts = [g for g in groups if EXPERT_PATTERN.search(g.pattern)]
        if experts:
            groups = [g for g in groups if not EXPERT_PATTERN.search(g.pattern)]
            notes.append(f"{sum(g.count for g in experts)} {EXPERTS_NOT_PLANNED}: {decls.fused_moe} "
                         f"({named(g.pattern for g in experts)})")
    if decls.engine == "gptqmodel" and tp > 1:
        notes.append("GPTQModel has no tensor parallelism of its own: per-rank shapes are shown as if each "
                     "rank loaded a shard (sharded_load)")
    rows = [layer_row(g.pattern, g.count, select_kernel(g.layer, device, decls, off, tp, ms=ms)) for g in groups]
    return SelectReport(engine=decls.engine, device=device, tp=tp, layers=rows, source=source,
                        disabled=sorted(off), notes=notes, ms=list(ms), unplanned=list(unplanned))
