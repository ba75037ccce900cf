"""Probe (issue 7, M = 256): can dequantize + cuBLAS get near dense speed if the dequantized weight never
leaves L2? One Llama-3-70B decoder layer (seven projections), fp16, M = 256, GPU only.

Paths, each timed as CUDA-graph replays over two copies of the layer (so no packed weight is reused from L2
between consecutive uses), median of 5 samples:

    dense      cuBLAS F.linear on an fp16 weight (the baseline)
    full       the shipped dispatch: dequantize the whole W^T [K, N] (PTX dequant kernel), then x @ W^T
    chunk-Nc   N split into column chunks of Nc: dequantize one chunk into a reused [K, Nc] scratch (small
               enough to stay in L2), then x @ chunk into the output's chunk; two scratch buffers alternate
    chunk2s-Nc the same with the dequantization of chunk c+1 on a second stream, overlapping chunk c's GEMM

The packed tensors are stored chunk-contiguous here (what a chunked layout would store) so that the
existing dequant kernel can be used unchanged; outputs are compared with `full` before timing.

    python benchmarks/probe_m256_chunked.py [--m 256] [--chunks 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [("q_proj", 8192, 8192), ("k_proj", 8192, 1024), ("v_proj", 8192, 1024), ("o_proj", 8192, 8192),
          ("gate_proj", 8192, 28672), ("up_proj", 8192, 28672), ("down_proj", 28672, 8192)]  # (name, K, N)
GROUP = 128


def packed(k: int, n: int, g: torch.Generator) -> dict:
    dev = "cuda"
    return {
        "qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev, generator=g),
        "qzeros": torch.randint(-2**31, 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device=dev, generator=g),
        "scales": (torch.rand((k // GROUP, n), device=dev, generator=g) * 0.01 + 0.001).half(),
    }


def dequant_into(p: dict, w: torch.Tensor, k: int, n: int) -> None:
    """w [K, n] fp16 <- dequantized W^T of packed tensors whose row stride is n."""
    import triton

    from qtool.kernels.triton.w4a16 import dequant_words_kernel

    bn, bk = 256, 64
    grid = (triton.cdiv(k, bk), triton.cdiv(n, bn))
    dequant_words_kernel[grid](p["qweight"], p["qzeros"], p["scales"].view(torch.int16), w, n, k, GROUP,
                               BLOCK_N=bn, BLOCK_K=bk, BF16=False, USE_ASM=True, num_warps=8)


def chunked(p: dict, nc: int) -> list[dict]:
    n = p["qweight"].shape[1]
    return [{"qweight": p["qweight"][:, c:c + nc].contiguous(),
             "qzeros": p["qzeros"][:, c // 8:(c + nc) // 8].contiguous(),
             "scales": p["scales"][:, c:c + nc].contiguous()} for c in range(0, n, nc)]


def time_graph(fn, reps: int = 5, inner: int = 5) -> float:
    """Median microseconds of one fn() call, fn captured in a CUDA graph and replayed `inner` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(out)


