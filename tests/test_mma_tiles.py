"""The mma tile layout (qtool/packing/mma_tiles.py) and the arithmetic the csrc/*.cuh kernels do on it, on the CPU.

The kernel cannot run here; what can be checked is everything it relies on:
- the layout round-trips and places each code where the PTX A-fragment layout says a lane holds it
  (an independent table below, written from the PTX ISA's m16n8k16 / wgmma m64nNk16 A-fragment figure);
- the LOP3 + FMA dequantization gives exactly q - z for every q, z in fp16 and bf16 (bit-level emulation);
- a lane-by-lane emulation of the kernel's decode over a whole layer reproduces the dequantized weight;
- the stream-K kernel's biased fragments carry each code exactly, and its per-unit correction by
  (bias + z) * sum(x) reproduces the layer product;
- the x-in-registers kernel's x transpose gives its lanes their B fragments, and its work split (K groups,
  warps' blocks, records, the order of the sums) reproduces the layer product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.bench.layers import random_plain
from qtool.kernels.base import PackedLayer, dequantize_packed, unpack_gptq
from qtool.kernels.cuda import build
from qtool.packing import mma_tiles


def fragment_coords(g: int, t: int) -> list[tuple[int, int]]:
    """PTX A fragment of lane 4g + t in a 16 x 16 tile: elements a0..a7 as (row, k).
    a0,a1: (g, 2t), (g, 2t+1); a2,a3: (g+8, 2t), (g+8, 2t+1); a4,a5: (g, 2t+8), (g, 2t+9); a6,a7: (g+8, ...)."""
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
            (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]


# which nibble of the word the kernel's extraction turns into fragment element i (see dequant in csrc/common.cuh):
# register a_r = (low half, high half); fp16: a0 <- nibbles 0/4, a1 <- 1/5, a2 <- 2/6 (word >> 8), a3 <- 3/7
NIBBLE_OF_ELEMENT = [0, 4, 1, 5, 2, 6, 3, 7]


def test_hand_built_tile_words():
    # one 16 x 64 tile, code(k, n) = (n + 3k) % 16: lane (g=2, t=1), step 1 decoded by hand
    k, n = 64, 16
    kk, nn = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
    codes = ((nn + 3 * kk) % 16).to(torch.uint8)
    qw = mma_tiles.tile_codes(codes)
    assert qw.shape == (1, 1, 32, 4)
    word = int(qw[0, 0, 4 * 2 + 1, 1]) & 0xFFFFFFFF
    # step 1 -> k0 = 16; lane g=2, t=1: rows 2 and 10, k 18, 19, 26, 27
    want = {0: (2, 18), 4: (2, 19), 1: (10, 18), 5: (10, 19), 2: (2, 26), 6: (2, 27), 3: (10, 26), 7: (10, 27)}
    for nib, (row, kx) in want.items():
        assert (word >> (4 * nib)) & 15 == (row + 3 * kx) % 16, nib


def test_golden_words():
    # codes 0..15 cycling along K, rows offset by their index: the first lane's four words, fixed bytes
    k, n = 64, 16
    kk, nn = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
    codes = ((kk + nn) % 16).to(torch.uint8)
    qw = mma_tiles.tile_codes(codes)
    got = [int(v) & 0xFFFFFFFF for v in qw[0, 0, 0]]
    # lane 0 (g=0, t=0), step s: nibbles (row, k) = (0,16s) (8,16s) (0,16s+8) (8,16s+8) (0,16s+1) ...
    want = []
    for s in range(4):
        k0 = 16 * s
        vals = [(0, k0), (8, k0), (0, k0 + 8), (8, k0 + 8), (0, k0 + 1), (8, k0 + 1), (0, k0 + 9), (8, k0 + 9)]
        want.append(sum(((r + kx) % 16) << (4 * j) for j, (r, kx) in enumerate(vals)))
    assert got == want == [0x19910880] * 4  # nibbles 0, 8, 8, 0, 1, 9, 9, 1, low first


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 40).map(lambda v: 8 * v), n=st.integers(1, 70), seed=st.integers(0, 1 << 16))
def test_tile_round_trip_and_fragment_placement(k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    qw = mma_tiles.tile_codes(codes)
    n16, kb = mma_tiles.padded(n, k)
    assert qw.shape == (n16, kb, 32, 4) and qw.dtype == torch.int32
    assert torch.equal(mma_tiles.untile_codes(qw, k, n), codes)
    # independent placement check: every (tile, block, lane, step) word against the fragment table
    full = torch.zeros(kb * 64, n16 * 16, dtype=torch.int64)
    full[:k, :n] = codes.to(torch.int64)
    words = qw.to(torch.int64) & 0xFFFFFFFF
    for tn in range(n16):
        for b in range(kb):
            for lane in (0, 5, 31):
                g, t = divmod(lane, 4)
                for s in range(4):
                    w = int(words[tn, b, lane, s])
                    for e, (r, kx) in enumerate(fragment_coords(g, t)):
                        nib = NIBBLE_OF_ELEMENT[e]
                        assert (w >> (4 * nib)) & 15 == full[64 * b + 16 * s + kx, 16 * tn + r]


def _lop3_and_or(a, b, c):
    return (a & b) | c


def _fma_f16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma.rn.f16x2 on uint32 pairs: exact a*b+c (float64 holds it for these magnitudes), rounded once."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype=np.uint32) for v in (a, b, c)))

    def halves(v):
        return np.stack([(v & 0xFFFF).astype(np.uint16), (v >> 16).astype(np.uint16)]).view(np.float16)
    r = (halves(a).astype(np.float64) * halves(b).astype(np.float64) + halves(c).astype(np.float64))
    h = r.astype(np.float16).view(np.uint16).astype(np.uint32)
    return h[0] | (h[1] << 16)


def _fma_bf16(a, b, c):
    a, b, c = (np.ascontiguousarray(v) for v in
               np.broadcast_arrays(*(np.asarray(v, dtype=np.uint32) for v in (a, b, c))))

    def halves(v):
        lo = torch.from_numpy(((v & 0xFFFF) << 16).astype(np.uint32).view(np.int32)).view(torch.float32)
        hi = torch.from_numpy((v & 0xFFFF0000).astype(np.uint32).view(np.int32)).view(torch.float32)
        return lo.double(), hi.double()
    (al, ah), (bl, bh), (cl, ch) = halves(a), halves(b), halves(c)

    def rnd(v):  # round to bf16 bits
        return torch.from_numpy(v.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32))
    lo, hi = rnd(al * bl + cl).numpy(), rnd(ah * bh + ch).numpy()
    return lo | (hi << 16)


def emulate_dequant(w: np.ndarray, z0: np.ndarray, z1: np.ndarray, bf16: bool) -> list[np.ndarray]:
    """The kernel's dequant(w, row_const(z0, z1)) without the scale: four uint32 16-bit pairs per word."""
    w = w.astype(np.uint32)
    if bf16:
        nz0, nz1 = (0xC300 + z0) * 0x10001, (0xC300 + z1) * 0x10001
        one, magic = np.uint32(0x3F803F80), np.uint32(0x43004300)
        m = np.uint32(0x000F000F)
        return [_fma_bf16(_lop3_and_or(w >> sh, m, magic), one, nz) for sh, nz in
                ((0, nz0), (4, nz1), (8, nz0), (12, nz1))]
    nz0, nz1 = (0xE400 + z0) * 0x10001, (0xD400 + 16 * z1) * 0x10001
    one, sixteenth, magic = np.uint32(0x3C003C00), np.uint32(0x2C002C00), np.uint32(0x64006400)
    lo, hi = np.uint32(0x000F000F), np.uint32(0x00F000F0)
    w8 = w >> 8
    return [_fma_f16(_lop3_and_or(w, lo, magic), one, nz0), _fma_f16(_lop3_and_or(w, hi, magic), sixteenth, nz1),
            _fma_f16(_lop3_and_or(w8, lo, magic), one, nz0), _fma_f16(_lop3_and_or(w8, hi, magic), sixteenth, nz1)]


