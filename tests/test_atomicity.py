"""Writes are all-or-nothing: `pack` and `repack` interrupted mid-write (SIGINT, SIGKILL, disk full) leave
either no destination, the old destination untouched, or a complete new one; never a partial one.

The commands run as real subprocesses (`python -m qtool`) on a model big enough that writing takes about a
second. Each run is signalled at a random moment after its temporary output `.qtool-tmp-PID-*`
appears (so the kill lands during the write, not during start-up), then the destination is judged:
- absent, or byte-identical to what it was before the run (its old content), or
- complete: the same files, tensor names, shapes and tensor bytes as an uninterrupted reference run.
SIGKILL may leave the hidden temporary entry behind; the next run to the same destination must remove it
(`qtool.io.writer.clean_stale`). SIGINT leaves nothing (exit 130, one line). An existing destination is
refused without --force; with --force it is replaced only once the new output is complete.

CI runs one SIGKILL and one SIGINT per command; `-m slow` runs several at random times.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.errors import OutputError
from qtool.io import writer
from qtool.io.writer import TMP_TAG, atomic_output, clean_stale
from tests.attacks.runner import REPO, child_env, limit_memory, run_qtool
from tests.conftest import write_llama

LAYERS, HIDDEN = 4, 1024
SEED = int(os.environ.get("QTOOL_ATOMICITY_SEED", random.randrange(1 << 30)))


# --- models and judging ---------------------------------------------------------------------------

def dense_model(root: Path) -> Path:
    """LAYERS x 4 fp16 linear weights [HIDDEN, HIDDEN] (~32 MB), a norm and a config."""
    g = torch.Generator().manual_seed(0)
    root.mkdir(parents=True)
    t = {f"model.layers.{k}.{m}.weight": torch.randn(HIDDEN, HIDDEN, generator=g).half()
         for k in range(LAYERS) for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")}
    t["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
    write_llama(root, t, "float16")
    return root


def digest(path: Path) -> dict[str, str]:
    """{relative file: sha256} of a directory (what "untouched" is checked against)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def tensors_of(path: Path) -> dict[str, tuple]:
    """{tensor name: (dtype, shape, sha256 of bytes)} over every .safetensors file of a directory."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                out[k] = (str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()
                                                                        .tobytes()).hexdigest())
    return out


def judge(dest: Path, before: dict[str, str] | None, reference: Path) -> str:
    """'absent', 'old' (byte-identical to `before`) or 'new' (complete: same files and tensors as the
    reference run); raises AssertionError for anything else, i.e. a partial destination."""
    if not dest.exists():
        assert before is None, f"{dest} vanished: it existed before the run"
        return "absent"
    if before is not None and digest(dest) == before:
        return "old"
    names = sorted(p.name for p in dest.iterdir())
    want = sorted(p.name for p in reference.iterdir())
    assert names == want, f"partial destination: files {names}, a complete one has {want}"
    assert tensors_of(dest) == tensors_of(reference), "destination tensors differ from a complete run's"
    json.loads((dest / "config.json").read_text())
    return "new"


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(TMP_TAG))


# --- running and interrupting --------------------------------------------------------------------------

def start(argv: list[str], preexec=limit_memory) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qtool", *map(str, argv)], cwd=REPO, env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=preexec)


def interrupt(argv: list[str], dest: Path, sig: int, rng: random.Random, window: float) -> tuple:
    """Start the command, wait for its temporary output to appear, sleep U(0, window), send `sig`.
    Returns (exit code, stderr, seconds after the temporary output appeared when the signal went)."""
    p = start(argv)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None and not any(
            name.startswith(f"{TMP_TAG}{p.pid}-") for name in os.listdir(dest.parent)):
        time.sleep(0.005)
    delay = rng.uniform(0, window)
    time.sleep(delay)
    if p.poll() is None:
        p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode(errors="replace"), delay


def timed_run(argv: list[str], dest: Path) -> float:
    """Run to completion; return how long the write took (temporary output first seen -> exit)."""
    p = start(argv)
    seen = None
    while p.poll() is None:
        if seen is None and any(n.startswith(f"{TMP_TAG}{p.pid}-") for n in os.listdir(dest.parent)):
            seen = time.monotonic()
        time.sleep(0.005)
    out, err = p.communicate()
    assert p.returncode == 0, err.decode()
    return time.monotonic() - (seen or time.monotonic())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Source model, the CLI argv per command, one uninterrupted reference output per command (written
    in-process: same code, no interpreter start-up) and how long each write takes."""
    from qtool.pack import PackJob, run_pack
    from qtool.repack.plan import RepackJob
    from qtool.repack.run import run_repack

    root = tmp_path_factory.mktemp("atomic")
    src = dense_model(root / "dense")
    ref = {"pack": root / "ref-pack", "repack": root / "ref-repack"}
    argv = {"pack": ["pack", src, "--group-size", "128", "-q"],
            "repack": ["repack", ref["pack"], "--to", "marlin", "-q"]}
    t0 = time.perf_counter()
    run_pack(PackJob(src=src, out=ref["pack"], group_size=128))
    t1 = time.perf_counter()
    run_repack(RepackJob(src=ref["pack"], to="marlin", out=ref["repack"]))
    window = {"pack": t1 - t0, "repack": time.perf_counter() - t1}
    return root, argv, ref, window


