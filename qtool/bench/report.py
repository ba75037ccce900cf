"""Render a BenchReport: rich tables (terminal), Markdown (benchmarks/results), and the PNG plot."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from qtool.bench import roofline
from qtool.bench.run import DENSE, BenchReport
from qtool.errors import OutputError, UsageError
from qtool.report.text import md_escape, sanitize

# Formats matplotlib's Agg backend writes without extra packages; a --plot name without a suffix gets PNG.
PLOT_FORMATS = ("png", "pdf", "svg")


def check_report_path(flag: str, path: Path) -> None:
    """Refuse, before the sweep runs, a report destination that cannot be a file: a directory, a path
    under a file, an existing file (a report never replaces one: it may be anything, a model too), or (for
    --plot) a suffix matplotlib does not write or a missing matplotlib. A missing parent is fine: it is
    created when the report is written. A terminal, pipe or /dev/null is written in place."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory", fix=f"name a file, e.g. {path / 'bench'}")
    if path.is_file() or (path.is_symlink() and not path.exists()):  # a link to a pipe (/dev/stdout) is written
        raise UsageError(f"{flag} {path}: the file exists, and a report does not replace one",
                         fix="remove it, or name another file")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory",
                         fix="choose a path whose parent directories are directories")
    if flag == "--plot" and plot_format(path) not in PLOT_FORMATS:
        raise UsageError(f"--plot {path}: cannot write a '{path.suffix}' image",
                         fix=f"use a name ending in {', '.join('.' + f for f in PLOT_FORMATS)}")
    if flag == "--plot":
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot draws with matplotlib, which is not installed",
                             fix="pip install 'qtool[plot]', or drop --plot")


def check_distinct_reports(reports: list[tuple[str, Path]]) -> None:
    """Refuse, before the sweep runs, two report flags that name one file (the second write would fail after the
    sweep, or leave one report's bytes under the other's name) or a file and a path under it. Paths are compared
    resolved (./a is a, a link to a directory is the directory). An existing terminal, pipe or /dev/null may be
    named twice: each report is written to it in place."""
    import os
    from itertools import permutations

    def in_place(path: Path) -> bool:
        return path.exists() and not path.is_file() and not path.is_dir()

    resolved = [(flag, path, Path(os.path.realpath(os.path.abspath(path)))) for flag, path in reports]
    for (flag_a, path_a, real_a), (flag_b, path_b, real_b) in permutations(resolved, 2):
        if real_a == real_b and not in_place(path_a):
            same = f"{path_a}" if str(path_a) == str(path_b) else f"{path_a} and {path_b}, both {real_a}"
            raise UsageError(f"{flag_a} and {flag_b} name the same file ({same})", fix="give each report its own file")
        if real_a in real_b.parents:
            raise UsageError(f"{flag_a} {path_a} and {flag_b} {path_b}: {path_a} would be both a report file and "
                             "the directory of another", fix="give each report its own file")


def plot_format(path: Path) -> str:
    return path.suffix[1:].lower() or "png"


def write_report(flag: str, path: Path, fill: Callable[[Path], None], replace: bool = True) -> None:
    """Write a report file: `fill(p)` writes the whole report to p. A regular file (or a new one) is
    written under a temporary name and renamed into place, creating missing parent directories; anything
    else that exists there (a terminal, a pipe, /dev/null) is written in place and never replaced. With
    replace=False a file that appeared since check_report_path is not replaced either (the run fails).
    Any write error becomes a one-line error naming the file."""
    from qtool.io.writer import atomic_output

    def fail(e: OSError) -> OutputError:
        return OutputError(f"cannot write the {flag} report ({e.strerror or type(e).__name__})", path=path,
                           fix="free space, or give another path")

    def appeared() -> OutputError:
        return OutputError(f"the {flag} report's file appeared during the run, and a report does not replace a file",
                           path=path, fix="remove it, or name another file")

    try:
        st = path.stat() if os.path.lexists(path) else None
    except FileNotFoundError:  # a link to nothing: a name a new file would go through, or replace
        st = None
    except OSError as e:
        raise fail(e) from None
    # checked before the run, so new since then
    if not replace and os.path.lexists(path) and (st is None or stat.S_ISREG(st.st_mode)):
        raise appeared()
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{flag} {path}: is a directory", fix="name a file")
        try:
            fill(path)
        except OSError as e:
            raise fail(e) from None
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(e) from None
    try:
        with atomic_output(path, force=replace, directory=False) as tmp:
            try:
                fill(tmp)
            except OSError as e:
                raise fail(e) from None
    except OutputError:
        # It appeared while the report was written: say so in this command's words (atomic_output's speak of -o
        # and --force, which bench does not have).
        if not replace and os.path.lexists(path):
            raise appeared() from None
        raise


