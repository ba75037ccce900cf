"""CLI conventions shared by every command: start-up cost, error lines, exit codes, --config merging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from qtool.cli.common import apply_config
from qtool.cli.main import expand_variadic
from qtool.errors import SpecError
from qtool.report.text import sanitize

REPO = Path(__file__).resolve().parents[1]


def test_cli_load_does_not_import_torch():
    code = "import sys, qtool.cli.main; bad=[m for m in ('torch','triton','numpy','safetensors') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_commands():
    r = subprocess.run([sys.executable, "-m", "qtool", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for cmd in ("pack", "inspect", "repack", "select", "bench"):
        assert cmd in r.stdout


def test_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qtool", "pack", str(tmp_path / "nope.safetensors"), "-o",
                        str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "nope.safetensors" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_expand_variadic():
    assert expand_variadic(["bench", "--batch-sizes", "1", "16", "256", "--json", "x"]) == [
        "bench", "--batch-sizes", "1", "--batch-sizes", "16", "--batch-sizes", "256", "--json", "x"]


def _probe_app():
    app = typer.Typer()
    seen = {}

    @app.command()
    def run(ctx: typer.Context, bits: int = 4, group_size: int = 128, sym: bool = True,
            include: list[str] | None = typer.Option(None), config: Path | None = typer.Option(None)):
        seen.update(apply_config(ctx, config, {"bits": bits, "group_size": group_size, "sym": sym,
                                               "include": include, "config": config}, run))

    return app, seen


def test_config_merge_flags_win(tmp_path):
    app, seen = _probe_app()
    cfg = tmp_path / "job.yaml"
    cfg.write_text("bits: 3\ngroup-size: 64\nsym: false\ninclude: 'mlp'\n")
    r = CliRunner().invoke(app, ["--config", str(cfg), "--bits", "8"])
    assert r.exit_code == 0, r.output
    assert (seen["bits"], seen["group_size"], seen["sym"], seen["include"]) == (8, 64, False, ["mlp"])


@pytest.mark.parametrize("text,msg", [
    ("bitz: 3\n", "unknown key 'bitz'"),
    ("bits: four\n", "key 'bits' must be an integer"),
    ("bits: 3.5\n", "must be an integer"),
    ("sym: 1\n", "must be true or false"),
    ("- a\n- b\n", "must be a mapping"),
    ("bits: [1, 2\n", "invalid YAML"),
    ("bits: 3\nsym: true\nbits: 4\n", "job.yaml:3: invalid YAML: key 'bits' appears twice"),
])
def test_config_errors_name_key_and_file(tmp_path, text, msg):
    app, _ = _probe_app()
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    r = CliRunner().invoke(app, ["--config", str(cfg)])
    assert isinstance(r.exception, SpecError)
    assert msg in str(r.exception) and "job.yaml" in str(r.exception)


def test_a_value_checked_after_the_merge_names_the_config_file(tmp_path, capsys):
    """`--bits 9` from a job spec is refused after the merge: the line says the file set it."""
    from qtool.cli.main import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text("bits: 9\n")
    with pytest.raises(SystemExit) as e:
        main(["pack", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "--config", str(cfg)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "--bits 9 is outside 2..8" in err and f"--bits was set by key 'bits' in {cfg}" in err
    with pytest.raises(SystemExit):  # given on the command line, the flag is the user's own
        main(["pack", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "--bits", "9"])
    assert "set by key" not in capsys.readouterr().err


def test_example_job_specs_are_valid(tmp_path):
    """Every example spec in configs/jobs loads against the command it names."""
    import qtool.cli.main  # noqa: F401  registers commands
    from qtool.cli.app import app

    for spec in sorted((REPO / "configs" / "jobs").glob("*.yaml")):
        cmd = spec.name.split("-")[0]
        r = CliRunner().invoke(app, [cmd, str(tmp_path / "missing"), "--config", str(spec), "--dry-run"])
        # the source is missing, so the command must get past config parsing and fail on the input
        assert "missing" in str(r.exception), (spec.name, r.output, r.exception)


def test_sanitize_strips_control_sequences():
    assert sanitize("evil\x1b[2Jname\x07") == "evil\\x1b[2Jname\\x07"
    assert "\x1b" not in sanitize("\x1b]0;title\x07")


def test_a_value_the_core_refuses_per_module_names_its_config_key(tmp_path, capsys):
    """A group size or --tensor-type rule from a job spec that one module cannot take is refused inside pack's
    plan; the line still says which key of which file set it."""
    from qtool.cli.main import main
    from tests.test_pack import make_model

    make_model(tmp_path / "m")
    for text, key in (("group_size: 96\n", "--group-size was set by key 'group_size'"),
                      ("tensor_type: ['q_proj=4:96']\n", "--tensor-type was set by key 'tensor_type'")):
        cfg = tmp_path / "job.yaml"
        cfg.write_text(text)
        with pytest.raises(SystemExit) as e:
            main(["pack", str(tmp_path / "m"), "-o", str(tmp_path / "o"), "--config", str(cfg)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "does not divide in_features" in err and f"{key} in {cfg}" in err, err