def _pair_values(regs: list[np.ndarray], bf16: bool) -> np.ndarray:
    """uint32 pairs -> float64 elements a0..a7 (low half first)."""
    out = []
    for r in regs:
        for h in (r & 0xFFFF, r >> 16):
            if bf16:
                out.append(torch.from_numpy((h.astype(np.uint32) << 16).view(np.int32)).view(torch.float32).double()
                           .numpy())
            else:
                out.append(h.astype(np.uint16).view(np.float16).astype(np.float64))
    return np.stack(out)


@pytest.mark.parametrize("bf16", [False, True])
def test_dequant_bit_trick_is_exact_for_every_code_and_zero(bf16):
    # every word whose 8 nibbles are one code q, against every zero z (row g) and z' (row g + 8)
    q = np.arange(16, dtype=np.uint32)
    words = q * np.uint32(0x11111111)
    qq, zz = np.meshgrid(q, q, indexing="ij")
    w = words[qq.ravel()]
    z = zz.ravel().astype(np.uint32)
    vals = _pair_values(emulate_dequant(w, z, z, bf16), bf16)
    assert np.array_equal(vals, np.broadcast_to(qq.ravel().astype(np.float64) - z, vals.shape))


def tiled_layer(n: int, k: int, group_size: int, bf16: bool, seed: int):
    """A random GPTQ layer and its tile-layout tensors: (layer, qweight, zeros, scales)."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    layer = PackedLayer.from_plain(random_plain(n, k, group_size=group_size, dtype=dtype, seed=seed))
    codes, zeros = unpack_gptq(layer)
    return (layer, mma_tiles.tile_codes(codes.to(torch.uint8)), mma_tiles.tile_zeros(zeros),
            mma_tiles.tile_scales(layer.scales))


@pytest.mark.parametrize("bf16", [False, True])
def test_lane_emulation_reproduces_the_dequantized_weight(bf16):
    """Decode a whole tiled layer lane by lane as the kernel does (word -> (q - z) pairs -> fragment
    positions), apply the per-row scales, and compare with the GPTQ dequantization."""
    n, k, gsz = 40, 192, 64
    layer, qw, zt, sc = tiled_layer(n, k, gsz, bf16, seed=7)
    n16, kb = mma_tiles.padded(n, k)
    w_hat = np.zeros((n16 * 16, kb * 64))
    for tn in range(n16):
        for b in range(kb):
            grp = min(64 * b // gsz, layer.n_groups - 1)  # the kernel's shift
            zp = zt[tn, grp].numpy().astype(np.uint32)  # (x, y)
            s16 = sc[tn, grp].numpy().astype(np.int64) & 0xFFFFFFFF
            for lane in range(32):
                g, t = divmod(lane, 4)
                z0 = np.array([(zp[0] >> (4 * g)) & 15], dtype=np.uint32)
                z1 = np.array([(zp[1] >> (4 * g)) & 15], dtype=np.uint32)
                pair = np.array([s16[g]], dtype=np.uint32)
                s0, s1 = _pair_values([pair], bf16)[:, 0]
                for s in range(4):
                    w = np.array([int(qw[tn, b, lane, s]) & 0xFFFFFFFF], dtype=np.uint32)
                    vals = _pair_values(emulate_dequant(w, z0, z1, bf16), bf16)[:, 0]
                    for e, (r, kx) in enumerate(fragment_coords(g, t)):
                        scale = s0 if r < 8 else s1  # the kernel scales the fp32 block sum per row
                        w_hat[16 * tn + r, 64 * b + 16 * s + kx] = vals[e] * scale
    ref = dequantize_packed(layer, torch.float64).t().numpy()  # [N, K]
    assert np.array_equal(w_hat[:n, :k], ref)
    assert not w_hat[n:].any()  # padded rows have zero codes and zero scales


def test_step_groups():
    assert mma_tiles.step_groups(160, 32, 5).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4]  # padding: last
    assert mma_tiles.step_groups(256, 128, 2).tolist() == [0] * 8 + [1] * 8
    assert mma_tiles.step_groups(1536, -1, 1).tolist() == [0] * 96
    assert mma_tiles.step_groups(256, 40, 7) is None  # a 16-k step would straddle two groups


def test_scales_and_zeros_layout():
    s = torch.arange(2 * 20, dtype=torch.float16).view(2, 20)
    t = mma_tiles.tile_scales(s)
    assert t.shape == (2, 2, 8)  # tile, group, lane group
    v = int(t[0, 1, 3]) & 0xFFFFFFFF  # tile 0, group 1, lane group g = 3: rows 3 and 11
    assert np.uint16(v & 0xFFFF).view(np.float16) == s[1, 3] and np.uint16(v >> 16).view(np.float16) == s[1, 11]
    v = int(t[1, 0, 2]) & 0xFFFFFFFF  # tile 1, group 0, g = 2: rows 18 and 26 (padding: 0)
    assert np.uint16(v & 0xFFFF).view(np.float16) == s[0, 18] and v >> 16 == 0
    assert (int(t[1, 0, 7]) & 0xFFFFFFFF) >> 16 == 0  # row 16 + 15 = 31 is padding: scale 0
    z = (torch.arange(40) % 16).view(2, 20)
    zt = mma_tiles.tile_zeros(z)
    assert zt.shape == (2, 2, 4) and not zt[..., 2:].any()  # tile, group; words 2-3: padding
    lo, hi = (int(v) & 0xFFFFFFFF for v in zt[0, 0, :2])
    assert [(lo >> (4 * r)) & 15 for r in range(8)] == list(range(8))
    assert [(hi >> (4 * r)) & 15 for r in range(8)] == list(range(8, 16))
    lo = int(zt[0, 1, 0]) & 0xFFFFFFFF  # tile 0, group 1: rows 0-7 hold (20 + r) % 16
    assert [(lo >> (4 * r)) & 15 for r in range(8)] == [(20 + r) % 16 for r in range(8)]


def emulate_biased(w: np.ndarray, bf16: bool) -> list[np.ndarray]:
    """The stream-K kernel's biased(w): four uint32 16-bit pairs per word, the bias left in."""
    w = w.astype(np.uint32)
    if bf16:
        return [_lop3_and_or(w >> sh, np.uint32(0x000F000F), np.uint32(0x43004300)) for sh in (0, 4, 8, 12)]
    lo, hi, magic = np.uint32(0x000F000F), np.uint32(0x00F000F0), np.uint32(0x64006400)
    return [_lop3_and_or(w, lo, magic), _lop3_and_or(w, hi, magic), _lop3_and_or(w >> 8, lo, magic),
            _lop3_and_or(w >> 8, hi, magic)]


