"""Round-to-nearest min-max quantization of one block of groups (GPTQ's conventions).

All functions work on a grouped view `wg` float32 [R, n_groups, G] (rows x groups x members) and return
per-group parameters shaped [R, n_groups, 1] so they broadcast over the members.

- asym: xmin = min(min w, 0), xmax = max(max w, 0); s = (xmax - xmin) / (2^b - 1); z = round(-xmin / s)
  clamped to [0, 2^b - 1].
- sym:  amax = max|w|; s = 2 * amax / (2^b - 1); z = 2^(b-1) (so codes span the whole [0, 2^b - 1]).
- a group of zeros gets the range [-1, 1] (as GPTQ does) so no scale is 0 and nothing is NaN.
- s is rounded to the scales dtype *before* the codes are computed, so dequantize(plain) is exactly what the
  codes mean; a scale that underflows to 0 in that dtype is replaced by the dtype's smallest normal. That
  scale is far above such a group's weights, so every code sits at the zero point and the whole group
  dequantizes to 0: `qtool.quant.scale_underflow` finds those groups (and scales left with few significant
  bits) for the caller to report.
- q = clamp(round(w / s) + z, 0, 2^b - 1): GPTQ packers clamp.
`ratio` < 1 shrinks the range (clip search, see mse.py); 1.0 is plain RTN.
"""

from __future__ import annotations

import torch


def group_range(wg: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """wg float32 [R, n_groups, G] -> (xmin, xmax) float32 [R, n_groups, 1], both spanning 0, never both 0."""
    xmin = wg.amin(-1, keepdim=True).clamp_(max=0)
    xmax = wg.amax(-1, keepdim=True).clamp_(min=0)
    if sym:
        amax = torch.maximum(-xmin, xmax)
        xmin, xmax = -amax, amax
    empty = (xmin == 0) & (xmax == 0)
    return torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)


def params_from_range(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype,
                      ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Range [R, n_groups, 1] -> (scale float32 holding scale_dtype values, zero float32 integer-valued)."""
    maxq = (1 << bits) - 1
    if ratio != 1.0:
        xmin, xmax = xmin * ratio, xmax * ratio
    scale = ((xmax - xmin) / maxq).to(scale_dtype).to(torch.float32)
    # a scale of 0 would give NaN codes; the floor keeps them finite (and zeroes the group: see the docstring)
    scale = torch.where(scale > 0, scale, torch.finfo(scale_dtype).tiny)
    if sym:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        zero = torch.round(-xmin / scale).clamp_(0, maxq)
    return scale, zero


def group_params(wg: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype,
                 ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """wg float32 [R, n_groups, G] -> (scale, zero), each float32 [R, n_groups, 1]."""
    xmin, xmax = group_range(wg, sym)
    return params_from_range(xmin, xmax, bits, sym, scale_dtype, ratio)


def codes(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 integer-valued codes [R, n_groups, G] = clamp(round(w / s) + z, 0, 2^b - 1)."""
    return torch.div(wg, scale).round_().add_(zero).clamp_(0, (1 << bits) - 1)


def quantize_groups(wg: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype):
    """RTN of a grouped block: (q float32 [R, n_groups, G], scale [R, n_groups, 1], zero [R, n_groups, 1])."""
    scale, zero = group_params(wg, bits, sym, scale_dtype)
    return codes(wg, scale, zero, bits), scale, zero
