"""`cuda-fp8` and `cuda-fp8-block`: FP8 E4M3 weights; at M <= 8 qtool's weight-only GEMV (csrc/fp8_gemv.cu),
above it torch's scaled matmul (the scaled-mm kernels' W8A8 path).

    M <= 8:  y = x @ (s * W)^T    x as given (fp16/bf16), E4M3 codes decoded exactly in registers, fp32 sums
             on the tensor core (mma.sync m16n8k16), one rounding to x's dtype; no activation quantization
    M > 8:   x quantized to E4M3 per token (cuda-fp8) or per 1x128 group (cuda-fp8-block), then
             torch._scaled_mm row-wise / F.scaled_mm block-wise, as scaled-mm-fp8 / scaled-mm-fp8-block

Why two paths: at small M an FP8 layer is a stream of weight bytes, and the W8A8 path spends a launch on the
activation quantizer and runs a GEMM tiled for large M; the GEMV reads each weight byte once (H200,
Llama-3-70B layer at M = 1: 1.79-1.82x bf16 against the W8A8 path's 1.67-1.72x, 2x being the bytes' ratio;
benchmarks/results/fp.md). At large M the tensor-core FP8 GEMM is the right tool. The GEMV is also the more
accurate path (x is not rounded to E4M3), so the error bound stays the W8A8 one (scaled_mm.py's docstring).

The GEMV is used where it is built (nvcc once, or a cached cubin; build.py) and the layer's codes hold no NaN
pattern (the splice that decodes a code reads E4M3's NaN as 480, where the oracle propagates NaN: such a layer
takes the W8A8 path, which does); `describe` names the path taken.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from qtool.kernels.base import ScaledLayer, register
from qtool.kernels.devices import cuda_index
from qtool.kernels.scaled_mm import BLOCK, ScaledMMBlockwise, ScaledMMRowwise, ScaledMMState

UNIT = "fp8_gemv.cu"
MAX_M = 8  # one mma n-tile of batch columns
MIN_CAPABILITY = (8, 9)  # the kernels' floor (FP8 tensor cores for the W8A8 path); the GEMV is used within it
MODES = {"tensor": "tensor", "channel": "row", "block": "block"}  # weight strategy -> the kernel's scale mode
WIDTHS = (4, 8)  # warps per CTA


def entry_points() -> set[str]:
    """The kernels csrc/fp8_gemv.cu defines."""
    return {f"qt_fp8_gemv_{dt}_{mode}_w{w}" for dt in ("f16", "bf16") for mode in MODES.values() for w in WIDTHS}


class Fp8Args(ctypes.Structure):
    """csrc/fp8_gemv.cu's Fp8Args, field for field."""

    _fields_ = [("w", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("s", ctypes.c_void_p),
                ("ws", ctypes.c_void_p), ("cnt", ctypes.c_void_p), ("M", ctypes.c_int), ("N", ctypes.c_int),
                ("K", ctypes.c_int), ("KS", ctypes.c_int), ("steps", ctypes.c_int), ("flags", ctypes.c_int)]


# csrc/fp8_gemv.cu keeps its threads to 64 registers (launch bounds): an SM holds 32 warps of either CTA width
WARPS_PER_SM = 32


@dataclass(frozen=True)
class GemvPlan:
    """Grid (tiles of 16 rows, K splits), 128-k steps per split, warps per CTA."""

    tiles: int
    splits: int
    steps: int
    warps: int

    def label(self) -> str:
        return f"cuda fp8 gemv w{self.warps} split{self.splits}"


def _shape(tiles: int, nsteps: int, n_sm: int, warps: int, splits: int | None) -> tuple[GemvPlan, float]:
    if splits is None:  # as many K splits as fill one wave of resident warps, each warp keeping a step
        splits = max(1, min((n_sm * WARPS_PER_SM) // (tiles * warps), nsteps // warps))
    steps = -(-nsteps // max(1, min(splits, nsteps)))
    pl = GemvPlan(tiles, -(-nsteps // steps), steps, warps)
    waves = tiles * pl.splits * warps / (n_sm * WARPS_PER_SM)
    return pl, waves / math.ceil(waves)


def plan(m: int, n: int, k: int, n_sm: int, *, warps: int | None = None, splits: int | None = None) -> GemvPlan:
    """The launch for a layer: the grid whose waves of resident warps are fullest. Every warp streams at the
    same rate (each holds the same bytes in flight), so a grid of 1.3 waves takes as long as 2, and one of 0.6
    leaves 40 % of the warps that could stream idle. Each CTA width (4 or 8 warps) is sized with the K splits
    that fill a wave (small layers, k/v: 8 splits), and the fuller grid wins (Qwen2.5-32B down, 320 tiles:
    4 warps x 3 splits, 0.91 of a wave, against 8 x 1, 0.61); on a tie the one with fewer splits (no pass
    over partial sums), then 4 warps (fewer CTAs to start). The weight stream is the same for every M <= 8, and
    so is the plan. `warps` and `splits` force a choice (tests, tuning)."""
    tiles = -(-n // 16)
    nsteps = -(-k // 128)
    cands = [_shape(tiles, nsteps, n_sm, w, splits) for w in ((warps,) if warps else WIDTHS[::-1])]
    return max(cands, key=lambda c: (round(c[1], 2), -c[0].splits, c[0].warps == 4))[0]


@lru_cache(maxsize=8)
def _module(device_index: int, cc: tuple[int, int]):
    from qtool.kernels.cuda.build import cubin_for
    from qtool.kernels.cuda.driver import Module

    return Module(cubin_for(cc, UNIT), torch.device("cuda", device_index))


def gemv_built(device: torch.device) -> str | None:
    """Why the GEMV cannot run on `device` (capability, sources, nvcc), or None."""
    from qtool.kernels.cuda import build

    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CAPABILITY:
        return f"the FP8 GEMV is built for compute capability >= 8.9, device has {cc[0]}.{cc[1]}"
    if not build.sources_present(UNIT):
        return f"csrc/{UNIT} is not installed (install qtool from its source tree)"
    if not build.cubin_path(cc, UNIT).is_file() and build.find_nvcc() is None:
        return f"the FP8 GEMV is built from csrc/{UNIT} with nvcc on first use, and no nvcc was found"
    return None


@dataclass
class GemvState:
    """The codes as bytes [N, K], the scales as fp32 (tensor [1], channel [N], block [ceil(N/128), ceil(K/128)]),
    and the split-K workspace (cuda.launch.grow_workspace)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mode: str
    n_sm: int
    cc: tuple[int, int]
    ws: torch.Tensor | None = None
    counters: torch.Tensor | None = None
    retired: list = field(default_factory=list)


def gemv_state(layer: ScaledLayer) -> GemvState | str:
    """The GEMV's view of `layer`, or why it does not take the layer."""
    p = layer.plain
    dev = p.codes.device
    why = gemv_built(dev)
    if why:
        return why
    if p.strategy == "block" and p.block_shape != (BLOCK, BLOCK):
        return f"the FP8 GEMV reads 128x128 weight blocks, not {p.block_shape[0]}x{p.block_shape[1]}"
    codes = p.codes.view(torch.uint8)
    if not codes.is_contiguous():
        codes = codes.contiguous()
    elif codes.data_ptr() % 16:  # a view at an odd offset: the GEMV reads 16-byte pieces
        codes = codes.clone()
    nan = int(((codes & 0x7F) == 0x7F).sum())
    if nan:
        return f"the weight holds {nan} E4M3 NaN codes (the GEMV would read them as 480)"
    s = p.scales.to(torch.float32)
    scales = s.reshape(-1).contiguous() if p.strategy != "block" else s.contiguous()
    torch.cuda.current_stream(dev).synchronize()  # the GEMV reads the weights before its dependency wait
    return GemvState(codes, scales, MODES[p.strategy], torch.cuda.get_device_properties(dev).multi_processor_count,
                     torch.cuda.get_device_capability(dev))


def gemv(x: torch.Tensor, st: GemvState, out: torch.Tensor | None = None, pl: GemvPlan | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (s * W)^T for M <= 8, x fp16/bf16 on the state's device; `pl` forces a launch."""
    from qtool.kernels.cuda.launch import grow_workspace, pdl_enabled

    m, k = x.shape
    n = st.codes.shape[0]
    if not x.is_contiguous() or x.data_ptr() % 16:  # read in 16-byte pieces
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    y = out if out.is_contiguous() else torch.empty((m, n), dtype=x.dtype, device=x.device)
    pl = pl or plan(m, n, k, st.n_sm)
    ws = cnt = y
    if pl.splits > 1:
        grow_workspace(st, pl.splits * m * n, pl.tiles, x.device)
        ws, cnt = st.ws, st.counters
    args = Fp8Args(st.codes.data_ptr(), x.data_ptr(), y.data_ptr(), st.scales.data_ptr(), ws.data_ptr(),
                   cnt.data_ptr(), m, n, k, -(-k // BLOCK), pl.steps, 0)
    dt = "bf16" if x.dtype == torch.bfloat16 else "f16"
    dev = cuda_index(x.device)
    _module(dev, st.cc).launch(f"qt_fp8_gemv_{dt}_{st.mode}_w{pl.warps}", (pl.tiles, pl.splits, 1), 32 * pl.warps,
                               0, [args], pdl=pdl_enabled() and tuple(st.cc) >= (9, 0))
    if y is not out:
        out.copy_(y)
    return out


@dataclass(frozen=True, eq=False)
class CudaFp8State:
    mm: ScaledMMState  # the W8A8 path (M > 8)
    gemv: GemvState | None  # None: every M takes the W8A8 path
    why_not: str = ""  # why the GEMV does not take this layer


class _CudaFp8:
    """The two paths over one scaled-mm kernel's checks and W8A8 state (mixed into its class)."""

    def prepare(self, layer: ScaledLayer) -> CudaFp8State:
        mm = super().prepare(layer)
        g = gemv_state(layer)
        return CudaFp8State(mm, None, g) if isinstance(g, str) else CudaFp8State(mm, g)

    def forward(self, x: torch.Tensor, state: CudaFp8State, out: torch.Tensor | None = None) -> torch.Tensor:
        if state.gemv is not None and x.shape[0] <= MAX_M:
            return gemv(x, state.gemv, out)
        return super().forward(x, state.mm, out)

    def describe(self, state: CudaFp8State, m: int) -> str:
        if state.gemv is not None and m <= MAX_M:
            st = state.gemv
            pl = plan(m, st.codes.shape[0], st.codes.shape[1], st.n_sm)
            return f"{pl.label()}, x as given"
        w8a8 = super().describe(state.mm, m)
        return w8a8 if state.gemv is not None or m > MAX_M else f"{w8a8} (GEMV not used: {state.why_not})"


@register
class CudaFp8(_CudaFp8, ScaledMMRowwise):
    id = "cuda-fp8"
    summary = ("FP8 E4M3 weights (per-tensor or per-channel scales): M <= 8 qtool's weight-only GEMV "
               "(csrc/fp8_gemv.cu, x as given), larger M x quantized per token + torch._scaled_mm row-wise; "
               "CUDA CC >= 8.9")


@register
class CudaFp8Block(_CudaFp8, ScaledMMBlockwise):
    id = "cuda-fp8-block"
    summary = ("FP8 E4M3 weights with 128x128 block scales: M <= 8 qtool's weight-only GEMV "
               "(csrc/fp8_gemv.cu, x as given), larger M x quantized per 1x128 group + F.scaled_mm block-wise; "
               "CUDA CC 9.0, CUDA >= 12.9")

