"""fp8 (HF/vLLM), ct_fp8 and ct_int8 (compressed-tensors naive-quantized): foreign fixtures bit for bit,
round trips, the exactness rule between layouts, and qtool's output read back by the foreign code."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qtool.errors import FormatError, NotRepresentable
from qtool.formats import get_format
from qtool.formats.scaled import ScaledPlain, dequantize
from qtool.quant.scaled import quantize_scaled
from qtool.scheme import QuantScheme
from tests.conftest import fixture_path

CT_FIXTURES = {"ct-float/compressed-tensors-fp8": "ct_fp8", "ct-float/compressed-tensors-int8": "ct_int8"}


def modules(tensors: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for k, v in tensors.items():
        mod, _, short = k.rpartition(".")
        out.setdefault(mod, {})[short] = v
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("folder", sorted(CT_FIXTURES))
def test_compressed_tensors_fixtures_decode_bit_for_bit(folder):
    d = fixture_path(folder)
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    ref = load_file(d / "reference.safetensors")
    fmt = get_format(CT_FIXTURES[folder])
    mods = modules(load_file(d / "model.safetensors"))
    assert len(mods) >= 3
    for name, t in mods.items():
        p = fmt.unpack(t, QuantScheme(extra={"quant_config": cfg, "module": name}))
        assert same_bits(dequantize(p), ref[f"{name}.weight"]), name
        # and the layout written back is the bytes read
        again = fmt.pack(p)
        assert set(again) == set(t), name
        for k in t:
            assert same_bits(again[k], t[k]), f"{name}.{k}"


def test_fixture_schemes_are_read_from_their_config_groups():
    d = fixture_path("ct-float/compressed-tensors-fp8")
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]
    mods = modules(load_file(d / "model.safetensors"))
    got = {n: get_format("ct_fp8").unpack(t, QuantScheme(extra={"quant_config": cfg, "module": n}))
           for n, t in mods.items()}
    assert {n: (p.strategy, p.block, p.scale_type, p.meta["act_dynamic"]) for n, p in got.items()} == {
        "layers.0.q_proj": ("tensor", (-1, -1), "bf16", False),
        "layers.0.k_proj": ("channel", (1, -1), "bf16", True),
        "layers.0.v_proj": ("block", (128, 128), "fp32", True),
        "layers.0.o_proj": ("group", (1, 34), "fp16", True),
    }


def test_hf_fp8_layout_and_golden_bytes():
    w = torch.zeros(2, 3)
    w[0, 0], w[1, 2] = 448.0, -1.0
    p = quantize_scaled(w, "e4m3", (128, 128), "fp32")
    t = get_format("fp8").pack(p)
    assert sorted(t) == ["weight", "weight_scale_inv"]
    assert t["weight"].view(torch.uint8).tolist() == [[0x7E, 0, 0], [0, 0, 0xB8]]  # 448, -1.0
    assert t["weight_scale_inv"].dtype == torch.float32 and t["weight_scale_inv"].tolist() == [[1.0]]
    pt = quantize_scaled(w, "e4m3", (-1, -1), "fp32")
    tt = get_format("fp8").pack(pt)
    assert sorted(tt) == ["weight", "weight_scale"] and tt["weight_scale"].shape == ()
    back = get_format("fp8").unpack(tt, QuantScheme())
    assert back.strategy == "tensor" and back.equal(pt)


@pytest.mark.parametrize("fid,element,block,stype", [
    ("fp8", "e4m3", (128, 128), "fp32"), ("fp8", "e4m3", (64, 32), "fp32"), ("fp8", "e4m3", (-1, -1), "fp32"),
    ("ct_fp8", "e4m3", (1, -1), "bf16"), ("ct_fp8", "e4m3", (128, 128), "fp32"), ("ct_fp8", "e4m3", (1, 32), "fp16"),
    ("ct_fp8", "e4m3", (-1, -1), "fp32"), ("ct_int8", "int8", (1, -1), "bf16"), ("ct_int8", "int8", (-1, -1), "fp32"),
])
def test_round_trips(fid, element, block, stype):
    fmt = get_format(fid)
    w = torch.randn(200, 160, dtype=torch.bfloat16)
    p = quantize_scaled(w, element, block, stype, compute=fmt.compute_for(stype))
    t = fmt.pack(p)
    q = fmt.unpack(t, QuantScheme(extra={"quant_config": {"weight_block_size": list(block)}}))
    assert q.equal(p)
    t2 = fmt.pack(q)
    assert all(same_bits(t[k], t2[k]) for k in t)


def test_hf_block_and_ct_block_are_a_rename():
    p = quantize_scaled(torch.randn(300, 260), "e4m3", (128, 128), "fp32")
    hf = get_format("fp8").pack(p)
    ct = get_format("ct_fp8").pack(get_format("ct_fp8").require(get_format("fp8").unpack(hf, QuantScheme())))
    assert same_bits(hf["weight"], ct["weight"]) and same_bits(hf["weight_scale_inv"], ct["weight_scale"])
    back = get_format("fp8").pack(get_format("fp8").require(get_format("ct_fp8").unpack(ct, QuantScheme())))
    assert all(same_bits(hf[k], back[k]) for k in hf)


def test_bf16_scales_widen_exactly_into_hf_fp8():
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    ct = quantize_scaled(w, "e4m3", (128, 128), "bf16", compute="bfloat16", out_dtype="bfloat16")
    hf = get_format("fp8").require(ct)
    assert hf.scale_type == "fp32" and hf.compute == "float32"
    assert same_bits(dequantize(hf), dequantize(ct))  # fp32 product rounded once == bf16 product


def test_refusals_say_why():
    ch = quantize_scaled(torch.randn(8, 16), "e4m3", (1, -1), "fp32")
    assert get_format("fp8").check(ch) == ["fp8 stores tensor or block scales, not channel ones"]
    with pytest.raises(NotRepresentable, match="not channel"):
        get_format("fp8").pack(ch)
    i8 = quantize_scaled(torch.randn(8, 16), "int8", (1, -1), "fp32")
    assert "fp8 stores e4m3 codes, not int8" in get_format("fp8").check(i8)
    assert "ct_fp8 stores e4m3 codes, not int8" in get_format("ct_fp8").check(i8)
    blk = quantize_scaled(torch.randn(8, 16), "int8", (4, 4), "fp32")
    assert any("not block" in r for r in get_format("ct_int8").check(blk))
    # fp32 scales that are no bf16 values cannot be narrowed by a layout that only held bf16 (none here), but a
    # compute change that alters the result is refused
    p = ScaledPlain(torch.ones(1, 1, dtype=torch.float8_e4m3fn), "e4m3", torch.tensor([[1 + 2 ** -10]]), "fp32",
                    (-1, -1), compute="bfloat16", out_dtype="bfloat16")
    assert any("forms the product" in r for r in get_format("fp8").check(p))


def test_unpack_errors_name_the_tensor():
    with pytest.raises(FormatError, match="weight_scale_inv"):
        get_format("fp8").unpack({"weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
                                  "weight_scale_inv": torch.ones(3, 5)}, QuantScheme())
    with pytest.raises(FormatError, match="weight.*int8"):
        get_format("ct_int8").unpack({"weight": torch.zeros(4, 4), "weight_scale": torch.ones(4, 1)}, QuantScheme())


def test_configs_as_engines_read_them():
    p = quantize_scaled(torch.randn(256, 256), "e4m3", (128, 128), "fp32")
    from qtool.formats.scaled_format import module_meta

    cfg = get_format("fp8").quantization_config([("m", QuantScheme(), module_meta(p))], dense=["lm_head"])
    assert cfg == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"],
                   "ignored_layers": ["lm_head"]}
    ct = get_format("ct_fp8").quantization_config([("m", QuantScheme(), module_meta(p))])
    g = ct["config_groups"]["group_0"]
    assert ct["format"] == "float-quantized" and g["format"] == "float-quantized"
    assert g["weights"]["strategy"] == "block" and g["weights"]["block_structure"] == [128, 128]
    assert g["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "actorder": None,
                                      "block_structure": None, "strategy": "group", "group_size": 128,
                                      "dynamic": True, "observer": None}
    i8 = quantize_scaled(torch.randn(8, 16), "int8", (1, -1), "fp32")
    g8 = get_format("ct_int8").quantization_config([("m", QuantScheme(), module_meta(i8))])["config_groups"]["group_0"]
    assert g8["input_activations"]["strategy"] == "token" and g8["input_activations"]["type"] == "int"
    assert g8["weights"]["type"] == "int" and g8["weights"]["strategy"] == "channel"


# --- the foreign code reads qtool's output ---------------------------------------------------------------
def _ct():
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (run this "
                               "file with an environment that has it: pip install compressed-tensors)")


@pytest.mark.parametrize("fid,element,block,stype", [
    ("ct_fp8", "e4m3", (-1, -1), "bf16"), ("ct_fp8", "e4m3", (1, -1), "bf16"), ("ct_fp8", "e4m3", (128, 128), "fp32"),
    ("ct_fp8", "e4m3", (1, 32), "fp16"), ("ct_int8", "int8", (1, -1), "bf16"), ("ct_int8", "int8", (-1, -1), "fp32"),
])
def test_compressed_tensors_decompresses_qtool_output(fid, element, block, stype):
    _ct()
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    fmt = get_format(fid)
    w = torch.randn(130, 160, dtype=torch.bfloat16)
    p = quantize_scaled(w, element, block, stype, compute=fmt.compute_for(stype), out_dtype=fmt.compute_for(stype))
    t = fmt.pack(p)
    from qtool.formats.scaled_format import module_meta

    group = fmt.quantization_config([("m", QuantScheme(), module_meta(p))])["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["m"], weights=group["weights"])
    got = NaiveQuantizationCompressor.decompress(dict(t), scheme)["weight"]
    assert same_bits(got, dequantize(p))


def test_transformers_dequantizes_qtool_hf_fp8():
    pytest.importorskip("transformers", reason="transformers is not installed (an optional extra)")
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    p = quantize_scaled(torch.randn(256, 384), "e4m3", (128, 128), "fp32")
    t = get_format("fp8").pack(p)
    got = Fp8Dequantize(None)._dequantize_one(t["weight"], t["weight_scale_inv"], torch.bfloat16)
    assert same_bits(got, dequantize(p))
