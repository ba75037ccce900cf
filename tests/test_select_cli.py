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
    groups, notes, _ = path_groups(None, "bf16", modules=mods)
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
    (["--format", "fp8", "--bits", "4"], "--bits 4: fp8 has 8-bit codes"),
    (["--format", "int8", "--bits", "4"], "--bits 4: int8 has 8-bit codes"),
    (["--format", "w4a8", "--bits", "8"], "--bits 8: w4a8 has 4-bit codes"),
    (["--format", "gguf:Q4_K", "--bits", "8"], "--bits 8: gguf:Q4_K has 4-bit codes"),
    (["--format", "gguf:Q4_K", "--group-size", "32"], "--group-size 32: gguf:Q4_K has one scale per group of 256"),
    (["--format", "nvfp4", "--group-size", "128"], "--group-size 128: nvfp4 has one scale per group of 16 inputs"),
    (["--format", "mxfp4", "--scale", "channel"], "--scale channel: mxfp4 has one scale per group of 32 inputs"),
    (["--format", "fp8", "--desc-act"], "--desc-act: fp8 has no g_idx"),
])
def test_flags_the_format_contradicts_are_refused_not_dropped(flags, needle):
    """An answer for another layer than the one asked about (block scales on GPTQ, an --asym or --block that
    nothing reads) would be untrue: exit 2, naming the flag."""
    for src in (["--layer", "4096,4096"], ["--model", "llama-3-8b"]):
        r = runner.invoke(app, ["select", *src, "--device", "h100", "--engine", "vllm", *flags])
        assert isinstance(r.exception, UsageError) and needle in str(r.exception), (flags, r.output)


def test_flags_the_format_reads_still_work():
    for flags in (["--format", "fp8", "--scale", "block", "--block", "64,64"], ["--format", "int8", "--asym"],
                  ["--format", "gptq", "--scale", "channel", "--group-size", "-1"], ["--format", "ct", "--asym"],
                  ["--format", "gguf:Q4_K", "--bits", "4"], ["--format", "nvfp4", "--group-size", "16", "--scale",
                                                              "group"], ["--format", "fp8", "--bits", "8"]):
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
    groups, _, _ = path_groups(tmp_path, "bf16", modules=mods)
    rep = plan_select(groups, profile("h100"), "vllm", tp=16)
    parts = {r.name.rsplit(".", 1)[-1]: (r.selection.in_features_per_partition,
                                         r.selection.out_features_per_partition) for r in rep.layers}
    assert parts == {"qkv_proj": (8192, 512 + 2 * 128), "o_proj": (512, 8192)}
    # without a config the widths split evenly, as before
    groups, _, _ = path_groups(None, "bf16", modules=mods)
    qkv = plan_select(groups, profile("h100"), "vllm", tp=16).layers[0].selection
    assert qkv.out_features_per_partition == (8192 + 2 * 1024) // 16


