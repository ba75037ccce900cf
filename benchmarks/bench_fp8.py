"""Reproduce the FP8 kernel numbers of benchmarks/results/fp.md (one GPU), and record them.

    python benchmarks/bench_fp8.py run [--out DIR] [--batch-sizes 1 4 8 16 64 256 1024]
    python benchmarks/bench_fp8.py record DIR [--into benchmarks/results/fp.json]

`run`: the Llama-3-70B layer, `qtool bench --device cuda:0 --bits 8 --format fp8 --shapes llama-3-70b --graphs`
for bf16 and fp16 with per-tensor weight scales (kernels cuda-fp8, scaled-mm-fp8, scaled-mm-fp8-tensor) and for
bf16 with 128x128 blocks (cuda-fp8-block, scaled-mm-fp8-block), writing fp8-{bf16,fp16,block-bf16}.json to DIR.
The dense cuBLAS baseline and the copy bandwidth are measured in the same runs.

`record`: put those JSON reports under the key "fp8kern" of fp.json (the raw runs the page cites) and print
the page's table: per kernel and M, the layer's total speedup over dense and its fraction of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {  # file stem -> (dtype, strategy, kernels)
    "fp8-bf16": ("bf16", "tensor", "cuda-fp8,scaled-mm-fp8,scaled-mm-fp8-tensor"),
    "fp8-fp16": ("fp16", "tensor", "cuda-fp8,scaled-mm-fp8,scaled-mm-fp8-tensor"),
    "fp8-block-bf16": ("bf16", "block", "cuda-fp8-block,scaled-mm-fp8-block"),
}
KEY = "fp8kern"


def commands(out: Path, batch_sizes: list[str], seconds: str) -> list[list[str]]:
    return [[sys.executable, "-m", "qtool", "bench", "--device", "cuda:0", "--bits", "8", "--format", "fp8",
             "--strategy", strategy, "--shapes", "llama-3-70b", "--dtype", dtype, "--batch-sizes", *batch_sizes,
             "--graphs", "--seconds", seconds, "--kernels", kernels, "--quiet", "--json", str(out / f"{stem}.json")]
            for stem, (dtype, strategy, kernels) in RUNS.items()]


def table(reports: dict[str, dict]) -> str:
    lines = ["| run | kernel | M | × dense (layer) | min × dense (shape) | % of copy bandwidth | path |",
             "|---|---|---|---|---|---|---|"]
    for stem, rep in reports.items():
        paths: dict = {}  # (kernel, M) -> the distinct paths its shapes took, in shape order
        for r in rep["results"]:
            seen = paths.setdefault((r["kernel"], r["M"]), [])
            if r["path"] not in seen:
                seen.append(r["path"])
        for kernel, per_m in rep["summary"]["per_m"].items():
            if kernel == "dense":
                continue
            for m, e in sorted(per_m.items(), key=lambda kv: int(kv[0])):
                lines.append(f"| {stem} | {kernel} | {m} | {e['total_speedup_vs_dense']:.2f} | "
                             f"{e['min_speedup_vs_dense']:.2f} | {100 * e['total_bw_fraction']:.1f} | "
                             f"{' / '.join(paths.get((kernel, int(m)), []))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, default=Path("fp8-runs"))
    run.add_argument("--batch-sizes", nargs="+", default=["1", "4", "8", "16", "64", "256", "1024"])
    run.add_argument("--seconds", default="0.3")
    rec = sub.add_parser("record")
    rec.add_argument("dir", type=Path)
    rec.add_argument("--into", type=Path, default=REPO / "benchmarks" / "results" / "fp.json")
    args = ap.parse_args()
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        rc = 0
        for cmd in commands(args.out, args.batch_sizes, args.seconds):
            print("$", " ".join(cmd[1:]), flush=True)
            rc |= subprocess.call(cmd, cwd=REPO)
        return rc
    reports = {stem: json.loads((args.dir / f"{stem}.json").read_text()) for stem in RUNS
               if (args.dir / f"{stem}.json").is_file()}
    data = json.loads(args.into.read_text()) if args.into.is_file() else {}
    data[KEY] = reports
    args.into.write_text(json.dumps(data, indent=1) + "\n")
    print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
