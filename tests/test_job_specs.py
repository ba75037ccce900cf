"""YAML job specs (`--config job.yaml`) read as a demanding user writes them: every mistake is one line naming
the file, the line and the key, with a fix (exit 2); nothing in the file is dropped without a word."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from qtool.cli.common import apply_config
from qtool.errors import SpecError


def _probe_app():
    """A command with one option of every kind a job spec sets; `seen` receives the merged values."""
    app = typer.Typer()
    seen: dict = {}

    @app.command()
    def run(ctx: typer.Context,
            src: Annotated[str, typer.Argument()] = "x",
            bits: int = 4,
            group_size: int = 128,
            damp: float = 0.1,
            device: str | None = typer.Option(None),
            calib: Path | None = typer.Option(None),
            sym: Annotated[bool, typer.Option("--sym/--asym")] = True,
            include: list[str] | None = typer.Option(None),
            quiet: bool = False,
            config: Path | None = typer.Option(None)):
        seen.clear()
        seen.update(apply_config(ctx, config, {k: v for k, v in locals().items() if k != "ctx"}, run))

    return app, seen


def _run(tmp_path: Path, text: str | bytes, *flags: str):
    app, seen = _probe_app()
    cfg = tmp_path / "job.yaml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    return CliRunner().invoke(app, ["--config", str(cfg), *flags]), seen, cfg


def _refused(tmp_path: Path, text: str | bytes, *flags: str) -> str:
    r, _, cfg = _run(tmp_path, text, *flags)
    assert isinstance(r.exception, SpecError), (r.output, r.exception)
    msg = str(r.exception)
    assert str(cfg) in msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("text,key", [
    ("device: null\n", "device"), ("device:\n", "device"), ("bits: ~\n", "bits"), ("sym: null\n", "sym"),
    ("calib: null\n", "calib"), ("damp: null\n", "damp"), ("include: null\n", "include"),
    ("include: [mlp, null]\n", "include' item 2"),
])
def test_null_is_refused_for_every_kind_of_key(tmp_path, text, key):
    """null is one rule for every key (refused, with the fix), never 'got None' in Python's words."""
    msg = _refused(tmp_path, text)
    assert f"key '{key}" in msg and "has no value (null)" in msg and "delete the line" in msg


@pytest.mark.parametrize("text,flags", [
    ("device: null\n", ["--device", "cpu"]),
    ("bits: four\n", ["--bits", "4"]),
    ("sym: maybe\n", ["--asym"]),
])
def test_a_bad_value_is_refused_even_when_its_flag_is_given(tmp_path, text, flags):
    """The flag wins over a good value; a broken file is refused whatever the command line says."""
    msg = _refused(tmp_path, text, *flags)
    assert f"{tmp_path / 'job.yaml'}:1: key '{text.split(':')[0]}'" in msg


def test_an_overridden_key_is_said_on_stderr(tmp_path):
    r, seen, cfg = _run(tmp_path, "bits: 3\ndevice: cpu\n", "--bits", "8", "--device", "cpu")
    assert r.exit_code == 0 and seen["bits"] == 8
    assert r.stderr == f"qtool: note: --bits on the command line (8) overrides key 'bits' (3) of {cfg}:1\n"
    r, _, _ = _run(tmp_path, "bits: 3\n", "--bits", "8", "--quiet")
    assert r.exit_code == 0 and r.stderr == ""


def test_two_spellings_of_one_option_are_refused(tmp_path):
    """PyYAML sees group_size and group-size as two keys; the command has one option: which value was meant?"""
    msg = _refused(tmp_path, "group_size: 32\nbits: 3\ngroup-size: 64\n")
    assert f"{tmp_path / 'job.yaml'}:3: keys 'group_size' and 'group-size' name one option" in msg