def probe(nc: int, layers, xs, refs, m: int, t_dense: float) -> None:
    """Time chunk-nc and chunk2s-nc (one line each) after checking chunk-nc against `full`."""
    parts = [[chunked(p, nc) if p["qweight"].shape[1] > nc else [p] for p in layer] for layer in layers]
    scratch = {k: torch.empty((2, k * nc), device="cuda", dtype=torch.float16) for _, k, _n in SHAPES}
    ych = [torch.empty((max(1, n // nc), m, min(n, nc)), device="cuda", dtype=torch.float16)
           for _, _k, n in SHAPES]
    side = torch.cuda.Stream()

    def run_chunk(c_range=(0, 1), two_streams=False):
        main = torch.cuda.current_stream()
        for c in c_range:
            for j, (_, k, n) in enumerate(SHAPES):
                w = min(n, nc)
                ps = parts[c][j]
                if not two_streams:
                    for i, p in enumerate(ps):
                        buf = scratch[k][i % 2, :k * w].view(k, w)
                        dequant_into(p, buf, k, w)
                        torch.matmul(xs[k], buf, out=ych[j][i])
                    continue
                # dequant i+1 on `side` overlaps GEMM i on `main`; buffer (i+1) % 2 is free once GEMM i-1
                # has finished (event g[i-1]); GEMM i waits for its dequant (event d[i])
                d = [torch.cuda.Event() for _ in ps]
                gev = [torch.cuda.Event() for _ in ps]
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    dequant_into(ps[0], scratch[k][0, :k * w].view(k, w), k, w)
                    d[0].record(side)
                for i in range(len(ps)):
                    main.wait_event(d[i])
                    torch.matmul(xs[k], scratch[k][i % 2, :k * w].view(k, w), out=ych[j][i])
                    gev[i].record(main)
                    if i + 1 < len(ps):
                        with torch.cuda.stream(side):
                            if i >= 1:
                                side.wait_event(gev[i - 1])
                            dequant_into(ps[i + 1], scratch[k][(i + 1) % 2, :k * w].view(k, w), k, w)
                            d[i + 1].record(side)
                main.wait_stream(side)

    run_chunk((0,))
    torch.cuda.synchronize()
    worst = 0.0
    for j, (_, _k, n) in enumerate(SHAPES):
        got = ych[j].permute(1, 0, 2).reshape(m, n) if n > nc else ych[j][0]
        worst = max(worst, float((got.float() - refs[j].float()).abs().max() / refs[j].float().abs().max()))
    t1 = time_graph(lambda: run_chunk()) / 2
    print(f"  chunk-{nc:<5}      {t1:8.1f} us   {t_dense / t1:.2f}x   (max rel diff to full {worst:.1e})")
    t2 = time_graph(lambda: run_chunk(two_streams=True)) / 2
    print(f"  chunk2s-{nc:<5}    {t2:8.1f} us   {t_dense / t2:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    m = a.m
    layers = [[packed(k, n, g) for _, k, n in SHAPES] for _copy in range(2)]
    dense = [[(torch.randn((n, k), device="cuda", generator=g) * 0.02).half() for _, k, n in SHAPES] for _c in range(2)]
    xs = {k: (torch.randn((m, k), device="cuda", generator=g)).half() for _, k, _n in SHAPES}
    ys = [torch.empty((m, n), device="cuda", dtype=torch.float16) for _, _k, n in SHAPES]
    wfull = {(k, n): torch.empty((k, n), device="cuda", dtype=torch.float16) for _, k, n in SHAPES}

    def run_dense():
        for c in range(2):
            for j, (_, k, _n) in enumerate(SHAPES):
                torch.matmul(xs[k], dense[c][j].t(), out=ys[j])

    def run_full():
        for c in range(2):
            for j, (_, k, n) in enumerate(SHAPES):
                w = torch.empty((k, n), device="cuda", dtype=torch.float16)  # as the shipped path: a temporary
                dequant_into(layers[c][j], w, k, n)
                torch.matmul(xs[k], w, out=ys[j])

    t_dense = time_graph(run_dense) / 2
    t_full = time_graph(run_full) / 2
    print(f"M={m} fp16, one Llama-3-70B layer (7 projections), per layer:")
    print(f"  dense            {t_dense:8.1f} us   1.00x")
    print(f"  full             {t_full:8.1f} us   {t_dense / t_full:.2f}x")

    # reference outputs of `full` for the correctness check
    refs = []
    for j, (_, k, n) in enumerate(SHAPES):
        dequant_into(layers[0][j], wfull[(k, n)], k, n)
        refs.append(xs[k] @ wfull[(k, n)])
    del wfull
    torch.cuda.empty_cache()

    for nc in a.chunks:
        if any(n > nc and n % nc for _, _k, n in SHAPES):
            print(f"  chunk-{nc:<5}      skipped: does not divide every N")
            continue
        probe(nc, layers, xs, refs, m, t_dense)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
