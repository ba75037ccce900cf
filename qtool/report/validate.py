"""What `qtool validate` found: one row per (check, module), the summary, the hashes; rendered as JSON, a rich
table, or Markdown (report.md for CI artifacts).

JSON schema (README "qtool validate"):

    path      str         what was validated
    device    str         where the kernels ran ("cpu", "cuda:0")
    checks    list[obj]   name (integrity | roundtrip | contract | reference | kernels | hashes), module
                          (str|null: null for a file-level finding), status (pass | fail | skip), detail (str),
                          numbers (obj of floats/ints the verdict rests on: errors, bounds, bytes)
    summary   obj         status ("pass": at least one check passed and none failed | "fail": one failed |
                          "skip": nothing passed or failed, so nothing was checked), counts {pass, fail,
                          skip}, per check {pass, fail, skip}, modules, tensors, bytes_read, seconds
    hash      obj         algorithm, model (hex digest over every tensor's name and digest, in name order:
                          the same for any shard layout), tensors {name: hex digest}
    notes     list[str]   warnings that fail nothing (each says what it means)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qtool.report.common import human_bytes, md_table

CHECKS = ("integrity", "roundtrip", "contract", "reference", "kernels", "hashes")
STATUSES = ("pass", "fail", "skip")
NO_REFERENCE = "no --reference DENSE given"  # the reference check's skip when it has nothing to compare with


@dataclass(frozen=True)
class CheckResult:
    name: str
    module: str | None
    status: str
    detail: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "module": self.module, "status": self.status, "detail": self.detail,
                "numbers": {k: _finite(v) for k, v in self.numbers.items()}}


def _finite(v: Any) -> Any:
    """NaN/Inf are not JSON: null (the detail says what was not finite)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class ValidateReport:
    path: str
    device: str
    checks: list[CheckResult] = field(default_factory=list)
    hash_algorithm: str = ""
    model_hash: str | None = None
    tensor_hashes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    modules: int = 0
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    selected: tuple[str, ...] = CHECKS

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def status(self) -> str:
        """"fail" when a check failed; "pass" only when one passed too (a run whose every check was skipped
        proved nothing, and a CI gate must not read it as proof); "skip" otherwise."""
        if self.failed:
            return "fail"
        return "pass" if any(c.status == "pass" for c in self.checks) else "skip"

    def nothing_checked(self) -> str | None:
        """For a "skip" verdict, one line: that nothing was checked, why (each check's skip reasons), and the
        fix; None for any other verdict."""
        if self.status != "skip":
            return None
        why = "; ".join(f"{r[0]}: {r[5] or 'no finding'}" for r in _per_check(self))
        fix = "add integrity or hashes to --checks (they read and check every tensor of any checkpoint)"
        if any(c.name == "reference" and c.detail == NO_REFERENCE for c in self.checks):
            fix = "give --reference DENSE, or " + fix
        return f"nothing was checked: every selected check was skipped ({why}); fix: {fix}"

    def counts(self, name: str | None = None) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for c in self.checks:
            if name is None or c.name == name:
                out[c.status] += 1
        return out

    def summary(self) -> dict[str, Any]:
        return {"status": self.status, "counts": self.counts(),
                "checks": {n: self.counts(n) for n in self.selected},
                "modules": self.modules, "tensors": self.tensors, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3)}

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "device": self.device, "checks": [c.to_dict() for c in self.checks],
                "summary": self.summary(),
                "hash": {"algorithm": self.hash_algorithm, "model": self.model_hash,
                         "tensors": dict(self.tensor_hashes)},
                "notes": list(self.notes)}


_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def _rows(report: ValidateReport, verbose: bool) -> list[CheckResult]:
    """Failures always; passes and skips folded per check unless verbose (a 70B model has ~600 modules)."""
    if verbose:
        return list(report.checks)
    return [c for c in report.checks if c.status == "fail"]


def _per_check(report: ValidateReport) -> list[list[str]]:
    rows = []
    for n in report.selected:
        c = report.counts(n)
        reasons: dict[str, int] = {}
        for x in report.checks:
            if x.name == n and x.status == "skip":
                reasons[_reason(x.detail)] = reasons.get(_reason(x.detail), 0) + 1
        verdict = "fail" if c["fail"] else ("pass" if c["pass"] else "skip")
        why = "; ".join(f"{k} ({v})" if v > 1 else k for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
        rows.append([n, verdict, str(c["pass"]), str(c["fail"]), str(c["skip"]), why])
    return rows


def _reason(detail: str) -> str:
    """A skip's reason without the layer shape in front ("[384, 384] 4-bit g128: cuda-w4a16 ...")."""
    head, sep, rest = detail.partition(": ")
    return rest if sep and head.startswith("[") else detail


def render(report: ValidateReport, console, verbose: bool = False) -> None:
    from rich.table import Table

    t = Table(title=f"qtool validate {report.path} (device {report.device})", title_justify="left")
    for h in ("check", "verdict", "pass", "fail", "skip", "skipped because"):
        t.add_column(h, overflow="fold")
    for r in _per_check(report):
        t.add_row(r[0], f"[{_STYLE[r[1]]}]{r[1]}[/]", *r[2:])
    console.print(t)
    shown = _rows(report, verbose)
    if shown:
        d = Table(title="failures" if not verbose else "every check", title_justify="left")
        for h in ("check", "module", "status", "detail"):
            d.add_column(h, overflow="fold")
        for c in shown:
            d.add_row(c.name, c.module or "(file)", f"[{_STYLE[c.status]}]{c.status}[/]", c.detail)
        console.print(d)
    for n in report.notes:
        console.print(f"note: {n}", markup=False)
    s = report.summary()
    tail = (f"{report.modules} modules, {report.tensors} tensors, {human_bytes(report.bytes_read)} read in "
            f"{report.seconds:.1f} s")
    if report.model_hash:
        tail += f"; model {report.hash_algorithm} {report.model_hash[:16]}…"
    console.print(f"{s['status'].upper()}: {s['counts']['pass']} passed, {s['counts']['fail']} failed, "
                  f"{s['counts']['skip']} skipped; {tail}", style=_STYLE[s["status"]], markup=False)


def to_markdown(report: ValidateReport) -> str:
    s = report.summary()
    out = [f"# qtool validate: {s['status'].upper()}\n",
           f"- path: `{report.path}`\n- device: {report.device}\n"
           f"- {report.modules} modules, {report.tensors} tensors, {human_bytes(report.bytes_read)} read in "
           f"{report.seconds:.1f} s\n"]
    empty = report.nothing_checked()
    if empty:
        from qtool.report.text import md_escape

        out.append(f"- {md_escape(empty)}\n")
    if report.model_hash:
        out.append(f"- model hash ({report.hash_algorithm}): `{report.model_hash}`\n")
    out.append("\n## Checks\n\n")
    out.append(md_table(["check", "verdict", "pass", "fail", "skip", "skipped because"], _per_check(report)))
    fails = [c for c in report.checks if c.status == "fail"]
    if fails:
        out.append("\n## Failures\n\n")
        out.append(md_table(["check", "module", "detail"], [[c.name, c.module or "(file)", c.detail] for c in fails]))
    if report.notes:
        out.append("\n## Notes\n\n" + "".join(f"- {n}\n" for n in report.notes))
    out.append("\n## Every check\n\n")
    out.append(md_table(["check", "module", "status", "detail"],
                        [[c.name, c.module or "(file)", c.status, c.detail] for c in report.checks]))
    return "".join(out)
