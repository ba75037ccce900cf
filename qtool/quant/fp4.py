"""Quantizers for the micro-float layouts: NVFP4 and OCP MX (MXFP4, MXFP8), producing `ScaledPlain`.

    quantize_nvfp4(weight [O, I], method) -> ScaledPlain   e2m1 codes, e4m3 scale per 16, fp32 global (div)
    quantize_mx(weight [O, I], element "e2m1"|"e4m3", method) -> ScaledPlain   e8m0 scale per 32

NVFP4 (amax): the global scale g is the largest power of two with g <= 448 * 6 / amax(W), so every block
scale g * amax(block) / 6 fits E4M3 and 1 / g is exact: the same bytes then serve compressed-tensors
(divide by g) and ModelOpt (multiply by 1 / g) exactly. compressed-tensors' own observer takes g = 448 * 6 /
amax unrounded; the power of two costs at most one bit of the E4M3 scales' range, none of their precision.
Block scale s = e4m3(g * amax(block) / 6), codes = e2m1(w / (s / g)), the effective scale formed in fp32 as
the readers form it.

MX (amax): the block exponent k is the least with amax(block) <= max(element) * 2^k, so nothing clips
(OCP MX v1.0 section 6.3's reference recipe takes floor(log2(amax)) - emax(element) instead, which clips
the top of the block to the element's max; `mse` considers both and keeps the better per block).

`mse` keeps, per block, the candidate scale with the least squared error (the amax one first, so never
worse than rtn): for NVFP4 the block scale shrunk by RATIOS, for MX the exponents k and k - 1.
An all-zero block (or one too small for any E4M3 scale) gets scale 1 (E8M0 byte 127) or the least E4M3
scale 2^-9, never 0: a zero scale is an anomaly inspect reports. NaN/inf in the weight: InputError naming the first.
"""

from __future__ import annotations

import math

import torch

from qtool.errors import InputError, UsageError
from qtool.formats.scaled import ScaledPlain
from qtool.packing.minifloat import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_decode,
    e8m0_from_exponent,
    floor_log2,
)

METHODS = ("rtn", "mse")
NV_GROUP, MX_GROUP = 16, 32
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# floor(log2(max)) of each element: E2M1 6 = 1.5 * 2^2, E4M3 448 = 1.75 * 2^8
_EMAX = {"e2m1": 2, "e4m3": 8}
_MAX = {"e2m1": E2M1_MAX, "e4m3": E4M3_MAX}


def _check(weight: torch.Tensor, group: int, method: str, name: str | None) -> torch.Tensor:
    where = f" for '{name}'" if name else ""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise UsageError(f"can only quantize 2-D float weights [out, in], got {weight.dtype} "
                         f"{tuple(weight.shape)}{where}")
    if method not in METHODS:
        raise UsageError(f"unknown method '{method}'{where}", fix="use --method rtn or mse")
    if weight.shape[1] % group:
        raise UsageError(f"in_features {weight.shape[1]} is not a multiple of the {group}-input block{where}",
                         fix="--exclude this module")
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        raise InputError(f"the weight holds {float(w[r, c])} at [{r}, {c}] (the first of {int(bad.sum())} "
                         "NaN/inf values)", tensor=name, fix="fix the source weights or --exclude this module")
    return w


def _encode(x: torch.Tensor, element: str) -> torch.Tensor:
    return e2m1_encode(x) if element == "e2m1" else e4m3_encode(x)


def _decode(c: torch.Tensor, element: str) -> torch.Tensor:
    return e2m1_decode(c) if element == "e2m1" else c.to(torch.float32)


def _global_power(amax: float) -> float:
    """The largest power of two g (a normal fp32) with g * amax <= 448 * 6; 1 for an all-zero weight."""
    if amax == 0:
        return 1.0
    k = math.floor(math.log2(E4M3_MAX * E2M1_MAX / amax))
    # log2 rounds: step to the exact boundary (amax is an fp32 value, exact in Python's float)
    while k > -126 and math.ldexp(amax, k) > E4M3_MAX * E2M1_MAX:
        k -= 1
    while k < 127 and math.ldexp(amax, k + 1) <= E4M3_MAX * E2M1_MAX:
        k += 1
    return math.ldexp(1.0, max(-126, min(127, k)))


