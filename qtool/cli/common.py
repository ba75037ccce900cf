"""Conventions shared by every command: option aliases, --config merging, output, progress.

- `--json` puts machine-readable output alone on stdout; everything human goes to stderr then.
- `-q/--quiet` silences the human report and progress bars (errors still print).
- `--config job.yaml`: keys are the long option names (`group_size` or `group-size`); flags given on the
  command line win (stderr says so where the values differ); unknown keys, wrong types and null values are
  errors naming the file, line and key; numbers are decimal (YAML 1.2: `1e-3` is a number, `010` is text);
  relative paths are taken from the current directory, as a flag's are, and `~` is the home directory.
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
    typer.Option("--config", help="YAML job spec; keys are the long option names; flags override it; relative "
                                   "paths in it are from the current directory.", show_default=False),
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
    can never drift apart. Every key is checked (name, type) whether or not its flag was given; a key from
    the file replaces a value only when the flag was not given on the command line, and stderr says so when
    the flag overrides a different value (not under -q). Values are checked against the option's annotated
    type (int, float, bool, str, Path, list[...]); nothing is coerced from a wrong type, and null is refused.
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
    lines = getattr(data, "lines", {})
    out = dict(values)
    set_by: dict[str, str] = {}  # option name -> the key that set it
    overridden = []
    for key, raw in data.items():
        where = f"{config}:{lines[key]}" if key in lines else str(config)
        name = key.replace("-", "_")
        if name not in schema and name + "_" in schema:  # Python names that shadow a builtin: json_
            name += "_"
        if name not in schema:
            raise SpecError(f"unknown key '{key}'", path=where, fix=_unknown_key_fix(name, schema, command))
        flag = "--" + name.rstrip("_").replace("_", "-")
        if name in set_by:  # group_size and group-size: PyYAML sees two keys, the command one option
            raise SpecError(f"keys '{set_by[name]}' and '{key}' name one option", path=where, fix="keep one")
        set_by[name] = key
        # Checked even when the flag wins: a broken file is refused whatever the command line says.
        value = _convert(raw, schema[name], key, where)
        if _given_on_command_line(ctx, name):
            if value != out.get(name):
                overridden.append(f"{flag} on the command line ({_shown(_flag_text(out.get(name)))}) overrides "
                                  f"key '{key}' ({_describe(raw)}) of {where}")
            continue
        out[name] = value
        _FROM_CONFIG[flag] = (key, where)
    _check_paths(out)
    if not out.get("quiet"):
        for note in overridden:
            sys.stderr.write(f"qtool: note: {sanitize(note)}\n")
    return out


# The options a --config file set: {"--bits": ("bits", "job.yaml:3")}. A value checked after the merge is
# refused under its flag's name, and the user must learn that the flag came from the file (and which line).
_FROM_CONFIG: dict[str, tuple[str, str]] = {}


def config_origin(message: str) -> str:
    """" (--bits was set by key 'bits' in job.yaml:3)" for each option in `message` that a --config file
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


def _unknown_key_fix(name: str, schema: dict[str, Any], command: Callable[..., Any]) -> str:
    """What to write instead of an unknown key: the close option name, or where an argument goes."""
    import difflib

    valid = sorted(k.rstrip("_") for k in schema)
    bare = name.lstrip("_").lower()
    if bare in _argument_names(command) or bare == "config":
        return f"{bare.upper() if bare != 'config' else '--config'} is given on the command line, not in a job spec"
    for off, on in _negative_flags(command).items():
        if bare == off:
            return f"write {on}: false"
    if bare in valid:  # --bits or Bits
        return f"write '{bare}'"
    close = difflib.get_close_matches(bare, valid, n=1, cutoff=0.7)
    said = f"did you mean '{close[0]}'? " if close else ""
    return f"{said}valid keys: {', '.join(valid)}"


def _argument_names(command: Callable[..., Any]) -> set[str]:
    hints = get_type_hints(command, include_extras=True)
    return {name for name, hint in hints.items() if get_origin(hint) is Annotated
            and any(type(m).__name__ == "ArgumentInfo" for m in get_args(hint)[1:])}