@pytest.mark.parametrize("text,said", [
    ("bits: [4]\n", "got a list of 1 item ("),
    ("bits: [4, 5]\n", "got a list of 2 items ("),
    ("bits: {a: 1}\n", "got a mapping of 1 key ("),
    ("bits: true\n", "got true ("),
    ("device: off\n", "got false (quote it"),
    ("include: [a, [b]]\n", "key 'include' item 2 must be a string, got a list of 1 item"),
])
def test_wrong_types_are_said_in_yaml_words(tmp_path, text, said):
    assert said in _refused(tmp_path, text)


@pytest.mark.parametrize("text,fix", [
    ("bitz: 4\n", "did you mean 'bits'?"),
    ("group_sise: 4\n", "did you mean 'group_size'?"),
    ("Bits: 4\n", "write 'bits'"),
    ("asym: true\n", "write sym: false"),
    ("src: model\n", "SRC is given on the command line"),
    ("config: other.yaml\n", "--config is given on the command line"),
])
def test_an_unknown_key_names_what_to_write(tmp_path, text, fix):
    msg = _refused(tmp_path, text)
    assert f":1: unknown key '{text.split(':')[0]}'" in msg and fix in msg


def test_errors_name_the_line(tmp_path):
    assert f"{tmp_path / 'job.yaml'}:3: key 'bits' must be an integer" in _refused(
        tmp_path, "# a job\nsym: true\nbits: four\n")
    assert ":2: invalid YAML: found character '\\t'" in _refused(tmp_path, "bits: 4\n\tsym: true\n")
    assert ":2: job spec is not UTF-8" in _refused(tmp_path, b"bits: 4\ndevice: \xff\n")
    assert ":2: key 1 is not an option name" in _refused(tmp_path, "bits: 4\n1: 2\n")
    # a control character: the reader gives a position, not a mark
    assert ":2: invalid YAML: special characters are not allowed (#x0007)" in _refused(
        tmp_path, "bits: 4\ndevice: a\x07b\n")


@pytest.mark.parametrize("text,key,value", [
    ("seconds: 1e-3\n", "damp", 0.001),       # YAML 1.1 reads 1e-3 as text
    ("seconds: 2\n", "damp", 2.0),            # an integer for a float option is the float, as from the flag
    ("seconds: 1:30\n", "device", "1:30"),    # not 90 (YAML 1.1's base 60)
    ("seconds: 2024-01-01\n", "calib", Path("2024-01-01")),  # not a date
])
def test_numbers_are_decimal_and_text_stays_text(tmp_path, text, key, value):
    r, seen, _ = _run(tmp_path, text.replace("seconds", key))
    assert r.exit_code == 0, r.exception
    assert seen[key] == value and type(seen[key]) is type(value)


@pytest.mark.parametrize("text", ["bits: 010\n", "bits: 0x10\n", "bits: 1:30\n", "bits: 0b11\n"])
def test_octal_hex_and_base_60_are_refused_not_reinterpreted(tmp_path, text):
    """YAML 1.1 reads 010 as 8: a job spec takes decimal numbers, as the command line does."""
    assert "key 'bits' must be an integer" in _refused(tmp_path, text)


@pytest.mark.parametrize("text,said", [
    ("damp: 1" + "0" * 400 + "\n", "key 'damp' is out of range"),  # float(int) overflows: was exit 3
    ("calib: \"a\\0b\"\n", "key 'calib' holds a NUL character"),    # open() raises ValueError: was exit 3
    ("device: \"cpu\\0\"\n", "key 'device' holds a NUL character"),
    ("calib: ''\n", "key 'calib' is an empty path"),                 # Path('') is '.'
    ("include: []\n", "key 'include' is an empty list"),             # [] read as "not given"
])
def test_values_no_command_line_can_give_are_refused(tmp_path, text, said):
    assert said in _refused(tmp_path, text)


