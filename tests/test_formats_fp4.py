"""NVFP4 / MXFP4 / MXFP8 layouts: decode equals the foreign tools' own dequantizers bit for bit (fixtures in
tests/fixtures/fp4, PROVENANCE.md), round trips, and the exactness rule between ModelOpt and compressed-tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qtool.errors import FormatError, NotRepresentable
from qtool.formats import get_format
from qtool.formats.mxfp import decode_blocks
from qtool.formats.nvfp4 import is_power_of_two
from qtool.formats.scaled import ScaledPlain, dequantize
from tests.conftest import FIXTURES

FP4 = FIXTURES / "fp4"
MODULES = ("encoder.layer.0.attention.self.query", "encoder.layer.0.intermediate.dense",
           "encoder.layer.0.output.dense")


def modules_of(folder: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    t = load_file(str(FP4 / folder / "model.safetensors"))
    ref = load_file(str(FP4 / folder / "reference.safetensors"))
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for name, v in t.items():
        prefix, _, short = name.rpartition(".")
        mods.setdefault(prefix, {})[short] = v
    return mods, ref


def same_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ (0 = bit-identical)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


@pytest.mark.parametrize("folder,fid", [("ct-nvfp4", "nvfp4"), ("ct-mxfp4", "mxfp4"), ("ct-mxfp8", "mxfp8")])
def test_decode_equals_compressed_tensors(folder, fid):
    mods, ref = modules_of(folder)
    fmt = get_format(fid)
    assert sorted(mods) == sorted(MODULES)
    for name, t in mods.items():
        p = fmt.unpack(t)
        w = dequantize(p)
        assert same_bits(w, ref[f"{name}.weight"]) == 0, name
        # and the bytes come back: pack(unpack(b)) == b
        again = fmt.pack(p)
        assert sorted(again) == sorted(t)
        for k in t:
            assert torch.equal(again[k].view(torch.uint8), t[k].view(torch.uint8)), (name, k)


def test_fixtures_hold_the_hazards():
    # row 1's zeroed inputs give all-zero blocks (compressed-tensors stores E4M3's eps 0.125 as their scale,
    # never 0); the 40.0 at [2, 5] is the tensor's amax, so its block gets the largest E4M3 scale, 448
    mods, _ = modules_of("ct-nvfp4")
    t = mods[MODULES[0]]
    s = t["weight_scale"].to(torch.float32)
    assert s[1, :4].tolist() == [0.125] * 4 and int(t["weight_packed"][1, :32].max()) == 0
    assert float(s[2, 0]) == 448.0
    mx, _ = modules_of("ct-mxfp4")
    assert int(mx[MODULES[0]]["weight_scale"][2, 0]) == int(mx[MODULES[0]]["weight_scale"].max())


def test_modelopt_reads_as_compressed_tensors_converter_does():
    mods, ref = modules_of("modelopt-nvfp4")
    ct, _ = modules_of("ct-nvfp4")
    mo, nv = get_format("modelopt_nvfp4"), get_format("nvfp4")
    for name, t in mods.items():
        p = mo.unpack(t)
        assert p.global_op == "mul"
        g = p.global_scale
        assert not is_power_of_two(g)
        # the global scale is no power of two: converting to compressed-tensors is lossy, and says so
        with pytest.raises(NotRepresentable, match="allow-lossy"):
            nv.pack(p)
        out = nv.pack(p, lossy=True)
        # the bytes compressed-tensors' converter keeps are ours too
        assert torch.equal(out["weight_packed"], t["weight"])
        assert torch.equal(out["weight_scale"].view(torch.uint8), t["weight_scale"].view(torch.uint8))
        assert torch.equal(out["weight_global_scale"], 1 / t["weight_scale_2"])
        # ... and decode to the converter + decompress reference bit for bit
        w = dequantize(nv.unpack(out))
        assert same_bits(w, ref[f"{name}.weight"]) == 0, name
        # qtool's ModelOpt decode (multiply by weight_scale_2) is within one bf16 rounding of it
        wm = dequantize(p, torch.float64)
        assert torch.allclose(wm, ref[f"{name}.weight"].to(torch.float64), rtol=2 ** -7, atol=0)
        assert set(ct[name]) >= {"weight_packed", "weight_scale", "weight_global_scale"}


def test_ct_modelopt_exact_for_power_of_two_global():
    mods, _ = modules_of("ct-nvfp4")
    nv, mo = get_format("nvfp4"), get_format("modelopt_nvfp4")
    t = dict(mods[MODULES[0]])
    t["weight_global_scale"] = torch.tensor([64.0])
    p = nv.unpack(t)
    out = mo.pack(p)  # exact: no lossy flag needed
    assert torch.equal(out["weight"], t["weight_packed"])
    assert out["weight_scale_2"].item() == 1 / 64
    q = mo.unpack(out)
    assert torch.equal(dequantize(q, torch.float64), dequantize(p, torch.float64))
    assert same_bits(dequantize(q), dequantize(p)) == 0
    back = nv.pack(q)
    for k in t:
        assert torch.equal(back[k].view(torch.uint8), t[k].view(torch.uint8))


def test_gptoss_blocks_equal_transformers():
    t = load_file(str(FP4 / "gptoss-mxfp4" / "model.safetensors"))
    ref = load_file(str(FP4 / "gptoss-mxfp4" / "reference.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    w = decode_blocks(t[f"{name}_blocks"], t[f"{name}_scales"], torch.bfloat16)
    # transformers returns [E, I, O] (transposed for GptOssExperts); the stored rows are [E, O, I]
    assert same_bits(w.transpose(1, 2).contiguous(), ref[name]) == 0
    # the same bytes are the ct-mxfp4 modules: one decoder, two layouts
    ct, _ = modules_of("ct-mxfp4")
    g = get_format("gptoss_mxfp4")
    for e, mod in enumerate(MODULES[:2]):
        p = get_format("mxfp4").unpack(ct[mod])
        packed = g.pack(p)
        assert torch.equal(packed["weight_blocks"], t[f"{name}_blocks"][e])
        assert torch.equal(packed["weight_scales"], t[f"{name}_scales"][e])
        assert g.unpack(packed).equal(p)


def test_gptoss_experts_refused_with_reason():
    t = load_file(str(FP4 / "gptoss-mxfp4" / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(FormatError, match="MoE experts"):
        get_format("gptoss_mxfp4").unpack({"weight_blocks": t[f"{name}_blocks"],
                                           "weight_scales": t[f"{name}_scales"]})


def test_shape_errors_name_the_tensor():
    with pytest.raises(FormatError, match="weight_scale"):
        get_format("nvfp4").unpack({"weight_packed": torch.zeros(4, 8, dtype=torch.uint8),
                                    "weight_scale": torch.zeros(4, 2).to(torch.float8_e4m3fn),
                                    "weight_global_scale": torch.ones(1)})
    with pytest.raises(FormatError, match="weight_scale"):
        get_format("mxfp4").unpack({"weight_packed": torch.zeros(4, 32, dtype=torch.uint8),
                                    "weight_scale": torch.zeros(4, 3, dtype=torch.uint8)})


def test_check_names_every_mismatch():
    codes = torch.zeros(2, 32, dtype=torch.uint8)
    mx = ScaledPlain(codes, "e2m1", torch.full((2, 1), 127, dtype=torch.uint8), "e8m0", (1, 32))
    why = get_format("nvfp4").check(mx)
    assert any("e4m3 scales" in w for w in why) and any("global scale" in w for w in why)
    assert get_format("mxfp4").check(mx) == []
    assert any("e4m3 codes" in w for w in get_format("mxfp8").check(mx))