def _f(v, fmt: str, dash: str = "-") -> str:
    return dash if v is None else format(v, fmt)


def headline(report: BenchReport) -> str:
    d, r = report.device_info, report.roofline
    return (f"{d.get('name')} ({d['type']}), torch {d['torch']}, triton {d.get('triton')}, "
            f"{report.settings.dtype}, {report.settings.bits}-bit g{report.settings.group_size}; "
            f"copy bandwidth {d['copy_bandwidth_gbs']:.0f} GB/s, matmul {d['matmul_peak_tflops']:.1f} TFLOP/s; "
            f"M* theory {r['m_star_theory']:.0f} (b_eff {r['b_eff']:.3f})")


def render_tables(report: BenchReport, console) -> None:
    from rich.table import Table

    console.print(sanitize(headline(report)))
    t = Table(show_lines=False)
    for col in ("shape", "K x N", "M", "kernel", "path", "rel err (x base)", "us", "TFLOP/s", "GB/s",
                "% copy BW", "x dense"):
        t.add_column(col, justify="right" if col not in ("shape", "kernel", "path") else "left")
    for r in report.rows:
        if r.status != "ok":
            err = f"{r.rel_err:.2g}" if r.rel_err is not None else "-"
            t.add_row(sanitize(r.shape), f"{r.K}x{r.N}", str(r.M), sanitize(r.kernel),
                      f"[red]{r.status}[/]: {sanitize(r.reason)}",
                      err, "-", "-", "-", "-", "-")
            continue
        ratio = (r.rel_err / r.baseline_rel_err) if r.baseline_rel_err else None
        err = f"{r.rel_err:.2g} ({ratio:.2f})" if ratio is not None else _f(r.rel_err, ".2g")
        t.add_row(sanitize(r.shape), f"{r.K}x{r.N}", str(r.M), sanitize(r.kernel), sanitize(r.path), err, _f(r.median_us, ".1f"),
                  _f(r.tflops, ".2f"), _f(r.gbs, ".0f"), _f(r.bw_fraction and 100 * r.bw_fraction, ".0f"),
                  _f(r.speedup_vs_dense, ".2f"))
    console.print(t)
    s = Table(title="All shapes together (one decoder layer's projections)")
    anchor = report.summary.get("anchor")
    cols = ["kernel", "M", "shapes", "total us", "x dense", "% copy BW", "min x dense", "M* measured"]
    if anchor:
        cols += [f"{anchor['kernel']} x dense", f"/ {anchor['kernel']}"]
    for col in cols:
        s.add_column(sanitize(col), justify="left" if col == "kernel" else "right")
    for kname, per_m in report.summary.get("per_m", {}).items():
        mstar = report.summary["m_star_measured"].get(kname)
        for m, e in per_m.items():
            cells = [sanitize(kname), m, shapes_cell(e), f"{e['total_us']:.1f}", f"{e['total_speedup_vs_dense']:.2f}",
                     f"{100 * e['total_bw_fraction']:.0f}", f"{e['min_speedup_vs_dense']:.2f}", _f(mstar, ".0f")]
            if anchor:
                cells += [_f(e.get("anchor_x_dense"), ".2f"), _f(e.get("vs_anchor"), ".2f")]
            s.add_row(*cells)
    console.print(s)
    for line in partial_lines(report):
        console.print(f"[magenta]partial[/]: {sanitize(line)}")
    for line in anchor_gap_lines(report):
        console.print(f"[cyan]anchor[/]: {sanitize(line)}")
    for line in flag_lines(report):
        console.print(f"[yellow]flag[/]: {sanitize(line)}")


def shapes_cell(e: dict) -> str:
    """How many shapes a layer sum covers: "2", or "1 of 2" where the kernel ran on only some of them."""
    n, total = e["shapes"], e.get("shapes_total", e["shapes"])
    return str(n) if n >= total else f"{n} of {total}"


