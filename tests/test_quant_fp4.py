"""NVFP4 / MX quantizers: hand-worked blocks, idempotence, error against an honest bound, mse never worse,
and (when compressed-tensors is installed) qtool's outputs decompress with compressed-tensors to qtool's values."""

from __future__ import annotations

import math

import pytest
import torch

from qtool.errors import InputError, UsageError
from qtool.formats import get_format
from qtool.formats.scaled import dequantize, relative_error
from qtool.quant.fp4 import quantize_for, quantize_mx, quantize_nvfp4


def test_mx_golden_block():
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([6.0, -3.0, 0.5]) * 2.0 ** -3  # amax 0.75 = 6 * 2^-3: exponent -3, nothing clips
    p = quantize_mx(w, "e2m1")
    assert p.scales.tolist() == [[124]]
    assert p.codes[0, :4].tolist() == [7, 13, 1, 0]
    assert torch.equal(dequantize(p, torch.float32), w)
    # 0.76 would clip under the OCP floor rule (4..8 * 2^-3); the amax rule moves to 2^-2
    w[0, 0] = 0.76
    assert quantize_mx(w, "e2m1").scales.tolist() == [[125]]


def test_nvfp4_golden_block():
    w = torch.tensor([[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -6.0, 0.0, 1.0]])
    p = quantize_nvfp4(w)
    # g = 2^floor(log2(448 * 6 / 6)) = 256; block scale e4m3(256 * 6 / 6) = 256; effective scale 1
    assert p.global_scale.tolist() == [256.0]
    assert p.scales.to(torch.float32).tolist() == [[256.0]]
    assert p.codes[0].tolist() == [7, 14, 5, 4, 3, 2, 1, 0, 9, 10, 11, 12, 13, 15, 0, 2]
    assert torch.equal(dequantize(p, torch.float32), w)


@pytest.mark.parametrize("fid", ["mxfp4", "mxfp8"])
def test_mx_idempotent(fid):
    torch.manual_seed(0)
    p = quantize_for(fid, torch.randn(8, 128))
    again = quantize_for(fid, dequantize(p, torch.float32))
    # the values come back; the bytes may not (a block whose max rounded down to 3 * 2^k is 6 * 2^(k-1))
    assert torch.equal(dequantize(again, torch.float32), dequantize(p, torch.float32))


@pytest.mark.parametrize("fid,bound", [("nvfp4", 0.12), ("mxfp4", 0.16), ("mxfp8", 0.04)])
def test_error_and_mse(fid, bound):
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.02
    w[3, 7] = 0.5  # an outlier
    rtn = relative_error(w, quantize_for(fid, w))
    mse = relative_error(w, quantize_for(fid, w, method="mse"))
    assert math.isfinite(rtn) and rtn < bound
    assert mse <= rtn + 1e-12


def test_zero_weight_and_bad_input():
    p = quantize_nvfp4(torch.zeros(2, 32))
    assert p.anomalies() == [] and int(p.codes.max()) == 0
    assert quantize_mx(torch.zeros(2, 32)).scales.tolist() == [[127], [127]]
    w = torch.ones(2, 32)
    w[1, 3] = float("nan")
    with pytest.raises(InputError, match=r"\[1, 3\]"):
        quantize_mx(w, name="x.weight")
    with pytest.raises(UsageError, match="multiple of the 16"):
        quantize_nvfp4(torch.ones(2, 24))


@pytest.mark.parametrize("fid", ["nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4"])
def test_pack_unpack_round_trip(fid):
    torch.manual_seed(2)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    fmt = get_format(fid)
    p = quantize_for(fid, w)
    t = fmt.pack(p)
    q = fmt.unpack(t)
    assert torch.equal(dequantize(q), dequantize(p))
    again = fmt.pack(q)
    assert all(torch.equal(again[k].view(torch.uint8), t[k].view(torch.uint8)) for k in t)


@pytest.mark.parametrize("fid", ["nvfp4", "mxfp4", "mxfp8"])
def test_compressed_tensors_decompresses_our_output(fid):
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed here; run this "
                             "test with an environment that has it: pip install compressed-tensors)")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16

    del ct
    torch.manual_seed(3)
    w = torch.randn(32, 128, dtype=torch.bfloat16)
    w[0, :32] = 0
    comp, preset, bits = {"nvfp4": (NVFP4PackedCompressor, NVFP4A16, None),
                          "mxfp4": (MXFP4PackedCompressor, MXFP4A16, None),
                          "mxfp8": (MXFP8QuantizationCompressor, MXFP4A16, 8)}[fid]
    weights = preset["weights"].model_copy(update={"num_bits": bits} if bits else {})
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    for method in ("rtn", "mse"):
        p = quantize_for(fid, w, method=method)
        theirs = comp.decompress(get_format(fid).pack(p), scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        assert torch.equal(theirs.view(torch.int16), dequantize(p).view(torch.int16))
