"""`qtool repack` on the command line: plan output, --dry-run, --json, refusals (exit 2, nothing written),
default destination, --config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import OutputError, UsageError
from qtool.repack.run import Refused
from tests.test_repack import MODULES, decode_all, make_checkpoint


def invoke(*args):
    r = CliRunner().invoke(app, ["repack", *[str(a) for a in args]])
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    make_checkpoint(tmp_path / "m", "gptq", 4, 128, True)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = invoke(tmp_path / "m", "--to", "marlin", "--dry-run")
    assert r.exit_code == 0
    for name in MODULES:
        assert name in r.stdout
    assert "3 modules: 3 exact" in r.stdout and "dry run: nothing written" in r.stdout
    assert str(tmp_path / "m-marlin") in r.stdout.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_json_report_and_default_destination(tmp_path):
    plains = make_checkpoint(tmp_path / "m", "gptq_v2", 4, 64, False)
    r = invoke(tmp_path / "m", "--to", "ct", "--json")
    rep = json.loads(r.stdout)
    assert rep["written"] and rep["counts"]["exact"] == 3 and rep["out"] == str(tmp_path / "m-ct")
    assert {m["module"]: m["kind"] for m in rep["modules"]} == dict.fromkeys(MODULES, "exact")
    got = decode_all(tmp_path / "m-ct")
    assert all(got[n].equal(p) for n, p in plains.items())


def test_refusal_lists_modules_writes_nothing_and_json_says_refused(tmp_path):
    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 128, False)
    with pytest.raises(Refused, match="zero point of 0"):
        invoke(tmp_path / "m", "--to", "gptq", "-o", tmp_path / "out")
    r = CliRunner().invoke(app, ["repack", str(tmp_path / "m"), "--to", "gptq", "-o", str(tmp_path / "out"),
                                 "--json"])
    assert isinstance(r.exception, Refused)
    rep = json.loads(r.stdout)
    assert rep["refused"] and not rep["written"] and rep["counts"]["lossy"] == 3
    assert not (tmp_path / "out").exists()
    r = invoke(tmp_path / "m", "--to", "gptq", "-o", tmp_path / "out", "--allow-lossy", "-q")
    assert r.exit_code == 0 and r.stdout == "" and (tmp_path / "out" / "model.safetensors").is_file()


def test_exit_code_2_and_one_error_line_from_the_real_entry_point(tmp_path):
    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 128, False)
    p = subprocess.run([sys.executable, "-m", "qtool", "repack", str(tmp_path / "m"), "--to", "gptq", "-o",
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2
    err_lines = [ln for ln in p.stderr.splitlines() if ln.startswith("qtool: error:")]
    assert len(err_lines) == 1 and "3 of 3 modules" in err_lines[0] and "--allow-lossy" in err_lines[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


def test_config_file_and_usage_errors(tmp_path):
    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 128, True)
    job = tmp_path / "job.yaml"
    job.write_text("to: awq\nbits: 8\nout: " + str(tmp_path / "o") + "\n")
    with pytest.raises(UsageError, match="awq holds 4-bit"):
        invoke(tmp_path / "m", "--config", job)
    job.write_text("to: ct\nbits: 8\nout: " + str(tmp_path / "o") + "\n")
    rep = json.loads(invoke(tmp_path / "m", "--config", job, "--json").stdout)
    assert all(m["to_bits"] == 8 and m["kind"] == "exact" for m in rep["modules"])
    with pytest.raises(OutputError, match="destination exists"):
        invoke(tmp_path / "m", "--config", job)
    with pytest.raises(UsageError, match="missing --to"):
        invoke(tmp_path / "m")
    with pytest.raises(UsageError, match="--bits/--group-size do not apply"):
        invoke(tmp_path / "m", "--to", "q4_0", "--group-size", "64", "--dry-run")


def test_keep_and_drop_flags_reach_the_plan(tmp_path):
    from tests.test_repack import paro_checkpoint

    paro_checkpoint(tmp_path / "m")
    r = invoke(tmp_path / "m", "--to", "gptq_v2", "-o", tmp_path / "o", "--drop", r"\.(rot|theta)$")
    assert r.exit_code == 0 and "1 dropped" in r.stdout
    assert "dropped (2 tensors" in r.stdout and "q_proj.rot" in r.stdout
    r = invoke(tmp_path / "m", "--to", "gptq_v2", "-o", tmp_path / "k", "--keep", "rot", "--keep", "theta", "--json")
    rep = json.loads(r.stdout)
    assert rep["dropped_tensors"] == [] and rep["counts"]["exact"] == 3


@pytest.mark.parametrize("g", ["0", "-2"])
def test_group_size_zero_or_negative_is_a_usage_error(tmp_path, g):
    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 128, True)
    with pytest.raises(UsageError, match=f"--group-size {g} is not a group size"):
        invoke(tmp_path / "m", "--to", "ct", "--group-size", g, "--dry-run")
