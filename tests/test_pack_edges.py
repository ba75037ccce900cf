"""`qtool pack` at its edges: numbers a flag gives are bounded before they size work, flags a job does not read
are refused, and a model transformers cannot build is a one-line error (calibration, --eval, `qtool eval`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import InputError, UsageError
from tests.test_pack import load, make_model


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("block", ["128x4294967296", "99999999999999999999x1", "9223372036854775807x128",
                                   "0x128", "128"])
def test_a_block_past_int32_or_not_rows_by_cols_is_refused_before_any_work(tmp_path, block):
    make_model(tmp_path / "src")
    r = run("pack", tmp_path / "src", "-o", tmp_path / "out", "--to", "fp8", "--block", block)
    assert isinstance(r.exception, UsageError) and "is not ROWSxCOLS of 1 to 2147483647" in str(r.exception)
    assert not (tmp_path / "out").exists()


def test_a_block_past_the_weight_is_the_weight_s_extent(tmp_path):
    """One scale a row block for a block wider than the weight: what a block of exactly its width gives, and no
    padding to the block's size (a 2**31-wide block fits in memory)."""
    make_model(tmp_path / "src")
    r = run("pack", tmp_path / "src", "-o", tmp_path / "wide", "--to", "fp8", "--block", "64x2147483647", "-q")
    assert r.exit_code == 0, r.output
    r = run("pack", tmp_path / "src", "-o", tmp_path / "exact", "--to", "fp8", "--block", "64x256", "-q")
    assert r.exit_code == 0, r.output
    wide, _ = load(tmp_path / "wide")
    exact, _ = load(tmp_path / "exact")
    name = "model.layers.0.self_attn.q_proj.weight"  # [128, 256]
    assert torch.equal(wide[name].view(torch.uint8), exact[name].view(torch.uint8))
    assert torch.equal(wide[name + "_scale_inv"], exact[name + "_scale_inv"])
    assert tuple(wide[name + "_scale_inv"].shape) == (2, 1)


@pytest.mark.parametrize("args,needle", [
    (["--method", "gptq", "--calib-samples", "999999999999"], "--calib-samples must be 1 to 65536"),
    (["--method", "gptq", "--calib-seed", "99999999999999999999999"], "--calib-seed 0 to 9223372036854775807"),
    (["--calib-samples", "5"], "--calib-samples applies only to --method gptq or awq"),
    (["--calib-seqlen", "64"], "--calib-seqlen applies only to --method gptq or awq"),
    (["--device", "cpu"], "--device applies only to --method gptq or awq and to --eval"),
    (["--to", "fp8", "--dtype", "garbage"], "--dtype does not apply to --to fp8"),
    (["--to", "nvfp4", "--dtype", "bf16"], "--dtype does not apply to --to nvfp4"),
    (["--to", "fp8", "--calib-samples", "5"], "--calib-samples does not apply to --to fp8"),
    (["--to", "fp8", "--device", "cpu"], "--device does not apply to --to fp8"),
])
def test_flags_out_of_range_or_not_read_are_refused(tmp_path, args, needle):
    make_model(tmp_path / "src")
    r = run("pack", tmp_path / "src", "-o", tmp_path / "out", *args)
    assert isinstance(r.exception, UsageError) and needle in str(r.exception), (r.exception, r.output)
    assert not (tmp_path / "out").exists()


def test_calibration_windows_that_would_not_fit_memory_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    from qtool.quant import calib, hf

    make_model(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 256}))
    monkeypatch.setattr("qtool.io.memory.available_bytes", lambda: (1 << 20, "available (test)"))
    monkeypatch.setattr(hf, "build_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UsageError, match=r"128 calibration windows of 256 tokens hold about .* more than the 0\.0 GiB"):
        calib.calibrate_checkpoint(tmp_path / "src", [], {}, None, n_samples=128, seqlen=256)


def _hf_model(root, **config):
    """A one-layer Llama model with its tokenizer, its config.json then changed by `config` (`_raw`: replaced)."""
    transformers = pytest.importorskip("transformers")
    from tests.test_calib import _tokenizer

    tok = _tokenizer(root)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    if "_raw" in config:
        (root / "config.json").write_text(config["_raw"])
    elif config:
        (root / "config.json").write_text(json.dumps({**json.loads((root / "config.json").read_text()), **config}))
    return root


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "nonexistent_arch"}, "transformers cannot read its config.json"),
    ({"intermediate_size": 96}, "transformers cannot build the model from it"),
    ({"_raw": "{not json"}, "config.json: invalid JSON"),
    ({"_raw": "[1, 2]"}, "config.json is not a JSON object"),
])
def test_a_model_transformers_cannot_build_is_a_one_line_input_error(tmp_path, config, needle):
    from qtool.quant import hf

    src = _hf_model(tmp_path / "m", **config)
    with pytest.raises(InputError) as e:
        hf.build_model(src, "cpu")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_weights_of_another_shape_are_named_not_a_runtime_error(tmp_path):
    from qtool.quant import hf

    src = _hf_model(tmp_path / "m")
    model, _, _ = hf.build_model(src, "cpu")
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    full["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(InputError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' is \[3, 3\] where the "
                                         r"model its config.json describes has \[64, 64\]"):
        hf.build_model(src, "cpu", weights=full)