def partial_lines(report: BenchReport) -> list[str]:
    """One line per kernel and set of M whose layer sum covers only some of the shapes, naming the rest; and
    where the measured M* comes from fewer shapes than a sum."""
    lines = []
    summary = report.summary
    anchor = summary.get("anchor")  # without one, there is no anchor ratio to speak of
    for kname, per_m in summary.get("per_m", {}).items():
        by_gap: dict[tuple[int, int, tuple[str, ...]], list[str]] = {}
        for m, e in per_m.items():
            if e["shapes"] < e.get("shapes_total", e["shapes"]):
                by_gap.setdefault((e["shapes"], e["shapes_total"], tuple(e.get("shapes_missing", ()))), []).append(m)
        for (n, total, missing), ms in by_gap.items():
            lines.append(f"{kname} at M = {', '.join(ms)}: the layer sum covers {n} of {total} shapes (refused or "
                         f"failed on {', '.join(missing) or 'the others'}); its "
                         + ("x dense, % copy BW and anchor ratio are for those shapes alone, against dense's and the "
                            "anchor's times on them" if anchor else "x dense and % copy BW are for those shapes "
                            "alone, against dense's times on them")
                         + ", not the whole layer's")
        common = summary.get("m_star_shapes", {}).get(kname)
        if common is not None and any(common < e["shapes"] for e in per_m.values()):
            lines.append(f"{kname}: M* measured over the {common} shape(s) it ran at every M")
    return lines


def anchor_gap_lines(report: BenchReport) -> list[str]:
    """One line per set of M the anchor has no figures for, naming the shapes and what is not compared there:
    those shapes' rows and every layer sum that includes one of them. A kernel's sum over part of the shapes that
    leaves them all out keeps its anchor ratio (apply_anchor compares a sum where the anchor has each of its
    shapes); the line names those sums, so neither "not compared" nor a ratio beside it is left unexplained."""
    anchor = report.summary.get("anchor") or {}
    by_ms: dict[tuple[int, ...], list[str]] = {}
    for g in anchor.get("uncovered", []):
        kn = f"{g['K']}x{g['N']}"
        by_ms.setdefault(tuple(g["M"]), []).append(kn if g["shape"] == kn else f"{g['shape']} ({kn})")
    lines = []
    for ms, shapes in by_ms.items():
        it = "it" if len(shapes) == 1 else "any of them"
        line = (f"{anchor['file']} has no figures for {', '.join(shapes)} at M = {', '.join(map(str, ms))}: "
                f"{'its' if len(shapes) == 1 else 'their'} rows there and every layer sum that includes {it} are "
                "not compared with the anchor")
        kept = []
        for kname, per_m in report.summary.get("per_m", {}).items():
            at = [m for m in ms if per_m.get(str(m), {}).get("vs_anchor") is not None]
            if at:
                kept.append(f"{kname} at M = {', '.join(map(str, at))} ({shapes_cell(per_m[str(at[0])])} shapes)")
        if kept:
            line += (f"; these sums over part of the shapes leave {'it' if len(shapes) == 1 else 'them'} out and "
                     f"are compared over their own shapes: {'; '.join(kept)}")
        lines.append(line)
    return lines


def flag_lines(report: BenchReport) -> list[str]:
    """One line per flag: the layer sums first, then the shapes."""
    flags = sorted(report.summary.get("flags", []), key=lambda f: (f["scope"] != "layer", f["kernel"], f["M"]))
    return [f"{f['kernel']} M={f['M']} {'layer sum' if f['scope'] == 'layer' else f['scope']}: {f['why']}"
            for f in flags]


