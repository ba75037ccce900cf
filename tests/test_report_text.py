"""The escapers every printed or reported name goes through (qtool.report.text), and the layer rule that
nothing below the CLI imports it."""

from __future__ import annotations

import ast
import html
import re
import unicodedata
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from qtool.report.common import md_table
from qtool.report.text import MD_SPECIAL, md_escape, sanitize, terminal

REPO = Path(__file__).resolve().parents[1]
UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs"}
ANY_TEXT = st.text(st.characters(codec=None), max_size=40)
# Names that look like an attack: Markdown and HTML syntax, bidi and zero-width characters, separators.
HOSTILE = st.lists(st.sampled_from(list("ab.|[]()<>`*_~!&#@:\\/ -\n\r\t\x1b\x07") +
                                  ["\u202e", "\u2066", "\u200b", "\u200d", "\u2028", "\u2029", "\ufeff",
                                   "\u061c", "\u200e", "www.", "http://", "<script>", "](", "&lt;", "<!--"]),
                  max_size=30).map("".join)
MD = MarkdownIt("commonmark").enable(["table", "strikethrough"])


def _unsafe(s: str) -> list[str]:
    return [c for c in s if unicodedata.category(c) in UNSAFE]


def test_bidi_zero_width_and_separators_are_escaped_visibly():
    cases = {"\u202e": "\\u202e", "\u202a": "\\u202a", "\u2066": "\\u2066", "\u2069": "\\u2069",
             "\u200e": "\\u200e", "\u200f": "\\u200f", "\u061c": "\\u061c", "\u2028": "\\u2028",
             "\u2029": "\\u2029", "\u200b": "\\u200b", "\u200d": "\\u200d", "\u2060": "\\u2060",
             "\ufeff": "\\ufeff", "\U000e0001": "\\U000e0001", "\x1b": "\\x1b", "\x85": "\\x85"}
    for raw, shown in cases.items():
        assert terminal(f"w{raw}.q") == f"w{shown}.q"
        assert sanitize(f"w{raw}.q") == f"w{shown}.q"
        assert shown in md_escape(f"w{raw}.q")


def test_lone_surrogate_is_escaped_not_an_encoding_crash():
    name = "model.\ud800.weight"
    assert terminal(name) == "model.\\ud800.weight"
    terminal(name).encode("utf-8")  # what a UTF-8 terminal write needs


def test_sanitize_escapes_rich_markup():
    assert sanitize("[red]x[/red]") == "\\[red]x\\[/red]"


@settings(deadline=None)
@given(ANY_TEXT)
def test_terminal_output_has_no_control_format_or_separator_characters(s):
    out = terminal(s)
    assert not _unsafe(out)
    assert not _unsafe(sanitize(s))
    assert terminal(out) == out  # already safe text is left alone
    if not _unsafe(s) and s.isprintable():
        assert out == s


@settings(deadline=None)
@given(st.one_of(ANY_TEXT, HOSTILE))
def test_md_escape_leaves_no_unescaped_metacharacter(s):
    out = md_escape(s)
    assert not _unsafe(out)
    assert "\n" not in out and "\r" not in out
    # every Markdown metacharacter is preceded by an odd run of backslashes (escaped)
    for m in re.finditer(r"(\\*)([" + re.escape("".join(MD_SPECIAL - {"\\"})) + "])", out):
        assert len(m.group(1)) % 2 == 1, (s, out)
    assert len(re.search(r"\\*$", out).group()) % 2 == 0  # no dangling escape at the end


def _visible_text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", fragment))


@settings(deadline=None)
@given(st.one_of(ANY_TEXT, HOSTILE), st.one_of(ANY_TEXT, HOSTILE))
def test_markdown_table_renders_names_as_their_own_text_in_their_own_cells(a, b):
    out = MD.render(md_table(["name", "other"], [[a, b]]))
    tags = set(re.findall(r"</?([a-zA-Z][a-zA-Z0-9]*)", out))
    assert tags <= {"table", "thead", "tbody", "tr", "th", "td"}, (a, b, out)
    cells = re.findall(r"<td>(.*?)</td>", out, flags=re.S)
    assert len(cells) == 2, (a, b, out)
    assert [_visible_text(c) for c in cells] == [terminal(a).strip(" "), terminal(b).strip(" ")]


def test_markdown_link_html_and_cell_injection_are_inert():
    name = "x](http://evil.example) | <img src=x onerror=alert(1)> ![i](j) **b** `c` www.evil.example"
    out = MD.render(md_table(["module"], [[name]]))
    assert "<a " not in out and "<img" not in out and "<strong>" not in out and "<code>" not in out
    assert out.count("<td>") == 1


def test_nothing_below_the_cli_imports_it():
    """Layers point down: cli -> commands -> core -> io / report."""
    offenders = []
    for path in sorted((REPO / "qtool").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[:2] == ("qtool", "cli") or rel.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{rel}: {n}" for n in names if n == "qtool.cli" or n.startswith("qtool.cli.")]
    assert not offenders
