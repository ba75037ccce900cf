"""Escaping text read from files (tensor names, paths, metadata) before it reaches a terminal or a report.

- `terminal(text)`: every character that is not printable becomes a visible escape (`\\x1b`, `\\u202e`,
  `\\U000e0001`). That covers C0/C1 controls (ANSI escapes, CR, backspace), the bidi embeddings, overrides
  and isolates (U+202A-202E, U+2066-2069, U+200E/F, U+061C), the line and paragraph separators
  U+2028/2029, zero-width characters (U+200B-200D, U+2060, U+FEFF) and every other format (Cf) character,
  lone surrogates, and spaces other than U+0020 that a reader cannot tell from it.
- `sanitize(text)`: `terminal` plus rich-markup escaping, for strings handed to a rich console or table.
- `md_escape(text)`: for a name written into a Markdown report: the `terminal` escapes, plus a backslash
  before every character Markdown gives a meaning to (links, images, emphasis, code, table cells, raw
  HTML, entities, autolinks), so a name renders as its own text and stays in its own table cell.
"""

from __future__ import annotations

import re

# Characters with a meaning somewhere in CommonMark / GitHub Markdown: emphasis (* _ ~), code (`), links
# and images ([ ]: with both escaped, "(" and "!" start nothing), raw HTML and autolinks (< >), entities
# (&), table cells (|), headings (#), email and URL autolinks (@ :), and the escape character itself. List
# markers (- +) and thematic breaks matter only at a line's start, where a name never goes.
MD_SPECIAL = frozenset("\\`*_~[]<>&|#@:")
# `www.` starts an extended autolink on GitHub; escaping its dot breaks the match.
_WWW_DOT = re.compile(r"(?i)(?<=www)\.")


def _visible(c: str) -> str:
    o = ord(c)
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def terminal(text: object) -> str:
    """`text` with every non-printable character shown as a visible escape (see the module docstring)."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _visible(c) for c in s)


def sanitize(text: object) -> str:
    """Make a name read from a file safe to print on a rich console: `terminal` escapes, and rich markup
    brackets escaped."""
    from rich.markup import escape

    return escape(terminal(text))


def md_escape(text: object) -> str:
    """A string as literal Markdown text: Markdown's special characters backslash-escaped, non-printable
    characters (newlines included) shown as visible escapes."""
    s = str(text)
    out = []
    for c in s:
        if c in MD_SPECIAL:
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append(_visible(c))
    return _WWW_DOT.sub(r"\\.", "".join(out))