@pytest.mark.parametrize("bf16", [False, True])
def test_biased_fragments_carry_the_code_exactly(bf16):
    # every code in every nibble: fp16 rows g give 1024 + q, rows g + 8 (high nibbles) 1024 + 16 q; bf16 128 + q
    q = np.arange(16, dtype=np.uint32)
    vals = _pair_values(emulate_biased(q * np.uint32(0x11111111), bf16), bf16)  # [8 elements, 16 codes]
    for e in range(8):
        row_hi = (e // 2) % 2 == 1  # elements a2, a3, a6, a7: rows g + 8
        want = 128.0 + q if bf16 else (1024.0 + 16 * q if row_hi else 1024.0 + q)
        assert np.array_equal(vals[e], want)


@pytest.mark.parametrize("bf16", [False, True])
def test_stream_k_unit_arithmetic_reproduces_the_layer_product(bf16):
    """Emulate sk_small's arithmetic on a small layer in float64 at M = 1: per unit of two blocks, the biased
    fragments of all 32 lanes placed by the PTX table give A[16 rows][128 k]; the tensor core's sum A @ x
    (exact here) is corrected by (bias + z) * sum(x) and scaled (s1 / 16 for the fp16 high nibble) as lane
    (g, t = 0) does for batch column 0; summed over units against x @ dequant(W)^T. Checks the bias, the
    correction constants and the placement, not fp32 rounding."""
    n, k, gsz = 24, 256, 128
    layer, qw, zt, sc = tiled_layer(n, k, gsz, bf16, seed=11)
    n16, kb = mma_tiles.padded(n, k)
    x = torch.randn(k, generator=torch.Generator().manual_seed(3)).to(layer.scales.dtype).double().numpy()
    y = np.zeros(n16 * 16)
    for tn in range(n16):
        for u in range(kb // 2):  # units of two blocks, one group (128 = 2 x 64)
            grp = min(128 * u // gsz, layer.n_groups - 1)
            a = np.full((16, 128), np.nan)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for b in range(2):
                    for s in range(4):
                        w = np.array([int(qw[tn, 2 * u + b, lane, s]) & 0xFFFFFFFF], dtype=np.uint32)
                        vals = _pair_values(emulate_biased(w, bf16), bf16)[:, 0]
                        for e, (r, kx) in enumerate(fragment_coords(g, t)):
                            a[r, 64 * b + 16 * s + kx] = vals[e]
            assert not np.isnan(a).any()  # the 32 lanes cover the unit exactly
            xu = x[128 * u:128 * u + 128]
            accb = a @ xu
            zp = zt[tn, grp].numpy().astype(np.uint32)
            for g in range(8):
                s0, s1 = _pair_values([np.array([int(sc[tn, grp, g]) & 0xFFFFFFFF], dtype=np.uint32)], bf16)[:, 0]
                z0, z1 = float((zp[0] >> (4 * g)) & 15), float((zp[1] >> (4 * g)) & 15)
                c0, c1 = (128 + z0, 128 + z1) if bf16 else (1024 + z0, 1024 + 16 * z1)
                s1 = s1 if bf16 else s1 / 16
                y[16 * tn + g] += s0 * (accb[g] - c0 * xu.sum())
                y[16 * tn + g + 8] += s1 * (accb[g + 8] - c1 * xu.sum())
    ref = x @ dequantize_packed(layer, torch.float64).numpy()  # [K] @ [K, N]
    np.testing.assert_allclose(y[:n], ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())


def _transpose4(v: list[list[int]]) -> list[list[int]]:
    """csrc/xr.cuh transpose4 over one row's four lanes: v[t][e] is lane t's element e; two butterfly rounds,
    the same sends and keeps as the kernel's."""
    v = [list(r) for r in v]
    for m in (1, 2):
        new = [list(r) for r in v]
        for e in range(4):
            if e & m:
                continue
            e1 = e | m
            send = [v[t][e] if t & m else v[t][e1] for t in range(4)]
            for t in range(4):
                recv = send[t ^ m]
                if t & m:
                    new[t][e] = recv
                else:
                    new[t][e1] = recv
        v = new
    return v


def test_x_in_registers_fragments_come_out_in_mma_order():
    """xr_small's x load: lane t of a row loads 16-byte chunks t and t + 4 of a 64-k block (words 4t.. and
    16 + 4t..), the row's four lanes transpose them, and lane t's registers are then its B fragments: word
    8 s + 4 h + t (the pair k = 16 s + 8 h + 2t, + 1) for step s, half h."""
    words = list(range(32))  # one row's 32 words of a block
    for c in range(2):
        got = _transpose4([[words[16 * c + 4 * t + e] for e in range(4)] for t in range(4)])
        for t in range(4):
            # v.x, v.y -> step 2c (h 0, 1); v.z, v.w -> step 2c + 1
            assert got[t] == [8 * (2 * c) + t, 8 * (2 * c) + 4 + t, 8 * (2 * c + 1) + t, 8 * (2 * c + 1) + 4 + t]
    # the emulation above is the kernel's own butterfly: fail here if the source stops doing what it mirrors
    for line in ("const bool hi = t & m;", "const uint32_t send = hi ? *v[e] : *v[e1];",
                 "__shfl_xor_sync(0xffffffffu, send, m);", "*v[e] = recv;", "*v[e1] = recv;"):
        assert line in _SRC, line
    assert "transpose4(xb[b][2 * c][j][0], xb[b][2 * c][j][1], xb[b][2 * c + 1][j][0]," in _SRC
    assert "const int k0 = (kg * nw + warp) * R * 64 + 8 * t;" in _SRC and "k0 + b * 64 + c * 32" in _SRC


_SRC = "".join(p.read_text() for p in sorted(build.CSRC.glob("*.cuh")))  # the kernels


# (K, group, warps, blocks per warp, tiles per unit, CTAs, M, biased, clusters of 2): a warp partly past K with
# one record per block (448, 64) and with two blocks per record (640, 128, one warp of 4); warps wholly past K
# (640, 128, 3 x 2); a single group, one K group (512); CTAs whose ranges cross K groups (all but 512 and the
# clusters); units of two tiles, the last of each K group with a tile past N (3 tiles), in one CTA crossing K
# groups and (K 1024, 8 blocks a warp, one group) in three; biased weights corrected by the groups' sums of x
# (groups of 64 and 128, one group, a warp partly past K); two K groups in clusters of 2 (3 clusters for 2 and
# for 3 units of a K group, bf16)
@pytest.mark.parametrize("k,gsz,nw,r,tpu,ctas,m,bias,cl", [
    (448, 64, 3, 2, 1, 3, 11, False, False), (640, 128, 1, 4, 1, 2, 3, False, False),
    (640, 128, 3, 2, 1, 3, 16, False, False), (512, -1, 2, 4, 1, 3, 16, False, False),
    (640, 128, 3, 2, 2, 1, 16, False, False), (1024, -1, 2, 8, 2, 3, 9, False, False),
    (448, 64, 3, 2, 1, 3, 16, True, False), (896, 128, 3, 2, 2, 4, 16, True, False),
    (1024, -1, 2, 8, 2, 3, 9, True, False), (896, 128, 2, 4, 2, 6, 16, True, True),
    (1024, 128, 2, 4, 1, 6, 12, "bf16", True)])
def test_x_in_registers_work_split_reproduces_the_layer_product(k, gsz, nw, r, tpu, ctas, m, bias, cl):
    """Emulate xr_small's work split in float64: units (K group of nw x r blocks, t tiles) cut per CTA by the
    kernel's formula (clusters: one range of tile units per cluster of 2, rank = K group); each warp's r blocks of
    each tile of a unit (a warp partly past K re-reads its last block, x being 0 there; a warp wholly past K adds
    nothing; a tile past N re-reads the unit's first tile and is not stored), one scale record per GB = min(r,
    group / 64) blocks, the fp32 sums scaled per record (biased: the fragments' bias + q sums corrected by (bias +
    z) x the record's sum of x, s1 / 16 for fp16's high nibbles); the warps' partials summed in warp order, the K
    groups' in K-group order. Checks the block, record and group arithmetic against x @ dequant(W)^T (the
    fragments themselves: tests above)."""
    n, bf16 = 40, bias == "bf16"
    layer, qw, zt, sc = tiled_layer(n, k, gsz, bf16, seed=5)
    n16, kb = mma_tiles.padded(n, k)
    ng = layer.n_groups
    gshift = 30 if ng == 1 else gsz.bit_length() - 1  # qtool.kernels.cuda.group_shift
    lgb = min(max(gshift - 6, 0), r.bit_length() - 1)
    gb = 1 << lgb
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).half().double().numpy()
    xpad = np.zeros((m, kb * 64))
    xpad[:, :k] = x
    # the dequantized tile rows (q - z, unscaled) and the per-(tile, group, row) scales, from the lane emulation
    q_minus_z = np.zeros((n16 * 16, kb * 64))  # biased: bias + q (fp16 rows 8-15: 1024 + 16 q)
    for tn in range(n16):
        for b in range(kb):
            grp = min(64 * b // (gsz if gsz > 0 else 1 << 30), ng - 1)
            zp = zt[tn, grp].numpy().astype(np.uint32)
            for lane in range(32):
                g, t = divmod(lane, 4)
                z0 = np.array([(zp[0] >> (4 * g)) & 15], dtype=np.uint32)
                z1 = np.array([(zp[1] >> (4 * g)) & 15], dtype=np.uint32)
                for s in range(4):
                    w = np.array([int(qw[tn, b, lane, s]) & 0xFFFFFFFF], dtype=np.uint32)
                    frag = emulate_biased(w, bf16) if bias else emulate_dequant(w, z0, z1, bf16)
                    vals = _pair_values(frag, bf16)[:, 0]
                    for e, (row, kx) in enumerate(fragment_coords(g, t)):
                        q_minus_z[16 * tn + row, 64 * b + 16 * s + kx] = vals[e]

    def scale(tn, grp):
        s = np.zeros(16)
        for g in range(8):
            s[g], s[g + 8] = _pair_values([np.array([int(sc[tn, grp, g]) & 0xFFFFFFFF], dtype=np.uint32)], bf16)[:, 0]
        return s

    def correction(tn, grp):  # (bias + z) per row, and the factor on the scale
        zp = zt[tn, grp].numpy().astype(np.uint32)
        z = np.array([(int(zp[h]) >> (4 * g)) & 15 for h in (0, 1) for g in range(8)], dtype=np.float64)
        if bf16:
            return 128 + z, np.ones(16)
        return np.concatenate([1024 + z[:8], 1024 + 16 * z[8:]]), np.array([1.0] * 8 + [1 / 16] * 8)

    kgroups, ntu = -(-kb // (nw * r)), -(-n16 // tpu)
    units = kgroups * ntu
    assert kgroups == 2 or not cl
    assert "const long long cu = CL ? ntu : units;" in _SRC and "inb = min(R, p.KB - kb0);" in _SRC
    assert "const int u0 = (int)(cid * cu / ncl) + crank * ntu, n = (int)((cid + 1) * cu / ncl) - (int)(cid * cu / ncl);" in _SRC
    assert "ws + min(b, inb - 1) * 32" in _SRC and "min(max(p.gshift - 6, 0), 31 - __clz(R))" in _SRC
    assert "const bool in = tt == 0 || itile * T + tt < n16;" in _SRC and "if (T > 1 && tile >= n16) break;" in _SRC
    assert "const int kbr = min(kb0 + (mlane ? rec << lgb : 0), p.KB - 1);" in _SRC
    partial = {}  # (kg, tile) -> the unit's sum over warps, in warp order
    crossed = False
    for cta in range(ctas):
        if cl:  # cluster cta // 2, rank cta % 2
            ncl, cid = ctas // 2, cta // 2
            u0 = cid * ntu // ncl + (cta % 2) * ntu
            u1 = u0 + (cid + 1) * ntu // ncl - cid * ntu // ncl
        else:
            u0, u1 = cta * units // ctas, (cta + 1) * units // ctas
        crossed |= u1 > u0 and u0 // ntu != (u1 - 1) // ntu  # this CTA reloads x for a second K group
        for u, tt in ((u, tt) for u in range(u0, u1) for tt in range(tpu)):
            kg, tu = divmod(u, ntu)
            tile = tu * tpu + tt
            if tile >= n16:
                continue  # its copies repeat the unit's first tile; its sums are never stored
            total = np.zeros((16, m))
            for warp in range(nw):
                kb0 = (kg * nw + warp) * r
                inb = min(r, kb - kb0)
                acc = np.zeros((16, m))
                if inb > 0:  # live
                    for rec in range(r // gb):
                        kbr = min(kb0 + rec * gb, kb - 1)
                        grp = min((kbr * 64) >> gshift, ng - 1)
                        accb, xsum = np.zeros((16, m)), np.zeros(m)
                        for bb in range(gb):
                            b = rec * gb + bb
                            src = kb0 + min(b, inb - 1)  # the block whose weights land in slot b
                            kx = kb0 + b  # the block of x in register set b (0 past K)
                            xb = xpad[:, 64 * kx:64 * kx + 64] if kx < kb else np.zeros((m, 64))
                            accb += q_minus_z[16 * tile:16 * tile + 16, 64 * src:64 * src + 64] @ xb.T
                            xsum += xb.sum(axis=1)  # the mmas with an A of ones, over the record's register sets
                        if bias:
                            c, f = correction(tile, grp)
                            accb = accb - c[:, None] * xsum[None, :]
                            acc += (f * scale(tile, grp))[:, None] * accb
                        else:
                            acc += scale(tile, grp)[:, None] * accb
                total = total + acc
            partial[(kg, tile)] = total
    assert sorted(partial) == [(g, t) for g in range(kgroups) for t in range(n16)]  # every unit exactly once
    assert crossed == (kgroups > 1 and not cl)
    y = np.zeros((m, n16 * 16))
    for tile in range(n16):
        tot = partial[(0, tile)]
        for g in range(1, kgroups):
            tot = tot + partial[(g, tile)]
        y[:, 16 * tile:16 * tile + 16] = tot.T
    ref = x @ dequantize_packed(layer, torch.float64).numpy()
    np.testing.assert_allclose(y[:, :n], ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
