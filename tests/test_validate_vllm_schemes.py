"""validate's contract rows for the float and int8 layouts (qtool.validate.vllm_schemes): one checkpoint each that
vLLM loads and one it refuses, made by `qtool pack` and, for the broken ones, a config edit or a shape that
breaks vLLM's rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.validate.vllm_schemes import _args, scheme_for
from tests.conftest import write_llama


def cli(*args):
    res = CliRunner().invoke(app, [str(a) for a in args], standalone_mode=False)
    if res.exception is not None:
        raise res.exception
    return res, res.return_value or 0


def contract(d: Path) -> tuple[list[dict], int]:
    res, code = cli("validate", d, "--checks", "contract", "--engine", "qtool", "--target", "cpu", "--json")
    return [c for c in json.loads(res.stdout)["checks"] if "vLLM" in c["detail"]], code


def make_llama(d: Path, kv_rows: int) -> Path:
    """One Llama block: q/o 128x128, k/v kv_rows x 128, gate/up 256x128, down 128x256 (bf16)."""
    g = torch.Generator().manual_seed(0)
    d.mkdir(parents=True)
    shapes = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (kv_rows, 128), "self_attn.v_proj": (kv_rows, 128),
              "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
              "mlp.down_proj": (128, 256)}
    t = {f"model.layers.0.{n}.weight": (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
         for n, s in shapes.items()}
    t["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    write_llama(d, t, "bfloat16")
    return d


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("vllm-schemes")
    return {128: make_llama(root / "kv128", 128), 64: make_llama(root / "kv64", 64)}


def pack(src: Path, out: Path, *args: str) -> Path:
    _, code = cli("pack", src, "-o", out, *args, "-q")
    assert code == 0
    return out


def edit_group(d: Path, **changes) -> None:
    """Change the first config group's weights (keys) or input activations (`acts`, a dict or None)."""
    c = json.loads((d / "config.json").read_text())
    g = next(iter(c["quantization_config"]["config_groups"].values()))
    if "acts" in changes:
        g["input_activations"] = changes.pop("acts")
    g["weights"].update(changes)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("to, scheme", [
    (["--to", "ct_fp8", "--strategy", "channel"], "CompressedTensorsW8A8Fp8"),
    (["--to", "ct_int8"], "CompressedTensorsW8A8Int8 (dynamic per-token activations)"),
    (["--to", "nvfp4"], "CompressedTensorsW4A16Fp4"),
    (["--to", "mxfp4"], "CompressedTensorsW4A16Mxfp4"),
    (["--to", "mxfp8"], "CompressedTensorsW8A8Mxfp8"),
])
def test_qtool_packs_load_as_a_vllm_scheme(dense, tmp_path, to, scheme):
    rows, code = contract(pack(dense[128], tmp_path / "q", *to))
    assert code == 0
    assert [r["status"] for r in rows] == ["pass"] and rows[0]["detail"].endswith(f"loads as {scheme}")


@pytest.mark.parametrize("to, edit, why", [
    # compressed-tensors can write group-wise FP8, vLLM reads tensor, channel or block only
    (["--to", "ct_fp8", "--strategy", "group", "--group-size", "64"], {}, "FP8 weight strategy 'group'"),
    # INT8 weights with per-group scales: vLLM's W8A8 rule reads tensor or channel
    (["--to", "ct_int8"], {"strategy": "group", "group_size": 64}, "INT8 weight strategy 'group'"),
    # INT8 weight-only: no W8A16 int8 scheme
    (["--to", "ct_int8"], {"acts": None}, "INT8 weights need input_activations"),
    # NVFP4 with the wrong group: neither the NVFP4 nor the MXFP4 rule
    (["--to", "nvfp4"], {"group_size": 32}, "no NVFP4 (tensor_group of 16) or MXFP4"),
    # MXFP4 stored asymmetric
    (["--to", "mxfp4"], {"symmetric": False}, "no NVFP4 (tensor_group of 16) or MXFP4"),
    # MXFP8 whose config does not say its scales are E8M0 bytes
    (["--to", "mxfp8"], {"scale_dtype": None}, "load as MXFP8 only with scale_dtype torch.uint8"),
    # MXFP8 codes per group of 64: no MXFP8, and FP8 groups are no W8A8/W8A16 strategy
    (["--to", "mxfp8"], {"group_size": 64}, "FP8 weight strategy 'group'"),
])
def test_groups_vllm_has_no_scheme_for_fail(dense, tmp_path, to, edit, why):
    d = pack(dense[128], tmp_path / "q", *to)
    if edit:
        edit_group(d, **edit)
    rows, code = contract(d)
    assert code == 1
    bad = [r for r in rows if r["status"] == "fail"]
    assert len(bad) == 1 and "No compressed-tensors compatible scheme" in bad[0]["detail"] and why in bad[0]["detail"]


