"""repack between the NVFP4 layouts (exact where the global scale is a power of two, lossy and said so
otherwise) and to/from the other layouts (requantized, with the error reported)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.errors import QtoolError
from qtool.formats import get_format
from qtool.formats.scaled import dequantize
from qtool.repack.plan import RepackJob
from qtool.repack.run import plan_repack, run_repack
from tests.conftest import FIXTURES

FP4 = FIXTURES / "fp4"
Q = "encoder.layer.0.attention.self.query"


def _ct_nvfp4_pow2(tmp_path):
    """The ct-nvfp4 fixture with power-of-two global scales (qtool's own NVFP4 quantizer writes such)."""
    t = load_file(str(FP4 / "ct-nvfp4" / "model.safetensors"))
    for k in t:
        if k.endswith("weight_global_scale"):
            t[k] = torch.tensor([64.0])
    src = tmp_path / "src"
    src.mkdir()
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text((FP4 / "ct-nvfp4" / "config.json").read_text())
    return src, t


def test_ct_to_modelopt_and_back_is_bit_identical(tmp_path):
    src, t = _ct_nvfp4_pow2(tmp_path)
    _, plan = plan_repack(RepackJob(src=src, to="modelopt_nvfp4", out=tmp_path / "mo"))
    assert {m.kind for m in plan.modules} == {"exact"}
    run_repack(RepackJob(src=src, to="modelopt_nvfp4", out=tmp_path / "mo"))
    mo = load_file(str(tmp_path / "mo" / "model.safetensors"))
    assert torch.equal(mo[f"{Q}.weight"], t[f"{Q}.weight_packed"])
    assert mo[f"{Q}.weight_scale_2"].tolist() == [1 / 64]
    cfg = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["quant_algo"], cfg["group_size"]) == ("modelopt", "NVFP4", 16)
    run_repack(RepackJob(src=tmp_path / "mo", to="nvfp4", out=tmp_path / "back"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(t)
    for k in t:
        assert torch.equal(back[k].view(torch.uint8), t[k].view(torch.uint8)), k


def test_non_power_of_two_global_is_lossy_and_refused_without_the_flag(tmp_path):
    with pytest.raises(QtoolError, match="allow-lossy"):
        run_repack(RepackJob(src=FP4 / "ct-nvfp4", to="modelopt_nvfp4", out=tmp_path / "mo"))
    assert not (tmp_path / "mo").exists()
    rep = run_repack(RepackJob(src=FP4 / "ct-nvfp4", to="modelopt_nvfp4", out=tmp_path / "mo", allow_lossy=True))
    mods = {m.module: m for m in rep.plan.modules}
    assert mods[Q].kind == "lossy" and mods[Q].steps == ["invert global scale"]
    # the conversion is compressed-tensors' converter's: the same bytes, weight_scale_2 = 1 / global scale
    mo = load_file(str(tmp_path / "mo" / "model.safetensors"))
    ct = load_file(str(FP4 / "ct-nvfp4" / "model.safetensors"))
    assert torch.equal(mo[f"{Q}.weight"], ct[f"{Q}.weight_packed"])
    assert torch.equal(mo[f"{Q}.weight_scale_2"], (1 / ct[f"{Q}.weight_global_scale"]).to(torch.float32))
    assert mods[Q].rel_error < 1e-6


def test_float_to_integer_and_back_requantizes(tmp_path):
    rep = run_repack(RepackJob(src=FP4 / "ct-mxfp4", to="gptq_v2", out=tmp_path / "g", allow_lossy=True))
    assert {(m.kind, m.to_bits) for m in rep.plan.modules} == {("lossy", 4)}
    assert all(0 < m.rel_error < 0.2 for m in rep.plan.modules)
    rep = run_repack(RepackJob(src=tmp_path / "g", to="mxfp8", out=tmp_path / "m8", allow_lossy=True))
    assert all(m.kind == "lossy" and m.rel_error < 0.05 for m in rep.plan.modules)
    t = load_file(str(tmp_path / "m8" / "model.safetensors"))
    p = get_format("mxfp8").unpack({"weight": t[f"{Q}.weight"], "weight_scale": t[f"{Q}.weight_scale"]})
    assert torch.isfinite(dequantize(p)).all()


def test_group_size_refused_for_float_targets(tmp_path):
    with pytest.raises(QtoolError, match="--group-size does not apply"):
        plan_repack(RepackJob(src=FP4 / "ct-mxfp4", to="nvfp4", out=tmp_path / "x", group_size=16))
