"""Summarize an Nsight Compute report's SASS source page (per-instruction counters): where one kernel stalls.

    ncu --clock-control none -k regex:qt_xr -c 1 --section WarpStateStats --section SourceCounters \\
        --section InstructionStats -o rep python tools/profile_cuda_w4a16.py 16 --shape 8192x28672
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python tools/ncu_source_summary.py src.csv [--top N] [--regions UNITS]

Prints the column totals (instructions executed, warp stall samples, each stall reason) and the instructions with
the most stall samples and the most executions. --regions UNITS: the code as runs of consecutive instructions
with the same execution count (a loop body, a branch taken so often), each with its instructions per work unit
(UNITS: how many times the kernel's main loop body runs in all warps, e.g. units x warps per CTA) and its share
of the stall samples.
"""

import argparse
import csv
import sys


def num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    hi = next(i for i, r in enumerate(rows) if "Source" in (c.strip() for c in r))
    return rows[hi], rows[hi + 1:]


def opcode(src: str) -> str:
    parts = src.split()
    return parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else (parts[0] if parts else "")


def regions(head: list[str], body: list[list[str]], units: int) -> None:
    ci, cs = head.index("Instructions Executed"), head.index("Warp Stall Sampling (All Samples)")
    ca, src = head.index("Address"), head.index("Source")
    stalls = [i for i, n in enumerate(head) if n.startswith("stall_") and "Not Issued" not in n]
    base = int(body[0][ca], 16)
    runs: list[dict] = []
    for r in body:
        e, s, a = num(r[ci]), num(r[cs]), int(r[ca], 16) - base
        if not runs or runs[-1]["exec"] != e:
            runs.append({"start": a, "end": a, "exec": e, "n": 0, "samples": 0.0, "ops": {}, "stalls": {}})
        g = runs[-1]
        g["end"], g["n"], g["samples"] = a, g["n"] + 1, g["samples"] + s
        g["ops"][opcode(r[src])] = g["ops"].get(opcode(r[src]), 0) + 1
        for i in stalls:
            g["stalls"][head[i][6:]] = g["stalls"].get(head[i][6:], 0) + num(r[i])
    tot = sum(g["exec"] * g["n"] for g in runs)
    ts = sum(g["samples"] for g in runs) or 1
    print(f"{tot:.0f} warp instructions executed ({tot / units:.0f} per unit of {units}), {ts:.0f} warp stall samples")
    print("runs of one execution count with >= 0.4 % of the instructions or >= 1 % of the samples:")
    for g in runs:
        if g["exec"] * g["n"] > 0.004 * tot or g["samples"] > 0.01 * ts:
            top = ", ".join(f"{k} {v}" for k, v in sorted(g["ops"].items(), key=lambda x: -x[1])[:4])
            stl = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g["stalls"].items(), key=lambda x: -x[1])[:3])
            print(f"  {g['start']:#07x}-{g['end']:#07x} x{g['exec']:>6.0f}: {g['n']:>3} instructions = "
                  f"{g['exec'] * g['n'] / units:5.1f}/unit; samples {100 * g['samples'] / ts:4.1f} % ({stl}); {top}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--regions", type=int, default=0, metavar="UNITS")
    a = ap.parse_args()
    head, body = load(a.csv)
    if a.regions:
        regions(head, body, a.regions)
        return 0
    src = head.index("Source")
    cols = {name: i for i, name in enumerate(head)}
    numeric = [n for n in head if n not in ("Source", "Address") and any(num(r[cols[n]]) for r in body)]
    tot = {n: sum(num(r[cols[n]]) for r in body) for n in numeric}
    print("instructions:", len(body))
    for n in numeric:
        print(f"  {n}: {tot[n]:.0f}")
    samp = next((n for n in numeric if "All Samples" in n), None)
    exe = next((n for n in numeric if n.startswith("Instructions Executed")), None)
    stalls = [n for n in numeric if n.startswith("stall_") and "Not Issued" not in n]
    s = sum(tot[n] for n in stalls) or 1
    print("stall reasons:", ", ".join(f"{n[6:]} {100 * tot[n] / s:.1f}%" for n in sorted(stalls, key=lambda n: -tot[n])
                                      if tot[n] > 0.005 * s))
    addr = cols["Address"]
    for key in (samp, exe):
        if key is None:
            continue
        print(f"-- top {a.top} by {key}")
        for r in sorted(body, key=lambda r: -num(r[cols[key]]))[: a.top]:
            print(f"{r[addr]:>18} {num(r[cols[key]]):>10.0f}  {r[src][:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
