"""The canonical form for codes that are numbers in their own element type: FP8, INT8, FP4, MX.

`Plain` (plain.py) holds unsigned integer codes with a zero point per group, because every integer layout
qtool reads is a bit-packing of such codes. The float and W8A8 layouts are not: their codes are values of a
small number format (E4M3, E5M2, E2M1, int8) that is multiplied by a scale, the scale itself may be a small
float (E4M3 for NVFP4, a power of two E8M0 for MX), it may cover a 2-D block instead of a run of inputs, and a
second, global scale may sit on top. Forcing those into `Plain` would turn a code into an index whose meaning
depends on the format, and lose the fact that the bytes on disk *are* the canonical codes. So they get a
sibling, `ScaledPlain`, with the same role: every float/int8 layout is a view of it, `repack A B` is
`B.pack(A.unpack(x))`, and `dequantize` here is the one oracle for those formats' kernels.

One record expresses every scheme of issue #25:

    scheme              element  scale_type  block          global
    FP8 per-tensor      e4m3     fp32        (-1, -1)       -
    FP8 per-channel     e4m3     fp32/bf16   (1, -1)        -
    FP8 128x128 blocks  e4m3     fp32        (128, 128)     -
    INT8 W8A8 channel   int8     fp32/bf16   (1, -1)        -
    NVFP4               e2m1     e4m3        (1, 16)        fp32 (CT divides, ModelOpt multiplies)
    MXFP4 / MXFP8       e2m1/e4m3 e8m0       (1, 32)        -

`block` is (rows, inputs) covered by one scale, -1 meaning the whole dimension: per-tensor, per-channel, 1-D
groups along the input and 2-D blocks are one rule, scale[r // bo, c // bi], with ragged edge blocks allowed
(the last block row/column is partial, as in DeepSeek's and compressed-tensors' ceil-division grids).

Arithmetic (bit-exactness depends on the dtype of each step, so the record names them):
    s   = decode(scales).to(compute)                  E4M3 scales exactly, E8M0 as 2^(byte-127)
    s   = s / global  or  s * global   (in compute)   only when a global scale is present
    w   = (decode(codes).to(compute) - zeros) * s     codes and zeros convert exactly into every compute dtype
    out = w.to(out_dtype)                             a single final rounding
compressed-tensors (`forward._dequantize`) forms the product in the scale's dtype, so its `compute` is the
weight_scale dtype (bf16 scales: a bf16 product); transformers' FP8 dequantize and DeepSeek's
`weight_dequant` form it in fp32 and round once to the model dtype. With `dtype=torch.float64` dequantize
returns the exact product of the code and the effective scale instead (the oracle kernels are judged by).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from qtool.errors import FormatError

if TYPE_CHECKING:  # torch is imported where it is used: qtool.formats loads without it
    import torch


@dataclass(frozen=True)
class Element:
    """A code (or scale) element type: its id, the torch dtype that stores it, and its largest finite value.

    E2M1 has no unpacked torch dtype; one code per uint8 byte (bits 0..3: sign bit 3, exponent 2..1,
    mantissa 0) is its canonical storage. E8M0 is stored as its raw biased-exponent byte (uint8), the way
    compressed-tensors' MX compressors and gpt-oss write it.
    """

    id: str
    storage: str  # torch dtype name
    max: float
    is_float: bool


ELEMENTS: dict[str, Element] = {e.id: e for e in (
    Element("e4m3", "float8_e4m3fn", 448.0, True),
    Element("e5m2", "float8_e5m2", 57344.0, True),
    Element("e2m1", "uint8", 6.0, True),
    Element("int8", "int8", 127.0, False),
)}
SCALE_TYPES: dict[str, Element] = {e.id: e for e in (
    Element("fp32", "float32", 3.4028234663852886e38, True),
    Element("bf16", "bfloat16", 3.3895313892515355e38, True),
    Element("fp16", "float16", 65504.0, True),
    Element("e4m3", "float8_e4m3fn", 448.0, True),
    Element("e8m0", "uint8", 2.0 ** 127, True),
)}
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# E2M1 values by code (OCP MX spec v1.0, table 5): sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 0xFF


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def strategy_of(block: tuple[int, int]) -> str:
    """'tensor' (-1, -1), 'channel' (1, -1), 'group' (1, g) or 'block' (bo, bi): the compressed-tensors names."""
    bo, bi = block
    if (bo, bi) == (-1, -1):
        return "tensor"
    if bo == 1:
        return "channel" if bi == -1 else "group"
    return "block"


@dataclass(frozen=True, eq=False)
class ScaledPlain:
    """One quantized linear weight W[O, I] = codes * scale, in canonical form (module docstring).

    codes:        [O, I] in the element's storage dtype (float8_e4m3fn, float8_e5m2, int8; uint8 for E2M1)
    element:      "e4m3" | "e5m2" | "e2m1" | "int8"
    scales:       [ceil(O / bo), ceil(I / bi)] in the scale type's storage dtype (-1 in `block` = 1 there)
    scale_type:   "fp32" | "bf16" | "fp16" | "e4m3" | "e8m0"
    block:        (bo, bi) rows x inputs per scale, -1 = the whole dimension
    global_scale: fp32 tensor of one element, or None; `global_op` "div" (compressed-tensors) or "mul"
    zeros:        int8 [same shape as scales] for asymmetric int8, or None (symmetric: zero is 0)
    compute:      torch dtype name the scale and the product are formed in ("float32", "bfloat16", "float16")
    out_dtype:    torch dtype name dequantize returns by default (the model dtype)
    meta:         facts a format carries through a round trip (activation scheme, names read); never needed
                  to dequantize
    """

    codes: torch.Tensor
    element: str
    scales: torch.Tensor
    scale_type: str
    block: tuple[int, int]
    compute: str = "float32"
    out_dtype: str = "bfloat16"
    global_scale: torch.Tensor | None = None
    global_op: str = "div"
    zeros: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # --- derived facts -------------------------------------------------------------------------
    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])

    @property
    def strategy(self) -> str:
        return strategy_of(self.block)

    @property
    def block_shape(self) -> tuple[int, int]:
        """(bo, bi) with -1 resolved to the dimension."""
        bo, bi = self.block
        return (self.out_features if bo == -1 else bo, self.in_features if bi == -1 else bi)

    def grid(self) -> tuple[int, int]:
        """The scale grid's shape for these codes and this block."""
        return scale_grid(self.out_features, self.in_features, self.block)

    def with_(self, **changes) -> ScaledPlain:
        return replace(self, **changes)

    # --- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise FormatError when the fields contradict each other; cheap (shapes and dtypes only)."""
        if self.element not in ELEMENTS:
            raise FormatError(f"unknown code element '{self.element}'", fix=f"use one of {sorted(ELEMENTS)}")
        if self.scale_type not in SCALE_TYPES:
            raise FormatError(f"unknown scale type '{self.scale_type}'", fix=f"use one of {sorted(SCALE_TYPES)}")
        for what, name in (("compute", self.compute), ("out_dtype", self.out_dtype)):
            if name not in COMPUTE_DTYPES:
                raise FormatError(f"{what} dtype '{name}' is not one of {COMPUTE_DTYPES}")
        if self.global_op not in ("div", "mul"):
            raise FormatError(f"global_op '{self.global_op}' must be 'div' or 'mul'")
        el, st = ELEMENTS[self.element], SCALE_TYPES[self.scale_type]
        if self.codes.dim() != 2:
            raise FormatError(f"codes must be 2-D [out, in], got shape {tuple(self.codes.shape)}")
        if self.codes.dtype != _dtype(el.storage):
            raise FormatError(f"{self.element} codes must be stored as {el.storage}, got {self.codes.dtype}")
        bo, bi = self.block
        if any(b == 0 or b < -1 for b in (bo, bi)):
            raise FormatError(f"block {self.block} must hold positive sizes or -1")
        if self.scales.dtype != _dtype(st.storage):
            raise FormatError(f"{self.scale_type} scales must be stored as {st.storage}, got {self.scales.dtype}")
        if tuple(self.scales.shape) != self.grid():
            raise FormatError(f"scales shape {tuple(self.scales.shape)} does not match the {self.grid()} grid of "
                              f"{self.block} blocks over [{self.out_features}, {self.in_features}]")
        if self.zeros is not None:
            import torch

            if self.zeros.dtype != torch.int8 or self.zeros.shape != self.scales.shape:
                raise FormatError(f"zeros must be int8 {tuple(self.scales.shape)}, got {self.zeros.dtype} "
                                  f"{tuple(self.zeros.shape)}")
        if self.global_scale is not None:
            import torch

            if self.global_scale.dtype != torch.float32 or self.global_scale.numel() != 1:
                raise FormatError(f"global scale must be one fp32 value, got {self.global_scale.dtype} "
                                  f"{tuple(self.global_scale.shape)}")

    def anomalies(self) -> list[tuple[str, str]]:
        """Data checks (reads every value): (severity, message) for what makes the weight wrong ("error") or
        suspicious ("warning"); [] when fine."""
        import torch

        out = []
        if self.element in ("e4m3", "e5m2"):
            v = self.codes.to(torch.float32)
            nan = int(torch.isnan(v).sum())
            if nan:
                bits = "0x7F/0xFF" if self.element == "e4m3" else "exponent 11111 with a mantissa"
                out.append(("error", f"{nan} {self.element} weight code(s) hold NaN bit patterns ({bits})"))
            inf = int(torch.isinf(v).sum())
            if inf:
                out.append(("error", f"{inf} {self.element} weight code(s) are infinite"))
        elif self.element == "e2m1" and self.codes.numel() and int(self.codes.max()) > 0x0F:
            out.append(("error", "an e2m1 code uses more than 4 bits"))
        s = decode_scales(self.scales, self.scale_type).to(torch.float64)
        n_nan = int(torch.isnan(s).sum())
        if self.scale_type == "e8m0" and n_nan:
            out.append(("error", f"{n_nan} e8m0 scale(s) are 0xFF (NaN, the one reserved E8M0 value)"))
        elif n_nan:
            out.append(("error", f"{n_nan} scale(s) are NaN"))
        n_inf = int(torch.isinf(s).sum())
        if n_inf:
            out.append(("error", f"{n_inf} scale(s) are infinite"))
        n_zero = int((s == 0).sum())
        if n_zero:
            out.append(("warning", f"{n_zero} scale(s) are zero (their blocks dequantize to 0)"))
        n_neg = int((s < 0).sum())
        if n_neg:
            out.append(("warning", f"{n_neg} scale(s) are negative (quantizers write positive ones)"))
        if self.global_scale is not None:
            g = float(self.global_scale.reshape(()))
            if g == 0 or g != g or abs(g) == float("inf"):
                out.append(("error", f"the global scale is {g}"))
        finite = s[torch.isfinite(s)]
        if finite.numel():
            top = float(finite.abs().max()) * ELEMENTS[self.element].max
            if self.global_scale is not None:
                g = abs(float(self.global_scale.reshape(())))
                top = top / g if self.global_op == "div" and g else top * g
            limit = float(torch.finfo(_dtype(self.out_dtype)).max)
            if top > limit:
                out.append(("error", f"scale overflow: the largest code times the largest scale is {top:.4g}, "
                                     f"beyond {self.out_dtype}'s {limit:.4g}"))
        return out

    def equal(self, other: ScaledPlain) -> bool:
        """Exact equality of the stored bytes and the arithmetic they are read with."""
        import torch

        def same(a, b) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))

        return (self.element == other.element and self.scale_type == other.scale_type
                and self.block_shape == other.block_shape and self.compute == other.compute
                and self.global_op == other.global_op and same(self.codes, other.codes)
                and same(self.scales, other.scales) and same(self.zeros, other.zeros)
                and same(self.global_scale, other.global_scale))


