"""Check and tune the `cuda-w4a16` kernels on a GPU (the numbers behind qtool/kernels/cuda/rows.py).

    python benchmarks/tune_cuda_w4a16.py --check                      # every kernel variant vs the float64 oracle
    python benchmarks/tune_cuda_w4a16.py --tune --batch-sizes 1 16 256 --json tune-cuda.json

--check: awkward layers (N not a multiple of 16 or 64, K = group x odd, K not a multiple of 64, act-order,
group -1 / 32 / 64 / 128) x fp16/bf16 x M, for the M-bucket choice and for every forced variant (mma nt1/2/4
with and without split, stream-K with short and long warp ranges and whole tiles per CTA, wgmma bn32/48/64/128/256);
outputs poisoned with NaN, on every other layer at a 2-byte offset (a view); error within 4x the dense
same-precision baseline's. Then chains of calls each reading the previous output, with and without programmatic
dependent launch (same bits required). Exit 1 on any failure.
--scaling: K 8192 x N 7168-57344 for the M = 16 x-in-registers shapes and the M = 1 default, with a line fitted
through each kernel's times (steady state per 28672 rows, and what a call pays once).
--tune: Llama-3-70B's four distinct projection shapes (times weighted by how often each occurs in a decoder
layer: q/o 2, k/v 2, gate/up 2, down 1), dense cuBLAS against the default choice and the candidates below,
timed as `qtool bench --graphs` does (CUDA-graph replays, rotating weight copies).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from qtool.bench.layers import random_plain  # noqa: E402
from qtool.bench.timing import rotation_count, time_calls  # noqa: E402
from qtool.formats.plain import dequantize  # noqa: E402
from qtool.kernels.base import PackedLayer, get_kernel  # noqa: E402
from qtool.kernels.cuda import built, launch, rows  # noqa: E402
from qtool.kernels.cuda.launch import MMA, PDL_KINDS, SK, SK_MAX_M, WGMMA, XS, Config, sk_takes  # noqa: E402
from qtool.kernels.cuda.rows import choose  # noqa: E402

ERR_FACTOR = 4.0
SHAPES_70B = [("q/o_proj", 8192, 8192, 2), ("k/v_proj", 8192, 1024, 2), ("gate/up_proj", 8192, 28672, 2),
              ("down_proj", 28672, 8192, 1)]


def forced_configs(m: int, st) -> list[Config]:
    cs = [Config(kind=MMA, nt=nt, tn=tn, splits=sp) for nt in (1, 2, 4) if 8 * nt >= min(m, 8)
          for tn in (1, 2) if (nt, tn) != (4, 1) for sp in (1, 3)]
    if m <= SK_MAX_M:  # stream-K: ranges of one unit (many warps per tile), and long ranges over many tiles
        cs += [Config(kind=SK, ub=ub, warps=w, ctas_per_sm=c, min_blocks=mb, depth=d)
               for ub, w, c, mb, d in ((2, 8, 4.0, 1, 0), (2, 4, 1.0, 8, 6), (2, 16, 0.1, 1, 0), (2, 16, 1.0, 8, 4),
                                       (2, 8, 2.0, 2, 6))
               if sk_takes(st, ub)]
        # whole tiles per CTA (shared-memory hand-over), and grids whose CTAs split some tiles (both hand-overs)
        cs += [Config(kind=SK, warps=w, tpc=tpc, depth=d, pdl=pdl, trigger=trig)
               for w, tpc, d, pdl, trig in ((16, 1, 4, None, "wait"), (8, 2, 6, None, "start"), (4, 3, 4, None, "wait"),
                                            (16, 1, 6, False, "wait"))
               if sk_takes(st)]
        # the zero subtracted per fragment (on both grids and both ring depths), and the normal L2 policy
        cs += [Config(kind=SK, warps=16, ctas_per_sm=1.0, min_blocks=8, zsub=True, trigger="start"),
               Config(kind=SK, warps=16, tpc=1, depth=6, zsub=True),
               Config(kind=SK, warps=8, tpc=2, zsub=True, evict="none")] if sk_takes(st) else []
    if torch.cuda.get_device_capability() == (9, 0):
        cs += [Config(kind=WGMMA, bn=bn, wgs=2, splits=sp) for bn in (64, 128, 256) for sp in (1, 2)]
        cs.append(Config(kind=WGMMA, bn=128, wgs=4, splits=1))
        cs += [Config(kind=WGMMA, bn=bn, wgs=w, splits=sp) for bn in (24, 32, 40, 48) for w in (2, 4) for sp in (1, 3)]
        cs += [Config(kind=WGMMA, bn=bn, wgs=3, splits=sp) for bn in (24, 40) for sp in (1, 3)]
        # three and four consumer warpgroups (the TMA form; setmaxnreg shares the registers out differently)
        cs += [Config(kind=WGMMA, bn=bn, wgs=w, splits=sp) for bn, w in ((64, 3), (64, 4), (128, 3)) for sp in (1, 3)]
        cs.append(Config(kind=WGMMA, bn=128, wgs=2, stages=4, splits=2))
        cs.append(Config(kind=WGMMA, bn=128, wgs=2, splits=2, evict="none"))  # the default is evict-first
        # x by cp.async (the TMA form's fallback where K % 8 != 0), and 6 x-tile stages at bn 256
        cs += [Config(kind=WGMMA, bn=128, wgs=2, stages=4, splits=2, tma=False),
               Config(kind=WGMMA, bn=256, wgs=2, stages=6), Config(kind=WGMMA, bn=192, wgs=2, splits=3)]
        cs += [Config(kind=WGMMA, bn=112, wgs=w, splits=sp) for w, sp in ((2, 1), (3, 3), (4, 2))]
        cs += [Config(kind=WGMMA, bn=160, wgs=2, splits=2), Config(kind=WGMMA, bn=224, wgs=2)]
        # K splits summed in a cluster per tile: 2 to 8 splits, every tile width, both x forms, 2 CTAs an SM
        cs += [Config(kind=WGMMA, bn=bn, wgs=w, splits=sp, cluster=True, stages=stg, tma=tma)
               for bn, w, sp, stg, tma in ((32, 4, 2, 0, True), (48, 3, 3, 0, True), (64, 2, 5, 0, True),
                                           (128, 3, 8, 0, True), (128, 2, 4, 4, True), (128, 2, 3, 4, False),
                                           (192, 2, 4, 0, True), (256, 2, 2, 0, True), (256, 2, 7, 6, True))]
    cs.append(Config(kind=MMA, nt=2, tn=2, splits=3, evict="none"))
    if st.gshift_blk >= 0:  # x streamed in chunks (one group per block): both chunk sizes, split or not, pdl
        cs += [Config(kind=XS, nt=2, tn=tn, warps=w, depth=d, xc=xc, splits=sp, pdl=pdl)
               for tn, w, d, xc, sp, pdl in ((1, 16, 6, 2, 1, None), (1, 4, 12, 4, 3, True), (2, 8, 6, 2, 2, True),
                                             (2, 3, 12, 4, 1, False), (1, 7, 6, 2, 5, True))]
    if st.gshift_blk >= 0 and m <= 16:  # x in registers: one and several K groups, CTAs crossing K groups, pdl
        cs += [Config(kind=launch.XR, nt=2, r=r, warps=w, depth=d, ctas_per_sm=c, pdl=pdl)
               for r, w, d, c, pdl in ((4, 16, 4, 1.0, None), (4, 16, 3, 1.0, True), (4, 10, 4, 1.0, True), (2, 8, 4, 2.0, True),
                                       (4, 4, 4, 0.3, False), (2, 3, 4, 1.0, True), (8, 8, 3, 1.0, True),
                                       (8, 4, 3, 2.0, None), (8, 3, 3, 0.4, False))]
        cs += [Config(kind=launch.XR, nt=2, r=8, t=2, warps=w, depth=2, ctas_per_sm=c, pdl=pdl)
               for w, c, pdl in ((8, 1.0, None), (3, 0.6, True), (5, 0.3, False))]
        # biased weights, corrected by the sums of x: one and several K groups, crossing CTAs, warps past K
        cs += [Config(kind=launch.XR, nt=2, r=8, t=t, warps=w, depth=d, ctas_per_sm=c, pdl=pdl, bias=True)
               for t, d, w, c, pdl in ((1, 3, 8, 1.0, True), (1, 3, 3, 0.4, False), (2, 2, 8, 1.0, None),
                                       (2, 2, 5, 0.3, True), (2, 2, 3, 0.6, False))]
        if torch.cuda.get_device_capability() == (9, 0) and launch.xr_kgroups(st, 8, 8) == 2:
            # two K groups of 8 warps x 8 blocks, summed in a cluster of 2: biased and not, one and two tiles a
            # unit, fewer clusters than units, an odd grid rounded down, no pdl
            cs += [Config(kind=launch.XR, nt=2, r=8, t=t, warps=8, depth=d, ctas_per_sm=c, pdl=pdl, bias=b,
                          cluster=True)
                   for t, d, c, pdl, b in ((2, 2, 1.0, None, True), (1, 3, 0.05, False, False), (2, 2, 0.03, True, False))]
        if m <= 8:  # and one batch tile: r 4 (16 warps) and r 8 (8 warps), CTAs crossing K groups, warps past K
            cs += [Config(kind=launch.XR, nt=1, r=4, warps=w, ctas_per_sm=c, pdl=True) for w, c in ((16, 1.0), (5, 0.7), (3, 1.0))]
            cs += [Config(kind=launch.XR, nt=1, r=8, warps=w, depth=3, ctas_per_sm=c, pdl=pdl)
                   for w, c, pdl in ((8, 1.0, True), (3, 0.4, False))]
    if st.gshift_blk >= 0 and 16 < m <= 64:  # x in registers, eight batch tiles (M 33-64; also 17-32)
        cs += [Config(kind=launch.XR, nt=8, r=2, warps=w, depth=3, ctas_per_sm=c, pdl=pdl)
               for w, c, pdl in ((8, 1.0, True), (3, 0.4, False), (8, 2.0, None))]
    if st.gshift_blk >= 0 and 8 < m <= 32:  # x in registers, four batch tiles (M 17-32; also 9-16)
        cs += [Config(kind=launch.XR, nt=4, r=4, warps=w, depth=3, ctas_per_sm=c, pdl=pdl)
               for w, c, pdl in ((8, 1.0, True), (3, 0.4, False), (8, 2.0, None))]
    return cs


def check() -> int:
    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    layers = [(384, 200, 128, False, False), (640, 96, 64, True, False), (4096, 1024, 128, False, True),
              (1536, 520, -1, False, False), (2048, 1040, 32, True, False), (160, 48, 32, False, True),
              (8192, 256, 128, False, False), (512, 202, 128, False, False)]
    bad = total = 0
    for dt in (torch.float16, torch.bfloat16):
        for i, (k, n, g, act, sym) in enumerate(layers):
            plain = random_plain(n, k, group_size=g, act_order=act, sym=sym, dtype=dt, device=dev, seed=100 + i)
            layer = PackedLayer.from_plain(plain)
            why = kern.check(layer, dt, dev)
            if why:
                print("REFUSED", k, n, g, act, why)
                bad += 1
                continue
            st = kern.prepare(layer)
            w64 = dequantize(plain, torch.float64)
            w16 = dequantize(plain, dt)
            for m in (1, 5, 16, 24, 33, 80, 100, 160, 208, 256):
                x = torch.randn(m, k, device=dev).to(dt)
                ref = x.double() @ w64.t()
                base = float((F.linear(x, w16).double() - ref).norm() / ref.norm())
                for cfg in [None, *forced_configs(m, st)]:
                    st.override = cfg
                    # y at a 2-byte offset on every other layer: a caller's out may be any contiguous view, so no
                    # kernel may assume more alignment than 2 bytes (nor rows of a multiple of 4: N = 202)
                    out = torch.full((m * n + 1,), float("nan"), dtype=dt, device=dev)[i % 2:][:m * n].view(m, n)
                    try:
                        y = kern.forward(x, st, out=out)
                        torch.cuda.synchronize()
                        fin = bool(torch.isfinite(y).all())
                        err = float((y.double() - ref).norm() / ref.norm()) if fin else float("inf")
                    except Exception as e:  # noqa: BLE001 - a report, not a crash
                        fin, err = False, float("inf")
                        print("EXC", e)
                    total += 1
                    ok = fin and err <= ERR_FACTOR * base
                    if not ok:
                        bad += 1
                        label = cfg.label() if cfg else "default:" + st.config(m).label()
                        print(f"FAIL {dt} K={k} N={n} g={g} act={act} sym={sym} M={m} {label}: err {err:.3g} "
                              f"base {base:.3g}")
                st.override = None
    print(f"check: {total - bad} passed, {bad} failed")
    return 1 if bad else 0


# the default choice with other launch settings; "hot x": every call reads the same x (in L2), as a layer reads
# the activations the previous kernel just wrote, where the rotation otherwise leaves each call's x cold
VARIANTS = {"default, no pdl": dict(pdl=False), "default, pdl": dict(pdl=True),
            "default, pdl, trigger at start": dict(pdl=True, trigger="start"),
            "default, pdl, trigger after wait": dict(pdl=True, trigger="wait"), "default, hot x": {},
            # the L2 policy of the weight copies: normal instead of evict-first (the default)
            "default, evict none": dict(evict="none"),
            # stream-K: the zero subtracted per fragment or by the x sums
            "default, zsub": dict(zsub=True), "default, no zsub": dict(zsub=False),
            # x in registers: the weights biased (corrected by the sums of x) or the zero subtracted per fragment;
            # the two K groups summed in a cluster of 2 (where there are two; elsewhere the default itself)
            "default, no bias": dict(bias=False), "default, cluster": dict(cluster=True),
            "default, cluster, no bias": dict(cluster=True, bias=False)}


def chain_check() -> int:
    """Programmatic dependent launch: back-to-back calls where each reads the previous one's output (a square
    layer, x_{i+1} = x_i W^T), launched with pdl on sm_90, eagerly and as a replayed CUDA graph, against the same
    chain launched plainly; every step must give the same bits (the kernels are deterministic), so a kernel
    that read x or wrote y before pdl_wait would show. Outputs poisoned before each chain."""
    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    dt = torch.bfloat16  # the chain grows about 32x a step: bf16 has the range
    bad = total = 0
    for k, tag in ((1024, "sk/mma/wgmma"), (8192, "70B q/o")):
        plain = random_plain(k, k, group_size=128, dtype=dt, device=dev, seed=7)
        st = kern.prepare(PackedLayer.from_plain(plain))
        for m in (1, 5, 16, 256):
            bases = [choose(m, st)]
            if m == 16:  # the x-streaming and x-in-registers kernels, which wait before they read x
                bases.append(Config(kind=XS, nt=2, tn=1, warps=8, ctas_per_sm=2.0))
                bases.append(Config(kind=launch.XR, nt=2, r=4, warps=16, ctas_per_sm=1.0))
                bases.append(Config(kind=launch.XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0, bias=True))
                if k == 8192:  # two K groups: summed in a cluster of 2
                    bases.append(Config(kind=launch.XR, nt=2, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0,
                                        bias=True, cluster=True))
            for base in bases:
                x0 = torch.randn(m, k, device=dev).to(dt)
                chains = {}
                runs = [(False, "wait", False, "none")]
                if base.kind in PDL_KINDS:  # the mma kernel is never launched so: nothing to compare
                    runs += [(True, "wait", False, "none"), (True, "wait", True, "none"), (True, "start", True, "none"),
                             (True, "start", True, "weights")]
                else:  # L2 evict-first weight copies: a hint, the same bits
                    runs.append((False, "wait", True, "weights"))
                for pdl, trig, graph, ev in runs:
                    st.override = dataclasses.replace(base, pdl=pdl, trigger=trig, evict=ev)
                    outs = [torch.full((m, k), float("nan"), dtype=dt, device=dev) for _ in range(6)]
                    def run(outs=outs, x0=x0, st=st):
                        prev = x0
                        for o in outs:
                            prev = kern.forward(prev, st, out=o)
                    if graph:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            run()
                        for o in outs:
                            o.fill_(float("nan"))
                        g.replay()
                    else:
                        run()
                    torch.cuda.synchronize()
                    chains[(pdl, trig, graph, ev)] = [o.clone() for o in outs]
                st.override = None
                ref = chains[(False, "wait", False, "none")]
                for key, outs in list(chains.items())[1:]:
                    total += 1
                    same = all(torch.equal(a, b) for a, b in zip(ref, outs))
                    if not same:
                        bad += 1
                        print(f"FAIL chain {tag} K=N={k} M={m} {base.label()} pdl={key[0]} trigger={key[1]} "
                              f"graph={key[2]} evict={key[3]}: differs from the plain launches")
    print(f"chain check: {total - bad} passed, {bad} failed")
    return 1 if bad else 0


def candidates(m: int, full: bool = True, variants_only: bool = False,
               variants: list[str] | None = None) -> list[Config | str | None]:
    c: list[Config | str | None] = [None, *(v for v in VARIANTS if not variants or any(w in v for w in variants))]
    if variants_only:
        return c
    if m <= SK_MAX_M:  # group 128: units of two blocks
        c += [Config(kind=SK, ub=2, warps=w, depth=d, ctas_per_sm=cps, min_blocks=mb)
              for w, d, cps, mb in ((16, 4, 1.0, 8), (16, 4, 1.0, 32), (16, 4, 2.0, 8), (8, 4, 2.0, 8),
                                    (16, 6, 1.0, 8), (8, 6, 2.0, 8))]
        c += [Config(kind=SK, ub=2, warps=w, depth=d, ctas_per_sm=1.0, min_blocks=8, trigger="start")
              for w, d in ((16, 4), (12, 6), (16, 6))]
        c.append(Config(kind=SK, ub=2, warps=16, tpc=4, trigger="start"))
        # the zero subtracted per fragment on the other grids
        c += [Config(kind=SK, ub=2, warps=16, depth=d, ctas_per_sm=1.0, min_blocks=8, trigger="start", zsub=True)
              for d in (4, 6)]
        c += [Config(kind=SK, ub=2, warps=16, tpc=tpc, zsub=True) for tpc in (2, 4)]
        # whole tiles per CTA (hand-over in shared memory): 64 / 512 / 1792 tiles of k/v, q/o and down, gate/up
        c += [Config(kind=SK, ub=2, warps=w, depth=d, tpc=tpc)
              for tpc, w, d in ((1, 16, 6), (2, 16, 4), (4, 16, 4), (7, 16, 4), (14, 16, 4))]
    if m > SK_MAX_M and not full:
        return c
    if m <= 16:
        nt = 1 if m <= 8 else 2
        c += [Config(kind=MMA, nt=nt, tn=tn, warps=w, depth=d, ctas_per_sm=cps, min_blocks=mb)
              for tn, w in ((1, 4), (2, 4), (2, 8)) for d in (0, 12) for cps, mb in ((4.0, 4), (16.0, 4), (32.0, 2))]
        # x in registers: K groups of warps x r blocks, one or two CTAs per SM
        c += [Config(kind=launch.XR, nt=nt, r=r, warps=w, depth=d, ctas_per_sm=cps, pdl=pdl)
              for r, w, d, cps, pdl in ((4, 16, 4, 1.0, True), (4, 16, 3, 1.0, True), (4, 16, 4, 1.0, False),
                                        (4, 8, 4, 2.0, True), (2, 16, 4, 1.0, True), (2, 8, 4, 2.0, True),
                                        (8, 8, 3, 1.0, True), (8, 4, 3, 2.0, True))
              if (nt, r, d, 1, False, False) in built.XR]
        # units of two tiles: one exchange of the warps' partial sums per two tiles
        c += [Config(kind=launch.XR, nt=nt, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0, pdl=pdl)
              for pdl in (True, False) if (nt, 8, 2, 2, False, False) in built.XR]
        # biased weights (4 LOP3s a word), corrected per group by (bias + z) x the sums of x
        c += [Config(kind=launch.XR, nt=nt, r=8, t=t, warps=8, depth=d, ctas_per_sm=1.0, pdl=True, bias=True)
              for t, d in ((1, 3), (2, 2)) if (nt, 8, d, t, True, False) in built.XR]
        if m > 8:  # x streamed in chunks: about one wave of CTAs, whole tiles (gate/up) or a few long K slices
            c += [Config(kind=XS, nt=2, tn=tn, warps=w, depth=d, xc=xc, ctas_per_sm=cps, pdl=pdl, min_blocks=mb)
                  for tn, w, d, xc, cps, pdl, mb in (
                      (1, 14, 6, 2, 1.0, None, 4), (1, 16, 6, 2, 1.0, None, 4), (1, 16, 12, 4, 1.0, None, 4),
                      (1, 8, 6, 2, 2.0, None, 4), (1, 8, 12, 4, 2.0, None, 4), (1, 4, 6, 2, 4.0, None, 4),
                      (2, 8, 12, 4, 1.0, None, 4), (2, 4, 6, 2, 2.0, None, 4), (1, 14, 6, 2, 1.0, True, 4),
                      (1, 16, 6, 2, 1.0, True, 4), (1, 8, 6, 2, 2.0, True, 4), (2, 4, 6, 2, 2.0, True, 4),
                      (1, 8, 6, 2, 3.0, None, 4), (1, 8, 6, 2, 3.0, True, 4),
                      # fewer K splits on the small layers (k/v): fewer partials for the last CTA to sum
                      (1, 8, 6, 2, 3.0, True, 8), (1, 8, 6, 2, 3.0, True, 16), (1, 4, 6, 2, 4.0, True, 8),
                      (1, 16, 6, 2, 1.0, True, 8), (1, 8, 12, 4, 3.0, True, 8))]
    else:
        c += [Config(kind=WGMMA, bn=bn, wgs=wgs, stages=stg, ctas_per_sm=1.0, min_blocks=8)
              for bn, wgs, stg in ((128, 2, 4), (256, 2, 4), (256, 2, 6), (128, 4, 6), (64, 2, 6))]
        # K splits against the tail wave (gate/up: 224 tiles of 128 rows on 132 SMs)
        c += [Config(kind=WGMMA, bn=256, wgs=2, stages=stg, splits=sp) for stg in (4, 6) for sp in (2, 3, 4)]
        c += [Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8, tma=False)]
    return c


def rotated_layer(kern, k: int, n: int, dtype: torch.dtype, dev: torch.device, m_max: int, seed: int):
    """A random g128 layer as `qtool bench --graphs` times it: (layer, kernel states, dense weights), each list
    long enough to rotate through so that no call finds its weights in L2."""
    plain = random_plain(n, k, group_size=128, dtype=dtype, device=dev, seed=seed)
    layer = PackedLayer.from_plain(plain)
    w16 = dequantize(plain, dtype)
    del plain
    nq = rotation_count(dev, layer.nbytes() + m_max * k * 2)
    nd = rotation_count(dev, w16.numel() * 2)
    states = [kern.prepare(layer if i == 0 else layer.clone()) for i in range(nq)]
    return layer, states, [w16] + [w16.clone() for _ in range(nd - 1)]


def tune(batch_sizes: list[int], dtype: torch.dtype, out_json: Path | None, full: bool = True, variants_only: bool = False, only: str | None = None,
         variants: list[str] | None = None) -> None:
    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    rows = []
    for name, k, n, mult in SHAPES_70B:
        layer, states, w16s = rotated_layer(kern, k, n, dtype, dev, max(batch_sizes), seed=k + n)
        for m in batch_sizes:
            xs = [torch.randn(m, k, device=dev).to(dtype) for _ in range(max(len(states), len(w16s)))]
            td = time_calls([(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, w16s)], dev, graphs=True)
            rows.append(dict(shape=name, K=k, N=n, M=m, mult=mult, kernel="dense", us=td.median_s * 1e6))
            if m == 1:  # a read-only reference over the same packed bytes: torch's sum of the int32 words
                tr = time_calls([(lambda s=s: s.qweight.sum(dtype=torch.int64)) for s in states], dev, graphs=True)
                rows.append(dict(shape=name, K=k, N=n, M=m, mult=mult, kernel="read-only torch.sum(qweight)",
                                 us=tr.median_s * 1e6))
            for cfg in candidates(m, full, variants_only, variants):
                if only and isinstance(cfg, Config) and cfg.kind != only:
                    continue
                for s in states:
                    s.override = None
                    s.override = dataclasses.replace(s.config(m), **VARIANTS[cfg]) if cfg in VARIANTS else cfg
                    if cfg in VARIANTS:  # a variant this layer has no kernel for: the default itself
                        try:
                            launch.plan(s.override, m, s)
                        except ValueError:
                            s.override = None
                if cfg in VARIANTS:
                    label = cfg + ":" + states[0].config(m).label()
                else:
                    # Config.label() does not show a forced dependent launch: candidates with one get rows of their own
                    label = (cfg.label() + (" pdl" if cfg.pdl else "")) if cfg else (
                        "default:" + states[0].config(m).label())
                xs_call = [xs[0]] * len(xs) if isinstance(cfg, str) and cfg.endswith("hot x") else xs
                tq = time_calls([(lambda x=x, s=s: kern.forward(x, s)) for x, s in zip(xs_call, states)], dev,
                                graphs=True)
                rows.append(dict(shape=name, K=k, N=n, M=m, mult=mult, kernel=label, us=tq.median_s * 1e6,
                                 bytes=layer.nbytes() + 2 * m * (k + n)))
            del xs
        del states, w16s, layer
        torch.cuda.empty_cache()
    # per M and candidate: layer totals (weighted), speedup over dense
    print(f"{'M':>4} {'kernel':<40} {'layer us':>9} {'x dense':>8}")
    for m in batch_sizes:
        dense = sum(r["us"] * r["mult"] for r in rows if r["M"] == m and r["kernel"] == "dense")
        names = []
        for r in rows:
            if r["M"] == m and r["kernel"] != "dense" and r["kernel"].split(":")[0] not in names:
                names.append(r["kernel"].split(":")[0])
        for nm in names:
            rs = [r for r in rows if r["M"] == m and r["kernel"].split(":")[0] == nm]
            if len(rs) != len(SHAPES_70B):
                continue
            t = sum(r["us"] * r["mult"] for r in rs)
            print(f"{m:>4} {nm:<40} {t:>9.1f} {dense / t:>8.2f}   " +
                  " ".join(f"{r['shape']}={r['us']:.1f}" for r in rs))
        print(f"{m:>4} {'dense':<40} {dense:>9.1f}")
    if out_json:
        out_json.write_text(json.dumps({"dtype": str(dtype), "rows": rows}, indent=1))


# --scaling: (M, launch) pairs; None = rows.choose(), "dense" = F.linear
SCALING = [(16, Config(kind=launch.XR, nt=2, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0, pdl=True, bias=True)),
           (16, Config(kind=launch.XR, nt=2, r=8, t=2, warps=8, depth=2, ctas_per_sm=1.0, pdl=True)),
           (16, Config(kind=launch.XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)),
           (1, None), (16, "dense"), (1, "dense")]


def scaling(dtype: torch.dtype, out_json: Path | None) -> None:
    """How a kernel's time grows with its work: K 8192 and N from 7168 to 57344 (one K group split as in
    gate/up, 0.25-2x its units per SM), for the M = 16 x-in-registers shapes and the M = 1 default. A line through the points: its slope is the steady state, its intercept what a kernel pays once
    (start, x loads, tail)."""
    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    cfgs = SCALING
    rows = []
    k = 8192
    for n in (7168, 14336, 28672, 57344):
        layer, states, w16s = rotated_layer(kern, k, n, dtype, dev, 16, seed=n)
        for m, cfg in cfgs:
            xs = [torch.randn(m, k, device=dev).to(dtype) for _ in range(max(len(states), len(w16s)))]
            if cfg == "dense":
                calls = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, w16s)]
                label = "dense"
            else:
                for st in states:
                    st.override = cfg
                label = cfg.label() if cfg else "default:" + states[0].config(m).label()
                calls = [(lambda x=x, st=st: kern.forward(x, st)) for x, st in zip(xs, states)]
            us = time_calls(calls, dev, graphs=True).median_s * 1e6
            rows.append(dict(K=k, N=n, M=m, kernel=label, us=us, bytes=layer.nbytes()))
            print(f"K {k} N {n:>6} M {m:>2} {label:<58} {us:8.1f} us {layer.nbytes() / us / 1e3:7.0f} GB/s",
                  flush=True)
        del states, w16s, layer
        torch.cuda.empty_cache()
    for i, (m, _) in enumerate(cfgs):
        lab = f"{rows[i]['kernel'].split(':')[0]} M{m}"
        pts = [(r["N"], r["us"]) for r in rows[i::len(cfgs)]]
        ns, ts = zip(*pts)
        mn, mt = sum(ns) / len(ns), sum(ts) / len(ts)
        slope = sum((a - mn) * (b - mt) for a, b in pts) / sum((a - mn) ** 2 for a in ns)
        print(f"fit {lab:<62} {slope * 28672:7.1f} us per 28672 rows, intercept {mt - slope * mn:6.1f} us")
    if out_json:
        out_json.write_text(json.dumps({"dtype": str(dtype), "rows": rows}, indent=1))


# --curve: the families that can take each range of M, by name (None: rows.choose()); each a function of
# (m, state) giving a Config, or None where the family does not take that M
XR_ROWS_M16 = ("x in registers, two-tile units", "x in registers", "x streamed, small layer", "x streamed")


def before_curve(m: int, st) -> Config | None:
    """The launch ROWS gave before the x-in-registers and x-streaming rows took M <= 8 (where stream-K does not)
    and the four-tile x-in-registers row M 17-32: the split-K mma kernel; None where the choice is unchanged."""
    row = rows.choose_row(m, st).name
    if m <= 8 and row in XR_ROWS_M16:
        return Config(kind=MMA, nt=1, tn=1, warps=4, ctas_per_sm=16.0)
    if row == "x in registers, four batch tiles":
        return Config(kind=MMA, nt=4, tn=2, warps=8, ctas_per_sm=3.0)
    return None


def forward_as(kern, x: torch.Tensor, st, cfg: Config | None):
    """kern.forward with the state's launch set to cfg (None: its own choice) for this call: the curve's
    families share the states and are timed interleaved."""
    st.override = cfg
    return kern.forward(x, st)


def wg_cluster(cfg: Config | None, m: int, st, splits: int = 0) -> Config | None:
    """A wgmma launch with its K splits (its own, or `splits`; at most launch.WG_CLUSTER_MAX) summed in a
    thread-block cluster; None for another kernel or one split."""
    if cfg is None or cfg.kind != WGMMA:
        return None
    kb = -(-st.K // 64)
    s = min(splits or launch.plan(cfg, m, st)["splits"], launch.WG_CLUSTER_MAX, kb)
    return dataclasses.replace(cfg, splits=s, cluster=True) if s > 1 else None


# the M ranges of the bn24, bn40, bn112, bn160 and bn224 rows, and the M whose launch each had before
WIDER = ((17, 24, 32), (33, 40, 48), (97, 112, 128), (129, 160, 192), (193, 224, 256))


def cluster_fit(m: int, st) -> Config | None:
    """The dispatch's wgmma launch whose K splits meet through the workspace, as the most splits whose clusters
    are all resident (rows.wg_clustered without its partial-bytes condition); None elsewhere."""
    cfg = rows.wg_tailed(rows.choose_row(m, st).make(st), m, st)
    if cfg.kind != WGMMA or cfg.tail or rows.choose(m, st).cluster:
        return None
    p = launch.plan(cfg, m, st)
    fit = rows.cluster_splits(p["grid"][0] * p["grid"][2], p["splits"], st)
    return dataclasses.replace(cfg, splits=fit, cluster=True) if fit else None


def wg_narrowest(m: int, st) -> Config | None:
    """At M <= 64, the wgmma launch of the narrowest batch tile that covers M (32, 48, 64 columns), its warpgroups
    and K splits by the cost model, summed in clusters where the dispatch would (rows.wg_clustered); None
    elsewhere. Set against the rows that give M <= 64 to other kernels."""
    bn = next((b for b in (32, 48, 64) if m <= b), None)
    if bn is None or not launch.wgmma_ok(st.cc):
        return None
    return rows.wg_clustered(rows.wg_launch(bn)(st), m, st)


def few_ctas(m: int, st) -> bool:
    """Whether the dispatch's launch at M > 64 is a grid of under half the SMs (narrow layers: k/v, MoE experts)."""
    if m <= 64:
        return False
    g = launch.plan(rows.choose(m, st), m, st)["grid"]
    return g[0] * g[1] * g[2] < st.n_sm // 2


