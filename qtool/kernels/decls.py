"""Kernel declarations as data: `configs/kernels/<engine>.yaml`, loaded and schema-checked.

One YAML file per engine (gptqmodel, vllm, qtool). A row says what one kernel accepts: formats with their
AUTO priority, bits, group sizes, act-order, symmetry, activation and word dtypes, shape divisibility, TP
behaviour, and the runtime floors (platforms, compute capability, shared memory, CPU flags, packages).
`qtool.kernels.select` reads these rows; nothing else knows a kernel's rules.

Every file is validated on load against `KERNEL_ROW` / `ENGINE_FILE` below: an unknown key, a wrong type or
a list naming an undeclared kernel is a `SpecError` naming the file and the key, so a typo cannot silently
widen what a kernel accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from qtool.errors import SpecError
from qtool.paths import CONFIG_DIR

ENGINES = ("gptqmodel", "vllm", "sglang", "qtool")
PLATFORMS = ("cuda", "rocm", "cpu", "xpu", "mps", "npu", "all")
WALKS = ("priority", "list")
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "int8")
SCALES = ("tensor", "channel", "group", "block")
PACK_DTYPES = ("int8", "int16", "int32", "int64")
MAX_DECL_BYTES = 4 << 20

# --------------------------------------------------------------------------------------------------------
# A tiny schema language: a validator is `check(value, where) -> converted value`, raising SpecError.
# --------------------------------------------------------------------------------------------------------

Check = Callable[[Any, str], Any]


class _Invalid(Exception):
    """Raised inside validators; turned into one SpecError naming the file by `validate`."""


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def is_str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _Invalid(f"{where} must be a string, got {_type_name(v)}")
    return v


def is_int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Invalid(f"{where} must be an integer, got {v!r}")
    return v


def is_bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _Invalid(f"{where} must be true or false, got {v!r}")
    return v


def is_num(v: Any, where: str) -> float:
    # .nan / .inf are YAML floats, but no bandwidth or peak; reported, they would make --json invalid JSON
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Invalid(f"{where} must be a finite number, got {v!r}")
    return float(v)


_CC = re.compile(r"^\d{1,2}\.\d$")


def is_cc(v: Any, where: str) -> tuple[int, int]:
    """A compute capability written as a quoted "major.minor" string (YAML would read 9.0 as a float)."""
    if not isinstance(v, str) or not _CC.match(v):
        raise _Invalid(f"{where} must be a quoted \"major.minor\" compute capability, got {v!r}")
    major, minor = v.split(".")
    return int(major), int(minor)


def one_of(*choices: Any) -> Check:
    def check(v: Any, where: str) -> Any:
        if v not in choices:
            raise _Invalid(f"{where} must be one of {list(choices)}, got {v!r}")
        return v
    return check


def nullable(inner: Check) -> Check:
    def check(v: Any, where: str) -> Any:
        return None if v is None else inner(v, where)
    return check


def either(*checks: Check) -> Check:
    def check(v: Any, where: str) -> Any:
        errors = []
        for c in checks:
            try:
                return c(v, where)
            except _Invalid as e:
                errors.append(str(e))
        raise _Invalid(" or ".join(errors))
    return check


def list_of(inner: Check, *, nonempty: bool = True) -> Check:
    def check(v: Any, where: str) -> tuple:
        if not isinstance(v, list):
            raise _Invalid(f"{where} must be a list, got {_type_name(v)}")
        if nonempty and not v:
            raise _Invalid(f"{where} must not be empty")
        return tuple(inner(x, f"{where}[{i}]") for i, x in enumerate(v))
    return check


def range_of(inner: Check) -> Check:
    """[lo, hi] with lo <= hi: a window read as m_range[0]..m_range[-1], which a reversed or longer list would
    silently empty or narrow."""
    def check(v: Any, where: str) -> tuple:
        pair = list_of(inner)(v, where)
        if len(pair) != 2 or pair[0] > pair[1]:
            raise _Invalid(f"{where} must be [lo, hi] with lo <= hi, got {v!r}")
        return pair
    return check


def map_of(key: Check, value: Check) -> Check:
    def check(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise _Invalid(f"{where} must be a mapping, got {_type_name(v)}")
        return {key(k, f"{where} key {k!r}"): value(x, f"{where}.{k}") for k, x in v.items()}
    return check


def record(fields: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A mapping with exactly these keys (a subset); unknown keys are errors."""
    def check(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise _Invalid(f"{where} must be a mapping, got {_type_name(v)}")
        for k in v:
            if k not in fields:
                raise _Invalid(f"{where}: unknown key {k!r} (valid: {', '.join(sorted(fields))})")
        for k in required:
            if k not in v:
                raise _Invalid(f"{where}: missing required key {k!r}")
        return {k: fields[k](x, f"{where}.{k}") for k, x in v.items()}
    return check


def validate(data: Any, schema: Check, path: Path, where: str = "") -> Any:
    try:
        return schema(data, where or path.name)
    except _Invalid as e:
        raise SpecError(str(e), path=path, fix="fix the declaration file (see its header comment)") from None


def load_yaml(path: Path) -> Any:
    """yaml.safe_load of a bounded, UTF-8 declarations file; errors name the file and line."""
    import yaml

    if not path.is_file():
        raise SpecError("declarations file not found", path=path,
                        fix="run from a qtool checkout, or restore configs/ from git")
    if path.stat().st_size > MAX_DECL_BYTES:
        raise SpecError(f"declarations file is over {MAX_DECL_BYTES} bytes", path=path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SpecError("declarations file is not UTF-8 text", path=path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(f"invalid YAML{line}: {getattr(e, 'problem', None) or e}", path=path) from None


# --------------------------------------------------------------------------------------------------------
# The kernel-row schema (shared by every engine) and the engine-file schema.
# --------------------------------------------------------------------------------------------------------

_GROUP = either(is_int, one_of("K"))

KERNEL_ROW = record({
    "name": is_str,
    "kind": one_of("kernel", "gate"),
    "backend": is_str,
    "method": is_str,
    "file": is_str,
    "source": is_str,
    "note": is_str,
    "fallback": is_str,                         # what choosing this kernel gives up (said in the layer notes)
    "platforms": list_of(one_of(*PLATFORMS)),
    "reject_platforms": list_of(one_of(*PLATFORMS)),
    # contract: what the checkpoint and layer must look like
    "formats": map_of(is_str, is_int),          # engine format name -> AUTO priority (0 = explicit only)
    "bits": list_of(is_int),
    "group_sizes": list_of(_GROUP),             # "K": a group equal to the full input width
    "desc_act": list_of(is_bool),
    "sym": list_of(is_bool),
    "training": is_bool,
    "act_dtypes": list_of(one_of(*DTYPES)),
    "pack_dtypes": list_of(one_of(*PACK_DTYPES)),
    "in_divisible": is_int,                     # GPTQModel SUPPORTS_IN_FEATURES_DIVISIBLE_BY
    "out_divisible": is_int,
    "auto_padding": is_bool,
    "sharded_load": is_bool,
    "weight_types": list_of(is_str),            # vLLM scalar types, zero points or not
    "weight_types_zp": list_of(is_str),         # ... allowed when the layer has zero points
    "weight_types_no_zp": list_of(is_str),      # ... allowed when it has none
    "zero_points": is_bool,                     # false: refuses runtime zero points
    "g_idx": either(is_bool, one_of("unpartitioned")),
    "k_part_multiple": is_int,
    "n_part_multiple": is_int,
    "n_part_pack_factor": is_bool,              # N_part % (32 / bits)
    "group_positive": is_bool,
    "group_even": is_bool,
    "group_divides_k": one_of("full", "part"),
    "strict_with_g_idx": record({"k_part_multiple": is_int, "n_part_multiple": is_int}),
    "group_straddle": one_of("refuse", "flat"),  # flat: blocks run over the flattened weight (bitsandbytes)
    "tile_padding": one_of("marlin"),
    "qtypes": list_of(is_str),                  # GGUF block qtypes the kernel runs ("Q6_K"), not bit widths
    "scales": list_of(one_of(*SCALES)),         # weight-scale granularity: per tensor / channel / group / block
    "blocks": list_of(list_of(is_int)),         # block-scale shapes [rows, cols] when scales has block
    "m_range": range_of(is_int),                # [lo, hi]: rows per call this kernel serves (dispatch by M)
    "m_why": is_str,                            # why the window is what it is (shown with it)
    # runtime: the device and the software on it
    "min_cc": is_cc,
    "exact_cc": list_of(is_cc),
    "cc_range": range_of(is_cc),
    "below_cc": is_cc,                          # only devices below this capability (a fallback for older GPUs)
    "dtype_min_cc": map_of(one_of(*DTYPES), is_cc),  # activation dtype -> the capability it needs
    "min_smem_optin": is_int,
    "cpu_flags": list_of(is_str),
    "packages": list_of(is_str),
    "torch_ops": list_of(is_str),
    "min_torch": is_str,
    "os": list_of(is_str),
    "executable": is_bool,
    "retired": is_str,
    "selectable": is_bool,
}, required=("name", "platforms"))

METHOD_ROW = record({
    "name": is_str,
    "source": is_str,
    "formats": list_of(is_str),
    "weight_type": one_of("biased", "unsigned", "by_sym", "signed", "float"),
    "sym_only": is_bool,
    "zero_points": either(is_bool, one_of("not_sym")),
    "bits": list_of(is_int),
    "gate": is_str,
    "note": is_str,
    "walk": is_str,                              # a `walks:` name (default: `lists:`)
    "act_quant": one_of(*DTYPES),                # the method quantizes activations to this at run time
    "walk_by_scale": map_of(one_of(*SCALES), is_str),   # scale granularity -> `walks:` name
    "refuse": is_str,                            # the engine has no linear path for these formats: why
}, required=("name", "formats", "weight_type", "zero_points"))

ENGINE_FILE = record({
    "schema": one_of("qtool.kernels/v1"),
    "engine": one_of(*ENGINES),
    "walk": one_of(*WALKS),
    "source": is_str,
    "formats": map_of(is_str, is_str),
    "pack_dtype_by_format": map_of(is_str, one_of(*PACK_DTYPES)),
    "base_checks": record({"group_full_k_alias": is_bool, "group_divides_k_unless_auto_padding": is_bool,
                           "group_straddle_fatal": is_bool}),
    "methods": list_of(METHOD_ROW),
    "lists": map_of(one_of(*PLATFORMS), list_of(is_str, nonempty=False)),
    "walks": map_of(is_str, map_of(one_of(*PLATFORMS), list_of(is_str, nonempty=False))),
    # serialized layout -> {checkpoint source: backends the loader binds it to}
    "serialized": map_of(is_str, map_of(is_str, list_of(is_str))),
    "gates": list_of(KERNEL_ROW),
    "engine_gates": list_of(KERNEL_ROW),       # checks at engine start: every layer passes them or none runs
    "fused_moe": is_str,                       # how the engine runs MoE experts, where not as linear layers
    "kernels": list_of(KERNEL_ROW),
}, required=("schema", "engine", "walk", "kernels"))


# --------------------------------------------------------------------------------------------------------
# Typed views of the rows.
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelDecl:
    """One kernel (or a config-time gate) and everything it requires. None = no declaration."""

    name: str
    platforms: tuple[str, ...]
    kind: str = "kernel"
    backend: str | None = None
    method: str | None = None
    file: str | None = None
    source: str | None = None
    note: str | None = None
    fallback: str | None = None
    reject_platforms: tuple[str, ...] = ()
    formats: dict[str, int] | None = None
    bits: tuple[int, ...] | None = None
    group_sizes: tuple[int | str, ...] | None = None
    desc_act: tuple[bool, ...] | None = None
    sym: tuple[bool, ...] | None = None
    training: bool | None = None
    act_dtypes: tuple[str, ...] | None = None
    pack_dtypes: tuple[str, ...] | None = None
    in_divisible: int | None = None
    out_divisible: int | None = None
    auto_padding: bool = False
    sharded_load: bool = True
    weight_types: tuple[str, ...] | None = None
    weight_types_zp: tuple[str, ...] | None = None
    weight_types_no_zp: tuple[str, ...] | None = None
    zero_points: bool | None = None
    g_idx: bool | str | None = None
    k_part_multiple: int | None = None
    n_part_multiple: int | None = None
    n_part_pack_factor: bool = False
    group_positive: bool = False
    group_even: bool = False
    group_divides_k: str | None = None
    strict_with_g_idx: dict[str, int] | None = None
    group_straddle: str | None = None
    tile_padding: str | None = None
    qtypes: tuple[str, ...] | None = None
    scales: tuple[str, ...] | None = None
    blocks: tuple[tuple[int, ...], ...] | None = None
    m_range: tuple[int, ...] | None = None
    m_why: str | None = None
    min_cc: tuple[int, int] | None = None
    exact_cc: tuple[tuple[int, int], ...] | None = None
    cc_range: tuple[tuple[int, int], ...] | None = None
    below_cc: tuple[int, int] | None = None
    dtype_min_cc: dict[str, tuple[int, int]] | None = None
    min_smem_optin: int | None = None
    cpu_flags: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    torch_ops: tuple[str, ...] = ()
    min_torch: str | None = None
    os: tuple[str, ...] | None = None
    executable: bool = True
    retired: str | None = None
    selectable: bool = True

    def priority(self, engine_format: str) -> int | None:
        """AUTO priority for `engine_format`, or None when the format is not declared."""
        return None if self.formats is None else self.formats.get(engine_format)


@dataclass(frozen=True)
class MethodDecl:
    """How an engine's quantization method turns a checkpoint into the layer config kernels see (vLLM)."""

    name: str
    formats: tuple[str, ...]
    weight_type: str
    zero_points: bool | str
    sym_only: bool = False
    bits: tuple[int, ...] | None = None
    gate: str | None = None
    source: str | None = None
    note: str | None = None
    walk: str | None = None
    walk_by_scale: dict[str, str] | None = None
    act_quant: str | None = None
    refuse: str | None = None


@dataclass(frozen=True)
class EngineDecls:
    """Everything one engine declares: its kernels, how it walks them, and how formats map onto them."""

    engine: str
    walk: str
    path: Path
    kernels: tuple[KernelDecl, ...]
    source: str = ""
    formats: dict[str, str] = field(default_factory=dict)
    pack_dtype_by_format: dict[str, str] = field(default_factory=dict)
    methods: tuple[MethodDecl, ...] = ()
    lists: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gates: tuple[KernelDecl, ...] = ()
    engine_gates: tuple[KernelDecl, ...] = ()
    fused_moe: str | None = None  # set: experts are no linear layers here, and this says what runs them
    base_checks: dict[str, bool] = field(default_factory=dict)   # checks the engine applies to every row
    walks: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    serialized: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def kernel(self, name: str) -> KernelDecl:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kernels)

    def engine_format(self, qtool_format: str) -> str:
        """The engine's name for a qtool format id ("gguf:Q4_K" -> family "gguf" first)."""
        family = qtool_format.split(":", 1)[0]
        return self.formats.get(family, family)


def _kernel_from_row(row: dict) -> KernelDecl:
    return KernelDecl(**row)


def parse_engine(data: Any, path: Path) -> EngineDecls:
    """Validate a parsed engine file and build its typed view. Pure: no file access."""
    d = validate(data, ENGINE_FILE, path)
    kernels = tuple(_kernel_from_row(r) for r in d["kernels"])
    gates = tuple(_kernel_from_row({**r, "kind": "gate"}) for r in d.get("gates", ()))
    engine_gates = tuple(_kernel_from_row({**r, "kind": "gate"}) for r in d.get("engine_gates", ()))
    names = [k.name for k in kernels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"kernel names declared twice: {', '.join(dupes)}", path=path)
    lists = {p: tuple(v) for p, v in d.get("lists", {}).items()}
    for platform, order in lists.items():
        for n in order:
            if n not in names:
                raise SpecError(f"lists.{platform} names undeclared kernel {n!r}", path=path,
                                fix="add a row for it under kernels:")
    walks = {w: {p: tuple(v) for p, v in per.items()} for w, per in d.get("walks", {}).items()}
    for w, per in walks.items():
        for platform, order in per.items():
            for n in order:
                if n not in names:
                    raise SpecError(f"walks.{w}.{platform} names undeclared kernel {n!r}", path=path,
                                    fix="add a row for it under kernels:")
    if d["walk"] == "list" and not lists:
        raise SpecError("walk: list needs a `lists:` mapping of platform -> kernel order", path=path)
    if d["walk"] == "priority":
        for k in kernels:
            if k.selectable and not k.formats:
                raise SpecError(f"kernel {k.name!r} declares no formats, but walk: priority needs them",
                                path=path)
    methods = tuple(MethodDecl(**m) for m in d.get("methods", ()))
    gate_names = {g.name for g in gates}
    for m in methods:
        if m.gate is not None and m.gate not in gate_names:
            raise SpecError(f"method {m.name!r} names undeclared gate {m.gate!r}", path=path)
        for w in ([m.walk] if m.walk else []) + list((m.walk_by_scale or {}).values()):
            if w not in walks:
                raise SpecError(f"method {m.name!r} names undeclared walk {w!r}", path=path,
                                fix="add it under walks:")
    return EngineDecls(
        engine=d["engine"], walk=d["walk"], path=path, kernels=kernels, source=d.get("source", ""),
        formats=dict(d.get("formats", {})), pack_dtype_by_format=dict(d.get("pack_dtype_by_format", {})),
        methods=methods, lists=lists, gates=gates, engine_gates=engine_gates, fused_moe=d.get("fused_moe"),
        base_checks=dict(d.get("base_checks", {})),
        walks=walks, serialized={f: {src: tuple(b) for src, b in m.items()}
                                 for f, m in d.get("serialized", {}).items()},
    )


def load_engine(engine: str, config_dir: Path | None = None) -> EngineDecls:
    """Load and validate `configs/kernels/<engine>.yaml` (cached per file)."""
    if engine not in ENGINES:
        from qtool.errors import UsageError

        raise UsageError(f"unknown engine {engine!r}", fix=f"use one of: {', '.join(ENGINES)}")
    path = (config_dir or CONFIG_DIR) / "kernels" / f"{engine}.yaml"
    decls = _load_cached(str(path))
    if decls.engine != engine:
        raise SpecError(f"file declares engine {decls.engine!r}, expected {engine!r}", path=path)
    return decls


@lru_cache(maxsize=16)
def _load_cached(path: str) -> EngineDecls:
    p = Path(path)
    return parse_engine(load_yaml(p), p)