def scale_grid(o: int, i: int, block: tuple[int, int]) -> tuple[int, int]:
    """Scale rows and columns for [o, i] codes in `block` blocks (ragged edges count as blocks)."""
    bo, bi = block
    bo = o if bo == -1 else bo
    bi = i if bi == -1 else bi
    return (-(-o // bo) if o else (1 if block[0] == -1 else 0), -(-i // bi) if i else (1 if block[1] == -1 else 0))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The storage bytes of a tensor, so that NaN codes compare equal to themselves."""
    import torch

    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def decode_codes(codes: torch.Tensor, element: str, dtype: torch.dtype) -> torch.Tensor:
    """Codes -> their values in `dtype` (exact for every element type and float dtype qtool computes in)."""
    import torch

    if element == "e2m1":
        lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
        return lut[codes.to(torch.int64) & 0x0F]
    return codes.to(dtype)


def decode_scales(scales: torch.Tensor, scale_type: str) -> torch.Tensor:
    """Stored scales -> their float values: float32 for E8M0 (2^(byte-127), 0xFF NaN) and E4M3 (exact), the
    stored dtype otherwise."""
    import torch

    if scale_type == "e8m0":
        v = torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - 127)
        return torch.where(scales == E8M0_NAN, torch.full_like(v, float("nan")), v)
    if scale_type == "e4m3":
        return scales.to(torch.float32)
    return scales


def effective_scales(p: ScaledPlain, rows: slice | None = None) -> torch.Tensor:
    """The scale grid the product uses, in p.compute, global scale applied (rows: the grid rows they need)."""
    compute = _dtype(p.compute)
    s = decode_scales(p.scales, p.scale_type)
    if rows is not None:
        s = s[_grid_rows(p, rows)]
    s = s.to(compute)
    if p.global_scale is not None:
        g = p.global_scale.reshape(1).to(compute)
        s = s / g if p.global_op == "div" else s * g
    return s


def _grid_rows(p: ScaledPlain, rows: slice) -> slice:
    bo = p.block_shape[0]
    start, stop, _ = rows.indices(p.out_features)
    return slice(start // bo, -(-stop // bo) if stop > start else start // bo)


def dequantize(p: ScaledPlain, dtype: torch.dtype | None = None, rows: slice | None = None) -> torch.Tensor:
    """W[O, I] by the arithmetic in the module docstring, rounded once to `dtype` (default p.out_dtype).

    dtype=torch.float64 returns the exact value code * effective scale (the effective scale is formed in
    p.compute, as the format does). `rows` restricts the work to a slice of output rows (bounded memory).
    """
    import torch

    out = dtype or _dtype(p.out_dtype)
    work = torch.float64 if out == torch.float64 else _dtype(p.compute)
    sl = rows if rows is not None else slice(None)
    start, stop, step = sl.indices(p.out_features)
    if step != 1:
        raise FormatError("dequantize rows must be a contiguous slice")
    if (p.element == "e4m3" and p.zeros is None and work == torch.float32 and stop > start
            and p.codes.device.type == "cpu"):
        # the same IEEE steps in one pass over the bytes (qtool.packing.e4m3), where its C++ library loads
        from qtool.packing.e4m3 import dequant as e4m3_dequant

        bo = p.block_shape[0]
        w = e4m3_dequant(p.codes[start:stop], effective_scales(p, slice(start, stop)), p.block_shape[1], out,
                         bo=bo, first=start % bo)
        if w is not None:
            return w
    q = decode_codes(p.codes[start:stop], p.element, work)
    s = effective_scales(p, slice(start, stop)).to(work)
    z = None
    if p.zeros is not None:
        z = p.zeros[_grid_rows(p, slice(start, stop))].to(work)
    bo, bi = p.block_shape
    n = stop - start
    # one scale row per code row (blocks of bo rows repeat theirs), then broadcast along the inputs
    first = start % bo
    ri = (torch.arange(n, device=q.device) + first) // bo
    if bo != 1:
        s = s.index_select(0, ri)
        z = z.index_select(0, ri) if z is not None else None
    i = p.in_features
    if i % bi == 0 and n:
        qv = q.view(n, i // bi, bi)
        if z is not None:
            qv = qv - z.unsqueeze(-1)
        w = (qv * s.unsqueeze(-1)).view(n, i)
    else:
        ci = torch.arange(i, device=q.device) // bi
        if z is not None:
            q = q - z.index_select(1, ci)
        w = q * s.index_select(1, ci)
    return w.to(out)


def relative_error(weight: torch.Tensor, p: ScaledPlain, block_rows: int = 512) -> float:
    """‖W − dequantize(p)‖ / ‖W‖ in float64, a block of rows at a time (bounded memory)."""
    import torch

    num = den = 0.0
    step = block_rows
    bo = p.block_shape[0]
    if bo > 1 and bo != p.out_features:
        step = max(bo, block_rows // bo * bo)  # whole block rows per slice
    for r in range(0, weight.shape[0], step):
        sl = slice(r, r + step)
        w = weight[sl].to(torch.float64)
        num += float(torch.sum((w - dequantize(p, torch.float64, sl)) ** 2))
        den += float(torch.sum(w * w))
    return (num ** 0.5) / max(den ** 0.5, 1e-300)
