"""Launch configurations for the Triton W4A16 kernel, bucketed by M, and the call itself.

Why the buckets look the way they do (seed 002, "crossover" and the M-bucketed dispatchers):
- Small M is pure weight streaming; there is no reuse to exploit, so the aim is every SM pulling weight
  bytes at once: narrow N tiles, deep K blocks, and split-K when N / BLOCK_N programs cannot fill the
  device (Llama k/v projections have N = 1024: 16 tiles of 64 on 132 SMs).
- M = 1 has its own kernel (mode 3): a GEMV whose dequantization is a short PTX block per int32 word.
- From M ~ 2 the tensor cores matter: mode 4 (the M = 1 kernel's per-word PTX dequant feeding a wgmma
  with the weight as the register operand), split-K.
- Past M = 64 the dequantize-into-a-temporary + cuBLAS path is taken and reported as such
  ("dequant(ptx ...)+cublas"). The temporary lives for one call.

TABLE comes from benchmarks/tune_w4a16.py sweeps on an H200, 2026-11-29 (benchmarks/results/tune-triton-h200.json,
keys tune, tune-m1, tune-v2; bench.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

FUSED = "fused"
DEQUANT_GEMM = "dequant+cublas"


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: mode (0 FMA rows, 1 mma x@W, 2 swapped W^T x^T, 3 the M=1 GEMV with PTX dequant, 4 the dot
    kernel with PTX dequant and natural-K tiles), tile
    sizes, split-K, warps, stages, or path = "dequant+cublas" (then only the dequant tiles matter)."""

    mode: int = 1
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    f32: bool = False  # dequantize in fp32 (always for bf16; an option for fp16)
    pair: bool = False  # mode 3: two words per 16-bit accumulator (when a block lies in one group)
    swap: bool = False  # mode 4: the weight as the dot's first operand (W^T x^T)
    path: str = FUSED

    def label(self) -> str:
        if self.path == DEQUANT_GEMM:
            if self.mode == 4:
                return f"dequant(ptx {self.block_n}x{self.block_k} w{self.num_warps})+cublas"
            return "dequant+cublas"
        return (f"mode{self.mode} {self.block_m}x{self.block_n}x{self.block_k} splitk{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}" + (" f32" if self.f32 else "") + (" pair" if self.pair else "")
                + (" swap" if self.swap else ""))


@dataclass(frozen=True)
class Bucket:
    """Applies to max_m >= M (first match); split-K is chosen at run time to reach `programs_per_sm`."""

    max_m: int
    config: LaunchConfig
    programs_per_sm: float = 2.0


# M buckets at 1 / 16 / 64 / larger, as the dispatchers in seed 002 do.
TABLE: tuple[Bucket, ...] = (
    # M = 1: the PTX-dequant GEMV; ~6 programs per SM (4 fit at 128 registers: 1.5 waves balanced best)
    Bucket(1, LaunchConfig(mode=3, block_m=1, block_n=512, block_k=64, num_warps=4, num_stages=1, pair=True),
           programs_per_sm=6.0),
    # M <= 16: mode 4, the weight as the wgmma register operand (W^T x^T, N = 16), PTX dequant per word,
    # narrow 64-column tiles, split-K to ~8 programs per SM (tune-triton-h200.json, tune-v2: 1.36x over the 70B layer
    # against 1.02x for the mode 2 launch it replaces)
    Bucket(16, LaunchConfig(mode=4, block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True),
           programs_per_sm=8.0),
    Bucket(64, LaunchConfig(mode=2, block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)),
    # Past M = 64: dequantize with mode 4's PTX block into a temporary, then cuBLAS (0.58x over the 70B
    # layer, against 0.40x with the Triton-ops dequant). The fused mode 4 kernel at 128x128x128 measured
    # the same (0.59x), but two sibling tilings (256x128x64, 64x128x64) gave wrong results on the
    # 8192x28672 layer under triton 3.6, so the fused path is not dispatched there (bench.md).
    Bucket(1 << 62, LaunchConfig(path=DEQUANT_GEMM, mode=4, block_n=256, block_k=64, num_warps=8)),
)


# Act-order or odd group sizes where mode 4 would be chosen: the swapped dot kernel.
MMA_FALLBACK = LaunchConfig(mode=2, block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)

