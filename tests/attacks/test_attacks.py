"""Every command that reads a file, run as a separate process over the hostile corpus (generate_corpus.py).

For each (command, case) the outcome must be one of:
- refused: exit 2, exactly one line on stderr (`qtool: error: ...`), naming the offending file (or the input)
  and, where the command reads that layer, the tensor / key / shard at fault; no control characters;
- reported (only commands that describe inputs, i.e. `inspect --strict`): exit 1, nothing on stderr, the
  JSON report holds an error-severity anomaly naming the problem;
and in every case: no traceback, no timeout, peak memory under MAX_RSS_MB with a 4 GiB address-space cap,
the pickle marker never created, and for writing commands (-o DEST, DEST an earlier qtool output holding a
sentinel, which --force may replace) DEST untouched and no temporary leftovers beside it, with --force and without.
The control cases must succeed (and with --force replace DEST by a complete output), so the harness cannot
pass by refusing everything.

Most runs go through the fork server (runner.run_batch: one interpreter imports torch once, then forks a
child per run); a sample run per command (AGREE) is repeated through `python -m qtool` and must give the same
exit code and stderr, and the slow sweep runs the whole corpus that way.

Adding a command is one line in COMMANDS. A failure in code this suite does not own is listed in KNOWN with
its owner; those pairs run in test_known_failure, xfail(strict=True), so a fix turns them into a failure
that says "remove me from KNOWN".
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.attacks.generate_corpus import MARKER, Case, build_corpus
from tests.attacks.runner import REPO, Result, run_batch, run_qtool

MAX_RSS_MB = 1024   # observed: ~180 MB refusing, ~230 MB for the control conversions
TIMEOUT = 30.0      # per run; a correct refusal takes well under a second
KNOWN_TIMEOUT = 2.0  # known hangs are cut short: the check is that they still fail
SENTINEL = "SENTINEL.txt"
SENTINEL_TEXT = "an earlier output that must survive\n"
EARLIER = "model.safetensors"
_META = b'{"__metadata__":{"format":"pt","qtool.version":"0"}}'
EARLIER_BYTES = len(_META).to_bytes(8, "little") + _META
TMP_PREFIX = ".qtool-tmp-"  # qtool.io.writer's temporary outputs beside a destination

ALL_LAYERS = frozenset({"safetensors", "gguf", "checkpoint", "layout", "data", "yaml", "pickle"})


@dataclass(frozen=True)
class Command:
    """How the suite runs one qtool command.

    argv:     input path -> arguments (without --config / -o / --force)
    controls: control cases it must accept (the first is its input for YAML cases)
    reads:    layers of the corpus it parses; inputs of other layers it must refuse as a whole (pack refuses
              any GGUF or already-quantized input), naming the input
    blind:    layers it never looks at by design, so it may succeed on them (select reads headers, not
              tensor data)
    writes:   takes -o DEST and --force
    reports:  may describe a broken input (exit 1 under --strict) instead of refusing it
    path:     takes an input path at all (bench only reads --config)
    warm:     safe to run once in the fork server before forking (no torch arithmetic)
    """

    argv: Callable[[str], list[str]]
    controls: tuple[str, ...] = ()
    reads: frozenset[str] = ALL_LAYERS
    blind: frozenset[str] = frozenset()
    writes: bool = False
    reports: bool = False
    path: bool = True
    warm: bool = False


COMMANDS: dict[str, Command] = {
    "pack": Command(lambda s: ["pack", s, "--group-size", "32"], ("ok_dense",),
                    frozenset({"safetensors", "checkpoint", "yaml", "pickle"}), writes=True),
    # inspect with --deep: the data checks run too; --strict turns error anomalies into exit 1
    "inspect": Command(lambda s: ["inspect", s, "--deep", "--strict", "--json"], ("ok_gptq", "ok_dense", "ok_gguf"),
                       reports=True),
    "repack": Command(lambda s: ["repack", s, "--to", "gptq_v2"], ("ok_gptq", "ok_gguf"), writes=True),
    "select": Command(lambda s: ["select", s, "--device", "h100"], ("ok_gptq", "ok_gguf"),
                      blind=frozenset({"data"}), warm=True),
    "bench": Command(lambda s: ["bench", "--device", "cpu"], (), frozenset({"yaml"}), path=False),
}
AVAILABLE = [name for name in COMMANDS if (REPO / "qtool" / "cli" / f"{name}.py").is_file()]

# (command or "*" for code every command shares, case) -> "owner module: what goes wrong". Checked strictly:
# each entry must still fail (test_known_failure), and is left out of the per-command sweeps.
KNOWN: dict[tuple[str, str], str] = {}


def _known(cmd: str, case: str) -> str | None:
    return KNOWN.get((cmd, case)) or KNOWN.get(("*", case))


# --- running ------------------------------------------------------------------------------------------

@dataclass
class Run:
    cmd: str
    case: Case
    variant: str          # "" (reading commands), "force" or "keep" (no --force)
    argv: list[str]
    dest: Path | None = None
    result: Result | None = None


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, Case]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, {c.name: c for c in build_corpus(root)}


def plan_runs(cmd_name: str, root: Path, cases: dict[str, Case], dests: Path, every_variant: bool,
              only: set[str] | None = None) -> list[Run]:
    """The runs of one command over the corpus. Writing commands get `-o DEST --force` for every case and,
    without --force, the controls and one case per layer (every case when `every_variant`)."""
    cmd = COMMANDS[cmd_name]
    runs = []
    seen_layers: set[str] = set()
    for case in cases.values():
        if only is not None and case.name not in only:
            continue
        if case.valid and case.name not in cmd.controls:
            continue
        if not cmd.path and case.layer != "yaml":
            continue
        src = case.src if case.src is not None else (cmd.controls[0] if cmd.controls else "")
        argv = cmd.argv(str(root / src))
        if case.config:
            argv += ["--config", str(root / case.config)]
        if not cmd.writes:
            runs.append(Run(cmd_name, case, "", argv))
            continue
        variants = ["force"]
        if every_variant or case.valid or case.layer not in seen_layers:
            variants.append("keep")
            seen_layers.add(case.layer)
        for v in variants:
            dest = earlier_output(dests / cmd_name / f"{case.name}-{v}")
            runs.append(Run(cmd_name, case, v, argv + ["-o", str(dest)] + (["--force"] if v == "force" else []),
                            dest))
    return runs


def earlier_output(dest: Path) -> Path:
    """DEST as an earlier qtool output (what --force may replace): a sentinel file and a model.safetensors
    carrying qtool's metadata."""
    dest.mkdir(parents=True)
    (dest / SENTINEL).write_text(SENTINEL_TEXT)
    (dest / EARLIER).write_bytes(EARLIER_BYTES)
    return dest


