"""Reproduce the W4A16 numbers of the README and benchmarks/results/bench.md (one GPU, CUDA and triton).

    python benchmarks/bench_w4a16.py [--out DIR] [--models llama-3-70b] [--dtypes fp16 bf16]
                                     [--batch-sizes 1 16 256] [--kernels triton-w4a16,cuda-w4a16]

For each model and dtype: `qtool bench --device cuda:0 --shapes MODEL --dtype DTYPE --batch-sizes ... --graphs
--kernels ...`, writing bench-MODEL-DTYPE-cuda.{json,png} to DIR (default benchmarks/results, the files the
page cites). The dense cuBLAS baseline and the copy bandwidth are measured in the same run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commands(out: Path, models: list[str], dtypes: list[str], batch_sizes: list[str], kernels: str) -> list[list[str]]:
    cmds = []
    for model in models:
        for dtype in dtypes:
            stem = out / f"bench-{model}-{dtype}-cuda"
            cmds.append([sys.executable, "-m", "qtool", "bench", "--device", "cuda:0", "--shapes", model,
                         "--dtype", dtype, "--batch-sizes", *batch_sizes, "--graphs", "--kernels", kernels,
                         "--json", f"{stem}.json", "--plot", f"{stem}.png"])
    return cmds


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--models", nargs="+", default=["llama-3-70b"])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    ap.add_argument("--batch-sizes", nargs="+", default=["1", "16", "256"])
    ap.add_argument("--kernels", default="triton-w4a16,cuda-w4a16")
    return ap


def main() -> int:
    args = parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for cmd in commands(args.out, args.models, args.dtypes, args.batch_sizes, args.kernels):
        print("$", " ".join(cmd[1:]), flush=True)
        rc |= subprocess.call(cmd, cwd=REPO)
    return rc


if __name__ == "__main__":
    sys.exit(main())