def _one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), err


def kill_and_judge(models, cmd: str, sig: int, force: bool, rng: random.Random, tag: str) -> str:
    root, argv, ref, window = models
    dest = root / f"{cmd}-{tag}"
    before = None
    if force:  # the old destination: an earlier qtool output (what --force may replace), not what the run writes
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(ref["pack"] if cmd == "repack" else ref["repack"], dest)
        before = digest(dest)
    else:
        shutil.rmtree(dest, ignore_errors=True)
    full = argv[cmd] + ["-o", dest] + (["--force"] if force else [])
    rc, err, delay = interrupt(full, dest, sig, rng, 1.2 * window[cmd] + 0.05)
    where = f"{cmd} {signal.Signals(sig).name} {'--force ' if force else ''}after {delay:.3f} s (seed {SEED})"
    state = judge(dest, before, ref[cmd])
    # A SIGINT that lands while the interpreter is already shutting down (the work done) interrupts an atexit
    # finalizer: Python prints "Exception ignored in atexit callback" and its traceback. Harmless, and only
    # possible once the output is complete; anything else with a traceback is a failure.
    late = sig == signal.SIGINT and err.lstrip().startswith("Exception ignored in atexit callback")
    assert "Traceback" not in err or (late and state == "new"), (where, rc, state, err)
    if rc == 0 or rc == -sig or late:
        # 0: the signal came after the end. -sig: SIGKILL, or SIGINT during interpreter shutdown (Python's
        # handler is gone by then), which only happens once the output is in place.
        assert state == "new" or (sig == signal.SIGKILL and rc == -sig), (where, rc, state)
        assert state in (("old", "new") if force else ("absent", "new")), where
    elif sig == signal.SIGINT:
        assert rc == 130, (where, rc, err)
        # Typer turns KeyboardInterrupt into a silent Exit(130); a message, if any, is one line.
        assert len(err.strip().splitlines()) <= 1, (where, err)
        # a signal held back over the publish (or landing after it) stops the run once the output is complete,
        # and the line says it was written
        published = f"after writing {dest}" in err
        assert state == ("new" if published else "old" if force else "absent"), (where, err)
        assert not leftovers(dest), (where, leftovers(dest))  # Ctrl-C cleans up after itself
    else:
        raise AssertionError((where, rc, err))
    return state


# --- tests -----------------------------------------------------------------------------------------

