"""Reading a YAML job spec into a plain mapping, with errors that name the file, the key and the line.

The per-command schema is the command's own options: `qtool.cli.common.apply_config` checks keys and types
against them, so the CLI flags and the YAML keys can never drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qtool.errors import SpecError

# A job spec is a few lines. The loader is pure Python (the C one cannot refuse aliases), at about 2 s and
# 250 MB of memory per MB of YAML: the cap keeps a hostile or mistaken file to a fraction of a second.
MAX_SPEC_BYTES = 64 << 10
# Values are scalars or lists of scalars (depth 2); a hostile file nests thousands deep to exhaust the stack.
MAX_SPEC_DEPTH = 16

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
# YAML 1.1 reads `010` as 8, `0x10` as 16 and `1:30` as 90 (base 60), and `1e-3` as text; `2024-01-01` becomes a
# date and `<<` a merge. A job spec takes numbers in decimal only, as YAML 1.2 and the command line do: anything
# else stays text, and the key's type check names it.
_DECIMAL_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$")
_DECIMAL_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                                 |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                                 |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)


# What to do about each kind of YAML error (a part of its message -> the fix); the last is the default.
_SYNTAX_FIXES = (
    ("'\\t'", "indent with spaces, not tabs"),
    ("aliases", "write the value out in full"),
    ("appears twice", "keep one"),
    ("nested", "a value is one item or a list of items"),
    ("special characters", "remove the control character"),
    ("another document", "a job spec is one document: remove the '---' line"),
    ("", "check the YAML at that line; quote a value holding ': ' or ' #'"),
)


class JobSpec(dict):
    """The spec's mapping, plus the line each key is on (`lines`), for messages."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lines: dict[str, int] = {}


def _no_alias_loader():
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """safe_load without anchors/aliases: a job spec never needs them, and aliases are how a few hundred
        bytes of YAML expand into billions of elements ("billion laughs")."""

        yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in rows if tag.rsplit(":", 1)[1] not in ("int", "float", "timestamp",
                                                                                 "merge")]
            for first, rows in yaml.SafeLoader.yaml_implicit_resolvers.items()}
        _depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.constructor.ConstructorError(None, None, "YAML aliases (*name) are not allowed in a job "
                                                        "spec", event.start_mark)
            if self._depth >= MAX_SPEC_DEPTH:
                raise yaml.constructor.ConstructorError(None, None, f"values nested more than {MAX_SPEC_DEPTH} "
                                                        "levels deep", self.peek_event().start_mark)
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            # PyYAML keeps the last of two equal keys; which one the user meant is unknowable
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(None, None, f"key {str(key)[:40]!r} appears twice",
                                                            key_node.start_mark)
            return super().construct_mapping(node, deep)

    for first in "-+0123456789":
        NoAliasLoader.add_implicit_resolver(_INT, _DECIMAL_INT, [first])
    for first in "-+.0123456789":
        NoAliasLoader.add_implicit_resolver(_FLOAT, _DECIMAL_FLOAT, [first])
    return NoAliasLoader


def load_yaml_mapping(path: str | Path) -> JobSpec:
    """Parse `path` with PyYAML's safe loader (never arbitrary objects; no aliases, decimal numbers only) and
    require a mapping of str keys. An empty file (or one of comments only) is an empty mapping."""
    import yaml

    p = Path(path)
    fix = "give a YAML file of `option: value` lines to --config"
    if p.exists() and not p.is_file():
        raise SpecError("job spec is not a regular file", path=p, fix=fix)
    if not p.is_file():
        raise SpecError("job spec not found", path=p, fix="give an existing YAML file to --config")
    try:
        with open(p, "rb") as f:
            # Bounded by the read, not by stat: a file under /proc says size 0 whatever it holds.
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read job spec ({e.strerror or e})", path=p, fix=fix) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"job spec is over the {MAX_SPEC_BYTES // 1024} KiB limit", path=p,
                        fix="a job spec holds a few option: value lines; check --config names the right file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SpecError("job spec is not UTF-8 text", path=f"{p}:{line}", fix="save it as UTF-8") from None
    loader = None
    try:
        loader = _no_alias_loader()(text)  # its reader refuses control characters here
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = str(getattr(e, "problem", None) or e)
        if isinstance(e, yaml.reader.ReaderError):  # a control character: it has a position, not a mark
            line = text.count("\n", 0, e.position) + 1
            problem = f"{e.reason} (#x{e.character:04x})" if isinstance(e.character, int) else e.reason
        fix = next((f for part, f in _SYNTAX_FIXES if part in problem), _SYNTAX_FIXES[-1][1])
        raise SpecError(f"invalid YAML: {problem}", path=f"{p}:{line}" if line else p, fix=fix) from None
    except Exception as e:  # noqa: BLE001 - see below
        # PyYAML's safe constructors raise plain Python errors for tagged values they cannot build
        # (ValueError for a 5000-digit int or `!!int nope`, AttributeError for `!!timestamp` on text,
        # IndexError for `!!int ''`, KeyError for `!!bool maybe`): all of them mean the same thing to the
        # user — this value is not valid YAML for a job spec.
        raise SpecError(f"invalid YAML value ({type(e).__name__}: {str(e)[:80]})", path=p,
                        fix="write the value without a !!tag") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return JobSpec()
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", bool: "true or false", int: "a number",
                float: "a number"}.get(type(data), type(data).__name__)
        raise SpecError(f"a job spec must be a mapping of option names to values, not {kind}", path=p,
                        fix="write one `option: value` per line, e.g. bits: 4")
    out = JobSpec(data)
    # Keys are unique (refused above) and dicts keep their order, so the nodes and the keys pair up.
    for (key_node, _), k in zip(node.value, data, strict=True):
        if not isinstance(k, str):
            shown = "null" if k is None else str(k).lower() if isinstance(k, bool) else repr(k)[:40]
            raise SpecError(f"key {shown} is not an option name", path=f"{p}:{key_node.start_mark.line + 1}",
                            fix="keys are long option names, e.g. group_size")
        out.lines[k] = key_node.start_mark.line + 1
    return out
