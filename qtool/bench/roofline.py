"""Roofline arithmetic and the two device ceilings measured in the same run.

Seed 002, "Where the batch-size crossover is": streaming N*K weights at b_eff bits costs
N*K*b_eff / (8*BW); the math costs 2*M*N*K / P. They are equal at

    M* = P * b_eff / (16 * BW),      b_eff = bits + 16 / group_size   (fp16/bf16 scale per group)

(H100: 989.4e12 * 4.125 / (16 * 3.35e12) = 76). Below M* a W4A16 kernel is weight-bandwidth bound and
can be up to 16 / b_eff times faster than the dense 16-bit product; the dense product itself stays
memory-bound up to P / BW rows (its own ridge), past which the two can only tie.

The measured counterpart, from a sweep over M: the intersection of the two asymptotes actually seen,
t_mem (the time at the smallest M, where the kernel streams weights) and t_row = t(M_max) / M_max
(time per row at the largest M): M*_measured = t_mem / t_row. It is meaningful when the sweep reaches
past the ridge (e.g. --batch-sizes 1 16 256).
"""

from __future__ import annotations

import time

import torch


def b_eff(bits: int, group_size: int, k: int) -> float:
    """Effective bits per stored weight: codes plus one 16-bit scale per group (seed 002, section 0.5)."""
    g = k if group_size == -1 else group_size
    return bits + 16.0 / g


def m_star(peak_flops: float, bandwidth: float, bits_eff: float) -> float:
    """The W4A16 ridge M* = P * b_eff / (16 * BW) (P in FLOP/s, BW in bytes/s)."""
    return peak_flops * bits_eff / (16.0 * bandwidth)


def dense_ridge(peak_flops: float, bandwidth: float, act_bytes: int = 2) -> float:
    """Rows at which a dense 16-bit product turns compute-bound: P * act_bytes / (2 * BW)."""
    return peak_flops * act_bytes / (2.0 * bandwidth)


def roofline_speedup(m: int, k: int, n: int, bits_eff: float, peak_flops: float, bandwidth: float) -> float:
    """Ideal speedup of W4A16 over dense at batch m (weights + activations + output, both at the roofline)."""
    act = 2 * (m * k + m * n)
    flop = 2.0 * m * n * k
    dense = max((2 * n * k + act) / bandwidth, flop / peak_flops)
    quant = max((n * k * bits_eff / 8 + act) / bandwidth, flop / peak_flops)
    return dense / quant


def measured_m_star(times_by_m: dict[int, float]) -> float | None:
    """Intersection of the measured memory asymptote (smallest M) and compute asymptote (largest M)."""
    if len(times_by_m) < 2:
        return None
    ms = sorted(times_by_m)
    t_mem = times_by_m[ms[0]]
    t_row = times_by_m[ms[-1]] / ms[-1]
    if t_row <= 0:
        return None
    return t_mem / t_row


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median).

    GPU: a 1 GiB buffer (far past any L2); CPU: 128 MiB.
    """
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    if device.type == "cuda":
        for _ in range(3):
            dst.copy_(src)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        dst.copy_(src)
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * nbytes / times[len(times) // 2]


def matmul_peak(device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    """Dense matmul FLOP/s on random data (GPU: 8192^3 in `dtype`; CPU: 512^3 fp32), median."""
    n = 8192 if device.type == "cuda" else 512
    dt = dtype if device.type == "cuda" else torch.float32
    a = torch.randn((n, n), device=device, dtype=dt)
    b = torch.randn((n, n), device=device, dtype=dt)
    times = []
    if device.type == "cuda":
        for _ in range(3):
            a @ b
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            a @ b
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
    else:
        a @ b
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * n ** 3 / times[len(times) // 2]
