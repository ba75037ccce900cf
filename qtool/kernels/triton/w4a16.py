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
  MODE 2  swapped (W^T x^T): the weight is the first operand of the dot (the M <= 64 buckets).
  (mode 3, the M = 1 GEMV with the dequantization in PTX, is the second kernel below; mode 4, the same PTX
  dequantization feeding tl.dot in natural K order, the third.)
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


# ---------------------------------------------------------------------------------------------------------
# M = 1: the GEMV kernel. At one row the weight is read once and every weight is used once, so the kernel is
# a race between HBM and the instruction issue rate: on an H200, 4.8 TB/s of 4-bit weights is ~9.6e12
# weights/s against ~3.4e13 lane-instructions/s, a budget of ~3.5 instructions per weight for everything.
# The generic path spends ~8 (field extraction, 16-bit packing, fp16->fp32 conversion, one FMA each), so
# here one int32 word (8 weights of one column) goes through one PTX block of ~22 instructions:
#   lop3 (q & 0x000F000F) | 0x64006400 turns nibbles j and j+4 into the fp16 pair (1024+q_j, 1024+q_j+4),
#   sub.f16x2 (1024+z, 1024+z) makes them exact (q - z), mul.f16x2 by the scale pair rounds once (the
#   fp16 weight torch would hold), fma.f16x2 against the activation pair (x_j, x_j+4) sums 4 products per
#   half, and the two halves are added in fp32.
# Products are summed in 16-bit only within a word (4 terms per half); everything else accumulates in fp32.
# bf16 uses the same sequence with the bf16 bias 128 (0x4300) and fma.rn.bf16x2 for sub/mul (sm_80).
# The interpreter cannot run PTX, so USE_ASM=False computes the same quantities with Triton ops.
# ---------------------------------------------------------------------------------------------------------

_GEMV_ASM_F16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, u, a;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
lop3.b32 t0, $1, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 4;
lop3.b32 t1, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 8;
lop3.b32 t2, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 12;
lop3.b32 t3, u, 0x000f000f, 0x64006400, 0xea;
sub.f16x2 t0, t0, $6;
sub.f16x2 t1, t1, $6;
sub.f16x2 t2, t2, $6;
sub.f16x2 t3, t3, $6;
mul.f16x2 t0, t0, $7;
mul.f16x2 t1, t1, $7;
mul.f16x2 t2, t2, $7;
mul.f16x2 t3, t3, $7;
mul.f16x2 a, t0, $2;
fma.rn.f16x2 a, t1, $3, a;
fma.rn.f16x2 a, t2, $4, a;
fma.rn.f16x2 a, t3, $5, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")

