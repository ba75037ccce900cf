"""The README's formats table, generated from the format rows (qtool/formats: id, aliases, bits, summary).

    python tools/format_table.py            # print the table
    python tools/format_table.py --write    # rewrite it in README.md, between the markers

tests/test_readme_formats.py fails while README.md holds a table other than the one this prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- formats table: generated from the format rows by tools/format_table.py -->"
END = "<!-- end of the generated formats table -->"


def table() -> str:
    from qtool.formats.base import all_formats, bits_text

    rows = ["| id | also named | bits | layout (the row's summary) |", "|---|---|---|---|"]
    for fid, fmt in sorted(all_formats().items()):
        s = fmt.spec
        also = ", ".join(f"`{a}`" for a in s.aliases)
        rows.append(f"| `{fid}` | {also} | {bits_text(s.bits)} | {s.summary} |")
    return "\n".join(rows)


def rewrite(text: str) -> str:
    """`text` with the block between BEGIN and END replaced by the current table."""
    head, sep, rest = text.partition(BEGIN + "\n")
    _old, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    return head + BEGIN + "\n" + table() + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = ap.parse_args(argv)
    if not args.write:
        print(table())
        return 0
    readme = REPO / "README.md"
    readme.write_text(rewrite(readme.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