# Act-order or odd group sizes at M = 1: the generic FMA kernel (gathers a scale per element).
GEMV_FALLBACK = LaunchConfig(mode=0, block_m=1, block_n=64, block_k=256, num_warps=4, num_stages=1)


def _pow2_floor(v: int) -> int:
    p = 1
    while p * 2 <= v:
        p *= 2
    return p


def gemv_ok(group_size: int, block_k: int, act_order: bool) -> bool:
    """Mode 3 reads one zero/scale per word: no act-order, and groups of whole words."""
    return not act_order and group_size % 8 == 0


def mma_ok(group_size: int, act_order: bool) -> bool:
    """Mode 4 reads one zero/scale per word row: no act-order, and groups of whole words."""
    return not act_order and group_size % 8 == 0


def choose_config(m: int, n: int, k: int, n_sm: int, group_size: int = 128, act_order: bool = False,
                  table: tuple[Bucket, ...] = TABLE) -> LaunchConfig:
    """The launch for an [m, k] x [k, n] product on a device with n_sm multiprocessors."""
    bucket = next(b for b in table if m <= b.max_m)
    cfg = bucket.config
    if cfg.path != FUSED:
        if cfg.mode == 4 and not mma_ok(group_size, act_order):
            return LaunchConfig(path=cfg.path)  # the gathering dequant kernel (act-order, odd groups)
        return cfg
    if cfg.mode == 3 and not gemv_ok(group_size, cfg.block_k, act_order):
        cfg = GEMV_FALLBACK
    if cfg.mode == 4 and not mma_ok(group_size, act_order):
        cfg = MMA_FALLBACK
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_blocks = -(-k // cfg.block_k)
    want = max(1.0, bucket.programs_per_sm * n_sm / max(tiles, 1))
    # mode 3 rounds to the nearest power of two (its split costs one extra pass over [split, N] floats);
    # the atomic split of the dot kernels rounds down.
    p2 = 1 << max(0, round(math.log2(want))) if cfg.mode == 3 else _pow2_floor(int(want))
    # mode 3 keeps >= 256 K rows per program: shorter K ranges measured slower (prologue and the serial
    # sum of partials dominate), e.g. 8192x8192 at split 64: 20.6 us against 17.1 us at split 32.
    per_split = max(1, 256 // cfg.block_k) if cfg.mode == 3 else 1
    # mode 4 keeps >= 2 K blocks per program (one block leaves nothing to overlap the loads with)
    if cfg.mode == 4:
        per_split = 2
    split = min(p2, _pow2_floor(max(1, k_blocks // per_split)), 64 if cfg.mode in (3, 4) else 16)
    if split == cfg.split_k:
        return cfg
    return replace(cfg, split_k=split)


def group_mode(group_size: int, block_k: int, act_order: bool) -> int:
    """GROUPS constexpr of the kernel (see w4a16.py)."""
    if act_order:
        return 2
    if group_size % block_k == 0:
        return 0
    if group_size % 8 == 0:
        return 1
    return 2


def run_w4a16(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None, group_size: int, cfg: LaunchConfig,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(qweight...) (shapes in w4a16.py); x fp16/bf16, 4-bit codes.

    group_size: the effective size (K for -1). g_idx: int32 [K] under act-order, else None.
    """
    import triton

    from qtool.kernels.triton.w4a16 import dequant_kernel, w4a16_kernel

    m, k = x.shape
    n = qweight.shape[1]
    bf16 = x.dtype == torch.bfloat16
    act = g_idx is not None
    gi = g_idx if act else qweight  # any int32 pointer; never read when ACT_ORDER is False
    if x.stride(1) != 1:
        x = x.contiguous()
    if cfg.path == DEQUANT_GEMM and cfg.mode == 4 and mma_ok(group_size, act):
        from qtool.kernels.triton.w4a16 import dequant_words_kernel

        w = torch.empty((k, n), dtype=x.dtype, device=x.device)
        sc = scales if scales.dtype == x.dtype else scales.to(x.dtype)
        grid = (triton.cdiv(k, cfg.block_k), triton.cdiv(n, cfg.block_n))
        dequant_words_kernel[grid](qweight, qzeros, sc.view(torch.int16), w, n, k, group_size,
                                   BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BF16=bf16,
                                   USE_ASM=not interpreter_on(), num_warps=cfg.num_warps)
        if out is None:
            return x @ w
        return torch.matmul(x, w, out=out)
    if cfg.path == DEQUANT_GEMM:
        w = torch.empty((k, n), dtype=x.dtype, device=x.device)
        block_n, block_r = 128, 8
        grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, block_n))
        dequant_kernel[grid](qweight, qzeros, scales, gi, w, n, k, group_size, BLOCK_N=block_n,
                             BLOCK_R=block_r, ACT_ORDER=act, F32=bf16, num_warps=4)
        if out is None:
            return x @ w
        return torch.matmul(x, w, out=out)

    if cfg.mode == 3:
        if gemv_ok(group_size, cfg.block_k, act):
            return _run_gemv(x, qweight, qzeros, scales, group_size, cfg, out)
        cfg = GEMV_FALLBACK
    if cfg.mode == 4:
        if mma_ok(group_size, act):
            return _run_mma(x, qweight, qzeros, scales, group_size, cfg, out)
        cfg = replace(MMA_FALLBACK, block_m=cfg.block_m, split_k=cfg.split_k)
    split = cfg.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    atomic = split > 1
    if atomic:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    elif out is not None and out.stride(1) == 1:
        y = out
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    w4a16_kernel[grid](
        x, qweight, qzeros, scales, gi, y,
        m, n, k, group_size, x.stride(0), y.stride(0), k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        MODE=cfg.mode, GROUPS=group_mode(group_size, cfg.block_k, act), ACT_ORDER=act, ATOMIC=atomic,
        BF16=bf16, F32=bf16 or cfg.f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if atomic:
        if out is not None:
            out.copy_(y)
            return out
        return y.to(x.dtype)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


_WORKSPACES: dict = {}


def _workspace(device: torch.device, n_split: int, m: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials [n_split, m, n] and int32 arrival counters [tiles] (kept zero by the kernel itself).

    Shared by every layer of one shape on one device; launches on one stream are ordered, so sharing is
    safe there (not across concurrent streams).
    """
    key = (str(device), n_split, m, n, tiles)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.empty((n_split, m, n), dtype=torch.float32, device=device),
                            torch.zeros((tiles,), dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def _run_gemv(x, qweight, qzeros, scales, group_size, cfg, out):
    import triton

    from qtool.kernels.triton.w4a16 import w4a16_gemv_kernel

    m, k = x.shape
    n = qweight.shape[1]
    if x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.contiguous()  # the kernel reads activations in 32-bit pairs
    sc = scales if scales.dtype == x.dtype else scales.to(x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    n_split = triton.cdiv(k, k_per_split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    y = out if (out is not None and out.stride(1) == 1) else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n_split > 1:
        ws, sem = _workspace(x.device, n_split, m, n, m * n_tiles)
    else:
        ws, sem = y, qweight  # never touched
    groups = 0 if group_size % cfg.block_k == 0 else 1
    w4a16_gemv_kernel[(m, n_tiles, n_split)](
        x.view(torch.int32), qweight, qzeros, sc.view(torch.int16), y, ws, sem,
        m, n, k, group_size, x.stride(0) // 2, y.stride(0), k_per_split, n_split,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUPS=groups, SPLIT=n_split > 1,
        BF16=x.dtype == torch.bfloat16, USE_ASM=not interpreter_on(),
        EVEN=(n % cfg.block_n == 0 and k % k_per_split == 0), PAIR=cfg.pair and groups == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def _run_mma(x, qweight, qzeros, scales, group_size, cfg, out):
    import triton

    from qtool.kernels.triton.w4a16 import w4a16_mma_kernel

    m, k = x.shape
    n = qweight.shape[1]
    sc = scales if scales.dtype == x.dtype else scales.to(x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    n_split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), n_split)
    y = out if (out is not None and out.stride(1) == 1) else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n_split > 1:
        ws, sem = _workspace(x.device, n_split, m, n, grid[0] * grid[1])
    else:
        ws, sem = y, qweight  # never touched
    w4a16_mma_kernel[grid](
        x, qweight, qzeros, sc.view(torch.int16), y, ws, sem,
        m, n, k, group_size, x.stride(0), y.stride(0), k_per_split, n_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP=cfg.swap,
        GROUPS=0 if group_size % cfg.block_k == 0 else 1, SPLIT=n_split > 1,
        BF16=x.dtype == torch.bfloat16, USE_ASM=not interpreter_on(),
        EVEN=(n % cfg.block_n == 0 and k % k_per_split == 0),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y
