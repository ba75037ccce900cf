"""AWQ GEMM layout `awq` (AutoAWQ "gemm" version; FORMATS.md "AWQ GEMM").

Tensors of one linear module, I = in_features, O = out_features, n_groups = I / G, 4-bit only:

    qweight  int32 [I, O/8]         codes packed along the OUTPUT columns, interleaved: nibble i (shift 4i)
                                    of word c holds column 8c + AWQ_ORDER[i], AWQ_ORDER = [0,2,4,6,1,3,5,7]
    qzeros   int32 [n_groups, O/8]  true zeros (no -1), packed and interleaved the same way
    scales   fp16/bf16/fp32 [n_groups, O]

No g_idx: act-order cannot be stored. Bias is not part of the layout. Relation to `gptq_v2`: the same
Plain, packed along the other axis with the interleave, so AWQ <-> GPTQ v2 is exact both ways.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from qtool.errors import FormatError, NotRepresentable, UsageError
from qtool.formats.base import Format, FormatSpec, expect, register
from qtool.formats.detection import GPTQ_FAMILY, Claims, Detected, Sig, bits_note, exact_div, group_from
from qtool.formats.gptq import V2, gptq_shaped, gptqmodel_config, infer_group_size, is_lm_head, quantizer_meta
from qtool.formats.plain import FLOAT_DTYPES, Plain
from qtool.lazy import lazy_module
from qtool.packing.bitstream import pack_stream, unpack_stream
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

# Nibble slot i of a word holds column 8c + AWQ_ORDER[i]; AWQ_INVERSE maps a column back to its slot.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


# Why an AWQ config holds one scheme and a dense LM head. vLLM's AWQConfig.from_config and
# AWQMarlinConfig.from_config read bits, group_size and zero_point (and modules_to_not_convert), transformers'
# AWQ path (replace_with_awq_linear) builds every linear with the config's one group_size, AutoAWQ likewise:
# none reads GPTQModel's per-module `dynamic`, so a module of another group size is built with the wrong shapes.
# The LM head: transformers adds the output embedding to modules_to_not_convert, AutoAWQ quantizes only the
# decoder blocks, and vLLM's AWQConfig builds ParallelLMHead unquantized (only AWQMarlinConfig reads `lm_head`).
AWQ_ONE_SCHEME = ("AWQ loaders (vLLM's AWQConfig and AWQMarlinConfig, transformers' AWQ path, AutoAWQ) read one "
                  "bits/group_size/zero_point for the whole model, no per-module override")
AWQ_DENSE_LM_HEAD = ("AWQ loaders keep the LM head dense (transformers and AutoAWQ never convert it, vLLM's "
                     "AWQConfig builds it unquantized) and would find no weight to load")


def schemes_by_module(modules) -> dict[tuple[int, int, bool], list[str]]:
    """{(bits, group_size, sym): module names} of `modules`, [(name, bits, group_size, sym)], in their order."""
    out: dict[tuple[int, int, bool], list[str]] = {}
    for name, bits, group, sym in modules:
        out.setdefault((bits, group, bool(sym)), []).append(name)
    return out


def describe_schemes(groups: dict[tuple[int, int, bool], list[str]]) -> str:
    """'2 at 4-bit group 64 (a, b); 12 at 4-bit group 32 (c, d, e, ...)', the fewest first."""
    parts = []
    for (bits, group, sym), names in sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0])):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{len(names)} at {bits}-bit group {group}{' symmetric' if sym else ''} ({shown})")
    return "; ".join(parts)


@dataclass(frozen=True)
class AwqMismatch:
    """Why one AWQ config cannot describe the modules an output would hold quantized (awq_mismatch).

    problem:    one sentence naming the modules and the loaders' rule they break
    module:     the module an error names: the LM head, or the first module of the least common scheme
    lm_head:    True for a quantized LM head (AWQ_DENSE_LM_HEAD), False for more than one scheme (AWQ_ONE_SCHEME)
    group_size: where the schemes differ in group size alone, the one group size that splits every module's
                groups exactly (their greatest common divisor); None otherwise
    """

    problem: str
    module: str
    lm_head: bool
    group_size: int | None = None

    @property
    def conversion_fix(self) -> str:
        """The fix for an output converted from quantized modules (`qtool repack`), whose --group-size splits
        coarser groups into finer ones exactly."""
        if self.lm_head:
            return "convert to gptq or gptq_v2, whose config records \"lm_head\": true"
        return ((f"add --group-size {self.group_size}, or " if self.group_size else "")
                + "convert to gptq_v2, whose loaders read per-module overrides (dynamic)")


def awq_mismatch(modules) -> AwqMismatch | None:
    """The AWQ rules for a whole output, checked once for pack and repack: None when one AWQ config describes
    `modules`, [(name, bits, group_size, sym)] of every module written quantized; else why not. A quantized LM
    head comes first (no --group-size mends it)."""
    modules = list(modules)
    head = next((name for name, *_ in modules if is_lm_head(name)), None)
    if head is not None:
        return AwqMismatch(f"awq cannot hold a quantized LM head ({head}): {AWQ_DENSE_LM_HEAD}", head, True)
    groups = schemes_by_module(modules)
    if len(groups) < 2:
        return None
    sizes = [g for _b, g, _s in groups if g > 0]
    same_but_group = len({(b, s) for b, _g, s in groups}) == 1
    return AwqMismatch(f"an awq config holds one scheme for every module, and {AWQ_ONE_SCHEME}; the modules would "
                       f"be written as {describe_schemes(groups)}", min(groups.values(), key=len)[0], False,
                       math.gcd(*sizes) if same_but_group and sizes else None)


def interleave_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N] natural column order -> slot order (slot 8c + i holds column 8c + AWQ_ORDER[i])."""
    n = codes.shape[-1]
    return codes.reshape(*codes.shape[:-1], n // 8, 8)[..., torch.tensor(AWQ_ORDER)].reshape(codes.shape)


def deinterleave_columns(slots: torch.Tensor) -> torch.Tensor:
    """Inverse of interleave_columns."""
    n = slots.shape[-1]
    return slots.reshape(*slots.shape[:-1], n // 8, 8)[..., torch.tensor(AWQ_INVERSE)].reshape(slots.shape)


def pack_awq_cols(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] 4-bit codes -> int32 [R, N/8] AWQ-interleaved words."""
    return pack_stream(interleave_columns(codes).contiguous(), 4, dim=-1)


def unpack_awq_cols(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [R, N/8] AWQ words -> uint8 [R, N] codes in natural column order."""
    return deinterleave_columns(unpack_stream(words, 4, n, dim=-1)).contiguous()



def awq_gemm_shaped(t: Mapping[str, Sig]) -> bool:
    """Every tensor of the row, qweight int32 [I, W] and qzeros [nG, W] with W words along O = scales'
    columns, as AutoAWQ's GEMM version writes them (GPTQ files can share these shapes; see gptq_shaped)."""
    if any(n not in t for n in AwqGemm.spec.required):
        return False
    (qw_dt, qw), sc, qz = t["qweight"], t["scales"][1], t["qzeros"][1]
    if qw_dt != "I32" or len(qw) != 2 or len(sc) != 2:
        return False
    n_groups, out = sc
    return qw[1] != out and qz[0] == n_groups and qz[1] == qw[1] and out % qw[1] == 0

@register
class AwqGemm(Format):
    spec = FormatSpec(
        id="awq",
        aliases=("awq_gemm",),
        bits=(4,),
        tensors=("qweight", "qzeros", "scales"),
        required=("qweight", "qzeros", "scales"),
        summary="AWQ GEMM 4-bit (true z): qweight int32 [I, O/8] packed along O with nibble interleave "
                "[0,2,4,6,1,3,5,7], qzeros [I/G, O/8], scales [I/G, O], no g_idx",
        act_order=False,
        out_multiple={4: 8},
    )

    def check(self, plain: Plain) -> list[str]:
        why = super().check(plain)
        why += plain.check_ranges()
        return why

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """qweight int32 [I, O*b/32] packed along the outputs, qzeros [nG, O*b/32], scales [nG, O], when the
        shapes are not also GPTQ's."""
        if not awq_gemm_shaped(t) or gptq_shaped(t):
            return None
        c = claims
        qw = t["qweight"][1]
        n_groups, out = t["scales"][1]
        bits = exact_div(qw[1] * 32, out)
        notes: list[tuple[str, str]] = []
        if bits not in self.spec.bits:
            notes.append(("warning", f"AWQ GEMM with {bits}-bit codes: the classic interleaved layout is 4-bit only"))
        in_f = qw[0]
        if c.format in GPTQ_FAMILY:
            notes.append(("error", f"config says {c.format} but the tensors have the AWQ GEMM layout (qweight "
                                   f"packed along outputs, [I, O*b/32]); fix: quant_method: awq, version: gemm"))
        elif c.format not in (None, "awq"):
            notes.append(("error", f"config says {c.format} but the tensors have the AWQ GEMM layout"))
        if "g_idx" in t:
            notes.append(("warning", "AWQ GEMM has no g_idx, but this module carries one"))
        group, gnote = group_from(in_f, n_groups, c.group_size)
        if gnote:
            notes.append(("error", gnote))
        notes += bits_note(c, bits)
        sym = c.sym if c.sym is not None else False
        return Detected("awq", bits, group, sym, False, in_f, out, in_f * out, detail="AWQ gemm", notes=notes)

    def pack(self, plain: Plain) -> dict[str, torch.Tensor]:
        """Plain -> {"qweight", "qzeros", "scales"} (see module docstring). NotRepresentable lists why not."""
        why = self.check(plain)
        if why:
            fix = "write --to gptq_v2 (it keeps g_idx)" if plain.desc_act else None
            raise NotRepresentable("cannot store this weight as awq: " + "; ".join(why), fix=fix)
        return {
            "qweight": pack_awq_cols(plain.qweight.t().contiguous()),
            "qzeros": pack_awq_cols(plain.zeros_or_midpoint().t().contiguous()),
            "scales": plain.scales.t().contiguous(),
        }

    def config_for(self, bits: int, group_size: int, sym: bool, desc_act: bool, extra: dict | None = None, *,
                   lm_head: bool = False) -> dict:
        """The AutoAWQ-style `quantization_config` (GEMM version; no act-order to declare); `extra` last. An LM
        head cannot be declared quantized (AWQ_DENSE_LM_HEAD): pack and quantization_config refuse it first."""
        if lm_head:
            raise FormatError(f"awq cannot hold a quantized LM head: {AWQ_DENSE_LM_HEAD}",
                              fix="write --to gptq_v2, whose config records \"lm_head\": true")
        cfg = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not sym,
               "version": "gemm", "format": "gemm", "desc_act": False, "sym": sym, "meta": quantizer_meta()}
        return cfg | (extra or {})

    def quantization_config(self, modules, dense=None) -> dict:
        """The config of converted `modules` [(name, scheme, meta)]: one scheme, no quantized LM head
        (awq_mismatch), else a UsageError naming the modules and the fix. repack refuses such a plan before
        converting anything; this guard keeps any other caller from writing a config its loaders misread."""
        bad = awq_mismatch([(name, s.bits, s.group_size, s.sym) for name, s, _m in modules])
        if bad is not None:
            raise UsageError(f"{bad.problem}; nothing was written", tensor=f"{bad.module}.qweight",
                             fix=bad.conversion_fix)
        return gptqmodel_config(self, modules, dense or ())

    def decode_zeros(self, qzeros: torch.Tensor, bits: int, out_features: int, params: QuantScheme):
        """qzeros int32 [R, O/8] (any R group rows) -> (true zero points uint8 [R, O] in natural column order,
        "v2"): AWQ stores z itself, as GPTQ v2 does. The same decoding unpack uses, for callers that read the
        zeros alone (repack checks a config's sym against them before planning)."""
        if bits != 4:
            raise FormatError(f"awq GEMM holds 4-bit codes, the config says {bits}-bit",
                              tensor="qzeros", fix="check the checkpoint's quantization_config")
        return unpack_awq_cols(qzeros, out_features), V2

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> Plain:
        """{"qweight", "qzeros", "scales"} -> Plain (4-bit, true zeros, trivial g_idx)."""
        qweight = expect(tensors, "qweight", "awq", dtype=torch.int32, dims=2)
        qzeros = expect(tensors, "qzeros", "awq", dtype=torch.int32, dims=2)
        scales = expect(tensors, "scales", "awq", dims=2)
        if scales.dtype not in FLOAT_DTYPES:
            raise FormatError(f"awq: 'scales' must be fp16/bf16/fp32, got {scales.dtype}", tensor="scales")
        if params.bits not in (None, 4):
            raise FormatError(f"awq GEMM holds 4-bit codes, the config says {params.bits}-bit",
                              fix="check the checkpoint's quantization_config")
        n_groups, out_features = scales.shape
        in_features = qweight.shape[0]
        if qweight.shape[1] * 8 != out_features:
            raise FormatError(f"awq: qweight {tuple(qweight.shape)} does not pack {out_features} 4-bit "
                              f"columns (needs {out_features / 8:g} words per row)", tensor="qweight")
        if tuple(qzeros.shape) != (n_groups, qweight.shape[1]):
            raise FormatError(f"awq: qzeros shape {tuple(qzeros.shape)} != ({n_groups}, {qweight.shape[1]})",
                              tensor="qzeros")
        group_size = params.group_size if params.group_size is not None else \
            infer_group_size(in_features, n_groups, "awq")
        expected = 1 if group_size == -1 else -(-in_features // group_size)
        if n_groups != expected:
            raise FormatError(f"awq: {n_groups} scale rows do not match in_features {in_features} with "
                              f"group_size {group_size}", tensor="scales")
        codes = unpack_awq_cols(qweight, out_features).t().contiguous()
        zeros = self.decode_zeros(qzeros, 4, out_features, params)[0].t().contiguous()
        if bool((zeros == 8).all()):
            zeros = None
        return Plain(codes, scales.t().contiguous(), zeros, None, 4, group_size, meta={"format": "awq"})
