"""Fuzz the parsers of untrusted input with hypothesis, 10,000 generated cases per parser, and record what
happened: how many inputs each parser accepted, refused with a QtoolError (the contract) or reported as
damaged (GGUF), and every crash (any other exception, or an accepted input breaking an invariant of the
parsed result), grouped by exception type and the qtool line it came from.

    .venv/bin/python benchmarks/fuzz_headers.py                      # 10,000 per target, all targets
    .venv/bin/python benchmarks/fuzz_headers.py -n 2000 --target gguf_header --seed 7

Strategies and targets are those of tests/attacks/fuzz_targets.py (CI runs 150 per target through
tests/attacks/test_fuzz.py). Unlike the tests, the run does not stop at the first crash: it counts them all.
Results go to benchmarks/results/fuzz.md (date, command, machine, counts, crash signatures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from tests.attacks import fuzz_targets as ft  # noqa: E402


def signature(e: BaseException) -> str:
    """Exception type and the innermost frame inside qtool/ (or the innermost frame at all): one line per
    distinct bug, however many inputs reach it."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/qtool/" in f.filename] or frames
    where = "?"
    if ours:
        f = ours[-1]
        name = str(Path(f.filename).relative_to(REPO)) if f.filename.startswith(str(REPO)) else f.filename
        where = f"{name}:{f.lineno}"
    kind = "invariant broken" if isinstance(e, AssertionError) else type(e).__name__
    return f"{kind} at {where}"


def fuzz(target: str, n: int, seed_value: int) -> dict:
    strategy, run, label = ft.TARGETS[target]
    outcomes: Counter = Counter()
    crashes: dict[str, list] = {}

    @seed(seed_value)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy())
    def body(x):
        try:
            outcomes[run(x)] += 1
        except Exception as e:  # noqa: BLE001 - counting every crash is the point
            sig = signature(e)
            outcomes["crash"] += 1
            entry = crashes.setdefault(sig, [0, None, ""])
            entry[0] += 1
            text = repr(x)
            if entry[1] is None or len(text) < len(entry[1]):
                entry[1], entry[2] = text, (str(e).splitlines() or [""])[0][:120]

    t0 = time.perf_counter()
    body()
    seconds = time.perf_counter() - t0
    return {"target": target, "label": label, "cases": sum(outcomes.values()), "outcomes": dict(outcomes),
            "crashes": crashes, "seconds": seconds}


def markdown(results: list[dict], args, command: str) -> str:
    lines = [
        "# Fuzzing the parsers of untrusted input",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}",
        f"- hypothesis {__import__('hypothesis').__version__}, seed {args.seed}, {args.n} generated cases per target "
        "(generate phase only: every case counted, no shrinking)",
        "- outcome per case: `accepted`; `refused` = a QtoolError (one line naming the file: the contract); "
        "`reported` = the GGUF reader parsed it and listed the damage as problems; `crash` = any other exception, "
        "or an accepted input whose parsed result breaks an invariant (offsets past the file, overlaps, a "
        "complete directory with the wrong count, ...)",
        "",
        "| target | parser | cases | accepted | refused | reported | crash | cases/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        o = r["outcomes"]
        lines.append(f"| {r['target']} | {r['label']} | {r['cases']} | {o.get('accepted', 0)} | "
                     f"{o.get('refused', 0)} | {o.get('reported', 0)} | {o.get('crash', 0)} | "
                     f"{r['cases'] / max(r['seconds'], 1e-9):.0f} |")
    total = sum(r["cases"] for r in results)
    crashes = sum(r["outcomes"].get("crash", 0) for r in results)
    lines += ["", f"Total: {total} cases, {crashes} crashes.", ""]
    if crashes:
        lines += ["## Crashes (where: count; the smallest input that reached it, and its message)", ""]
        for r in results:
            for sig, (count, ex, msg) in sorted(r["crashes"].items(), key=lambda kv: -kv[1][0]):
                lines.append(f"- **{r['target']}** `{sig}`: {count} cases; e.g. `{ex[:200]}` -> {msg}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=10_000, help="generated cases per target (default 10,000)")
    p.add_argument("--target", action="append", choices=sorted(ft.TARGETS), help="repeatable; default all")
    p.add_argument("--seed", type=int, default=20240601)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fuzz.md")
    args = p.parse_args()
    command = " ".join(["python benchmarks/fuzz_headers.py", *sys.argv[1:]])
    results = []
    try:
        for target in args.target or list(ft.TARGETS):
            r = fuzz(target, args.n, args.seed)
            o = r["outcomes"]
            print(f"{target:20s} {r['cases']:6d} cases in {r['seconds']:6.1f} s: " +
                  ", ".join(f"{k} {v}" for k, v in sorted(o.items())), flush=True)
            for sig, (count, _, msg) in r["crashes"].items():
                print(f"    crash x{count}: {sig}: {msg}", flush=True)
            results.append(r)
    finally:
        ft.cleanup()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, args, command), encoding="utf-8")
    print(f"wrote {args.out}")
    return 1 if any(r["outcomes"].get("crash") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