def warm_argvs(root: Path, names: list[str]) -> list[list[str]]:
    return [COMMANDS[n].argv(str(root / COMMANDS[n].controls[0])) for n in names
            if COMMANDS[n].warm and COMMANDS[n].controls]


def execute(runs: list[Run], root: Path, timeout: float = TIMEOUT) -> None:
    names = sorted({r.cmd for r in runs})
    results = run_batch([r.argv for r in runs], cwd=root, timeout=timeout, marker=root / MARKER,
                        warm=warm_argvs(root, names))
    for r, res in zip(runs, results, strict=True):
        r.result = res


# --- judging ------------------------------------------------------------------------------------------

def problems(run: Run, root: Path) -> list[str]:
    """Everything wrong with one run's outcome; [] when it is what the module docstring promises."""
    cmd, case, r = COMMANDS[run.cmd], run.case, run.result
    assert r is not None
    out: list[str] = []
    if r.timed_out:
        return [f"no answer within {TIMEOUT:.0f} s"]
    if "Traceback" in r.stdout + r.stderr:
        out.append("traceback: " + r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else "traceback")
    if r.marker or (root / MARKER).exists():
        out.append("the pickle marker exists: something unpickled a file")
    if r.maxrss_mb > MAX_RSS_MB:
        out.append(f"peak memory {r.maxrss_mb:.0f} MB > {MAX_RSS_MB} MB")
    lines = r.stderr.splitlines()
    line = lines[0] if lines else ""
    if case.layer in cmd.blind and r.rc == 0:
        return out
    if case.valid and run.variant != "keep":
        if r.rc != 0:
            out.append(f"valid input: exit {r.rc}: {r.stderr.strip()[:300]}")
        elif run.variant == "force":
            out += _replaced(run.dest)
        return out
    if case.valid:  # keep: valid input, existing destination, no --force
        out += _refused(r, lines)
        if str(run.dest) not in line:
            out.append(f"refusal does not name the destination: {line[:300]}")
    elif cmd.reports and r.rc == 1:
        out += _reported(r, case, root)
    else:
        out += _refused(r, lines)
        if not out:
            out += _names(line, case, cmd, run)
    if run.dest is not None:
        out += _untouched(run.dest)
    return out


