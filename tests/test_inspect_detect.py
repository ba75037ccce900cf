"""Format detection as pure functions of {short name: (dtype, shape)} and the config's claims."""

from __future__ import annotations

import pytest

from qtool.formats.detection import Claims, ct_scheme_for
from qtool.formats.gguf_blocks import detect_gguf
from qtool.inspect.detect import (
    collapse_layers,
    detect_module,
    group_modules,
    split_name,
)


def gptq_sigs(i: int, o: int, bits: int, g: int) -> dict:
    ng = i // g if g != -1 else 1
    return {"qweight": ("I32", (i * bits // 32, o)), "qzeros": ("I32", (ng, o * bits // 32)),
            "scales": ("F16", (ng, o)), "g_idx": ("I32", (i,)), "bias": ("F16", (o,))}


def fields(d):
    return (d.format, d.bits, d.group_size, d.sym, d.desc_act, d.in_features, d.out_features)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("g", [32, 128, -1])
def test_gptq_bits_and_group_from_shapes(bits, g):
    d = detect_module("m", gptq_sigs(512, 256, bits, g), None)
    assert fields(d) == ("gptq", bits, g, None, None, 512, 256)
    assert d.n_weights == 512 * 256


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "gptq_p"])
def test_gptq_variant_comes_from_config(fmt):
    c = Claims(format=fmt, bits=4, group_size=128, sym=True, desc_act=False)
    d = detect_module("m", gptq_sigs(256, 64, 4, 128), c)
    assert fields(d) == (fmt, 4, 128, True, False, 256, 64) and d.notes == []


def test_config_and_shapes_disagree():
    c = Claims(format="gptq", bits=3, group_size=64)
    d = detect_module("m", gptq_sigs(256, 64, 4, 128), c)
    msgs = [m for _s, m in d.notes]
    assert "config says 3-bit but the tensor shapes give 4-bit" in msgs
    assert any(m.startswith("config says group_size 64 but the tensors hold 2 groups") for m in msgs)
    assert d.bits == 4 and d.group_size == 128  # the data wins


def test_awq_gemm_vs_gptq():
    t = {"qweight": ("I32", (256, 8)), "qzeros": ("I32", (2, 8)), "scales": ("F16", (2, 64))}
    assert fields(detect_module("m", t, None)) == ("awq", 4, 128, False, False, 256, 64)
    d = detect_module("m", t, Claims(format="gptq", quant_method="gptq"))
    assert d.format == "awq" and d.notes[0][0] == "error" and "fix: quant_method: awq" in d.notes[0][1]
    # and the other way round
    d = detect_module("m", gptq_sigs(256, 64, 4, 128), Claims(format="awq", quant_method="awq"))
    assert d.format == "gptq" and "fix: quant_method: gptq" in d.notes[0][1]


def test_awq_gemv_and_gemv_fast():
    # GEMV: qweight [O, I/8], qzeros [O, W], scales [O, 8W]; I=1024, G=128 -> 8 groups -> W=1
    t = {"qweight": ("I32", (64, 128)), "qzeros": ("I32", (64, 1)), "scales": ("F16", (64, 8))}
    assert fields(detect_module("m", t, Claims(format="awq_gemv"))) == ("awq_gemv", 4, 128, False, False, 1024, 64)
    assert detect_module("m", t, None).format == "awq_gemv"
    # GEMV_FAST: qweight int16 [O/4, I], scales/qzeros fp16 [8W, O]
    t = {"qweight": ("I16", (16, 1024)), "qzeros": ("F16", (8, 64)), "scales": ("F16", (8, 64))}
    assert fields(detect_module("m", t, None)) == ("awq_gemv_fast", 4, 128, False, False, 1024, 64)


