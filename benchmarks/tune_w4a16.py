"""Sweep launch configurations of the Triton W4A16 kernel on the GPU: the source of triton/launch.TABLE.

    python benchmarks/tune_w4a16.py [--shapes llama-3-70b] [--batch-sizes 1 16 64 256] [--json tune.json]

Candidates per M bucket (each with a split-K target in programs per SM): the row launch.TABLE holds now first,
then the alternatives of its bucket. A candidate's split-K comes from launch.choose_config with a one-bucket
table, so a winner copied into TABLE dispatches exactly what was timed. Every candidate is checked twice against
the float64 oracle (error within 4x the dense same-precision baseline's; a failing one is reported, not timed),
then timed over CUDA-graph replays with rotating weight copies, as `qtool bench --graphs`. Candidates are
compiled in parallel worker processes first (Triton caches them on disk). Prints the best per (shape, M) and the
decoder-layer sums per candidate (every projection with its multiplicity, one config for all shapes, as TABLE
dispatches); writes every measurement to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qtool.kernels.triton.launch import DEQUANT_GEMM, TABLE, Bucket, LaunchConfig, choose_config  # noqa: E402


def candidates(m: int) -> list[tuple[LaunchConfig, float]]:
    """(config, programs per SM) for M, the current TABLE row first."""
    c: list[tuple[LaunchConfig, float]] = [(b.config, b.programs_per_sm) for b in TABLE if m <= b.max_m][:1]
    if m == 1:  # mode 3, the PTX-dequant GEMV
        for bn, bk, w, pair in [(512, 64, 4, False), (512, 64, 4, True), (1024, 64, 8, True), (256, 128, 8, True),
                                (512, 128, 8, True), (256, 128, 4, False), (256, 64, 4, True)]:
            for pps in (2.0, 4.0, 6.0, 8.0):
                c.append((LaunchConfig(mode=3, block_m=1, block_n=bn, block_k=bk, num_warps=w, num_stages=1,
                                       pair=pair), pps))
    elif m <= 16:  # mode 4 with and without swap; mode 2 as the old reference
        for swap, bn, bk, w, st in [(True, 128, 128, 4, 3), (True, 128, 128, 4, 4), (True, 64, 128, 4, 4),
                                    (True, 64, 128, 4, 5), (True, 128, 256, 8, 3), (True, 256, 128, 8, 3),
                                    (True, 64, 256, 4, 3), (True, 128, 64, 4, 4), (False, 128, 128, 4, 3),
                                    (False, 64, 128, 4, 4)]:
            for pps in (2.0, 4.0, 8.0):
                c.append((LaunchConfig(mode=4, block_m=16, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                                       swap=swap), pps))
        c.append((LaunchConfig(mode=2, block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3), 8.0))
    elif m <= 64:  # mode 2 tiles
        for bm, bn, bk, w, st in [(64, 128, 128, 4, 3), (128, 256, 128, 8, 3), (128, 128, 128, 8, 4)]:
            for pps in (1.0, 2.0):
                c.append((LaunchConfig(mode=2, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st),
                          pps))
        c.append((LaunchConfig(path=DEQUANT_GEMM, mode=4, block_n=256, block_k=64, num_warps=8), 1.0))
    else:  # fused mode 4 against dequantize + cuBLAS
        for swap, bm, bn, bk, w, st in [(True, 128, 128, 64, 8, 3), (True, 256, 128, 64, 8, 3),
                                        (False, 128, 128, 64, 8, 3), (False, 128, 256, 64, 8, 3),
                                        (True, 128, 128, 128, 8, 3), (False, 128, 128, 128, 8, 3),
                                        (True, 64, 128, 64, 4, 4), (False, 64, 128, 64, 4, 4)]:
            for pps in (1.0, 2.0):
                c.append((LaunchConfig(mode=4, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                                       swap=swap), pps))
        c.append((LaunchConfig(path=DEQUANT_GEMM), 1.0))
        for bn, bk, w in [(128, 128, 4), (64, 256, 4), (256, 64, 8)]:
            c.append((LaunchConfig(path=DEQUANT_GEMM, mode=4, block_n=bn, block_k=bk, num_warps=w), 1.0))
    return list(dict.fromkeys(c))  # the table row once, so its layer sum is found among the candidates'


def _compile_worker(cfg_dicts: list[dict]) -> list[str]:
    """Run each config once on a small problem (same specialization as the real shapes) to fill the cache."""
    from qtool.bench.layers import random_plain
    from qtool.kernels.base import pack_gptq_v2
    from qtool.kernels.triton.launch import run_w4a16

    errs = []
    dev = torch.device("cuda")
    lay = {dt: pack_gptq_v2(random_plain(1024, 1024, dtype=dt, device=dev)) for dt in (torch.float16,)}
    for d in cfg_dicts:
        cfg = LaunchConfig(**d)
        for dt, L in lay.items():
            for m in sorted({1, cfg.block_m}):
                if cfg.mode == 0 and m != 1:
                    continue
                x = torch.randn(m, 1024, device=dev, dtype=dt)
                for split in sorted({1, cfg.split_k}):
                    try:
                        run_w4a16(x, L.qweight, L.qzeros, L.scales, None, 128, replace(cfg, split_k=split))
                    except Exception as e:  # noqa: BLE001
                        errs.append(f"{cfg.label()}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errs


def precompile(cfgs: list[LaunchConfig], workers: int) -> list[str]:
    import multiprocessing as mp

    uniq = {c: None for c in cfgs if c.path == "fused"}
    items = [asdict(c) for c in uniq]
    if not items:
        return []
    chunks = [items[i::workers] for i in range(workers)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        res = pool.map(_compile_worker, [c for c in chunks if c])
    return [e for r in res for e in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3-70b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--seconds", type=float, default=0.15)
    args = ap.parse_args()

    import torch.nn.functional as F

    from qtool.bench.layers import random_plain
    from qtool.bench.roofline import copy_bandwidth
    from qtool.bench.run import rel_err
    from qtool.bench.shapes import parse_shapes
    from qtool.bench.timing import rotation_count, time_calls
    from qtool.formats.plain import dequantize
    from qtool.kernels.base import pack_gptq_v2
    from qtool.kernels.triton.launch import run_w4a16

    dev = torch.device("cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    seen, shapes = set(), []
    for s in parse_shapes(args.shapes, "cuda"):
        if (s.K, s.N) not in seen:
            seen.add((s.K, s.N))
            shapes.append(s)

    def resolve(c: LaunchConfig, pps: float, m: int, n: int, k: int) -> LaunchConfig:
        return choose_config(m, n, k, n_sm, 128, False, table=(Bucket(1 << 62, c, pps),))

    t0 = time.time()
    errs = precompile([resolve(c, p, m, s.N, s.K) for s in shapes for m in args.batch_sizes
                       for c, p in candidates(m)], args.workers)
    print(f"precompiled in {time.time() - t0:.0f}s; {len(errs)} errors", flush=True)
    for e in errs[:10]:
        print("  compile error:", e)

    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    results = []
    for s in shapes:
        plain = random_plain(s.N, s.K, dtype=dtype, device=dev, seed=s.K + s.N)
        layer = pack_gptq_v2(plain)
        w64 = dequantize(plain, torch.float64)
        w16 = dequantize(plain, dtype)
        del plain
        nq = rotation_count(dev, layer.nbytes())
        nd = rotation_count(dev, w16.numel() * 2)
        qs = [layer] + [layer.clone() for _ in range(nq - 1)]
        ws = [w16] + [w16.clone() for _ in range(nd - 1)]
        for m in args.batch_sizes:
            xs = [torch.randn(m, s.K, device=dev, dtype=dtype) for _ in range(max(nq, nd))]
            y64 = xs[0].double() @ w64.t()
            base = rel_err(F.linear(xs[0], w16), y64)
            td = time_calls([(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws)], dev, graphs=True,
                            max_seconds=args.seconds).median_s
            qbytes = layer.nbytes() + 2 * m * (s.K + s.N)
            rec = {"K": s.K, "N": s.N, "M": m, "dense_us": td * 1e6, "base_err": base, "cands": []}
            measured: dict = {}
            for c0, pps in candidates(m):
                c = resolve(c0, pps, m, s.N, s.K)
                key = f"{c0.label()} pps{pps:g}"
                if c in measured:
                    rec["cands"].append(dict(measured[c], key=key, pps=pps))
                    continue
                entry = {"cfg": asdict(c), "pps": pps, "label": c.label(), "key": key}
                try:
                    for trial in range(2):  # fresh inputs on the second check: same function on any input
                        x = xs[trial]
                        ref = y64 if trial == 0 else x.double() @ w64.t()
                        out = torch.full((m, s.N), float("nan"), device=dev, dtype=dtype)
                        y = run_w4a16(x, layer.qweight, layer.qzeros, layer.scales, None, 128, c, out=out)
                        err = rel_err(y, ref)
                        entry["err"] = max(err, entry.get("err", 0.0))
                    if not entry["err"] <= 4 * base:
                        entry["status"] = "wrong"
                    else:
                        t = time_calls([(lambda x=x, L=L, c=c: run_w4a16(x, L.qweight, L.qzeros, L.scales, None,
                                                                           128, c)) for x, L in zip(xs, qs)],
                                       dev, graphs=True, max_seconds=args.seconds).median_s
                        entry.update(status="ok", us=t * 1e6, bw_frac=qbytes / t / bw, speedup=td / t)
                except Exception as e:  # noqa: BLE001
                    entry.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
                measured[c] = entry
                rec["cands"].append(entry)
            ok = sorted((e for e in rec["cands"] if e["status"] == "ok"), key=lambda e: e["us"])
            bad = [e for e in rec["cands"] if e["status"] != "ok"]
            rec["best"] = ok[0] if ok else None
            cur = rec["cands"][0]
            print(f"{s.K}x{s.N} M={m}: dense {td * 1e6:.1f}us | table {cur['label']} {cur.get('us', -1):.1f}us "
                  f"| {len(bad)} bad", flush=True)
            for e in ok[:5]:
                print(f"      {e['label']} pps{e['pps']:g} {e['us']:.1f}us {100 * e['bw_frac']:.0f}%BW "
                      f"x{e['speedup']:.2f}")
            for e in bad[:4]:
                print(f"      BAD {e['label']}: {e.get('status')} {e.get('err', '')} {e.get('reason', '')[:200]}")
            results.append(rec)
            del xs
        del qs, ws, w64, w16, layer
        torch.cuda.empty_cache()
    # one decoder layer (every projection, with multiplicity): dense, the current table, and each candidate
    # that ran on every shape (one config for all shapes, as launch.TABLE dispatches)
    from collections import Counter

    mult = Counter((s.K, s.N) for s in parse_shapes(args.shapes, "cuda"))
    summary = {}
    for m in args.batch_sizes:
        recs = [r for r in results if r["M"] == m]
        dense = sum(r["dense_us"] * mult[(r["K"], r["N"])] for r in recs)
        totals: dict = {}
        for r in recs:
            for e in r["cands"]:
                if e["status"] == "ok":
                    totals.setdefault(e["key"], []).append(e["us"] * mult[(r["K"], r["N"])])
        full = sorted((sum(v), k) for k, v in totals.items() if len(v) == len(recs))
        table_key = recs[0]["cands"][0]["key"] if recs else None
        table_t = next((t for t, k in full if k == table_key), None)
        best_mixed = sum(min(e["us"] for e in r["cands"] if e["status"] == "ok") * mult[(r["K"], r["N"])]
                         for r in recs if any(e["status"] == "ok" for e in r["cands"]))
        print(f"M={m}: layer dense {dense:.1f}us | table {table_key}: "
              + (f"{table_t:.1f}us x{dense / table_t:.2f}" if table_t else "n/a")
              + f" | best per shape {best_mixed:.1f}us x{dense / best_mixed:.2f}")
        for t, k in full[:6]:
            print(f"    {k}: {t:.1f}us x{dense / t:.2f}")
        summary[m] = {"dense_us": dense, "table": [table_key, table_t], "best_per_shape_us": best_mixed,
                      "single": [[k, t] for t, k in full]}
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "n_sm": n_sm, "summary": summary, "results": results}, indent=1))


if __name__ == "__main__":
    main()
