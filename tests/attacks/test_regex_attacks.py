"""Regexes from a checkpoint's config (GPTQModel `dynamic` keys, compressed-tensors `re:` targets) against
module names from the same file: a 2 kB checkpoint with `(a+)+$` and a 40-character name of a's would keep
Python's backtracking `re` busy for hours. Every command that reads those regexes must finish at once, in a
fresh interpreter under the memory cap (runner.run_qtool): a supported pattern runs on the linear-time engine,
an unsupported one is refused with exit 2, one line naming the file, the key and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.attacks.runner import run_qtool
from tests.test_inspect import gptq_module

TIMEOUT = 30.0          # a correct run takes a few seconds, most of it importing torch
HOSTILE = "a" * 40 + "!"  # (a+)+$ against it: 2**40 backtracking steps in `re`


def _gptq_checkpoint(root, dynamic: dict) -> str:
    root.mkdir()
    t = {}
    for name in (f"model.layers.0.{HOSTILE}", "model.layers.0.mlp.down_proj"):
        for s, v in gptq_module(64, 128, 4, 32, None, "v1", seed=1).items():
            t[f"{name}.{s}"] = v
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "dynamic": dynamic}
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return str(root)


def _ct_checkpoint(root, target: str) -> str:
    root.mkdir()
    o, i = 64, 128
    t = {f"{HOSTILE}.weight_packed": torch.zeros(o, i * 4 // 32, dtype=torch.int32),
         f"{HOSTILE}.weight_scale": torch.ones(o, i // 32, dtype=torch.float16),
         f"{HOSTILE}.weight_shape": torch.tensor([o, i], dtype=torch.int64)}
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.10.0",
          "config_groups": {"group_0": {"targets": [target], "format": "pack-quantized",
                                        "weights": {"num_bits": 4, "group_size": 32, "symmetric": True,
                                                    "strategy": "group", "type": "int"}}},
          "ignore": [target]}
    (root / "config.json").write_text(json.dumps({"quantization_config": qc}))
    return str(root)


def _finished(r) -> None:
    assert not r.timed_out, f"{r.argv}: still running after {TIMEOUT} s (catastrophic backtracking)"
    assert r.rc in (0, 1, 2), (r.argv, r.rc, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [["inspect", "--strict", "--json"], ["select", "--device", "h100"],
                                  ["repack", "--to", "gptq_v2"]])
def test_catastrophic_dynamic_key_runs_bounded(tmp_path, argv):
    src = _gptq_checkpoint(tmp_path / "m", {"+:(a+)+$": {"bits": 4}, r"-:.*lm_head": {}})
    args = [argv[0], src, *argv[1:]] + (["-o", str(tmp_path / "out")] if argv[0] == "repack" else [])
    r = run_qtool(args, timeout=TIMEOUT)
    _finished(r)
    assert r.rc == 0, (r.rc, r.stderr[-2000:])
    if argv[0] == "inspect":
        mods = {m["name"]: m["format"] for m in json.loads(r.stdout)["modules"]}
        assert mods[f"model.layers.0.{HOSTILE}"] == "gptq"


def test_catastrophic_ct_target_runs_bounded(tmp_path):
    r = run_qtool(["inspect", _ct_checkpoint(tmp_path / "m", "re:(a+)+$"), "--json"], timeout=TIMEOUT)
    _finished(r)
    assert r.rc == 0 and json.loads(r.stdout)["modules"][0]["format"] == "ct", r.stderr[-2000:]


@pytest.mark.parametrize("cmd", ["inspect", "select", "repack"])
def test_unsupported_dynamic_pattern_is_refused(tmp_path, cmd):
    src = _gptq_checkpoint(tmp_path / "m", {r"+:(a+)+\1$": {"bits": 4}})
    args = {"inspect": ["inspect", src], "select": ["select", src, "--device", "h100"],
            "repack": ["repack", src, "--to", "gptq_v2", "-o", str(tmp_path / "out")]}[cmd]
    r = run_qtool(args, timeout=TIMEOUT)
    _finished(r)
    lines = r.stderr.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1, (r.rc, r.stderr)
    assert "config.json: dynamic: regex '(a+)+\\1$' cannot be matched safely: backreferences" in lines[0]
    assert "rewrite the pattern" in lines[0]
    assert not (tmp_path / "out").exists()


def test_unsupported_ct_target_is_refused(tmp_path):
    r = run_qtool(["inspect", _ct_checkpoint(tmp_path / "m", "re:(?<=x)a"), "--strict"], timeout=TIMEOUT)
    _finished(r)
    assert r.rc == 2 and "config.json: compressed-tensors targets/ignore: regex '(?<=x)a'" in r.stderr, r.stderr
