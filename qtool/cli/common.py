"""Conventions shared by every command: option aliases, --config merging, output, progress.

- `--json` puts machine-readable output alone on stdout; everything human goes to stderr then.
- `-q/--quiet` silences the human report and progress bars (errors still print).
- `--config job.yaml`: keys are the long option names (`group_size` or `group-size`); flags given on the
  command line win; unknown keys and wrong types are errors naming the key and the file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import typer

from qtool.errors import SpecError, UsageError
from qtool.report.text import sanitize

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON alone on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No report or progress: errors, and warnings of what "
                                                               "an output leaves out, only.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="YAML job spec; keys are the long option names; flags override it.",
                 show_default=False),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing destination (atomically).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")]
IncludeOpt = Annotated[list[str] | None, typer.Option(
    "--include", help="Regex of module names to work on (repeatable; default: every eligible module).")]
ExcludeOpt = Annotated[list[str] | None, typer.Option(
    "--exclude", help="Regex of module names to leave as they are (repeatable).")]
MaxShardOpt = Annotated[str, typer.Option("--max-shard-size", help="Shard size limit, e.g. 4GB, 500MB, 2GiB.")]


def apply_config(ctx: typer.Context, config: Path | None, values: dict[str, Any],
                 command: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Return `values` (the command's parsed parameters) with YAML keys filled in.

    `command` is the command function itself (default: the one Typer is running): its type hints are the schema, so the YAML keys and the flags
    can never drift apart. A key from the file replaces a value only when the flag was not given on the
    command line. Values are checked against the option's annotated type (int, float, bool, str, Path,
    list[...]); nothing is coerced from a wrong type.
    """
    _FROM_CONFIG.clear()
    _check_paths(values)
    if config is None:
        return values
    from qtool.spec.job import load_yaml_mapping

    data = load_yaml_mapping(config)
    if command is None:
        cb = ctx.command.callback
        command = getattr(cb, "__wrapped__", cb)
    schema = option_types(command)
    out = dict(values)
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in schema and name + "_" in schema:  # Python names that shadow a builtin: json_
            name += "_"
        if name not in schema:
            valid = ", ".join(sorted(k.rstrip("_") for k in schema))
            raise SpecError(f"unknown key '{key}'", path=config, fix=f"valid keys: {valid}")
        if _given_on_command_line(ctx, name):
            continue
        out[name] = _convert(raw, schema[name], key, config)
        _FROM_CONFIG["--" + name.rstrip("_").replace("_", "-")] = (key, config)
    _check_paths(out)
    return out


# The options a --config file set: {"--bits": ("bits", path)}. A value checked after the merge is refused
# under its flag's name, and the user must learn that the flag came from the file.
_FROM_CONFIG: dict[str, tuple[str, Path]] = {}


def config_origin(message: str) -> str:
    """" (--bits was set by key 'bits' in job.yaml)" for each option in `message` that a --config file
    set, or ""."""
    import re

    named = set(re.findall(r"--[a-z][a-z0-9-]*", message))
    said = [f"{flag} was set by key '{key}' in {path}" for flag, (key, path) in _FROM_CONFIG.items()
            if flag in named]
    return f" ({'; '.join(said)})" if said else ""


_PATH_NAMES = {"src": "SRC", "path": "PATH", "out": "-o", "config": "--config"}


def _check_paths(values: dict[str, Any]) -> None:
    """Every path given (arguments, options, --config, and paths from the YAML file) fits the system's
    name limits; refused with one line otherwise (see qtool.paths.check_path_length)."""
    from qtool.paths import check_path_length

    for name, val in values.items():
        if isinstance(val, Path):
            check_path_length(val, _PATH_NAMES.get(name, "--" + name.rstrip("_").replace("_", "-")))


def option_types(command: Callable[..., Any]) -> dict[str, Any]:
    """{parameter name: base type} for the options of a command function (arguments, ctx and --config
    excluded). Base types are int, float, bool, str, Path, or ("list", item type)."""
    hints = get_type_hints(command, include_extras=True)
    out = {}
    for name, hint in hints.items():
        if name in ("return", "ctx", "config"):
            continue
        base, meta = hint, ()
        if get_origin(hint) is Annotated:
            base, *meta = get_args(hint)
        if any(type(m).__name__ == "ArgumentInfo" for m in meta):
            continue
        out[name] = _base_type(base)
    return out


def _base_type(t: Any) -> Any:
    args = [a for a in get_args(t) if a is not type(None)]
    if get_origin(t) in (Union, UnionType) and len(args) == 1:
        return _base_type(args[0])
    if get_origin(t) is list:
        return ("list", _base_type(get_args(t)[0]))
    return t