def test_links_that_lead_to_no_file_are_named_not_a_crash_and_repack_q_still_warns(tmp_path):
    """A partly downloaded snapshot's dangling link, or a loop of links: not copied, each named; -q leaves out the
    report, never what the output leaves out."""
    import subprocess
    import sys

    def links(d):
        (d / "dangling").symlink_to("nonexist")
        (d / "l1").symlink_to("l2")
        (d / "l2").symlink_to("l1")

    make_model(tmp_path / "src")
    links(tmp_path / "src")
    qtool = [sys.executable, "-m", "qtool"]
    for cmd, out in ((["pack", tmp_path / "src", "--group-size", "32"], tmp_path / "q"),
                     (["repack", tmp_path / "q", "--to", "marlin"], tmp_path / "m"),
                     (["repack", tmp_path / "q", "--to", "dense"], tmp_path / "d")):
        r = subprocess.run([*qtool, *map(str, cmd), "-o", str(out), "-q"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        for name, why in (("dangling", "nonexist"), ("l1", "l2"), ("l2", "l1")):
            assert f"warning: {name}: not copied: a symbolic link to {why}, which leads to no file" in r.stderr
            assert not os.path.lexists(out / name)
        if cmd[0] == "pack":
            links(out)  # the repacks below read them


@pytest.mark.parametrize("to, stray", [("gptq", "qweight"), ("awq", "scales"), ("fp8", "weight_scale_inv"),
                                       ("nvfp4", "weight_packed")])
def test_a_source_tensor_named_as_the_layout_writes_is_refused_before_any_work(tmp_path, to, stray):
    from safetensors.torch import load_file, save_file

    t = make_model(tmp_path / "src")
    name = f"model.layers.0.self_attn.q_proj.{stray}"
    save_file({**load_file(str(tmp_path / "src" / "model.safetensors")), name: torch.zeros(4, dtype=torch.int32)},
              str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    assert name not in t
    r = run("pack", tmp_path / "src", "-o", tmp_path / "out", "--to", to, "--dry-run")
    assert isinstance(r.exception, InputError), r.output
    msg = str(r.exception)
    assert f"tensor '{name}': the source holds '{name}' beside the weight it quantizes" in msg, msg
    assert str(tmp_path / "src") in msg and "--exclude" in msg and not (tmp_path / "out").exists()


def _lost_groups(src: torch.Tensor, packed: dict, fmt: str, module: str, bits: int, group: int) -> int:
    """Oracle from the written bytes: groups of `src` holding a nonzero weight whose decoded weights are all 0."""
    from tests.test_pack import decode

    deq = torch.from_numpy(decode(fmt, packed, module, bits, group))
    o, i = src.shape
    held = (src != 0).reshape(o, i // group, group).any(-1)
    return int((held & (deq == 0).reshape(o, i // group, group).all(-1)).sum())


def test_weights_too_small_for_fp16_scales_are_named_with_the_groups_they_lose(tmp_path):
    """An fp32 weight of |w| ~ 1e-8 in some groups: their 8-bit scales underflow fp16, its smallest normal stands
    in, and every code is the zero point. pack writes it as before and says so, once, for that tensor: how many
    groups of how many (the count the written bytes show), the largest |w| among them, and the fix. --dtype bf16
    loses nothing and says nothing; the ordinary weight beside it is never named."""
    from tests.conftest import write_llama

    g = torch.Generator().manual_seed(0)
    t = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 256, generator=g) * 0.02,
         "model.layers.0.mlp.down_proj.weight": torch.randn(64, 256, generator=g) * 0.02}
    down = t["model.layers.0.mlp.down_proj.weight"]
    down[:24, :128] *= 1e-6   # group 0 of rows 0..23
    (tmp_path / "src").mkdir()
    write_llama(tmp_path / "src", t, "float32")
    r = run("pack", tmp_path / "src", "-o", tmp_path / "fp16", "--to", "gptq", "--bits", 8, "--group-size", 128,
            "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    packed, _ = load(tmp_path / "fp16")
    assert _lost_groups(down, packed, "gptq", "model.layers.0.mlp.down_proj", 8, 128) == 24
    assert _lost_groups(t["model.layers.0.self_attn.q_proj.weight"], packed, "gptq",
                        "model.layers.0.self_attn.q_proj", 8, 128) == 0
    named = [w for w in report["warnings"] if "q_proj" in w or "down_proj" in w]
    amax = float(down[:24, :128].abs().max())
    assert named == [f"model.layers.0.mlp.down_proj.weight: every nonzero weight of 24 of 128 groups dequantizes "
                     f"to 0 (largest |w| among them {amax:.3g}): their 8-bit scale underflows fp16, and its smallest "
                     "normal, 6.1e-05, stands in; use --dtype bf16 (bf16 scales have float32's range) or --exclude "
                     "this module"], report["warnings"]
    assert json.loads((tmp_path / "fp16" / "report.json").read_text())["warnings"] == report["warnings"]
    assert "every nonzero weight of 24 of 128 groups" in (tmp_path / "fp16" / "report.md").read_text()

    r = run("pack", tmp_path / "src", "-o", tmp_path / "bf16", "--to", "gptq", "--bits", 8, "--group-size", 128,
            "--dtype", "bf16", "--json")
    report = json.loads(r.stdout)
    packed, _ = load(tmp_path / "bf16")
    assert _lost_groups(down, packed, "gptq", "model.layers.0.mlp.down_proj", 8, 128) == 0
    assert not [w for w in report["warnings"] if "proj" in w], report["warnings"]
    assert max(x["rel_error"] for x in report["tensors"]) < 0.01


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_packs_name_the_groups_an_fp16_scale_zeroes_too(tmp_path, method):
    """GPTQ and AWQ make their own Plains (and AWQ scales the weight first); the check reads what they made."""
    from safetensors.torch import load_file, save_file

    src = _hf_model(tmp_path / "m")
    weights = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] * 1e-7
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = run("pack", src, "-o", tmp_path / "out", "--to", "gptq_v2" if method == "gptq" else "awq", "--bits", 4,
            "--group-size", 32, "--method", method, "--calib-samples", 4, "--calib-seqlen", 16, "--json")
    assert r.exit_code == 0, r.output
    warnings = json.loads(r.stdout)["warnings"]
    packed, _ = load(tmp_path / "out")
    fmt = "gptq_v2" if method == "gptq" else "awq"
    lost = _lost_groups(weights[name], packed, fmt, "model.layers.0.mlp.down_proj", 4, 32)
    o, i = weights[name].shape
    assert lost > 0
    named = [w for w in warnings if w.startswith(name)]
    assert len(named) == 1 and f"every nonzero weight of {lost} of {o * i // 32} groups" in named[0], warnings
    assert not [w for w in warnings if "proj" in w and not w.startswith(name)], warnings


def test_a_warning_is_said_once_on_the_terminal_and_on_stderr_when_the_report_is_not_shown(tmp_path):
    """The shown report prints its warnings; stderr carries them only under -q and --json (whose stdout is the
    report), so a terminal (stdout and stderr together) reads each once."""
    from tests.conftest import write_llama

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 1e-8
    (tmp_path / "src").mkdir()
    write_llama(tmp_path / "src", {"model.layers.0.mlp.down_proj.weight": w}, "float32")
    said = "model.layers.0.mlp.down_proj.weight: every nonzero weight of"
    for flags, where in (((), "output"), (("-q",), "stderr"), (("--json",), "stderr")):
        out = tmp_path / f"out{len(flags)}{flags[:1]}"
        r = run("pack", tmp_path / "src", "-o", out, "--to", "gptq", "--bits", 8, *flags)
        assert r.exit_code == 0, r.output
        assert getattr(r, where).count(said) == 1, (flags, r.output)
        if flags != ("--json",):  # --json's stdout holds the report, warnings included
            assert r.output.count(said) == 1, (flags, r.output)
