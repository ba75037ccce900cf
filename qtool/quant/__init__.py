"""Quantizers producing the canonical `Plain` (FORMATS.md "Canonical form").

    quantize(weight float [O, I], bits, group_size, sym, method="rtn"|"mse", scale_dtype=fp16, g_idx=None)
        -> Plain(qweight uint8 [O, I], scales scale_dtype [O, n_groups], zeros uint8 [O, n_groups] or None
                 (sym), g_idx int32 [I] or None, bits, group_size)

`rtn`: per-group min-max round to nearest (rtn.py). `mse`: per-group clip-ratio search minimising squared
error (mse.py). Rows are processed in blocks of about CHUNK_ELEMENTS weights so peak memory stays bounded
on large layers (a 4096x14336 layer never materialises more than a few block-sized float32 temporaries).

    scale_underflow(weight [O, I], plain) -> ScaleUnderflow or None
        the groups, of a Plain from any method, that the scale dtype fails: zeroed by an underflowed scale, or
        left with a subnormal scale of few significant bits; callers report them (pack's warnings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import InputError, NotRepresentable, UsageError
from qtool.formats.plain import FLOAT_DTYPES, Plain
from qtool.quant import mse, rtn

METHODS = {"rtn": rtn.quantize_groups, "mse": mse.quantize_groups}
BITS = range(2, 9)
GROUP_RANGE = (16, 1024)
CHUNK_ELEMENTS = 1 << 21


def _where(name: str | None) -> str:
    return f" for '{name}'" if name else ""


def validate(in_features: int, bits: int, group_size: int, method: str = "rtn", name: str | None = None) -> None:
    """Raise UsageError when bits / group_size / method cannot quantize a layer with this in_features."""
    if method not in METHODS:
        raise UsageError(f"unknown quantization method '{method}'", fix="use --method rtn or --method mse")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise UsageError(f"bits={bits!r} is outside 2..8{_where(name)}", fix="use --bits 2..8")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise UsageError(f"group_size={group_size!r} is not an integer", fix="use -1 or 16..1024")
    if group_size == -1:
        return
    lo, hi = GROUP_RANGE
    if not lo <= group_size <= hi:
        raise UsageError(f"group_size={group_size} is outside {lo}..{hi}{_where(name)}",
                         fix=f"use -1 (one group per row) or a size in {lo}..{hi} dividing in_features")
    if in_features % group_size:
        raise UsageError(f"group_size {group_size} does not divide in_features {in_features}{_where(name)}",
                         fix="choose a group size that divides in_features, or -1")


def _column_order(g_idx: torch.Tensor | None, in_features: int, group: int, name: str | None):
    """Permutation that makes each group's columns contiguous (None = already trivial)."""
    if g_idx is None:
        return None
    g = torch.as_tensor(g_idx).to(torch.int64)
    if g.shape != (in_features,):
        raise UsageError(f"g_idx has shape {tuple(g.shape)}, expected ({in_features},){_where(name)}")
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(in_features) // group):
        raise UsageError(f"g_idx must put exactly group_size={group} input channels in each group "
                         f"0..{in_features // group - 1}{_where(name)}",
                         fix="build g_idx as GPTQ act-order does: g_idx[perm[i]] = i // group_size")
    return perm


def _first(mask: torch.Tensor) -> tuple[int, int]:
    r, c = (int(v) for v in mask.nonzero()[0])
    return r, c


def _refuse_nonfinite(weight: torch.Tensor, r0: int, r1: int, name: str | None) -> None:
    """InputError naming the first value of rows r0..r1 that is NaN/inf (or beyond float32's range)."""
    block = weight[r0:r1].cpu()
    bad = ~torch.isfinite(block)
    if bool(bad.any()):
        r, c = _first(bad)
        n = int(bad.sum())
        raise InputError(f"the weight holds {float(block[r, c])} at [{r0 + r}, {c}] (the first of {n} "
                         f"NaN/inf values in rows {r0}..{r1 - 1})", tensor=name,
                         fix="fix the source weights or --exclude this module")
    r, c = _first(~torch.isfinite(block.to(torch.float32)))
    raise InputError(f"the weight holds {float(block[r, c]):.6g} at [{r0 + r}, {c}], beyond float32's "
                     f"range", tensor=name, fix="rescale the source weights or --exclude this module")