def test_marlin_legacy_and_contract():
    # K=256, N=128, 4-bit: B [K/16, N*16/8] = [16, 256]; s [K/128, N]
    t = {"B": ("I32", (16, 256)), "s": ("F16", (2, 128)), "workspace": ("I32", (32,))}
    d = detect_module("m", t, None)
    assert fields(d) == ("marlin", 4, 128, True, False, 256, 128) and d.detail.startswith("legacy")
    t = {"qweight": ("I32", (16, 512)), "scales": ("F16", (1, 128)), "shape": ("I64", (2,))}
    d = detect_module("m", t, Claims(format="marlin", sym=True, desc_act=False))
    assert fields(d) == ("marlin", 8, -1, True, False, 256, 128)
    # padded act-order module: the contract's padding entry gives the true [N, K]
    t = {"qweight": ("I32", (16, 256)), "scales": ("F16", (4, 128)), "qzeros": ("I32", (4, 16)),
         "g_idx": ("I32", (256,)), "perm": ("I32", (256,)), "shape": ("I64", (2,))}
    c = Claims(format="marlin", bits=4, group_size=64, marlin_padding={"m": [100, 250, 128, 256]})
    assert fields(detect_module("m", t, c)) == ("marlin", 4, 64, False, True, 250, 100)


def test_malformed_int16_and_marlin_headers_are_named_not_crashes():
    """Headers the fuzzer found: integer scaled_zeros beside an int16 qweight (neither layout) and a 1-D Marlin
    B; each is an 'unknown' module with the reason, not an exception."""
    t = {"qweight": ("I16", (64, 1024)), "scales": ("F16", (8, 256)), "scaled_zeros": ("I32", (8, 256))}
    d = detect_module("m", t, None)
    assert d.format == "unknown" and "neither AWQ GEMV_FAST" in d.notes[0][1]
    for b, s in (((4096,), (2, 128)), ((16, 256), ())):
        d = detect_module("m", {"B": ("I32", b), "s": ("F16", s)}, None)
        assert d.format == "unknown" and "Marlin B" in d.notes[0][1], (b, s)


def test_compressed_tensors_pack_quantized():
    c = Claims(format="ct", quant_method="compressed-tensors", ct_version="0.18.0",
               ct_groups=[(["Linear"], {"num_bits": 4, "group_size": 128, "symmetric": False,
                                        "strategy": "group"}, "pack-quantized", {})], ct_ignore=["lm_head"])
    t = {"weight_packed": ("I32", (64, 48)), "weight_scale": ("BF16", (64, 3)),
         "weight_zero_point": ("I32", (8, 3)), "weight_shape": ("I64", (2,))}
    assert fields(detect_module("l.q", t, c)) == ("ct", 4, 128, False, False, 384, 64)
    # sym tensors under an asym config
    del t["weight_zero_point"]
    d = detect_module("l.q", t, c)
    assert d.sym is True and ("error", "config says asymmetric but there is no weight_zero_point") in d.notes
    # 3-bit dense packing, act-order map present: I from weight_g_idx
    t = {"weight_packed": ("I32", (64, 36)), "weight_scale": ("F16", (64, 3)), "weight_g_idx": ("I32", (384,)),
         "weight_shape": ("I64", (2,))}
    d = detect_module("l.q", t, Claims(quant_method="compressed-tensors", format="ct"))
    assert fields(d) == ("ct", 3, 128, True, True, 384, 64)
    assert ct_scheme_for(c, "lm_head")[2] is True and ct_scheme_for(c, "l.q")[2] is False


