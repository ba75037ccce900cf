"""Element codecs for the micro-float formats: E2M1 (FP4) codes, their two-per-byte packing, E8M0 and E4M3
scales. Pure tensor functions; they know bits and rounding, not formats.

Facts (OCP Microscaling Formats (MX) v1.0, section 5.3 "Element data types" and 5.4 "Scale data type";
NVFP4 as compressed-tensors 0.20 and ModelOpt write it):

- E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0. Magnitudes by code 0..7:
  0, 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0. No Inf, no NaN. Conversion to E2M1 rounds to nearest, ties to
  even (the even code), and saturates at +-6 (the spec's saturating conversion, the one every MX/NVFP4
  producer uses). The sign of a value that rounds to zero is kept (-0.1 -> -0, code 8), as IEEE rounding
  does and compressed-tensors' packer does (it takes the sign from `signbit`).
- Two codes per byte: element 2i in the low nibble, element 2i+1 in the high nibble. compressed-tensors'
  `pack_fp4_to_uint8` (`low | high << 4`), ModelOpt's `weight` (compressed-tensors converts it by renaming
  the tensor) and gpt-oss's `_blocks` (transformers' `_convert_moe_packed_tensors` reads `blk & 0x0F` into
  even columns) agree.
- E8M0: an unsigned biased exponent, value 2^(e - 127) for e in 0..254; 0xFF is NaN. No zero, no sign.
- E4M3 (the `fn` variant): bias 7, max 448, no Inf, S.1111.111 is NaN. NVFP4's block scales.
"""

from __future__ import annotations

from qtool.lazy import lazy_module

torch = lazy_module("torch")

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Values by code (OCP MX v1.0 table 5); code 8 is -0.0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Magnitude thresholds for round-to-nearest-even onto codes 0..7: a magnitude `a` gets code
# sum(a > t for strict t) + sum(a >= t for non-strict t). A tie goes to the even code: 0.25 -> 0 (code 0),
# 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4), 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4
# (code 6). Above 6 every threshold is passed: saturation to code 7.
_E2M1_TIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
              (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Float tensor (any shape, fp16/bf16/fp32/fp64) -> uint8 E2M1 codes 0..15, one per byte.

    Round to nearest even, saturating at +-6, sign kept for values that round to zero. NaN has no E2M1
    encoding: ValueError (the caller names the tensor)."""
    if x.is_floating_point() and bool(torch.isnan(x).any()):
        raise ValueError("NaN has no E2M1 encoding")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, inclusive in _E2M1_TIES:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 E2M1 codes 0..15 -> their values in `dtype` (default fp32; every E2M1 value is exact in
    fp16/bf16/fp32)."""
    dtype = dtype or torch.float32
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return lut[(codes & 0x0F).to(torch.int64)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even, each < 16) -> uint8 bytes [..., n/2]: element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"two E2M1 codes per byte need an even last dimension, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., m] -> uint8 codes [..., 2m] (low nibble first)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def e8m0_decode(e: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 biased exponents -> 2^(e - 127) in `dtype` (fp32/fp64: every value exact; 2^-127 is an fp32
    subnormal); 0xFF -> NaN. Built from the exponent bits, so it does not depend on the torch version's
    float8_e8m0fnu support."""
    dtype = dtype or torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"E8M0 decodes exactly to float32/float64, not {dtype}")
    e32 = e.to(torch.int32)
    # 1..254: the fp32 exponent field itself; 0: 2^-127, the fp32 subnormal with only bit 22 set
    bits = torch.where(e32 == 0, torch.full_like(e32, 1 << 22), e32 << 23)
    v = bits.view(torch.float32)
    v = torch.where(e32 == E8M0_NAN, torch.full_like(v, float("nan")), v)
    return v.to(dtype)


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents k -> uint8 E8M0 bytes k + 127. ValueError when some k is outside [-127, 127]
    (255 would be the NaN byte)."""
    k = exp.to(torch.int32)
    if k.numel() and (int(k.min()) < -E8M0_BIAS or int(k.max()) > E8M0_BIAS):
        raise ValueError(f"E8M0 holds 2^-127..2^127; exponents span [{int(k.min())}, {int(k.max())}]")
    return (k + E8M0_BIAS).to(torch.uint8)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """int32 floor(log2(x)) of positive finite values, exact: read from the fp32 exponent bits (a float
    log2 can round up just below a power of two); fp32 subnormals included. The caller excludes x <= 0."""
    x32 = x.to(torch.float32)
    bits = x32.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    # subnormal: value = man * 2^-149, floor(log2) = floor(log2(man)) - 149
    sub = torch.floor(torch.log2(man.clamp(min=1).to(torch.float64))).to(torch.int32) - 149
    return torch.where(exp == 0, sub, exp - 127)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> torch.float8_e4m3fn, round to nearest even, saturating at +-448 (clamped first, so
    the result does not depend on how the installed torch casts out-of-range values). NaN: ValueError."""
    x32 = x.to(torch.float32)
    if bool(torch.isnan(x32).any()):
        raise ValueError("NaN scale has no E4M3 encoding here")
    return x32.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_nan_mask(x: torch.Tensor) -> torch.Tensor:
    """bool mask of the E4M3 NaN bytes (0x7F, 0xFF) of a float8_e4m3fn or uint8 tensor."""
    b = x.view(torch.uint8) if x.dtype != torch.uint8 else x
    return (b & 0x7F) == 0x7F