def _refuse_scale_overflow(weight: torch.Tensor, w: torch.Tensor, s: torch.Tensor, r0: int, group: int,
                           perm: torch.Tensor | None, bits: int, scale_dtype: torch.dtype, name: str | None) -> None:
    """NotRepresentable naming the first group whose scale is not finite in scale_dtype, its max |w| and the fix."""
    r, g = _first(~torch.isfinite(s.reshape(s.shape[0], -1)))
    cols = torch.arange(g * group, (g + 1) * group)
    amax = float(w[r, g * group:(g + 1) * group].abs().max())
    col = int(cols[0]) if perm is None else int(perm[cols].min())
    limit = torch.finfo(scale_dtype).max
    dt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[scale_dtype]
    if scale_dtype == torch.float16:
        fix = "write bf16 scales with --dtype bf16 (its range is float32's), or --exclude this module"
    else:
        fix = "rescale the source weights or --exclude this module"
    raise NotRepresentable(f"max |w| = {amax:.6g} in row {r0 + r}, group {g} (from column "
                           f"{col}) needs a {bits}-bit scale beyond {dt}'s largest value {limit:.6g}",
                           tensor=name, fix=fix)


def quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool, method: str = "rtn",
             scale_dtype: torch.dtype = torch.float16, g_idx: torch.Tensor | None = None,
             name: str | None = None) -> Plain:
    """Quantize weight [O, I] (fp16/bf16/fp32) to a Plain; see the module docstring for shapes.

    g_idx (int [I], optional): act-order group map; every group must hold exactly group_size channels.
    name: the tensor's name, used only in error messages.
    """
    if weight.dim() != 2:
        raise UsageError(f"can only quantize 2-D weights [out, in], got shape {tuple(weight.shape)}{_where(name)}")
    if not weight.is_floating_point():
        raise UsageError(f"weight dtype {weight.dtype} is not floating point{_where(name)}")
    if scale_dtype not in FLOAT_DTYPES:
        raise UsageError(f"scale dtype {scale_dtype} is not fp16/bf16/fp32", fix="use --dtype fp16 or bf16")
    out_features, in_features = weight.shape
    validate(in_features, bits, group_size, method, name)
    group = in_features if group_size == -1 else group_size
    n_groups = in_features // group
    perm = _column_order(g_idx, in_features, group, name)
    fn = METHODS[method]

    qweight = torch.empty(out_features, in_features, dtype=torch.uint8)
    scales = torch.empty(out_features, n_groups, dtype=scale_dtype)
    zeros = None if sym else torch.empty(out_features, n_groups, dtype=torch.uint8)
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        w = weight[r0:r1].to(device="cpu", dtype=torch.float32)
        if not torch.isfinite(w).all():
            _refuse_nonfinite(weight, r0, r1, name)
        if perm is not None:
            w = w[:, perm]
        q, s, z = fn(w.reshape(r1 - r0, n_groups, group), bits, sym, scale_dtype)
        if not torch.isfinite(s).all():
            _refuse_scale_overflow(weight, w, s, r0, group, perm, bits, scale_dtype, name)
        q = q.reshape(r1 - r0, in_features).to(torch.uint8)
        if perm is not None:
            qweight[r0:r1, perm] = q
        else:
            qweight[r0:r1] = q
        scales[r0:r1] = s.squeeze(-1).to(scale_dtype)
        if zeros is not None:
            zeros[r0:r1] = z.squeeze(-1).to(torch.uint8)
    gi = None if g_idx is None else torch.as_tensor(g_idx).to(torch.int32).contiguous()
    return Plain(qweight, scales, zeros, gi, bits, group_size, meta={"method": method})


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def coarse_scale_limit(scale_dtype: torch.dtype, bits: int) -> float:
    """The largest scale whose rounding to scale_dtype can move a code's value by a whole step: 2^(bits-2)
    of the dtype's smallest subnormal (fp16: 2.38e-07 at 4 bits, 3.81e-06 at 8)."""
    # A value is (q - z) s with |q - z| up to 2^(bits-1); rounding s moves it by up to 2^(bits-2) spacings of
    # the dtype, a whole step s once s is that small. Only subnormals get there (a normal fp16 scale moves it
    # by at most 1/16 of a step at 8 bits, a bf16 one by 1/2), and they keep at most 7 significant bits, fewer
    # than bf16's 8. Measured on groups of 128 normal weights: groups at the limit lose 1-3% more than with
    # float32 scales, groups far below it up to 7x, groups above it at most 0.4%.
    fi = torch.finfo(scale_dtype)
    return fi.tiny * fi.eps * 2 ** (bits - 2)