def test_nvfp4_fp8_bnb_dense():
    t = {"weight_packed": ("U8", (64, 192)), "weight_scale": ("F8_E4M3", (64, 24)),
         "weight_global_scale": ("F32", (1,))}
    assert fields(detect_module("m", t, None)) == ("nvfp4", 4, 16, True, False, 384, 64)
    t = {"weight": ("F8_E4M3", (300, 512)), "weight_scale_inv": ("F32", (3, 4))}
    d = detect_module("m", t, Claims(quant_method="fp8", format="fp8", block_size=(128, 128)))
    assert fields(d) == ("fp8", 8, 128, True, False, 512, 300) and d.notes == []
    t = {"weight": ("F8_E4M3", (300, 512)), "weight_scale": ("F32", (300, 1)), "input_scale": ("F32", (1,))}
    assert fields(detect_module("m", t, None)) == ("ct_fp8", 8, -1, True, False, 512, 300)
    t = {"weight": ("U8", (8192, 1)), "weight.absmax": ("F32", (256,)), "weight.quant_map": ("F32", (16,)),
         "weight.quant_state.bitsandbytes__nf4": ("U8", (100,))}
    d = detect_module("m", t, None)
    assert (d.format, d.bits, d.group_size, d.n_weights, d.detail) == ("bnb", 4, 64, 16384, "bitsandbytes nf4")
    t = {"weight": ("I8", (64, 128)), "SCB": ("F32", (64,)), "weight_format": ("U8", (1,))}
    assert fields(detect_module("m", t, None)) == ("bnb", 8, -1, True, False, 128, 64)
    assert fields(detect_module("m", {"weight": ("BF16", (64, 128)), "bias": ("BF16", (64,))}, None)) == \
        ("dense", 16, None, None, None, 128, 64)
    assert detect_module("norm", {"weight": ("F16", (64,))}, None) is None


def test_incomplete_module_is_unknown_with_error():
    d = detect_module("m", {"qzeros": ("I32", (2, 8)), "scales": ("F16", (2, 64))}, None)
    assert d.format == "unknown" and d.notes[0][0] == "error"
    d = detect_module("m", {"qweight": ("I32", (32, 64))}, None)
    assert d.format == "unknown"


def test_names_grouping_and_patterns():
    assert split_name("model.layers.0.mlp.up_proj.weight.absmax") == ("model.layers.0.mlp.up_proj", "weight.absmax")
    assert split_name("model.layers.0.mlp.up_proj.qweight") == ("model.layers.0.mlp.up_proj", "qweight")
    g = group_modules({"a.b.qweight": ("I32", (1, 1)), "a.b.scales": ("F16", (1, 1)), "c": ("F16", (1,))})
    assert g == {"a.b": {"qweight": ("I32", (1, 1)), "scales": ("F16", (1, 1))}, "": {"c": ("F16", (1,))}}
    assert collapse_layers("model.layers.17.mlp.experts.3.down_proj") == "model.layers.#.mlp.experts.#.down_proj"
    assert collapse_layers("blk.0.attn_q") == "blk.#.attn_q"


def test_gguf_types():
    d = detect_gguf((384, 64), "Q4_0", (32, 18))
    assert fields(d) == ("gguf:Q4_0", 4, 32, True, False, 384, 64)
    assert fields(detect_gguf((512, 8), "Q4_K", (256, 144)))[:4] == ("gguf:Q4_K", 4, 256, False)
    assert fields(detect_gguf((512, 8), "Q6_K", (256, 210)))[:4] == ("gguf:Q6_K", 6, 256, True)
    assert fields(detect_gguf((64, 8), "F16", (1, 2)))[:2] == ("dense", 16)
    assert detect_gguf((64,), "F32", (1, 4)) is None


@pytest.mark.parametrize(("fid", "bits", "group", "sym"), [
    ("gptq", 4, 32, True), ("gptq_v2", 3, 32, False), ("gptq_p", 5, 64, False), ("awq", 4, 32, False),
    ("ct", 4, 32, False), ("ct", 3, -1, True), ("marlin", 4, 64, True), ("marlin", 8, -1, True)])
def test_detection_names_what_each_format_packs(fid, bits, group, sym):
    """A format's detector, asked in inspect's order with what a config would claim, recognizes the tensors
    the same format's `pack` writes: its id, bits, group size and shape, with no error."""
    from qtool.formats import get_format
    from qtool.io.writer import st_dtype
    from tests.test_formats_ct import random_plain

    o, i = 128, 256
    packed = get_format(fid).pack(random_plain(0, o, i, bits, group, sym))
    t = {k: (st_dtype(v), tuple(v.shape)) for k, v in packed.items()}
    d = detect_module("model.layers.0.mlp.up_proj", t, Claims(format=fid, bits=bits, group_size=group))
    assert (d.format, d.bits, d.group_size, d.in_features, d.out_features) == (fid, bits, group, i, o)
    assert [m for sev, m in d.notes if sev == "error"] == []
