"""SIGINT, SIGTERM and SIGHUP end a run the same way: the exception unwinds through `atomic_output`, which
removes the temporary output, and the CLI prints one line and exits 128 + the signal number (130, 143, 129).

`install()` (called by the CLI) sets the handlers. Inside `deferred()` (the few renames that publish an
output) a signal is held back and raised when the block ends, so a publish is never cut in half.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = {"depth": 0, "pending": None}


class Terminated(BaseException):  # noqa: N818 - named for what happened, like KeyboardInterrupt
    """SIGINT, SIGTERM or SIGHUP arrived. A BaseException, as KeyboardInterrupt is, so that only cleanup code
    (`finally`, `except BaseException: ...; raise`) sees it on its way to the CLI (Click would turn a
    KeyboardInterrupt into a silent exit)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _handler(signum: int, _frame) -> None:
    if _state["depth"]:
        _state["pending"] = _state["pending"] or signum
        return
    raise Terminated(signum)


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP through `_handler` (main thread only, as Python requires). A
    signal the parent set to be ignored (nohup, a shell's background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in HANDLED:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back for the duration of the block; one that came meanwhile is raised
    at its end."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        pending = _state["pending"] if not _state["depth"] else None
        if pending is not None:
            _state["pending"] = None
            raise Terminated(pending)
