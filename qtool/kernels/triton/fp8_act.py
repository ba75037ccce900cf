"""Dynamic E4M3 quantization of activations in one launch: per token, per 1x128 group, or per tensor.

The scaled-matmul kernels (qtool/kernels/scaled_mm.py) quantize x on every call. Done with torch ops that is
an abs, a reduction, a division, a clamp and a cast: five launches and two temporaries of x's size, which at
M = 1 cost as much as a quarter of the weight stream of a 70B projection. Here one program owns one
(row, group) and writes its codes and its scale; a padded row (rows >= M, up to the M the matmul needs) reads
as zeros. At M = 1 the call is latency, not bandwidth: one program reads a whole 8192-28672-element row, so
the row is loaded in one step (every load in flight at once) and held in registers, not walked in a loop of
dependent round trips to memory (with the looped form, the H200 took 10 us longer on down_proj, K = 28672,
than on gate_proj for the same weight bytes).

The arithmetic is `act_quant_torch`'s (scaled_mm.py) step for step, so that both give the same bytes:
    scale = max(amax, min_amax) / 448          (IEEE division, div_rn)
    code  = e4m3(clamp(x / scale, -448, 448))  (IEEE division; the cast rounds to nearest even)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, M, group, stride_xm, stride_qm, stride_sm, stride_sg,
                      E4M3: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr, PER_TENSOR: tl.constexpr,
                      SINGLE: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    n_read = tl.where(row < M, group, 0)  # a padded row reads nothing: zeros
    x_row = x_ptr + row.to(tl.int64) * stride_xm + g * group
    q_row = q_ptr + row.to(tl.int64) * stride_qm + g * group
    if SINGLE:
        # the whole slice in registers: every load in flight at once, x read once
        offs = tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < n_read, other=0.0).to(tl.float32)
        if PER_TENSOR:
            amax = tl.load(amax_ptr).to(tl.float32)
        else:
            amax = tl.max(tl.abs(v), axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, FLOOR), E4M3)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
        y = tl.math.div_rn(v, tl.full([BLOCK], 0.0, tl.float32) + scale)
        y = tl.minimum(tl.maximum(y, -E4M3), E4M3)
        tl.store(q_row + offs, y.to(tl.float8e4nv), mask=offs < group)
    else:
        if PER_TENSOR:
            amax = tl.load(amax_ptr).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, group, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(x_row + offs, mask=offs < n_read, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(v))
            amax = tl.max(acc, axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, FLOOR), E4M3)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
        for start in range(0, group, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < n_read, other=0.0).to(tl.float32)
            y = tl.math.div_rn(v, tl.full([BLOCK], 0.0, tl.float32) + scale)
            y = tl.minimum(tl.maximum(y, -E4M3), E4M3)
            tl.store(q_row + offs, y.to(tl.float8e4nv), mask=offs < group)


# Slices up to this many elements are held in registers by one program (16 warps: 64 values a thread);
# longer ones are read twice in LOOP_BLOCK pieces.
SINGLE_MAX = 32768
LOOP_BLOCK = 4096


def act_quant_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                     amax: torch.Tensor | None, e4m3_max: float, min_amax: float) -> None:
    """Fill q [Mp, K] float8_e4m3fn and scales from x [M, K] fp16/bf16/fp32 (M <= Mp; rows past M are zeros).

    group: K (one scale per token) or a divisor of K (one per 1 x group slice); scales is [Mp, K / group]
    with any strides (the 1x128 matmul wants it outer-dim-major). amax: a float32 scalar tensor holding
    max |x| over the whole tensor: then every row uses that one scale (per-tensor), written to scales[0, 0]
    by every program (the same value). e4m3_max, min_amax: the constants of scaled_mm.py (passed in, so
    that this module needs nothing but triton and torch).
    """
    mp, k = q.shape
    n_groups = k // group
    single = triton.next_power_of_2(group) <= SINGLE_MAX
    block = triton.next_power_of_2(group) if single else LOOP_BLOCK
    warps = max(1, min(16, block // 512))
    per_tensor = amax is not None
    _act_quant_kernel[(mp, n_groups)](
        x, q, scales, amax if per_tensor else scales, x.shape[0], group, x.stride(0), q.stride(0),
        0 if per_tensor else scales.stride(0), 0 if per_tensor else scales.stride(1),
        E4M3=e4m3_max, FLOOR=min_amax, BLOCK=block, PER_TENSOR=per_tensor, SINGLE=single, num_warps=warps)
