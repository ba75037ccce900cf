"""Launch configurations of the `cuda-w4a16` kernels, chosen by M, and the call itself.

Why the choices look the way they do:
- Small M streams the weight: every SM must pull bytes at once, so the grid is sized to several CTAs per SM
  by splitting K (the x slice a CTA stages in shared memory is bounded by X_BUDGET, and the partial sums are
  finished by the last CTA of each tile in the same launch). Each warp owns TN 16-row tiles and keeps its
  ring's D - 1 blocks of weights in flight.
- Large M on Hopper is tensor-core bound: wgmma with 64-row warpgroup tiles x BN batch columns, x tiles
  shared by the CTA's warpgroups, about one CTA per SM, split-K only to fill the SMs.
The thresholds and split targets come from benchmarks/tune_cuda_w4a16.py on an H200 (benchmarks/results/
bench.md, "Fourth pass"; tune-cuda-h200-v4*.json).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

MMA, WGMMA = "mma", "wgmma"
X_BUDGET = 32 * 1024  # bytes of x a mma CTA stages (its K slice): small enough for several CTAs per SM
WG_STAGES = {64: 6, 128: 6, 256: 4}  # default x-tile stages of the wgmma kernel per BN


def ring_depth(kind: str, post: bool, stages: int = 0, depth: int = 0) -> int:
    """Stream<D, NS> depth (blocks in flight per warp), as instantiated in csrc/w4a16.cu."""
    if kind == MMA:
        return (depth or 6) if post else 4
    return stages if post else stages - 1


def ring_bytes_per_warp(kind: str, post: bool, stages: int = 0, tn: int = 1, depth: int = 0) -> int:
    """Stream<D, NS, TN>::BYTES_PER_WARP: D slots of TN x (512 bytes of weights + NS 48-byte metadata records)."""
    ns = 1 if post else 4
    return ring_depth(kind, post, stages, depth) * tn * (512 + ns * 48)


@dataclass(frozen=True)
class Config:
    """kind mma: nt = batch tiles of 8 per CTA (1, 2, 4), warps per CTA; kind wgmma: bn (64/128/256), wgs
    warpgroups per CTA. splits: K splits (0 = choose from ctas_per_sm). post: scale fp32 block sums (mma)."""

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
    depth: int = 0  # mma, post only: cp.async ring depth (0: 6; 12 is also built)
    probe: bool = False  # mma only: the same weight stream without arithmetic (benchmarks; wrong results)

    def label(self, splits: int | None = None) -> str:
        sp = splits if splits is not None else self.splits
        tail = f" split{sp}" if sp else f" {self.ctas_per_sm:g}/sm"
        if self.kind == MMA:
            d = f" d{self.depth}" if self.depth else ""
            return f"cuda {'probe' if self.probe else 'mma'} nt{self.nt} tn{self.tn} w{self.warps}{d}{tail}"
        st = f" s{self.stages}" if self.stages else ""
        return f"cuda wgmma bn{self.bn} wg{self.wgs}{st}{tail}"


def wgmma_ok(cc: tuple[int, int]) -> bool:
    return cc == (9, 0)


def choose(m: int, st) -> Config:
    """The launch for batch size m on the state's device."""
    if m > 32 and wgmma_ok(st.cc):
        if m <= 64:
            return Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=8)
        if m <= 128:
            return Config(kind=WGMMA, bn=128, wgs=2, ctas_per_sm=1.0, min_blocks=8)
        # tune-cuda-h200-v4.json, Llama-3-70B at M = 256: a layer too narrow for a wave of 128 x 256 tiles
        # (k/v, 8 tiles) wants many small CTAs, two per SM (bn128, 4 stages: 31.7 us against 69.9); a square
        # one (q/o) 4 warpgroups sharing each x tile (84.6 against 91-95); long-K and wide ones bn256 (253-270)
        tiles = -(-st.N // 128) * -(-m // 256)
        if tiles * 8 < st.n_sm:
            return Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8)
        if tiles < st.n_sm and st.K <= 2 * st.N:
            return Config(kind=WGMMA, bn=128, wgs=4, ctas_per_sm=1.0, min_blocks=8)
        return Config(kind=WGMMA, bn=256, wgs=2, ctas_per_sm=1.0, min_blocks=8)
    # tune-cuda-h200-v4-depth.json (benchmarks/results/bench.md, fourth pass): at M <= 8 one tile per warp, 4 warps,
    # ~16 CTAs per SM of split work (195.7 us over the 70B layer; two tiles per warp 208-218 us); at M <= 16
    # two tiles per warp (they share the x fragments), 8 warps, ~3 CTAs per SM (296-299 us; one tile 365 us)
    if m <= 8:
        return Config(kind=MMA, nt=1, tn=1, warps=4, ctas_per_sm=16.0)
    nt = 2 if m <= 16 else 4
    return Config(kind=MMA, nt=nt, tn=2, warps=8, ctas_per_sm=3.0)