def _negative_flags(command: Callable[..., Any]) -> dict[str, str]:
    """{"asym": "sym"} for each --x/--y option: the key of the second name is the first set to false."""
    out = {}
    for name, hint in get_type_hints(command, include_extras=True).items():
        for meta in get_args(hint)[1:] if get_origin(hint) is Annotated else ():
            # Under Annotated, Typer takes the first positional argument of typer.Option ("--sym/--asym") as
            # a declaration although it lands in `default`.
            first = getattr(meta, "default", None)
            for decl in [first, *(getattr(meta, "param_decls", None) or ())]:
                if isinstance(decl, str) and decl.startswith("-") and "/" in decl:
                    out[decl.split("/", 1)[1].lstrip("-").replace("-", "_")] = name.rstrip("_")
    return out


# How to write each type in YAML, for the messages.
_WANT = {bool: ("true or false", "write true or false"),
         int: ("an integer", "write a whole number in decimal, unquoted"),
         float: ("a number", "write a number, unquoted: 0.5, 1e-3"),
         str: ("a string", "write one value"),
         Path: ("a path", "write the path, relative to the current directory or absolute")}


def _convert(raw: Any, kind: Any, key: str, where: str, item: str = "") -> Any:
    """`raw` (a value of key `key`, at `where` = FILE:LINE) checked against `kind` and converted as Typer
    would convert the flag's text. `item` names a list item in messages."""
    what = f"key '{key}'{item}"
    if raw is None:
        raise SpecError(f"{what} has no value (null)", path=where,
                        fix="give it a value, or delete the line to use the default")
    if isinstance(kind, tuple):  # ("list", item)
        if isinstance(raw, list) and not raw:
            # [] would read as "not given" (the default: every kernel, every check): say so by leaving it out
            raise SpecError(f"{what} is an empty list", path=where,
                            fix="name at least one value, or delete the line to use the default")
        if isinstance(raw, str) and kind[1] in (int, float) and len(raw.replace(",", " ").split()) > 1:
            # `batch_sizes: 1 16 256`, as after the flag: YAML reads one string
            raise SpecError(f"{what} must be a list of numbers, got {_describe(raw)}", path=where,
                            fix="write a YAML list: [1, 16, 256]")
        items = raw if isinstance(raw, list) else [raw]
        return [_convert(v, kind[1], key, where, f" item {i + 1}" if isinstance(raw, list) else "")
                for i, v in enumerate(items)]
    ok = {
        bool: isinstance(raw, bool),
        int: isinstance(raw, int) and not isinstance(raw, bool),
        float: isinstance(raw, (int, float)) and not isinstance(raw, bool),
        str: isinstance(raw, (str, int, float)) and not isinstance(raw, bool),
        Path: isinstance(raw, str),
    }.get(kind)
    if ok is None:
        raise SpecError(f"{what} cannot be set from a job spec", path=where, fix="give it on the command line")
    if not ok:
        want, fix = _WANT[kind]
        if kind in (str, Path) and isinstance(raw, bool):
            fix = "quote it: YAML reads unquoted yes/no/on/off/true/false as true or false"
        elif kind in (str, Path) and isinstance(raw, (int, float)):
            fix = "quote it"
        raise SpecError(f"{what} must be {want}, got {_describe(raw)}", path=where, fix=fix)
    if kind is float:
        try:
            return float(raw)
        except OverflowError:  # an integer of 309 or more digits
            raise SpecError(f"{what} is out of range: {_describe(raw)}", path=where,
                            fix="give a value the option allows (see --help)") from None
    if kind is str or kind is Path:
        text = str(raw)
        if "\0" in text:  # cannot come from a command line; open() would raise on it
            raise SpecError(f"{what} holds a NUL character (\\0)", path=where, fix="remove it")
        if kind is str:
            return text
        if not text:  # Path("") is ".": the current directory, which nobody means by an empty value
            raise SpecError(f"{what} is an empty path", path=where,
                            fix="name a file or directory, or delete the line to use the default")
        try:
            return Path(text).expanduser()  # as the shell expands ~ in a flag
        except RuntimeError:  # ~user with no such user, or no home directory
            raise SpecError(f"{what}: cannot expand {_describe(text)}", path=where,
                            fix="write the path in full") from None
    return raw


def _flag_text(v: Any) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v).lower() if isinstance(v, bool) else str(v)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _describe(v: Any, limit: int = 60) -> str:
    """A value read from a file as YAML writes it, bounded: never walk a huge nested value to print it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return f"a mapping of {_count(len(v), 'key')}"
    if isinstance(v, (list, tuple, set, frozenset)):
        return f"a list of {_count(len(v), 'item')}"
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
