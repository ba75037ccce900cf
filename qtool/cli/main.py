"""Entry point: registers the command modules and turns errors into one line and an exit code.

Exit codes: 0 ok, 1 a check failed, 2 usage or input error, 3 an internal error (a bug: please report it
with QTOOL_DEBUG=1 output), 4 nothing checked (validate: every selected check skipped), 128 + N when
signal N ended the run (130 SIGINT, 143 SIGTERM, 129 SIGHUP; the temporary output is removed first, see
qtool.signals). QTOOL_DEBUG=1 re-raises so the traceback shows.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys

import typer

from qtool.cli.app import app

COMMANDS = ("pack", "inspect", "repack", "select", "bench", "validate", "eval")

# Options that take several values after one flag (`--batch-sizes 1 16 256`). Click options take one value
# per occurrence, so the argument list is rewritten to repeated flags before parsing.
VARIADIC_OPTIONS = frozenset({"--batch-sizes"})

for _name in COMMANDS:  # each module registers its command on `app`
    importlib.import_module(f"qtool.cli.{_name}")


def expand_variadic(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        out.append(a)
        i += 1
        if a in VARIADIC_OPTIONS:
            first = True
            while i < len(argv) and not argv[i].startswith("-"):
                if not first:
                    out.append(a)
                out.append(argv[i])
                first = False
                i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    from qtool import signals
    from qtool.errors import QtoolError

    signals.install()
    writer = sys.modules.get("qtool.io.writer")  # loaded only by a command that writes (not at CLI start-up)
    if writer is not None:  # an earlier command of this process (tests, a library caller) published those
        writer.PUBLISHED.clear()
    args = expand_variadic(list(sys.argv[1:] if argv is None else argv))
    debug = os.environ.get("QTOOL_DEBUG", "") not in ("", "0")
    try:
        rv = app(args=args, prog_name="qtool", standalone_mode=False)
    except QtoolError as e:
        if debug:
            raise
        from qtool.cli.common import config_origin

        _die(str(e) + config_origin(e.problem), e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _die("aborted", 130)
    except KeyboardInterrupt:
        _die("interrupted", 130)
    except signals.Terminated as e:
        from qtool.io.writer import PUBLISHED

        what = "interrupted" if e.signum == signal.SIGINT else "terminated"
        done = f" after writing {', '.join(map(str, PUBLISHED))}" if PUBLISHED else ""
        _die(f"{what} by {e}{done}; any unfinished output was removed", 128 + e.signum)
    except BrokenPipeError:  # a reader that went away (`| head`) before any status was known
        _finish(0)
    except Exception as e:  # noqa: BLE001 - a traceback shown to a user is a bug; report it as one
        if _is_usage_error(e):  # bad flags: Typer's own message with the usage line, exit 2
            e.show()
            sys.exit(2)
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG and not debug:
            name = os.fsdecode(e.filename or "")
            _die(f"{name[:80]}{'...' if len(name) > 80 else ''}: file name too long (use a shorter path)", 2)
        if debug:
            raise
        _die(f"internal error: {type(e).__name__}: {e} (this is a qtool bug; rerun with QTOOL_DEBUG=1 "
             "and report the traceback)", 3)
    _finish(rv if isinstance(rv, int) else 0)


def _finish(code: int) -> None:
    """Exit with the command's status. Output still buffered for a closed stdout is dropped quietly: a
    reader that stopped reading is not a failure, and must not turn into a traceback or another status."""
    from qtool.cli.common import silence

    try:
        sys.stdout.flush()
    except BrokenPipeError:
        silence()
    sys.exit(code)


def _is_usage_error(e: Exception) -> bool:
    # Typer vendors Click privately, so its usage-error class is not importable through a public name;
    # recognise it by its documented interface instead.
    return callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int)


def _die(msg: str, code: int) -> None:
    sys.stderr.write("qtool: error: " + " ".join(str(msg).split("\n")) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
