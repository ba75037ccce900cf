"""The FP8 GEMV's CTA widths against its plan, the W8A8 path and dense, on the Llama-3 8B/70B and Qwen2.5-32B
projections at M = 1, 4, 8 (one GPU). The evidence behind qtool/kernels/cuda_fp8.py's `plan`.

    python benchmarks/tune_fp8_gemv.py [--json OUT.json] [--strategies tensor block] [--reps 20] [--splits 1 2 4 8]

Per shape and M: dense bf16 (torch.mm), the W8A8 path (scaled-mm-fp8 / scaled-mm-fp8-block), and the GEMV at
4 and 8 warps per CTA (each with the K splits its plan gives), and which one `plan` picks. Timing: a CUDA
graph of R calls, each on its own copy of the weights (R copies hold >= 300 MB, past the L2), replayed `--reps`
times; the median per call in microseconds. The GEMV is checked against the float64 oracle first.
--splits also times each width at each of those K split counts (each launch checked against the oracle too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtool.bench.layers import random_scaled  # noqa: E402
from qtool.formats.scaled import dequantize  # noqa: E402
from qtool.kernels import cuda_fp8  # noqa: E402
from qtool.kernels.base import ScaledLayer, get_kernel  # noqa: E402

SHAPES = {  # (N, K)
    "llama-3-70b q/o": (8192, 8192), "llama-3-70b k/v": (1024, 8192), "llama-3-70b gate/up": (28672, 8192),
    "llama-3-70b down": (8192, 28672), "llama-3-8b q/o": (4096, 4096), "llama-3-8b k/v": (1024, 4096),
    "llama-3-8b gate/up": (14336, 4096), "llama-3-8b down": (4096, 14336), "qwen2.5-32b q/o": (5120, 5120),
    "qwen2.5-32b k/v": (1024, 5120), "qwen2.5-32b gate/up": (27648, 5120), "qwen2.5-32b down": (5120, 27648),
}
W8A8 = {"tensor": "scaled-mm-fp8", "block": "scaled-mm-fp8-block"}
GEMV = {"tensor": "cuda-fp8", "block": "cuda-fp8-block"}


def per_call_us(fns, reps: int) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(fns))
    return statistics.median(times)


def measure(strat: str, name: str, n: int, k: int, reps: int, splits: list[int] | None = None) -> list[dict]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    kern, w8a8 = get_kernel(GEMV[strat]), get_kernel(W8A8[strat])
    copies = max(2, min(48, int(300e6 // (n * k))))
    plains = [random_scaled(n, k, strategy=strat, dtype=dtype, device=dev, seed=i) for i in range(copies)]
    states = [kern.prepare(ScaledLayer(p)) for p in plains]
    dense = [dequantize(p, dtype) for p in plains[: max(2, copies // 2)]]
    w64 = dequantize(plains[0], torch.float64)
    n_sm = states[0].gemv.n_sm
    rows = []
    for m in (1, 4, 8):
        x = torch.randn(m, k, device=dev).to(dtype)
        ref = x.double() @ w64.t()
        err = float((cuda_fp8.gemv(x, states[0].gemv).double() - ref).norm() / ref.norm())
        base = float((F.linear(x, dense[0]).double() - ref).norm() / ref.norm())
        if not err <= 1.5 * base + 1e-7:
            raise SystemExit(f"{name} M={m}: GEMV error {err:.3g} > 1.5 x dense's {base:.3g}")
        outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(copies)]
        row = {"strategy": strat, "shape": name, "N": n, "K": k, "M": m, "err": err, "dense_err": base,
               "dense_us": per_call_us([partial(torch.mm, x, dense[i % len(dense)].t(), out=outs[i])
                                        for i in range(copies)], reps),
               "w8a8_us": per_call_us([partial(w8a8.forward, x, states[i].mm, outs[i]) for i in range(copies)],
                                      reps)}
        for w in cuda_fp8.WIDTHS:
            pl = cuda_fp8.plan(m, n, k, n_sm, warps=w)
            row[f"gemv_w{w}_us"] = per_call_us([partial(cuda_fp8.gemv, x, states[i].gemv, outs[i], pl)
                                                for i in range(copies)], reps)
            row[f"gemv_w{w}_splits"] = pl.splits
        for w in cuda_fp8.WIDTHS if splits else ():
            for sp in splits:
                pl = cuda_fp8.plan(m, n, k, n_sm, warps=w, splits=sp)
                y = cuda_fp8.gemv(x, states[0].gemv, torch.full((m, n), float("nan"), device=dev, dtype=dtype), pl)
                e = float((y.double() - ref).norm() / ref.norm())
                if not e <= 1.5 * base + 1e-7:
                    raise SystemExit(f"{name} M={m} w{w} split {pl.splits}: GEMV error {e:.3g} > 1.5 x dense's {base:.3g}")
                row[f"gemv_w{w}_split{pl.splits}_us"] = per_call_us(
                    [partial(cuda_fp8.gemv, x, states[i].gemv, outs[i], pl) for i in range(copies)], reps)
        auto = cuda_fp8.plan(m, n, k, n_sm)
        row["plan"] = f"w{auto.warps}"
        best = min(cuda_fp8.WIDTHS, key=lambda w, row=row: row[f"gemv_w{w}_us"])
        print(f"{strat} {name} M={m}: dense {row['dense_us']:.1f} w8a8 {row['w8a8_us']:.1f} "
              + " ".join(f"w{w}(s{row[f'gemv_w{w}_splits']}) {row[f'gemv_w{w}_us']:.1f}" for w in cuda_fp8.WIDTHS)
              + f" plan w{auto.warps} ({row[f'gemv_w{auto.warps}_us'] / row[f'gemv_w{best}_us']:.3f} of best)",
              flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--strategies", nargs="+", default=["tensor", "block"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--splits", nargs="+", type=int, help="also time each width at these K split counts")
    args = ap.parse_args()
    rows = []
    for strat in args.strategies:
        for name, (n, k) in SHAPES.items():
            rows += measure(strat, name, n, k, args.reps, args.splits)
            torch.cuda.empty_cache()
    if args.json:
        props = torch.cuda.get_device_properties(torch.device("cuda"))
        args.json.write_text(json.dumps({"device": props.name, "sms": props.multi_processor_count,
                                         "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
