"""Clip-ratio search: per group, the shrink of the min-max range that minimises squared error.

For each ratio r in RATIOS (1.0 first, down to 0.5) the group's range is scaled by r, the scale rounded to
the scales dtype, codes computed as in rtn.py, and the squared error sum((w - s*(q - z))^2) measured with
the same float32 products dequantize uses. Each group keeps its best ratio independently; ties keep the
earlier (larger) ratio, and r = 1.0 is exactly RTN, so no group's error is above RTN's.
Vectorised over all groups of a row block; the only Python loop is over the ratios, and only per-group
parameters are kept between ratios (codes are computed once, at the end).
"""

from __future__ import annotations

import torch

from qtool.quant.rtn import codes, group_range, params_from_range

# 1.0, 0.975, ..., 0.5: fine enough that 3/4-bit gains saturate, short enough for big layers.
RATIOS = tuple(1.0 - 0.025 * k for k in range(21))


def quantize_groups(wg: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype,
                    ratios: tuple[float, ...] = RATIOS):
    """wg float32 [R, n_groups, G] -> (q float32 [R, n_groups, G], scale [R, n_groups, 1], zero [R, n_groups, 1])."""
    maxq = (1 << bits) - 1
    xmin, xmax = group_range(wg, sym)
    best_s = best_z = best_err = None
    buf = torch.empty_like(wg)
    for r in ratios:
        scale, zero = params_from_range(xmin, xmax, bits, sym, scale_dtype, ratio=r)
        # clamp(round(w/s), -z, maxq - z) == clamp(round(w/s) + z, 0, maxq) - z exactly (small integers).
        t = torch.div(wg, scale, out=buf).round_()
        t = torch.clamp(t, min=-zero, max=maxq - zero, out=buf)
        err = t.mul_(scale).sub_(wg).square_().sum(-1, keepdim=True)
        if best_err is None:
            best_s, best_z, best_err = scale, zero, err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
        best_z = torch.where(better, zero, best_z)
    return codes(wg, best_s, best_z, bits), best_s, best_z
