"""Sweep launch configurations of the Triton W4A16 kernel on the GPU; the source of launch.TABLE.

    python benchmarks/tune_w4a16.py --shapes llama-3-70b,llama-3-8b --batch-sizes 1 16 256 --json tune.json

For every distinct K x N and M: the float64 oracle check of each candidate (a failing candidate is
reported and skipped), then the median time per call over CUDA-graph replays with rotating weight copies
(as `qtool bench --graphs`), next to dense F.linear and dequantize+cuBLAS. Prints the best candidate per
(shape, M) and writes every measurement to --json. Candidates are compiled in parallel worker processes
first (Triton caches them on disk), so the sweep itself does not wait on the compiler.
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

from qtool.kernels.triton.launch import DEQUANT_GEMM, LaunchConfig  # noqa: E402


def candidates(m: int) -> list[LaunchConfig]:
    c: list[LaunchConfig] = []
    if m == 1:
        for bn, bk, w, pair in [(512, 64, 4, False), (512, 64, 4, True), (1024, 64, 8, True), (256, 128, 8, True),
                                (512, 128, 8, True), (256, 128, 4, False), (256, 64, 4, True)]:
            c.append(LaunchConfig(mode=3, block_m=1, block_n=bn, block_k=bk, num_warps=w, num_stages=1, pair=pair))
    if 1 < m <= 16:
        for mode, bn, bk, w, st in [(2, 128, 128, 4, 3), (2, 64, 128, 4, 3), (1, 128, 128, 4, 3), (2, 128, 256, 8, 3),
                                    (2, 128, 128, 4, 4), (2, 256, 128, 8, 3)]:
            c.append(LaunchConfig(mode=mode, block_m=16, block_n=bn, block_k=bk, num_warps=w, num_stages=st))
        c.append(LaunchConfig(mode=3, block_m=1, block_n=512, block_k=64, num_warps=4, num_stages=1))
    if m > 16:
        for bm, bn, bk, w, st in [(128, 256, 128, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 4)]:
            c.append(LaunchConfig(mode=2, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st))
        c.append(LaunchConfig(path=DEQUANT_GEMM))
    return c


def with_split(cfg: LaunchConfig, m: int, n: int, k: int, n_sm: int, pps: float) -> LaunchConfig:
    if cfg.path != "fused":
        return cfg
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    kb = -(-k // cfg.block_k)
    want = max(1, int(pps * n_sm) // tiles)
    split = 1
    while split * 2 <= min(want, kb, 64 if cfg.mode == 3 else 16):
        split *= 2
    return replace(cfg, split_k=split)


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
    ap.add_argument("--shapes", default="llama-3-70b,llama-3-8b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--pps", type=float, nargs="+", default=[2.0, 4.0, 8.0],
                    help="split-K targets: programs per SM")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    ap.add_argument("--seconds", type=float, default=0.25)
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

    all_cfgs = []
    for s in shapes:
        for m in args.batch_sizes:
            for c in candidates(m):
                for pps in args.pps:
                    all_cfgs.append(with_split(c, m, s.N, s.K, n_sm, pps))
    t0 = time.time()
    errs = precompile(all_cfgs, args.workers)
    print(f"precompiled {len(set(all_cfgs))} configs in {time.time() - t0:.0f}s; {len(errs)} errors", flush=True)
    for e in errs[:20]:
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
            tried = set()
            for c0 in candidates(m):
                for pps in args.pps:
                    c = with_split(c0, m, s.N, s.K, n_sm, pps)
                    if c in tried:
                        continue
                    tried.add(c)
                    entry = {"cfg": asdict(c), "label": c.label()}
                    try:
                        out = torch.full((m, s.N), float("nan"), device=dev, dtype=dtype)
                        y = run_w4a16(xs[0], layer.qweight, layer.qzeros, layer.scales, None, 128, c, out=out)
                        err = rel_err(y, y64)
                        entry["err"] = err
                        if not err <= 4 * base:
                            entry["status"] = "wrong"
                            rec["cands"].append(entry)
                            continue
                        t = time_calls([(lambda x=x, L=L, c=c: run_w4a16(x, L.qweight, L.qzeros, L.scales, None,
                                                                           128, c)) for x, L in zip(xs, qs)],
                                       dev, graphs=True, max_seconds=args.seconds).median_s
                        entry.update(status="ok", us=t * 1e6, bw_frac=qbytes / t / bw, speedup=td / t)
                    except Exception as e:  # noqa: BLE001
                        entry.update(status="error", reason=f"{type(e).__name__}: {str(e)[:200]}")
                    rec["cands"].append(entry)
            ok = sorted((e for e in rec["cands"] if e["status"] == "ok"), key=lambda e: e["us"])
            bad = [e for e in rec["cands"] if e["status"] != "ok"]
            best = ok[0] if ok else None
            rec["best"] = best
            print(f"{s.K}x{s.N} M={m}: dense {td * 1e6:.1f}us | best "
                  + (f"{best['label']} {best['us']:.1f}us {100 * best['bw_frac']:.0f}%BW x{best['speedup']:.2f}"
                     if best else "none") + f" | {len(bad)} bad", flush=True)
            for e in ok[1:4]:
                print(f"      {e['label']} {e['us']:.1f}us x{e['speedup']:.2f}")
            for e in bad[:3]:
                print(f"      BAD {e['label']}: {e.get('status')} {e.get('err', '')} {e.get('reason', '')[:150]}")
            results.append(rec)
            del xs
        del qs, ws, w64, w16, layer
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "n_sm": n_sm, "results": results}, indent=1))


if __name__ == "__main__":
    main()
