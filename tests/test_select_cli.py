"""`qtool select` through the CLI: JSON schema, exit codes, PATH via inspect (real and fake modules)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import DeviceError, UsageError
from qtool.kernels.devices import profile
from qtool.scheme import QuantScheme
from qtool.select.plan import path_groups, plan_select
from tests.conftest import fixture_path

runner = CliRunner()

LAYER_KEYS = {"name", "in_features", "out_features", "in_features_per_partition", "out_features_per_partition",
              "chosen", "candidates"}
CANDIDATE_KEYS = {"kernel", "ok", "reason", "hint"}


def _check_schema(d: dict) -> None:
    assert {"engine", "device", "tp", "layers"} <= set(d)
    assert isinstance(d["engine"], str) and isinstance(d["device"], str) and isinstance(d["tp"], int)
    for layer in d["layers"]:
        assert LAYER_KEYS <= set(layer)
        for key in ("in_features", "out_features", "in_features_per_partition", "out_features_per_partition"):
            assert isinstance(layer[key], int) and layer[key] > 0
        assert layer["chosen"] is None or isinstance(layer["chosen"], str)
        assert layer["candidates"], layer["name"]
        for c in layer["candidates"]:
            assert CANDIDATE_KEYS <= set(c)
            assert isinstance(c["ok"], bool) and isinstance(c["reason"], str)
            assert c["reason"].startswith(c["kernel"] + ": ")
            assert c["hint"] is None or isinstance(c["hint"], str)
        if layer["chosen"] is not None:
            chosen = next(c for c in layer["candidates"] if c["kernel"] == layer["chosen"])
            assert chosen["ok"]


def test_json_llama3_70b_tp2_vllm_h100():
    r = runner.invoke(app, ["select", "--model", "llama-3-70b", "--format", "gptq", "--bits", "4",
                            "--group-size", "128", "--device", "h100", "--engine", "vllm", "--tp", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    _check_schema(d)
    assert (d["engine"], d["device"], d["tp"]) == ("vllm", "h100", 2)
    down = next(x for x in d["layers"] if x["name"] == "model.layers.#.mlp.down_proj")
    assert (down["in_features"], down["out_features"]) == (28672, 8192)
    assert (down["in_features_per_partition"], down["out_features_per_partition"]) == (14336, 8192)
    assert down["chosen"] == "MacheteLinearKernel" and down["count"] == 80
    o_proj = next(x for x in d["layers"] if x["name"].endswith("o_proj"))
    assert o_proj["in_features_per_partition"] == 4096


def test_group_2048_on_cpu_exits_1_and_lists_every_refusal():
    # standalone_mode=False hands back the command's return value (main() turns it into the exit code)
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--group-size", "2048", "--device", "cpu",
                            "--json"], standalone_mode=False)
    assert r.return_value == 1
    d = json.loads(r.stdout)
    _check_schema(d)
    (layer,) = d["layers"]
    assert layer["chosen"] is None and len(layer["candidates"]) == 14
    assert all("group_size 2048 not in" in c["reason"] for c in layer["candidates"])


def test_exit_code_through_main():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "qtool", "select", "--layer", "4096,4096", "--device", "h100", "-q"]
    assert subprocess.run(cmd + ["--group-size", "2048"], capture_output=True).returncode == 1
    assert subprocess.run(cmd, capture_output=True).returncode == 0


def test_human_output_and_quiet():
    r = runner.invoke(app, ["select", "--layer", "19110,8192,row", "--group-size", "-1", "--device", "h100",
                            "--engine", "vllm", "--tp", "2"])
    assert r.exit_code == 0, r.output
    assert "K_part 9555 % 64 != 0" in r.stdout and "MarlinLinearKernel" in r.stdout and "8192x9600" in r.stdout
    q = runner.invoke(app, ["select", "--layer", "4096,4096", "--device", "h100", "-q"])
    assert q.exit_code == 0 and q.stdout == ""


def test_path_on_the_packed_fixture(tmp_path):
    src = str(fixture_path("gptqmodel-gptq-v1-4bit-g128-sym"))
    r = runner.invoke(app, ["select", src, "--device", "h100", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    _check_schema(d)
    names = {x["name"] for x in d["layers"]}
    assert "encoder.layer.#.attention.self.query" in names
    # truncated fixture rows: out_features 64 is not a multiple of Machete's 128 -> Marlin
    q = next(x for x in d["layers"] if x["name"].endswith("self.query"))
    assert (q["in_features"], q["out_features"]) == (384, 64)
    assert q["chosen"] == "MarlinLinear"
    machete = next(c for c in q["candidates"] if c["kernel"] == "MacheteLinear")
    assert machete["reason"] == "MacheteLinear: N 64 % 128 != 0"


def test_path_with_fake_inspect_modules():
    # The contract select codes against: objects with name/format/bits/group_size/sym/desc_act/in/out.
    mods = [SimpleNamespace(name=f"model.layers.{i}.mlp.down_proj", in_features=28672, out_features=8192,
                            scheme=QuantScheme("gptq", 4, 128, sym=True, desc_act=False)) for i in range(3)]
    mods += [SimpleNamespace(name="model.layers.0.mlp.gate_proj", in_features=8192, out_features=28672,
                             scheme=QuantScheme("awq", 4, 128, sym=False, desc_act=False)),
             SimpleNamespace(name="lm_head", in_features=8192, out_features=128256, scheme=QuantScheme("dense"))]
    groups, notes = path_groups(None, "bf16", modules=mods)
    assert [(g.pattern, g.count, g.layer.parallel) for g in groups] == [
        ("model.layers.#.mlp.down_proj", 3, "row"), ("model.layers.#.mlp.gate_proj", 1, "column")]
    assert any("1 dense module" in n for n in notes)
    rep = plan_select(groups, profile("h100"), "vllm", tp=2)
    down, gate = (r.selection for r in rep.layers)
    assert (down.chosen, down.in_features_per_partition) == ("MacheteLinearKernel", 14336)
    assert (gate.chosen, gate.out_features_per_partition) == ("MacheteLinearKernel", 14336)


def test_usage_and_device_errors():
    r = runner.invoke(app, ["select", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "nothing to select for" in str(r.exception)
    r = runner.invoke(app, ["select", "--model", "llama-3-8b", "--layer", "1,2", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "exactly one of" in str(r.exception)
    r = runner.invoke(app, ["select", "--model", "llama-3-8b", "--device", "h1000"])
    assert isinstance(r.exception, DeviceError) and "did you mean 'h100'" in str(r.exception)
    r = runner.invoke(app, ["select", "--model", "lama-3-8b", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "did you mean 'llama-3-8b'" in str(r.exception)
    r = runner.invoke(app, ["select", "--layer", "4096", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "K,N" in str(r.exception)


@pytest.mark.parametrize("flags, needle", [
    (["--format", "gptq", "--scale", "block"], "--scale block: gptq weights carry one scale per group"),
    (["--format", "awq", "--scale", "tensor"], "--scale tensor: awq weights carry one scale per group"),
    (["--format", "fp8", "--block", "64,64"], "--block applies to --scale block, and the scale here is channel"),
    (["--format", "fp8", "--asym"], "--asym: fp8 codes are floats"),
    (["--format", "nvfp4", "--asym"], "--asym: nvfp4 codes are floats"),
    (["--format", "gptq", "--scale", "channel", "--group-size", "128"], "one scale per channel is --group-size -1"),
    (["--format", "gptq", "--scale", "group", "--group-size", "-1"], "one scale per channel is --group-size -1"),
])
def test_flags_the_format_contradicts_are_refused_not_dropped(flags, needle):
    """An answer for another layer than the one asked about (block scales on GPTQ, an --asym or --block that
    nothing reads) would be untrue: exit 2, naming the flag."""
    for src in (["--layer", "4096,4096"], ["--model", "llama-3-8b"]):
        r = runner.invoke(app, ["select", *src, "--device", "h100", "--engine", "vllm", *flags])
        assert isinstance(r.exception, UsageError) and needle in str(r.exception), (flags, r.output)


def test_flags_the_format_reads_still_work():
    for flags in (["--format", "fp8", "--scale", "block", "--block", "64,64"], ["--format", "int8", "--asym"],
                  ["--format", "gptq", "--scale", "channel", "--group-size", "-1"], ["--format", "ct", "--asym"]):
        r = runner.invoke(app, ["select", "--layer", "4096,4096", "--device", "h100", "--engine", "vllm", *flags])
        assert r.exception is None or isinstance(r.exception, SystemExit), (flags, r.output)


def test_config_file(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: llama-3-8b\ndevice: b200\nengine: vllm\n"
                    "disable: [MarlinLinearKernel, ConchLinearKernel]\n")
    r = runner.invoke(app, ["select", "--config", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    # Machete: not Hopper; Marlin and Conch disabled; Exllama: bf16 model -> Triton W4A16
    assert d["device"] == "b200" and d["disabled"] == ["ConchLinearKernel", "MarlinLinearKernel"]
    assert {x["chosen"] for x in d["layers"]} == {"TritonW4A16LinearKernel"}


def test_tp_splits_attention_by_whole_heads():
    """--model under TP: q/k/v/o per rank as vLLM's QKVParallelLinear cuts them (a key/value head copied to each
    rank where there are fewer than ranks), and a degree that splits a head refuses with that reason."""
    from qtool.select.plan import model_groups

    rep = plan_select(model_groups("llama-3-70b", QuantScheme(format="gptq"), "fp16"), profile("h100"), "vllm", tp=16)
    parts = {r.name.rsplit(".", 1)[-1]: (r.selection.in_features_per_partition,
                                         r.selection.out_features_per_partition) for r in rep.layers}
    assert parts["qkv_proj"] == (8192, 768) and parts["o_proj"] == (512, 8192)
    rep = plan_select(model_groups("qwen2.5-7b", QuantScheme(format="gptq"), "fp16"), profile("h100"), "vllm", tp=8)
    qkv = next(r.selection for r in rep.layers if r.name.endswith("qkv_proj"))
    assert qkv.chosen is None and "TP 8 does not divide the 28 attention heads" in qkv.notes


def test_a_checkpoint_under_tp_splits_attention_by_the_heads_its_config_gives(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 64, "num_key_value_heads": 8,
                                                      "hidden_size": 8192}))
    q4 = QuantScheme("gptq", 4, 128, sym=True, desc_act=False)
    shapes = {"q_proj": (8192, 8192), "k_proj": (8192, 1024), "v_proj": (8192, 1024), "o_proj": (8192, 8192)}
    mods = [SimpleNamespace(name=f"model.layers.0.self_attn.{n}", in_features=k, out_features=o, scheme=q4)
            for n, (k, o) in shapes.items()]
    groups, _ = path_groups(tmp_path, "bf16", modules=mods)
    rep = plan_select(groups, profile("h100"), "vllm", tp=16)
    parts = {r.name.rsplit(".", 1)[-1]: (r.selection.in_features_per_partition,
                                         r.selection.out_features_per_partition) for r in rep.layers}
    assert parts == {"qkv_proj": (8192, 512 + 2 * 128), "o_proj": (512, 8192)}
    # without a config the widths split evenly, as before
    groups, _ = path_groups(None, "bf16", modules=mods)
    qkv = plan_select(groups, profile("h100"), "vllm", tp=16).layers[0].selection
    assert qkv.out_features_per_partition == (8192 + 2 * 1024) // 16
