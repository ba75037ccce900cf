"""Triton W4A16 GEMM over GPTQ v2 tensors, read as stored (no repack, no dense weight kept).

    y[M, N] = x[M, K] @ W^T,   W^T[k, n] = scales[g(k), n] * (q[k, n] - z[g(k), n])

    x:       fp16/bf16 [M, K], row stride stride_xm, unit column stride
    qweight: int32 [K/8, N]   word r, column n holds the codes of rows 8r..8r+7 at bits 4j..4j+3
    qzeros:  int32 [n_groups, N/8]  word c holds the zeros of columns 8c..8c+7 at bits 4i..4i+3
    scales:  fp16/bf16 [n_groups, N]
    g_idx:   int32 [K] (act-order only)
    y:       x's dtype [M, N]; or fp32 [M, N] accumulated with atomics when the K loop is split

How a K block of BLOCK_K rows is consumed: the [BLOCK_K/8, BLOCK_N] int32 tile is loaded once, and for
each nibble j the rows 8r + j (r = 0..BLOCK_K/8-1) form a sub-tile that is dequantized in registers and
multiplied with the matching strided columns of x. A dot product does not care in which order K is
summed, so the codes never need to be rearranged into natural row order (no reshape, no shared-memory
shuffle): each loaded word is used in place eight times.

Dequantization: fp16 bits `0x6400 | q` are 1024 + q, and fp32 bits `0x4B000000 | q` are 2^23 + q, both
exact for q < 16, so (bias + q) - (bias + z) = q - z is exact and the one multiply by the scale rounds once
— the same value torch's dequantize-then-round produces — without an int-to-float conversion (a
quarter-rate instruction that would otherwise bound the M=1 kernel on an H200). bf16 always takes the fp32
form (exact too: a bf16 scale times q - z fits fp32's significand), fp16 either (F32 picks).

Modes (the launch table in configs.py chooses one per M bucket):
  MODE 0  M = 1 rows, no tensor cores: fp32 FMA into a [BLOCK_K/8, BLOCK_N] accumulator, reduced once at
          the end (tensor cores would waste 15/16 of a 16-row tile and need a layout shuffle).
  MODE 1  x @ W on tensor cores (mma), BLOCK_M >= 16.
  MODE 2  swapped (W^T x^T): the weight is the first operand, which Hopper's wgmma may take from
          registers, so the dequantized tile never round-trips through shared memory; for large M.
Groups (constexpr GROUPS):
  0  the whole K block lies in one group (group_size % BLOCK_K == 0): one scale row per block
  1  group changes inside the block but only every >= 8 rows (group_size % 8 == 0): one scale per word row
  2  any g_idx (act-order) or group size: a scale and zero gathered per element
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _biased(words, shift, F32: tl.constexpr):
    """The 4-bit field at `shift` of int32 `words` as a float holding bias + q, exactly, with no
    int-to-float conversion: fp32 bits 0x4B000000 | q = 2^23 + q, fp16 bits 0x6400 | q = 1024 + q."""
    q = (words >> shift) & 0xF
    if F32:
        return (q | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _scale(s, F32: tl.constexpr):
    if F32:
        return s.to(tl.float32)
    else:
        return s.to(tl.float16)


@triton.jit(do_not_specialize=["M"])
def w4a16_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, y_ptr,
    M, N, K, group_size, stride_xm, stride_ym, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MODE: tl.constexpr, GROUPS: tl.constexpr, ACT_ORDER: tl.constexpr, ATOMIC: tl.constexpr,
    BF16: tl.constexpr, F32: tl.constexpr,
):
    R: tl.constexpr = BLOCK_K // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if BF16:
        CT: tl.constexpr = tl.bfloat16
    else:
        CT: tl.constexpr = tl.float16

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    zshift = (offs_n % 8) * 4
    n_words = N // 8
    k_rows = K // 8

    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    if MODE == 2:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((R, BLOCK_N), dtype=tl.float32)

    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_r
        r_mask = rows < k_rows
        # Weight words (and, below, scales/zeros) in the orientation of the mode: [BLOCK_N, R] when the
        # weight is the dot's first operand, [R, BLOCK_N] otherwise.
        if MODE == 2:
            w_mask = n_mask[:, None] & r_mask[None, :]
            qw = tl.load(qweight_ptr + rows[None, :] * N + offs_n[:, None], mask=w_mask, other=0)
        else:
            w_mask = r_mask[:, None] & n_mask[None, :]
            qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0)

        if GROUPS == 0:
            g = k0 // group_size
            s_row = _scale(tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0), F32)
            z_row = _biased(tl.load(qzeros_ptr + g * n_words + offs_n // 8, mask=n_mask, other=0), zshift, F32)
            if MODE == 2:
                s = s_row[:, None]
                zq = z_row[:, None]
            else:
                s = s_row[None, :]
                zq = z_row[None, :]
        elif GROUPS == 1:
            g = (k0 + 8 * offs_r) // group_size
            if MODE == 2:
                s = _scale(tl.load(scales_ptr + g[None, :] * N + offs_n[:, None], mask=w_mask, other=0.0), F32)
                zw = tl.load(qzeros_ptr + g[None, :] * n_words + (offs_n // 8)[:, None], mask=w_mask, other=0)
                zq = _biased(zw, zshift[:, None], F32)
            else:
                s = _scale(tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=w_mask, other=0.0), F32)
                zw = tl.load(qzeros_ptr + g[:, None] * n_words + (offs_n // 8)[None, :], mask=w_mask, other=0)
                zq = _biased(zw, zshift[None, :], F32)

        for j in tl.static_range(8):
            kj = k0 + 8 * offs_r + j
            k_mask = kj < K
            if GROUPS == 2:
                if ACT_ORDER:
                    gj = tl.load(g_idx_ptr + kj, mask=k_mask, other=0)
                else:
                    gj = kj // group_size
                if MODE == 2:
                    s = _scale(tl.load(scales_ptr + gj[None, :] * N + offs_n[:, None], mask=w_mask, other=0.0), F32)
                    zw = tl.load(qzeros_ptr + gj[None, :] * n_words + (offs_n // 8)[:, None], mask=w_mask,
                                 other=0)
                    zq = _biased(zw, zshift[:, None], F32)
                else:
                    s = _scale(tl.load(scales_ptr + gj[:, None] * N + offs_n[None, :], mask=w_mask, other=0.0), F32)
                    zw = tl.load(qzeros_ptr + gj[:, None] * n_words + (offs_n // 8)[None, :], mask=w_mask,
                                 other=0)
                    zq = _biased(zw, zshift[None, :], F32)
            w = (_biased(qw, 4 * j, F32) - zq) * s  # exact (q - z), one rounding at the multiply
            if MODE == 0:
                xj = tl.load(x_ptr + pid_m * stride_xm + kj, mask=k_mask, other=0.0)
                acc += xj.to(tl.float32)[:, None] * w.to(tl.float32)
            elif MODE == 1:
                xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + kj[None, :],
                             mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                acc = tl.dot(xj, w.to(CT), acc)
            else:
                xj = tl.load(x_ptr + offs_m[None, :] * stride_xm + kj[:, None],
                             mask=k_mask[:, None] & m_mask[None, :], other=0.0)
                acc = tl.dot(w.to(CT), xj, acc)

    if MODE == 0:
        out = tl.sum(acc, axis=0)
        ptrs = y_ptr + pid_m * stride_ym + offs_n
        if ATOMIC:
            tl.atomic_add(ptrs, out, mask=n_mask)
        else:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=n_mask)
    elif MODE == 1:
        ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask)
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=mask)
        else:
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_kernel(
    qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, w_ptr,
    N, K, group_size,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACT_ORDER: tl.constexpr, F32: tl.constexpr,
):
    """W^T [K, N] (w_ptr's dtype, row-major) from the packed tensors, in one pass: for the large-M path
    that hands the product to cuBLAS. The dense weight lives only for the duration of one call."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (offs_n < N)[None, :]
    qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
    zshift = ((offs_n % 8) * 4)[None, :]
    for j in tl.static_range(8):
        k = rows * 8 + j
        if ACT_ORDER:
            g = tl.load(g_idx_ptr + k, mask=rows < K // 8, other=0)
        else:
            g = k // group_size
        s = _scale(tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0), F32)
        zw = tl.load(qzeros_ptr + g[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask, other=0)
        w = (_biased(qw, 4 * j, F32) - _biased(zw, zshift, F32)) * s
        tl.store(w_ptr + k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)
