"""`cuda-w4a16` host side on the CPU: launch planning, group lookup, act-order plan, refusals, the nvcc build.

The kernels themselves run only on a GPU (tests/test_kernels_gpu.py, benchmarks/tune_cuda_w4a16.py --check);
their arithmetic and layout are emulated lane by lane in tests/test_mma_tiles.py.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qtool.bench.layers import random_plain
from qtool.kernels.base import PackedLayer, get_kernel
from qtool.kernels.cuda import act_order_plan, build, built, group_shift, launch, rows
from qtool.kernels.cuda.launch import MMA, SK, WG_STAGES, WGMMA, XR, XS, Config, plan, ring_depth
from qtool.kernels.cuda.rows import choose

ENTRY = built.NAMES | built.NAMES_SM90A  # every entry point of the sm_90a build
SMEM_MAX = 227 * 1024
SHAPES = [(8192, 8192), (8192, 1024), (8192, 28672), (28672, 8192), (384, 200), (160, 48)]


sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_choices import H100_GBPS, H100_SLOTS, state  # noqa: E402


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 100, 256, 1000])
@pytest.mark.parametrize("post", [True, False])
def test_plan_names_an_instantiated_kernel_and_fits(m, post):
    for k, n in SHAPES:
        for cc in ((9, 0), (8, 0)):
            st = state(k, n, post, cc)
            cfg = choose(m, st)
            if cc != (9, 0):
                assert cfg.kind in (MMA, SK, XS)  # wgmma is sm_90a only
            p = plan(cfg, m, st)
            for dt in ("f16", "bf16"):
                assert p["name"].replace("{dt}", dt) in launch.kernels(cc), p["name"]
            assert p["smem"] <= SMEM_MAX
            # x by TMA exactly for the kernels built so, which take one more (producer) warpgroup
            assert p["tma"] == p["name"].endswith("_tma")
            if cfg.kind == WGMMA:
                assert p["block"] == 128 * (cfg.wgs + p["tma"])
            if cfg.kind == SK:
                units = -(-n // 16) * -(-k // 64) // cfg.ub
                assert m <= 8 and p["grid"][0] * (p["block"] // 32) <= units  # every warp range non-empty
                assert p["ws_floats"] == 2 * p["grid"][0] * (p["block"] // 32) * 128 and p["counters"] == -(-n // 16)
                continue
            if cfg.kind == XR:  # K groups of warps x r blocks; never more CTAs than (K group, t tiles) units
                kb = -(-k // 64)
                kgroups = -(-kb // (cfg.warps * cfg.r))
                assert m <= 64 and cc == (9, 0) and p["splits"] == kgroups
                assert p["grid"][0] <= kgroups * -(-n // (16 * cfg.t)) and p["rows"] == 8 * cfg.nt >= m
                continue
            gx, splits, gz = p["grid"]
            kb = -(-k // 64)
            assert splits == -(-kb // p["kbps"]) and (splits - 1) * p["kbps"] < kb  # no empty split
            assert gz * p["rows"] >= m and gx * (16 * (p["block"] // 32) * (cfg.tn if cfg.kind in (MMA, XS) else 1)) >= n


def test_forced_configs_and_labels():
    st = state(8192, 8192)
    p = plan(Config(kind=MMA, nt=1, tn=1, warps=8, splits=3), 1, st)
    assert p["grid"] == (64, 3, 1) and p["kbps"] == 43 and p["block"] == 256
    assert p["name"] == "qt_mma_{dt}_nt1_tn1_post"
    assert p["ws_floats"] == 3 * 8 * 8192 and p["counters"] == 64  # split x batch rows x N, one count per tile
    one = plan(Config(kind=MMA, nt=1, tn=1, warps=8, splits=1), 1, st)
    assert one["ws_floats"] == 0 and one["counters"] == 0  # stored in place: no workspace
    assert plan(Config(kind=MMA, nt=1, tn=2, warps=8, splits=3), 1, st)["grid"] == (32, 3, 1)
    p = plan(Config(kind=WGMMA, bn=128, wgs=4, splits=1), 256, st)
    assert p["grid"] == (32, 1, 2) and p["block"] == 512
    assert p["smem"] == 1024 + WG_STAGES[128] * 128 * 128 + 16 * ring_depth(WGMMA, True, 6) * (512 + 48)
    p = plan(Config(kind=WGMMA, bn=128, wgs=2, stages=4), 256, st)
    assert p["name"] == "qt_wg_{dt}_bn128_wg2_s4_blk_tma" and p["smem"] <= 113 * 1024  # two CTAs per SM
    assert p["tma"] and not plan(Config(kind=WGMMA, bn=128, wgs=2, stages=4), 256, state(8196, 8192))["tma"]
    p = plan(Config(kind=WGMMA, bn=128, wgs=2, stages=4, tma=False), 256, st)
    assert p["name"] == "qt_wg_{dt}_bn128_wg2_s4_blk" and not p["tma"]
    assert Config(kind=MMA, nt=1).label() == "cuda mma nt1 tn2 w4 6/sm"
    assert Config(kind=MMA, nt=1).label(8) == "cuda mma nt1 tn2 w4 split8"


def test_small_m_takes_stream_k_where_x_fits():
    # Llama-3-70B at M = 1: k/v one CTA per tile; down (long K) and q/o (4 tiles per SM) 4 whole tiles per CTA
    assert choose(1, state(28672, 8192)).kind == SK and choose(1, state(8192, 1024)).tpc == 1
    assert choose(1, state(28672, 8192)).tpc == 4 and choose(1, state(8192, 8192)).tpc == 4
    assert plan(choose(1, state(28672, 8192)), 1, state(28672, 8192))["grid"] == (128, 1, 1)
    # equal ranges, one CTA per SM, only at M = 1 on a wide layer whose x-in-registers K groups would be over a
    # quarter idle (Qwen2.5-32B's 5120 x 27648 and 5120 x 5120)
    for k, n in ((5120, 27648), (5120, 5120)):
        ranges = choose(1, state(k, n))
        assert (ranges.kind, ranges.tpc, ranges.trigger) == (SK, 0, "start") and rows._sk_ranges(1, state(k, n))
        assert rows.xr_live(state(k, n)) < rows.XR_LIVE_MIN
    # elsewhere a layer stream-K would take over equal ranges goes to one batch tile of x in registers: 8 blocks a
    # warp at every M <= 8 where its K groups are full (Llama-3-70B's gate/up, TP=2's and TP=4's, Qwen2.5-32B's
    # down_proj), four blocks a warp at M 2-8 where they are not (Qwen2.5-32B's 5120 K: 2 groups of 10 warps)
    for m, k, n in ((1, 8192, 28672), (3, 8192, 28672), (2, 8192, 14336), (1, 8192, 7168), (1, 27648, 5120)):
        assert rows._sk_ranges(m, state(k, n))
        one = choose(m, state(k, n))
        assert (one.kind, one.nt, one.r, one.warps) == (XR, 1, 8, 8)
    for m, k, n in ((2, 5120, 27648), (6, 5120, 27648), (3, 5120, 5120)):
        assert rows._sk_ranges(m, state(k, n))
        one = choose(m, state(k, n))
        assert (one.kind, one.nt, one.r, one.warps) == (XR, 1, 4, 10) and plan(one, m, state(k, n))["splits"] == 2
    # where x is too long for stream-K (70B at M >= 4), and on layers of one K group of 8 x 8 blocks (K 3072-4096:
    # Llama-3-8B, Qwen2.5-7B) at any M <= 8: one batch tile of x in registers, 8 warps of 8 blocks
    assert choose(3, state(8192, 1024)).kind == SK and choose(4, state(8192, 1024)).kind == XR  # x 65.6 KB
    assert not launch.sk_fits(4, state(28672, 8192)) and choose(4, state(28672, 8192)).kind == XR  # x 229 KB
    one = choose(4, state(28672, 8192))
    assert (one.nt, one.r, one.warps, one.depth, one.t, one.bias, one.cluster) == (1, 8, 8, 3, 1, False, False)
    assert [choose(1, state(k, 4096)).kind for k in (2048, 3584, 4096, 5120)] == [XR, XR, XR, SK]
    assert [choose(1, state(k, 4096)).r for k in (2048, 3584, 4096)] == [4, 8, 8]
    assert choose(1, state(14336, 4096)).kind == SK and choose(3, state(14336, 4096)).kind == XR
    # M 17-32: four batch tiles of x in registers (4 blocks a warp) where the bn32 wgmma grid spreads worse
    for m, (k, n) in ((17, (8192, 1024)), (24, (2048, 768)), (32, (768, 2048)), (32, (8192, 512))):
        four = choose(m, state(k, n))
        assert (four.kind, four.nt, four.r, four.warps) == (XR, 4, 4, 8)
        assert plan(four, m, state(k, n))["rows"] == 32
    # ... and the bn32 wgmma grid of least modelled cost of one wave where it is within WG32_EDGE of that:
    # Llama-3-70B's down_proj and q/o, Qwen2.5-32B's 5120 x 27648, Llama-3-8B's 4096 x 14336, Qwen2.5-7B's q/o; at
    # M <= 24 the same grid with 24 batch columns
    for m, (k, n) in ((17, (28672, 8192)), (32, (8192, 8192)), (24, (5120, 27648)), (32, (4096, 14336)),
                      (24, (3584, 3584)), (25, (3584, 3584))):
        wg = choose(m, state(k, n))
        bn = 24 if m <= 24 else 32
        assert (wg.kind, wg.bn) == (WGMMA, bn) and wg.wgs == rows.wg_launch(32)(state(k, n)).wgs
        p = plan(wg, m, state(k, n))
        assert p["rows"] == bn and p["grid"] == plan(choose(32, state(k, n)), 32, state(k, n))["grid"]
        assert p["grid"][0] * p["grid"][1] <= 132
    # Qwen2.5-7B's gate_proj: the model's least-cost grid is three waves (99 x 4); the row takes the least-cost
    # grid of one wave, three warpgroups unsplit
    assert plan(rows.wg_launch(32)(state(3584, 18944)), 32, state(3584, 18944))["grid"][:2] == (99, 4)
    for m in (17, 20, 32):
        wg = choose(m, state(3584, 18944))
        assert (wg.kind, wg.bn, wg.wgs, wg.tail) == (WGMMA, 24 if m <= 24 else 32, 3, 0)
        assert plan(wg, m, state(3584, 18944))["grid"][:2] == (99, 1)
    # the fused gate_up_proj of Llama-3-70B, Qwen2.5-32B and Qwen2.5-7B: no bn32 grid fits one wave, so its whole
    # waves run unsplit and a tail launch splits the tiles left over; its cost within WG32_EDGE of x in registers
    for (k, n), (whole, left, t) in (((8192, 57344), (264, 35, 3)), ((5120, 55296), (264, 24, 4)),
                                    ((3584, 37888), (132, 66, 2))):
        st = state(k, n)
        for m in (17, 24, 32):
            wg = choose(m, st)
            bn = 24 if m <= 24 else 32
            assert (wg.kind, wg.bn, wg.wgs, wg.splits, wg.tail) == (WGMMA, bn, 3, 0, t), (k, n, m, wg)
            p = plan(wg, m, st)
            assert p["rows"] == bn and p["grid"] == (whole, 1, 1) and p["tail"]["grid"] == (left, t, 1)
    # M 33-40 a 40-column wgmma tile in the grid the 48-column one takes at M 41-48, M 49-64 a 64-column one
    assert [(c.kind, c.bn) for c in (choose(m, state(8192, 8192)) for m in (33, 40, 41, 48, 49, 64))] == [
        (WGMMA, 40), (WGMMA, 40), (WGMMA, 48), (WGMMA, 48), (WGMMA, 64), (WGMMA, 64)]
    for k, n in ((8192, 8192), (8192, 28672), (28672, 8192), (8192, 1024)):
        assert plan(choose(40, state(k, n)), 40, state(k, n))["grid"] == plan(choose(48, state(k, n)), 48,
                                                                              state(k, n))["grid"]
    # M 33-64: 32-column wgmma batch tiles, K split to fill the SMs, on a layer of at most one 16-row tile's
    # 1024-k slice per SM: the MoE expert's 2048 x 768 (96 slices), 8192 x 256 (128); not 4096 x 1024 (256)
    for k, n in ((2048, 768), (768, 2048), (8192, 256)):
        small = choose(64, state(k, n))
        assert (small.kind, small.bn, small.wgs) == (WGMMA, 32, 2) and choose(33, state(k, n)) == small
        p = plan(small, 64, state(k, n))
        assert p["grid"][2] == 2 and p["grid"][0] * p["grid"][1] * p["grid"][2] <= 132
    # ... and where K is under 8 64-k blocks (BERT-size 384 x N), eight batch tiles of x in registers
    for k, n in ((384, 384), (384, 1536)):
        eight = choose(48, state(k, n))
        assert (eight.kind, eight.nt, eight.r, eight.warps) == (XR, 8, 2, 8) and choose(64, state(k, n)) == eight
        assert plan(eight, 64, state(k, n))["rows"] == 64
    assert choose(48, state(1536, 384)).kind == WGMMA
    assert choose(64, state(4096, 1024)).kind == WGMMA and choose(65, state(2048, 768)).kind == WGMMA
    # M 65-256 on a small layer (at most 32 blocks of a 16-row tile and 128 batch columns per SM): 64-column wgmma
    # batch tiles, K split to fill the SMs; 4096 x 1024 only up to M = 128, 8192 x 1024 not at all
    for m, (k, n) in ((65, (2048, 768)), (256, (8192, 256)), (128, (4096, 1024)), (200, (768, 2048))):
        small = choose(m, state(k, n))
        assert (small.kind, small.bn, small.wgs) == (WGMMA, 64, 2)
        assert plan(small, m, state(k, n))["grid"][2] == -(-m // 64)
    assert choose(129, state(4096, 1024)).bn == choose(128, state(8192, 1024)).bn == 128
    # M = 9-16, groups of >= 128, on the H200: x in registers, 8 warps of 8 blocks, on every layer (k/v too),
    # units of two tiles with >= 8 such units per SM (gate/up, down)
    q16, kv16, down16, gate16 = (choose(16, state(k, n)) for k, n in ((8192, 8192), (8192, 1024), (28672, 8192),
                                                                      (8192, 28672)))
    assert (q16.kind, q16.r, q16.warps, q16.t, q16.depth) == (kv16.kind, kv16.r, kv16.warps, kv16.t, kv16.depth) == (
        XR, 8, 8, 1, 3)
    assert (down16.kind, down16.r, down16.warps, down16.t, down16.depth) == (XR, 8, 8, 2, 2)
    assert (gate16.kind, gate16.t) == (XR, 2)
    # two K groups (gate/up): the weights biased and the K groups summed in a cluster; seven (down) and q/o plain
    assert (gate16.bias, gate16.cluster, down16.bias, down16.cluster, q16.bias, q16.cluster) == (
        True, True, False, False, False, False)
    # down's seven K groups take two-tile units only on H200-class memory (XR_T2_GBPS_SM): one tile of depth 3 on
    # the H100 (and on a device of no known bandwidth); gate/up's cluster form on both
    for gbps in (H100_GBPS, 0):
        assert choose(16, state(28672, 8192, gbps=gbps)) == q16 == choose(12, state(27648, 5120, gbps=gbps))
        assert choose(16, state(8192, 28672, gbps=gbps)) == gate16
    assert plan(gate16, 16, state(8192, 28672))["cluster"] == (2, 1, 1)
    assert plan(q16, 16, state(8192, 8192))["cluster"] == (1, 1, 1)
    assert [launch.xr_kgroups(state(k, 64), 8, 8) for k in (4096, 4097, 8192, 8193)] == [1, 2, 2, 3]
    for k, cl in ((4096, False), (7680, True), (12288, False)):  # one K group, two (the second 7/8 full), three
        wide = choose(16, state(k, 65536))
        assert (wide.kind, wide.r, wide.t, wide.cluster, wide.bias) == (XR, 8, 2, cl, cl)
        assert plan(wide, 16, state(k, 65536))["cluster"] == ((2, 1, 1) if cl else (1, 1, 1))
    # K groups of 8 x 8 blocks over a quarter idle (Qwen2.5-32B's K of 5120: 64 + 16 blocks; the MoE expert's 768
    # and 2048; two groups, the second one block): four blocks a warp, the fewest warps that keep groups of 16
    for m, k, nt, warps, groups in ((8, 5120, 1, 10, 2), (12, 5120, 2, 10, 2), (16, 768, 2, 3, 1),
                                    (9, 2048, 2, 8, 1), (16, 4160, 2, 9, 2)):
        assert rows.xr_live(state(k, 768)) < rows.XR_LIVE_MIN
        four = choose(m, state(k, 768))
        assert (four.kind, four.nt, four.r, four.warps, four.t, four.bias, four.cluster) == (
            XR, nt, 4, warps, 1, False, False)
        assert plan(four, m, state(k, 768))["splits"] == groups
    # at least 3/4 busy (K of 3584, 7168, 14336: 7/8) keeps eight blocks a warp
    assert [choose(16, state(k, 768)).r for k in (3584, 7168, 14336, 27648)] == [8, 8, 8, 8]
    # M <= 8: K under XR1_MIN_K (stream-K's before) takes four blocks a warp at every M; a K of 5120 only where x
    # is too long for stream-K
    for m, k, warps in ((1, 2048, 8), (4, 768, 3), (8, 384, 2), (1, 3008, 12)):
        one = choose(m, state(k, 768))
        assert (one.kind, one.nt, one.r, one.warps) == (XR, 1, 4, warps)
    assert choose(4, state(5120, 768)).kind == SK and choose(1, state(3072, 768)).r == 8
    g64 = state(8192, 8192, slots=(), gbps=0, gshift=6)  # groups of 64: not run on a GPU
    assert choose(16, g64).kind == XS
    # elsewhere (not measured there) the earlier choices: x streamed for down, the split mma grid for gate/up
    down16 = choose(16, state(28672, 8192, cc=(8, 0)))
    assert down16.kind == XS and choose(16, state(8192, 28672, cc=(8, 0))).kind == MMA
    p = plan(down16, 16, state(28672, 8192))
    assert p["grid"] == (32, 4, 1) and p["kbps"] == 112 and p["name"] == "qt_xs_{dt}_nt2_tn1_d6_x2"
    assert p["smem"] == 4 * 16 * (2 * 64 + 8) * 2 + 16 * 6 * (512 + 48)  # 4 x chunks, 16 rings of 6 blocks
    xs_small = Config(kind=XS, nt=2, tn=1, warps=8, ctas_per_sm=3.0, min_blocks=8)  # groups of 64 on k/v
    assert plan(xs_small, 16, state(8192, 1024))["grid"] == (8, 16, 1)  # 8 blocks per warp: 16 splits
    # groups under a block: the mma kernel, a small layer (k/v) one tile per warp with 12-slot rings
    kv16 = choose(16, state(8192, 1024, post=False))
    assert (kv16.kind, kv16.tn, kv16.depth) == (MMA, 1, 12)
    with pytest.raises(ValueError, match="x-streaming"):
        plan(Config(kind=XS, nt=2, tn=1), 16, state(8192, 1024, post=False))
    assert choose(1, state(8192, 8192, post=False)).kind == MMA  # groups not found by a shift: no stream-K
    assert choose(1, state(8256, 1024)).kind == XR  # 129 blocks: not whole units of two, x in registers instead
    p = plan(Config(kind=SK, warps=8, ctas_per_sm=4.0, min_blocks=8), 1, state(8192, 1024))
    assert p["grid"] == (128, 1, 1) and p["block"] == 256  # 64 x 128 blocks: 8 per warp, not 4 CTAs per SM
    assert p["name"] == "qt_sk_{dt}_u2_d4"
    assert plan(Config(kind=SK, depth=6), 1, state(8192, 1024))["name"] == "qt_sk_{dt}_u2_d6"
    # the whole-tile grids (k/v, down) subtract the zero per fragment; the 1/sm grid keeps the x sums
    kv, down, gate = (choose(1, state(k, n)) for k, n in ((8192, 1024), (28672, 8192), (5120, 27648)))
    assert kv.zsub and down.zsub and not gate.zsub and "zsub" in kv.label() and "zsub" not in gate.label()
    assert plan(kv, 1, state(8192, 1024))["name"] == "qt_sk_z_{dt}_u2_d6"
    assert plan(down, 1, state(28672, 8192))["name"] == "qt_sk_z_{dt}_u2_d6"  # long K: 6-slot rings
    assert plan(choose(1, state(8192, 8192)), 1, state(8192, 8192))["name"] == "qt_sk_z_{dt}_u2_d4"  # q/o: 4
    st8 = state(8192, 1024, slots=(), gbps=0, gshift=8)  # group 256: units of 4 would fit
    with pytest.raises(ValueError, match="zsub"):
        plan(Config(kind=SK, ub=4, zsub=True), 1, st8)
    with pytest.raises(ValueError, match="no stream-K kernel with 4 blocks per unit"):
        plan(Config(kind=SK, ub=4), 1, st8)
    with pytest.raises(ValueError, match="one group per unit"):
        plan(Config(kind=SK, ub=4), 1, state(8192, 1024))  # group 128 < 4 blocks
    with pytest.raises(ValueError, match="ring depth"):
        plan(Config(kind=SK, depth=5), 1, state(8192, 1024))
    tiny = plan(Config(kind=SK, warps=16, min_blocks=1), 1, state(256, 48))  # 3 tiles x 2 units
    assert tiny["grid"] == (1, 1, 1) and tiny["block"] == 6 * 32


@pytest.mark.parametrize("n16,upt,tw", [(64, 64, 1024), (3, 3, 9), (1792, 64, 2112), (5, 7, 3), (2, 224, 33)])
def test_stream_k_partition(n16, upt, tw):
    """The kernel's range arithmetic (csrc/w4a16.cu, sk_small; upt = units per tile, tw = warps in the grid):
    every unit has exactly one warp, the owner formula inverts the range starts, the partial slots of shared
    tiles never collide, and the finisher's shortcut holds (every contributor after the first starts its range
    inside the tile, so its slot is 2w)."""
    units = n16 * upt

    def start(w):
        return w * units // tw

    def owner(u):
        return ((u + 1) * tw - 1) // units

    seen = []
    for w in range(tw):
        assert start(w + 1) > start(w)  # tw <= units: no empty range
        for u in range(start(w), start(w + 1)):
            assert owner(u) == w
            seen.append(u)
    assert seen == list(range(units))
    slots = {}
    for tile in range(n16):
        wa, wb = owner(tile * upt), owner(tile * upt + upt - 1)
        if wa == wb:
            continue
        for w in range(wa, wb + 1):
            slot = 2 * w if start(w) // upt == tile else 2 * w + 1  # what the contributor writes
            if w > wa:
                assert slot == 2 * w  # what the finisher reads without dividing
            else:
                assert slot == (2 * wa if start(wa) == tile * upt else 2 * wa + 1)
            assert slot not in slots, (tile, w)
            slots[slot] = tile
            # the warp's range really touches the tile, and a second slot only for its last tile
            assert start(w) < (tile + 1) * upt and start(w + 1) > tile * upt
            if slot % 2:
                assert (start(w + 1) - 1) // upt == tile


def test_large_m_choice_follows_the_layer_shape():
    # Llama-3-70B at M = 256: k/v narrow, the rest one 256-column tile of 4 x-tile stages; x by TMA (one more
    # warp) where K allows it
    narrow = Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8)
    assert rows.choose_row(256, state(8192, 1024)).make(state(8192, 1024)) == narrow
    q = choose(256, state(8192, 8192))
    assert (q.bn, q.wgs, q.stages) == (256, 2, 0)
    p = plan(q, 256, state(8192, 8192))
    assert p["tma"] and p["block"] == 384 and p["name"] == "qt_wg_{dt}_bn256_wg2_s4_blk_tma" and p["grid"] == (64, 2, 1)
    assert choose(256, state(8192, 28672)).bn == 256 and choose(256, state(28672, 8192)).bn == 256
    # one CTA per SM: the K split keeps the grid within a wave (Qwen2.5-7B's down_proj, 28 column blocks: 4
    # splits, 112 CTAs, where rounding 132 / 28 up gave 5 and 140)
    assert plan(choose(256, state(18944, 3584)), 256, state(18944, 3584))["grid"] == (28, 4, 1)
    assert plan(choose(256, state(3584, 3584)), 256, state(3584, 3584))["grid"] == (28, 4, 1)
    from qtool.kernels.cuda import CudaW4A16

    st = state(8192, 8192)
    assert CudaW4A16().describe(SimpleNamespace(**vars(st), config=lambda m: q), 256) == (
        "cuda wgmma bn256 wg2 split2 cluster x-tma pdl")
    assert choose(256, state(8192, 8192, cc=(8, 0))).kind == MMA
    # M 129-192: one 192-column tile (6 x-tile stages) where the narrow row does not take the layer
    for k, n in ((8192, 8192), (8192, 28672), (28672, 8192)):
        c = rows.choose_row(192, state(k, n)).make(state(k, n))
        assert (c.kind, c.bn, c.wgs, c.stages) == (WGMMA, 192, 2, 0)
        assert plan(c, 129, state(k, n))["name"] == "qt_wg_{dt}_bn192_wg2_s6_blk_tma"
    assert rows.choose_row(160, state(8192, 1024)).name == "wgmma bn128 narrow"


def test_wgmma_grid_has_the_least_modelled_cost(monkeypatch):
    """M 33-128: the warpgroups and K splits of the rows' evidence (csrc wg_large runs one CTA per SM, so a grid
    of a wave and a bit costs two CTA times), and the cost model's ordering behind them."""
    def rows_state(k, n):  # the grids of the rows themselves: no clusters (wg_clustered, tested below)
        return state(k, n, slots=())

    gate = rows_state(8192, 28672)  # Llama-3-70B gate_proj: 1792 tiles in 112 CTAs of four warpgroups (224 of two)
    c = choose(64, gate)
    assert (c.bn, c.wgs, c.splits) == (64, 4, 1)
    p = plan(c, 64, gate)
    assert p["grid"] == (112, 1, 1) and p["block"] == 5 * 128 and p["name"] == "qt_wg_{dt}_bn64_wg4_s6_blk_tma"
    assert rows.wg_cost(64, 4, 1, gate) < rows.wg_cost(64, 2, 1, gate)  # one wave against two
    qwen = rows_state(3584, 18944)  # Qwen2.5-7B gate_proj at M = 128: 99 CTAs of three warpgroups (148 of two)
    assert (choose(128, qwen).wgs, choose(128, qwen).splits) == (3, 1)
    down = rows_state(18944, 3584)  # 14 column blocks of four warpgroups, 9 splits: 126 CTAs, not 140 of two
    c = choose(48, down)
    assert (c.wgs, c.splits) == (4, 9) and plan(c, 48, down)["grid"] == (14, 9, 1)
    # a small layer keeps two warpgroups and splits K for its CTAs, as far as the partials' traffic pays:
    # at bn128 13 splits (104 CTAs), where a model without that traffic takes 16 (128 CTAs of 8 blocks)
    kv = rows_state(8192, 1024)
    assert (choose(64, kv).wgs, choose(64, kv).splits) == (2, 16)
    assert (choose(100, kv).wgs, choose(100, kv).splits) == (2, 13)
    monkeypatch.setattr(rows, "WG_PARTIAL", 0.0)
    assert choose(100, kv).splits == 16


