"""Conventions shared by every command: option aliases, --config merging, output, progress.

- `--json` puts machine-readable output alone on stdout; everything human goes to stderr then.
- `-q/--quiet` silences the human report and progress bars (errors still print).
- `--config job.yaml`: keys are the long option names (`group_size` or `group-size`); flags given on the
  command line win; unknown keys and wrong types are errors naming the key and the file.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from click.core import ParameterSource

from qtool.errors import SpecError

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON alone on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No report or progress; errors only.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="YAML job spec; keys are the long option names; flags override it.",
                 show_default=False),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing destination (atomically).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")]


def apply_config(ctx: typer.Context, config: Path | None, values: dict[str, Any]) -> dict[str, Any]:
    """Return `values` (the command's parsed parameters) with YAML keys filled in.

    A key from the file replaces a value only when the flag was not given on the command line. Values are
    converted and checked by the option's own click type, so YAML and flags accept exactly the same things.
    """
    if config is None:
        return values
    from qtool.spec.job import load_yaml_mapping

    data = load_yaml_mapping(config)
    params = {p.name: p for p in ctx.command.params if isinstance(p, click.Option) and p.name != "config"}
    out = dict(values)
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in params:
            valid = ", ".join(sorted(params))
            raise SpecError(f"unknown key '{key}'", path=config, fix=f"valid keys: {valid}")
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            continue
        param = params[name]
        if param.multiple and not isinstance(raw, list):
            raw = [raw]
        if not param.multiple and isinstance(raw, (list, dict)):
            raise SpecError(f"key '{key}' takes a single value, got {type(raw).__name__}", path=config)
        if isinstance(raw, dict) or (isinstance(raw, list) and any(isinstance(v, (list, dict)) for v in raw)):
            raise SpecError(f"key '{key}' has a nested value", path=config)
        if param.is_flag and not isinstance(raw, bool):
            raise SpecError(f"key '{key}' must be true or false, got {raw!r}", path=config)
        if isinstance(param.type, click.types.IntParamType) and isinstance(raw, (bool, float)):
            raise SpecError(f"key '{key}' must be an integer, got {raw!r}", path=config)
        try:
            out[name] = param.type_cast_value(ctx, raw)
        except click.BadParameter as e:
            raise SpecError(f"key '{key}': {e.format_message()}", path=config) from None
    return out


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def sanitize(text: str) -> str:
    """Make a name read from a file safe to print: control characters (ANSI escapes included) become
    visible escapes, and rich markup brackets are escaped."""
    from rich.markup import escape

    clean = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
    return escape(clean)


def stdout_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def emit_json(obj: Any) -> None:
    """The only thing written to stdout under --json."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def progress(quiet: bool):
    """A rich progress bar on stderr (so --json stdout stays clean); disabled under --quiet."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr_console(),
        disable=quiet,
        transient=True,
    )
