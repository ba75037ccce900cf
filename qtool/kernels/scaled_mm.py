"""FP8 W8A8 kernels through torch's scaled matmul: E4M3 weights as stored, E4M3 activations quantized per call.

    y[M, N] = (s_x * q_x[M, K]) @ (s_w * q_w[N, K])^T     fp32 accumulation, one rounding to x's dtype

Three kernels, one per scaling recipe the installed torch runs (each a row of configs/kernels/qtool.yaml):

    kernel                weight scales         activation scales (dynamic)   torch path
    scaled-mm-fp8         tensor or channel     per token  [M, 1]             _scaled_mm row-wise (CUTLASS/cuBLAS)
    scaled-mm-fp8-tensor  tensor                per tensor []                 _scaled_mm tensor-wise (cuBLASLt)
    scaled-mm-fp8-block   128 x 128 blocks      per 1 x 128 group [M, K/128]  F.scaled_mm BlockWise1x128 x
                                                                              BlockWise128x128 (cuBLAS >= 12.9)

The weight operand is the checkpoint's codes, [N, K] row-major, passed transposed: a column-major [K, N] view,
the layout the FP8 tensor-core GEMMs require for their second operand. Nothing is copied or repacked at
load except the weight scales (a per-tensor scale broadcast to [1, N] for the row-wise GEMM; the 128x128
grid transposed and padded to a multiple of 4 along K, the layout cuBLAS reads). The activations are
quantized inside `forward` by one Triton launch (triton/fp8_act.py), or by the same arithmetic in torch
ops (`act_quant_torch`) where Triton is absent.

Activations are always scaled dynamically: a checkpoint's static input scale (compressed-tensors / HF
`activation_scheme: static`) is not read. Dynamic scales are at least as accurate (an engine using the static
scale clips every x beyond it); the kernels are judged against the weight's oracle either way.

Facts these rules come from (torch's test/test_scaled_matmul_cuda.py and ScaledBlas.cpp, torch 2.9-2.13):
- FP8 GEMMs need SM 8.9+; every dimension of the weight operand a multiple of 16 (K and N; M is free).
- Row-wise scaling writes fp16 output only on SM 9.0+ (bf16 on 8.9).
- Block-wise 1x128 x 128x128 runs on SM 9.0 only (cuBLAS's Hopper path; B200 is refused), from CUDA 12.9,
  with bf16 or fp32 output; 1x128 activation scales are outer-dim-major (stride (1, M)) and M a multiple
  of 4, the 128x128 weight scales [ceil(K/128) rounded up to 4, N/128] with stride (1, that).

Error bound (the accuracy contract, base.Kernel.err_factor): the kernel's error against the float64 oracle
is dominated by rounding x to E4M3, a relative error of up to u8 = 2^-4 per element (3 mantissa bits); the
weight codes enter exactly and the fp32 accumulation is ~2^-24. The same-precision torch baseline rounds
the weight and the output to the activation dtype, two roundings of up to u16 each (2^-8 bf16, 2^-11 fp16)
with the same distribution of mantissas, so the expected ratio of the two errors is about u8 / (sqrt(2) u16).
k = 2 u8 / u16 (32 for bf16, 256 for fp16) allows 2 sqrt(2) ~ 2.8 times that; the GPU tests record the
ratio measured, so the bound is also shown to be not loose by more than that margin.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from qtool.kernels.base import Kernel, Layer, ScaledLayer, register

E4M3_MAX = 448.0
# absmax floor: a row of zeros still gets a finite, positive scale (its codes are 0)
MIN_AMAX = 1e-12
U_E4M3 = 2.0 ** -4
BLOCK = 128
# activation dtype -> its unit roundoff
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
# linear weight-scale types (converted exactly to the fp32 scales the GEMMs read)
LINEAR_SCALES = ("fp32", "bf16", "fp16")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------------------------------
# Activation quantization
# ------------------------------------------------------------------------------------------------------

def _ieee_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b rounded once, as the Triton kernel's div_rn: torch on CUDA divides a tensor by a Python number as
    a multiplication by its reciprocal, which is an ulp off for about one value in three (2912 / 448 gives
    6.5000005), and one ulp of a scale moves codes that sit on a rounding tie."""
    return a / torch.full_like(a, b)


