"""inspect names and decodes the micro-float layouts: ModelOpt NVFP4 is not "dense U8", MXFP8's E8M0 scales
are exponents (not linear values), gpt-oss blocks are MXFP4; --deep reports each anomaly the formats can hold."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.inspect import inspect_path
from tests.conftest import FIXTURES
from tests.test_inspect_layouts import _mods, _sev, _write

FP4 = FIXTURES / "fp4"
MOD = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("folder,fid", [("ct-nvfp4", "nvfp4"), ("ct-mxfp4", "mxfp4"), ("ct-mxfp8", "mxfp8"),
                                        ("modelopt-nvfp4", "modelopt_nvfp4"), ("gptoss-mxfp4", "gptoss_mxfp4")])
def test_fixtures_named_and_decoded(folder, fid):
    r = inspect_path(FP4 / folder, deep=True)
    assert {m.scheme.format for m in r.modules} == {fid}
    assert not _sev(r, "error"), _sev(r, "error")
    ref = load_file(str(FP4 / folder / "reference.safetensors"))
    for m in r.modules:
        w = next(v for k, v in ref.items() if k.startswith(m.name))
        if fid != "gptoss_mxfp4":
            assert (m.in_features, m.out_features) == (w.shape[1], w.shape[0])
        else:  # an [E, O, I] stack (the reference as transformers holds it, [E, I, O]): its E * O rows, and says
            # it is one; E2M1 codes and an E8M0 scale per 32
            assert (m.scheme.extra["experts"], m.in_features, m.out_features) == (w.shape[0], w.shape[1],
                                                                                   w.shape[0] * w.shape[2])
            assert r.bpw == pytest.approx(4 + 8 / 32)
        # the statistics are those of the foreign tool's own dequantized weights
        assert m.stats["absmax"] == pytest.approx(float(w.float().abs().max()), rel=1e-6)
        assert m.stats["mean"] == pytest.approx(float(w.double().mean()), rel=1e-3, abs=1e-7)


def test_modelopt_without_config_is_not_dense(tmp_path):
    t = load_file(str(FP4 / "modelopt-nvfp4" / "model.safetensors"))
    root = _write(tmp_path / "m", {k.replace("encoder.layer.0.output.dense", MOD): v for k, v in t.items()
                                   if "output.dense" in k})
    r = inspect_path(root)
    assert _mods(r)[MOD] == ("modelopt_nvfp4", 4, 16, 1536, 16)


def test_mxfp8_is_not_read_as_fp8(tmp_path):
    t = load_file(str(FP4 / "ct-mxfp8" / "model.safetensors"))
    root = _write(tmp_path / "m", {k.replace("encoder.layer.0.output.dense", MOD): v for k, v in t.items()
                                   if "output.dense" in k})
    r = inspect_path(root, deep=True)
    m = next(m for m in r.modules if m.name == MOD)
    assert (m.scheme.format, m.scheme.bits, m.scheme.group_size) == ("mxfp8", 8, 32)
    ref = load_file(str(FP4 / "ct-mxfp8" / "reference.safetensors"))["encoder.layer.0.output.dense.weight"]
    assert m.stats["absmax"] == pytest.approx(float(ref.float().abs().max()), rel=1e-6)


def _copy(tmp_path, folder):
    dst = tmp_path / folder
    shutil.copytree(FP4 / folder, dst)
    return dst, load_file(str(dst / "model.safetensors"))


def test_deep_reports_e8m0_nan_and_overflow(tmp_path):
    dst, t = _copy(tmp_path, "ct-mxfp8")
    q = "encoder.layer.0.attention.self.query.weight_scale"
    s = t[q].clone()
    s[0, 0] = 0xFF
    s[0, 1] = 254  # 448 * 2^127 is beyond bf16
    t[q] = s
    save_file(t, str(dst / "model.safetensors"))
    errs = " | ".join(_sev(inspect_path(dst, deep=True), "error"))
    assert "0xFF (NaN" in errs and "scale overflow" in errs


def test_deep_reports_zero_global_scale(tmp_path):
    dst, t = _copy(tmp_path, "ct-nvfp4")
    t["encoder.layer.0.attention.self.query.weight_global_scale"] = torch.zeros(1)
    save_file(t, str(dst / "model.safetensors"))
    errs = " | ".join(_sev(inspect_path(dst, deep=True), "error"))
    assert "the global scale is 0.0" in errs


def test_deep_reports_gptoss_nan_scale(tmp_path):
    dst, t = _copy(tmp_path, "gptoss-mxfp4")
    k = "model.layers.0.mlp.experts.down_proj_scales"
    s = t[k].clone()
    s[1, 3, 2] = 0xFF
    t[k] = s
    save_file(t, str(dst / "model.safetensors"))
    errs = " | ".join(_sev(inspect_path(dst, deep=True), "error"))
    assert "0xFF (NaN)" in errs