def test_killed_mid_write_leaves_old_or_complete(models):
    """SIGKILL then SIGINT over an existing destination with --force, for pack and repack: old or complete
    new, never partial; the temporary entry SIGKILL leaves is removed by the next run (the interrupted
    one), which leaves nothing of its own. One test, so the models are built once per worker."""
    rng = random.Random(SEED)
    root = models[0]
    for cmd in ("pack", "repack"):
        kill_and_judge(models, cmd, signal.SIGKILL, True, rng, "ci")
        kill_and_judge(models, cmd, signal.SIGINT, True, rng, "ci")
        assert not leftovers(root / f"{cmd}-ci")  # SIGKILL's leftover went with the next run's clean_stale
    _disk_full_run(models)


def test_existing_destination_refused_without_force(tmp_path):
    """(The corpus runs check the same through the CLI: tests/attacks, variant "keep".)"""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="destination exists.*--force"), atomic_output(dest) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"] and not leftovers(dest)


def _disk_full():
    limit_memory()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def _disk_full_run(models) -> None:
    """A file-size limit (1 MiB) makes the first shard write fail (EFBIG, as ENOSPC would): exit 2 with one
    line naming the destination, the old destination intact with --force, no temporary leftovers."""
    root, argv, ref, _ = models
    dest = root / "pack-full"
    shutil.copytree(ref["repack"], dest)
    before = digest(dest)
    p = start(argv["pack"] + ["-o", dest, "--force"], preexec=_disk_full)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err.decode()
    _one_line(err.decode(), str(dest), "cannot write the output")
    assert digest(dest) == before and not leftovers(dest)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["pack", "repack"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
@pytest.mark.parametrize("force", [False, True], ids=["fresh", "force"])
def test_interrupted_at_random_times(models, cmd, sig, force):
    rng = random.Random(SEED + 7 * int(sig) + force)
    tag = f"{'force' if force else 'fresh'}-{int(sig)}"
    states = [kill_and_judge(models, cmd, sig, force, rng, tag) for _ in range(5)]
    assert set(states) <= {"absent", "old", "new"}
    if sig == signal.SIGKILL:  # a completed run to the same destination removes what the kills left
        r = run_qtool(models[1][cmd] + ["-o", models[0] / f"{cmd}-{tag}", "--force"], timeout=300)
        assert r.rc == 0 and not leftovers(models[0] / f"{cmd}-{tag}"), r.stderr


# --- the writer itself (in-process) ------------------------------------------------------------------

def earlier_output(dest: Path) -> Path:
    """An earlier qtool output (what --force may replace): old.txt and a model.safetensors with qtool's
    metadata."""
    dest.mkdir()
    save_file({"w": torch.zeros(2)}, dest / "model.safetensors", metadata={"qtool.version": "0"})
    (dest / "old.txt").write_text("old")
    return dest


def test_atomic_output_swaps_in_one_step(tmp_path):
    """With --force the old directory stays whole until the new one is complete; after, only the new one
    exists and nothing temporary is left."""
    dest = tmp_path / "out"
    earlier_output(dest)
    with atomic_output(dest, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (dest / "old.txt").read_text() == "old"  # untouched while the new output is written
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"] and not leftovers(dest)


def test_atomic_output_rolls_back_on_interrupt(tmp_path):
    dest = tmp_path / "out"
    earlier_output(dest)
    with pytest.raises(KeyboardInterrupt), atomic_output(dest, force=True) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise KeyboardInterrupt
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors", "old.txt"] and not leftovers(dest)


def test_interrupt_outside_the_handlers_is_cleaned_at_exit(tmp_path):
    """A Ctrl-C that lands after the temporary output exists but where atomic_output's handlers cannot see it
    (contextlib's __enter__ has the path, the with block is not set up yet): the exit hook removes it, and
    leaves a published output and another process's temporary output alone."""
    from qtool.io import writer

    dest = tmp_path / "out"
    earlier_output(dest)
    cm = atomic_output(dest, force=True)
    tmp = cm.__enter__()  # ... and the interrupt comes here: __exit__ never runs
    (tmp / "half.bin").write_bytes(b"x")
    done = tmp_path / "done"
    with atomic_output(done) as t:
        (t / "a.txt").write_text("a")
    other = tmp_path / f"{TMP_TAG}{os.getpid() + 1}-abcdef"  # a forked child's view: not this process's
    other.mkdir()
    writer._LIVE.add(other)
    assert leftovers(dest) == sorted([tmp.name, other.name])
    writer._remove_live()
    assert leftovers(dest) == [other.name] and (done / "a.txt").read_text() == "a"
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors", "old.txt"] and not writer._LIVE


def test_atomic_output_disk_full_is_an_output_error(tmp_path):
    import errno

    dest = tmp_path / "out"
    with pytest.raises(OutputError, match="cannot write the output"), atomic_output(dest) as tmp:
        (tmp / "a").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert not dest.exists() and not leftovers(dest)


def test_fallback_without_exchange_restores_old_after_a_crash(tmp_path, monkeypatch):
    """Where renameat2 is missing the swap is move aside, move in; a process dying between them (here a real
    death: os._exit in a forked child) leaves the old output aside under its hidden name, and the next run
    puts it back under the name its record holds instead of deleting it."""
    dest = tmp_path / "out"
    earlier_output(dest)
    pid = os.fork()
    if pid == 0:  # the child: no exchange, and it dies right after moving dest aside
        try:
            writer._exchange = lambda a, b: False
            real_rename = os.rename

            def dying_rename(a, b):
                real_rename(a, b)
                if Path(b).name.endswith("-old"):
                    os._exit(9)

            writer.os.rename = dying_rename
            with atomic_output(dest, force=True) as tmp:
                (tmp / "new.txt").write_text("new")
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert not dest.exists() and any(n.endswith("-old") for n in leftovers(dest))
    clean_stale(dest)  # the child is gone: its pid is in the leftovers' names
    assert (dest / "old.txt").read_text() == "old" and not leftovers(dest)


def test_clean_stale_removes_only_dead_runs(tmp_path, monkeypatch):
    dest = tmp_path / "out"
    dead = tmp_path / f"{TMP_TAG}999999-abc123"
    alive = tmp_path / f"{TMP_TAG}{os.getpid()}-def456"
    other = tmp_path / ".other-hidden-999999"
    for d in (dead, alive, other):
        d.mkdir()
    monkeypatch.setattr(writer, "_pid_alive", lambda pid: pid == os.getpid())
    clean_stale(dest)
    assert not dead.exists() and alive.exists() and other.exists()


# --- publishing: no-replace rename, the --force rule, names, parents ------------------------------------

def test_destination_appearing_before_publish_is_kept(tmp_path):
    """Without --force a destination that appears while the output is written wins: it is left as it is,
    the run fails, the temporary output goes (a check-then-rename would replace it)."""
    dest = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared while qtool was writing"), atomic_output(dest) as tmp:
        (tmp / "new.txt").write_text("new")
        dest.mkdir()
        (dest / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in dest.iterdir()) == ["theirs.txt"] and not leftovers(dest)


@pytest.mark.parametrize("directory", [True, False], ids=["dir", "file"])
def test_no_replace_fallback_without_renameat2(tmp_path, monkeypatch, directory):
    """Without renameat2 a file is published with link()+unlink() and a directory by mkdir()+rename() over
    it: both still refuse a destination that appeared, and publish onto a free name."""
    monkeypatch.setattr(writer, "_renameat2", lambda a, b, flags: False)
    for taken in (True, False):
        dest = tmp_path / f"out-{taken}"

        def fill(tmp, dest=dest, taken=taken):
            if directory:
                (tmp / "new.txt").write_text("new")
            else:
                tmp.write_text("new")
            if taken:
                dest.write_text("theirs")

        if taken:
            with pytest.raises(OutputError, match="appeared"), atomic_output(dest, directory=directory) as tmp:
                fill(tmp)
            assert dest.read_text() == "theirs"
        else:
            with atomic_output(dest, directory=directory) as tmp:
                fill(tmp)
            assert (dest / "new.txt" if directory else dest).read_text() == "new"
    assert not leftovers(tmp_path / "x")


def test_force_rule(tmp_path):
    """--force replaces an empty directory, an earlier qtool output (with the sub-directories it carried over)
    and a GGUF file; it refuses a symlink, a FIFO, a file that is not GGUF, a directory without qtool's
    metadata (with or without sub-directories)."""
    from safetensors.torch import save_file

    def qtool_output(d: Path, meta: dict) -> Path:
        d.mkdir()
        save_file({"w": torch.zeros(2)}, d / "model.safetensors", metadata=meta)
        (d / "tokenizer.json").write_text("{}")
        return d

    ok = [tmp_path / "empty", qtool_output(tmp_path / "prior", {"qtool.version": "1"}), tmp_path / "m.gguf"]
    ok[0].mkdir()
    (ok[1] / "1_Pooling").mkdir()
    ok[2].write_bytes(b"GGUF" + b"\0" * 20)
    bad = {"symbolic link": tmp_path / "link", "FIFO": tmp_path / "fifo", "not a GGUF": tmp_path / "notes.txt",
           "not a qtool output": tmp_path / "home", "no qtool.version": qtool_output(tmp_path / "hf", {"format": "pt"})}
    bad["symbolic link"].symlink_to(ok[1])
    os.mkfifo(bad["FIFO"])
    bad["not a GGUF"].write_text("notes")
    (bad["not a qtool output"] / "docs").mkdir(parents=True)
    for d in ok:
        gguf = d.suffix == ".gguf"
        with atomic_output(d, force=True, directory=not gguf) as tmp:
            if gguf:
                tmp.write_bytes(b"GGUF new")
            else:
                (tmp / "new.txt").write_text("new")
    assert (ok[0] / "new.txt").exists() and (ok[1] / "new.txt").exists() and ok[2].read_bytes() == b"GGUF new"
    for why, d in bad.items():
        with pytest.raises(OutputError, match=f"--force replaces only.*{why}"), atomic_output(d, force=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert bad["symbolic link"].is_symlink() and stat.S_ISFIFO(os.lstat(bad["FIFO"]).st_mode)
    assert bad["not a GGUF"].read_text() == "notes" and (bad["not a qtool output"] / "docs").is_dir()
    assert not leftovers(tmp_path / "x")


def test_long_destination_names_and_missing_parents(tmp_path):
    """A 255-byte destination name works (the temporary name beside it is short and fixed); missing parent
    directories are created; a 256-byte name is a one-line usage error before anything is made."""
    from qtool.errors import UsageError

    dest = tmp_path / "a" / "b" / ("n" * 255)
    with atomic_output(dest) as tmp:
        assert len(tmp.name) <= 40
        (tmp / "x.txt").write_text("x")
    assert (dest / "x.txt").read_text() == "x"
    with pytest.raises(UsageError, match="name of 256 bytes"), atomic_output(tmp_path / "c" / ("n" * 256)):
        pass
    assert not (tmp_path / "c").exists()


def test_refuse_overwriting_input_covers_every_file_the_source_resolves_to(tmp_path):
    from safetensors.torch import save_file

    from qtool.io.writer import refuse_overwriting_input

    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.zeros(2)}, src / "model-00001-of-00002.safetensors")
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    save_file({"b": torch.zeros(2)}, elsewhere / "blob")
    (src / "model-00002-of-00002.safetensors").symlink_to(elsewhere / "blob")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    for dest in (src, src / "sub", src / "model-00001-of-00002.safetensors", src / "model.safetensors.index.json",
                 elsewhere, elsewhere / "blob", tmp_path):
        with pytest.raises(OutputError, match="overlaps"):
            refuse_overwriting_input(src, dest)
    refuse_overwriting_input(src, tmp_path / "out")  # a sibling is fine


def test_signal_during_a_heavy_import_is_held_not_lost(tmp_path):
    """A signal that lands while a large package is first imported (the commands import torch after the
    handlers are set) is held to the import's end and raised there: C code that imports a dependency would
    discard the exception (the run went on and published, exit 0), or the package would be left half
    initialised. `swallower` stands for such a package: it catches everything raised inside it."""
    import subprocess
    import sys

    pkg = tmp_path / "swallower"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    for _ in range(10000):\n"
        "        pass\n"
        "except BaseException:\n"
        "    pass  # as C code that imports a dependency does with an exception raised in it\n"
        "import builtins\n"
        "builtins.SWALLOWER_DONE = True  # the whole body ran\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "from qtool import signals\n"
            "def run(held):\n"
            "    if held:\n"
            "        signals.HEAVY = signals.HEAVY | {'swallower'}\n"
            "    signals.install()\n"
            "    try:\n"
            "        import swallower\n"
            "    except signals.Terminated as e:\n"
            "        return f'terminated {e.signum} after the import: {swallower_ready()}'\n"
            "    return 'swallowed'\n"
            "def swallower_ready():\n"
            "    import builtins\n"
            "    return getattr(builtins, 'SWALLOWER_DONE', False)\n"
            "print(run(sys.argv[1] == 'held'))\n")
    out = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60,
                                cwd=REPO).stdout.strip() for mode in ("held", "plain")}
    assert out == {"held": f"terminated {int(signal.SIGTERM)} after the import: True", "plain": "swallowed"}