def test_a_path_from_the_spec_expands_home_as_the_shell_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    r, seen, _ = _run(tmp_path, "calib: ~/calib.txt\n")
    assert r.exit_code == 0 and seen["calib"] == tmp_path / "calib.txt"
    r, seen, _ = _run(tmp_path, "calib: data/calib.txt\n")  # relative: to the current directory, as a flag
    assert r.exit_code == 0 and seen["calib"] == Path("data/calib.txt")


def test_hostile_specs_are_refused_quickly(tmp_path):
    """Work is bounded by the file: a spec over the cap is refused before parsing, deep nesting at the cap."""
    from qtool.spec.job import MAX_SPEC_BYTES, MAX_SPEC_DEPTH

    t0 = time.perf_counter()
    assert "over the 64 KiB limit" in _refused(tmp_path, "quiet: true\n" + "#\n" * MAX_SPEC_BYTES)
    depth = MAX_SPEC_DEPTH + 4
    assert f":1: invalid YAML: values nested more than {MAX_SPEC_DEPTH} levels deep" in _refused(
        tmp_path, "quiet: " + "[" * depth + "]" * depth + "\n")
    assert "values nested" in _refused(tmp_path, "quiet: " + "[" * 30000 + "]" * 30000 + "\n")
    assert time.perf_counter() - t0 < 5


def test_an_unreadable_spec_is_said_as_such(tmp_path):
    """/proc/self/mem is a regular file of size 0 whose read fails: not 'invalid YAML'."""
    mem = Path("/proc/self/mem")
    if not mem.is_file():
        pytest.skip("needs Linux /proc")
    app, _ = _probe_app()
    r = CliRunner().invoke(app, ["--config", str(mem)])
    assert isinstance(r.exception, SpecError) and "cannot read job spec" in str(r.exception)


@pytest.mark.parametrize("argv", [
    ["pack", "missing", "-o", "out"], ["repack", "missing", "--to", "gptq"], ["select", "--layer", "64,64"],
    ["bench", "--device", "cpu"], ["validate", "missing"], ["inspect", "missing"],
    ["eval", "missing", "--reference", "missing"],
])
def test_every_command_refuses_a_broken_spec_in_one_line(tmp_path, capsys, argv):
    from qtool.cli.main import main

    cfg = tmp_path / "job.yaml"
    for text, said in (("quiet: null\n", f"{cfg}:1: key 'quiet' has no value (null)"),
                       ("quiet: false\nquit: true\n", f"{cfg}:2: unknown key 'quit' (did you mean 'quiet'?"),
                       ("quiet: [true]\n", "key 'quiet' must be true or false, got a list of 1 item (")):
        cfg.write_text(text)
        with pytest.raises(SystemExit) as e:
            main([*argv, "--config", str(cfg)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and said in err, err


def test_numbers_after_one_key_as_after_the_flag_are_shown_the_list_form(tmp_path):
    """`--batch-sizes 1 16 256` takes several values after one flag; in YAML that is one string."""
    app = typer.Typer()

    @app.command()
    def run(ctx: typer.Context, batch_sizes: list[int] | None = typer.Option(None),
            config: Path | None = typer.Option(None)):
        apply_config(ctx, config, {"batch_sizes": batch_sizes, "config": config}, run)

    cfg = tmp_path / "job.yaml"
    cfg.write_text("batch_sizes: 1 16 256\n")
    r = CliRunner().invoke(app, ["--config", str(cfg)])
    assert isinstance(r.exception, SpecError)
    assert "must be a list of numbers, got '1 16 256' (write a YAML list: [1, 16, 256])" in str(r.exception)


def test_eval_takes_its_reference_from_the_spec_and_says_when_neither_gives_it(tmp_path, capsys):
    """--reference is required, but a job spec's `reference:` gives it: Click cannot require a flag the spec
    may hold, so eval checks after the merge."""
    from qtool.cli.main import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"reference: {tmp_path / 'dense-missing'}\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path), "--config", str(cfg), "-q"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "dense-missing: " in err and "Missing option" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path), "-q"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "missing --reference" in err and "key 'reference'" in err, err
