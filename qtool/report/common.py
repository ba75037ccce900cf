"""Small formatting helpers shared by reports."""

from __future__ import annotations

from qtool.report.text import md_escape


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub-flavoured Markdown table; every cell goes through `md_escape`, so a name read from a file
    renders as its own text in its own cell."""
    out = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(md_escape(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
