"""SIGINT, SIGTERM and SIGHUP end a run the same way: the exception unwinds through `atomic_output`, which
removes the temporary output, and the CLI prints one line and exits 128 + the signal number (130, 143, 129).

`install()` (called by the CLI) sets the handlers. Inside `deferred()` (the few renames that publish an
output) a signal is held back and raised when the block ends, so a publish is never cut in half; the run then
stops with the output complete, and the CLI's line names it (io.writer.PUBLISHED).

The first import of a large extension package (torch, numpy, ...) runs deferred too. The commands import
torch on first use, after the handlers are set; an exception raised inside that import is either discarded
by C code that imports a dependency (numpy from torch._C: the run goes on and publishes, exit 0) or leaves
the package half-initialised (the next import fails, exit 3).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import signal
import sys
import threading
from collections.abc import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Packages whose first import runs with signals held back (top-level names)
HEAVY = frozenset({"torch", "numpy", "triton", "safetensors", "transformers", "tokenizers"})
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
    if not any(isinstance(f, _HeldImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _HeldImports())


class _HeldImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of a HEAVY package not yet imported, it asks the other finders and
    runs the module's code inside `deferred()`."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in HEAVY or name in sys.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HeldLoader(spec.loader)
                return spec
        return None


class _HeldLoader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, attr: str):  # resource readers, is_package, get_code, ...
        return getattr(self._inner, attr)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        # the module's spec and __loader__ name the real loader, as if this one had never been there
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        with deferred():
            self._inner.exec_module(module)


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
