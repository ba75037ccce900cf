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


def test_weight_files_left_out_are_named(tmp_path):
    """A .safetensors file the model does not include (not model.safetensors, not in an index) and a pickle
    are never copied into an output; pack, repack and repack --to dense each say so."""
    import torch
    from safetensors.torch import save_file

    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 64, False)
    save_file({"x": torch.zeros(2)}, tmp_path / "m" / "adapter_model.safetensors")
    (tmp_path / "m" / "training_args.bin").write_bytes(b"pickle")
    want = {"adapter_model.safetensors: not copied: weights that are not part of the model read (not "
            "model.safetensors, not in the index)", "training_args.bin: not copied: a pickle, never loaded"}
    for to in ("ct", "dense"):
        rep = json.loads(invoke(tmp_path / "m", "--to", to, "-o", tmp_path / to, "--json").stdout)
        assert want <= set(rep["warnings"]), rep["warnings"]
        assert not (tmp_path / to / "adapter_model.safetensors").exists()
        assert not (tmp_path / to / "training_args.bin").exists()
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "dense"), "-o", str(tmp_path / "p"), "--to", "gptq", "-q"])
    assert r.exit_code == 0, r.output
    assert not {w for w in json.loads((tmp_path / "p" / "report.json").read_text())["warnings"]
                if "not copied" in w}  # the dense output carried neither
    save_file({"x": torch.zeros(2)}, tmp_path / "dense" / "extra.safetensors")
    r = CliRunner().invoke(app, ["pack", str(tmp_path / "dense"), "-o", str(tmp_path / "p2"), "--to", "gptq", "-q"])
    assert r.exit_code == 0, r.output
    assert "extra.safetensors: not copied: weights that are not part of the model read (not model.safetensors, " \
           "not in the index)" in json.loads((tmp_path / "p2" / "report.json").read_text())["warnings"]


@pytest.mark.parametrize("to,key", [("gptq_v2", "dynamic"), ("gptq_p", "dynamic"), ("awq", "modules_to_not_convert"),
                                    ("ct", "ignore"), ("marlin", "dynamic")])
def test_linears_kept_dense_stay_excluded(tmp_path, to, key):
    """A linear the pack kept dense (--exclude) is excluded in the repacked config too: loaders would look
    for its packed tensors. The engine contract of the output holds as the source's does."""
    from tests.test_validate import make_dense

    make_dense(tmp_path / "dense")
    src = tmp_path / "src"
    assert CliRunner().invoke(app, ["pack", str(tmp_path / "dense"), "-o", str(src), "--to", "gptq", "--group-size",
                                    "32", "--exclude", r"layers\.0\.mlp", "-q"]).exit_code == 0
    out = tmp_path / to
    invoke(src, "--to", to, "-o", out, "--allow-lossy", "-q")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kept = "model.layers.0.mlp.down_proj"
    assert kept in (list(qc[key]) if key != "dynamic" else [k[3:-1].replace("\\", "") for k in qc[key]]), qc
    target = ["--target", "h100"] if to == "marlin" else []  # gptqmodel's Marlin kernels run on CUDA only
    r = CliRunner().invoke(app, ["validate", str(out), "--checks", "contract", "--device", "cpu", *target, "-q"])
    assert r.exit_code == 0, r.output


def test_one_shard_of_a_sharded_model_is_named(tmp_path):
    from tests.test_validate import make_dense

    make_dense(tmp_path / "dense")
    src = tmp_path / "src"
    assert CliRunner().invoke(app, ["pack", str(tmp_path / "dense"), "-o", str(src), "--to", "gptq", "--group-size",
                                    "32", "--max-shard-size", "20KB", "-q"]).exit_code == 0
    shard = sorted(src.glob("model-*.safetensors"))[0]
    rep = json.loads(invoke(shard, "--to", "gptq_v2", "-o", tmp_path / "one", "--json").stdout)
    assert any(w.startswith(f"{shard.name} is one of the 2 shards model.safetensors.index.json names: only its")
               for w in rep["warnings"]), rep["warnings"]
    rep = json.loads(invoke(src, "--to", "gptq_v2", "-o", tmp_path / "all", "--json").stdout)
    assert not any("is one of the" in w for w in rep["warnings"])
