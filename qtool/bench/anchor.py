"""A reference kernel's figures (`--anchor FILE.csv`) set beside a bench report, and the flags a sweep raises.

The anchor file is a CSV with the columns model, shape, count_in_layer, K, N, M, fp16_us, <kernel>_us and
<kernel>_x_fp16 (benchmarks/anchors/marlin-orig-h200.csv: the original Marlin kernel against fp16 cuBLAS on an
H200). Only K, N, M, fp16_us and the kernel's time are used (each row is one call's time; model and shape, where
present, only tell one layer's row from another's, and a layer's second row for one M is refused): a bench shape
takes the mean of the anchor's rows of the same K x N and M (several models or projections can share a shape), so the
anchor speedup of a shape is mean(fp16_us) / mean(kernel_us), and of the bench's layer, the sums of those means
over its shapes, each counted once per occurrence, as the bench sums its own times. Absolute times drift between runs and machines; ratios carry over.

Flags: every (kernel, M) whose layer sum is below dense, or below the anchor's speedup at that M. A kernel that
ran on only some shapes is compared over those shapes (dense's and the anchor's times on the same shapes), and its
flag says how many of the layer's shapes the sum covers.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

from qtool.bench.shapes import MAX_DIM, digits_value
from qtool.errors import InputError, UsageError

REQUIRED = ("K", "N", "M", "fp16_us")
MAX_BYTES = 16 << 20  # a figures table, not a data set
MAX_ROWS = 100_000  # 200 times the shipped tables (benchmarks/anchors: under 500 rows); bounds what is held
# A nanosecond to 1000 s per call: wider than any GEMM's time, narrow enough that the sums and ratios of any
# MAX_ROWS rows stay finite (1e308 us beside 1e300 us made a layer's anchor speedup inf).
MIN_US, MAX_US = 1e-3, 1e9
# ASCII digits only: int() and float() also take "1_0" (as 10) and other scripts' digits.
INT = re.compile(r"\s*[0-9]+\s*")


@dataclass(frozen=True)
class Anchor:
    name: str  # the reference kernel, from the <name>_us column
    path: str
    times: dict[tuple[int, int, int], tuple[float, float]]  # (K, N, M) -> (mean fp16_us, mean kernel_us)

    def speedup(self, k: int, n: int, m: int) -> float | None:
        t = self.times.get((k, n, m))
        return t[0] / t[1] if t else None


def load_anchor(path: Path) -> Anchor:
    """Read an anchor CSV; any problem is a one-line error naming the file, the line and the fix."""
    fix = "give a CSV with columns K,N,M,fp16_us and one <kernel>_us column (as benchmarks/anchors/*.csv)"
    if path.is_dir():
        raise UsageError(f"--anchor {path}: is a directory", fix=fix)
    if not path.exists():
        raise UsageError(f"--anchor {path}: no such file", fix=fix)
    try:
        # At most one byte past the limit is read: the size stat() gives is 0 for a pipe (--anchor <(...)) and
        # stale for a file still being written.
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise InputError(f"anchor file is more than a figures table ({MAX_BYTES:,} bytes)", path=path, fix=fix)
        text = data.decode("utf-8-sig")  # a spreadsheet's export may start with a BOM
    except UnicodeDecodeError:
        raise InputError("anchor file is not UTF-8 text", path=path, fix=fix) from None
    except OSError as e:
        raise InputError(f"cannot read the anchor file ({e.strerror or type(e).__name__})", path=path,
                         fix=fix) from None
    # newline="" keeps a quoted field's line breaks as the csv module expects; strict makes a stray or unclosed
    # quote an error instead of a field that silently swallows the lines after it.
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    try:
        kcol, sums = _read_rows(reader, path, fix)
    except csv.Error as e:  # bad quoting, a field over the csv module's size limit
        # the underlying reader's count: DictReader's own is updated only after a record is returned
        raise InputError(f"anchor file line {reader.reader.line_num or 1} is not valid CSV ({e})", path=path,
                         fix=fix) from None
    times = {key: (a / c, b / c) for key, (a, b, c) in sums.items()}
    if not times:
        raise InputError("anchor file has no rows", path=path, fix=fix)
    return Anchor(kcol[: -len("_us")], str(path), times)


def _read_rows(reader: csv.DictReader, path: Path, fix: str
               ) -> tuple[str, dict[tuple[int, int, int], tuple[float, float, int]]]:
    """The kernel's time column, and (K, N, M) -> (sum of fp16_us, sum of the kernel's time, row count)."""
    cols = reader.fieldnames or []
    if len(set(cols)) != len(cols):
        raise InputError(f"anchor file names column '{next(c for c in cols if cols.count(c) > 1)}' twice",
                         path=path, fix=fix)
    missing = [c for c in REQUIRED if c not in cols]
    kernel_cols = [c for c in cols if c.endswith("_us") and c != "fp16_us"]
    if missing or len(kernel_cols) != 1:
        what = f"lacks column(s) {', '.join(missing)}" if missing else (
            f"has {len(kernel_cols)} kernel time columns (<kernel>_us besides fp16_us), not one")
        raise InputError(f"anchor file {what}", path=path, fix=fix)
    kcol = kernel_cols[0]
    if kcol == "_us":  # the flags and tables name the reference kernel by it
        raise InputError("anchor file's kernel time column '_us' names no kernel", path=path,
                         fix="name it <kernel>_us, e.g. marlin_us")
    # One layer's row per model, shape and M: a second is a pasted repeat or a rerun, and averaging it in would
    # weight that figure twice. Rows of different layers of one K x N are meant to be averaged (gate and up).
    ident = [c for c in ("model", "shape") if c in cols]
    first: dict[tuple, int] = {}
    sums: dict[tuple[int, int, int], tuple[float, float, int]] = {}
    for row in reader:
        line = reader.line_num  # the record's last line: blank lines and quoted line breaks count
        if None in row or None in row.values():  # more or fewer fields than the header names
            raise InputError(f"anchor file line {line}: {len(row.get(None) or ())} field(s) beyond the header's "
                             f"{len(cols)}" if None in row else f"anchor file line {line}: fewer fields than the "
                             f"header's {len(cols)}", path=path, fix=fix)
        if len(first) >= MAX_ROWS:
            raise InputError(f"anchor file has more than {MAX_ROWS:,} rows (line {line})", path=path,
                             fix="keep the rows of the models and M you bench")
        try:
            if not (all(INT.fullmatch(row[c]) for c in ("K", "N", "M"))
                    and all(row[c].isascii() and "_" not in row[c] for c in ("fp16_us", kcol))):
                raise ValueError
            k, n, m = (digits_value(row[c]) for c in ("K", "N", "M"))
            fp16, kern = float(row["fp16_us"]), float(row[kcol])
        except ValueError:
            raise InputError(f"anchor file line {line}: K, N, M must be integers and fp16_us, {kcol} numbers",
                             path=path, fix=fix) from None
        if not (all(1 <= d <= MAX_DIM for d in (k, n, m)) and all(MIN_US <= t <= MAX_US for t in (fp16, kern))):
            raise InputError(f"anchor file line {line}: sizes and times must be positive and finite (K, N, M from "
                             f"1 to {MAX_DIM}; times from {MIN_US} to {MAX_US:,.0f} us)", path=path, fix=fix)
        key = (*(row[c].strip() for c in ident), k, n, m)
        if key in first:
            what = ", ".join([*ident, "K, N and M"])
            raise InputError(f"anchor file line {line} repeats line {first[key]}'s {what}", path=path,
                             fix="keep one row per layer and M" + ("" if ident else
                                 ", or add model and shape columns that tell the layers of one K x N apart"))
        first[key] = line
        a, b, c = sums.get((k, n, m), (0.0, 0.0, 0))
        sums[(k, n, m)] = (a + fp16, b + kern, c + 1)
    return kcol, sums


def apply_anchor(report, anchor: Anchor | None, dense: str = "dense") -> None:
    """Add the anchor's speedups to the report's rows and per-M layer sums, and the flags (always: below dense;
    with an anchor: below it). A layer sum is compared with the anchor only where the anchor has every shape the sum
    covers (a kernel's sum over part of the shapes may be compared where the whole layer is not); the shapes and M
    it lacks are listed (summary.anchor.uncovered), so a missing comparison is said, not blank.
    `dense`: the kernel id of the dense baseline's rows."""
    DENSE = dense  # noqa: N806 - the baseline's id, as run.py names it

    summary = report.summary
    rows = [r for r in report.rows if r.kernel != DENSE and r.status == "ok" and r.median_us]
    if anchor is not None:
        for r in rows:
            a = anchor.speedup(r.K, r.N, r.M)
            if a is not None and r.speedup_vs_dense is not None:
                r.anchor_x_dense = a
                r.vs_anchor = r.speedup_vs_dense / a
        gaps: dict[tuple[str, int, int], set[int]] = {}
        for r in report.rows:
            if anchor.speedup(r.K, r.N, r.M) is None:
                gaps.setdefault((r.shape, r.K, r.N), set()).add(r.M)
        summary["anchor"] = {"kernel": anchor.name, "file": Path(anchor.path).name,
                             "uncovered": [{"shape": sh, "K": k, "N": n, "M": sorted(ms)}
                                           for (sh, k, n), ms in gaps.items()]}
    dense = {(r.shape, r.M): r for r in report.rows if r.kernel == DENSE}
    flags = []
    for kname, per_m in summary.get("per_m", {}).items():
        if kname == DENSE:
            continue
        for m, e in per_m.items():
            ok = [r for r in rows if r.kernel == kname and r.M == int(m)]
            if anchor is not None and ok and all(anchor.speedup(r.K, r.N, r.M) is not None for r in ok):
                fp16 = sum(anchor.times[(r.K, r.N, r.M)][0] for r in ok)
                kern = sum(anchor.times[(r.K, r.N, r.M)][1] for r in ok)
                e["anchor_x_dense"] = fp16 / kern
                e["vs_anchor"] = e["total_speedup_vs_dense"] / e["anchor_x_dense"]
            below = []
            if e["total_speedup_vs_dense"] < 1.0:
                below.append(f"below dense ({e['total_speedup_vs_dense']:.2f}x)")
            if e.get("vs_anchor") is not None and e["vs_anchor"] < 1.0:
                below.append(f"below {anchor.name} ({e['total_speedup_vs_dense']:.2f}x against "
                             f"{e['anchor_x_dense']:.2f}x, ratio {e['vs_anchor']:.2f})")
            if below:
                why = "; ".join(below)
                if e.get("shapes_total") and e["shapes"] < e["shapes_total"]:  # the sum of part of the layer
                    why = f"over {e['shapes']} of {e['shapes_total']} shapes: {why}"
                flags.append({"kernel": kname, "M": int(m), "scope": "layer", "why": why})
    for r in rows:
        below = []
        if r.speedup_vs_dense is not None and r.speedup_vs_dense < 1.0 and (r.shape, r.M) in dense:
            below.append(f"below dense ({r.speedup_vs_dense:.2f}x)")
        if r.vs_anchor is not None and r.vs_anchor < 1.0:
            below.append(f"below {anchor.name} ({r.speedup_vs_dense:.2f}x against {r.anchor_x_dense:.2f}x)")
        if below:
            flags.append({"kernel": r.kernel, "M": r.M, "scope": r.shape, "why": "; ".join(below)})
    summary["flags"] = flags
