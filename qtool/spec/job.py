"""Reading a YAML job spec into a plain mapping, with errors that name the file and key.

The per-command schema is the command's own options: `qtool.cli.common.apply_config` checks keys and types
against them, so the CLI flags and the YAML keys can never drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qtool.errors import SpecError

MAX_SPEC_BYTES = 1 << 20  # a job spec is a few lines; refuse anything that is clearly not one


def _no_alias_loader():
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """safe_load without anchors/aliases: a job spec never needs them, and aliases are how a few hundred
        bytes of YAML expand into billions of elements ("billion laughs")."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.constructor.ConstructorError(None, None, "YAML aliases (*name) are not allowed in a job "
                                                        "spec", event.start_mark)
            return super().compose_node(parent, index)

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

    return NoAliasLoader


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Parse `path` with yaml.safe_load (never arbitrary objects) and require a mapping of str keys."""
    import yaml

    _NoAliasLoader = _no_alias_loader()
    p = Path(path)
    if p.exists() and not p.is_file():
        raise SpecError("job spec is not a regular file", path=p, fix="give a YAML file to --config")
    if not p.is_file():
        raise SpecError("job spec not found", path=p, fix="give an existing YAML file to --config")
    if p.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(f"job spec is {p.stat().st_size} bytes, over the {MAX_SPEC_BYTES} limit", path=p)
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_NoAliasLoader)
    except UnicodeDecodeError:
        raise SpecError("job spec is not UTF-8 text", path=p) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(f"invalid YAML{where}: {getattr(e, 'problem', None) or e}", path=p) from None
    except Exception as e:  # noqa: BLE001 - see below
        # PyYAML's safe constructors raise plain Python errors for tagged values they cannot build
        # (ValueError for a bad timestamp or a 5000-digit int, AttributeError for `!!timestamp` on text,
        # IndexError for `!!int ''`, KeyError for `!!bool maybe`, RecursionError for deep nesting): all of
        # them mean the same thing to the user — this value is not valid YAML for a job spec.
        raise SpecError(f"invalid YAML value ({type(e).__name__}: {str(e)[:80]})", path=p) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"a job spec must be a mapping of option names to values, got {type(data).__name__}",
                        path=p)
    for k in data:
        if not isinstance(k, str):
            raise SpecError(f"key {k!r} is not a string", path=p)
    return data