@dataclass(frozen=True)
class ScaleUnderflow:
    """The groups of one quantized weight its scale dtype fails (see scale_underflow).

    groups: groups in the weight (rows x groups per row)
    zeroed: groups holding a nonzero weight of which every weight dequantizes to 0; zeroed_amax: the largest
            |w| among them (of the weight passed in, 0.0 when none)
    coarse: other groups holding a nonzero weight whose scale is at most coarse_scale_limit; coarse_amax
            likewise
    """

    groups: int
    zeroed: int
    zeroed_amax: float
    coarse: int
    coarse_amax: float
    bits: int
    scale_dtype: torch.dtype

    def message(self, fix: str | None = None) -> str:
        """One line: what happened to how many groups, the largest |w| among them, and the fix (pack's flags
        unless the caller names its own)."""
        dt = _DTYPE_NAMES.get(self.scale_dtype, str(self.scale_dtype))
        parts = []
        if self.zeroed:
            parts.append(f"every nonzero weight of {self.zeroed} of {self.groups} groups dequantizes to 0 "
                         f"(largest |w| among them {self.zeroed_amax:.3g}): their {self.bits}-bit scale underflows "
                         f"{dt}, and its smallest normal, {torch.finfo(self.scale_dtype).tiny:.3g}, stands in")
        if self.coarse:
            parts.append(f"{self.coarse} of {self.groups} groups have {dt} scales of at most "
                         f"{coarse_scale_limit(self.scale_dtype, self.bits):.3g}, subnormals whose rounding can "
                         f"move a weight by a whole step (largest |w| among them {self.coarse_amax:.3g})")
        if fix is not None:
            parts.append(fix)
        elif self.scale_dtype == torch.float16:
            parts.append("use --dtype bf16 (bf16 scales have float32's range) or --exclude this module")
        else:
            parts.append("rescale the source weights or --exclude this module")
        return "; ".join(parts)


def scale_underflow(weight: torch.Tensor, plain: Plain) -> ScaleUnderflow | None:
    """The groups of `plain` (weight [O, I] quantized by any method; any float dtype, any device) that its
    scale dtype fails, or None when there are none.

    A group is zeroed when its scale is at or below the dtype's smallest normal (where rtn.py's floor puts a
    scale that underflows), it holds a nonzero weight, and every code sits at the zero point: each weight
    then dequantizes to exactly 0. A group is coarse when it is not zeroed, holds a nonzero weight and its
    scale is at most coarse_scale_limit. Only rows with a scale at or below the smallest normal are read, so a
    weight of ordinary magnitudes costs one comparison over its scales [O, n_groups].
    """
    s = plain.scales.cpu()
    low = s <= torch.finfo(s.dtype).tiny
    if not bool(low.any()):
        return None
    coarse_at = coarse_scale_limit(s.dtype, plain.bits)
    in_features, n_groups = plain.in_features, plain.n_groups
    gi = plain.group_index().cpu()
    zp = plain.zeros_or_midpoint().cpu()
    rows = low.any(1).nonzero().squeeze(1)
    zeroed = coarse = 0
    zeroed_amax = coarse_amax = 0.0
    step = max(1, CHUNK_ELEMENTS // max(in_features, 1))
    for k in range(0, rows.numel(), step):
        r = rows[k:k + step]
        n = r.numel()
        # float64: the smallest values of a float64 source stay nonzero
        w = weight.index_select(0, r.to(weight.device)).to(device="cpu", dtype=torch.float64).abs_()
        amax = torch.zeros(n, n_groups, dtype=torch.float64).scatter_reduce_(1, gi.expand(n, -1), w, "amax")
        off_zero = plain.qweight.index_select(0, r.to(plain.qweight.device)).cpu() != zp[r].index_select(1, gi)
        moved = torch.zeros(n, n_groups, dtype=torch.int32).index_add_(1, gi, off_zero.to(torch.int32))
        held = amax > 0
        z = low[r] & held & (moved == 0)
        c = (s[r] <= coarse_at) & held & ~z
        if bool(z.any()):
            zeroed += int(z.sum())
            zeroed_amax = max(zeroed_amax, float(amax[z].max()))
        if bool(c.any()):
            coarse += int(c.sum())
            coarse_amax = max(coarse_amax, float(amax[c].max()))
    if not (zeroed or coarse):
        return None
    return ScaleUnderflow(plain.out_features * n_groups, zeroed, zeroed_amax, coarse, coarse_amax, plain.bits,
                          s.dtype)


__all__ = ["METHODS", "ScaleUnderflow", "quantize", "scale_underflow", "validate"]