def _refused(r: Result, lines: list[str]) -> list[str]:
    if r.rc != 2:
        return [f"exit {r.rc}, expected 2; stderr: {r.stderr.strip()[:300]!r}"]
    if len(lines) != 1:
        return [f"{len(lines)} lines on stderr, expected 1: {r.stderr[:400]!r}"]
    if not lines[0].startswith("qtool: error: "):
        return [f"stderr is not a qtool error line: {lines[0][:300]!r}"]
    if not lines[0].isprintable():
        return [f"control characters reach the terminal: {lines[0][:300]!r}"]
    return []


def _names(line: str, case: Case, cmd: Command, run: Run) -> list[str]:
    """The one line names the offending file (or the input), and what is at fault where the command reads
    that layer. Without --force a refusal of the existing destination is a valid answer too."""
    if run.variant == "keep" and str(run.dest) in line and "exists" in line:
        return []
    places = {case.where, case.src} - {None, ""}
    if case.layer not in cmd.reads:
        places = {case.src} if case.src else places
    need = [n for n in case.names] if case.layer in cmd.reads else []
    missing = [] if any(p in line for p in places) else [" or ".join(sorted(places))]
    missing += [n for n in need if n not in line]
    return [f"error does not name {missing}: {line[:300]}"] if missing else []


def _reported(r: Result, case: Case, root: Path) -> list[str]:
    if r.stderr.strip():
        return [f"exit 1 (reported) but stderr is not empty: {r.stderr.strip()[:300]!r}"]
    try:
        report = json.loads(r.stdout)
    except ValueError:
        return [f"exit 1 but stdout is not the JSON report: {r.stdout[:200]!r}"]
    errors = [a for a in report.get("anomalies", []) if a.get("severity") == "error"]
    if not errors:
        return ["exit 1 but no error-severity anomaly in the report"]
    text = json.dumps(errors)
    if case.where == case.src:  # a single-file input: the report itself is about that file
        text += json.dumps(report.get("path"))
    wanted = [Path(case.where).name, *case.names]
    if not any(w in text for w in wanted):
        return [f"no error anomaly names any of {wanted}: {text[:300]}"]
    return []