@pytest.mark.parametrize("to", [["--to", "fp8"], ["--to", "ct_fp8", "--block", "128x128"]])
def test_block_scaled_merged_layers(dense, tmp_path, to):
    """k_proj of 64 rows inside qkv_proj with 128-row blocks: vLLM refuses (v_proj, the last part, may be
    ragged); with 128-row k/v it loads."""
    rows, code = contract(pack(dense[128], tmp_path / "good", *to))
    assert code == 0 and any("merged layers hold whole FP8 weight blocks" in r["detail"] for r in rows)
    rows, code = contract(pack(dense[64], tmp_path / "bad", *to))
    bad = [r for r in rows if r["status"] == "fail"]
    assert code == 1 and [r["module"] for r in bad] == ["model.layers.#.self_attn.qkv_proj"]
    assert "k_proj 64 is not a multiple of 128" in bad[0]["detail"] and "v_proj" not in bad[0]["detail"].split(":")[1]


def test_block_scaled_layers_stored_merged_take_their_parts_from_the_config(tmp_path):
    """Phi-3 stores qkv_proj merged: vLLM creates it with the q/k/v row counts of the config, and the same rule
    holds (k of 64 rows in 128-row blocks fails); gate_up_proj splits in halves."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    for kv, name in ((1, "bad"), (2, "good")):  # 2 heads of 64 (q 128); kv heads of 64 rows
        d = tmp_path / f"src-{name}"
        d.mkdir()
        t = {"model.layers.0.self_attn.qkv_proj.weight": torch.randn(128 + 2 * 64 * kv, 128, generator=g),
             "model.layers.0.self_attn.o_proj.weight": torch.randn(128, 128, generator=g),
             "model.layers.0.mlp.gate_up_proj.weight": torch.randn(512, 128, generator=g)}
        save_file({k: (v * 0.02).to(torch.bfloat16) for k, v in t.items()}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({"model_type": "phi3", "torch_dtype": "bfloat16", "hidden_size": 128,
                                                   "num_attention_heads": 2, "num_key_value_heads": kv}))
        rows, code = contract(pack(d, tmp_path / name, "--to", "fp8"))
        bad = [r for r in rows if r["status"] == "fail"]
        if name == "bad":
            assert code == 1 and [r["module"] for r in bad] == ["model.layers.#.self_attn.qkv_proj"]
            assert "k_proj 64 is not a multiple of 128" in bad[0]["detail"]
        else:
            assert code == 0 and any("2 merged layers hold whole FP8 weight blocks" in r["detail"] for r in rows)


def test_scheme_rules_follow_vllms_order_and_defaults():
    fp8 = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    static_group = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": False}
    assert scheme_for(_args(fp8), _args(token), "float-quantized") == "CompressedTensorsW8A8Fp8"
    # static activations must be per tensor for W8A8; the weight-only FP8 scheme takes the rest
    assert scheme_for(_args(fp8), _args(static_group), "float-quantized") == "CompressedTensorsW8A16Fp8"
    # the FP8 rules need an activation-quantization format
    assert scheme_for(_args(fp8), _args(token), "pack-quantized") is None
    # compressed-tensors' defaults: 8-bit int, symmetric, static; no strategy and no group size = tensor
    w = _args({})
    assert (w.num_bits, w.type, w.symmetric, w.dynamic, w.strategy) == (8, "int", True, False, "tensor")
    assert scheme_for(w, _args({"strategy": "tensor"}), "int-quantized") == \
        "CompressedTensorsW8A8Int8 (static activations)"


@pytest.mark.parametrize("to, method", [("modelopt_nvfp4", "modelopt"), ("gptoss_mxfp4", "mxfp4")])
def test_a_config_whose_loader_keys_are_not_recorded_is_not_checked_not_passed(dense, tmp_path, to, method):
    d = pack(dense[128], tmp_path / "q", "--to", to)
    res, _ = cli("validate", d, "--checks", "contract", "--engine", "qtool", "--target", "cpu", "--json")
    rows = [c for c in json.loads(res.stdout)["checks"] if f"quant_method {method}" in c["detail"]]
    assert [r["status"] for r in rows] == ["skip"] and "not checked" in rows[0]["detail"]
