"""Slow, obvious decoders written straight from the layout facts in FORMATS.md, sharing no code with qtool.

They work on numpy arrays of Python ints, bit by bit, so a shared bug with the vectorised packers is unlikely.
"""

from __future__ import annotations

import numpy as np


def _u32(words: np.ndarray) -> np.ndarray:
    return words.astype(np.int64) & 0xFFFFFFFF


def stream_decode(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """int32 words [W, ...] -> codes [n, ...] along axis 0: code j occupies stream bits [j*bits, (j+1)*bits),
    little-endian. Bit by bit (vectorised only across the other axes)."""
    w = _u32(words)
    out = np.zeros((n,) + w.shape[1:], dtype=np.int64)
    for j in range(n):
        for k in range(bits):
            pos = j * bits + k
            out[j] |= ((w[pos // 32] >> (pos % 32)) & 1) << k
    return out


def planar_decode(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Planar, along axis 0: per run of 32 codes, planes low first; a plane of width p has p words, word k
    holding codes [k*32/p, (k+1)*32/p) at shifts p*j."""
    planes = {2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1), 8: (8,)}[bits]
    w = _u32(words)
    out = np.zeros((n,) + w.shape[1:], dtype=np.int64)
    for run in range(n // 32):
        base, shift = run * bits, 0
        for p in planes:
            per = 32 // p
            for c in range(32):
                word = w[base + c // per]
                out[run * 32 + c] |= ((word >> (p * (c % per))) & ((1 << p) - 1)) << shift
            base += p
            shift += p
    return out


def gptq_weight(qweight, qzeros, scales, g_idx, bits, planar=False, v1=False) -> np.ndarray:
    """Dense W [O, I] (float64) from GPTQ tensors: qweight [I*b/32, O] along rows, qzeros [G, O*b/32] along
    columns, v1 stores z - 1 (GPTQModel whole-word convention for 2/4/8-bit)."""
    dec = planar_decode if planar else stream_decode
    qweight, qzeros = np.asarray(qweight), np.asarray(qzeros)
    scales = np.asarray(scales, dtype=np.float64)
    g_idx = np.asarray(g_idx, dtype=np.int64)
    i_feat, o_feat = len(g_idx), scales.shape[1]
    q = dec(qweight, bits, i_feat).T  # [O, I]
    if v1 and 32 % bits == 0:
        pf = 32 // bits
        const = sum(1 << (bits * k) for k in range(pf))
        qzeros = ((qzeros.astype(np.int64) & 0xFFFFFFFF) + const) & 0xFFFFFFFF
    z = dec(qzeros.T, bits, o_feat).T  # [G, O]
    if v1 and 32 % bits:
        z = (z + 1) & ((1 << bits) - 1)
    return (q - z[g_idx].T) * scales[g_idx].T


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_unpack_cols(words: np.ndarray) -> np.ndarray:
    """[R, O/8] int32 -> [R, O]: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    w = _u32(words)
    r, c = w.shape
    out = np.zeros((r, c * 8), dtype=np.int64)
    for i in range(8):
        out[:, np.arange(c) * 8 + AWQ_ORDER[i]] = (w >> (4 * i)) & 15
    return out


def awq_weight(qweight, qzeros, scales, group_size) -> np.ndarray:
    q = awq_unpack_cols(np.asarray(qweight))  # [I, O]
    z = awq_unpack_cols(np.asarray(qzeros))  # [G, O]
    s = np.asarray(scales, dtype=np.float64)
    g = np.arange(q.shape[0]) // group_size
    return ((q - z[g]) * s[g]).T
