"""The CLI's edges (issue 27): sizes from flags, report files, devices, escaping and a closed stdout.

Every case runs qtool as a separate process under the corpus's memory cap (runner.run_batch / run_qtool):
refusals must be one line on stderr, exit 2, naming the flag and the value and what is allowed; nothing
may exit 3 or print a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.attacks.runner import REPO, Result, child_env, limit_memory, run_batch, run_qtool
from tests.conftest import fixture_path

MAX_RSS_MB = 1024
# A tiny sweep: one small layer, one batch size, one kernel; seconds of work.
TINY = ["bench", "--device", "cpu", "--shapes", "128x64", "--batch-sizes", "1", "--seconds", "0.001",
        "--kernels", "torch-ref", "--quiet"]
HOSTILE = "evil\u202ekey\u2066[red]x[/red]\u200b\u2028|[link](http://evil.example)<b>*_`\x1b[2J"
UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def _refused(r: Result, *words: str) -> None:
    lines = r.stderr.splitlines()
    assert r.rc == 2, (r.argv, r.rc, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), (r.argv, r.stderr[-2000:])
    assert "Traceback" not in r.stdout + r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert r.maxrss_mb < MAX_RSS_MB, (r.argv, r.maxrss_mb)


def _clean(r: Result) -> None:
    assert r.rc == 0, (r.argv, r.rc, r.stderr[-2000:])
    assert "Traceback" not in r.stdout + r.stderr


# --- sizes, counts and devices from flags -----------------------------------------------------------------

FLAG_CASES = [
    (["select", "--model", "llama-3-8b", "--device", "h100", "--bits", "0"], ["--bits 0", "2 to 8"]),
    (["select", "--model", "llama-3-8b", "--device", "h100", "--bits", "-1"], ["--bits -1", "2 to 8"]),
    (["select", "--model", "llama-3-8b", "--device", "h100", "--bits", "64"], ["--bits 64", "2 to 8"]),
    (["select", "--model", "llama-3-8b", "--device", "h100", "--group-size", "0"], ["--group-size 0", "-1 or 1"]),
    (["select", "--layer", "4096,4096", "--device", "h100", "--group-size", "-2"], ["--group-size -2"]),
    (["bench", "--device", "cpu", "--bits", "99"], ["--bits 99", "2, 3, 4, 5, 6, 7, 8"]),
    (["bench", "--device", "tpu:0"], ["--device", "tpu:0", "cpu, cuda or cuda:N"]),
    (["bench", "--device", "cuda:99999999999999999999"], ["--device", "cpu, cuda or cuda:N"]),
    (["bench", "--device", "cpu", "--group-size", "0"], ["--group-size 0"]),
    (["bench", "--device", "cpu", "--seconds", "nan"], ["--seconds nan"]),
    (["bench", "--device", "cpu", "--seconds", "-1"], ["--seconds -1"]),
    (["bench", "--device", "cpu", "--batch-sizes", "0"], ["--batch-sizes 0", "1 to"]),
    (["bench", "--device", "cpu", "--batch-sizes", "99999999999999999999"], ["--batch-sizes 9999", "1 to"]),
    (["bench", "--device", "cpu", "--shapes", "0x64"], ["--shapes 0x64", "1 to"]),
    (["bench", "--device", "cpu", "--shapes", "99999999999x64"], ["--shapes 99999999999x64", "1 to"]),
    # unbounded work: refused before anything is allocated, with the number of bytes it would need
    (["bench", "--device", "cpu", "--batch-sizes", "1000000000"], ["--batch-sizes 1000000000", "needs about",
                                                                   "bytes"]),
    (["bench", "--device", "cpu", "--shapes", "65536x65536"], ["--shapes 65536x65536", "needs about", "bytes"]),
    (["bench", "--device", "cpu", "--shapes", "4096x4096", "--batch-sizes", "16777216"], ["needs about"]),
]


def test_flag_sizes_and_devices_are_refused_in_one_line():
    results = run_batch([argv for argv, _ in FLAG_CASES], timeout=60)
    for (_argv, words), r in zip(FLAG_CASES, results, strict=True):
        _refused(r, *words)
        assert "needs about" not in r.stderr or "more than the" in r.stderr


def test_batch_size_that_is_not_an_integer_is_a_usage_error():
    """`--batch-sizes 1e9` is not an integer: Typer's usage message (exit 2), never a sweep."""
    r = run_batch([["bench", "--device", "cpu", "--batch-sizes", "1e9"]], timeout=60)[0]
    assert r.rc == 2 and "--batch-sizes" in r.stderr and "Traceback" not in r.stderr, r


def test_unbounded_bench_refused_in_a_fresh_interpreter():
    """The same refusal through `python -m qtool` (no fork server), within a second or two of start-up."""
    r = run_qtool(["bench", "--device", "cpu", "--shapes", "65536x65536"], timeout=60)
    _refused(r, "--shapes 65536x65536", "needs about")


# --- report files ------------------------------------------------------------------------------------------

def test_report_flag_naming_a_directory_is_refused_before_the_sweep(tmp_path):
    cases = [[*TINY, flag, str(tmp_path)] for flag in ("--json", "--markdown", "--plot")]
    cases.append([*TINY, "--plot", str(tmp_path / "x.gif")])
    (tmp_path / "afile").write_text("x")
    cases.append([*TINY, "--json", str(tmp_path / "afile" / "r.json")])
    for argv, r in zip(cases, run_batch(cases, timeout=60), strict=True):
        _refused(r, argv[-2], str(tmp_path))
        assert r.seconds < 30