def test_wgmma_split_k_in_a_cluster_plan():
    """The K splits of a tile as one cluster along the grid's y: no workspace and no counters, and each CTA's fp32
    tile [bn][64 wgs + 4] within its shared memory; at most WG_CLUSTER_MAX splits; one split is no cluster."""
    st = state(4096, 4096)
    cfg = Config(kind=WGMMA, bn=128, wgs=2, splits=4, cluster=True)
    p = plan(cfg, 128, st)
    assert p["grid"] == (32, 4, 1) and p["cluster"] == (1, 4, 1) and p["ws_floats"] == 0 == p["counters"]
    ws = plan(dataclasses.replace(cfg, cluster=False), 128, st)
    assert ws["cluster"] == (1, 1, 1) and ws["ws_floats"] == 4 * 128 * 4096 and ws["counters"] == 32
    assert p["smem"] == ws["smem"]
    # csrc/wgmma.cuh epilogue_cluster writes the CTA's fp32 tile [bn][64 wgs + 4] over its drained stages from
    # the 1 KB-aligned base: every built wgmma shape's stages hold it
    for bn, wgs, stages, tma in built.WG:
        c = Config(kind=WGMMA, bn=bn, wgs=wgs, stages=stages, tma=tma, splits=2, cluster=True)
        assert plan(c, bn, st)["smem"] >= 1024 + bn * (64 * wgs + 4) * 4, (bn, wgs, stages, tma)
    assert plan(dataclasses.replace(cfg, splits=1), 128, st)["cluster"] == (1, 1, 1)
    assert cfg.label(4) == "cuda wgmma bn128 wg2 split4 cluster"
    with pytest.raises(ValueError, match="cluster"):
        plan(dataclasses.replace(cfg, splits=9), 128, state(8192, 4096))


