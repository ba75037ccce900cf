"""Rendering a repack plan/report: a rich table of every module's verdict, then a summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qtool.report.common import human_bytes


@dataclass
class RunReport:
    """What a repack run (any target) did: its plan, whether it wrote, the files, the bytes and the time."""

    plan: Any
    written: bool = False
    files: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def outcome(self) -> dict:
        return {"written": self.written, "files": self.files, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3)}


def print_outcome(report: RunReport, console, wrote_extra: str = "") -> None:
    """The plan's warnings, then what was written (or, on a dry run, would be)."""
    from qtool.report.text import sanitize

    plan = report.plan
    for w in plan.warnings:
        console.print(f"warning: {sanitize(w)}")
    if plan.job.dry_run:
        console.print(f"dry run: nothing written (would write {sanitize(str(plan.out))})")
    else:
        console.print(f"wrote {sanitize(str(plan.out))}: {human_bytes(report.bytes_in)} -> "
                      f"{human_bytes(report.bytes_out)} in {report.seconds:.2f} s{wrote_extra}")

_STYLE = {"exact": "green", "near-exact": "cyan", "dropped": "magenta", "lossy": "yellow", "impossible": "red", "keep": "dim"}


def _err(m) -> str:
    if m.kind == "near-exact" and m.max_error is not None:
        return f"max {m.max_error:.3g}"
    if m.kind == "lossy":
        if m.rel_error is not None:
            return f"rel {m.rel_error:.3%}, max {m.max_error:.3g}"
        return "measured when run"
    return ""


def _how(m) -> str:
    if m.copy:
        return "copy"
    if m.kind in ("impossible", "keep"):
        return "-"
    parts = list(m.steps) or ["relayout"]
    if m.fast:
        parts.append("direct")
    return ", ".join(parts)


def render(report, console, *, refused: bool = False) -> None:
    """The plan table (one row per module), then reasons, a summary and the outcome. On refusal only the
    blocking modules are listed, one line each (the error line follows)."""
    from rich.table import Table

    from qtool.report.text import sanitize

    plan = report.plan
    if refused:
        for m in plan.blocking():
            console.print(f"{m.kind:>10}  {sanitize(m.module)}: {sanitize('; '.join(m.reasons))}")
        return
    t = Table(title=f"repack {sanitize(str(plan.job.src))} -> {plan.target}", show_lines=False)
    for h in ("module", "from", "shape", "bits/group", "kind", "how", "error"):
        t.add_column(h, overflow="fold")
    for m in plan.modules:
        bg = f"{m.src.bits}/{m.src.group_size}"
        if m.to_bits is not None and (m.to_bits, m.to_group_size) != (m.src.bits, m.src.group_size):
            bg += f" -> {m.to_bits}/{m.to_group_size}"
        style = _STYLE.get(m.kind, "")
        t.add_row(sanitize(m.module), m.src.format, "x".join(map(str, m.shape or [])) or "?", bg,
                  f"[{style}]{m.kind}[/{style}]" if style else m.kind, _how(m), _err(m))
    console.print(t)
    for m in plan.modules:
        if m.reasons and not m.copy:
            console.print(f"{m.kind}: {sanitize(m.module)}: {sanitize('; '.join(m.reasons))}")
    c = plan.counts()
    summary = ", ".join(f"{n} {k}" for k, n in c.items() if n)
    console.print(f"{len(plan.modules)} modules: {summary}; {plan.passthrough} other tensors copied byte for byte")
    lost = sorted(plan.dropped)
    if lost:
        console.print(f"dropped ({len(lost)} tensors, written nowhere; the plan says why): "
                      f"{sanitize(', '.join(lost))}")
    print_outcome(report, console)
