"""The error hierarchy every user-facing failure goes through.

A `QtoolError` message is one line that names the file and/or tensor, what is wrong, and what to do.
`qtool.cli.main.main` prints it and exits with `exit_code`; `QTOOL_DEBUG=1` shows the traceback.
Nothing in the core prints; it raises one of these.
"""

from __future__ import annotations


class QtoolError(Exception):
    """Base class. `exit_code` 2 = usage or input error; a failed check is no error: its command returns 1."""

    exit_code = 2

    def __init__(self, message: str, *, path: object | None = None, tensor: str | None = None,
                 fix: str | None = None):
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.fix = fix
        self.problem = message
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.path:
            where.append(self.path)
        if self.tensor:
            where.append(f"tensor '{self.tensor}'")
        head = ": ".join(where)
        msg = f"{head}: {self.problem}" if head else self.problem
        if self.fix:
            msg = f"{msg} ({self.fix})"
        # One line, always: a message built from file contents must not break the terminal layout; and inert:
        # names read from a file must not reach the terminal as CR, ANSI escapes or Unicode line breaks.
        msg = " ".join(msg.split("\n"))
        return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                       for c in msg)


class UsageError(QtoolError):
    """Bad flags or option combinations."""


class SpecError(QtoolError):
    """A YAML job spec or a declarations file is invalid (unknown key, wrong type)."""


class InputError(QtoolError):
    """An input file is missing, unreadable, malformed, hostile or inconsistent."""


class FormatError(QtoolError):
    """A tensor set does not match what its format requires (shapes, dtypes, bits)."""


class NotRepresentable(QtoolError):
    """A Plain cannot be stored exactly in the requested format (e.g. v1 zero of 0)."""


class OutputError(QtoolError):
    """The destination exists (without --force) or cannot be written."""


class DeviceError(QtoolError):
    """A requested device is absent or unusable."""