def quantize_nvfp4(weight: torch.Tensor, method: str = "rtn", out_dtype: str = "bfloat16",
                   name: str | None = None) -> ScaledPlain:
    """weight [O, I] (I % 16 == 0) -> NVFP4 ScaledPlain in compressed-tensors' convention (module docstring)."""
    w = _check(weight, NV_GROUP, method, name)
    o, i = w.shape
    blocks = w.view(o, i // NV_GROUP, NV_GROUP)
    amax_b = blocks.abs().amax(-1)
    amax = float(amax_b.max()) if amax_b.numel() else 0.0
    g = torch.tensor([_global_power(amax)], dtype=torch.float32)

    def scales_for(ratio: float) -> torch.Tensor:
        s = e4m3_encode(amax_b * ratio * g / E2M1_MAX)
        sf = s.to(torch.float32)
        # a block too small for any E4M3 scale (or all zero) gets the least one above zero, never 0
        return torch.where(sf > 0, sf, torch.full_like(sf, 2.0 ** -9)).to(torch.float8_e4m3fn)

    def codes_for(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eff = (s.to(torch.float32) / g).unsqueeze(-1)
        c = e2m1_encode(blocks / eff)
        err = (e2m1_decode(c) * eff - blocks).square().sum(-1)
        return c, err

    s = scales_for(1.0)
    codes, err = codes_for(s)
    if method == "mse":
        for ratio in RATIOS[1:]:
            s2 = scales_for(ratio)
            c2, e2 = codes_for(s2)
            better = e2 < err
            s = torch.where(better, s2.view(torch.uint8), s.view(torch.uint8)).view(torch.float8_e4m3fn)
            codes = torch.where(better.unsqueeze(-1), c2, codes)
            err = torch.where(better, e2, err)
    return ScaledPlain(codes.reshape(o, i), "e2m1", s, "e4m3", (1, NV_GROUP), "float32", out_dtype,
                       global_scale=g, global_op="div", meta={"method": method, "format": "nvfp4"})


def quantize_mx(weight: torch.Tensor, element: str = "e2m1", method: str = "rtn", out_dtype: str = "bfloat16",
                name: str | None = None) -> ScaledPlain:
    """weight [O, I] (I % 32 == 0) -> MX ScaledPlain: `element` codes, E8M0 scale per 32 (module docstring)."""
    if element not in _MAX:
        raise UsageError(f"MX codes are e2m1 (mxfp4) or e4m3 (mxfp8), not '{element}'")
    w = _check(weight, MX_GROUP, method, name)
    o, i = w.shape
    blocks = w.view(o, i // MX_GROUP, MX_GROUP)
    amax_b = blocks.abs().amax(-1)
    top = _MAX[element]
    pos = amax_b > 0
    k = floor_log2(torch.where(pos, amax_b, torch.ones_like(amax_b))) - _EMAX[element]
    # the least k with amax <= top * 2^k: one more where the OCP exponent would clip
    k = k + (amax_b > top * torch.ldexp(torch.ones_like(amax_b), k)).to(torch.int32)
    k = torch.where(pos, k, torch.zeros_like(k)).clamp(-127, 127)

    def codes_for(kk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = e8m0_decode(e8m0_from_exponent(kk)).unsqueeze(-1)
        c = _encode(blocks / s, element)
        err = (_decode(c, element) * s - blocks).square().sum(-1)
        return c, err

    codes, err = codes_for(k)
    if method == "mse":
        k2 = (k - 1).clamp(-127, 127)
        c2, e2 = codes_for(k2)
        better = e2 < err
        k = torch.where(better, k2, k)
        codes = torch.where(better.unsqueeze(-1), c2, codes)
    # Rounding up to the top code can pass the model dtype's largest value (60000 in fp16: 4 * 2^14); such a
    # block takes the OCP exponent one lower, whose top code clips below amax, so every value stays finite
    fmax = torch.finfo(getattr(torch, out_dtype)).max
    over = _decode(codes, element).abs().amax(-1).double() * torch.pow(2.0, k.double()) > fmax
    if bool(over.any()):
        k2 = (k - 1).clamp(-127, 127)
        c2, _ = codes_for(k2)
        k = torch.where(over, k2, k)
        codes = torch.where(over.unsqueeze(-1), c2, codes)
    fid = "mxfp4" if element == "e2m1" else "mxfp8"
    return ScaledPlain(codes.reshape(o, i), element, e8m0_from_exponent(k), "e8m0", (1, MX_GROUP), "float32",
                       out_dtype, meta={"method": method, "format": fid})


def quantize_for(fid: str, weight: torch.Tensor, method: str = "rtn", out_dtype: str = "bfloat16",
                 name: str | None = None) -> ScaledPlain:
    """The quantizer of a micro-float format id (nvfp4, modelopt_nvfp4, mxfp4, gptoss_mxfp4, mxfp8)."""
    if fid in ("nvfp4", "modelopt_nvfp4"):
        return quantize_nvfp4(weight, method, out_dtype, name)
    if fid in ("mxfp4", "gptoss_mxfp4"):
        return quantize_mx(weight, "e2m1", method, out_dtype, name)
    if fid == "mxfp8":
        return quantize_mx(weight, "e4m3", method, out_dtype, name)
    raise UsageError(f"no micro-float quantizer for '{fid}'")


__all__ = ["METHODS", "quantize_for", "quantize_mx", "quantize_nvfp4"]