def to_markdown(report: BenchReport) -> str:
    """The tables as GitHub Markdown; every string that is not a number goes through `md_escape`."""
    e_ = md_escape
    lines = [f"- {e_(headline(report))}", "",
             "| shape | K x N | M | kernel | path | rel err | us | TFLOP/s | GB/s | % copy BW | x dense |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        if r.status != "ok":
            lines.append(f"| {e_(r.shape)} | {r.K}x{r.N} | {r.M} | {e_(r.kernel)} | {e_(r.status)}: {e_(r.reason)} | "
                         f"{_f(r.rel_err, '.2g')} | | | | | |")
            continue
        lines.append(f"| {e_(r.shape)} | {r.K}x{r.N} | {r.M} | {e_(r.kernel)} | {e_(r.path)} | {_f(r.rel_err, '.2g')} | "
                     f"{_f(r.median_us, '.1f')} | {_f(r.tflops, '.2f')} | {_f(r.gbs, '.0f')} | "
                     f"{_f(r.bw_fraction and 100 * r.bw_fraction, '.0f')} | {_f(r.speedup_vs_dense, '.2f')} |")
    anchor = report.summary.get("anchor")
    extra = f" {e_(anchor['kernel'])} x dense | / {e_(anchor['kernel'])} |" if anchor else ""
    lines += ["", "| kernel | M | shapes | total us | x dense (sum of times) | % copy BW (all bytes / all time) | "
              f"min x dense | M* measured |{extra}",
              "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if anchor else "")]
    for kname, per_m in report.summary.get("per_m", {}).items():
        mstar = report.summary["m_star_measured"].get(kname)
        for m, e in per_m.items():
            tail = f" {_f(e.get('anchor_x_dense'), '.2f')} | {_f(e.get('vs_anchor'), '.2f')} |" if anchor else ""
            lines.append(f"| {e_(kname)} | {m} | {shapes_cell(e)} | {e['total_us']:.1f} | "
                         f"{e['total_speedup_vs_dense']:.2f} | "
                         f"{100 * e['total_bw_fraction']:.0f} | {e['min_speedup_vs_dense']:.2f} | "
                         f"{_f(mstar, '.0f')} |{tail}")
    partial = partial_lines(report)
    if partial:
        lines += ["", "Partial sums:", ""] + [f"- {e_(p)}" for p in partial]
    gaps = anchor_gap_lines(report)
    if gaps:
        lines += ["", "Anchor:", ""] + [f"- {e_(g)}" for g in gaps]
    flags = flag_lines(report)
    if flags:
        lines += ["", "Flags:", ""] + [f"- {e_(f)}" for f in flags]
    return "\n".join(lines) + "\n"


def plot(report: BenchReport, path: Path, fmt: str = "png") -> None:
    """Speedup over dense vs M (all shapes together) per kernel, with the roofline's ideal speedup, as a
    `fmt` image (the name of `path` may be a temporary one, so its suffix is not read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, r = report.settings, report.roofline
    ms = sorted(s.batch_sizes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kname, per_m in report.summary.get("per_m", {}).items():
        if kname == DENSE:
            continue
        pts = sorted((int(m), e["total_speedup_vs_dense"]) for m, e in per_m.items())
        cover = sorted({shapes_cell(e) for e in per_m.values() if " of " in shapes_cell(e)})
        label = f"{kname} ({', '.join(cover)} shapes)" if cover else kname
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    grid = sorted(set(ms) | {int(v) for v in (2 ** i for i in range(0, 14)) if ms[0] <= v <= ms[-1]})
    ideal = []
    for m in grid:
        td = tq = 0.0
        for sh in s.shapes:
            sp = roofline.roofline_speedup(m, sh.K, sh.N, r["b_eff"], r["peak_flops"], r["bandwidth"])
            t_dense = max((2 * sh.N * sh.K) / r["bandwidth"], 2.0 * m * sh.N * sh.K / r["peak_flops"])
            td += t_dense
            tq += t_dense / sp
        ideal.append(td / tq)
    ax.plot(grid, ideal, linestyle="--", color="gray", label="roofline (measured BW, matmul peak)")
    anchor = report.summary.get("anchor")
    if anchor:  # the reference kernel's layer sums, at the M where the anchor file has every shape
        pts = {}
        for per_m in report.summary.get("per_m", {}).values():
            for m, e in per_m.items():  # a sum over part of the shapes is another layer: not this curve
                if e.get("anchor_x_dense") is not None and " of " not in shapes_cell(e):
                    pts[int(m)] = e["anchor_x_dense"]
        if pts:
            ms_a = sorted(pts)
            ax.plot(ms_a, [pts[m] for m in ms_a], marker="s", linestyle=":", color="black",
                    label=f"{anchor['kernel']} (anchor)")
    for f in report.summary.get("flags", []):  # flagged layer sums: a red ring
        if f["scope"] == "layer":
            e = report.summary["per_m"][f["kernel"]][str(f["M"])]
            ax.plot([f["M"]], [e["total_speedup_vs_dense"]], marker="o", markersize=11, markerfacecolor="none",
                    markeredgecolor="red", linestyle="none")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axvline(r["m_star_theory"], color="gray", linestyle=":", label=f"M* theory {r['m_star_theory']:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (batch rows)")
    ax.set_ylabel(f"speedup over dense {s.dtype}")
    ax.set_title(f"W{s.bits}A16 g{s.group_size} on {report.device_info.get('name')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=fmt)
    plt.close(fig)
