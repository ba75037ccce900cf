"""Running qtool as a separate process, with bounded memory and time, and reading back what it did.

Two ways, same observable result (exit code, stdout, stderr, peak memory):

- `run_qtool(argv)`: `sys.executable -m qtool ARGV` in a fresh interpreter. The real thing; ~2 s each
  because every interpreter imports torch.
- `run_batch(invocations)`: one helper interpreter (`python -m tests.attacks.forkrun`) imports qtool and
  torch once, then forks a child per invocation; the child applies the same limits, points fds 0/1/2 at
  /dev/null and two files, and runs the `qtool` package as `__main__` (exactly what `python -m qtool`
  does after start-up). A few milliseconds each, which is what lets CI run every command over the whole
  corpus. `tests/attacks/test_attacks.py` checks on a sample that both ways give the same result.

Memory: RLIMIT_AS (address space) of 4 GiB is set in the child before it runs anything, so an
allocation sized from a hostile header fails (MemoryError, i.e. a crash the tests catch) instead of
swapping the machine. Peak resident memory comes from wait4's rusage.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADDRESS_SPACE_LIMIT = 4 << 30
DEFAULT_TIMEOUT = 60.0


@dataclass
class Result:
    argv: list[str]
    rc: int | None          # exit status; -N when killed by signal N; None when it timed out
    stdout: str
    stderr: str
    seconds: float
    maxrss_mb: float        # peak resident set of the process (inherited pages included)
    timed_out: bool = False
    marker: bool = False    # the pickle marker existed after this run (run_batch only)

    def to_dict(self) -> dict:
        return asdict(self)


def limit_memory() -> None:
    """preexec_fn / post-fork hook: cap the address space so a blow-up fails fast."""
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "QTOOL_DEBUG"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("COLUMNS", "150")
    env.update(extra or {})
    return env


def _wait(pid: int, deadline: float) -> tuple[int | None, float, bool]:
    """(exit code or -signal, maxrss MiB, timed_out) of child `pid`; SIGKILLs it at the deadline."""
    while True:
        got, status, ru = os.wait4(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, ru = os.wait4(pid, 0)
            return None, ru.ru_maxrss / 1024, True
        time.sleep(0.005)
    rc = os.waitstatus_to_exitcode(status)
    return rc, ru.ru_maxrss / 1024, False


def run_qtool(argv: list[str], cwd: str | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
              env: dict[str, str] | None = None, preexec=limit_memory) -> Result:
    """`python -m qtool ARGV` in a fresh interpreter under the memory limit (preexec: a hook run in the child
    before it starts, e.g. to set more limits; it should call limit_memory too)."""
    t0 = time.monotonic()
    with open(os.devnull, "rb") as null, _tmpfile() as out, _tmpfile() as err:
        p = subprocess.Popen([sys.executable, "-m", "qtool", *map(str, argv)], cwd=cwd or REPO, stdin=null,
                             stdout=out, stderr=err, env=child_env(env), preexec_fn=preexec)
        rc, rss, timed_out = _wait(p.pid, t0 + timeout)
        p.returncode = rc if rc is not None else -9  # reaped by wait4 above; keep Popen from waiting again
        out.seek(0)
        err.seek(0)
        return Result([str(a) for a in argv], rc, out.read().decode("utf-8", "replace"),
                      err.read().decode("utf-8", "replace"), time.monotonic() - t0, rss, timed_out)


def _tmpfile():
    import tempfile

    return tempfile.TemporaryFile()


def run_batch(invocations: list[list[str]], cwd: str | Path | None = None, timeout: float = DEFAULT_TIMEOUT,
              marker: str | Path | None = None, warm: list[list[str]] | None = None,
              parallel: int = 2) -> list[Result]:
    """Run every argv through the fork server (see module docstring); results in the same order.

    warm: argvs the server runs in-process first (output discarded) so that their lazy imports and cached
          tables are paid once; only commands that do no torch arithmetic (header reading, planning).
    parallel: children alive at once.
    """
    if not invocations:
        return []
    request = {"invocations": [[str(a) for a in argv] for argv in invocations], "cwd": str(cwd or REPO),
               "timeout": timeout, "marker": str(marker) if marker else None,
               "warm": [[str(a) for a in argv] for argv in warm or []], "parallel": max(1, parallel)}
    p = subprocess.run([sys.executable, "-m", "tests.attacks.forkrun"], input=json.dumps(request).encode(),
                       capture_output=True, cwd=REPO, env=child_env(), timeout=timeout * len(invocations) + 300)
    if p.returncode != 0:
        raise RuntimeError(f"fork server failed ({p.returncode}): {p.stderr.decode(errors='replace')[-3000:]}")
    return [Result(**r) for r in json.loads(p.stdout)]


def _warm_up(commands: set[str], warm: list[list[str]]) -> None:
    """Import what commands import lazily (rich tables, help formatting, error paths, YAML tables) once,
    here, so each child does not: every command's --help, a run on a missing path, and the `warm` argvs,
    output discarded. No torch arithmetic runs here: a thread pool started before fork() would not
    survive into the children."""
    from contextlib import redirect_stderr, redirect_stdout

    from qtool.cli.main import main

    for mod in ("rich.console", "rich.table", "rich.progress", "rich.markup", "rich.panel", "rich.text"):
        try:
            __import__(mod)
        except ImportError:
            pass
    argvs = [a for cmd in sorted(commands) for a in ([cmd, "--help"], [cmd, "/nonexistent/qtool-warm-up"])]
    with open(os.devnull, "w") as null, redirect_stdout(null), redirect_stderr(null):
        for argv in argvs + warm:
            try:
                main(argv)
            except BaseException:  # noqa: BLE001 - SystemExit and anything else: only imports matter
                pass


def _child(argv: list[str], cwd: str, out, err) -> None:
    """In the forked child: limits, fds, then the qtool package as __main__. Never returns."""
    import runpy
    import traceback

    code = 1
    try:
        limit_memory()
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["qtool", *argv]
        try:
            runpy.run_module("qtool", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                sys.stderr.write(f"{e.code}\n")
                code = 1
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve(request: dict) -> list[dict]:
    """The fork server's loop (runs in the helper interpreter)."""
    import gc
    import tempfile

    import torch  # noqa: F401 - paid once here instead of once per invocation

    import qtool.cli.main  # noqa: F401 - registers every command

    for mod in ("qtool.pack", "qtool.inspect", "qtool.repack.run", "qtool.select.plan", "qtool.formats",
                "safetensors", "yaml", "numpy", "gguf"):
        try:
            __import__(mod)
        except ImportError:
            pass
    invocations = request["invocations"]
    _warm_up({argv[0] for argv in invocations if argv}, request.get("warm") or [])
    gc.freeze()  # children then leave the parent's objects alone instead of copying them on first GC
    marker = Path(request["marker"]) if request.get("marker") else None
    results: list[dict | None] = [None] * len(invocations)
    pending = list(enumerate(invocations))[::-1]
    running: dict[int, tuple] = {}
    while pending or running:
        while pending and len(running) < request.get("parallel", 1):
            k, argv = pending.pop()
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            sys.stdout.flush()
            sys.stderr.flush()
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(argv, request["cwd"], out, err)
            running[pid] = (k, argv, t0, out, err)
        for pid in list(running):
            k, argv, t0, out, err = running[pid]
            got, status, ru = os.wait4(pid, os.WNOHANG)
            timed_out = False
            if not got:
                if time.monotonic() - t0 < request["timeout"]:
                    continue
                os.kill(pid, signal.SIGKILL)
                _, status, ru = os.wait4(pid, 0)
                timed_out = True
            del running[pid]
            out.seek(0)
            err.seek(0)
            results[k] = Result(argv, None if timed_out else os.waitstatus_to_exitcode(status),
                                out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace"),
                                time.monotonic() - t0, ru.ru_maxrss / 1024, timed_out,
                                bool(marker and marker.exists())).to_dict()
            out.close()
            err.close()
        time.sleep(0.002)
    return results  # type: ignore[return-value]