def act_quant_torch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                    amax: torch.Tensor | None = None) -> None:
    """The arithmetic of triton/fp8_act.py in torch ops (same arguments, same bytes): fills q [Mp, K] and
    scales [Mp, K / group] (or a 0-dim scale when amax, the per-tensor max |x|, is given)."""
    m, k = x.shape
    mp = q.shape[0]
    xf = x.float().reshape(m, k // group, group)
    if amax is not None:
        a = amax.float().reshape(1, 1).expand(m, k // group)
    else:
        a = xf.abs().amax(dim=-1)
    scale = _ieee_div(a.clamp_min(MIN_AMAX), E4M3_MAX)
    floor = _ieee_div(torch.full((1,), MIN_AMAX, dtype=torch.float32, device=x.device), E4M3_MAX)
    codes = (xf / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q[:m] = codes.reshape(m, k)
    if mp > m:
        q[m:] = torch.zeros((), dtype=torch.float8_e4m3fn, device=q.device)
    if amax is not None:
        scales.copy_(scale[0, 0] if m else floor[0])
        return
    scales[:m] = scale
    if mp > m:
        scales[m:] = floor


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and importlib.util.find_spec("triton") is not None


def quantize_activations(x: torch.Tensor, act: str, *, pad_rows: int = 1,
                         use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (q [Mp, K] float8_e4m3fn, float32 scales), Mp = M rounded up to pad_rows.

    act: "token" -> scales [Mp, 1]; "tensor" -> scales [] (max |x| over all of x); "group" -> scales
    [Mp, K / 128], outer-dim-major (stride (1, Mp)). Rows past M are zeros with the floor scale.
    """
    m, k = x.shape
    mp = _round_up(max(m, 1), pad_rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    amax = None
    if act == "token":
        group, scales = k, torch.empty((mp, 1), dtype=torch.float32, device=x.device)
    elif act == "tensor":
        group, scales = k, torch.empty((), dtype=torch.float32, device=x.device)
        amax = (torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32) if x.numel()
                else torch.zeros((), dtype=torch.float32, device=x.device))  # no rows: the floor scale
    elif act == "group":
        group = BLOCK
        scales = torch.empty((k // BLOCK, mp), dtype=torch.float32, device=x.device).t()
    else:
        raise ValueError(f"unknown activation scaling {act!r}")
    if use_triton if use_triton is not None else _use_triton(x):
        from qtool.kernels.triton.fp8_act import act_quant_triton

        act_quant_triton(x, q, scales, group, amax, E4M3_MAX, MIN_AMAX)
    else:
        act_quant_torch(x, q, scales, group, amax)
    return q, scales


# ------------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ScaledMMState:
    """What `prepare` keeps: the layer as stored, the codes' transposed view and the weight scales in the
    layout the GEMM reads.

    w_t:     float8_e4m3fn [K, N], column-major (a view of layer.plain.codes [N, K], no copy)
    scale_b: float32: [] (tensor-wise), [1, N] (row-wise), or [ceil4(K/128), N/128] stride (1, ceil4(K/128))
             (block-wise)
    scale_tensor: the per-tensor weight scale as a float32 [] (None for channel and block scales)
    """

    layer: ScaledLayer
    w_t: torch.Tensor
    scale_b: torch.Tensor
    scale_tensor: torch.Tensor | None = None  # float32 [] when the weight has one scale (tensor-wise GEMM)


class _ScaledMM(Kernel):
    devices = ("cuda",)
    bits = ()
    elements = ("e4m3",)
    dtypes = (torch.float16, torch.bfloat16)
    min_capability = (8, 9)
    strategies: ClassVar[tuple[str, ...]]
    act: ClassVar[str]
    multiple: ClassVar[int] = 16
    exact_capability: ClassVar[tuple[int, int] | None] = None
    dtype_capability: ClassVar[dict] = {}

    def error_factor(self, dtype: torch.dtype) -> float:
        return 2.0 * U_E4M3 / UNIT_ROUNDOFF[dtype]

    def available(self, device: torch.device) -> str | None:
        why = super().available(device)
        if why:
            return why
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no _scaled_mm"
        if self.exact_capability is not None:
            cc = torch.cuda.get_device_capability(device)
            if cc != self.exact_capability:
                return (f"{self.id} runs on compute capability {self.exact_capability[0]}.{self.exact_capability[1]} "
                        f"only (cuBLAS's block-scaled FP8 path), device has {cc[0]}.{cc[1]}")
        return None

    def check(self, layer: Layer, dtype: torch.dtype, device: torch.device) -> list[str]:
        why = super().check(layer, dtype, device)
        if not isinstance(layer, ScaledLayer):
            return why
        p = layer.plain
        if p.strategy not in self.strategies or (p.strategy == "block" and p.block_shape != (BLOCK, BLOCK)):
            got = p.strategy if p.strategy != "block" else f"{p.block_shape[0]}x{p.block_shape[1]} block"
            why.append(f"{self.id} reads {' or '.join(self.strategies)} weight scales, not {got} scales")
        if p.scale_type not in LINEAR_SCALES:
            why.append(f"{self.id} reads fp32/bf16/fp16 weight scales, not {p.scale_type}")
        if p.global_scale is not None:
            why.append(f"{self.id} has no second (global) weight scale")
        if p.zeros is not None:
            why.append(f"{self.id} reads symmetric codes, not zero points")
        for name, dim in (("K", layer.K), ("N", layer.N)):
            if dim % self.multiple:
                why.append(f"{self.id}: {name}={dim} is not a multiple of {self.multiple} ({self.multiple_why})")
        need = self.dtype_capability.get(dtype)
        if need is not None and device.type == "cuda" and torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(device)
            if cc < need:
                why.append(f"{self.id} writes {dtype} output only on compute capability >= {need[0]}.{need[1]}, "
                           f"device has {cc[0]}.{cc[1]}: run bf16 activations")
        return why

    multiple_why: ClassVar[str] = "the FP8 GEMM's operand alignment"

    def describe(self, state: ScaledMMState, m: int) -> str:
        return self.path

    path: ClassVar[str] = ""


@register
class ScaledMMRowwise(_ScaledMM):
    id = "scaled-mm-fp8"
    summary = ("FP8 E4M3 weights (per-tensor or per-channel scales) x E4M3 activations quantized per token; "
               "torch._scaled_mm row-wise; CUDA CC >= 8.9")
    strategies = ("tensor", "channel")
    act = "token"
    dtype_capability = {torch.float16: (9, 0)}
    path = "act quant per token + _scaled_mm row-wise"

    def prepare(self, layer: ScaledLayer) -> ScaledMMState:
        p = layer.plain
        s = p.scales.to(torch.float32)
        per_tensor = p.strategy == "tensor"
        scale_b = (s.reshape(1, 1).expand(1, layer.N) if per_tensor else s.reshape(1, layer.N))
        return ScaledMMState(layer, p.codes.t(), scale_b.contiguous(),
                             s.reshape(()).contiguous() if per_tensor else None)

    def forward(self, x: torch.Tensor, state: ScaledMMState, out: torch.Tensor | None = None) -> torch.Tensor:
        q, sa = quantize_activations(x, "token")
        extra = {} if out is None else {"out": out}
        if x.shape[0] == 1 and state.scale_tensor is not None:
            # one token's scale is a tensor's scale: the same product through the tensor-wise GEMM, which
            # streams the weight at M = 1 far faster than the row-wise one (H200: 71 vs 99 us on 8192x28672)
            return torch._scaled_mm(q, state.w_t, scale_a=sa, scale_b=state.scale_tensor, out_dtype=x.dtype,
                                    **extra)
        return torch._scaled_mm(q, state.w_t, scale_a=sa, scale_b=state.scale_b, out_dtype=x.dtype, **extra)

    def describe(self, state: ScaledMMState, m: int) -> str:
        if m == 1 and state.scale_tensor is not None:
            return "act quant per token + _scaled_mm tensor-wise (one row: its scale is the tensor's)"
        return self.path


@register
class ScaledMMTensorwise(_ScaledMM):
    id = "scaled-mm-fp8-tensor"
    summary = ("FP8 E4M3 weights (per-tensor scale) x E4M3 activations with one dynamic per-tensor scale; "
               "torch._scaled_mm tensor-wise (cuBLASLt); CUDA CC >= 8.9")
    strategies = ("tensor",)
    act = "tensor"
    path = "act quant per tensor + _scaled_mm tensor-wise"

    def prepare(self, layer: ScaledLayer) -> ScaledMMState:
        p = layer.plain
        s = p.scales.to(torch.float32).reshape(()).contiguous()
        return ScaledMMState(layer, p.codes.t(), s, s)

    def forward(self, x: torch.Tensor, state: ScaledMMState, out: torch.Tensor | None = None) -> torch.Tensor:
        # one row's max is the tensor's: the per-token quantizer gives the same bytes in one launch
        q, sa = quantize_activations(x, "tensor" if x.shape[0] > 1 else "token")
        extra = {} if out is None else {"out": out}
        return torch._scaled_mm(q, state.w_t, scale_a=sa, scale_b=state.scale_b, out_dtype=x.dtype, **extra)


# The block-scaled GEMM writes bf16 or fp32; fp16 activations get an fp32 product rounded once to fp16.
BLOCK_OUT = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
MIN_CUDA_BLOCKWISE = (12, 9)


def block_weight_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] weight scales -> float32 [ceil4(K/128), N/128] with stride (1, ceil4(K/128)): the
    128x128 scale layout cuBLAS reads, K's blocks padded to a multiple of 4 (the padding is never read)."""
    nb, kb = scales.shape
    padded = torch.zeros((nb, _round_up(kb, 4)), dtype=torch.float32, device=scales.device)
    padded[:, :kb] = scales.to(torch.float32)
    return padded.t()


@register
class ScaledMMBlockwise(_ScaledMM):
    id = "scaled-mm-fp8-block"
    summary = ("FP8 E4M3 weights with 128x128 block scales (DeepSeek-V3) x E4M3 activations per 1x128 group; "
               "F.scaled_mm block-wise; CUDA CC 9.0, CUDA >= 12.9")
    strategies = ("block",)
    act = "group"
    multiple = BLOCK
    multiple_why = "whole 128x128 scale blocks; ragged edge blocks run on torch-ref"
    exact_capability = (9, 0)
    path = "act quant per 1x128 group + F.scaled_mm block-wise"

    def available(self, device: torch.device) -> str | None:
        why = super().available(device)
        if why:
            return why
        import torch.nn.functional as F

        if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (block-wise recipes)"
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        if cuda < MIN_CUDA_BLOCKWISE:
            return (f"block-wise FP8 scaling needs cuBLAS from CUDA >= 12.9; this torch is built with CUDA "
                    f"{torch.version.cuda}")
        return None

    def prepare(self, layer: ScaledLayer) -> ScaledMMState:
        p = layer.plain
        return ScaledMMState(layer, p.codes.t(), block_weight_scales(p.scales))

    def forward(self, x: torch.Tensor, state: ScaledMMState, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch.nn.functional as F

        m = x.shape[0]
        q, sa = quantize_activations(x, "group", pad_rows=4)
        y = F.scaled_mm(q, state.w_t, sa, F.ScalingType.BlockWise1x128, state.scale_b,
                        F.ScalingType.BlockWise128x128, output_dtype=BLOCK_OUT[x.dtype])[:m]
        if out is not None:
            return out.copy_(y)
        return y if y.dtype == x.dtype else y.to(x.dtype)
