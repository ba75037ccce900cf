"""Launch configurations of the `cuda-w4a16` kernels, chosen by M, and the call itself.

Why the choices look the way they do:
- M <= 8 (x small enough to stage whole): the stream-K kernel. The weight is cut into one equal contiguous range
  per warp of a persistent grid, so every SM streams the same bytes with no tail wave; the grid size per layer
  shape comes from benchmarks/tune_cuda_w4a16.py (bench.md, fifth pass).
- M = 9-16 on the H200's layers of at least 4 units (K group x tile) per SM with groups of >= 128 or one group:
  x held in registers (xr): a CTA of 8 warps owns a K group of 8 x 8 blocks and holds that x as mma fragments,
  then walks units of one or two tiles, each warp streaming its 8 blocks of each tile; the warps' partial sums
  meet in shared memory and the K groups' in the workspace once per warp after its loop. No x stream, no
  ldmatrix, no CTA barrier per block (bench.md, eleventh and twelfth passes). With two K groups (gate/up) the
  weights enter the mmas biased and the K groups meet in a thread-block cluster of 2 instead of the workspace
  (thirteenth pass).
- M = 9-16 on other layers of under 8 tiles per SM with one group per 64-k block (and on other GPUs): the
  x-streaming mma kernel (x through a ring of chunks in shared memory, so a CTA's K slice is not bounded by it):
  about one wave of CTAs, each warp one long contiguous run of its tile (bench.md, eighth pass).
- Other small M streams the weight: every SM must pull bytes at once, so the grid is sized to several CTAs per SM
  by splitting K (the x slice a CTA stages in shared memory is bounded by X_BUDGET, and the partial sums are
  finished by the last CTA of each tile in the same launch). Each warp owns TN 16-row tiles and keeps its
  ring's D - 1 blocks of weights in flight.
- Large M on Hopper is tensor-core bound: wgmma with 64-row warpgroup tiles x BN batch columns, x tiles
  shared by the CTA's warpgroups, about one CTA per SM, split-K only to fill the SMs. Where K % 8 == 0 a
  producer warpgroup copies each block's x tile (by the tensor memory accelerator: a tensor map made per x,
  cached on the state) and the CTA's weights into shared-memory stages, and gives its registers to the two
  consumer warpgroups (setmaxnreg), which then only dequantize and issue wgmmas: the per-block copies and CTA
  barriers of the cp.async form cost ~25 % at M = 256 (bench.md, ninth pass), and the consumers' own copies and
  recomputed addresses under 168 registers another ~10 % (tenth pass).
- On sm_90 the stream-K launches are programmatic dependent launches: the kernel streams its first weight blocks
  while the kernel before it on the stream finishes, and waits for it (griddepcontrol.wait) before it reads x or
  writes anything; prepare() synchronizes so the weights themselves are never that earlier kernel's output.
  QTOOL_CUDA_PDL=0 turns it off. The wgmma kernel can be launched so too (it gained nothing: off by default);
  the mma kernel never (it does not wait); the x-streaming and x-in-registers ones where choose() says so.
- Every kernel's weight copies carry an L2 evict-first policy (Config.evict): read once per call, they should not
  push out what is read again (x, the scale records, the next layer's first blocks). Worth ~20 us over the 70B
  layer at M = 1 and ~20 us at M = 16 (bench.md, seventh pass). Not the wgmma producer's copies: with the hint
  there, nvcc 13.0 emits a faulting instruction (csrc/w4a16.cu); at M = 256 it was worth ~2 % (ninth pass).
- The stream-K grids of whole tiles (k/v, down) subtract the zero point per fragment (Config.zsub) instead of
  correcting the block sums with sums of x: the x sums sat between the wait and the first mma.
The thresholds and split targets come from benchmarks/tune_cuda_w4a16.py on an H200 (benchmarks/results/
bench.md, "Fourth pass" to "Twelfth pass"; tune-cuda-h200-v4*.json, tune-cuda-h200-v6*.txt, -v7* to -v12*).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

MMA, WGMMA, SK, XS, XR = "mma", "wgmma", "sk", "xs", "xr"
SK_MAX_M = 8  # the stream-K kernel holds one 8-column batch tile
TRIGGER_FLAGS = {"wait": 0, "start": 1}  # Args::flags (csrc/w4a16.cu QT_PDL_EARLY)
EVICT_FLAGS = {"none": 0, "weights": 2}  # Args::flags QT_EVICT_FIRST
SK_BUILT = {(2, 4), (2, 6)}  # (blocks per unit, ring depth) instantiated in csrc/w4a16.cu
SK_X_BUDGET = 64 * 1024  # bytes of x it stages (all of K): beyond this, fewer CTAs fit per SM than it needs
SMEM_PER_SM = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024}  # usable per SM (and per CTA)
SMEM_OTHER = 99 * 1024  # sm_86 / sm_89
X_BUDGET = 32 * 1024  # bytes of x a mma CTA stages (its K slice): small enough for several CTAs per SM
WG_STAGES = {64: 6, 128: 6, 256: 4}  # default x-tile stages of the wgmma kernel per BN
XS_STAGES = 4  # x chunk slots of the x-streaming mma kernel (csrc/w4a16.cu QT_XS)
XS_BUILT = {(2, 1, 6, 2), (2, 1, 12, 4), (2, 2, 6, 2), (2, 2, 12, 4)}  # (nt, tn, ring depth, chunk blocks)
XS_PROBE_BUILT = (2, 1, 6, 2)  # the one shape its bandwidth probes (QT_XS_PROBE) are built for
# x in registers: (nt, blocks per warp and tile, ring depth, tiles per unit) -> partial-sum slots (csrc/w4a16.cu
# xr_small S); r 8 kernels take at most 8 warps (registers)
XR_BUILT = {(2, 4, 3, 1): 4, (2, 4, 4, 1): 4, (2, 2, 4, 1): 4, (1, 4, 4, 1): 4, (2, 8, 3, 1): 4, (2, 8, 2, 2): 4}
XR_BIAS_BUILT = {(2, 8, 3, 1), (2, 8, 2, 2)}  # the shapes built with biased weights (QT_XRB, QT_XRTB)
# its probes (fp16; csrc/w4a16.cu QT_XR_PROBE and after it): (probe, shape, biased, cluster). 1-7 on the eleventh
# and twelfth passes' shapes, 10 (K groups not summed) on the biased two-tile shape, 12 (right results and each
# warp's timeline in the workspace) on launch.choose()'s M = 9-16 launches on the H200
XR_PROBES_BUILT = ({(pr, (2, 4, 3, 1), False, False) for pr in (1, 2, 3, 4, 5, 7)}
                   | {(pr, (2, 8, 3, 1), False, False) for pr in (1, 2, 3)} | {(10, (2, 8, 2, 2), True, False)}
                   | {(12, sh, b, b) for sh, b in (((2, 8, 3, 1), False), ((2, 8, 2, 2), False), ((2, 8, 2, 2), True))})
XR_STAMP_U64 = 16  # probe 12: u64 a warp (csrc/w4a16.cu xr_small stamp_at)
XR_CLUSTER_BUILT = {(2, 8, 3, 1), (2, 8, 2, 2)}  # the shapes built as clusters of 2 (QT_XRC; sm_90a, both biases)
XR_CLUSTER_SLOTS = 4  # csrc/w4a16.cu xr_small S2: rank 1's sums of a unit waiting in rank 0
XR_MAX_WARPS = {8: 8}  # blocks per warp -> most warps a CTA (r 8: 128 registers of x, 255 a thread)
# wgmma (bn, warpgroups, stages) built as probes (QT_WG_PROBE, fp16, x by cp.async)
WG_PROBE_BUILT = {(128, 4, 6), (256, 2, 4)}
# (bn, warpgroups, stages) built with x read by the tensor memory accelerator (QT_WGT, ..._tma)
WG_TMA_BUILT = {(64, 2, 6), (128, 1, 6), (128, 2, 6), (128, 2, 4), (256, 2, 4), (256, 2, 6)}


def ring_depth(kind: str, post: bool, stages: int = 0, depth: int = 0) -> int:
    """Stream<D, NS> depth (blocks in flight per warp), as instantiated in csrc/w4a16.cu."""
    if kind == MMA:
        return (depth or 6) if post else 4
    if kind == SK:
        return depth or 4
    if kind == XS:
        return depth or 6
    if kind == XR:
        return depth or 4
    return stages if post else stages - 1


def slot_bytes(post: bool, tn: int = 1) -> int:
    """Stream<D, NS, TN>::SLOT: TN x (512 bytes of weights + NS 48-byte metadata records), NS = 1 or 4."""
    return tn * (512 + (1 if post else 4) * 48)


def ring_bytes_per_warp(kind: str, post: bool, stages: int = 0, tn: int = 1, depth: int = 0, ub: int = 2) -> int:
    """Stream<D, NS, TN>::BYTES_PER_WARP: D slots of TN x (512 bytes of weights + NS 48-byte metadata records);
    stream-K: D slots of UB x 512 bytes + one record."""
    if kind == SK:
        return ring_depth(kind, post, depth=depth) * (ub * 512 + 48)
    return ring_depth(kind, post, stages, depth) * slot_bytes(post or kind == XS, tn)


@dataclass(frozen=True)
class Config:
    """kind mma: nt = batch tiles of 8 per CTA (1, 2, 4), warps per CTA; kind xs: the same with x streamed in
    chunks of xc blocks (groups of >= 64 only); kind wgmma: bn (64/128/256), wgs warpgroups per CTA. splits: K
    splits (0 = choose from ctas_per_sm). post: scale fp32 block sums (mma)."""

    kind: str = MMA
    nt: int = 1
    tn: int = 2  # mma: adjacent 16-row tiles per warp (they share the x fragments and the loop's overhead)
    warps: int = 4
    bn: int = 128
    wgs: int = 2
    stages: int = 0  # wgmma x-tile stages (0: WG_STAGES[bn]); 4 stages at bn 128 fit two CTAs per SM
    splits: int = 0
    ctas_per_sm: float = 6.0
    min_blocks: int = 4  # 64-k blocks per warp at least
    depth: int = 0  # mma, post only: cp.async ring depth (0: 6; 12 is also built); sk: 0 = 4 (see SK_BUILT)
    ub: int = 2  # sk: 64-k blocks per work unit (the kernel takes any; SK_BUILT lists the instantiated ones)
    # benchmarks only (wrong results): the same weight stream without arithmetic; sk: 1, or 2 (also no metadata
    # copies), or 3 (also no x staging), or 4 (the full kernel without the x sums), or 5 (staging a quarter of x)
    probe: int = 0
    tpc: int = 0  # sk: whole tiles per CTA (grid = ceil(N16 / tpc); shared tiles handed over in shared memory)
    pdl: bool | None = None  # programmatic dependent launch; None: the kind's default (use_pdl)
    trigger: str = "wait"  # pdl: the next kernel may launch at this one's "start" or after its "wait"
    zsub: bool = False  # sk: the zero point subtracted per fragment (no x sums; csrc/w4a16.cu sk_small ZSUB)
    evict: str = "weights"  # L2 policy of the weight copies: evict-first ("weights") or normal ("none")
    xc: int = 2  # xs: 64-k blocks per x chunk (XS_BUILT lists the instantiated ones)
    r: int = 4  # xr: 64-k blocks per warp and tile (its x in registers; XR_BUILT lists the instantiated ones)
    t: int = 1  # xr: tiles per work unit (one exchange of the warps' partial sums per unit)
    bias: bool = False  # xr: weights biased (4 LOP3s a word), corrected by (bias + z) x sums of x (xr_small BIAS)
    cluster: bool = False  # xr, two K groups: a cluster of 2 CTAs per range of tiles sums them on chip (CL)
    tma: bool = True  # wgmma: x by the tensor memory accelerator where built and K % 8 == 0 (else by cp.async)

    def __post_init__(self) -> None:  # checked once here, not on every launch (flags)
        if self.trigger not in TRIGGER_FLAGS:
            raise ValueError(f"trigger {self.trigger!r} is not one of {sorted(TRIGGER_FLAGS)}")
        if self.evict not in EVICT_FLAGS:
            raise ValueError(f"evict {self.evict!r} is not one of {sorted(EVICT_FLAGS)}")

    def label(self, splits: int | None = None) -> str:
        sp = splits if splits is not None else self.splits
        nopdl = " no-pdl" if self.pdl is False else "" if self.trigger == "wait" else f" pdl-{self.trigger}"
        ev = "" if self.evict == "weights" else f" evict-{self.evict}"
        tail = f" split{sp}" if sp else f" {self.ctas_per_sm:g}/sm"
        if self.kind == MMA:
            d = f" d{self.depth}" if self.depth else ""
            return f"cuda {'probe' if self.probe else 'mma'} nt{self.nt} tn{self.tn} w{self.warps}{d}{tail}{ev}{nopdl}"
        if self.kind == SK:
            grid = f"{self.tpc} tiles/cta" if self.tpc else f"{self.ctas_per_sm:g}/sm min{self.min_blocks}"
            return (f"cuda stream-k{f' probe{self.probe}' if self.probe else ''}{' zsub' if self.zsub else ''} "
                    f"u{self.ub} d{ring_depth(SK, True, depth=self.depth)} w{self.warps} {grid}{ev}{nopdl}")
        if self.kind == XS:
            d = ring_depth(XS, True, depth=self.depth)
            pr = f" probe{self.probe}" if self.probe else ""
            mb = f" min{self.min_blocks}" if self.min_blocks != 4 else ""
            return f"cuda mma-xs{pr} nt{self.nt} tn{self.tn} w{self.warps} d{d} x{self.xc}{tail}{mb}{ev}{nopdl}"
        if self.kind == XR:
            d = ring_depth(XR, True, depth=self.depth)
            kg = f" kg{sp}" if sp else ""
            pr = f" probe{self.probe}" if self.probe else ""
            tu = f" t{self.t}" if self.t > 1 else ""
            bi = (" bias" if self.bias else "") + (" cluster2" if self.cluster else "")
            return (f"cuda xr{pr}{bi} nt{self.nt} r{self.r}{tu} w{self.warps} d{d} {self.ctas_per_sm:g}/sm{kg}"
                    f"{ev}{nopdl}")
        st = f" s{self.stages}" if self.stages else ""
        pr = f" probe{self.probe}" if self.probe else ""
        x = "" if self.tma else " cp.async-x"
        return f"cuda wgmma{pr} bn{self.bn} wg{self.wgs}{st}{x}{tail}{ev}{nopdl}"


def wgmma_ok(cc: tuple[int, int]) -> bool:
    return cc == (9, 0)


def small_layer(st) -> bool:
    """A layer of at most 16 64-k blocks per warp of 8 warps per SM (Llama-3-70B's k/v: 8192 blocks): too few
    for a grid of split work to keep every SM streaming, so small M gives it its own launch shape."""
    return -(-st.N // 16) * -(-st.K // 64) <= 16 * 8 * st.n_sm


def choose(m: int, st) -> Config:
    """The launch for batch size m on the state's device."""
    if m > 32 and wgmma_ok(st.cc):
        if m <= 64:
            return Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=8)
        if m <= 128:
            return Config(kind=WGMMA, bn=128, wgs=2, ctas_per_sm=1.0, min_blocks=8)
        # Llama-3-70B at M = 256 (bench.md, ninth pass; x by TMA): a layer too narrow for a wave of 128 x 256
        # tiles (k/v, 8 tiles) small CTAs (bn128, 4 stages: 21.1-22.3 us against 35.0 for bn256); a square one
        # (q/o) bn256 with 6 stages (65.1 against 68.4 with 4, 82.3 for 4 warpgroups of bn128); long-K and wide
        # ones bn256 (gate/up 221.6-230.4, down 211.5-222.8).
        tiles = -(-st.N // 128) * -(-m // 256)
        if tiles * 8 < st.n_sm:
            return Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8)
        if tiles < st.n_sm and st.K <= 2 * st.N:
            return Config(kind=WGMMA, bn=256, wgs=2, stages=6, ctas_per_sm=1.0, min_blocks=8)
        return Config(kind=WGMMA, bn=256, wgs=2, ctas_per_sm=1.0, min_blocks=8)
    # tune-cuda-h200-v4-depth.json (benchmarks/results/bench.md, fourth pass): at M <= 8 one tile per warp, 4 warps,
    # ~16 CTAs per SM of split work (195.7 us over the 70B layer; two tiles per warp 208-218 us); at M <= 16
    # two tiles per warp (they share the x fragments), 8 warps, ~3 CTAs per SM (296-299 us; one tile 365 us)
    if sk_fits(m, st):
        # tune-cuda-h200-v6.txt (bench.md, sixth pass), Llama-3-70B at M = 1 with programmatic dependent
        # launch: a small layer (k/v, 8192 blocks) one CTA of 16 warps per tile with 6-slot rings, so the whole
        # weight is in flight at once and the tile is summed in shared memory (5.0-5.5 us against 7.4-8.1 for the
        # stream-K grids); larger ones one CTA of 16 warps per SM, every SM the same range, the next layer
        # launched at this one's start (gate/up 36.3-36.9 us, q/o 14.0-14.2), except a long-K one (down), whose
        # tiles span several warps: whole tiles per CTA, so every hand-over stays in shared memory (36.8-38.5 us
        # in five runs against 38.9-39.8).
        # Seventh pass (tune-cuda-h200-v7-steps.txt): the whole-tile grids subtract the zero per fragment (k/v 4.3 us
        # against 4.8, down 36.7-37.0 against 36.9-37.2); the 1/sm grid keeps the x sums (gate/up 34.9-35.0
        # against 35.7-36.6 with zsub). Eighth pass (tune-cuda-h200-v8-steps.txt): a layer of at most 4 tiles per SM
        # (q/o) takes the whole-tile grid too (12.9-13.1 us against 13.5-13.7 for the 1/sm grid).
        n16 = -(-st.N // 16)
        if small_layer(st):
            return Config(kind=SK, warps=16, tpc=1, depth=6, zsub=True)
        if n16 >= st.n_sm and (st.K >= 2 * st.N or n16 <= 4 * st.n_sm):
            # down: 6-slot rings (36.0 us against 36.8 with 4 slots in one run, tune-cuda-h200-v8-steps.txt run 7;
            # 35.4-35.8 in run 8); q/o keeps 4 (13.0 against 13.8)
            long_k = st.K >= 2 * st.N
            return Config(kind=SK, warps=16, tpc=max(1, round(n16 / st.n_sm)), zsub=True, depth=6 if long_k else 0)
        return Config(kind=SK, warps=16, ctas_per_sm=1.0, min_blocks=8, trigger="start")
    if m <= 8:
        return Config(kind=MMA, nt=1, tn=1, warps=4, ctas_per_sm=16.0)
    if 8 < m <= 16 and st.gshift_blk >= 7 and tuple(st.cc) == (9, 0) and xr_units(st) >= 4 * st.n_sm:
        # x in registers (tune-cuda-h200-v11-steps.txt, bench.md eleventh pass), Llama-3-70B at M = 16: layers of
        # at least 4 units (K group x tile) per SM, one CTA per SM: gate/up 46.6-47.0 us against 59.6-60.2 for the
        # split mma grid, down 47.4-48.0 against 57.4-57.9 and q/o 19.1 against 20.1-20.2 for the x-streaming
        # kernel; k/v (128 units) keeps the latter (7.5-7.6 us against 8.0). Twelfth pass (tune-cuda-h200-v12-
        # steps.txt): 8 warps of 8 blocks (the same 4096-k K groups) in place of 16 of 4, q/o 18.4-18.8 against
        # 19.0-19.4; with at least 8 units of two tiles per SM (gate/up, down) units of two tiles, gate/up 43.3-44.1
        # in three runs of four (46.3 in the other) against 46.2-47.7, down 47.5-48.9 against 47.5-49.0. Groups of
        # >= 128 or one group: the record-per-block form (groups of 64) was not run on a GPU. Measured on the H200
        # only: other GPUs keep the choices below.
        if xr_units(st, 8, 8, 2) >= 8 * st.n_sm:
            # Thirteenth pass (tune-cuda-h200-v13-steps.txt): with two K groups (gate/up) the weights biased,
            # corrected by the sums of x, and the K groups' sums met in a cluster of 2 instead of the workspace
            # (41.5-42.3 us against 42.5-44.0 with neither); down (7 K groups) plain (46.7-47.4 against 47.0-48.5
            # biased). Fourteenth pass (tune-cuda-h200-v14-steps.txt): with x loaded before the first ring copy (the
            # kernel's order now) gate/up 39.5-40.2, down 44.4-44.8, q/o 17.7-17.9; no candidate changed place
            two = xr_kgroups(st, 8, 8) == 2
            return Config(kind=XR, nt=2, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0, pdl=pdl_enabled(), bias=two,
                          cluster=two)
        # q/o: neither helped (18.4-18.6 plain, 18.7-19.1 biased, 18.6-19.1 as clusters)
        return Config(kind=XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=pdl_enabled())
    if m <= 16 and st.gshift_blk >= 0 and -(-st.N // 16) < 8 * st.n_sm:
        # x streamed in chunks, launched dependent (tune-cuda-h200-v8-steps.txt, bench.md eighth pass), Llama-3-70B
        # at M = 16: a small layer (k/v) three CTAs of 8 warps per SM, 8 blocks per warp at least, so fewer K
        # splits for the last CTA of a tile to sum (10.2-10.3 us against 15.4-15.7 for the mma grid); q/o and down
        # one CTA of 16 warps per SM, each warp a K slice of one tile (21.4-21.6 against 27.8-28.5; 58.5-59.7
        # against 69.4-69.7). A wide layer (gate/up, >= 8 tiles per SM) keeps the split mma grid: the x stream
        # gained nothing there (61.6-66.6 against 62.7-63.3).
        if small_layer(st):
            return Config(kind=XS, nt=2, tn=1, warps=8, ctas_per_sm=3.0, min_blocks=8, pdl=pdl_enabled())
        return Config(kind=XS, nt=2, tn=1, warps=16, ctas_per_sm=1.0, pdl=pdl_enabled())
    if m <= 16 and small_layer(st):
        # a small layer (k/v) at M = 16: one tile per warp and 12-slot rings, so more of its few blocks are in
        # flight at once (15.4 us against 17.1, tune-cuda-h200-v7-m16.json)
        return Config(kind=MMA, nt=2, tn=1, warps=4, depth=12, ctas_per_sm=4.0, min_blocks=4)
    nt = 2 if m <= 16 else 4
    return Config(kind=MMA, nt=nt, tn=2, warps=8, ctas_per_sm=3.0)


def xr_kgroups(st, warps: int = 16, r: int = 4) -> int:
    """K groups (warps x r 64-k blocks each) of the x-in-registers kernel for this layer."""
    return -(-st.K // (64 * warps * r))


def xr_units(st, warps: int = 16, r: int = 4, t: int = 1) -> int:
    """Work units (K group of warps x r blocks, t 16-row tiles) of the x-in-registers kernel for this layer."""
    return xr_kgroups(st, warps, r) * -(-st.N // (16 * t))


def smem_per_sm(cc: tuple[int, int]) -> int:
    return SMEM_PER_SM.get(tuple(cc), SMEM_OTHER)


def sk_takes(st, ub: int = 2) -> bool:
    """Whether the stream-K kernel's units of ub blocks fit the layer: KB a multiple of ub, and one group per
    unit (a power-of-two group of >= 64 ub found by a shift, or a single group)."""
    kb = -(-st.K // 64)
    return kb % ub == 0 and st.gshift_blk >= 6 + ub.bit_length() - 1


def sk_x_bytes(m: int, kb: int, ub: int = 2) -> int:
    """Shared memory before the stream-K kernel's local partials (csrc/w4a16.cu sk_small): x [m][64 kb + 8
    halves], then the per-unit sums of x (float [kb / ub][8]), each rounded up to 128 bytes."""
    return -(-(m * (kb * 64 + 8) * 2) // 128) * 128 + -(-(kb // ub * 32) // 128) * 128


def sk_local_bytes(warps: int) -> int:
    """The stream-K kernel's CTA-local hand-over: float4 [2 warps][32] partials, int [warps] counters padded to
    128 bytes."""
    return warps * 1024 + -(-(warps * 4) // 128) * 128


def sk_smem(m: int, kb: int, warps: int, ring: int, ub: int = 2) -> int:
    """Dynamic shared memory of a stream-K CTA of `warps` warps with rings of `ring` bytes each."""
    return sk_x_bytes(m, kb, ub) + sk_local_bytes(warps) + warps * ring


def sk_fits(m: int, st) -> bool:
    """Whether the default choice for batch size m is the stream-K kernel: one batch tile, units that fit the
    layer, and x (all of K) within its budget."""
    kb = -(-st.K // 64)
    return (m <= SK_MAX_M and sk_takes(st) and sk_x_bytes(m, kb) <= SK_X_BUDGET
            and 2 * sk_smem(m, kb, 8, ring_bytes_per_warp(SK, True)) <= smem_per_sm(st.cc))


def _sk_plan(cfg: Config, m: int, st, n16: int, kb: int, post: bool) -> dict:
    """Grid of the stream-K kernel: about ctas_per_sm CTAs per SM (fewer when shared memory says so), every
    warp at least min_blocks blocks, and never more warps than blocks (each warp's range is non-empty, which
    the kernel's owner arithmetic relies on)."""
    if m > SK_MAX_M or not sk_takes(st, cfg.ub):
        raise ValueError(f"stream-K takes M <= {SK_MAX_M}, KB % {cfg.ub} == 0 and one group per unit")
    depth = ring_depth(SK, post, depth=cfg.depth)
    if (cfg.ub, depth) not in SK_BUILT:
        raise ValueError(f"no stream-K kernel with {cfg.ub} blocks per unit and ring depth {depth}")
    if cfg.zsub and (cfg.probe or cfg.ub != 2):
        raise ValueError("the stream-K probes and units other than 2 blocks have no zsub form")
    units = n16 * (kb // cfg.ub)
    ring = ring_bytes_per_warp(SK, post, depth=cfg.depth, ub=cfg.ub)
    if cfg.tpc:  # whole tiles per CTA: every tile's hand-over stays in its CTA's shared memory
        grid = -(-n16 // cfg.tpc)
    else:
        smem = sk_smem(m, kb, cfg.warps, ring, cfg.ub)
        fit = max(1, smem_per_sm(st.cc) // (smem + 1024))  # the driver reserves 1 KB per CTA
        grid = max(1, min(round(cfg.ctas_per_sm * st.n_sm), fit * st.n_sm))
        grid = max(1, min(grid, units * cfg.ub // max(1, cfg.min_blocks * cfg.warps)))  # min_blocks per warp
    warps = min(cfg.warps, max(1, units // grid))
    pre = f"probe{cfg.probe}_" if cfg.probe else "z_" if cfg.zsub else ""
    name = f"qt_sk_{pre}{{dt}}_u{cfg.ub}_d{depth}"
    return {"grid": (grid, 1, 1), "block": 32 * warps, "smem": sk_smem(m, kb, warps, ring, cfg.ub), "splits": 1,
            "kbps": 0, "rows": 8, "name": name, "post": post, "tma": False, "ws_floats": 2 * grid * warps * 128,
            "counters": n16}


def xr_smem(warps: int, r: int, depth: int, nt: int, t: int = 1, slots: int = 4, bias: bool = False,
            cluster: bool = False) -> int:
    """Dynamic shared memory of an x-in-registers CTA (csrc/w4a16.cu xr_small): the warps' rings of depth slots
    of t x {r x 512 bytes of weights, r 48-byte records} (biased: each followed by the warp's sums of x, [r
    groups][4 lanes] float4), `slots` partial slots [warps][t][nt][32] float4, per slot two mbarriers (8 bytes
    each); as a cluster, then the other rank's sums ([t][nt][32] float4 a slot) and two mbarriers a slot."""
    return (warps * depth * t * slot_bytes(True, r) + slots * warps * t * nt * 512 + slots * 16  # a record a block
            + (warps * r * 64 if bias else 0) + (XR_CLUSTER_SLOTS * (t * nt * 512 + 16) if cluster else 0))


def _xr_plan(cfg: Config, m: int, st, n16: int, kb: int, post: bool) -> dict:
    """Grid of the x-in-registers kernel: units (K group of warps x r blocks, t tiles) cut into equal ranges over
    about ctas_per_sm CTAs per SM; K groups > 1 leave fp32 partials [G][N16][32][nt] float4 in the workspace."""
    depth = ring_depth(XR, True, depth=cfg.depth)
    shape = (cfg.nt, cfg.r, depth, cfg.t)
    probe_ok = (cfg.probe, shape, cfg.bias, cfg.cluster) in XR_PROBES_BUILT
    if (not post or m > 8 * cfg.nt or shape not in XR_BUILT or (cfg.probe and not probe_ok)
            or (cfg.bias and shape not in XR_BIAS_BUILT) or cfg.warps > XR_MAX_WARPS.get(cfg.r, 16)):
        raise ValueError(f"no x-in-registers kernel for M {m}, nt {cfg.nt}, {cfg.r} blocks per warp, ring depth "
                         f"{depth}, {cfg.t} tiles per unit, {cfg.warps} warps{', biased' if cfg.bias else ''}"
                         f"{'' if post else ' and groups not found by a shift'}")
    ntu = -(-n16 // cfg.t)
    kgroups = xr_kgroups(st, cfg.warps, cfg.r)
    units = kgroups * ntu
    grid = max(1, min(units, round(cfg.ctas_per_sm * st.n_sm)))
    if cfg.cluster:  # one cluster of 2 per range of tile units; at most one range per tile unit
        if kgroups != 2 or shape not in XR_CLUSTER_BUILT or not wgmma_ok(st.cc):
            raise ValueError(f"no x-in-registers cluster kernel for {kgroups} K groups, shape {shape} on "
                             f"sm_{st.cc[0]}{st.cc[1]} (two K groups, sm_90a)")
        grid = 2 * max(1, min(ntu, grid // 2))
    slots = XR_BUILT[shape]
    suffix = (f"_t{cfg.t}_s{slots}" if cfg.t > 1 else "") + ("_b" if cfg.bias else "") + ("_c" if cfg.cluster else "")
    tail = kgroups > 1 and not cfg.cluster  # partials summed through the workspace
    ws = kgroups * n16 * 128 * cfg.nt if tail else 0
    if cfg.probe == 12:  # the warps' timelines past where the partials would be
        ws = kgroups * n16 * 128 * cfg.nt + grid * cfg.warps * XR_STAMP_U64 * 2
    return {"grid": (grid, 1, 1), "block": 32 * cfg.warps,
            "smem": xr_smem(cfg.warps, cfg.r, depth, cfg.nt, cfg.t, slots, cfg.bias, cfg.cluster),
            "splits": kgroups, "kbps": 0, "rows": 8 * cfg.nt, "cluster": 2 if cfg.cluster else 1,
            "name": f"qt_xr_{f'probe{cfg.probe}_' if cfg.probe else ''}{{dt}}_nt{cfg.nt}_r{cfg.r}_d{depth}{suffix}",
            "post": post, "tma": False, "ws_floats": ws, "counters": n16 if ws else 0}


@lru_cache(maxsize=8)
def _module(device_index: int, cc: tuple[int, int]):
    from qtool.kernels.cuda.build import cubin_for
    from qtool.kernels.cuda.driver import Module

    return Module(cubin_for(cc), torch.device("cuda", device_index))


def _scales(st, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """The tiled scales for x's dtype, and whether they were made just now (by kernels still in the stream)."""
    t = st.scales.get(dtype)
    if t is None:
        from qtool.packing.mma_tiles import tile_scales

        t = tile_scales(st.scales_src.to(dtype))
        st.scales[dtype] = t
        return t, True
    return t, False


def pdl_enabled() -> bool:
    """Programmatic dependent launch is on unless QTOOL_CUDA_PDL=0."""
    return os.environ.get("QTOOL_CUDA_PDL", "1") != "0"


def flags(cfg: Config, grid: int | None = None, n_sm: int | None = None) -> int:
    """The kernel's Args::flags for this launch. A trigger at the start lets a cascade of later grids take SM
    slots as CTAs exit; that is only even (and only faster) when the grid gives every SM the same number of
    CTAs, so a grid of another size (given grid and n_sm) triggers after its wait instead. The L2 policy of
    the weight copies is here too."""
    even = not (grid is not None and n_sm and grid % n_sm)
    f = TRIGGER_FLAGS[cfg.trigger if even else "wait"]
    return f | EVICT_FLAGS[cfg.evict]


PDL_KINDS = (SK, WGMMA, XS, XR)  # kernels that wait (pdl_wait) before they touch x or their outputs; mma_small does not
# on by default for stream-K only: the wgmma kernel gained nothing and sometimes lost at M = 256 (bench.md, sixth pass)
PDL_DEFAULT_KINDS = (SK,)


def use_pdl(cfg: Config, st) -> bool:
    """Whether this launch is a programmatic dependent launch: sm_90+, a kernel that waits for it, and cfg.pdl
    (None: the kind's default, unless QTOOL_CUDA_PDL=0)."""
    want = (cfg.kind in PDL_DEFAULT_KINDS and pdl_enabled()) if cfg.pdl is None else cfg.pdl
    return want and cfg.kind in PDL_KINDS and tuple(st.cc) >= (9, 0)


def plan(cfg: Config, m: int, st) -> dict:
    """Grid, block, shared memory, split, kernel name ("{dt}" stands for x's dtype), whether x goes by the tensor
    memory accelerator (tma: one more argument, x's tensor map) and the workspace the call needs (ws_floats fp32
    partials, counters per-tile arrival counters; 0 when it finishes in place)."""
    n16 = -(-st.N // 16)
    kb = -(-st.K // 64)
    post = st.gshift_blk >= 0  # one group per 64-k block, found by a shift
    if cfg.kind == SK:
        return _sk_plan(cfg, m, st, n16, kb, post)
    if cfg.kind == XR:
        return _xr_plan(cfg, m, st, n16, kb, post)
    if cfg.kind == XS:
        depth = ring_depth(XS, True, depth=cfg.depth)
        shape = (cfg.nt, cfg.tn, depth, cfg.xc)
        if not post or shape not in XS_BUILT or (cfg.probe and shape != XS_PROBE_BUILT):
            raise ValueError(f"no x-streaming kernel for nt {cfg.nt}, tn {cfg.tn}, ring depth {depth}, chunks of "
                             f"{cfg.xc} blocks{'' if post else ' and groups under 64 blocks'}")
    if cfg.kind in (MMA, XS):
        rows = 8 * cfg.nt
        gx, gz = -(-n16 // (cfg.warps * cfg.tn)), -(-m // rows)
        mc = min(m, rows)
        max_kbps = kb if cfg.kind == XS else max(1, ((X_BUDGET // (2 * mc)) - 8) // 64)
        threads = 32 * cfg.warps
        tiles = gx * gz
    else:
        rows = cfg.bn
        gx, gz = -(-n16 // (4 * cfg.wgs)), -(-m // rows)
        max_kbps = kb
        threads = 128 * cfg.wgs
        tiles = gx * gz
    if cfg.splits:
        splits = cfg.splits
    else:
        want = max(1, round(cfg.ctas_per_sm * st.n_sm / tiles))
        splits = max(1, min(want, kb // max(1, cfg.min_blocks)))
    kbps = -(-kb // splits)
    kbps = min(kbps, max_kbps)
    splits = -(-kb // kbps)
    stages = cfg.stages or WG_STAGES.get(cfg.bn, 6)
    tma = False
    mma = cfg.kind in (MMA, XS)
    depth = cfg.depth if (mma and post and not cfg.probe) else 0
    ring = threads // 32 * ring_bytes_per_warp(cfg.kind, post, stages, cfg.tn if mma else 1, depth)
    if cfg.kind == XS:
        smem = XS_STAGES * rows * (cfg.xc * 64 + 8) * 2 + ring
        pre = f"probe{cfg.probe}_" if cfg.probe else ""
        name = f"qt_xs_{pre}{{dt}}_nt{cfg.nt}_tn{cfg.tn}_d{ring_depth(XS, True, depth=cfg.depth)}_x{cfg.xc}"
    elif cfg.kind == MMA:
        smem = -(-(min(m, rows) * (kbps * 64 + 8) * 2) // 128) * 128 + ring
        name = f"qt_{'probe' if cfg.probe else 'mma'}_{{dt}}_nt{cfg.nt}_tn{cfg.tn}_{'post' if post else 'step'}"
        if depth and depth != 6:
            name += f"_d{depth}"
    else:
        smem = 1024 + stages * cfg.bn * 128 + ring
        shape = (cfg.bn, cfg.wgs, stages)
        tma = cfg.tma and not cfg.probe and st.K % 8 == 0 and shape in WG_TMA_BUILT
        if cfg.probe and (not post or shape not in WG_PROBE_BUILT):
            raise ValueError(f"no wgmma probe for bn {cfg.bn}, {cfg.wgs} warpgroups, {stages} stages"
                             f"{'' if post else ' and groups under 64 blocks'}")
        pre = f"probe{cfg.probe}_" if cfg.probe else ""
        name = f"qt_wg_{pre}{{dt}}_bn{cfg.bn}_wg{cfg.wgs}_s{stages}_{'blk' if post else 'step'}"
        if tma:
            name += "_tma"
            # no per-warp rings: each stage also holds every warp's weights and metadata of its block
            smem = 1024 + stages * (cfg.bn * 128 + threads // 32 * slot_bytes(post))
            threads += 128  # its producer warpgroup, which copies x and the weights
    split = splits > 1
    return {"grid": (gx, splits, gz), "block": threads, "smem": smem, "splits": splits, "kbps": kbps,
            "rows": rows, "name": name, "post": post, "tma": tma,
            "ws_floats": splits * gz * rows * n16 * 16 if split else 0, "counters": gx * gz if split else 0}


def x_map(st, x: torch.Tensor, box_rows: int):
    """x's tensor map for the wgmma kernel's TMA form, cached per (address, shape, box) on the state: a map
    holds only those, so it stays right for any tensor later at the same address (the bench rotates a few)."""
    from qtool.kernels.cuda.driver import x_tensor_map

    key = (x.data_ptr(), x.shape[0], x.shape[1], box_rows)
    maps = st.tmaps
    if key not in maps:
        if len(maps) >= 64:
            maps.clear()
        maps[key] = x_tensor_map(*key)
    return maps[key]


def run(x: torch.Tensor, st, cfg: Config, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for x fp16/bf16 [M, K] on the state's device."""
    m, k = x.shape
    if k != st.K:
        from qtool.errors import UsageError

        raise UsageError(f"cuda-w4a16: x has K={k}, the layer K={st.K}")
    if st.perm is not None:
        x = x.index_select(1, st.perm)  # act-order: the tiles hold the weight rows in sorted-group order
    elif not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % 16:  # the kernels read x in 16-byte pieces (a view at an odd offset)
        x = x.clone()
    if out is None:
        out = torch.empty((m, st.N), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    y = out if out.is_contiguous() else torch.empty((m, st.N), dtype=x.dtype, device=x.device)
    p = plan(cfg, m, st)
    dt = "bf16" if x.dtype == torch.bfloat16 else "f16"
    name = p["name"].replace("{dt}", dt)
    shared = p["ws_floats"] > 0  # partial sums in the workspace, finished in the same launch
    if shared:
        # Grown, never freed: a CUDA graph captured at another M keeps pointing at the buffers it saw.
        need = p["ws_floats"]
        if st.ws is None or st.ws.numel() < need:
            if st.ws is not None:
                st.retired.append(st.ws)
            size = max(need, 2 * st.ws.numel()) if st.ws is not None else need
            st.ws = torch.empty(size, dtype=torch.float32, device=x.device)
        ntiles = p["counters"]
        if st.counters is None or st.counters.numel() < ntiles:
            if st.counters is not None:
                st.retired.append(st.counters)
            st.counters = torch.zeros(max(ntiles, 1024), dtype=torch.int32, device=x.device)
    ws = st.ws if shared else y
    cnt = st.counters if shared else y
    scales, fresh = _scales(st, x.dtype)
    vp, ci = ctypes.c_void_p, ctypes.c_int
    args = [vp(st.qweight.data_ptr()), vp(scales.data_ptr()), vp(st.zeros.data_ptr()),
            vp(st.gtab.data_ptr()), vp(x.data_ptr()), vp(y.data_ptr()), vp(ws.data_ptr()), vp(cnt.data_ptr()),
            ci(m), ci(st.N), ci(st.K), ci(-(-st.K // 64)), ci(p["kbps"]), ci(st.n_groups),
            ci(st.gshift_blk), ci(flags(cfg, p["grid"][0] * p["grid"][1] * p["grid"][2], st.n_sm))]
    if p["tma"]:
        args.append(x_map(st, x, p["rows"]))
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    # The kernel reads its weights and scales before it waits for the previous kernel (pdl_wait): never right
    # after the kernels that made them (prepare synchronizes; scales tiled just now for another dtype do not).
    _module(dev, st.cc).launch(name, p["grid"], p["block"], p["smem"], args, pdl=use_pdl(cfg, st) and not fresh,
                               cluster=p.get("cluster", 1))
    if y is not out:
        out.copy_(y)
    return out
