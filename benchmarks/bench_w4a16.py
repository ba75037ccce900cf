"""Reproduce the W4A16 numbers in the README / benchmarks/results/bench.md.

    python benchmarks/bench_w4a16.py [--out DIR] [--models llama-3-70b llama-3-8b] [--dtype fp16]

For each model: `qtool bench --device cuda:0 --shapes MODEL --batch-sizes 1 16 256 --graphs` with the JSON,
Markdown tables and PNG plot written to DIR (default benchmarks/results). Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--models", nargs="+", default=["llama-3-70b", "llama-3-8b"])
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--batch-sizes", nargs="+", default=["1", "16", "256"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for model in args.models:
        stem = args.out / f"bench-{model}-{args.dtype}"
        cmd = [sys.executable, "-m", "qtool", "bench", "--device", "cuda:0", "--shapes", model, "--dtype", args.dtype,
               "--batch-sizes", *args.batch_sizes, "--graphs", "--json", f"{stem}.json",
               "--markdown", f"{stem}.md", "--plot", f"{stem}.png"]
        print("$", " ".join(cmd[1:]), flush=True)
        rc |= subprocess.call(cmd, cwd=REPO)
    return rc


if __name__ == "__main__":
    sys.exit(main())
