"""The README's formats table is the one tools/format_table.py generates from the format rows."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _tool():
    spec = importlib.util.spec_from_file_location("format_table", REPO / "tools" / "format_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_formats_table_is_current():
    tool = _tool()
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert tool.rewrite(text) == text, "README.md's formats table is stale: run python tools/format_table.py --write"


def test_table_has_a_row_per_registered_format():
    from qtool.formats.base import all_formats

    rows = [r for r in _tool().table().splitlines()[2:]]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == sorted(all_formats())
    assert all(r.count("|") == 5 and r.split("|")[4].strip() for r in rows)