def _untouched(dest: Path) -> list[str]:
    out = []
    if not dest.is_dir() or sorted(p.name for p in dest.iterdir()) != sorted([SENTINEL, EARLIER]):
        out.append(f"destination changed: {sorted(p.name for p in dest.iterdir()) if dest.is_dir() else 'gone'}")
    elif (dest / SENTINEL).read_text() != SENTINEL_TEXT or (dest / EARLIER).read_bytes() != EARLIER_BYTES:
        out.append("sentinel file changed")
    left = [p.name for p in dest.parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    if left:
        out.append(f"temporary leftovers beside the destination: {left}")
    return out


def _replaced(dest: Path) -> list[str]:
    """With --force on a valid input: DEST is now a complete output (every tensor readable), sentinel gone."""
    from safetensors import safe_open

    if (dest / SENTINEL).exists():
        return ["--force on a valid input left the old destination in place"]
    shards = sorted(dest.glob("*.safetensors"))
    if not shards:
        return [f"no .safetensors in the replaced destination: {sorted(p.name for p in dest.iterdir())}"]
    n = 0
    for s in shards:
        with safe_open(str(s), "pt") as f:
            for k in f.keys():
                n += f.get_tensor(k).numel() > 0
    left = [p.name for p in dest.parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    return ([] if n else ["replaced destination holds no tensors"]) + ([f"leftovers: {left}"] if left else [])


def _report(failures: list[tuple[Run, list[str]]]) -> str:
    return "\n".join(f"{r.cmd} {r.case.name}{'/' + r.variant if r.variant else ''}: {'; '.join(p)}"
                     for r, p in failures)


# --- tests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", AVAILABLE)
def test_command_over_corpus(cmd, corpus, tmp_path):
    """Every case of the corpus through one command (writing commands: with --force for every case, and
    without it for the controls and one case per layer; the slow sweep does every case both ways)."""
    root, cases = corpus
    runs = [r for r in plan_runs(cmd, root, cases, tmp_path, every_variant=False)
            if not _known(cmd, r.case.name)]
    execute(runs, root)
    failures = [(r, p) for r in runs if (p := problems(r, root))]
    assert not failures, f"{len(failures)} of {len(runs)} runs misbehaved:\n{_report(failures)}"
    # The sweep was not vacuous: every hostile case ran and was refused or reported, every control passed.
    hostile = [r for r in runs if not r.case.valid and r.case.layer not in COMMANDS[cmd].blind]
    assert hostile and all(r.result.rc in (1, 2) for r in hostile)
    assert all(r.result.rc == (2 if r.variant == "keep" else 0) for r in runs if r.case.valid)
    # The fork server is a faithful stand-in: one of the same runs through `python -m qtool` in a fresh
    # interpreter gives the same exit code and stderr (and, for pack, the pickle is not executed either).
    agree = next((r for r in runs if r.case.name == AGREE.get(cmd) and r.variant != "keep"), None)
    if agree is not None:
        argv = list(agree.argv)
        if agree.dest is not None:
            fresh = earlier_output(tmp_path / "real" / agree.dest.name)
            argv[argv.index(str(agree.dest))] = str(fresh)
        real = run_qtool(argv, cwd=root, timeout=TIMEOUT)
        assert (real.rc, real.stderr.replace(str(tmp_path / "real"), "D")) == \
            (agree.result.rc, agree.result.stderr.replace(str(tmp_path / cmd), "D")), argv
        assert "Traceback" not in real.stderr and real.maxrss_mb < MAX_RSS_MB + 512
        assert not (root / MARKER).exists()


# One run per command repeated through `python -m qtool` (see test_command_over_corpus).
AGREE = {"pack": "pk_malicious_bin", "inspect": "gg_array_len_beyond_file", "repack": "st_shape_2e60"}


def _known_pairs() -> list:
    pairs = []
    for (cmd, case), why in sorted(KNOWN.items()):
        name = AVAILABLE[0] if cmd == "*" else cmd
        if name in AVAILABLE and (cmd != "*" or COMMANDS[name].path or case.startswith("y_")):
            pairs.append(pytest.param(name, case, marks=pytest.mark.xfail(strict=True, reason=why),
                                      id=f"{cmd}-{case}"))
    return pairs


@pytest.fixture(scope="session")
def known_results(corpus, tmp_path_factory) -> dict[tuple[str, str], Run]:
    root, cases = corpus
    dests = tmp_path_factory.mktemp("known-dests")
    runs = []
    for p in _known_pairs():
        cmd, case = p.values
        runs += [r for r in plan_runs(cmd, root, cases, dests, every_variant=False, only={case})
                 if r.variant != "keep"]
    execute(runs, root, timeout=KNOWN_TIMEOUT)
    return {(r.cmd, r.case.name): r for r in runs}


@pytest.mark.parametrize("cmd,case", _known_pairs())
def test_known_failure(cmd, case, corpus, known_results):
    """A failure owned by another module, listed in KNOWN; passes (and so fails as XPASS) once fixed."""
    root, _ = corpus
    run = known_results[(cmd, case)]
    assert not problems(run, root), _report([(run, problems(run, root))])


@pytest.mark.slow
@pytest.mark.parametrize("cmd", AVAILABLE)
def test_command_over_corpus_python_m_qtool(cmd, corpus, tmp_path):
    """The whole corpus, each case as `python -m qtool` in a fresh interpreter, writing commands with and
    without --force for every case (~100-200 runs per command at ~2 s each)."""
    root, cases = corpus
    runs = [r for r in plan_runs(cmd, root, cases, tmp_path, every_variant=True) if not _known(cmd, r.case.name)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda r: run_qtool(r.argv, cwd=root, timeout=TIMEOUT), runs))
    for r, res in zip(runs, results, strict=True):
        r.result = res
    failures = [(r, p) for r in runs if (p := problems(r, root))]
    assert not failures, f"{len(failures)} of {len(runs)} runs misbehaved:\n{_report(failures)}"


@pytest.mark.slow
def test_generate_corpus_script(tmp_path):
    """`python tests/attacks/generate_corpus.py OUTDIR` writes the same cases build_corpus returns."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, str(REPO / "tests/attacks/generate_corpus.py"), str(tmp_path / "c")],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr
    listed = [line.split()[0] for line in p.stdout.splitlines()[:-1]]
    assert listed == [c.name for c in build_corpus(tmp_path / "again")]
    assert all((tmp_path / "c" / name).is_dir() for name in listed)
    shutil.rmtree(tmp_path / "again")


def test_corpus_pickle_is_live(corpus, tmp_path):
    """Positive control for the marker checks: the corpus pickle does run code when unpickled (here, on
    purpose), so "the marker never appeared" above means that nothing unpickled it."""
    import pickle

    root, cases = corpus
    blob = (root / cases["pk_malicious_bin"].src).read_bytes()
    marker = root / MARKER
    assert not marker.exists()
    try:
        pickle.loads(blob)  # noqa: S301 - the point of the test
        assert marker.is_dir()
    finally:
        if marker.exists():
            marker.rmdir()