@lru_cache(maxsize=8)
def _module(device_index: int, cc: tuple[int, int]):
    from qtool.kernels.cuda.build import cubin_for
    from qtool.kernels.cuda.driver import Module

    return Module(cubin_for(cc), torch.device("cuda", device_index))


def _scales(st, dtype: torch.dtype) -> torch.Tensor:
    t = st.scales.get(dtype)
    if t is None:
        from qtool.packing.mma_tiles import tile_scales

        t = tile_scales(st.scales_src.to(dtype))
        st.scales[dtype] = t
    return t


def plan(cfg: Config, m: int, st) -> dict:
    """Grid, block, shared memory, split and kernel name ("{dt}" stands for x's dtype) for one call."""
    n16 = -(-st.N // 16)
    kb = -(-st.K // 64)
    post = st.gshift_blk >= 0  # one group per 64-k block, found by a shift
    if cfg.kind == MMA:
        rows = 8 * cfg.nt
        gx, gz = -(-n16 // (cfg.warps * cfg.tn)), -(-m // rows)
        mc = min(m, rows)
        max_kbps = max(1, ((X_BUDGET // (2 * mc)) - 8) // 64)
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
    mma = cfg.kind == MMA
    depth = cfg.depth if (mma and post and not cfg.probe) else 0
    ring = threads // 32 * ring_bytes_per_warp(cfg.kind, post, stages, cfg.tn if mma else 1, depth)
    if cfg.kind == MMA:
        smem = -(-(min(m, rows) * (kbps * 64 + 8) * 2) // 128) * 128 + ring
        name = f"qt_{'probe' if cfg.probe else 'mma'}_{{dt}}_nt{cfg.nt}_tn{cfg.tn}_{'post' if post else 'step'}"
        if depth and depth != 6:
            name += f"_d{depth}"
    else:
        smem = 1024 + stages * cfg.bn * 128 + ring
        name = f"qt_wg_{{dt}}_bn{cfg.bn}_wg{cfg.wgs}_s{stages}_{'blk' if post else 'step'}"
    return {"grid": (gx, splits, gz), "block": threads, "smem": smem, "splits": splits, "kbps": kbps,
            "rows": rows, "name": name, "post": post}


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
    if p["splits"] > 1:
        # Grown, never freed: a CUDA graph captured at another M keeps pointing at the buffers it saw.
        need = p["splits"] * p["grid"][2] * p["rows"] * (-(-st.N // 16) * 16)
        if st.ws is None or st.ws.numel() < need:
            if st.ws is not None:
                st.retired.append(st.ws)
            size = max(need, 2 * st.ws.numel()) if st.ws is not None else need
            st.ws = torch.empty(size, dtype=torch.float32, device=x.device)
        ntiles = p["grid"][0] * p["grid"][2]
        if st.counters is None or st.counters.numel() < ntiles:
            if st.counters is not None:
                st.retired.append(st.counters)
            st.counters = torch.zeros(max(ntiles, 1024), dtype=torch.int32, device=x.device)
    ws = st.ws if p["splits"] > 1 else y
    cnt = st.counters if p["splits"] > 1 else y
    vp, ci = ctypes.c_void_p, ctypes.c_int
    args = [vp(st.qweight.data_ptr()), vp(_scales(st, x.dtype).data_ptr()), vp(st.zeros.data_ptr()),
            vp(st.gtab.data_ptr()), vp(x.data_ptr()), vp(y.data_ptr()), vp(ws.data_ptr()), vp(cnt.data_ptr()),
            ci(m), ci(st.N), ci(st.K), ci(-(-st.K // 64)), ci(p["kbps"]), ci(st.n_groups),
            ci(st.gshift_blk)]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    _module(dev, st.cc).launch(name, p["grid"], p["block"], p["smem"], args)
    if y is not out:
        out.copy_(y)
    return out
