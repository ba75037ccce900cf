"""Which launch `cuda-w4a16` takes: the rows of the dispatch table (ROWS, first match wins), the wgmma kernel's cost
model (wg_cost), its grid's tail launch (wg_tailed), cluster sums (wg_clustered) and programmatic launch
(wg_programmatic).

`choose(m, state)` is a pure function of the batch size and the layer's state (K, N, group shift, device facts:
compute capability, SMs, the driver's cluster capacity); launch.py holds what a launch is (Config), its grid
(plan) and the call. The measurements behind each rule are named where it is defined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from qtool.kernels.cuda import built
from qtool.kernels.cuda.launch import (
    MMA,
    SK,
    WG_CLUSTER_MAX,
    WG_STAGES,
    WGMMA,
    XR,
    XS,
    Config,
    clusters_fit,
    plan,
    sk_fits,
    wgmma_ok,
    xr_kgroups,
    xr_units,
)


def small_layer(st) -> bool:
    """A layer of at most 16 64-k blocks per warp of 8 warps per SM (Llama-3-70B's k/v: 8192 blocks): too few
    for a grid of split work to keep every SM streaming, so small M gives it its own launch shape."""
    return -(-st.N // 16) * -(-st.K // 64) <= 16 * 8 * st.n_sm


def _n16(st) -> int:
    return -(-st.N // 16)


def _wg_tiles(m: int, st) -> int:
    """128-row weight tiles x 256-column batch tiles of a bn256 wgmma grid."""
    return -(-st.N // 128) * -(-m // 256)


# The wgmma kernel runs one CTA per SM, so a grid of a wave and a bit takes two CTA times. Its launch is sized by
# a cost model instead of a fixed shape: the waves times each CTA's share (4 x warpgroups tiles x its 64-k blocks),
# divided by the warpgroups' rate, plus the split partials written and read back; the least cost wins. The two
# constants come from the family sweep in benchmarks/results/tune-curve.json, key h100-2026-12-05 (bn64 and bn128
# with 2, 3 and 4 consumer warpgroups over 12 Llama-3 and Qwen2.5-7B shapes at M 32-128, on an H100): on those
# launches the model ranks the fastest first at 55 of 60 points, the other five within 11 % of it.
WG_RATE = {2: 1.0, 3: 1.15, 4: 1.15}  # per-SM rate: more warps hide more of the dequantize-and-issue latency
WG_PARTIAL = 0.5  # cost of a partial sum's bytes against a weight byte (they stay in L2)


def wg_cost(bn: int, wgs: int, splits: int, st) -> float:
    """The model's time of a one-CTA-per-SM wgmma grid of one batch tile (M <= bn), in 64-k blocks of one 16-row
    tile (512 weight bytes)."""
    n16, kb = _n16(st), -(-st.K // 64)
    kbps = -(-kb // splits)
    splits = -(-kb // kbps)
    waves = -(-(-(-n16 // (4 * wgs)) * splits) // st.n_sm)
    partials = WG_PARTIAL * splits * bn * n16 * 16 * 8 / (st.n_sm * 512) if splits > 1 else 0.0
    return waves * 4 * wgs * kbps / WG_RATE[wgs] + partials


def wg_counts(bn: int, stages: int = 0) -> list[int]:
    """The consumer warpgroup counts built for bn batch columns with `stages` x-tile stages (0: WG_STAGES[bn]) and
    x by TMA (GPTQ packs K in words of 8, so every layer takes that form)."""
    stages = stages or WG_STAGES[bn]
    return sorted({w for b, w, s, tma in built.WG if b == bn and s == stages and tma})


def wg_least(bn: int, st, one_wave: bool = False) -> tuple[float, Config] | None:
    """The least-cost wgmma launch of bn batch columns (wg_cost) among the consumer warpgroup counts built
    (wg_counts) and the K splits of at least 8 blocks, and its cost; at equal cost, more warpgroups, then fewer
    splits. one_wave: only grids of at most one CTA an SM (None where there is none)."""
    n16, kb = _n16(st), -(-st.K // 64)
    fits = [(wg_cost(bn, w, s, st), -w, s, w) for w in wg_counts(bn) for s in range(1, max(1, kb // 8) + 1)
            if not one_wave or -(-n16 // (4 * w)) * s <= st.n_sm]
    if not fits:
        return None
    cost, _, splits, wgs = min(fits)
    return cost, Config(kind=WGMMA, bn=bn, wgs=wgs, splits=splits, min_blocks=8)


def wg_launch(bn: int) -> Callable[[object], Config]:
    """wg_least's launch of bn batch columns, as a row's launch."""
    return lambda st: wg_least(bn, st)[1]


def _wg_m(lo: int, hi: int) -> Callable[[int, object], bool]:
    """A row's condition: lo < M <= hi on sm_90a (the wgmma kernel)."""
    return lambda m, st: lo < m <= hi and wgmma_ok(st.cc)


# A small layer at M > 64 (k/v, MoE experts) gives a one-batch-tile wgmma grid of 16-64 CTAs, each walking 8-16
# 64-k blocks of its K split: the CTAs' fill and drain set the time. As 64-column batch tiles the grid has ceil(M /
# 64) times the CTAs. Measured (H100, fp16, two orders, benchmarks/results/tune-curve.json key h100-2026-12-06-tmaw
# `narrowkv`) where the work per SM, 64-k blocks of a 16-row tile times 128-column batch tiles, is at most
# WG_SMALL_BLOCKS: 1-20 % less time at every M of 96, 128, 192 and 256 (Llama-3-70B TP=4's 8192 x 256 at M = 256
# 12.2 against 14.8 us, the MoE expert's 768 x 2048 at M = 128 7.1 against 9.3); above it, on 5120 x 1024 and
# 8192 x 1024 at M = 96, 2-7 % more, and on 8192 x 512 at M = 256 3 % less.
WG_SMALL_BLOCKS = 32


def _wg_small(m: int, st) -> bool:
    """64 < M <= 256 on sm_90a, on a layer of at most WG_SMALL_BLOCKS 64-k blocks of a 16-row tile and 128-column
    batch tile per SM."""
    return (64 < m <= 256 and wgmma_ok(st.cc)
            and _n16(st) * -(-st.K // 64) * -(-m // 128) <= WG_SMALL_BLOCKS * st.n_sm)


def _wg_whole(bn: int) -> Config:
    """One bn-column tile covering the batch, two consumer warpgroups, one CTA an SM, K split to fill the SMs."""
    return Config(kind=WGMMA, bn=bn, wgs=2, ctas_per_sm=1.0, min_blocks=8)


def _xr_m16(m: int, st) -> bool:
    """M 9-16 on sm_90 with groups of >= 128 (or one group)."""
    return 8 < m <= 16 and st.gshift_blk >= 7 and tuple(st.cc) == (9, 0)


# Least K of the one-batch-tile x-in-registers row at M <= 8: 6 of the 8 warps of a K group of 8 x 8 blocks busy;
# below, too few warps stream each tile and stream-K (which stages all of x) takes the layer.
XR1_MIN_K = 3072


# Where stream-K would take a layer over equal ranges (wide layers: gate/up, and q/o past 4 tiles an SM), x in
# registers takes it at M <= 8 too: its time is nearly flat in M (Llama-3-70B's gate_proj 44.3 us at M = 1, 45.4 at
# M = 8), where the equal-range grid, which stages all of x per CTA and sums the tiles cut at range ends through the
# workspace, grows with M (44.5 us at M = 1, 46.8 at M = 3). H100, two orders, fp16 and bf16 (tune-curve.json
# h100-2026-12-06-xr, 'default' against 'sk 1/sm'): one batch tile of 8 blocks a warp took 4-6 % less time on
# Llama-3-70B's gate/up at M 2-3 (0-1 % at M = 1), 4-11 % on TP=2's 8192 x 14336 and 3-17 % on TP=4's 8192 x 7168
# at M 1-3, 3 % on Qwen2.5-32B's down_proj at M = 1. With K groups over a quarter idle (Qwen2.5-32B's 5120: four
# blocks a warp, _xr_r4) 7-23 % less on 5120 x 5120 at M 2-6 and from 4 % more to 7 % less on 5120 x 27648; at M = 1
# those two took 8-9 and 4-7 % more time so, and keep stream-K.
def _xr_m8(m: int, st) -> bool:
    """M <= 8 on sm_90, groups of >= 128 (or one group), K >= XR1_MIN_K, and either K within one K group of 8 warps
    x 8 blocks (no partial sums through the workspace), x too long for stream-K to stage, or a layer stream-K
    would take over equal ranges (_sk_ranges) but at M = 1 with K groups over a quarter idle (XR_LIVE_MIN)."""
    return (m <= 8 and st.gshift_blk >= 7 and tuple(st.cc) == (9, 0) and st.K >= XR1_MIN_K
            and (xr_kgroups(st, 8, 8) == 1 or not sk_fits(m, st)
                 or (_sk_ranges(m, st) and (m > 1 or xr_live(st) >= XR_LIVE_MIN))))


# Least share of an x-in-registers K group's warp blocks (8 warps x 8 64-k blocks) that hold K, below which a layer
# takes four blocks a warp (_xr_r4). A warp past K idles, and a K group's unit takes about as long with two busy
# warps as with eight: Qwen2.5-32B's K of 5120 (two groups of 64 blocks, the second three-quarters idle), the MoE
# expert's 2048 and 768, Llama-3-70B TP=4's 2048 and MiniLM's 384 and 1536 (one group half or more idle). With four
# blocks a warp and the fewest warps, up to 16, that keep the K groups of 16 warps, every group is full but for at
# most three blocks a warp of its last. H100, fp16, two orders (tune-curve.json h100-2026-12-06-r4):
# - where x in registers took those layers (M 8-16): 3-34 % less time (Qwen2.5-32B's gate_proj at M = 8
#   35.5 -> 29.6 us, the MoE expert's 768 x 2048 at M = 16 4.1 -> 2.7); on layers of 7/8 or more busy (K of 3584,
#   7168, 14336, 18944) from 4 % less to 15 % more, so those keep eight;
# - where stream-K took them (M <= 8, K under XR1_MIN_K): 6-27 % less time at every M 1-8 (the MoE expert's
#   2048 x 768 at M = 4 3.0 -> 2.4 us, TP=4's o_proj at M = 1 6.1 -> 4.9). Qwen2.5-32B's K of 5120 stays with
#   stream-K at M <= 6: its k/v took 8-28 % more time so, and q_proj 10 % more at M = 1.
XR_LIVE_MIN = 0.75


def xr_live(st, warps: int = 8, r: int = 8) -> float:
    """The share of the x-in-registers kernel's K-group warp blocks (warps x r each) that hold K."""
    kb = -(-st.K // 64)
    return kb / (xr_kgroups(st, warps, r) * warps * r)


def _xr_r4(m: int, st) -> bool:
    """At M <= 16 on sm_90 with groups of >= 128, a layer whose K groups of 8 warps x 8 blocks are less than
    XR_LIVE_MIN busy, where x in registers takes it (_xr_m8, _xr_m16) or K is under XR1_MIN_K."""
    short = m <= 8 and st.gshift_blk >= 7 and tuple(st.cc) == (9, 0) and st.K < XR1_MIN_K
    return (short or _xr_m8(m, st) or _xr_m16(m, st)) and xr_live(st) < XR_LIVE_MIN


def _xr_r4_launch(nt: int):
    """Four blocks a warp, nt batch tiles, the fewest warps (at most 16) that keep the K groups of 16."""
    def make(st) -> Config:
        kb = -(-st.K // 64)
        warps = -(-kb // (4 * xr_kgroups(st, 16, 4)))
        return Config(kind=XR, nt=nt, r=4, warps=warps, depth=4, ctas_per_sm=1.0, pdl=True)
    return make


# The x-in-registers launch of four batch tiles at M 17-32 (4 blocks a warp, 8 warps).
XR4 = Config(kind=XR, nt=4, r=4, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)


def _xr_m32(m: int, st) -> bool:
    """M 17-32 on sm_90, one group per 64-k block or coarser."""
    return 16 < m <= 32 and st.gshift_blk >= 0 and tuple(st.cc) == (9, 0)


# The bn32 wgmma launch against the four-tile x-in-registers one at M 17-32 (the 28 layer shapes of the seven
# bench models, fp16, two orders; benchmarks/results/tune-curve.json, key h200-2026-12-06-tmaw `narrow`, an H200).
# With its weights by tensor maps (csrc/wgmma.cuh TMA_W) a wgmma 64-k block of a 16-row tile costs 15-25 % less
# than an x-in-registers one where both fill the SMs (Llama-3-70B TP=2's 8192 x 14336 at M = 32: 33.5 against
# 43.6 us, Llama-3-8B's 4096 x 14336 20.0 against 23.9). The x-in-registers launch spreads better: its units are
# 2048-k groups of one tile, the wgmma CTA's are 8-16 tiles by a K split, one CTA an SM. So wgmma takes a layer
# whose bn32 grid is one wave and whose modelled cost (wg_cost) is within WG32_EDGE of the x-in-registers launch's
# 64-k blocks per SM (idle warps of a last, partial K group included). Measured: up to 1.28x that, wgmma was 1-22 %
# faster (3584 x 3584 at 1.28x: 9.2 against 11.3 us); at 1.5-2.6x the two were even (8192 x 1024, 4096 x 1024)
# but for 8192 x 512 (2.6x: 22 % slower); the MoE expert and 8192 x 256 (3-6x) 35-50 % slower. A grid of more
# than a wave (Qwen2.5-7B's 3584 x 18944 as 396 CTAs of 14 blocks at equal modelled cost) was 8 % slower, so the
# launch is the least-cost grid of one wave. Where no grid of bn32 tiles fits one wave (the fused gate_up_proj a
# serving engine launches: N of 37888-57344), the whole waves run unsplit and the tiles left over in a split tail
# launch (wg_tail_cost, as wg_tailed). Measured on an H100 (tune-curve.json key h100-2026-12-07-wide32; M 17-32,
# fp16 and bf16, two orders, every launch within its oracle bound) against four tiles of x in registers: the
# tail launch 20-29 % less time on Llama-3-70B's fused 8192 x 57344 (M = 24 fp16: 120.5 against 151.5 us),
# Qwen2.5-32B's 5120 x 55296 and Qwen2.5-7B's 3584 x 37888; the one-wave grid (three warpgroups, unsplit: 99
# CTAs) 16-21 % less on Qwen2.5-7B's 3584 x 18944. On the two widest layers four warpgroups unsplit, two waves,
# were within 4 % of the tail; the cost model's own multi-wave grids (K split 2-3 ways) 13-23 % slower.
WG32_EDGE = 1.4


def xr4_blocks_per_sm(st) -> float:
    """64-k blocks of one 16-row tile per SM of the four-tile x-in-registers launch (8 warps x 4 blocks a K
    group, the last group's idle warps counted)."""
    return xr_units(st, 8, 4) * 32 / st.n_sm


def wg32(st) -> tuple[float, Config] | None:
    """The bn32 wgmma launch the M 17-32 row weighs (the rules above) and its modelled cost: the least-cost grid of
    one wave, or where none fits one wave, the whole waves and a split tail; None for neither."""
    if one := wg_least(32, st, one_wave=True):
        return one
    if tail := wg_tail_least(32, 0, st):
        cost, w, t = tail
        return cost, Config(kind=WGMMA, bn=32, wgs=w, splits=0, min_blocks=8, tail=t)
    return None


def _wg_m32(m: int, st) -> bool:
    """M 17-32 on sm_90a where the bn32 wgmma launch (wg32) is modelled within WG32_EDGE of the x-in-registers
    one."""
    if not (16 < m <= 32 and wgmma_ok(st.cc)):
        return False
    pick = wg32(st)
    return pick is not None and pick[0] <= WG32_EDGE * xr4_blocks_per_sm(st)


# The bn24 and bn40 rows' launch is the wider tile's (its warpgroups, K splits, tail and clusters) with the narrower
# width. Evidence: tune-curve.json keys h100-2026-12-07-narrow (family `narrow`) and h100-2026-12-07-wider (family
# `as the wider tile`, on the committed kernel). A 56-column tile at M 49-56 gained under 2 % there: not built.
WHY_NARROW = ("At M 17-24 and 33-40 a 24- or 40-column wgmma tile covers the batch where a 32- or 48-column one "
              "spends a quarter or a sixth of its tensor-core work on empty columns: as the wider tile's launch with "
              "fewer columns, 1.2-3.0 % less time on the layer sums of the bench models (median 2.4-2.5 %; H100, "
              "fp16 and bf16, two orders) and on no layer more.")


def narrower(cfg: Config, bn: int) -> Config:
    """A wgmma launch with bn batch columns instead of its own (a narrower width that still covers M)."""
    return dataclasses.replace(cfg, bn=bn)


def _small64(m: int, st) -> bool:
    """M 33-64 on sm_90, one group per 64-k block or coarser, on a layer of at most one 16-row tile's 1024-k
    slice per SM (MoE experts, small k/v, BERT-size layers)."""
    return (32 < m <= 64 and st.gshift_blk >= 0 and tuple(st.cc) == (9, 0)
            and _n16(st) * -(-st.K // 1024) <= st.n_sm)


def _wg_small64(m: int, st) -> bool:
    """_small64 on a layer of at least 8 64-k blocks: two K splits of 4 blocks or more."""
    return _small64(m, st) and wgmma_ok(st.cc) and -(-st.K // 64) >= 8


def _xs_m16(m: int, st) -> bool:
    """M 9-16 with one group per 64-k block, on a layer of under 8 tiles per SM."""
    return m <= 16 and st.gshift_blk >= 0 and _n16(st) < 8 * st.n_sm


def _sk_tpc(st) -> int:
    """Whole tiles per CTA of the stream-K whole-tile grid: about one CTA per SM."""
    return max(1, round(_n16(st) / st.n_sm))


def _sk_one_wave(st) -> bool:
    """Whether the whole-tile grid fits one wave (no CTA waits for an SM while the others stream)."""
    return -(-_n16(st) // _sk_tpc(st)) <= st.n_sm


def _sk_tile_per_cta(m: int, st) -> bool:
    """Stream-K with one tile a CTA: a small layer of at most one tile per SM."""
    return sk_fits(m, st) and small_layer(st) and _n16(st) <= st.n_sm


def _sk_whole(m: int, st) -> bool:
    """Stream-K with whole tiles a CTA: a long-K layer or one of at most 4 tiles per SM, its CTAs one wave."""
    return (sk_fits(m, st) and _n16(st) >= st.n_sm and _sk_one_wave(st)
            and (st.K >= 2 * st.N or _n16(st) <= 4 * st.n_sm))


def _sk_ranges(m: int, st) -> bool:
    """Stream-K over equal ranges of the weight: a layer it takes with neither one nor whole tiles a CTA."""
    return sk_fits(m, st) and not _sk_tile_per_cta(m, st) and not _sk_whole(m, st)


def _sk_whole_tiles(st) -> Config:
    long_k = st.K >= 2 * st.N
    return Config(kind=SK, warps=16, tpc=_sk_tpc(st), zsub=True, depth=6 if long_k else 0)


# Two-tile units hold two tiles' 64-k blocks in each slot of a warp's ring, at depth 2 (shared memory holds no third).
# With one K group, or two that meet in a cluster (gate/up, biased weights), no partial sums go through the workspace
# and they are the faster form (H100: Llama-3-70B's gate_proj at M 10-16 3-6 % less time than one tile, Qwen2.5-7B's
# 3584 x 18944 as units of 7 warps 3-5 %). With more K groups (Llama-3-70B's and Qwen2.5-32B's down_proj) the memory
# decides: on an H200 (4.8 TB/s, 36 GB/s an SM) they took 6 % less time than one-tile units of depth 3 on
# Llama-3-70B's down_proj at M = 16 and the same on Qwen2.5-32B's (tune-curve.json h200-2026-12-03); on an H100
# (3.35 TB/s, 25 GB/s an SM) 5-21 % more on both at M 10-16, fp16 and bf16, two orders (tune-curve.json
# h100-2026-12-06-m16: 70B's 59.3 against 52.3 us, Qwen2.5-32B's 42.1 against 35.4 at M = 16, fp16). So they take such
# a layer only where the device's profile gives at least XR_T2_GBPS_SM an SM; an unknown device takes one tile.
XR_T2_GBPS_SM = 30.0


def _xr_t2(m: int, st) -> bool:
    """M 9-16 on sm_90 with groups of >= 128, at least 8 two-tile units per SM, and either at most two K groups
    (none through the workspace) or memory of at least XR_T2_GBPS_SM an SM."""
    return (_xr_m16(m, st) and xr_units(st, 8, 8, 2) >= 8 * st.n_sm
            and (xr_kgroups(st, 8, 8) <= 2 or st.hbm_gbps >= XR_T2_GBPS_SM * st.n_sm))


# The x-in-registers launch of one tile a unit at M 9-16 (8 blocks a warp, 8 warps).
XR1 = Config(kind=XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)


def _xr_two_tiles(st) -> Config:
    two = xr_kgroups(st, 8, 8) == 2
    return Config(kind=XR, nt=2, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0, pdl=True, bias=two,
                  cluster=two)


@dataclass(frozen=True)
class Row:
    """One row of the launch table: where it applies (M, the layer state), the launch (a Config, or made from the
    state), and the measurement behind it."""

    name: str
    when: Callable[[int, object], bool]
    config: Config | Callable[[object], Config]
    why: str

    def make(self, st) -> Config:
        return self.config(st) if callable(self.config) else self.config


# First matching row wins. The evidence is from benchmarks/tune_cuda_w4a16.py on an H200 over Llama-3-70B's
# layers (q/o 8192 x 8192, k/v 8192 x 1024, gate/up 8192 x 28672, down 28672 x 8192), and where a row names an
# H100, from its --curve sweep over the seven bench models (benchmarks/results/curve.md).
ROWS = (
    Row("wgmma bn24", lambda m, st: m <= 24 and _wg_m32(m, st), lambda st: narrower(wg32(st)[1], 24), WHY_NARROW),
    Row("wgmma bn32", _wg_m32, lambda st: wg32(st)[1],
        "At M 17-32 a layer that fills the SMs runs faster as a 32-column wgmma tile than with four batch tiles "
        "of x in registers, where its one-wave grid spreads nearly as evenly (WG32_EDGE; H200, fp16, M = 32: "
        "Llama-3-70B TP=2's 8192 x 14336 33.5 against 43.6 us, Qwen2.5-7B's 3584 x 3584 9.2 against 11.3), or "
        "past one wave as whole waves and a split tail (H100, M = 24: a fused 8192 x 57344 120.5 against 151.5)."),
    Row("wgmma bn32 tiles, small layer", _wg_small64,
        Config(kind=WGMMA, bn=32, wgs=2, ctas_per_sm=1.0, min_blocks=4),
        "At M 33-64 a small layer (MoE experts, small k/v) runs fastest as 32-column batch tiles, its K split to "
        "fill the SMs and summed in clusters: 2-34 % less time than eight batch tiles of x in registers on the four "
        "such bench shapes (H100, fp16, two orders, M = 64: the Qwen3-30B-A3B expert's 2048 x 768 5.5 against "
        "8.3 us, 768 x 2048 5.4 against 5.6, Qwen2.5-7B's 3584 x 512 6.5 against 8.5, Llama-3-70B TP=4's "
        "8192 x 256 9.0 against 9.7)."),
    Row("x in registers, eight batch tiles", _small64,
        Config(kind=XR, nt=8, r=2, warps=8, depth=3, ctas_per_sm=1.0, pdl=True),
        "A small layer too short in K to split (under 8 64-k blocks) is faster at M 33-64 with eight batch tiles of "
        "x in registers, its whole weight in flight at once, than as 32-column wgmma tiles each walking all of K "
        "(H100, fp16, two orders, M = 48: MiniLM-L6's 384 x 384 3.8 against 4.6 us, 384 x 1536 4.2 against 4.6)."),
    Row("wgmma bn40", _wg_m(32, 40), lambda st: narrower(wg_launch(48)(st), 40), WHY_NARROW),
    Row("wgmma bn48", _wg_m(32, 48), wg_launch(48),
        "At M 33-48 on sm_90a one 48-column wgmma tile per CTA covers the batch: no tensor-core work on a quarter "
        "of empty columns, never slower than bn64 on the 24 bench layer shapes that take wgmma there and up to 6 % "
        "faster (H200, fp16, M = 40: Llama-3-70B's gate_proj 80.7 against 85.7 us)."),
    Row("wgmma bn64", _wg_m(48, 64), wg_launch(64),
        "At M 49-64 on sm_90a one 64-column wgmma tile per CTA covers the batch, in the grid of least modelled cost "
        "(wg_cost): a wave and a bit runs two CTA times (Llama-3-70B's gate_proj at M = 64 on an H100: 224 CTAs "
        "of two warpgroups 106.7 us, 112 of four 87.5)."),
    Row("wgmma bn64 tiles, small layer", _wg_small,
        Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=4),
        "At M 65-256 a small layer (k/v, MoE experts) runs faster as 64-column batch tiles, its K split to fill "
        "the SMs, than as one wider tile in a grid of 16-64 CTAs (WG_SMALL_BLOCKS; H100, fp16: Llama-3-70B TP=4's "
        "8192 x 256 at M = 256 12.2 against 14.8 us, the MoE expert's 768 x 2048 at M = 128 7.1 against 9.3)."),
    Row("wgmma bn96", _wg_m(64, 96), wg_launch(96),
        "At M 65-96 one 96-column tile covers the batch where a 128-column one spends a quarter or more of its "
        "tensor-core work on empty columns: on the 28 bench layer shapes at M 72, 80 and 96 it took up to 30 % less "
        "time than the bn128 launch at 82 of 84 points and at most 2 % more at two (H100, fp16, two orders; "
        "Llama-3-70B's layer 1.25-1.28x dense -> 1.45-1.58x, the MoE expert's 0.60-0.62x -> 0.63-0.66x)."),
    Row("wgmma bn112", _wg_m(96, 112), wg_launch(112),
        "At M 97-112 one 112-column tile covers the batch where a 128-column one spends up to a quarter of its "
        "tensor-core work on empty columns: on the 28 bench layer shapes at M 100 and 112 it took up to 9 % less "
        "time than the launch M 128 gets at 104 of 112 points, and 2-14 % more at eight where that launch sums its "
        "K splits in clusters and this one through the workspace (H100, fp16 and bf16, two orders; Llama-3-70B's "
        "layer 1.35-1.39x dense -> 1.42-1.47x)."),
    Row("wgmma bn128", _wg_m(112, 128), wg_launch(128),
        "128 batch columns share each dequantized weight fragment over the whole batch, in the grid of least "
        "modelled cost (Qwen2.5-7B's gate_proj at M = 128 on an H100: 148 CTAs of two warpgroups 60.3 us, 99 of "
        "three 40.4)."),
    Row("wgmma bn128 narrow", lambda m, st: m > 128 and wgmma_ok(st.cc) and _wg_tiles(m, st) * 8 < st.n_sm,
        Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8),
        "A layer too narrow for a wave of 128 x 256 tiles (k/v) runs faster as small bn128 CTAs of 4 stages, two "
        "to an SM."),
    Row("wgmma bn160", _wg_m(128, 160), _wg_whole(160),
        "At M 129-160 one 160-column tile covers the batch where a 192-column one spends up to a third of its "
        "tensor-core work on empty columns: on the 19 bench layer shapes wider than the narrow row's, at M 136, 152 "
        "and 160, it took up to 14 % less time than the bn192 launch at 111 of 114 points and up to 9 % more at the "
        "other three (H100, fp16 and bf16, two orders; Llama-3-70B's layer 1.03-1.10x dense -> 1.13-1.17x)."),
    Row("wgmma bn192", _wg_m(160, 192), _wg_whole(192),
        "At M 161-192 one 192-column tile covers the batch where a 256-column one spends a quarter or more of its "
        "tensor-core work on empty columns: on the 19 bench layer shapes wider than the narrow row's it took 5-41 % "
        "less time than the bn256 launch at 56 of 57 points of M 136, 160 and 192 and 1 % more at one (H100, fp16, "
        "two orders; Llama-3-70B's layer 0.80-1.00x dense -> 1.07-1.20x), with 6 x-tile stages at least as fast as "
        "4 at 20 of 21 model points."),
    Row("wgmma bn224", _wg_m(192, 224), _wg_whole(224),
        "At M 193-224 one 224-column tile covers the batch where a 256-column one spends up to a quarter of its "
        "tensor-core work on empty columns: on the 20 bench layer shapes it takes, at M 200, 216 and 224, it took up "
        "to 15 % less time than the bn256 launch at 112 of 120 points and up to 5 % more at the other eight (H100, "
        "fp16 and bf16, two orders; Llama-3-8B's layer 0.90-0.94x dense -> 0.95-1.00x)."),
    Row("wgmma bn256", lambda m, st: m > 128 and wgmma_ok(st.cc),
        Config(kind=WGMMA, bn=256, wgs=2, ctas_per_sm=1.0, min_blocks=8),
        "At M > 224 one 256-column tile covers the batch with 4 x-tile stages, also on squarish layers of under a "
        "wave of tiles (q/o, the TP shards), where 6 stages were no faster: over two H100 runs of M 232 and 256, "
        "fp16 and bf16, two orders, 4 stages took less time at 73 of 96 points (median 1.6 % less, from 12 % less "
        "to 11 % more, within the runs' spread; tune-curve.json h100-2026-12-07-m256 runs.s4 and runs.v)."),
    Row("x in registers, four blocks a warp, one batch tile", lambda m, st: m <= 8 and _xr_r4(m, st),
        _xr_r4_launch(1),
        "A layer whose K groups of 8 warps x 8 blocks are over a quarter idle (XR_LIVE_MIN) runs faster at M <= 8 "
        "with four blocks a warp and its groups full, also where K is too short for the eight-block row and "
        "stream-K took it (H100, fp16, two orders: Qwen2.5-32B's gate_proj at M = 8 29.6 against 35.5 us, the MoE "
        "expert's 2048 x 768 at M = 4 2.4 against 3.0)."),
    Row("x in registers, four blocks a warp", lambda m, st: m > 8 and _xr_r4(m, st), _xr_r4_launch(2),
        "A layer whose K groups of 8 warps x 8 blocks are over a quarter idle (XR_LIVE_MIN) runs faster at M 9-16 "
        "with four blocks a warp and its groups full (H100, fp16, two orders: Llama-3-70B TP=4's o_proj at M = 16 "
        "6.8 against 8.1 us, the MoE expert's 768 x 2048 2.7 against 4.1)."),
    Row("x in registers, one batch tile", _xr_m8,
        Config(kind=XR, nt=1, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=True),
        "One batch tile of x in registers (8 blocks a warp) streams the weights with no x stream and no barrier per "
        "block, which beats stream-K on layers of one K group (Llama-3-8B at M = 3: q/o 6.3 against 10.4 us, "
        "gate/up 11.8 against 13.7) and on the wide layers it would take over equal ranges (H100, fp16, M = 3: "
        "Llama-3-70B TP=4's 8192 x 7168 13.6 against 16.4), and, where x is too long for stream-K (70B at M >= 4), "
        "the split-K mma kernel (q/o 14.2 against 25.4 us) and the two-tile M = 16 forms (q/o 14.2 against 16.3, "
        "k/v 5.7 against 6.9)."),
    Row("stream-K tile per CTA", _sk_tile_per_cta,
        Config(kind=SK, warps=16, tpc=1, depth=6, zsub=True),
        "A small layer of at most one tile per SM (k/v, MoE experts) puts its whole weight in flight with one "
        "16-warp CTA of 6-slot rings per tile, each tile summed in shared memory; with more tiles than SMs the "
        "CTAs queue in waves (Llama-3-70B's TP=4 o_proj, 2048 x 8192: 15.5 us against 5.8 with whole tiles)."),
    Row("stream-K whole tiles", _sk_whole, _sk_whole_tiles,
        "A long-K layer (down, with 6-slot rings) or one of at most 4 tiles per SM (q/o) is faster with whole "
        "tiles per CTA, every hand-over in shared memory, than with the equal-range grid, as long as the CTAs fit "
        "one wave: a second wave runs its tiles after the first (Qwen2.5-32B's down_proj, 320 tiles in 160 CTAs: "
        "36.2 us against 26.2 with equal ranges)."),
    Row("stream-K 1/SM", lambda m, st: sk_fits(m, st),
        Config(kind=SK, warps=16, ctas_per_sm=1.0, min_blocks=8, trigger="start"),
        "Wide layers (gate/up) stream best as one 16-warp CTA per SM over equal ranges, the next layer launched at "
        "this one's start (every SM has the same work, so the cascade is even)."),
    Row("x in registers, two-tile units", _xr_t2, _xr_two_tiles,
        "Layers of at least 8 two-tile units per SM (gate/up, down) run fastest with x in registers and one "
        "exchange per two tiles; with exactly two K groups (gate/up), biased weights summed in a cluster of 2; "
        "with more than two (down), on H200-class memory only (XR_T2_GBPS_SM)."),
    Row("x in registers", _xr_m16, XR1,
        "Any other layer (q/o, k/v, MoE experts, TP shards) is fastest with x in registers, one tile a unit, "
        "neither biased nor clustered: on the 11 bench shapes the x-streaming kernel took before, 1.07-1.38x "
        "faster (Qwen2.5-7B k/v at M = 16: 4.7 against 6.2 us)."),
    Row("x streamed, small layer", lambda m, st: _xs_m16(m, st) and small_layer(st),
        Config(kind=XS, nt=2, tn=1, warps=8, ctas_per_sm=3.0, min_blocks=8, pdl=True),
        "A small layer (k/v) at M 9-16 is fastest with x streamed by three 8-warp CTAs per SM, 8 blocks a warp at "
        "least, so few K splits meet at the end."),
    Row("x streamed", _xs_m16,
        Config(kind=XS, nt=2, tn=1, warps=16, ctas_per_sm=1.0, pdl=True),
        "A layer of under 8 tiles per SM is fastest with x streamed by one 16-warp CTA per SM, each warp a long K "
        "slice of one tile."),
    Row("mma M <= 8", lambda m, st: m <= 8,
        Config(kind=MMA, nt=1, tn=1, warps=4, ctas_per_sm=16.0),
        "Where neither stream-K nor the x-in-registers or x-streaming kernels take the layer, one tile per warp and "
        "about 16 CTAs of split K per SM beat two tiles per warp."),
    Row("mma M <= 16, small layer", lambda m, st: m <= 16 and small_layer(st),
        Config(kind=MMA, nt=2, tn=1, warps=4, depth=12, ctas_per_sm=4.0, min_blocks=4),
        "A small layer the faster kernels do not take is faster with one tile per warp and 12-slot rings, more of "
        "its few blocks in flight."),
    Row("mma M <= 16", lambda m, st: m <= 16,
        Config(kind=MMA, nt=2, tn=2, warps=8, ctas_per_sm=3.0),
        "Two tiles per warp share the x fragments, and about 3 CTAs of split K per SM keep every SM streaming."),
    Row("x in registers, four batch tiles", _xr_m32, XR4,
        "At M 17-32 four batch tiles of x in registers (4 blocks a warp) stream each weight byte once, which beats "
        "the split-K mma kernel on every bench shape and wgmma on the small layers the bn32 row leaves, whose "
        "wgmma grids spread unevenly (H200, fp16, M = 32: Llama-3-70B TP=4's 8192 x 256 7.3 against 9.7 us, the "
        "MoE expert's 2048 x 768 5.0 against 7.1)."),
    Row("mma", lambda m, st: True,
        Config(kind=MMA, nt=4, tn=2, warps=8, ctas_per_sm=3.0),
        "M 17-32, and any larger M without wgmma: four batch tiles per CTA, two tiles per warp."),
)


def choose_row(m: int, st) -> Row:
    """The first row of ROWS that applies to batch size m on the state's device."""
    return next(row for row in ROWS if row.when(m, st))


def choose(m: int, st) -> Config:
    """The launch for batch size m on the state's device: its row's, with a wgmma grid's last partial wave
    launched apart where wg_tailed says so, its K splits summed in thread-block clusters where wg_clustered
    does, and programmatic where wg_programmatic does."""
    return wg_programmatic(wg_clustered(wg_tailed(choose_row(m, st).make(st), m, st), m, st), st)


# A wgmma launch is a programmatic dependent launch on layers of at most WG_PDL_MAX_BYTES of 4-bit weights. Its
# CTAs then start while the previous kernel drains, set up their barriers and tensor maps and fill their first
# weight stages before they wait for it (csrc/wgmma.cuh): that saves about 1-3 us a call (median 1.5), most of a
# small layer's gap to cuBLAS. On an H100 (benchmarks/results/tune-curve.json, key h100-2026-12-06-pdl; seven models at
# M 24-256, fp16 and bf16, two orders, every output within its oracle bound): on layers of at most 32 MiB 1-22 %
# less time at all but one of 316 points (the MoE expert's 2048 x 768 and 768 x 2048 16-22 %, Llama-3-8B's q/o
# 6-18 %); on those of 56-68 MiB (70B TP=2's and Qwen2.5-32B's MLP) from 12 % less to 3 % more, less at 58 of 64
# points. On Llama-3-70B's MLP (112 MiB) that saving is a few percent of a 60-200 us call, and the launch
# measured from 6 % less to 7 % more: its down_proj (28672 x 8192) 3-7 % more at M 64-192 in both dtypes, its
# gate/up 2-7 % more at M 48-64. The line lies between those.
WG_PDL_MAX_BYTES = 96 << 20


def wg_programmatic(cfg: Config, st) -> Config:
    """cfg as a programmatic dependent launch where the rule above says so; cfg itself otherwise."""
    if cfg.kind != WGMMA or cfg.pdl is not None or st.K * st.N // 2 > WG_PDL_MAX_BYTES:
        return cfg
    return dataclasses.replace(cfg, pdl=True)


# The wgmma kernel holds one CTA an SM, so a grid of a wave and a bit takes two CTA times. At M > 96 (112- to
# 256-column tiles) the rows' grids can be such: Llama-3-70B's gate_proj is 224 tiles of 128 rows, Qwen2.5-7B's
# 148. There the whole waves are launched unsplit and the tiles left over after them, each tile's K split so that
# they fill the next wave (tail_splits). The tail's modelled cost (wg_tail_cost) against the grid's own (wg_cost)
# decides, over the warpgroup counts built. On an H100 (benchmarks/results/tune-curve.json, key
# h100-2026-12-06-tail; fp16 and bf16, two orders): Qwen2.5-7B's gate_proj took 24-28 % less time at M 144-256
# (70.3 -> 50.7 us at M = 144), Llama-3-70B's 11-19 % at M 112-128 with three warpgroups (138.4 -> 111.5 us at
# M = 112), Qwen2.5-32B's 12-17 %. The tail launch is programmatic, so its CTAs take the SMs as the first
# launch's leave: 8-10 % less time than in plain stream order. At M <= 96 the cost model already finds one-wave
# grids with more warpgroups a CTA. A tail there measured from 5 % faster to 2 % slower with three warpgroups
# against four (Llama-3-70B's and Qwen2.5-32B's gate_proj), and 17-24 % slower with two against three
# (Qwen2.5-7B's), so the tail starts above M = 96.
TAIL_MIN_M = 97
TAIL_MARGIN = 1.05  # the tail's modelled cost must be this much under the grid's: a second launch, its CTAs' fill


def tail_splits(left: int, kb: int, st) -> int:
    """K splits of a tail of `left` tiles: the most that keep it to one wave with at least 4 64-k blocks a split,
    in clusters where the driver says they all fit at once, else through the workspace; 0 for none."""
    fit = [s for s in range(2, WG_CLUSTER_MAX + 1)
           if left * s <= st.n_sm and kb // s >= 4 and clusters_fit(left, s, st)]
    spread = [s for s in range(2, kb // 4 + 1) if left * s <= st.n_sm]
    return fit[-1] if fit else spread[-1] if spread else 0


def wg_tail_cost(bn: int, wgs: int, t: int, st) -> float:
    """wg_cost's time of a grid of one batch tile launched as its whole waves, unsplit, and a tail of the tiles
    left over, each tile's K in t splits (the tail's waves counted, so a tail past one wave costs its waves)."""
    n16, kb = _n16(st), -(-st.K // 64)
    gx = -(-n16 // (4 * wgs))
    whole, left = divmod(gx, st.n_sm)
    tail_waves = -(-left * t // st.n_sm)
    partials = WG_PARTIAL * t * bn * left * 4 * wgs * 16 * 8 / (st.n_sm * 512)
    return 4 * wgs * (whole * kb + tail_waves * -(-kb // t)) / WG_RATE[wgs] + partials


def wg_tail_least(bn: int, stages: int, st) -> tuple[float, int, int] | None:
    """(wg_tail_cost, warpgroups, tail splits) of least cost among the warpgroup counts built whose one-batch-tile
    grid is a partial wave past a whole one with a tail that splits (tail_splits); None for none."""
    n16, kb = _n16(st), -(-st.K // 64)
    tails = [(wg_tail_cost(bn, w, t, st), w, t) for w in wg_counts(bn, stages)
             if (g := -(-n16 // (4 * w))) > st.n_sm and g % st.n_sm and (t := tail_splits(g % st.n_sm, kb, st))]
    return min(tails, default=None)


def wg_tailed(cfg: Config, m: int, st) -> Config:
    """cfg as whole waves and a split tail launch (Config.tail), with the warpgroups of least modelled cost,
    where its own grid is one batch tile a partial wave past a whole one and the tail costs less (the rules
    above); cfg itself otherwise."""
    if cfg.kind != WGMMA or m < TAIL_MIN_M or m > cfg.bn or cfg.tail or not wgmma_ok(st.cc):
        return cfg
    gx = -(-_n16(st) // (4 * cfg.wgs))
    if gx <= st.n_sm or not gx % st.n_sm:
        return cfg
    pick = wg_tail_least(cfg.bn, cfg.stages, st)
    if pick is None or pick[0] * TAIL_MARGIN >= wg_cost(cfg.bn, cfg.wgs, plan(cfg, m, st)["splits"], st):
        return cfg
    return dataclasses.replace(cfg, wgs=pick[1], splits=0, cluster=False, tail=pick[2])


# A wgmma launch's K splits meet either through the workspace (fp32 partials to L2, the tile's last CTA sums
# them) or in a thread-block cluster per tile (on chip, every CTA summing a slice: csrc/wgmma.cuh
# epilogue_cluster). Clusters are faster wherever the grid's clusters are resident at once, and 2x slower where
# they are not: a cluster's CTAs must share a GPC, so fewer clusters fit than SMs / size (st.cluster_slots,
# from the driver). Measured on an H100 over the 28 layer shapes of the seven bench models at M 32-256
# (benchmarks/results/tune-curve.json, key h100-2026-12-05-cluster; fp16):
# - the same splits in clusters, where they fit: never slower, up to 1.3x faster (Llama-3-70B TP=4 o_proj,
#   2048 x 8192 at M = 128: 17.7 -> 13.6 us; 7168 x 8192 at M = 256: 63.9 -> 50.0);
# - more than WG_CLUSTER_MAX splits (narrow layers): WG_CLUSTER_MAX splits in clusters where they fit
#   (Qwen2.5-32B's k/v, 5120 x 1024 at M = 128: 17.5 -> 12.6 us);
# - where the splits' clusters do not fit, the most splits whose clusters do, but only where the workspace
#   form's partials (8 splits M / K of the weight's bytes) are at least WG_CL_PARTIALS of its weight bytes:
#   there fewer splits cost less than the partials' traffic, elsewhere the lost parallelism costs more. The
#   H100 at 4 -> 3 splits of 32 tiles and 8 -> 6 of 16 (key h100-2026-12-06-cl, both dtypes, two orders): with
#   partials at 3/4 of the weight bytes 3 of 4 shapes ran 1-7 % slower in clusters (70B TP=4's 8192 x 2048 at
#   M = 192), at 1x 3 of 4 ran 3-10 % faster, at 1.5-2x all 9-18 % (Llama-3-8B q/o at M = 256: 29.1 -> 24.6
#   us); at 0.1x (Llama-3-70B's down_proj at M = 128: 3 splits, 117.7 us; 2 in clusters, 138.5) far slower.
WG_CL_PARTIALS = 1.0


def cluster_splits(tiles: int, splits: int, st) -> int:
    """The most K splits, up to `splits` and WG_CLUSTER_MAX, whose `tiles` clusters are all resident at once; 0 for
    none."""
    return max((s for s in range(2, min(splits, WG_CLUSTER_MAX) + 1) if clusters_fit(tiles, s, st)), default=0)


def wg_clustered(cfg: Config, m: int, st) -> Config:
    """cfg with its K splits summed in clusters where that is faster (the rules above); cfg itself otherwise."""
    if cfg.kind != WGMMA or cfg.cluster or cfg.tail or not st.cluster_slots:
        return cfg
    p = plan(cfg, m, st)
    splits = p["splits"]
    fit = cluster_splits(p["grid"][0] * p["grid"][2], splits, st)
    if fit and (fit == min(splits, WG_CLUSTER_MAX) or 8 * splits * m >= WG_CL_PARTIALS * st.K):
        return dataclasses.replace(cfg, splits=fit, cluster=True)
    return cfg