def test_wgmma_sources_and_plan_agree():
    """Two rules spelled in both csrc/wgmma.cuh and launch.py: a TMA stage's weights are BoxSlot<4 wgs>'s bytes
    (each tile's 512 bytes of weights, 32 of scales and 16 of zeros, rounded to 128), and the cluster sum takes as
    many ranks as WG_CLUSTER_MAX (cluster_sum's largest R)."""
    src = (build.CSRC / "wgmma.cuh").read_text()
    slot = re.search(r"struct BoxSlot \{(.*?)\n\};", src, re.S).group(1)
    scales, zeros = (int(v) for v in re.search(r"SCALES = T \* (\d+), ZEROS = T \* (\d+);", slot).groups())
    per_tile, align = (int(v) for v in re.search(r"BYTES = \(T \* (\d+) \+ \d+\) / (\d+) \* \2;", slot).groups())
    assert (scales, zeros, per_tile) == (512, 512 + 32, launch.slot_bytes(True))  # 512 + 32 + 16 = 560
    st = state(8192, 8192)
    for bn, wgs, stages, tma in built.WG:
        if not tma:
            continue
        p = plan(Config(kind=WGMMA, bn=bn, wgs=wgs, stages=stages), bn, st)
        box = -(-(4 * wgs * per_tile) // align) * align
        assert p["tma"] and p["smem"] == 1024 + stages * (bn * 128 + box), (bn, wgs, stages)
    ranks = max(int(r) for r in re.findall(r"cluster_sum<(\d+), \d+, BF16>", src))
    assert ranks == launch.WG_CLUSTER_MAX


def test_wgmma_splits_meet_in_a_cluster_where_its_clusters_fit():
    """wg_clustered: the same splits in clusters where the tiles' clusters are resident at once (cluster_slots);
    more than WG_CLUSTER_MAX splits cut to it where those fit; where they do not, the most splits that fit,
    only if the workspace's partials are at least WG_CL_PARTIALS of the weight bytes; nothing without slots."""
    slots = tuple(H100_SLOTS)  # launch.cluster_slots on an H100
    def row_launch(m, st):
        return rows.choose_row(m, st).make(st)

    def clustered(m, k, n):  # the launch before and after wg_clustered (and wg_tailed: none of these M take one)
        st = state(k, n, slots=slots)
        before = row_launch(m, st)
        return before, rows.wg_clustered(rows.wg_tailed(before, m, st), m, st), st

    before, after, st = clustered(128, 3584, 3584)  # 28 tiles of 4 splits: 28 clusters fit
    assert (plan(before, 128, st)["splits"], after.splits, after.cluster) == (4, 4, True)
    assert plan(after, 128, st)["cluster"] == (1, 4, 1)
    before, after, st = clustered(64, 8192, 1024)  # 16 splits of 8 tiles: 8 splits, 8 clusters of 8 fit
    assert (plan(before, 64, st)["splits"], after.splits, after.cluster) == (16, 8, True)
    # 4 splits of 32 tiles (30 clusters of 4 fit, 39 of 3): 3 splits only where the partials weigh at least
    # the weight bytes, 8 x 4 x M >= K, here M >= 128
    before, after, st = clustered(96, 4096, 4096)
    assert plan(before, 96, st)["splits"] == 4 and after == before
    before, after, st = clustered(128, 4096, 4096)
    assert plan(before, 128, st)["splits"] == 4 and (after.splits, after.cluster) == (3, True)
    # the edge itself: K = 8 x 4 x 128 takes it, a K past it does not (KB 64 -> 66 keeps 4 splits)
    st = state(4224, 4096, slots=slots)
    assert plan(row_launch(128, st), 128, st)["splits"] == 4 and not choose(128, st).cluster
    # Llama-3-70B's down_proj at M = 128: 43 tiles of 3 splits, 2 would fit, the partials are light: unchanged
    before, after, st = clustered(128, 28672, 8192)
    assert after == before and plan(before, 128, st)["splits"] == 3
    # one split, another kernel, a device without slots: unchanged
    assert not choose(128, state(8192, 28672, slots=slots)).cluster
    assert choose(16, state(4096, 4096, slots=slots)) == row_launch(16, state(4096, 4096))
    assert not choose(128, state(3584, 3584, slots=())).cluster


def test_wgmma_grid_past_a_wave_takes_a_tail_launch():
    """wg_tailed: a grid of one batch tile a partial wave past a whole one (M > 96) runs its whole waves unsplit
    and the tiles left over in a second launch, K split as far as one wave holds (in clusters where they fit,
    else through the workspace), where wg_tail_cost is under the grid's own; one-wave grids, M <= 96 and two
    batch tiles keep one launch, and a tail that cannot apply is refused."""
    slots = tuple(H100_SLOTS)
    st = state(3584, 18944, slots=slots)  # Qwen2.5-7B's gate_proj: 148 tiles of 128 rows, 56 64-k blocks
    for m, bn in ((129, 160), (176, 192), (208, 224), (256, 256)):
        cfg = choose(m, st)
        assert (cfg.bn, cfg.wgs, cfg.tail) == (bn, 2, 6), (m, cfg)
        p = plan(cfg, m, st)
        assert p["grid"] == (132, 1, 1) and p["splits"] == 1 and p["ws_floats"] == 0
        assert p["tail"] == {"grid": (16, 6, 1), "bx0": 132, "kbps": 10, "splits": 6, "cluster": (1, 6, 1),
                             "ws_floats": 0, "counters": 0}
        assert cfg.label().endswith(" tail6")
    one = choose(128, st)  # three warpgroups: 99 tiles, one wave
    assert (one.wgs, one.tail) == (3, 0) and plan(one, 128, st)["tail"] is None
    # Llama-3-70B's gate_proj at M = 128: 224 tiles of two warpgroups, or one wave and 18 tiles of three
    big = state(8192, 28672, slots=slots)
    cfg = choose(128, big)
    assert (cfg.wgs, cfg.tail) == (3, 5) and plan(cfg, 128, big)["tail"]["grid"] == (18, 5, 1)
    assert rows.wg_tail_cost(128, 3, 5, big) * rows.TAIL_MARGIN < rows.wg_cost(128, 2, 1, big)
    assert choose(96, big).tail == 0 and choose(256, big).tail == 0  # M <= 96; 92 tiles left: no split fits
    # without cluster slots the tail's splits meet in the workspace
    bare = state(3584, 18944, slots=())
    p = plan(choose(176, bare), 176, bare)
    assert p["tail"]["grid"] == (16, 8, 1) and p["tail"]["cluster"] == (1, 1, 1)  # 16 x 8 CTAs: one wave
    assert p["tail"]["ws_floats"] == 8 * 192 * 1184 * 16 and p["tail"]["counters"] == 16
    with pytest.raises(ValueError, match="tail launch"):  # within a wave; two batch tiles
        plan(Config(kind=WGMMA, bn=128, wgs=2, tail=4), 128, state(4096, 4096))
    with pytest.raises(ValueError, match="tail launch"):
        plan(Config(kind=WGMMA, bn=128, wgs=2, tail=4), 200, st)


def test_x_slice_bounds_the_split():
    # the mma kernel stages its K slice of x: at M = 16 that caps the slice at X_BUDGET, whatever was asked
    st = state(28672, 8192)
    p = plan(Config(kind=MMA, nt=2, tn=2, warps=8, splits=1), 16, st)
    assert p["kbps"] * 64 * 16 * 2 <= 32 * 1024 and p["splits"] > 1


def test_group_shift():
    assert state(64, 64).gshift_blk == 7 and ring_depth(MMA, True) == 6
    assert group_shift(128, 64, 64) == 7 and group_shift(64, 2, 64) == 6
    assert group_shift(32, 8, 64) == -1 and group_shift(32, 8, 16) == 5
    assert group_shift(96, 4, 16) == -1  # not a power of two: the kernel reads the group table
    assert group_shift(4096, 1, 64) == 30  # one group


def test_act_order_plan_sorts_rows_by_group():
    g = torch.arange(64) // 16
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    g_idx = g[perm]
    p, sg = act_order_plan(g_idx, 64)
    assert torch.equal(sg, g) and torch.equal(g_idx[p], g)
    uneven = torch.tensor([0] * 20 + [1] * 12 + [2] * 32)
    assert "16-row steps" in act_order_plan(uneven, 64)
    assert "K % 16" in act_order_plan(torch.zeros(40, dtype=torch.int64), 40)


def test_refusals_name_the_constraint():
    kern = get_kernel("cuda-w4a16")
    cpu = torch.device("cpu")
    lay = PackedLayer.from_plain(random_plain(32, 96, group_size=24, seed=1))
    why = kern.check(lay, torch.float16, cpu)
    assert any("runs on cuda" in w for w in why)
    assert any("group size 24 is not a multiple of 16" in w for w in why)
    lay = PackedLayer.from_plain(random_plain(32, 128, group_size=32, seed=1))
    assert kern.check(lay, torch.float32, cpu)[-1].startswith("cuda-w4a16 takes fp16/bf16")


def test_cache_key_follows_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CUDA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    for name in build.sources():
        (src / name).write_bytes((build.CSRC / name).read_bytes())
    monkeypatch.setattr(build, "CSRC", src)
    a = build.cubin_path((9, 0))
    assert a.parent == tmp_path / "cache" and a.name.endswith("-sm90.cubin")
    assert build.cubin_path((8, 0)) != a and build.gencode((9, 0)) == "arch=compute_90a,code=sm_90a"
    assert build.gencode((8, 9)) == "arch=compute_89,code=sm_89"
    (src / "w4a16.cu").write_text((src / "w4a16.cu").read_text() + "\n// edited\n")
    b = build.cubin_path((9, 0))
    assert b != a  # an edited kernel is never served from a stale cubin
    f = build.cubin_path((9, 0), "fp8_gemv.cu")
    assert f.name.startswith("fp8_gemv-") and f != b
    (src / "fp8_gemv.cu").write_text((src / "fp8_gemv.cu").read_text() + "\n// edited\n")
    assert build.cubin_path((9, 0)) == b and build.cubin_path((9, 0), "fp8_gemv.cu") != f  # each unit its own key
    f = build.cubin_path((9, 0), "fp8_gemv.cu")
    (src / "xr.cuh").write_text((src / "xr.cuh").read_text() + "\n// edited\n")
    assert build.cubin_path((9, 0)) != b  # nor an edited header
    assert build.cubin_path((9, 0), "fp8_gemv.cu") != f  # which any unit may include
    (src / "notes.txt").write_text("not a source")
    assert build.sources() == sorted(build.sources()) and "notes.txt" not in build.sources()
    a.parent.mkdir(parents=True)
    a.write_bytes(b"stale")
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(Exception, match="nvcc"):
        build.cubin_for((9, 0))


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("cc", [(8, 9), (9, 0)])
def test_nvcc_builds_the_fp8_gemv_without_spills(cc, tmp_path):
    from qtool.kernels import cuda_fp8

    res = subprocess.run([build.find_nvcc(), *build.FLAGS, "-gencode", build.gencode(cc), "-Xptxas", "-v",
                          "-o", str(tmp_path / "k.cubin"), str(build.CSRC / cuda_fp8.UNIT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(re.findall(r"Compiling entry function '(\w+)'", res.stderr)) == cuda_fp8.entry_points()
    assert "warning" not in res.stderr.lower()
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", res.stderr)]
    assert len(spills) == len(cuda_fp8.entry_points()) and max(spills) == 0
    if cc == (9, 0):  # the plan's occupancy: 64 registers a thread, 32 warps an SM
        regs = [int(v) for v in re.findall(r"Used (\d+) registers", res.stderr)]
        assert max(regs) <= 65536 // (32 * cuda_fp8.WARPS_PER_SM)


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("cc", [(8, 0), pytest.param((9, 0), marks=pytest.mark.slow)])
def test_nvcc_builds_every_entry_point_without_spills(cc, tmp_path):
    out = tmp_path / "k.cubin"
    res = subprocess.run([build.find_nvcc(), *build.FLAGS, "-gencode", build.gencode(cc), "-Xptxas", "-v",
                          "-o", str(out), str(build.CSRC / build.MAIN)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    names = set(re.findall(r"Compiling entry function '(\w+)'", res.stderr))
    assert names == set(launch.kernels(cc))
    assert "warning" not in res.stderr.lower()
    # ptxas says so (as info, not a warning) where it must serialize the wgmmas: each waits for the previous one
    assert "Performance Loss" not in res.stderr, re.findall(r".*Performance Loss.*", res.stderr)[:3]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", res.stderr)]
    assert spills and max(spills) == 0
    # No memory access through an odd uniform register pair: nvcc 13.0 gave the wgmma producer's policy-hinted
    # cp.asyncs such a descriptor, which faults on the GPU (illegal instruction; csrc/wgmma.cuh says more).
    import triton  # its wheel carries a cuobjdump

    dump = shutil.which("cuobjdump") or next(Path(triton.__file__).parent.glob("backends/nvidia/bin/cuobjdump"), None)
    if dump is not None:
        sass = subprocess.run([str(dump), "-sass", str(out)], capture_output=True, text=True, check=True).stdout
        assert "LDGSTS" in sass and not re.search(r"desc\[UR\d*[13579]\]", sass)
    assert Path(out).stat().st_size > 0


def test_launch_structs_match_cuda_h():
    """ctypes mirrors of CUlaunchAttribute / CUlaunchConfig (cuda.h, CUDA 12-13): sizes and offsets of the fields
    cuLaunchKernelEx reads (an id padded to 8 bytes and a 64-byte value union; 7 uints, then the stream,
    the attribute pointer and their count)."""
    import ctypes

    from qtool.kernels.cuda.driver import CUlaunchConfig, LaunchAttribute, ex_config

    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(CUlaunchConfig) == 56
    assert (CUlaunchConfig.hStream.offset, CUlaunchConfig.attrs.offset, CUlaunchConfig.numAttrs.offset) == (32, 40, 48)
    attrs = (LaunchAttribute * 2)()
    cfg = ex_config((3, 2, 1), 256, 4096, 1234, attrs, pdl=True, cluster=(1, 1, 1))
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.sharedMemBytes) == (
        3, 2, 1, 256, 1, 4096)
    assert cfg.hStream == 1234 and cfg.numAttrs == 1 and cfg.attrs[0].id == 6  # PROGRAMMATIC_STREAM_SERIALIZATION
    assert attrs[0].value[0] == 1  # programmaticStreamSerializationAllowed
    # both: the cluster dimension (id 4) as three uints {2, 1, 1} at the start of the union
    attrs = (LaunchAttribute * 2)()
    cfg = ex_config((132, 1, 1), 256, 4096, 1234, attrs, pdl=True, cluster=(2, 1, 1))
    assert cfg.numAttrs == 2 and (cfg.attrs[0].id, cfg.attrs[1].id) == (6, 4)
    dims = (ctypes.c_uint * 3).from_buffer(attrs[1], LaunchAttribute.value.offset)
    assert list(dims) == [2, 1, 1]
    attrs = (LaunchAttribute * 2)()
    cfg = ex_config((32, 4, 1), 256, 4096, 1234, attrs, pdl=False, cluster=(1, 4, 1))  # a wgmma tile's K splits
    dims = (ctypes.c_uint * 3).from_buffer(attrs[0], LaunchAttribute.value.offset)
    assert cfg.numAttrs == 1 and cfg.attrs[0].id == 4 and list(dims) == [1, 4, 1]


def test_tensor_map_mirror_matches_cuda_h():
    """The x tensor map of the wgmma kernel's TMA form: CUtensorMap is 128 opaque bytes (the kernel's TMap), and
    the enum values launch passes to cuTensorMapEncodeTiled are cuda.h's (checked against the header if present)."""
    import ctypes

    from qtool.kernels.cuda import driver

    assert ctypes.sizeof(driver.TensorMap) == 128
    header = next((p for p in (Path("/usr/local/cuda/include/cuda.h"),) if p.is_file()), None)
    if header is None:
        pytest.skip("no cuda.h to compare with")
    text = header.read_text(errors="replace")

    def value(enum: str, name: str) -> int:
        body = re.search(r"typedef enum " + enum + r"_enum \{(.*?)\}", text, re.S).group(1)
        v = -1
        for item in re.findall(r"(CU_\w+)(?:\s*=\s*(\w+))?", body):
            v = int(item[1], 0) if item[1] else v + 1
            if item[0] == name:
                return v
        raise KeyError(name)

    assert value("CUtensorMapDataType", "CU_TENSOR_MAP_DATA_TYPE_UINT16") == driver.TMAP_UINT16
    assert value("CUtensorMapSwizzle", "CU_TENSOR_MAP_SWIZZLE_128B") == driver.TMAP_SWIZZLE_128B
    assert value("CUtensorMapL2promotion", "CU_TENSOR_MAP_L2_PROMOTION_L2_128B") == driver.TMAP_L2_128B
    assert value("CUtensorMapInterleave", "CU_TENSOR_MAP_INTERLEAVE_NONE") == 0
    assert value("CUtensorMapFloatOOBfill", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE") == 0


def test_x_tensor_map_arguments(monkeypatch):
    """x_tensor_map asks the driver for x [rows][cols] (2-byte elements) as dims {cols, rows}, a row stride of
    2 cols bytes, boxes of 64 columns x box_rows rows, 128-byte swizzle, zero fill; at a 64-byte aligned address,
    whose 128 bytes come back as the kernel argument."""
    import ctypes

    from qtool.kernels.cuda import driver

    seen = {}

    class FakeLib:
        def cuTensorMapEncodeTiled(self, at, dtype, rank, ptr, dims, strides, box, estr, inter, swz, l2, oob):
            seen.update(at=at.value, dtype=dtype, rank=rank, ptr=ptr.value, dims=list(dims[:2]),
                        strides=list(strides[:1]), box=list(box[:2]), estr=list(estr[:2]), rest=(inter, swz, l2, oob))
            ctypes.memmove(at.value, bytes(range(128)), 128)
            return 0

    monkeypatch.setattr(driver, "_lib", lambda: FakeLib())
    m = driver.x_tensor_map(0x7F0000001000, 256, 8192, 128)
    assert seen["at"] % 64 == 0 and seen["ptr"] == 0x7F0000001000 and (seen["dtype"], seen["rank"]) == (1, 2)
    assert seen["dims"] == [8192, 256] and seen["strides"] == [16384] and seen["box"] == [64, 128]
    assert seen["estr"] == [1, 1] and seen["rest"] == (0, driver.TMAP_SWIZZLE_128B, driver.TMAP_L2_128B, 0)
    assert bytes(m) == bytes(range(128))


def test_x_map_is_cached_per_address_shape_and_box(monkeypatch):
    from qtool.kernels.cuda import driver, launch

    made = []
    monkeypatch.setattr(driver, "x_tensor_map", lambda *key: made.append(key) or key)
    st = SimpleNamespace(tmaps={})
    x = torch.zeros(4, 64, dtype=torch.float16)
    assert launch.x_map(st, x, 128) == launch.x_map(st, x, 128) and len(made) == 1
    launch.x_map(st, x, 64)
    launch.x_map(st, x[:2], 128)  # same address, another shape
    assert len(made) == 3 and made[0] == (x.data_ptr(), 4, 64, 128)


def test_tile_tensor_map_arguments(monkeypatch):
    """tile_tensor_map asks the driver for a tile-major [tiles][records][words] array of 4-byte words as dims
    {words, records, tiles}, byte strides {4 words, 4 words records}, boxes of one record of box_tiles tiles,
    unswizzled, 256-byte L2 promotion, zero fill (csrc/wgmma.cuh tma_load_3d reads it at {0, record, tile})."""
    import ctypes

    from qtool.kernels.cuda import driver

    seen = {}

    class FakeLib:
        def cuTensorMapEncodeTiled(self, at, dtype, rank, ptr, dims, strides, box, estr, inter, swz, l2, oob):
            seen.update(at=at.value, dtype=dtype, rank=rank, ptr=ptr.value, dims=list(dims[:3]),
                        strides=list(strides[:2]), box=list(box[:3]), estr=list(estr[:3]), rest=(inter, swz, l2, oob))
            ctypes.memmove(at.value, bytes(range(128, 256)), 128)
            return 0

    monkeypatch.setattr(driver, "_lib", lambda: FakeLib())
    m = driver.tile_tensor_map(0x7F0000002000, 1792, 128, 128, 16)  # 8192 x 28672's weights, 16 tiles a CTA
    assert seen["at"] % 64 == 0 and seen["ptr"] == 0x7F0000002000 and (seen["dtype"], seen["rank"]) == (2, 3)
    assert seen["dims"] == [128, 128, 1792] and seen["strides"] == [512, 65536] and seen["box"] == [128, 1, 16]
    assert seen["estr"] == [1, 1, 1] and seen["rest"] == (0, driver.TMAP_SWIZZLE_NONE, driver.TMAP_L2_256B, 0)
    assert bytes(m) == bytes(range(128, 256))


def test_w_maps_describe_the_state_and_are_cached(monkeypatch):
    """The wgmma kernel's weight, scale and zero maps cover the state's tile-major tensors (qweight [N16, KB, 32, 4],
    scales [N16, G, 8], zeros [N16, G, 4] int32) in boxes of the CTA's 4 x warpgroups tiles, once per scales
    tensor (fp16 and bf16 scales are two) and tile count."""
    from qtool.kernels.cuda import driver, launch

    made = []
    monkeypatch.setattr(driver, "tile_tensor_map", lambda *a: made.append(a) or a)
    n16, kb, g = 40, 80, 40
    st = SimpleNamespace(tmaps={}, qweight=torch.zeros(n16, kb, 32, 4, dtype=torch.int32),
                         zeros=torch.zeros(n16, g, 4, dtype=torch.int32))
    s16, s_bf = (torch.zeros(n16, g, 8, dtype=torch.int32) for _ in range(2))
    maps = launch.w_maps(st, s16, 12)
    assert maps == launch.w_maps(st, s16, 12) and len(made) == 3
    assert made == [(st.qweight.data_ptr(), n16, kb, 128, 12), (s16.data_ptr(), n16, g, 8, 12),
                    (st.zeros.data_ptr(), n16, g, 4, 12)]
    launch.w_maps(st, s_bf, 12)
    launch.w_maps(st, s16, 8)
    assert len(made) == 9


@pytest.mark.parametrize("n16,upt,ctas,warps", [(64, 64, 64, 16), (512, 64, 132, 16), (13, 3, 5, 4), (64, 32, 22, 4),
                                                (3, 7, 2, 5)])
def test_stream_k_cta_local_hand_over(n16, upt, ctas, warps):
    """A shared tile whose warps are all in one CTA is handed over in shared memory: its counter (the tile's first
    warp, CTA-relative) is used by no other shared tile of the CTA, and the partial slots of the CTA's warps never
    collide; a grid of whole tiles per CTA hands over nothing through global memory."""
    units, tw = n16 * upt, ctas * warps

    def start(w):
        return w * units // tw

    def owner(u):
        return ((u + 1) * tw - 1) // units

    counters, slots, global_tiles = {}, {}, 0
    for tile in range(n16):
        wa, wb = owner(tile * upt), owner(tile * upt + upt - 1)
        if wa == wb:
            continue
        cta = wa // warps
        if wb >= (cta + 1) * warps:
            global_tiles += 1
            continue
        la = wa - cta * warps
        assert (cta, la) not in counters
        counters[(cta, la)] = tile
        for w in range(wa, wb + 1):
            lw = w - cta * warps
            slot = 2 * lw if start(w) // upt == tile else 2 * lw + 1
            if w > wa:
                assert slot == 2 * lw
            assert (cta, slot) not in slots
            slots[(cta, slot)] = tile
    if n16 % ctas == 0:
        assert global_tiles == 0


def test_every_gpu_check_and_tuning_launch_is_plannable(monkeypatch):
    """The launches benchmarks/tune_cuda_w4a16.py makes on a GPU (--check's forced variants and the chain, --tune's
    candidates and variants) are valid configurations naming instantiated kernels, checked here on the CPU so a
    stale option fails before a device run does."""

    from qtool.kernels.cuda.launch import flags

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_cuda_w4a16 as tune

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for k, n in SHAPES + [(4096, 1024), (1536, 520), (512, 202)]:
        st = state(k, n)
        for m in (1, 5, 16, 33, 100, 256):
            base = choose(m, st)
            configs = [c for c in tune.forced_configs(m, st)]
            variants = [dataclasses.replace(base, **v) for v in tune.VARIANTS.values()]
            configs += variants
            configs += [c for c in tune.candidates(m) if isinstance(c, Config)]
            configs += [dataclasses.replace(base, pdl=p, trigger=t) for p, t in ((True, "wait"), (True, "start"))]
            if m == 16 and k == 8192:  # --scaling's launches (K 8192)
                configs += [c for mm, c in tune.SCALING if mm == m and isinstance(c, Config)]
            for cfg in configs:
                if cfg.kind == SK and not launch.sk_fits(m, st):
                    continue  # the scripts only force stream-K where it takes the layer
                try:
                    p = plan(cfg, m, st)
                except ValueError:
                    if cfg in variants and cfg.cluster:  # no cluster kernel for this layer: the script times the default
                        continue
                    raise
                for dt in ("f16", "bf16"):
                    assert p["name"].replace("{dt}", dt) in ENTRY, (cfg, p["name"])
                flags(cfg, p["grid"][0], 132)


def test_every_curve_family_is_plannable(monkeypatch):
    """benchmarks/tune_cuda_w4a16.py --curve's launch families, each a function of the rows' predicates and
    launches: on the bench shapes every family gives, somewhere, a launch that plans and names instantiated kernels
    (a family whose launch does not plan is skipped on the GPU, so a stale one would go unmeasured unseen)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tune_cuda_w4a16 as tune

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    planned = dict.fromkeys(tune.CURVE_FAMILIES, 0)
    for k, n in ((8192, 8192), (8192, 1024), (8192, 28672), (28672, 8192), (5120, 27648), (2048, 768),
                 (768, 2048), (384, 384), (8192, 256), (3584, 18944), (8192, 57344)):
        st = state(k, n)
        for m in (1, 2, 6, 12, 16, 24, 40, 64, 72, 100, 128, 150, 192, 200, 256):
            for fam, make in tune.CURVE_FAMILIES.items():
                cfg = make(m, st)
                if cfg is None:
                    continue
                try:
                    p = plan(cfg, m, st)
                except ValueError:
                    continue  # --curve skips it there too
                assert {p["name"].replace("{dt}", dt) for dt in ("f16", "bf16")} <= ENTRY, (fam, cfg)
                planned[fam] += 1
    assert [fam for fam, c in planned.items() if not c] == ["default"]  # the dispatch's own launch: None


def test_x_in_registers_plan():
    """K groups of warps x r blocks; units (K group, tile) over about ctas_per_sm CTAs per SM; partials per K
    group in the workspace only when there are several; every built shape fits one CTA per SM."""
    from qtool.kernels.cuda.launch import XR_MAX_WARPS, xr_smem, xr_units

    for (nt, r, d, t, b, c), sl in built.XR.items():
        cfg = Config(kind=XR, nt=nt, r=r, t=t, depth=d, warps=XR_MAX_WARPS.get((nt, r), 16), bias=b, cluster=c)
        st = state(8192, 28672) if c else state(8192, 8192)  # a cluster takes exactly two K groups
        name = plan(cfg, 8 * nt, st)["name"]
        assert {name.replace("{dt}", "f16"), name.replace("{dt}", "bf16")} <= ENTRY
        assert name.endswith(("_b" if b else "") + ("_c" if c else ""))
        # every built form, at its most warps, fits one CTA per SM
        assert xr_smem(XR_MAX_WARPS.get((nt, r), 16), r, d, nt, t, sl, b, c) <= SMEM_MAX - 1024
    cfg = Config(kind=XR, nt=2, r=4, warps=16, depth=3, ctas_per_sm=1.0)
    gate = plan(cfg, 16, state(8192, 28672))  # 128 blocks: 2 K groups of 64, 1792 tiles
    assert gate["grid"] == (132, 1, 1) and gate["block"] == 512 and gate["splits"] == 2
    assert gate["name"] == "qt_xr_{dt}_nt2_r4_d3" and gate["rows"] == 16
    assert gate["ws_floats"] == 2 * 1792 * 32 * 2 * 4 and gate["counters"] == 1792
    assert gate["smem"] == 16 * 3 * 4 * 560 + 4 * 16 * 32 * 2 * 16 + 4 * 16
    pair = plan(Config(kind=XR, nt=2, r=8, t=2, warps=8, depth=2), 16, state(8192, 28672 - 16))  # 1791 tiles
    assert pair["name"] == "qt_xr_{dt}_nt2_r8_d2_t2_s4" and pair["splits"] == 2 and pair["counters"] == 1791
    assert pair["smem"] == 8 * 2 * 2 * 8 * 560 + 4 * 8 * 2 * 2 * 512 + 4 * 16 and pair["block"] == 256
    assert pair["ws_floats"] == 2 * 1791 * 32 * 2 * 4 and xr_units(state(8192, 28672 - 16), 8, 8, 2) == 2 * 896
    down = plan(cfg, 9, state(28672, 8192))
    assert down["splits"] == 7 and down["grid"] == (132, 1, 1)
    one = plan(Config(kind=XR, nt=2, r=4, warps=16), 16, state(4096, 512))  # one K group: y stored in place
    assert one["splits"] == 1 and one["ws_floats"] == 0 and one["counters"] == 0
    assert one["grid"] == (32, 1, 1)  # never more CTAs than units
    assert plan(Config(kind=XR, nt=1, r=4, warps=5, ctas_per_sm=0.7), 3, state(384, 200))["grid"] == (13, 1, 1)
    assert cfg.label(2) == "cuda xr nt2 r4 w16 d3 1/sm kg2"
    eight = plan(Config(kind=XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0), 16, state(8192, 28672))
    assert eight["block"] == 256 and eight["splits"] == 2 and eight["name"] == "qt_xr_{dt}_nt2_r8_d3"
    assert eight["smem"] == 8 * 3 * 8 * 560 + 4 * 8 * 32 * 2 * 16 + 4 * 16
    # biased: the warps' sums of x follow their rings (r groups x 4 lanes x 16 bytes)
    biased = plan(Config(kind=XR, nt=2, r=8, t=2, warps=8, depth=2, bias=True), 16, state(28672, 8192))
    assert biased["name"] == "qt_xr_{dt}_nt2_r8_d2_t2_s4_b" and biased["splits"] == 7 and biased["counters"] == 512
    assert biased["smem"] == 8 * 2 * 2 * 8 * 560 + 4 * 8 * 2 * 2 * 512 + 4 * 16 + 8 * 8 * 64
    # a cluster of 2 per range of tile units (two K groups): an even grid, no workspace, rank 1's sums in rank 0
    cl = Config(kind=XR, nt=2, r=8, t=2, warps=8, depth=2, bias=True, cluster=True, ctas_per_sm=1.0)
    pc = plan(cl, 16, state(8192, 28672))
    assert pc["name"] == "qt_xr_{dt}_nt2_r8_d2_t2_s4_b_c" and pc["cluster"] == (2, 1, 1) and pc["grid"] == (132, 1, 1)
    assert pc["ws_floats"] == 0 and pc["counters"] == 0 and pc["splits"] == 2
    assert pc["smem"] == biased["smem"] + 4 * (2 * 2 * 512 + 16) <= SMEM_MAX - 1024
    odd = plan(dataclasses.replace(cl, ctas_per_sm=0.05), 16, state(8192, 256))  # 7 CTAs: 3 clusters
    assert odd["grid"] == (6, 1, 1)
    assert plan(dataclasses.replace(cl, ctas_per_sm=1.0), 16, state(8192, 64))["grid"] == (4, 1, 1)  # 2 units
    assert cl.label(2) == "cuda xr bias cluster2 nt2 r8 t2 w8 d2 1/sm kg2"
    for bad_st in (state(28672, 8192), state(4096, 8192), state(8192, 28672, cc=(8, 0))):  # 7 and 1 K groups, sm_80
        with pytest.raises(ValueError, match="cluster"):
            plan(cl, 16, bad_st)
    with pytest.raises(ValueError, match="cluster"):  # not built biased with one-tile units
        plan(dataclasses.replace(cl, t=1, depth=3), 16, state(8192, 28672))
    for bad in (Config(kind=XR, nt=1, r=4), Config(kind=XR, nt=2, r=8, warps=16), Config(kind=XR, nt=2, r=8, depth=5),
                Config(kind=XR, nt=2, r=4, t=2, depth=2), Config(kind=XR, nt=2, r=4, depth=3, bias=True)):
        with pytest.raises(ValueError, match="x-in-registers"):
            plan(bad, 16, state(8192, 8192))
    with pytest.raises(ValueError, match="x-in-registers"):
        plan(cfg, 16, state(8192, 8192, post=False))



def _gen_kernels():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_kernels", build.CSRC / "gen_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_files_are_current():
    """csrc/w4a16.cu, csrc/wgmma_rs.cuh and qtool/kernels/cuda/built.py are what csrc/gen_kernels.py makes from its
    table (regenerated here in memory), and the build hashes every file the translation unit includes."""
    gen = _gen_kernels()
    for path, text in gen.outputs().items():
        assert path.read_text() == text, f"{path} is stale: run python csrc/gen_kernels.py"
    assert {build.MAIN, "wgmma_rs.cuh", *gen.HEADERS} <= set(build.sources())
    common, sm90 = gen.names()
    assert built.NAMES == set(common) and built.NAMES_SM90A == set(sm90) and not built.NAMES & built.NAMES_SM90A
    assert len(common) == len(set(common)) and len(sm90) == len(set(sm90))  # no name built twice


def test_sources_are_short():
    for path in sorted(build.CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".py"):
            assert len(path.read_text().splitlines()) < 1000, path.name


def test_choose_and_plan_match_the_frozen_choices(monkeypatch):
    """For every point of tests/data/cuda_choices.json (M 1-8192, the configs/models.yaml shapes and some odd ones,
    five group shifts, sm_80 and sm_90 profiles), choose() and plan() give the launch recorded there, and it
    names a kernel the device's cubin has."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cuda_choices

    monkeypatch.delenv("QTOOL_CUDA_PDL", raising=False)
    want = json.loads(cuda_choices.DATA.read_text())
    got = cuda_choices.record(want["shapes"])
    for key, runs in want["runs"].items():
        dev = key.split("/")[0]
        expect = [(a, b, want["launches"][i]) for a, b, i in runs]
        assert [(a, b, got["launches"][i]) for a, b, i in got["runs"][key]] == expect, key
        assert got["plans"][key] == want["plans"][key], key
        for _, _, lc in expect:
            assert set(lc["names"]) <= launch.kernels(tuple(want["devices"][dev][0])), (key, lc)


# a point where each row of rows.ROWS is the first to apply: (M, K, N, compute capability, group shift)
ROW_POINTS = {
    "wgmma bn24": (24, 28672, 8192, (9, 0), 7), "wgmma bn32": (32, 28672, 8192, (9, 0), 7),
    "wgmma bn32 tiles, small layer": (48, 2048, 768, (9, 0), 7), "x in registers, eight batch tiles": (48, 384, 384, (9, 0), 7),
    "wgmma bn40": (40, 8192, 8192, (9, 0), 7), "wgmma bn48": (48, 8192, 8192, (9, 0), 7), "wgmma bn64": (64, 8192, 8192, (9, 0), 7),
    "wgmma bn64 tiles, small layer": (128, 8192, 256, (9, 0), 7), "wgmma bn96": (80, 8192, 8192, (9, 0), 7), "wgmma bn112": (100, 8192, 8192, (9, 0), 7),
    "wgmma bn128": (120, 8192, 8192, (9, 0), 7), "wgmma bn128 narrow": (256, 8192, 1024, (9, 0), 7),
    "wgmma bn160": (140, 8192, 8192, (9, 0), 7), "wgmma bn192": (176, 8192, 8192, (9, 0), 7),
    "wgmma bn224": (208, 8192, 8192, (9, 0), 7),
    "wgmma bn256": (256, 8192, 28672, (9, 0), 7),
    "x in registers, four blocks a warp, one batch tile": (8, 5120, 27648, (9, 0), 7),
    "x in registers, four blocks a warp": (16, 2048, 768, (9, 0), 7), "x in registers, one batch tile": (4, 8192, 8192, (9, 0), 7),
    "stream-K tile per CTA": (1, 8192, 1024, (9, 0), 7),
    "stream-K whole tiles": (1, 28672, 8192, (9, 0), 7), "stream-K 1/SM": (1, 8192, 28672, (8, 0), 7),
    "x in registers, two-tile units": (16, 8192, 28672, (9, 0), 7),
    "x in registers": (16, 8192, 8192, (9, 0), 30), "x streamed, small layer": (9, 8192, 1024, (9, 0), 6),
    "x streamed": (16, 8192, 8192, (8, 0), 7), "mma M <= 8": (4, 28672, 8192, (9, 0), -1),
    "mma M <= 16, small layer": (16, 8192, 1024, (9, 0), -1),
    "mma M <= 16": (12, 8192, 28672, (8, 0), 7), "x in registers, four batch tiles": (32, 4096, 1024, (9, 0), 7),
    "mma": (256, 8192, 8192, (8, 0), 7),
}


def test_every_row_is_reachable_and_built():
    """Each row of the launch table is the first to match somewhere (so none is dead), its launch names a kernel
    the device's cubin has, and its evidence is one sentence."""
    assert [r.name for r in rows.ROWS] == list(ROW_POINTS)
    for row in rows.ROWS:
        m, k, n, cc, gs = ROW_POINTS[row.name]
        st = state(k, n, cc=cc, gbps=H100_GBPS, gshift=gs, n_sm=132 if cc == (9, 0) else 108)
        assert rows.choose_row(m, st) is row, row.name
        p = plan(choose(m, st), m, st)
        assert {p["name"].replace("{dt}", dt) for dt in ("f16", "bf16")} <= launch.kernels(cc), row.name
        assert p["smem"] <= launch.smem_per_sm(cc), row.name
        assert row.why.endswith(".") and ". " not in row.why and "pass" not in row.why, row.name