# $6 holds -(128 + z) in both halves here (a negated bias: sub via fma), $7 the bf16 scale pair.
_GEMV_ASM_BF16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, u, a, one, nz, flo, fhi;
mov.b32 one, 0x3f803f80;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $1, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 4;
lop3.b32 t1, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 8;
lop3.b32 t2, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 12;
lop3.b32 t3, u, 0x000f000f, 0x43004300, 0xea;
fma.rn.bf16x2 t0, t0, one, $6;
fma.rn.bf16x2 t1, t1, one, $6;
fma.rn.bf16x2 t2, t2, one, $6;
fma.rn.bf16x2 t3, t3, one, $6;
fma.rn.bf16x2 t0, t0, $7, nz;
fma.rn.bf16x2 t1, t1, $7, nz;
fma.rn.bf16x2 t2, t2, $7, nz;
fma.rn.bf16x2 t3, t3, $7, nz;
fma.rn.bf16x2 a, t0, $2, nz;
fma.rn.bf16x2 a, t1, $3, a;
fma.rn.bf16x2 a, t2, $4, a;
fma.rn.bf16x2 a, t3, $5, a;
shl.b32 flo, a, 16;
and.b32 fhi, a, 0xffff0000;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _bits_to_f32(b, BF16: tl.constexpr):
    """int32 holding a 16-bit float's bits in its low half -> fp32 value (exact)."""
    if BF16:
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_operands(x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k0, k_end, N, group_size, stride_xm,
                   offs_r, offs_n, n_mask, zshift, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                   BF16: tl.constexpr, EVEN: tl.constexpr):
    """Everything block k0 needs: words [R, BN], activation pairs (x_j | x_j+4 << 16) [R] for j < 4, and the
    zero / scale pairs ([BN] when the block is in one group, else [R, BN]); all int32 bit patterns.

    EVEN (N % BLOCK_N == 0 and every split a whole number of blocks): no masks at all; a block past the
    split's end (the last prefetch) is clamped onto the last block, a re-read that hits L2, instead of
    predicating every load (masked loads cost a zeroing move and a compare per register).
    """
    if EVEN:
        k0 = tl.minimum(k0, k_end - BLOCK_K)
    rows = k0 // 8 + offs_r
    r_mask = rows < k_end // 8
    w_mask = r_mask[:, None] & n_mask[None, :]
    xrow = x_ptr + pid_m * stride_xm + k0 // 2 + 4 * offs_r
    if EVEN:
        qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :], eviction_policy="evict_first")
        xw0 = tl.load(xrow + 0)
        xw1 = tl.load(xrow + 1)
        xw2 = tl.load(xrow + 2)
        xw3 = tl.load(xrow + 3)
    else:
        qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :], mask=w_mask, other=0,
                     eviction_policy="evict_first")
        # x as int32 words (two 16-bit activations each): 4 loads per word row, regrouped to (x_j, x_j+4)
        xw0 = tl.load(xrow + 0, mask=r_mask, other=0)
        xw1 = tl.load(xrow + 1, mask=r_mask, other=0)
        xw2 = tl.load(xrow + 2, mask=r_mask, other=0)
        xw3 = tl.load(xrow + 3, mask=r_mask, other=0)
    xp0 = (xw0 & 0xFFFF) | (xw2 << 16)
    xp1 = ((xw0 >> 16) & 0xFFFF) | (xw2 & -65536)
    xp2 = (xw1 & 0xFFFF) | (xw3 << 16)
    xp3 = ((xw1 >> 16) & 0xFFFF) | (xw3 & -65536)
    n_words = N // 8
    if GROUPS == 0:
        g = k0 // group_size
        if EVEN:
            zw = tl.load(qzeros_ptr + g * n_words + offs_n // 8)
            sb = tl.load(sbits_ptr + g * N + offs_n).to(tl.int32) & 0xFFFF
        else:
            live = n_mask & ((offs_n * 0 + k0) < k_end)
            zw = tl.load(qzeros_ptr + g * n_words + offs_n // 8, mask=live, other=0)
            sb = tl.load(sbits_ptr + g * N + offs_n, mask=live, other=0).to(tl.int32) & 0xFFFF
        z = (zw >> zshift) & 0xF
    else:
        g = (k0 + 8 * offs_r) // group_size
        if EVEN:
            zw = tl.load(qzeros_ptr + g[:, None] * n_words + (offs_n // 8)[None, :])
            sb = tl.load(sbits_ptr + g[:, None] * N + offs_n[None, :]).to(tl.int32) & 0xFFFF
        else:
            zw = tl.load(qzeros_ptr + g[:, None] * n_words + (offs_n // 8)[None, :], mask=w_mask, other=0)
            sb = tl.load(sbits_ptr + g[:, None] * N + offs_n[None, :], mask=w_mask, other=0).to(tl.int32) & 0xFFFF
        z = (zw >> zshift[None, :]) & 0xF
    if BF16:
        zb = (z | 0x4300) | 0x8000  # -(128 + z): the bf16 asm subtracts by fma with +1
    else:
        zb = z | 0x6400
    zz = zb | (zb << 16)
    ss = sb | (sb << 16)
    return qw, xp0, xp1, xp2, xp3, zz, ss


@triton.jit
def _gemv_words(qw, xp0, xp1, xp2, xp3, zz, ss, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """fp32 [R, BN]: for each word, scale * sum over its 8 rows of x * (q - z) (see the block comment)."""
    if USE_ASM:
        if BF16:
            part = tl.inline_asm_elementwise(_GEMV_ASM_BF16, "=r,r,r,r,r,r,r,r",
                                             [qw, xp0[:, None], xp1[:, None], xp2[:, None], xp3[:, None], zz, ss],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            part = tl.inline_asm_elementwise(_GEMV_ASM_F16, "=r,r,r,r,r,r,r,r",
                                             [qw, xp0[:, None], xp1[:, None], xp2[:, None], xp3[:, None], zz, ss],
                                             dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = _bits_to_f32(ss & 0xFFFF, BF16)
        if BF16:
            z = ((zz & 0xFFFF) ^ 0x8000) - 0x4300
        else:
            z = (zz & 0xFFFF) - 0x6400
        zf = (z | 0x4B000000).to(tl.float32, bitcast=True)
        part = tl.zeros(qw.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            if j < 4:
                xb = (xp0 if j == 0 else (xp1 if j == 1 else (xp2 if j == 2 else xp3))) & 0xFFFF
            else:
                xb = ((xp0 if j == 4 else (xp1 if j == 5 else (xp2 if j == 6 else xp3))) >> 16) & 0xFFFF
            qf = (((qw >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            w = (qf - zf) * s
            if BF16:
                w = w.to(tl.bfloat16).to(tl.float32)
            else:
                w = w.to(tl.float16).to(tl.float32)
            part += _bits_to_f32(xb, BF16)[:, None] * w
    return part


# PAIR: two words of one column from the same group (rows r and r + R/2 of the block) share one 16-bit
# accumulator pair (8 products per half instead of 4), halving the conversions and fp32 adds per weight.
_GEMV2_ASM_F16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, t4, t5, t6, t7, u, a;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
lop3.b32 t0, $1, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 4;
lop3.b32 t1, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 8;
lop3.b32 t2, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $1, 12;
lop3.b32 t3, u, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t4, $2, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 4;
lop3.b32 t5, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 8;
lop3.b32 t6, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $2, 12;
lop3.b32 t7, u, 0x000f000f, 0x64006400, 0xea;
sub.f16x2 t0, t0, $11;
sub.f16x2 t1, t1, $11;
sub.f16x2 t2, t2, $11;
sub.f16x2 t3, t3, $11;
sub.f16x2 t4, t4, $11;
sub.f16x2 t5, t5, $11;
sub.f16x2 t6, t6, $11;
sub.f16x2 t7, t7, $11;
mul.f16x2 t0, t0, $12;
mul.f16x2 t1, t1, $12;
mul.f16x2 t2, t2, $12;
mul.f16x2 t3, t3, $12;
mul.f16x2 t4, t4, $12;
mul.f16x2 t5, t5, $12;
mul.f16x2 t6, t6, $12;
mul.f16x2 t7, t7, $12;
mul.f16x2 a, t0, $3;
fma.rn.f16x2 a, t1, $4, a;
fma.rn.f16x2 a, t2, $5, a;
fma.rn.f16x2 a, t3, $6, a;
fma.rn.f16x2 a, t4, $7, a;
fma.rn.f16x2 a, t5, $8, a;
fma.rn.f16x2 a, t6, $9, a;
fma.rn.f16x2 a, t7, $10, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")

_GEMV2_ASM_BF16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, t4, t5, t6, t7, u, a, one, nz, flo, fhi;
mov.b32 one, 0x3f803f80;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $1, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 4;
lop3.b32 t1, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 8;
lop3.b32 t2, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $1, 12;
lop3.b32 t3, u, 0x000f000f, 0x43004300, 0xea;
lop3.b32 t4, $2, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $2, 4;
lop3.b32 t5, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $2, 8;
lop3.b32 t6, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $2, 12;
lop3.b32 t7, u, 0x000f000f, 0x43004300, 0xea;
fma.rn.bf16x2 t0, t0, one, $11;
fma.rn.bf16x2 t1, t1, one, $11;
fma.rn.bf16x2 t2, t2, one, $11;
fma.rn.bf16x2 t3, t3, one, $11;
fma.rn.bf16x2 t4, t4, one, $11;
fma.rn.bf16x2 t5, t5, one, $11;
fma.rn.bf16x2 t6, t6, one, $11;
fma.rn.bf16x2 t7, t7, one, $11;
fma.rn.bf16x2 t0, t0, $12, nz;
fma.rn.bf16x2 t1, t1, $12, nz;
fma.rn.bf16x2 t2, t2, $12, nz;
fma.rn.bf16x2 t3, t3, $12, nz;
fma.rn.bf16x2 t4, t4, $12, nz;
fma.rn.bf16x2 t5, t5, $12, nz;
fma.rn.bf16x2 t6, t6, $12, nz;
fma.rn.bf16x2 t7, t7, $12, nz;
fma.rn.bf16x2 a, t0, $3, nz;
fma.rn.bf16x2 a, t1, $4, a;
fma.rn.bf16x2 a, t2, $5, a;
fma.rn.bf16x2 a, t3, $6, a;
fma.rn.bf16x2 a, t4, $7, a;
fma.rn.bf16x2 a, t5, $8, a;
fma.rn.bf16x2 a, t6, $9, a;
fma.rn.bf16x2 a, t7, $10, a;
shl.b32 flo, a, 16;
and.b32 fhi, a, 0xffff0000;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _gemv_words2(qa, a0, a1, a2, a3, qb, b0, b1, b2, b3, zz, ss, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """As _gemv_words for two words per output element (block halves A and B, one zero/scale)."""
    if USE_ASM:
        args = [qa, qb, a0[:, None], a1[:, None], a2[:, None], a3[:, None], b0[:, None], b1[:, None],
                b2[:, None], b3[:, None], zz, ss]
        if BF16:
            part = tl.inline_asm_elementwise(_GEMV2_ASM_BF16, "=r" + ",r" * 12, args, dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            part = tl.inline_asm_elementwise(_GEMV2_ASM_F16, "=r" + ",r" * 12, args, dtype=tl.float32,
                                             is_pure=True, pack=1)
    else:
        part = _gemv_words(qa, a0, a1, a2, a3, zz, ss, BF16, False) + \
            _gemv_words(qb, b0, b1, b2, b3, zz, ss, BF16, False)
    return part


@triton.jit(do_not_specialize=["M"])
def w4a16_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, y_ptr, ws_ptr, sem_ptr,
    M, N, K, group_size, stride_xm, stride_ym, k_per_split, n_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr,
    BF16: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr, PAIR: tl.constexpr,
):
    """y[m, :] for one row m per program (grid: M, N / BLOCK_N, n_split), K loop double-buffered by hand
    (the next block's loads are issued before the current block's arithmetic).

    x_ptr: int32 view of x [M, K] (pairs of activations; stride_xm in int32 words); sbits_ptr: int16 view of
    the scales [n_groups, N] in x's dtype.
    Split-K (SPLIT): each program writes its fp32 partial to ws [n_split, M, N]; the last program of a tile
    to arrive (counted with an acq_rel atomic on sem [M * cdiv(N, BLOCK_N)], int32, zero between calls)
    sums the partials, writes y and resets the counter: one launch, no memset, no second kernel.
    """
    R: tl.constexpr = BLOCK_K // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    zshift = (offs_n % 8) * 4
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    if PAIR:  # needs GROUPS == 0: both halves of a block in one group
        H: tl.constexpr = BLOCK_K // 2
        offs_h = tl.arange(0, R // 2)
        acc = tl.zeros((R // 2, BLOCK_N), dtype=tl.float32)
        qa, a0, a1, a2, a3, zz, ss = _gemv_operands(
            x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k_start, k_end, N, group_size, stride_xm, offs_h,
            offs_n, n_mask, zshift, H, GROUPS, BF16, EVEN)
        qb, b0, b1, b2, b3, _z, _s = _gemv_operands(
            x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k_start + H, k_end, N, group_size, stride_xm,
            offs_h, offs_n, n_mask, zshift, H, GROUPS, BF16, EVEN)
        for k0 in range(k_start, k_end, BLOCK_K):
            nqa, na0, na1, na2, na3, nzz, nss = _gemv_operands(
                x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k0 + BLOCK_K, k_end, N, group_size,
                stride_xm, offs_h, offs_n, n_mask, zshift, H, GROUPS, BF16, EVEN)
            nqb, nb0, nb1, nb2, nb3, _z, _s = _gemv_operands(
                x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k0 + BLOCK_K + H, k_end, N, group_size,
                stride_xm, offs_h, offs_n, n_mask, zshift, H, GROUPS, BF16, EVEN)
            acc += _gemv_words2(qa, a0, a1, a2, a3, qb, b0, b1, b2, b3, zz, ss, BF16, USE_ASM)
            qa, a0, a1, a2, a3, zz, ss = nqa, na0, na1, na2, na3, nzz, nss
            qb, b0, b1, b2, b3 = nqb, nb0, nb1, nb2, nb3
    else:
        offs_r = tl.arange(0, R)
        acc = tl.zeros((R, BLOCK_N), dtype=tl.float32)
        qw, xp0, xp1, xp2, xp3, zz, ss = _gemv_operands(
            x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k_start, k_end, N, group_size, stride_xm, offs_r,
            offs_n, n_mask, zshift, BLOCK_K, GROUPS, BF16, EVEN)
        for k0 in range(k_start, k_end, BLOCK_K):
            nqw, nxp0, nxp1, nxp2, nxp3, nzz, nss = _gemv_operands(
                x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, pid_m, k0 + BLOCK_K, k_end, N, group_size, stride_xm,
                offs_r, offs_n, n_mask, zshift, BLOCK_K, GROUPS, BF16, EVEN)
            acc += _gemv_words(qw, xp0, xp1, xp2, xp3, zz, ss, BF16, USE_ASM)
            qw, xp0, xp1, xp2, xp3, zz, ss = nqw, nxp0, nxp1, nxp2, nxp3, nzz, nss
    out = tl.sum(acc, axis=0)

    y_ptrs = y_ptr + pid_m * stride_ym + offs_n
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + pid_m) * N + offs_n, out, mask=n_mask)
        tl.debug_barrier()  # every thread's partial is issued before the counter moves
        tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
        arrived = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(0, n_split):
                total += tl.load(ws_ptr + (s * M + pid_m) * N + offs_n, mask=n_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(sem_ptr + tile, 0)
    else:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_mask)


# ---------------------------------------------------------------------------------------------------------
# MODE 4: the tensor-core kernel for M >= 2 with the M = 1 kernel's per-word dequantization.
# One PTX block per int32 word turns its 8 codes into 8 16-bit weights (lop3 nibble pairs, sub and mul in
# f16x2 / bf16x2: 15 instructions for 8 weights, against ~8 per weight in Triton ops), and the eight
# [BLOCK_N, BLOCK_K/8] results are interleaved with tl.join + reshape into the natural K order of one
# [BLOCK_N, BLOCK_K] tile (a register renaming, no data movement), so each K block is one dot of depth
# BLOCK_K instead of eight dots of depth BLOCK_K/8. SWAP puts the weight first (W^T x^T: on Hopper a
# wgmma with the weight as the register operand and a 16-wide N for small M); otherwise x @ W.
# Split-K as in the GEMV: fp32 partials in a workspace, the last program of a tile sums them.
# ---------------------------------------------------------------------------------------------------------

_MMA_ASM_F16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, u;
lop3.b32 t0, $8, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, 0x64006400, 0xea;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000f000f, 0x64006400, 0xea;
sub.f16x2 t0, t0, $9;
sub.f16x2 t1, t1, $9;
sub.f16x2 t2, t2, $9;
sub.f16x2 t3, t3, $9;
mul.f16x2 t0, t0, $10;
mul.f16x2 t1, t1, $10;
mul.f16x2 t2, t2, $10;
mul.f16x2 t3, t3, $10;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}""")

# $9 holds -(128 + z) in both halves (subtract by fma with +1), $10 the bf16 scale pair.
_MMA_ASM_BF16 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, u, one, nz;
mov.b32 one, 0x3f803f80;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000f000f, 0x43004300, 0xea;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000f000f, 0x43004300, 0xea;
fma.rn.bf16x2 t0, t0, one, $9;
fma.rn.bf16x2 t1, t1, one, $9;
fma.rn.bf16x2 t2, t2, one, $9;
fma.rn.bf16x2 t3, t3, one, $9;
fma.rn.bf16x2 t0, t0, $10, nz;
fma.rn.bf16x2 t1, t1, $10, nz;
fma.rn.bf16x2 t2, t2, $10, nz;
fma.rn.bf16x2 t3, t3, $10, nz;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}""")


@triton.jit
def _unpack_words(qw, zz, ss, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """[BN, R] int32 words (+ zero / scale pairs, broadcastable) -> [BN, 8R] weights of x's dtype, column
    8r + j holding nibble j of word r (the natural K order)."""
    if BF16:
        CT: tl.constexpr = tl.bfloat16
    else:
        CT: tl.constexpr = tl.float16
    if USE_ASM:
        if BF16:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _MMA_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [qw, zz, ss],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                       tl.bfloat16), is_pure=True,
                pack=1)
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _MMA_ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [qw, zz, ss],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16), is_pure=True,
                pack=1)
    else:
        s = _bits_to_f32(ss & 0xFFFF, BF16)
        if BF16:
            z = ((zz & 0xFFFF) ^ 0x8000) - 0x4300
        else:
            z = (zz & 0xFFFF) - 0x6400
        zf = (z | 0x4B000000).to(tl.float32, bitcast=True)
        w0 = ((((qw >> 0) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w1 = ((((qw >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w2 = ((((qw >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w3 = ((((qw >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w4 = ((((qw >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w5 = ((((qw >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w6 = ((((qw >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w7 = ((((qw >> 28) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf) * s
        w0, w1, w2, w3 = w0.to(CT), w1.to(CT), w2.to(CT), w3.to(CT)
        w4, w5, w6, w7 = w4.to(CT), w5.to(CT), w6.to(CT), w7.to(CT)
    # join appends a minor dimension: the innermost pairs j with j + 4, then j + 2, then j + 1, so the
    # flattened index is 8r + 4a + 2b + c = 8r + j.
    a = tl.join(tl.join(w0, w4), tl.join(w2, w6))
    b = tl.join(tl.join(w1, w5), tl.join(w3, w7))
    w = tl.join(a, b)
    return tl.reshape(w, (qw.shape[0], 8 * qw.shape[1]))


@triton.jit(do_not_specialize=["M"])
def w4a16_mma_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, sbits_ptr, y_ptr, ws_ptr, sem_ptr,
    M, N, K, group_size, stride_xm, stride_ym, k_per_split, n_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    GROUPS: tl.constexpr, SPLIT: tl.constexpr, BF16: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr,
):
    """y [M, N] = x [M, K] @ W^T (grid: cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), n_split).

    x_ptr: x [M, K] (fp16/bf16, unit column stride); sbits_ptr: int16 view of the scales [n_groups, N] in
    x's dtype; GROUPS 0 (a K block in one group) or 1 (group_size % 8 == 0; one zero/scale per word row).
    ws / sem: the split-K workspace as in w4a16_gemv_kernel (sem: int32 [tiles], zero between calls).
    EVEN: N % BLOCK_N == 0 and every split whole blocks: no masks on the weight loads.
    """
    R: tl.constexpr = BLOCK_K // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    zshift = (offs_n % 8) * 4
    n_words = N // 8
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_r
        w_mask = n_mask[:, None] & (rows < k_end // 8)[None, :]
        if EVEN:
            qw = tl.load(qweight_ptr + rows[None, :] * N + offs_n[:, None], eviction_policy="evict_first")
        else:
            qw = tl.load(qweight_ptr + rows[None, :] * N + offs_n[:, None], mask=w_mask, other=0,
                         eviction_policy="evict_first")
        if GROUPS == 0:
            g = k0 // group_size
            zw = tl.load(qzeros_ptr + g * n_words + offs_n // 8, mask=n_mask, other=0)
            sb = tl.load(sbits_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.int32) & 0xFFFF
            z = ((zw >> zshift) & 0xF)[:, None]
            sb = sb[:, None]
        else:
            g = (k0 + 8 * offs_r) // group_size
            zw = tl.load(qzeros_ptr + g[None, :] * n_words + (offs_n // 8)[:, None], mask=w_mask, other=0)
            sb = tl.load(sbits_ptr + g[None, :] * N + offs_n[:, None], mask=w_mask, other=0).to(tl.int32) & 0xFFFF
            z = (zw >> zshift[:, None]) & 0xF
        if BF16:
            zb = (z | 0x4300) | 0x8000
        else:
            zb = z | 0x6400
        w = _unpack_words(qw, zb | (zb << 16), sb | (sb << 16), BF16, USE_ASM)  # [BN, BK]
        kk = k0 + offs_k
        if EVEN:
            k_mask = kk < K + 0 * kk  # always true; keeps the mask a tensor for the m rows
        else:
            k_mask = kk < k_end
        if SWAP:
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=k_mask[:, None] & m_mask[None, :],
                         other=0.0)
            acc = tl.dot(w, xt, acc)
        else:
            xb = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc = tl.dot(xb, tl.trans(w), acc)

    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the counter moves
        tile = pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, n_split):
                total += tl.load(ws_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :], mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(sem_ptr + tile, 0)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_words_kernel(
    qweight_ptr, qzeros_ptr, sbits_ptr, w_ptr, N, K, group_size,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, USE_ASM: tl.constexpr,
):
    """W^T [K, N] (x's dtype, row-major) for the dequantize + cuBLAS path, with mode 4's per-word PTX
    dequantization (one zero/scale per word row: group_size % 8 == 0, no act-order)."""
    R: tl.constexpr = BLOCK_K // 8
    rows = tl.program_id(0) * R + tl.arange(0, R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (rows < K // 8)[None, :]
    qw = tl.load(qweight_ptr + rows[None, :] * N + offs_n[:, None], mask=mask, other=0)
    g = (rows * 8) // group_size
    zw = tl.load(qzeros_ptr + g[None, :] * (N // 8) + (offs_n // 8)[:, None], mask=mask, other=0)
    sb = tl.load(sbits_ptr + g[None, :] * N + offs_n[:, None], mask=mask, other=0).to(tl.int32) & 0xFFFF
    z = (zw >> ((offs_n % 8) * 4)[:, None]) & 0xF
    if BF16:
        zb = (z | 0x4300) | 0x8000
    else:
        zb = z | 0x6400
    w = _unpack_words(qw, zb | (zb << 16), sb | (sb << 16), BF16, USE_ASM)  # [BN, BK]
    kk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    wt = tl.trans(w)
    tl.store(w_ptr + kk[:, None] * N + offs_n[None, :], wt, mask=(kk < K)[:, None] & n_mask[None, :])