def small(bn: int, m: int, st, splits: int = 0) -> Config | None:
    """On a small layer (rows._wg_small at M = 128) at M 33-256: bn-column batch tiles of two warpgroups, the K
    splits by the cost model and summed in clusters where they fit (splits 0), or `splits` through the
    workspace."""
    if not (32 < m <= 256 and rows._wg_small(128, st)):
        return None
    cfg = Config(kind=WGMMA, bn=bn, wgs=2, ctas_per_sm=1.0, min_blocks=4, splits=splits)
    return cfg if splits else rows.wg_clustered(cfg, m, st)


XR1 = Config(kind=launch.XR, nt=1, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)  # the one-batch-tile row's


def xr_balanced(cfg: Config | None, st, most: int = 8) -> Config | None:
    """An x-in-registers launch with the fewest warps (at most `most`) that keep its K groups: every group full
    but the last by at most r - 1 blocks a warp; None for another kernel or no change."""
    if cfg is None or cfg.kind != launch.XR:
        return None
    kb = -(-st.K // 64)
    groups = -(-kb // (most * cfg.r))
    w = -(-kb // (groups * cfg.r))
    return dataclasses.replace(cfg, warps=w) if w != cfg.warps else None


def xr_r4(m: int, st) -> Config:
    """The four-blocks-a-warp rows' launch for batch size m (one batch tile at M <= 8, two above)."""
    return rows._xr_r4_launch(1 if m <= 8 else 2)(st)


def xr_least_idle(m: int, st, depth: int = 4) -> Config | None:
    """Two batch tiles of x in registers, four blocks a warp, with the warp count of 8-16 that leaves the fewest
    idle warp blocks in its K groups (more warps at a tie); None outside M 9-16 or groups of < 128."""
    if not (8 < m <= 16 and st.gshift_blk >= 7):
        return None
    kb = -(-st.K // 64)
    w = min(range(8, 17), key=lambda w: (-(-kb // (4 * w)) * 4 * w - kb, -w))
    return Config(kind=launch.XR, nt=2, r=4, warps=w, depth=depth, ctas_per_sm=1.0, pdl=True)


def tail_waves(m: int, st, t: int = 0) -> Config | None:
    """The dispatch's one-batch-tile wgmma grid a partial wave past a whole one, without a tail, as its whole waves
    and a tail whose split tiles may take more than one wave: t splits, or the t of least rows.wg_tail_cost."""
    c = rows.choose(m, st)
    if c.kind != WGMMA or c.tail or m < rows.TAIL_MIN_M or m > c.bn:
        return None
    whole, left = divmod(-(-rows._n16(st) // (4 * c.wgs)), st.n_sm)
    if not whole or not left:
        return None
    kb = -(-st.K // 64)
    pick = t or min(range(2, kb // 4 + 1), key=lambda s: rows.wg_tail_cost(c.bn, c.wgs, s, st))
    return dataclasses.replace(c, splits=0, cluster=False, tail=pick)


def wide32(m: int, st, how: str) -> Config | None:
    """M 17-32 on sm_90a, a layer whose least-cost bn32 wgmma grid (rows.wg_launch) is more than one wave, which
    the rows once left to four batch tiles of x in registers (`xr4`): that grid (`cost`), the least-cost grid of one
    wave (`wave`), four warpgroups unsplit (`w4`: what two launches of half the columns each give a wide layer) or
    the whole waves and a split tail of least modelled cost (`tail`); composed as the dispatch composes a launch."""
    if not (16 < m <= 32 and launch.wgmma_ok(st.cc)):
        return None
    cost = rows.wg_launch(32)(st)
    if -(-rows._n16(st) // (4 * cost.wgs)) * cost.splits <= st.n_sm:
        return None
    if how == "xr4":
        return rows.XR4
    if how == "tail":
        pick = rows.wg_tail_least(32, 0, st)
        cfg = pick and Config(kind=WGMMA, bn=32, wgs=pick[1], splits=0, min_blocks=8, tail=pick[2])
    elif how == "wave":
        cfg = (rows.wg_least(32, st, one_wave=True) or (0, None))[1]
    else:
        cfg = cost if how == "cost" else Config(kind=WGMMA, bn=32, wgs=4, splits=1, min_blocks=8)
    return cfg and rows.wg_programmatic(rows.wg_clustered(cfg, m, st), st)


def xr_biased(cfg: Config | None) -> Config | None:
    """The two-batch-tile x-in-registers launch with biased weights (corrected by the sums of x); None elsewhere."""
    if cfg is None or cfg.kind != launch.XR or cfg.nt != 2 or cfg.bias:
        return None
    return dataclasses.replace(cfg, bias=True)


CURVE_FAMILIES = {
    "cluster fit": cluster_fit,
    # a narrow layer's launch at M > 64 with more CTAs: 64-column batch tiles (K splits in clusters where they
    # fit, or through the workspace), or 128-column ones with up to 4x the K splits through the workspace
    "narrow bn64": lambda m, st: (rows.wg_clustered(Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0,
                                                             min_blocks=4), m, st) if few_ctas(m, st) else None),
    "narrow bn64 ws": lambda m, st: (Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=4)
                                     if few_ctas(m, st) else None),
    "narrow bn128 ws": lambda m, st: (Config(kind=WGMMA, bn=128, wgs=2, ctas_per_sm=1.0, min_blocks=4)
                                      if few_ctas(m, st) else None),
    "wgmma narrowest": wg_narrowest,
    # small layers at M 33-256: 32- or 64-column batch tiles, K split to fill the SMs (summed in clusters) or not
    "small bn64": lambda m, st: small(64, m, st),
    "small bn32": lambda m, st: small(32, m, st),
    "small bn64 s1": lambda m, st: small(64, m, st, 1),
    "small bn32 s1": lambda m, st: small(32, m, st, 1),
    "default": lambda m, st: None,
    # M <= 16 on x in registers: the fewest warps that keep the K groups (no group of mostly idle warps), biased
    # weights where the dispatch's launch is not; four blocks a warp and up to 16 warps (the evidence of the
    # four-blocks-a-warp rows), also where stream-K takes the layer; and the launch those rows replace
    "xr balanced": lambda m, st: xr_balanced(rows.choose(m, st), st),
    "xr biased": lambda m, st: xr_biased(rows.choose(m, st)) if 8 < m <= 16 else None,
    "xr nt1 balanced": lambda m, st: (xr_balanced(XR1, st) or XR1) if m <= 8 else None,
    "r4 any": lambda m, st: (xr_r4(m, st)
                             if m <= 16 and st.gshift_blk >= 7 and rows.xr_live(st) < rows.XR_LIVE_MIN else None),
    "eight blocks a warp": lambda m, st: (next(r for r in rows.ROWS if r.when(m, st) and "four blocks" not in r.name
                                               ).make(st) if "four blocks" in rows.choose_row(m, st).name else None),
    "xr r4 balanced": lambda m, st: c if 2 < m <= 16 and (c := xr_r4(m, st)).warps != 16 else None,
    # M 9-16: four blocks a warp with the fewest idle K-group blocks, or 16 warps (K groups of 64 blocks as eight
    # blocks a warp, half its x registers); the two-tile units with the fewest warps that keep their K groups
    "xr r4 least idle": xr_least_idle,
    "xr r4 least idle d3": lambda m, st: xr_least_idle(m, st, depth=3),
    "xr r4 w16": lambda m, st: (Config(kind=launch.XR, nt=2, r=4, warps=16, depth=4, ctas_per_sm=1.0, pdl=True)
                                if 8 < m <= 16 else None),
    "xr t2 balanced": lambda m, st: xr_balanced(rows._xr_two_tiles(st), st) if 8 < m <= 16 else None,
    # where the memory rule gives two-tile units a layer of more than two K groups (an H200's down_proj): one tile a
    # unit, the launch every other device gives it (rows.XR_T2_GBPS_SM)
    "xr one tile": lambda m, st: rows.XR1 if rows._xr_t2(m, st) and rows.xr_kgroups(st, 8, 8) > 2 else None,
    # at M > 96 a one-batch-tile grid a partial wave past a whole one that the tail rule leaves (its tail's split
    # tiles would pass a wave): whole waves and a tail of more than one wave
    "tail waves": tail_waves,
    "tail3": lambda m, st: tail_waves(m, st, 3),
    "tail4": lambda m, st: tail_waves(m, st, 4),
    # at M > 224 on squarish layers of under a wave of bn256 tiles (q/o, the TP shards): the dispatch's bn256
    # launch with 6 x-tile stages, the launch of the row that took them before 4 stages did
    "s6": lambda m, st: (dataclasses.replace(c, stages=6) if (c := rows.choose(m, st)).kind == WGMMA and c.bn == 256
                         and rows._wg_tiles(m, st) < st.n_sm and st.K <= 2 * st.N else None),
    # the dispatch's programmatic wgmma launch in plain stream order
    "wgmma no pdl": lambda m, st: (dataclasses.replace(c, pdl=False) if (c := rows.choose(m, st)).kind == WGMMA
                                   and c.pdl else None),
    # the dispatch's wgmma launch as a programmatic dependent launch: its first weight stages stream while the
    # previous kernel ends
    "wgmma pdl": lambda m, st: (dataclasses.replace(c, pdl=True) if (c := rows.choose(m, st)).kind == WGMMA
                                else None),
    "rows only": lambda m, st: rows.choose_row(m, st).make(st),  # the default without rows.wg_clustered
    "cluster": lambda m, st: wg_cluster(rows.choose(m, st), m, st),
    **{f"split{s} cluster": (lambda m, st, s=s: wg_cluster(rows.choose(m, st), m, st, s)) for s in (2, 3, 4, 6, 8)},
    "wgmma bn128 cost cluster": lambda m, st: wg_cluster(rows.wg_launch(128)(st), m, st) if 64 < m else None,
    "wgmma bn256 cost cluster": lambda m, st: wg_cluster(rows.wg_launch(256)(st), m, st) if 128 < m else None,
    "before": before_curve,
    "as M=16": lambda m, st: rows.choose(16, st) if m <= 16 else None,
    "xr nt1 r8 w8": lambda m, st: XR1 if m <= 8 else None,
    "xr nt1 r4 w16": lambda m, st: (Config(kind=launch.XR, nt=1, r=4, warps=16, depth=4, ctas_per_sm=1.0, pdl=True)
                                    if m <= 8 else None),
    "xr nt2 r8 w8": lambda m, st: (Config(kind=launch.XR, nt=2, r=8, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)
                                   if m <= 16 else None),
    "xr nt4 r4 w8": lambda m, st: rows.XR4 if 8 < m <= 32 else None,
    "xr nt4 r4 w8 2/sm": lambda m, st: dataclasses.replace(rows.XR4, ctas_per_sm=2.0) if 8 < m <= 32 else None,
    "xr nt8 r2 w8": lambda m, st: (Config(kind=launch.XR, nt=8, r=2, warps=8, depth=3, ctas_per_sm=1.0, pdl=True)
                                   if 16 < m <= 64 else None),
    "sk 1/sm": lambda m, st: (Config(kind=SK, warps=16, ctas_per_sm=1.0, min_blocks=8, trigger="start")
                              if m <= SK_MAX_M else None),
    "sk whole tiles": lambda m, st: rows._sk_whole_tiles(st) if m <= SK_MAX_M else None,
    "sk tile/cta": lambda m, st: Config(kind=SK, warps=16, tpc=1, depth=6, zsub=True) if m <= SK_MAX_M else None,
    "mma m8": lambda m, st: Config(kind=MMA, nt=1, tn=1, warps=4, ctas_per_sm=16.0) if m <= 8 else None,
    "mma nt4": lambda m, st: Config(kind=MMA, nt=4, tn=2, warps=8, ctas_per_sm=3.0) if 8 < m else None,
    "wgmma bn64": lambda m, st: (Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=8)
                                 if 16 < m <= 64 else None),
    "wgmma bn128": lambda m, st: (Config(kind=WGMMA, bn=128, wgs=2, ctas_per_sm=1.0, min_blocks=8)
                                  if 32 < m else None),
    "wgmma bn64 wg3": lambda m, st: (Config(kind=WGMMA, bn=64, wgs=3, ctas_per_sm=1.0, min_blocks=8)
                                     if 16 < m <= 64 else None),
    "wgmma bn64 wg4": lambda m, st: (Config(kind=WGMMA, bn=64, wgs=4, ctas_per_sm=1.0, min_blocks=8)
                                     if 16 < m <= 64 else None),
    "wgmma bn128 wg3": lambda m, st: (Config(kind=WGMMA, bn=128, wgs=3, ctas_per_sm=1.0, min_blocks=8)
                                      if 32 < m else None),
    "wgmma bn32 cost": lambda m, st: rows.wg_launch(32)(st) if 16 < m <= 32 else None,
    **{f"wide32 {how}": (lambda m, st, how=how: wide32(m, st, how)) for how in ("xr4", "cost", "wave", "w4", "tail")},
    "wgmma bn48 cost": lambda m, st: rows.wg_launch(48)(st) if 32 < m <= 48 else None,
    "wgmma bn64 cost": lambda m, st: rows.wg_launch(64)(st) if 16 < m <= 64 else None,
    "wgmma bn128 cost": lambda m, st: rows.wg_launch(128)(st) if 64 < m else None,
    "wgmma bn256 cost": lambda m, st: rows.wg_launch(256)(st) if 128 < m else None,
    "wgmma bn64 fine": lambda m, st: (Config(kind=WGMMA, bn=64, wgs=2, ctas_per_sm=1.0, min_blocks=2)
                                      if 16 < m <= 64 else None),
    "wgmma bn128 fine": lambda m, st: (Config(kind=WGMMA, bn=128, wgs=2, ctas_per_sm=1.0, min_blocks=2)
                                       if 64 < m else None),
    "wgmma bn128 s4": lambda m, st: (Config(kind=WGMMA, bn=128, wgs=2, stages=4, ctas_per_sm=1.0, min_blocks=8)
                                     if 64 < m else None),
    # M 129-192 as the dispatch launches M 193-256 (a 256-column tile): the bn192 row's baseline
    "as M=256": lambda m, st: rows.choose(256, st) if 128 < m <= 192 else None,
    # the dispatch without its tail launches (rows.wg_tailed): the tail rule's baseline
    "no tail": lambda m, st: (rows.wg_clustered(rows.choose_row(m, st).make(st), m, st)
                              if rows.choose(m, st).tail else None),
    # M 17-24, 33-40, 97-112, 129-160 and 193-224 as the dispatch launches the top of their range (32-, 48-, 128-,
    # 192- and 256-column tiles): the bn24, bn40, bn112, bn160 and bn224 rows' baseline
    "as the wider tile": lambda m, st: next((rows.choose(top, st) for lo, hi, top in WIDER if lo <= m <= hi),
                                            None),
    # M 65-96 as the dispatch launches M 97-128 (a 128-column tile): the bn96 row's baseline
    "as M=128": lambda m, st: rows.choose(128, st) if 64 < m <= 96 else None,
}


def curve(models: str, batch_sizes: list[int], dtype: torch.dtype, out_json: Path | None,
          families: list[str] | None = None, seconds: float = 1.0) -> int:
    """Every family of CURVE_FAMILIES over the models' distinct shapes (weighted by how often each occurs in a
    layer) and batch sizes: each launch checked against the float64 oracle (output poisoned), then timed as
    `qtool bench --graphs` does, dense cuBLAS and the families in two passes of opposite order (the mean of the
    two). Prints, per model and M, each family's layer sum and the best family per shape."""
    from qtool.bench.shapes import parse_shapes

    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    fams = {k: v for k, v in CURVE_FAMILIES.items() if not families or k in families or k == "default"}
    recs, bad = [], 0
    for model in models.split(","):
        counts: dict[tuple[int, int], int] = {}
        for sh in parse_shapes(model, "cuda"):
            counts[(sh.K, sh.N)] = counts.get((sh.K, sh.N), 0) + 1
        for (k, n), mult in counts.items():
            layer, states, w16s = rotated_layer(kern, k, n, dtype, dev, max(batch_sizes), seed=k + n)
            plain = random_plain(n, k, group_size=128, dtype=dtype, device=dev, seed=k + n)
            w64 = dequantize(plain, torch.float64)
            del plain
            for m in batch_sizes:
                xs = [torch.randn(m, k, device=dev).to(dtype) for _ in range(max(len(states), len(w16s)))]
                ref = xs[0].double() @ w64.t()
                base = float((F.linear(xs[0], w16s[0]).double() - ref).norm() / ref.norm())
                # every family checked first, then all timed in two passes of opposite order (dense included) and
                # each time the mean of its two: a launch timed right after another (dense cuBLAS at large M) runs
                # at the clocks that one left, up to 25 % off the same launch timed elsewhere in the order
                timed = [("dense", None, None, [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, w16s)])]
                for fam, make in fams.items():
                    cfg = make(m, states[0])
                    if fam != "default" and cfg is None:
                        continue
                    try:
                        launch.plan(cfg or rows.choose(m, states[0]), m, states[0])
                    except ValueError:
                        continue
                    states[0].override = cfg  # the oracle check's call; the timed calls set their own (forward_as)
                    label = (cfg or states[0].config(m)).label()
                    out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
                    y = kern.forward(xs[0], states[0], out=out)
                    err = float((y.double() - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("inf")
                    if err > ERR_FACTOR * base:
                        bad += 1
                        print(f"FAIL {model} {k}x{n} M={m} {fam} ({label}): err {err:.3g} vs base {base:.3g}",
                              flush=True)
                        recs.append(dict(model=model, K=k, N=n, M=m, mult=mult, family=fam, label=label, err=err,
                                         base_err=base, us=None))
                        continue
                    timed.append((fam, label, err, [(lambda x=x, s=s, c=cfg: forward_as(kern, x, s, c))
                                                    for x, s in zip(xs, states)]))
                us = {fam: 0.0 for fam, *_ in timed}
                for order in (timed, timed[::-1]):
                    for fam, _, _, calls in order:
                        us[fam] += time_calls(calls, dev, graphs=True, max_seconds=seconds / 2).median_s * 1e6 / 2
                for fam, label, err, _ in timed:
                    if fam == "dense":
                        recs.append(dict(model=model, K=k, N=n, M=m, mult=mult, family="dense", us=us[fam]))
                        continue
                    recs.append(dict(model=model, K=k, N=n, M=m, mult=mult, family=fam, label=label, err=err,
                                     base_err=base, us=us[fam]))
                    print(f"row {model} {k}x{n} M={m} {fam}: {us[fam]:.1f} us (dense {us['dense']:.1f}) {label}",
                          flush=True)
                for s in states:
                    s.override = None
                del xs
            del states, w16s, layer, w64
            torch.cuda.empty_cache()
    for model in models.split(","):
        print(f"== {model} {dtype}: layer x dense per family (a family missing a shape takes the default there)")
        for m in batch_sizes:
            rs = [r for r in recs if r["model"] == model and r["M"] == m]
            shapes = sorted({(r["K"], r["N"], r["mult"]) for r in rs})
            dense = {(r["K"], r["N"]): r["us"] for r in rs if r["family"] == "dense"}
            tdense = sum(dense[(k, n)] * c for k, n, c in shapes)
            line = []
            best_t = 0.0
            for fam in fams:
                t = 0.0
                for k, n, c in shapes:
                    own = [r["us"] for r in rs if (r["K"], r["N"]) == (k, n) and r["family"] == fam and r["us"]]
                    dflt = [r["us"] for r in rs if (r["K"], r["N"]) == (k, n) and r["family"] == "default" and r["us"]]
                    t += c * (own or dflt or [float("inf")])[0]
                line.append(f"{fam}={tdense / t:.2f}")
            for k, n, c in shapes:
                cand = [r for r in rs if (r["K"], r["N"]) == (k, n) and r["family"] != "dense" and r["us"]]
                best = min(cand, key=lambda r: r["us"])
                best_t += c * best["us"]
                line.append(f"| {k}x{n}: {best['family']} {best['us']:.1f}/{dense[(k, n)]:.1f}")
            print(f"M={m:>3} best {tdense / best_t:.2f} " + " ".join(line), flush=True)
    if out_json:
        out_json.write_text(json.dumps({"dtype": str(dtype), "rows": recs}, indent=1))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 256])
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--defaults-above-8", action="store_true",
                    help="for M > 8 time only the default choice, with and without pdl (--tune)")
    ap.add_argument("--variants-only", action="store_true",
                    help="time only the default choice and its launch variants (--tune)")
    ap.add_argument("--variants", nargs="+", metavar="WORDS",
                    help="of the launch variants, time only those whose names hold one of these (--tune)")
    ap.add_argument("--scaling", action="store_true",
                    help="time K 8192 x N 7168-57344 for the M = 16 shapes and fit time against N")
    ap.add_argument("--only", choices=[MMA, SK, XS, launch.XR, WGMMA],
                    help="of the candidates, time only this kind's (with the default and its variants; --tune)")
    ap.add_argument("--curve", metavar="MODELS",
                    help="time every CURVE_FAMILIES launch over these models' shapes (comma-separated) and M")
    ap.add_argument("--families", nargs="+", help="of CURVE_FAMILIES, only these (--curve)")
    ap.add_argument("--seconds", type=float, default=1.0, help="longest time per timed launch (--curve)")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} cc {props.major}.{props.minor} sms {props.multi_processor_count}, torch "
          f"{torch.__version__}", flush=True)
    rc = (check() | chain_check()) if a.check else 0
    if a.scaling:
        scaling({"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype], a.json)
    if a.curve:
        rc |= curve(a.curve, a.batch_sizes, {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype], a.json,
                    a.families, a.seconds)
    if a.tune:
        tune(a.batch_sizes, {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype], a.json,
             not a.defaults_above_8, a.variants_only, a.only, a.variants)
    return rc


if __name__ == "__main__":
    sys.exit(main())
