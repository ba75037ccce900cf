"""Which kernel runs a layer on a device, and why every other candidate refused.

`select_kernel(layer, device, engine, disabled, tp)` is the whole decision: a pure function of a layer's
quantization and shape, a `Device`, an engine's declarations (`configs/kernels/<engine>.yaml`), a set of
disabled kernel names and the tensor-parallel size. It walks the engine's candidates the way the engine
does -- GPTQModel AUTO by descending format priority, vLLM first match down its per-platform list -- but
checks every candidate completely: a "needs CUDA" refusal never hides the shape problem behind it, and the
candidates after the chosen one are still evaluated, so the report shows every alternative.

Each refusal names the constraint and the values (`MacheteLinearKernel: K_part 9555 % 64 != 0`). A hint says
what single change would make the kernel eligible; hints are found by re-running the same checks on a
changed layer/device/TP, so a hint is never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from qtool.kernels.decls import EngineDecls, KernelDecl, MethodDecl, load_engine
from qtool.kernels.devices import Device, load_profiles
from qtool.scheme import QuantScheme

DTYPE_FLAG = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8", "int8": "int8"}
PACKAGE_PIP = {"conch": "conch-triton-kernels"}
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Heads:
    """Attention heads laid along the dimension tensor parallelism splits: `count` heads of `dim` each. vLLM's
    and SGLang's QKVParallelLinear give each rank count / tp of them; key/value heads (`replicated`) are copied
    instead when there are fewer than ranks, one whole head a rank (tp a multiple of count)."""

    count: int
    dim: int
    replicated: bool = False


def width_heads(heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[Heads, ...]]:
    """The heads of a model's attention widths, by the names configs/models.yaml gives them: q_size (the
    attention heads) and kv_size (the key/value heads, copied where there are fewer than ranks)."""
    return {"q_size": (Heads(heads, head_dim),), "kv_size": (Heads(kv_heads, head_dim, replicated=True),)}


def split_width(width: int, heads: tuple[Heads, ...], tp: int, dim: str = "") -> tuple[int, str | None]:
    """(one rank's share of `width` under tp-way tensor parallelism, why it does not split or None): by
    whole heads where the width is attention heads, else width / tp. `dim` names the width in the reason."""
    if not heads or sum(h.count * h.dim for h in heads) != width:
        return width // tp, (None if width % tp == 0 else f"TP {tp} does not divide {dim + ' ' if dim else ''}{width}")
    part, why = 0, None
    for h in heads:
        if h.count % tp == 0:
            part += h.count // tp * h.dim
        elif h.replicated and tp % h.count == 0:
            part += h.dim
        else:
            part += h.dim * max(1, h.count // tp)
            kind = "key/value heads" if h.replicated else "attention heads"
            why = why or (f"TP {tp} does not divide the {h.count} {kind}" +
                          (" (nor is it a multiple of them)" if h.replicated else ""))
    return part, why


@dataclass(frozen=True)
class LayerQuant:
    """One linear layer as a kernel sees it: its quantization (`scheme`, read through the properties
    format / bits / group_size / sym / desc_act, all set) and what the deployment adds.

    in_features (K) and out_features (N) are the full, unsharded widths of the weight W[N, K].
    scheme.format: qtool format id ("gptq", "gptq_v2", "gptq_p", "awq", "marlin", "ct", "gguf:Q4_K", "fp8", ...).
    scheme.group_size: -1 = one group over all of K. act_dtype: activation dtype name ("float16", "bfloat16").
    parallel: how TP splits it -- "column" splits N, "row" splits K, "replicated" splits nothing.
    method: "gptq" / "awq" when the format alone is ambiguous (a Marlin-format checkpoint), else None.
    pack_dtype: integer word dtype of the checkpoint ("int32" unless the format says otherwise).
    scale: weight-scale granularity, "tensor" | "channel" | "group" | "block"; None = from group_size
    (-1 -> channel, else group). block: [rows, cols] of a block scale (DeepSeek-V3: (128, 128)).
    act_dtype may be a quantized activation ("float8_e4m3fn", "int8"): the operand the kernel multiplies.
    heads: the attention heads along the split dimension (q/k/v's N, o's K; a fused qkv: q's, then k's and
    v's), which tensor parallelism splits by whole heads; () = split evenly.
    """

    name: str
    in_features: int
    out_features: int
    scheme: QuantScheme
    act_dtype: str = "float16"
    parallel: str = "column"
    method: str | None = None
    pack_dtype: str | None = None
    scale: str | None = None
    block: tuple[int, int] | None = None
    heads: tuple[Heads, ...] = ()

    def __post_init__(self) -> None:
        q = self.scheme
        if None in (q.format, q.bits, q.group_size, q.sym, q.desc_act):
            raise ValueError(f"{self.name}: a layer to select for needs its whole scheme, got {q}")

    @property
    def format(self) -> str:
        return self.scheme.format

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def sym(self) -> bool:
        return self.scheme.sym

    @property
    def desc_act(self) -> bool:
        return self.scheme.desc_act

    def requantized(self, **changes) -> LayerQuant:
        """The same layer with other quantization (the hint search's what-ifs): changes to the scheme."""
        return replace(self, scheme=replace(self.scheme, **changes))

    @property
    def scale_kind(self) -> str:
        if self.scale is not None:
            return self.scale
        return "channel" if self.group_size <= 0 or self.group_size == self.in_features else "group"


@dataclass(frozen=True)
class Failure:
    """One violated constraint. `category` names what kind of change could fix it (hints search by it)."""

    category: str
    text: str


@dataclass(frozen=True)
class Candidate:
    """One kernel (or, for vLLM, a method / config-time gate) in walk order, with its verdict."""

    kernel: str
    ok: bool
    reason: str
    hint: str | None = None
    kind: str = "kernel"          # kernel | method | gate
    priority: int | None = None
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        d = {"kernel": self.kernel, "ok": self.ok, "reason": self.reason, "hint": self.hint}
        if self.kind != "kernel":
            d["kind"] = self.kind
        if self.priority is not None:
            d["priority"] = self.priority
        return d


@dataclass(frozen=True)
class Selection:
    """The verdict for one layer: per-rank shape, the chosen kernel (None: nothing can run it), every
    candidate in walk order, and layer-level notes (groups straddling TP shards, TP not dividing a dim)."""

    layer: LayerQuant
    engine: str
    device: str
    tp: int
    in_features_per_partition: int
    out_features_per_partition: int
    chosen: str | None
    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...] = ()
    per_m: tuple[tuple[int, str | None], ...] = ()   # (M, kernel that runs a call of M rows)


@dataclass(frozen=True)
class _Facts:
    """What every check reads, derived once per (layer, device, tp)."""

    layer: LayerQuant
    device: Device
    tp: int
    k_part: int
    n_part: int
    k_split: bool
    n_split: bool
    tp_failures: tuple[Failure, ...]
    engine_format: str
    weight_type: str
    zero_points: bool
    pack_dtype: str
    group_full_k_alias: bool
    group_divides_k_base: bool
    group_straddle_base: bool = False
    serialized: tuple[str, ...] | None = None    # backends the loader binds this serialized layout to
    engine: str = ""
    act_operand: str = "float16"                 # what the kernel multiplies: the method may quantize x

    @property
    def kl(self) -> str:
        return "K_part" if self.k_split else "K"

    @property
    def nl(self) -> str:
        return "N_part" if self.n_split else "N"


# ------------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------------

def select_kernel(layer: LayerQuant, device: Device, engine: EngineDecls | str,
                  disabled: Iterable[str] = (), tp: int = 1,
                  profiles: Sequence[Device] | None = None, ms: Sequence[int] = ()) -> Selection:
    """Choose the kernel `engine` would run `layer` with on `device` at tensor-parallel size `tp`.

    disabled: kernel names removed from consideration (vLLM's VLLM_DISABLED_KERNELS; --disable).
    profiles: devices tried when searching for a "runs on ..." hint (default: configs/devices.yaml).
    ms: batch rows M to resolve per call: kernels declaring `m_range` serve only those M, and a call
    outside it runs the next eligible kernel in walk order (SGLang/vLLM's M-bucketed FP8 dispatch).
    Returns every candidate in walk order with ok/reason/hint; `chosen` is the first eligible one.
    """
    decls = load_engine(engine) if isinstance(engine, str) else engine
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    disabled = frozenset(disabled)
    alts = tuple(load_profiles().values()) if profiles is None else tuple(profiles)
    facts, method, method_failures = _facts(layer, device, tp, decls)

    # an engine-wide check (the engine's start) is listed where it refuses; it passes for most layers
    candidates = [c for c in (_evaluate(g, layer, device, tp, disabled, decls, alts)
                              for g in decls.engine_gates if device.platform in g.platforms) if not c.ok]
    if decls.walk == "list":
        candidates.append(_method_candidate(layer, facts, method, method_failures))
        if method is not None and method.gate is not None:
            gate = next(g for g in decls.gates if g.name == method.gate)
            if device.platform in gate.platforms:
                candidates.append(_evaluate(gate, layer, device, tp, disabled, decls, alts))
    # the first engine gate, method or config gate that refuses: no kernel is tried after it
    blocked = next((c.kernel for c in candidates if not c.ok), None)
    if decls.walk == "list":
        # a format no method reads reaches no kernel: listing the walk would show kernels "passing" for it
        walk = [] if method is None or method.refuse else \
            [decls.kernel(n) for n in _list_for(decls, method, layer).get(device.platform, ())]
    else:
        walk = _priority_walk(decls, layer, facts.engine_format)

    chosen = None
    eligible: list[KernelDecl] = []
    for k in walk:
        c = _evaluate(k, layer, device, tp, disabled, decls, alts)
        candidates.append(c)
        if c.ok and not blocked:
            eligible.append(k)
            if chosen is None:
                chosen = k.name
    per_m = tuple((m, next((k.name for k in eligible if _serves(k, m)), None)) for m in ms)
    notes = _layer_notes(facts, decls, walk, blocked)
    notes += [f"{k.name}: {k.fallback}" for k in eligible[:1] if k.fallback]
    return Selection(
        layer=layer, engine=decls.engine, device=device.name, tp=tp,
        in_features_per_partition=facts.k_part, out_features_per_partition=facts.n_part,
        chosen=chosen, candidates=tuple(candidates), notes=tuple(notes), per_m=per_m,
    )


def _serves(k: KernelDecl, m: int) -> bool:
    return k.m_range is None or k.m_range[0] <= m <= k.m_range[-1]


def _list_for(decls: EngineDecls, method: MethodDecl | None, layer: LayerQuant) -> dict[str, tuple[str, ...]]:
    """The per-platform kernel list the method walks: its scale-specific walk, its own walk, or `lists:`."""
    if method is not None and method.walk_by_scale is not None:
        name = method.walk_by_scale.get(layer.scale_kind)
        return decls.walks[name] if name is not None else {}
    if method is not None and method.walk is not None:
        return decls.walks[method.walk]
    return decls.lists


# ------------------------------------------------------------------------------------------------------
# Walks
# ------------------------------------------------------------------------------------------------------

def _priority_walk(decls: EngineDecls, layer: LayerQuant, engine_format: str) -> list[KernelDecl]:
    """AUTO order: every selectable class declaring the format, highest priority first (declaration
    order breaks ties), explicit-only (priority 0) classes last so their refusal is still reported."""
    rows = [k for k in decls.kernels
            if k.selectable and k.formats is not None and engine_format in k.formats
            and (layer.method is None or k.method is None or k.method == layer.method
                 or engine_format in decls.serialized)]
    return sorted(rows, key=lambda k: -k.formats[engine_format])


def _method_for(decls: EngineDecls, fmt: str) -> MethodDecl | None:
    family = fmt.split(":", 1)[0]
    return next((m for m in decls.methods if family in m.formats), None)


def _weight_type(bits: int, biased: bool) -> str:
    """vLLM scalar type name: uint4b8 = unsigned 4-bit codes with an implicit zero of 8."""
    return f"uint{bits}b{1 << (bits - 1)}" if biased else f"uint{bits}"


def _facts(layer: LayerQuant, device: Device, tp: int,
           decls: EngineDecls) -> tuple[_Facts, MethodDecl | None, list[Failure]]:
    K, N = layer.in_features, layer.out_features
    k_split = layer.parallel == "row" and tp > 1
    n_split = layer.parallel == "column" and tp > 1
    tp_fail = []
    k_part, n_part = K, N
    for split, dim, width in ((k_split, "K", K), (n_split, "N", N)):
        if split:
            part, why = split_width(width, layer.heads, tp, dim)
            k_part, n_part = (part, n_part) if dim == "K" else (k_part, part)
            if why:
                tp_fail.append(Failure("tp", why))

    method, method_failures = None, []
    if decls.methods:
        method, method_failures, weight_type, zero_points = _vllm_method(decls, layer)
    else:
        weight_type, zero_points = _weight_type(layer.bits, layer.sym), not layer.sym
    engine_format = decls.engine_format(layer.format)
    pack_dtype = layer.pack_dtype or decls.pack_dtype_by_format.get(engine_format, "int32")
    facts = _Facts(
        layer=layer, device=device, tp=tp, k_part=k_part, n_part=n_part, k_split=k_split, n_split=n_split,
        tp_failures=tuple(tp_fail), engine_format=engine_format, weight_type=weight_type,
        zero_points=zero_points, pack_dtype=pack_dtype,
        group_full_k_alias=decls.base_checks.get("group_full_k_alias", False),
        group_divides_k_base=decls.base_checks.get("group_divides_k_unless_auto_padding", False),
        group_straddle_base=decls.base_checks.get("group_straddle_fatal", False),
        serialized=_serialized_backends(decls, engine_format, layer.method), engine=decls.engine,
        act_operand=(method.act_quant if method is not None and method.act_quant else layer.act_dtype),
    )
    return facts, method, method_failures


def _serialized_backends(decls: EngineDecls, engine_format: str, source: str | None) -> tuple[str, ...] | None:
    """Backends the model loader binds a serialized layout to (seed 000: a serialized Marlin checkpoint
    needs the matching Marlin backend or MLX); every source's backends when the source is unknown."""
    by_source = decls.serialized.get(engine_format)
    if by_source is None:
        return None
    if source is not None and source in by_source:
        return by_source[source]
    return tuple(dict.fromkeys(b for bs in by_source.values() for b in bs))


def _vllm_method(decls: EngineDecls, layer: LayerQuant):
    """The vLLM method that loads this format, the failures it raises at config time, and the weight type
    and zero-point flag it hands to every kernel's can_implement."""
    method = _method_for(decls, layer.format)
    failures: list[Failure] = []
    if method is None:
        readable = sorted({f for m in decls.methods for f in m.formats})
        failures.append(Failure("format", f"format {layer.format} is not a checkpoint format "
                                          f"{_ENGINE_NAME.get(decls.engine, decls.engine)} loads "
                                          f"(reads: {', '.join(readable)})"))
        return None, failures, _weight_type(layer.bits, layer.sym), not layer.sym
    if method.refuse is not None:
        failures.append(Failure("format", method.refuse))
        return method, failures, layer.format.split(":", 1)[0], False
    if method.walk_by_scale is not None and layer.scale_kind not in method.walk_by_scale:
        failures.append(Failure("scale", f"{layer.scale_kind} scales: no kernel list declared for them "
                                         f"(declared: {', '.join(method.walk_by_scale)})"))
    if method.bits is not None and layer.bits not in method.bits:
        failures.append(Failure("bits", f"bits {layer.bits} not in {_fmt(method.bits)}"))
    if method.sym_only and not layer.sym:
        failures.append(Failure("sym", f"sym=False: {method.name} has no scalar type for asymmetric weights "
                                       "(TYPE_MAP holds symmetric 4/8-bit only)"))
    zp = (not layer.sym) if method.zero_points == "not_sym" else bool(method.zero_points)
    if method.weight_type == "signed":
        return method, failures, f"int{layer.bits}", zp
    if method.weight_type == "float":
        return method, failures, layer.format.split(":", 1)[0], zp
    biased = {"biased": True, "unsigned": False, "by_sym": layer.sym}[method.weight_type]
    return method, failures, _weight_type(layer.bits, biased), zp


_ENGINE_NAME = {"vllm": "vLLM", "sglang": "SGLang"}


# ------------------------------------------------------------------------------------------------------
# One candidate: every failing constraint, then notes, then a hint
# ------------------------------------------------------------------------------------------------------

def _evaluate(k: KernelDecl, layer: LayerQuant, device: Device, tp: int, disabled: frozenset[str],
              decls: EngineDecls, alts: Sequence[Device]) -> Candidate:
    facts = _facts(layer, device, tp, decls)[0]
    failures, notes = _check(k, facts, disabled)
    prio = k.priority(facts.engine_format) if decls.walk == "priority" else None
    if failures:
        reason = f"{k.name}: " + "; ".join(f.text for f in failures)
        hint = _hint(k, layer, device, tp, disabled, decls, alts, failures)
        return Candidate(k.name, False, reason, hint, k.kind, prio, tuple(f.text for f in failures),
                         tuple(notes))
    reason = f"{k.name}: all checks pass" + "".join(f"; {n}" for n in notes)
    return Candidate(k.name, True, reason, None, k.kind, prio, (), tuple(notes))


def _method_candidate(layer: LayerQuant, facts: _Facts, method: MethodDecl | None,
                      failures: list[Failure]) -> Candidate:
    name = method.name if method is not None else f"{_ENGINE_NAME.get(facts.engine, facts.engine)} method"
    if failures:
        hint = _method_hint(layer, failures)
        return Candidate(name, False, f"{name}: " + "; ".join(f.text for f in failures), hint, "method",
                         failures=tuple(f.text for f in failures))
    desc = (f"weight type {facts.weight_type}, zero points {'yes' if facts.zero_points else 'no'}, "
            f"act-order {'yes' if layer.desc_act else 'no'}")
    if method is not None and (method.walk or method.walk_by_scale):
        desc += f", {layer.scale_kind} scales, activations {layer.act_dtype}"
        if method.act_quant and method.act_quant != layer.act_dtype:
            desc += f" -> {method.act_quant}"
    if method is not None and method.note:
        desc += f"; {method.note}"
    return Candidate(name, True, f"{name}: {desc}", None, "method")


def _check(k: KernelDecl, f: _Facts, disabled: frozenset[str]) -> tuple[list[Failure], list[str]]:
    """Every constraint of `k` that the layer/device violates (contract first, then runtime), and the
    notes an eligible kernel carries (padding, assumed software)."""
    L, dev = f.layer, f.device
    out: list[Failure] = []
    notes: list[str] = []

    def fail(category: str, text: str) -> None:
        out.append(Failure(category, text))

    # -- contract: the checkpoint and the layer shape -------------------------------------------------
    if k.retired:
        fail("retired", f"retired: {k.retired}")
    if k.formats is not None and k.kind == "kernel":
        prio = k.formats.get(f.engine_format)
        if prio is None:
            fail("format", f"format {f.engine_format} not declared (declares {', '.join(k.formats)})")
        elif prio == 0:
            fail("explicit", f"priority 0 for {f.engine_format}: explicit selection only, never AUTO")
    if k.bits is not None and L.bits not in k.bits:
        fail("bits", f"bits {L.bits} not in {_fmt(k.bits)}")
    g = L.group_size
    if k.group_sizes is not None:
        full_k = g == L.in_features or (f.group_full_k_alias and g == f.k_part)
        if g not in k.group_sizes and not ("K" in k.group_sizes and g == L.in_features) \
                and not (f.group_full_k_alias and full_k):
            fail("group", f"group_size {g} not in {_fmt(k.group_sizes)}")
    if k.group_positive and g <= 0:
        fail("group", f"group_size {g}: channelwise (-1) not supported")
    if k.group_even and g != -1 and g % 2:
        fail("group", f"group_size {g} is not -1 or a multiple of 2")
    if k.desc_act is not None and L.desc_act not in k.desc_act:
        fail("desc_act", f"desc_act={L.desc_act} not supported")
    if k.g_idx is False and L.desc_act:
        fail("desc_act", "act-order (g_idx) not supported")
    if k.g_idx == "unpartitioned" and L.desc_act and f.k_split:
        fail("tp", f"act-order (g_idx) with K split across {f.tp} ranks")
    if k.sym is not None and L.sym not in k.sym:
        fail("sym", f"sym={L.sym} not supported")
    if k.zero_points is False and f.zero_points:
        fail("sym", "runtime zero points (asymmetric) not supported")
    allowed = k.weight_types or (k.weight_types_zp if f.zero_points else k.weight_types_no_zp)
    if allowed is not None and f.weight_type not in allowed:
        zp = " with zero points" if f.zero_points else ""
        fail("weight_type", f"weight type {f.weight_type}{zp} not in {_fmt(allowed)}")
    if k.act_dtypes is not None and f.act_operand not in k.act_dtypes:
        fail("act_dtype", f"activation dtype {f.act_operand} not in {_fmt(k.act_dtypes)}")
    if k.pack_dtypes is not None and f.pack_dtype not in k.pack_dtypes:
        fail("pack", f"pack dtype {f.pack_dtype} not in {_fmt(k.pack_dtypes)}")
    if k.qtypes is not None:
        qtype = L.format.split(":", 1)[1] if ":" in L.format else None
        if qtype is None:
            fail("qtype", f"GGUF qtype unknown; runs only {_fmt(k.qtypes)}")
        elif qtype not in k.qtypes:
            fail("qtype", f"GGUF qtype {qtype} not in {_fmt(k.qtypes)}")
    if k.scales is not None and L.scale_kind not in k.scales:
        fail("scale", f"{L.scale_kind} weight scales not in {_fmt(k.scales)}")
    elif k.blocks is not None and L.scale_kind == "block" and tuple(L.block or ()) not in k.blocks:
        want = ", ".join("x".join(map(str, b)) for b in k.blocks)
        got = "x".join(map(str, L.block)) if L.block else "unknown"
        fail("scale", f"block {got} not in [{want}]")
    if f.serialized is not None and k.kind == "kernel" and k.backend not in f.serialized:
        src = f" from {L.method}" if L.method else ""
        fail("loader", f"serialized {f.engine_format} checkpoint{src}: the model loader binds it to "
                       f"{' or '.join(f.serialized)}, not {k.backend}")

    for multiple in (k.in_divisible, k.k_part_multiple):
        if multiple and f.k_part % multiple:
            fail("shape_k", f"{f.kl} {f.k_part} % {multiple} != 0")
    for multiple in (k.out_divisible, k.n_part_multiple):
        if multiple and f.n_part % multiple:
            fail("shape_n", f"{f.nl} {f.n_part} % {multiple} != 0")
    if k.n_part_pack_factor and f.n_part % (32 // L.bits):
        fail("shape_n", f"{f.nl} {f.n_part} % {32 // L.bits} (32 / bits) != 0")
    if g > 0:
        # GPTQModel's base validator: K must hold whole groups unless the class pads automatically.
        if f.group_divides_k_base and not k.auto_padding and f.k_part % g:
            fail("tp" if f.k_split else "shape_k", f"{f.kl} {f.k_part} % group_size {g} != 0")
        if k.group_divides_k == "full" and L.in_features % g:
            fail("shape_k", f"K {L.in_features} % group_size {g} != 0")
        if k.group_divides_k == "part" and f.k_part % g:
            fail("tp" if f.k_split else "shape_k", f"{f.kl} {f.k_part} % group_size {g} != 0")
        # blocks of the flattened weight span rows: a K that is no multiple of them splits nothing
        straddle = k.group_straddle == "refuse" or (f.group_straddle_base and k.kind == "kernel"
                                                    and k.group_straddle != "flat")
        if straddle and g < L.in_features and f.k_part % g:
            if f.k_split:
                fail("tp", f"group_size {g} straddles TP shards: K_part {f.k_part} % {g} != 0 "
                           "(padding cannot fix a split group)")
            else:
                fail("shape_k", f"K {f.k_part} % group_size {g} != 0")
    if k.strict_with_g_idx and L.desc_act:
        km, nm = k.strict_with_g_idx["k_part_multiple"], k.strict_with_g_idx["n_part_multiple"]
        if f.k_part % km:
            fail("shape_k", f"act-order keeps the strict tile check: {f.kl} {f.k_part} % {km} != 0")
        if f.n_part % nm:
            fail("shape_n", f"act-order keeps the strict tile check: {f.nl} {f.n_part} % {nm} != 0")
    if f.tp > 1 and not k.sharded_load:
        fail("tp", f"sharded load disabled (SUPPORTS_SHARDED_LOAD=False) but tp={f.tp}")
    out.extend(f.tp_failures)

    # -- runtime: the device and its software ----------------------------------------------------------
    plat = dev.platform
    if "all" not in k.platforms and plat not in k.platforms:
        fail("device", f"platform {plat} not in {_fmt(k.platforms)}")
    elif plat in k.reject_platforms:
        fail("device", f"rejects platform {plat}")
    if plat == "cuda" and dev.cc is not None:
        cc = dev.cc
        # An exact target list or a range implies the floor; one message per capability refusal.
        if k.exact_cc is not None and cc not in k.exact_cc:
            want = _cc(k.exact_cc[0]) if len(k.exact_cc) == 1 else _fmt([_cc(c) for c in k.exact_cc])
            fail("device", f"CC {_cc(cc)} != {want} (exact targets only)" if len(k.exact_cc) == 1
                 else f"CC {_cc(cc)} not in {want} (exact targets only)")
        elif k.cc_range is not None and not (k.cc_range[0] <= cc <= k.cc_range[-1]):
            fail("device", f"CC {_cc(cc)} outside {_cc(k.cc_range[0])}..{_cc(k.cc_range[-1])}")
        elif k.min_cc is not None and cc < k.min_cc:
            fail("device", f"CC {_cc(cc)} < {_cc(k.min_cc)}")
        need = (k.dtype_min_cc or {}).get(L.act_dtype)
        if need is not None and cc < need:
            fail("act_dtype", f"{L.act_dtype} needs CC >= {_cc(need)}, the device has CC {_cc(cc)}")
        if k.below_cc is not None and cc >= k.below_cc:
            fail("device", f"CC {_cc(cc)} >= {_cc(k.below_cc)}: a fallback for GPUs below {_cc(k.below_cc)} only")
        if k.min_smem_optin is not None:
            if dev.smem_optin is None:
                notes.append("opt-in shared memory unknown for this device")
            elif dev.smem_optin < k.min_smem_optin:
                fail("device", f"opt-in shared memory {dev.smem_optin} B < {k.min_smem_optin} B")
    if plat == "cpu":
        for flag in k.cpu_flags:
            if flag not in dev.cpu_flags:
                fail("device", f"CPU lacks {flag}")
    if k.os is not None and dev.os is not None and not any(dev.os.startswith(o) for o in k.os):
        fail("device", f"OS {dev.os} not in {_fmt(k.os)}")
    if k.min_torch is not None:
        if dev.torch_version is None:
            notes.append(f"assumes torch >= {k.min_torch}")
        elif _version(dev.torch_version) < _version(k.min_torch):
            fail("software", f"torch {dev.torch_version} < {k.min_torch}")
    for op in k.torch_ops:
        if dev.torch_ops is None:
            notes.append(f"assumes torch provides aten.{op}")
        elif op not in dev.torch_ops:
            fail("software", f"torch lacks aten.{op}")
    for pkg in k.packages:
        if dev.packages is None:
            notes.append(f"assumes package {pkg} is installed")
        elif pkg not in dev.packages:
            fail("software", f"package {pkg} not installed")
    if not k.executable:
        fail("executable", "checkpoint holder only: forward() raises until converted to MLX modules")
    if k.name in disabled:
        fail("disabled", "disabled by --disable")

    if not out and k.tile_padding == "marlin" and not L.desc_act:
        pn, pk = marlin_padded_nk(f.n_part, f.k_part, g)
        if (pn, pk) != (f.n_part, f.k_part):
            notes.insert(0, f"pads {f.nl}x{f.kl} {f.n_part}x{f.k_part} -> {pn}x{pk} "
                            "(zero-padded tiles on every forward; slower)")
    if not out and k.auto_padding and g > 0 and f.k_part % g:
        notes.insert(0, f"auto-pads {f.kl} {f.k_part} to whole groups of {g}")
    if k.m_range is not None:
        why = f" ({k.m_why})" if k.m_why else ""
        notes.append(f"serves M in [{k.m_range[0]}, {k.m_range[-1]}] per call{why}; other M run the next "
                     "eligible kernel")
    return out, notes


def marlin_padded_nk(n: int, k: int, group_size: int) -> tuple[int, int]:
    """Smallest (N, K) satisfying a Marlin thread-tile family: (N % 64, K % 128) or (N % 128, K % 64),
    with K kept a whole number of groups; the cheaper of the two by element count, then by sum."""
    group = group_size if group_size > 0 else 1
    families = ((_round_up(n, 64), _round_up(k, math.lcm(128, group))),
                (_round_up(n, 128), _round_up(k, math.lcm(64, group))))
    return min(families, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


# ------------------------------------------------------------------------------------------------------
# Hints: re-run the checks on a changed input; a change that clears a failure category is a hint
# ------------------------------------------------------------------------------------------------------

def _hint(k: KernelDecl, layer: LayerQuant, device: Device, tp: int, disabled: frozenset[str],
          decls: EngineDecls, alts: Sequence[Device], failures: list[Failure]) -> str | None:
    cats = {f.category for f in failures}
    parts: list[str] = []

    def clears(cat: str, new_layer: LayerQuant = layer, new_device: Device = device,
               new_tp: int = tp) -> bool:
        new = _check(k, _facts(new_layer, new_device, new_tp, decls)[0], disabled)[0]
        remaining = {x.category for x in new}
        return cat not in remaining and remaining <= cats

    done: set[str] = set()
    for cat in _CATEGORY_ORDER:
        if cat not in cats or cat in done:
            continue
        text = None
        if cat in ("bits", "weight_type", "sym"):
            text = _first(
                (desc, lay) for desc, lay in _quant_variants(k, layer, cat) if clears(cat, new_layer=lay))
            if text and cat != "sym" and "symmetric" in text:
                done.add("sym")
        elif cat == "group":
            text = _first((f"re-quantize with group_size {g}", layer.requantized(group_size=g))
                          for g in _preferred_groups(k, layer) if clears(cat, new_layer=layer.requantized(group_size=g)))
        elif cat == "desc_act":
            lay = layer.requantized(desc_act=False)
            text = "re-quantize without act-order (desc_act=False)" if clears(cat, new_layer=lay) else None
        elif cat == "act_dtype":
            text = _first((f"run with --dtype {DTYPE_FLAG[d]}", replace(layer, act_dtype=d))
                          for d in DTYPE_FLAG if clears(cat, new_layer=replace(layer, act_dtype=d)))
            if k.act_dtypes == ("float8_e4m3fn",):
                text = "needs FP8 (e4m3) activations: a W4A8 checkpoint, --dtype fp8"
        elif cat == "qtype":
            text = f"re-quantize to {' / '.join(k.qtypes)}" if k.qtypes else None
        elif cat == "loader":
            backends = _facts(layer, device, tp, decls)[0].serialized or ()
            text = f"load it with {' or '.join(backends)}" if backends else None
        elif cat in ("shape_k", "shape_n", "tp"):
            if "shape" in cat:
                pad = _pad_hint(k, layer, device, tp, decls, disabled, cat, cats)
                if pad:
                    parts.append(pad)
            if "tp-hint" not in done:
                # one TP suggestion that clears every shape/TP failure at once
                done.add("tp-hint")
                shape_cats = cats & {"shape_k", "shape_n", "tp"}
                tps = [t for t in TP_SIZES if t != tp and _tp_divides(layer, t)
                       and all(clears(c, new_tp=t) for c in shape_cats)]
                if tps:
                    parts.append(" or ".join(f"TP={t}" for t in tps))
            continue
        elif cat == "device":
            names = [d.name for d in alts if d.name != device.name and clears(cat, new_device=d)]
            if names:
                text = "runs on " + ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        elif cat == "software":
            text = "; ".join(_software_fix(f.text) for f in failures if f.category == "software")
        elif cat == "disabled":
            text = f"drop --disable {k.name}"
        elif cat == "explicit":
            text = f"select it explicitly (backend {k.backend})" if k.backend else "select it explicitly"
        elif cat == "executable":
            text = "convert the model to MLX modules and run it under MLX"
        if text:
            parts.append(text)
    return "; ".join(parts) if parts else None


# Order in which hint fragments are written (what to change first).
_CATEGORY_ORDER = ("disabled", "explicit", "device", "software", "loader", "bits", "weight_type", "sym",
                   "group", "qtype", "scale", "desc_act", "act_dtype", "pack", "shape_k", "shape_n", "tp",
                   "executable")


def _first(pairs) -> str | None:
    for desc, _ in pairs:
        return desc
    return None


def _quant_variants(k: KernelDecl, layer: LayerQuant, cat: str):
    bits_pref = [b for b in (4, 8, 3, 2, 5, 6, 7) if k.bits is None or b in k.bits]
    if cat == "sym":
        yield ("re-quantize symmetric" if not layer.sym else "re-quantize asymmetric",
               layer.requantized(sym=not layer.sym))
        return
    for b in bits_pref:
        if b != layer.bits:
            yield f"re-quantize to {b}-bit", layer.requantized(bits=b)
    if cat == "weight_type":
        yield ("re-quantize symmetric" if not layer.sym else "re-quantize asymmetric",
               layer.requantized(sym=not layer.sym))
        for b in bits_pref:
            if b != layer.bits:
                yield (f"re-quantize to {b}-bit {'symmetric' if not layer.sym else 'asymmetric'}",
                       layer.requantized(bits=b, sym=not layer.sym))


def _preferred_groups(k: KernelDecl, layer: LayerQuant) -> list[int]:
    pref = [128, 64, 32, 256, -1, 16, 512, 1024]
    declared = [g for g in (k.group_sizes or ()) if isinstance(g, int)]
    return [g for g in pref if g != layer.group_size and (not declared or g in declared)]


def _tp_divides(layer: LayerQuant, tp: int) -> bool:
    if layer.parallel in ("row", "column"):
        return split_width(layer.in_features if layer.parallel == "row" else layer.out_features, layer.heads,
                           tp)[1] is None
    return True


def _pad_hint(k: KernelDecl, layer: LayerQuant, device: Device, tp: int, decls: EngineDecls,
              disabled: frozenset[str], cat: str, cats: set[str]) -> str | None:
    """Pad the per-rank K (or N) up to the multiple the kernel wants, if that alone clears the category."""
    facts = _facts(layer, device, tp, decls)[0]
    dim_k = cat == "shape_k"
    if dim_k:
        mults = [m for m in (k.in_divisible, k.k_part_multiple) if m]
        if k.strict_with_g_idx and layer.desc_act:
            mults.append(k.strict_with_g_idx["k_part_multiple"])
        if layer.group_size > 0:
            mults.append(layer.group_size)
        part, label = facts.k_part, facts.kl
    else:
        mults = [m for m in (k.out_divisible, k.n_part_multiple) if m]
        if k.strict_with_g_idx and layer.desc_act:
            mults.append(k.strict_with_g_idx["n_part_multiple"])
        if k.n_part_pack_factor and 32 % layer.bits == 0:
            mults.append(32 // layer.bits)
        part, label = facts.n_part, facts.nl
    if not mults:
        return None
    need = math.lcm(*mults)
    padded = _round_up(part, need)
    if padded == part:
        return None
    split = facts.k_split if dim_k else facts.n_split
    full = padded * tp if split else padded
    new_layer = replace(layer, in_features=full) if dim_k else replace(layer, out_features=full)
    new = _check(k, _facts(new_layer, device, tp, decls)[0], disabled)[0]
    if cat in {x.category for x in new}:
        return None
    return f"pad {label} {part} -> {padded} (multiple of {need})"


def _software_fix(text: str) -> str:
    if text.startswith("package "):
        pkg = text.split()[1]
        return f"pip install {PACKAGE_PIP.get(pkg, pkg)}"
    if text.startswith("torch lacks"):
        return "upgrade torch (needs " + text.split()[-1] + ")"
    if text.startswith("torch "):
        return "upgrade torch to >= " + text.split()[-1]
    return text


def _method_hint(layer: LayerQuant, failures: list[Failure]) -> str | None:
    hints = []
    for f in failures:
        if f.category == "format":
            family = layer.format.split(":", 1)[0]
            if family == "gptq_p" and layer.bits in (2, 4, 8):
                hints.append("gptq_p at 2/4/8 bits is bit-identical to gptq: relabel it (qtool repack --to gptq)")
            elif family in ("gptq_p", "marlin"):
                hints.append("repack to gptq (qtool repack --to gptq); vLLM repacks to its kernels at load")
            elif family in ("gguf", "bnb"):
                hints.append("vLLM's method list at the seed's pin has no gguf or bitsandbytes (SGLang loads them)")
        elif f.category == "bits":
            hints.append("re-quantize to 4-bit or 8-bit")
        elif f.category == "sym":
            hints.append("re-quantize symmetric, or export as compressed-tensors (ct) with zero points")
    return "; ".join(hints) or None


# ------------------------------------------------------------------------------------------------------
# Layer notes and small helpers
# ------------------------------------------------------------------------------------------------------

def _layer_notes(f: _Facts, decls: EngineDecls, walk: list[KernelDecl], blocked: str | None) -> list[str]:
    L = f.layer
    notes = [x.text for x in f.tp_failures]
    g = L.group_size
    if f.k_split and g > 0 and g < L.in_features and f.k_part % g:
        notes.append(f"groups straddle TP shards: K_part {f.k_part} % group_size {g} = {f.k_part % g} "
                     "(a rank holds a partial group)")
    if f.k_split and L.desc_act:
        notes.append(f"act-order with K split across {f.tp} ranks")
    if not walk and not blocked:
        if decls.walk == "list":
            notes.append(f"{decls.engine} declares no kernel list for this layer on platform {f.device.platform}")
        else:
            notes.append(f"no {decls.engine} kernel declares format {f.engine_format}")
    if blocked:
        when = "when the engine starts" if blocked in {g.name for g in decls.engine_gates} else "at config time"
        notes.append(f"refused by {blocked} {when}, before any kernel is tried")
    return notes


def _fmt(values: Iterable) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)