def _convert(raw: Any, kind: Any, key: str, config: Path) -> Any:
    if isinstance(kind, tuple):  # ("list", item)
        items = raw if isinstance(raw, list) else [raw]
        return [_convert(v, kind[1], key, config) for v in items]
    ok = {
        bool: isinstance(raw, bool),
        int: isinstance(raw, int) and not isinstance(raw, bool),
        float: isinstance(raw, (int, float)) and not isinstance(raw, bool),
        str: isinstance(raw, (str, int, float)) and not isinstance(raw, bool),
        Path: isinstance(raw, str),
    }.get(kind)
    if ok is None:
        raise SpecError(f"key '{key}' cannot be set from a job spec", path=config)
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                Path: "a path string"}[kind]
        raise SpecError(f"key '{key}' must be {want}, got {_short_repr(raw)}", path=config)
    return Path(raw) if kind is Path else (str(raw) if kind is str else raw)


def _short_repr(v: Any, limit: int = 60) -> str:
    """repr of a value from a file, bounded: never walk a huge nested value to print it."""
    if isinstance(v, (list, dict)):
        return f"a {type(v).__name__} of {len(v)} items"
    text = repr(v) if not isinstance(v, str) or len(v) < 4 * limit else repr(v[: 4 * limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _given_on_command_line(ctx: typer.Context, name: str) -> bool:
    get = getattr(ctx, "get_parameter_source", None)
    source = get(name) if get is not None else None
    return source is not None and getattr(source, "name", "") == "COMMANDLINE"


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_range(flag: str, value: int | float, lo: int | float, hi: int | float, *,
                also: tuple[int, ...] = ()) -> None:
    """Refuse (exit 2) a flag's number outside [lo, hi] (or the special values `also`), naming the flag,
    the value and what is allowed. NaN is outside every range."""
    if value in also or lo <= value <= hi:
        return
    allowed = " or ".join([*map(str, also), f"{lo} to {hi}"])
    raise UsageError(f"{flag} {_shown(value)} is out of range", fix=f"allowed: {allowed}")


def check_choice(flag: str, value: Any, choices: tuple) -> None:
    """Refuse (exit 2) a flag's value that is not one of `choices`, listing them."""
    if value not in choices:
        raise UsageError(f"{flag} {_shown(value)} is not supported", fix=f"allowed: {', '.join(map(str, choices))}")


def silence(stream: Any = None) -> None:
    """Point an output whose reader went away (`qtool inspect | head -c1`) at /dev/null: nothing further
    reaches it, and neither a later write nor the interpreter's final flush fails."""
    stream = sys.stdout if stream is None else stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured output): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _console(stderr: bool):
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # A closed output is not a failure of the command (rich's default exits 1): stop writing, and
            # let the command finish and exit with its own status.
            self.quiet = True
            silence(self.file)

    c = _Console(stderr=stderr, highlight=False, soft_wrap=False)
    if not c.is_terminal:
        # Piped or captured output (CI logs, README examples): don't squeeze tables into 80 columns.
        c = _Console(stderr=stderr, highlight=False, soft_wrap=False, width=150)
    return c


def stdout_console():
    return _console(stderr=False)


def stderr_console():
    return _console(stderr=True)


def json_text(obj: Any) -> str:
    """`obj` as strict JSON text (see _plain), for stdout and for report files alike."""
    return json.dumps(_plain(obj), indent=2, sort_keys=False, allow_nan=False) + "\n"


def emit_json(obj: Any) -> None:
    """The only thing written to stdout under --json."""
    text = json_text(obj)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        silence()


def _plain(o: Any) -> Any:
    """`o` as strict JSON values. A non-finite float read from a file (a GGUF float key, a config's NaN) is
    written as the string "nan", "inf" or "-inf": bare NaN/Infinity are not JSON, and strict parsers reject the
    whole document. Numbers qtool computes are checked where they are made."""
    if isinstance(o, float):
        return o if math.isfinite(o) else repr(o)
    if isinstance(o, dict):
        return {str(k) if not isinstance(k, str) else k: _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if o is None or isinstance(o, (str, int, bool)):
        return o
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return _plain(o.to_dict())
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def progress(quiet: bool):
    """A rich progress bar on stderr (so --json stdout stays clean); disabled under --quiet."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = stderr_console()
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        # Only on a terminal: in logs and pipes a bar is noise (and rich leaves a blank line behind).
        disable=quiet or not console.is_terminal,
        transient=True,
    )


def warn_unshown(v: dict, warnings: list[str]) -> None:
    """Warnings (files and tensors not carried over) reach stderr when no report is shown: -q and --json
    leave out the report, never what was left out of the output. The shown report prints them itself."""
    if v["quiet"] or v["json_"]:
        for w in warnings:
            stderr_console().print(f"warning: {sanitize(w)}")