def test_report_files_create_missing_parents(tmp_path):
    plot, js, md = tmp_path / "a" / "b" / "p.png", tmp_path / "j" / "r.json", tmp_path / "m" / "n" / "r.md"
    r = run_batch([[*TINY, "--plot", str(plot), "--json", str(js), "--markdown", str(md)]], timeout=120)[0]
    _clean(r)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(js.read_text())["schema"] == "qtool.bench/1"
    assert "| torch-ref |" in md.read_text()
    leftovers = [p for p in tmp_path.rglob("*") if ".qtool-tmp-" in p.name]
    assert not leftovers


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_report_write_error_names_the_file_and_leaves_the_device():
    before = os.stat("/dev/full")
    r = run_batch([[*TINY, "--markdown", "/dev/full"]], timeout=120)[0]
    _refused(r, "/dev/full", "--markdown", "No space left on device")
    after = os.stat("/dev/full")
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)  # written to, never replaced


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_report_in_an_unwritable_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = run_batch([[*TINY, "--json", str(ro / "r.json")]], timeout=120)[0]
    finally:
        ro.chmod(0o700)
    _refused(r, str(ro / "r.json"), "--json")


# --- escaping ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hostile_checkpoint(tmp_path_factory) -> Path:
    """The GPTQ fixture with one module renamed to carry bidi, zero-width, separator, ANSI, rich and Markdown."""
    from safetensors.torch import load_file, save_file

    src = fixture_path("gptqmodel-gptq-v1-4bit-g128-sym")
    dst = tmp_path_factory.mktemp("hostile") / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    old = "encoder.layer.0.attention.self.key."
    renamed = {(k.replace(old, f"encoder.layer.0.attention.self.{HOSTILE}.") if k.startswith(old) else k): v
               for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "reference.safetensors").unlink(missing_ok=True)
    return dst


def _no_raw_controls(text: str) -> list[str]:
    return sorted({f"U+{ord(c):04X}" for c in text if unicodedata.category(c) in UNSAFE and c != "\n"})


def test_terminal_output_escapes_every_name(hostile_checkpoint):
    argvs = [["inspect", str(hostile_checkpoint), "--tensors"],
             ["inspect", str(hostile_checkpoint), "--deep"],
             ["select", str(hostile_checkpoint), "--device", "h100"]]
    for r in run_batch(argvs, timeout=60):
        assert r.rc in (0, 1), (r.argv, r.rc, r.stderr[-2000:])
        assert "Traceback" not in r.stdout + r.stderr
        assert not _no_raw_controls(r.stdout + r.stderr), (r.argv, _no_raw_controls(r.stdout + r.stderr))
        assert "\\u202e" in r.stdout, r.stdout[-3000:]  # shown, visibly escaped
        assert "[red]x[/red]" in r.stdout  # rich markup printed as text, not applied


def test_pack_markdown_report_escapes_names(tmp_path):
    from safetensors.torch import save_file

    torch = pytest.importorskip("torch")
    src = tmp_path / "dense"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    name = f"model.layers.0.{HOSTILE}.weight"
    save_file({name: torch.randn(64, 128, generator=g).half(),
               "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=g).half()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    out = tmp_path / "out"
    r = run_batch([["pack", str(src), "-o", str(out), "--group-size", "32"]], timeout=120)[0]
    _clean(r)
    assert not _no_raw_controls(r.stdout + r.stderr)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert not _no_raw_controls(md)
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<a " not in html and "<b>" not in html and "<em>" not in html and "<strong>" not in html
    assert "\\[link\\]" in md and "\\u202e" in md


# --- a closed stdout -----------------------------------------------------------------------------------------

def _head_c1(argv: list[str]) -> tuple[int, bytes, str]:
    """`qtool ARGV | head -c1`: read one byte, close the pipe, and let qtool finish."""
    p = subprocess.Popen([sys.executable, "-m", "qtool", *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env({"COLUMNS": "150"}),
                         preexec_fn=limit_memory)
    first = p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode("utf-8", "replace")
    return p.wait(timeout=120), first, err


@pytest.mark.parametrize("extra", [[], ["--json"], ["--tensors"]], ids=["table", "json", "tensors"])
def test_closed_stdout_is_not_a_failed_check(extra):
    src = fixture_path("gptqmodel-gptq-v1-4bit-g128-sym")
    assert run_qtool(["inspect", str(src), "--strict", *extra]).rc == 0  # the check passes on this input
    rc, first, err = _head_c1(["inspect", str(src), "--strict", *extra])
    assert first
    assert (rc, err) == (0, ""), (rc, err)


def test_closed_stdout_keeps_a_failed_checks_status(tmp_path):
    """A closed stdout changes nothing about the status: a failing --strict check still exits 1."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(fixture_path("gptqmodel-gptq-v1-4bit-g128-sym"), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    scales = next(k for k in sorted(tensors) if k.endswith(".scales"))
    tensors[scales][0, 0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    full = run_qtool(["inspect", str(broken), "--strict", "--deep"])
    assert full.rc == 1, (full.rc, full.stderr[-2000:])
    rc, first, err = _head_c1(["inspect", str(broken), "--strict", "--deep"])
    assert first
    assert (rc, err) == (1, ""), (rc, err)