def test_read_only_file_system_is_an_output_error(tmp_path, monkeypatch):
    """A file output on a read-only file system: writing the temporary file fails with EROFS, and so does
    unlinking the file that was never created (EROFS, not ENOENT); the user gets the output error (exit 2),
    not the cleanup's OSError (exit 3)."""
    import errno
    from pathlib import Path as P

    from qtool.errors import OutputError

    def ro(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))
    monkeypatch.setattr(P, "unlink", ro)
    with pytest.raises(OutputError) as e, atomic_output(tmp_path / "x.gguf", directory=False) as tmp:
        ro(tmp)
    assert e.value.exit_code == 2 and not leftovers(tmp_path / "x.gguf")


def test_a_signal_during_the_publish_stops_the_run_once_it_is_complete_and_says_so(tmp_path, monkeypatch, capsys):
    """A SIGINT that lands mid-publish is held back (signals.deferred) and raised when the renames are done:
    the output is complete, nothing is left beside it, and the CLI's one line names what was written, by this
    command only (a later command of the same process that is interrupted before it writes names nothing)."""
    from qtool import signals
    from qtool.cli import main as cli_main

    real = writer._publish

    def publish_under_a_signal(tmp, dest, force):
        signals._handler(signal.SIGINT, None)  # as the handler sees a signal inside deferred(): held
        real(tmp, dest, force)

    monkeypatch.setattr(writer, "_publish", publish_under_a_signal)
    monkeypatch.setattr(writer, "PUBLISHED", [Path("an-earlier-command's-output")])
    dest = tmp_path / "out"

    def app(**_kw):  # the command: one output, published under a signal
        with atomic_output(dest) as t:
            (t / "a").write_text("x")

    monkeypatch.setattr(cli_main, "app", app)
    monkeypatch.setattr(signals, "install", lambda: None)  # the test process keeps pytest's own handlers
    with pytest.raises(SystemExit) as ex:
        cli_main.main(["pack"])
    assert ex.value.code == 130
    assert (dest / "a").read_text() == "x" and writer.PUBLISHED == [dest] and not leftovers(dest)
    assert capsys.readouterr().err == f"qtool: error: interrupted by SIGINT after writing {dest}; any unfinished " \
                                      "output was removed\n"

    def interrupted_app(**_kw):
        raise signals.Terminated(signal.SIGINT)

    monkeypatch.setattr(cli_main, "app", interrupted_app)
    with pytest.raises(SystemExit):
        cli_main.main(["pack"])
    assert capsys.readouterr().err == "qtool: error: interrupted by SIGINT; any unfinished output was removed\n"
