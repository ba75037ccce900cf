"""pack / inspect / repack over NVFP4 and MX, end to end through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qtool.formats import get_format
from qtool.formats.scaled import dequantize
from tests.test_fp8_commands import dense, qtool, tensors  # noqa: F401  (the module-scoped dense model)

SHORTS = {"nvfp4": {"weight_packed", "weight_scale", "weight_global_scale"},
          "modelopt_nvfp4": {"weight", "weight_scale", "weight_scale_2"},
          "mxfp4": {"weight_packed", "weight_scale"}, "mxfp8": {"weight", "weight_scale"},
          "gptoss_mxfp4": {"weight_blocks", "weight_scales"}}
Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("to", sorted(SHORTS))
def test_pack_decode_and_inspect(dense, tmp_path, to):  # noqa: F811
    code, text = qtool("pack", dense, "-o", tmp_path / to, "--to", to, "-q")
    assert code == 0, text
    t = tensors(tmp_path / to)
    assert {k.rpartition(".")[2] for k in t if k.startswith(Q + ".")} == SHORTS[to]
    # nothing silent: embeddings, norm, lm_head and biases are copied byte for byte
    src = load_file(str(dense / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.bias"):
        assert torch.equal(t[k], src[k])
    p = get_format(to).unpack({k.rpartition(".")[2]: v for k, v in t.items() if k.startswith(Q + ".")})
    w = src[f"{Q}.weight"].to(torch.float64)
    err = float((dequantize(p, torch.float64) - w).norm() / w.norm())
    assert err < (0.04 if to == "mxfp8" else 0.16)
    report = json.loads((tmp_path / to / "report.json").read_text())
    assert [r["rel_error"] for r in report["tensors"] if r["module"] == Q] == [pytest.approx(err, rel=1e-6)]
    code, text = qtool("inspect", tmp_path / to, "--deep", "--json")
    assert code == 0, text
    mods = {m["name"]: m for m in json.loads(text)["modules"]}
    assert mods[Q]["format"] == to and mods[Q]["bits"] == (8 if to == "mxfp8" else 4)


def test_pack_nvfp4_then_repack_to_modelopt_and_back_exact(dense, tmp_path):  # noqa: F811
    assert qtool("pack", dense, "-o", tmp_path / "nv", "--to", "nvfp4", "--method", "mse", "-q")[0] == 0
    # qtool's global scales are powers of two: ModelOpt holds them exactly, with no --allow-lossy
    code, text = qtool("repack", tmp_path / "nv", "--to", "modelopt_nvfp4", "-o", tmp_path / "mo", "-q")
    assert code == 0, text
    code, text = qtool("repack", tmp_path / "mo", "--to", "nvfp4", "-o", tmp_path / "back", "-q")
    assert code == 0, text
    a, b = tensors(tmp_path / "nv"), tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_pack_refusals(dense, tmp_path):  # noqa: F811
    for args in (("--to", "nvfp4", "--bits", "8"), ("--to", "mxfp4", "--strategy", "channel"),
                 ("--to", "mxfp8", "--method", "gptq")):
        code, text = qtool("pack", dense, "-o", tmp_path / "x", *args)
        assert code == 2 and "Traceback" not in text and not (tmp_path / "x").exists(), text
    # a block the layout cannot store is refused before any tensor is read, a dry run included
    code, text = qtool("pack", dense, "-o", tmp_path / "x", "--to", "mxfp4", "--strategy", "group", "--group-size", "16",
                       "--dry-run")
    assert code == 2 and "stores scales per 32 inputs" in text, text


def _one_big_weight(d, dtype: torch.dtype, big: float):
    from tests.conftest import write_llama

    d.mkdir()
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    w[0, 0] = big
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    return write_llama(d, {f"{Q}.weight": w.to(dtype), "model.norm.weight": torch.ones(64, dtype=dtype)},
                       names[dtype])


@pytest.mark.parametrize("to", ["mxfp4", "gptoss_mxfp4"])
def test_mx_codes_stay_finite_in_the_model_dtype(tmp_path, to):
    """60000 in fp16: the least exponent that holds it (2^14) rounds it up to the top code, 4 * 2^14 = 65536,
    past fp16; the block takes the exponent below, whose top code clips to 6 * 2^13 = 49152."""
    src = _one_big_weight(tmp_path / "m", torch.float16, 60000.0)
    assert qtool("pack", src, "-o", tmp_path / "p", "--to", to, "-q")[0] == 0
    code, text = qtool("repack", tmp_path / "p", "--to", "dense", "-o", tmp_path / "d", "-q")
    assert code == 0, text
    w = load_file(str(tmp_path / "d" / "model.safetensors"))[f"{Q}.weight"]
    assert w.dtype == torch.float16 and bool(torch.isfinite(w).all()) and float(w[0, 0]) == 49152.0


@pytest.mark.parametrize("to,dtype", [("fp8", torch.bfloat16), ("ct_int8", torch.float32)])
def test_huge_weights_get_their_true_error(tmp_path, to, dtype):
    """The running sums of squares overflow float32 past ~1e19; the error is then measured in float64, not
    reported as NaN (which refused the pack)."""
    src = _one_big_weight(tmp_path / "m", dtype, 1e37)
    code, text = qtool("pack", src, "-o", tmp_path / "p", "--to", to, "-q")
    assert code == 0, text
    err = json.loads((tmp_path / "p" / "report.json").read_text())["tensors"][0]["rel_error"]
    assert 0 <= err < 0.05


def test_nvfp4_activation_scale_reciprocal_is_planned_lossy(dense, tmp_path):  # noqa: F811
    """ModelOpt stores the activation's global scale the other way up: a reciprocal that is not a power of two
    is inexact, so the plan says lossy, as for the weight's global scale."""
    from safetensors.torch import save_file

    assert qtool("pack", dense, "-o", tmp_path / "nv", "--to", "nvfp4", "-q")[0] == 0
    f = tmp_path / "nv" / "model.safetensors"
    t = load_file(str(f))
    for k in [k for k in t if k.endswith(".weight_global_scale")]:
        t[k.replace("weight_global_scale", "input_global_scale")] = torch.tensor([12.071035385131836])
    save_file(t, str(f), metadata={"format": "pt"})
    code, text = qtool("repack", tmp_path / "nv", "--to", "modelopt_nvfp4", "-o", tmp_path / "mo", "--json")
    assert code == 2 and "reciprocal is not exact" in text, text
    code, text = qtool("repack", tmp_path / "nv", "--to", "modelopt_nvfp4", "-o", tmp_path / "mo", "--allow-lossy",
                       "-q")
    assert code == 0, text
