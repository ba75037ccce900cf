"""The detection protocol: what a format's `detect(module, t, claims)` reads and returns (no torch, no I/O).

    t:       {short tensor name: Sig} of one module, Sig = (safetensors dtype name, shape): "I32", "F16",
             "F8_E4M3", ...; bitsandbytes' `weight.absmax`-style names keep their tail
    claims:  what the config and file metadata say (`Claims`), already narrowed to the module (GPTQModel
             `dynamic` overrides applied)
    returns: `Detected` (this layout, possibly with error notes), or None (not this layout)

inspect asks the formats in a fixed order (qtool/inspect/detect.py); the shared helpers here are the facts
every detector needs in the same words (group size from the number of groups, the bits the config claims,
the tensors no detector reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qtool.io.config_regex import BoundedRegex, WorkBudget, compile_config_regex

Sig = tuple[str, tuple[int, ...]]          # (safetensors dtype name, shape)

FLOAT_DTYPES = {"F16": 16, "BF16": 16, "F32": 32, "F64": 64}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}
GPTQ_FAMILY = ("gptq", "gptq_v2", "gptq_p")
AWQ_FAMILY = ("awq", "awq_gemv", "awq_gemv_fast")


@dataclass
class Claims:
    """What the config and file metadata say. Every field may be None (silent).

    format:  qtool format id implied by the config ("gptq", "gptq_v2", "awq", "ct", ...)
    source:  where the claim came from, for messages ("config.json", "quantize_config.json", ...)
    ct_groups: compressed-tensors config_groups as [(targets, weights dict, format, input_activations dict)],
             ct_ignore: ignore list
    block_size: fp8 weight_block_size [rows, cols]
    bnb_shape: read from tensor data by inspect (the header alone cannot give it), set per module
    """

    format: str | None = None
    quant_method: str | None = None
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    desc_act: bool | None = None
    checkpoint_format: str | None = None
    source: str = "config"
    ct_groups: list[tuple[list[str], dict, str | None, dict]] = field(default_factory=list)
    ct_ignore: list[str] = field(default_factory=list)
    ct_version: str | None = None
    block_size: tuple[int, int] | None = None
    bnb_blocksize: int | None = None
    marlin_padding: dict[str, list[int]] = field(default_factory=dict)   # module -> [N, K, Np, Kp]
    bnb_shape: tuple[int, int] | None = None   # [out, in] of this module's bitsandbytes 4-bit quant state
    raw: dict = field(default_factory=dict)
    path: str | None = None            # the file the claims were read from, for errors
    regexes: dict[str, BoundedRegex] = field(default_factory=dict, repr=False, compare=False)
    regex_budget: WorkBudget = field(default_factory=WorkBudget, repr=False, compare=False)

    @property
    def quantized(self) -> bool:
        return self.format is not None or self.quant_method is not None


def config_regex(c: Claims, pattern: str, key: str) -> BoundedRegex:
    """A regex from the config, compiled once per Claims into qtool's bounded matcher (never `re`: a
    hostile pattern would backtrack for ever); InputError naming the file and key when it is refused."""
    rx = c.regexes.get(pattern)
    if rx is None:
        rx = c.regexes[pattern] = compile_config_regex(pattern, path=c.path or c.source, key=key,
                                                       budget=c.regex_budget)
    return rx


def _ct_hit(claims: Claims, pat: str, module: str) -> bool:
    if pat.startswith("re:"):
        return config_regex(claims, pat[3:], "compressed-tensors targets/ignore").match(module)
    if pat[:1].isupper() and "." not in pat:  # a class name
        return pat.endswith("Linear")
    return module == pat or module.endswith("." + pat)


def ct_scheme_for(claims: Claims, module: str) -> tuple[dict | None, str | None, bool]:
    """The compressed-tensors config group that targets `module`: (weights, group format, ignored).

    Targets are class names ("Linear": any linear module, since headers carry no classes), `re:` regexes
    (matched against the module name) or literal names/suffixes. `ignore` works the same way.
    """
    ignored = any(_ct_hit(claims, p, module) for p in claims.ct_ignore if not (p[:1].isupper() and "." not in p))
    for targets, weights, fmt, _acts in claims.ct_groups:
        if any(_ct_hit(claims, t, module) for t in targets):
            return weights, fmt, ignored
    return None, None, ignored


def ct_activations_for(claims: Claims, module: str) -> dict:
    """The `input_activations` of the compressed-tensors config group that targets `module` ({}: none, the
    weight-only case)."""
    for targets, _w, _f, acts in claims.ct_groups:
        if any(_ct_hit(claims, t, module) for t in targets):
            return acts
    return {}


# compressed-tensors input_activations (type, num_bits) -> the activation dtype select plans for
ACT_DTYPES = {("float", 8): "fp8", ("int", 8): "int8"}


def activation_dtype(acts: dict) -> str | None:
    """"fp8" / "int8" for a config group's `input_activations`; None when the config quantizes no activations
    or names a type ACT_DTYPES does not know."""
    return ACT_DTYPES.get((acts.get("type"), acts.get("num_bits"))) if acts else None


def activation_detail(acts: dict) -> str | None:
    """"activations fp8, dynamic per-token" for a config group's `input_activations` (inspect's detail text);
    None as for activation_dtype."""
    name = activation_dtype(acts)
    if name is None:
        return None
    how = "dynamic" if acts.get("dynamic") else "static"
    strategy = acts.get("strategy")
    return f"activations {name}, {how}" + (f" per-{strategy}" if isinstance(strategy, str) else "")


@dataclass
class Detected:
    """One module's detected layout. bits/group_size/... are None when the header cannot tell.

    n_weights: logical weight count (I*O) used for bits-per-weight; notes: (severity, message) with the
    module name left out so identical findings across modules can be merged.
    """

    format: str
    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None
    desc_act: bool | None = None
    in_features: int | None = None
    out_features: int | None = None
    n_weights: int | None = None
    detail: str | None = None
    notes: list[tuple[str, str]] = field(default_factory=list)
    activations: str | None = None  # the dtype the config quantizes the module's inputs to ("fp8", "int8")
    weight_scale: str | None = None  # FP8 / INT8 weight-scale grid: "tensor", "channel" or "block"
    block: tuple[int, int] | None = None  # the [out, in] block of a "block" grid
    experts: int | None = None  # a stack of this many [O / experts, I] matrices (a mixture of experts' GGUF tensor)

    @property
    def quantized(self) -> bool:
        return self.format != "dense"


def exact_div(a: int, b: int) -> int | None:
    return a // b if b and a % b == 0 else None


def group_from(in_features: int | None, n_groups: int, claimed: int | None) -> tuple[int | None, str | None]:
    """(group_size, problem) from I and the number of group rows; the claim wins when it is consistent."""
    if in_features is None:
        return claimed, None
    if claimed is not None:
        eff = in_features if claimed == -1 else claimed
        if eff > 0 and -(-in_features // eff) == n_groups:
            return claimed, None
    if n_groups == 1:
        g = -1
    else:
        g = exact_div(in_features, n_groups) or (-(-in_features // n_groups) if n_groups > 0 else None)
    if claimed is not None:
        return g, f"config says group_size {claimed} but the tensors hold {n_groups} groups over {in_features} " \
                  f"inputs (group_size {g})"
    return g, None


def bits_note(c: Claims, bits: int | None) -> list[tuple[str, str]]:
    if c.bits is not None and bits is not None and c.bits != bits:
        return [("error", f"config says {c.bits}-bit but the tensor shapes give {bits}-bit")]
    return []


INT_DTYPES = frozenset({"U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})
# Element types of codes rather than weights: a "weight" of one of them that no detector claims is packed
# data of a layout qtool does not read (an FP4 or FP8 weight whose scales are missing), never nothing
CODE_DTYPES = INT_DTYPES | FP8_DTYPES | {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"}
# Names other layouts give their codes or quantization state. Any of them in a module that no detector
# below claims makes the module an unknown quantized layout (an error), never a dense one.
SIDECARS = frozenset({
    "qweight", "qzeros", "scales", "zeros", "scaled_zeros", "g_idx", "absmax", "quant_map", "nested_absmax",
    "nested_quant_map", "biases", "SCB", "B", "s", "s_channel", "s_group", "trellis", "suh", "svh", "su", "sv",
    "mcg", "mul1", "q_weight", "q_scale", "q_scale_max", "q_groups", "q_perm", "q_invperm", "weight_packed",
    "weight_scale", "weight_zero_point", "weight_scale_inv", "weight_global_scale", "weight_g_idx"})


def unclaimed(t: dict[str, Sig]) -> Detected | None:
    """What is left after every detector: None for a module with nothing quantized-looking (norms, biases,
    float weights of other ranks), else "unknown" with an error naming the tensors no detector reads."""
    ints = sorted(k for k, (dt, _shape) in t.items() if dt in CODE_DTYPES and "weight" in k.lower())
    side = sorted(set(t) & SIDECARS)
    if not ints and not side:
        return None
    seen = ", ".join(f"{k} {t[k][0]} {list(t[k][1])}" for k in sorted(set(ints) | set(side)))
    if ints:
        why = "weight tensors of integer or packed element types"
    elif "weight" in t:
        why = "a float weight beside quantization sidecars"
    else:
        why = "quantization sidecars without a packed weight qtool knows"
    return Detected("unknown", detail="unknown quantized layout",
                    notes=[("error", f"unknown quantized layout: {why} ({seen}) that no qtool detector reads; "
                                     "its format, bits and shape are unknown, so nothing about it is checked; "
                                     "fix: add the quantization config that names the format, or convert the "
                                     "checkpoint with the tool that wrote it")])