def test_flags_describing_a_layer_are_refused_beside_a_checkpoint():
    """PATH is planned with the quantization it holds: --bits 3 (or --format, --asym, ...) beside it was
    dropped, and the plan shown was for the checkpoint's 4-bit layers, not the one asked about."""
    src = str(fixture_path("gptqmodel-gptq-v1-4bit-g128-sym"))
    for flags, named in ((["--bits", "3"], "--bits"), (["--format", "awq", "--asym"], "--format, --asym"),
                         (["--desc-act", "--group-size", "32"], "--group-size, --desc-act"),
                         (["--format", "fp8", "--scale", "block", "--block", "64,64"], "--format, --scale, --block")):
        r = runner.invoke(app, ["select", src, "--device", "h100", "--json", *flags])
        assert isinstance(r.exception, UsageError) and r.stdout == "", flags
        assert str(r.exception).startswith(f"{named} only apply to --model and --layer"), str(r.exception)
    # what a checkpoint's plan does read: the activations and the batch rows
    r = runner.invoke(app, ["select", src, "--device", "h100", "--dtype", "bf16", "--m", "1,16", "--json"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("flags, needle", [
    (["--layer", "2147483648,4096"], "bad --layer '2147483648,4096'"),
    (["--layer", "4096," + "9" * 400], "with K and N from 1 to 2147483647"),
    (["--layer", "4096,4096", "--m", ""], "bad --m ''"),
    (["--layer", "4096,4096", "--m", "2147483648"], "bad --m '2147483648'"),
    (["--layer", "4096,4096", "--format", "fp8", "--scale", "block", "--block", ""], "bad --block ''"),
])
def test_shapes_and_counts_are_bounded_and_an_empty_value_is_refused(flags, needle):
    """A K of 400 digits was planned (and printed) as if a layer; an empty --m or --block was read as no flag."""
    r = runner.invoke(app, ["select", *flags, "--device", "h100", "--json"])
    assert isinstance(r.exception, UsageError) and needle in str(r.exception), r.output
    assert r.stdout == ""


def test_a_comma_list_to_disable_says_one_kernel_per_flag():
    """VLLM_DISABLED_KERNELS is a comma list; --disable A,B answered "did you mean 'B'?", which drops A."""
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--device", "h100", "--engine", "vllm",
                            "--disable", "MarlinLinearKernel,MacheteLinearKernel"])
    assert isinstance(r.exception, UsageError)
    assert str(r.exception) == ("--disable 'MarlinLinearKernel,MacheteLinearKernel': one kernel per --disable "
                                "(--disable MarlinLinearKernel --disable MacheteLinearKernel)")


def _attention_modules() -> list:
    q4 = QuantScheme("gptq", 4, 128, sym=True, desc_act=False)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 64)}
    return [SimpleNamespace(name=f"model.layers.0.self_attn.{n}", in_features=k, out_features=o, scheme=q4)
            for n, (k, o) in shapes.items()]


@pytest.mark.parametrize("config, needle", [
    ({"num_attention_heads": "2", "head_dim": 32}, "num_attention_heads is \"2\", not a positive integer"),
    ({"num_attention_heads": 2.0, "head_dim": 32}, "num_attention_heads is 2.0, not a positive integer"),
    ({"num_attention_heads": 2, "head_dim": 32.0}, "head_dim is 32.0, not a positive integer"),
    ({"num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": -1}, "num_key_value_heads is -1,"),
    ({"num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": 0}, "num_key_value_heads is 0,"),
    ({"num_attention_heads": True, "head_dim": 32}, "num_attention_heads is true,"),
    ({"text_config": {"num_attention_heads": "x"}}, "text_config.num_attention_heads is \"x\","),
    ({"num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": 3},
     "num_key_value_heads 3 does not divide num_attention_heads 2"),
])
def test_head_counts_config_json_gives_wrongly_are_input_errors(tmp_path, config, needle):
    """The heads decide what TP may split: a count read past (a string, a float, a negative) left the layers to
    split evenly, and TP 4 'passed' for a model of 2 attention heads."""
    from qtool.errors import InputError

    good = {"num_attention_heads": 2, "head_dim": 32, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(good))
    groups, _, _ = path_groups(tmp_path, "bf16", modules=_attention_modules())
    qkv = plan_select(groups, profile("h100"), "vllm", tp=4).layers[0].selection
    assert qkv.chosen is None and "TP 4 does not divide the 2 attention heads" in qkv.notes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        path_groups(tmp_path, "bf16", modules=_attention_modules())
    assert str(e.value).startswith(str(tmp_path / "config.json")) and needle in str(e.value), str(e.value)
    # null is a key not given (transformers' configs write "head_dim": null)
    (tmp_path / "config.json").write_text(json.dumps({**good, "head_dim": None, "hidden_size": 64}))
    assert path_groups(tmp_path, "bf16", modules=_attention_modules())[0]


def test_a_checkpoint_with_two_problems_says_one_more_problem(tmp_path):
    import shutil

    src = fixture_path("gptqmodel-gptq-v1-4bit-g128-sym")
    for name in ("model.safetensors", "config.json"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["select", str(tmp_path), "--device", "h100"])
    assert "config says group_size 7" in str(r.exception) and "(and 1 more problem)" in str(r.exception)
