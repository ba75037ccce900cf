"""The C++ absmax quantizer (csrc/scaled_quant.cpp via qtool.packing.scaled_quant) gives the torch path's codes
and scales bit for bit: every E4M3 rounding case (ties, subnormals, the carry into the next binade, +-448,
signed zeros), INT8 ties, per-tensor / per-channel / ragged blocks, bf16 / fp16 / fp32 weights, fp32 and bf16
scales; its error sums agree with the torch path's; a NaN weight is refused the same way."""

from __future__ import annotations

import pytest
import torch

from qtool.errors import InputError
from qtool.packing import scaled_quant as sq
from qtool.quant.scaled import quantize_scaled
from tests.conftest import require_extension


@pytest.fixture
def extension(monkeypatch):
    require_extension(monkeypatch, "QTOOL_SCALED_QUANT_EXT", sq)


def _e4m3_values() -> torch.Tensor:
    """Every finite E4M3 value, the midpoints between neighbours (ties), and points just either side."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)].unique()
    mid = (v[1:] + v[:-1]) / 2
    near = torch.cat([mid * (1 + 2 ** -20), mid * (1 - 2 ** -20), mid.nextafter(torch.tensor(0.0))])
    return torch.cat([v, mid, near, -v, -mid, -near, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])


def test_every_e4m3_rounding_case_equals_torchs_cast(extension):
    x = _e4m3_values().clamp(-448, 448)
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).reshape(-1, 64)
    ones = torch.ones(1, 1)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)
    for level in range(sq.isa() + 1):  # every build of the loops this CPU runs
        codes = torch.empty(x.shape, dtype=torch.uint8)
        assert sq.quantize(x, "e4m3", x.shape[0], 64, ones, ones, codes, level=level) is not None
        assert torch.equal(codes, ref), (level, x.reshape(-1)[(codes != ref).reshape(-1)][:8])


def test_int8_rounds_half_to_even_like_torch(extension):
    x = torch.arange(-128.0, 128, 0.25).reshape(-1, 16)  # every half-integer tie, and past +-127
    ones = torch.ones(1, 1)
    for level in range(sq.isa() + 1):
        codes = torch.empty(x.shape, dtype=torch.uint8)
        sq.quantize(x, "int8", x.shape[0], 16, ones, ones, codes, level=level)
        assert torch.equal(codes.view(torch.int8), x.clamp(-127, 127).round().to(torch.int8)), level


@pytest.mark.parametrize("o,i,block", [(300, 520, (128, 128)), (257, 384, (1, -1)), (200, 136, (-1, -1)),
                                       (130, 256, (1, 64)), (64, 200, (32, 48))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("element,scale_type", [("e4m3", "fp32"), ("e4m3", "bf16"), ("int8", "fp32"),
                                                ("int8", "bf16")])
def test_native_quantizer_equals_torch_path(extension, monkeypatch, o, i, block, dtype, element, scale_type):
    g = torch.Generator().manual_seed(o * i)
    w = (torch.randn(o, i, generator=g) * torch.exp(torch.randn(o, 1, generator=g) * 3)).to(dtype)
    w[5, :7] = 0  # a zero run, and for the 32x48 blocks a block row of zeros below
    if block == (32, 48):
        w[32:64] = 0
    fast_stats, ref_stats = {}, {}
    fast = quantize_scaled(w, element, block, scale_type, stats=fast_stats)
    monkeypatch.setenv("QTOOL_SCALED_QUANT_EXT", "0")
    ref = quantize_scaled(w, element, block, scale_type, stats=ref_stats)
    assert torch.equal(fast.codes.view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(fast.scales.view(torch.uint8), ref.scales.view(torch.uint8))
    for k in ("err2", "ref2"):  # the same sums, added in another order
        assert fast_stats[k] == pytest.approx(ref_stats[k], rel=1e-4, abs=1e-30)


def test_nan_weight_is_refused_by_the_native_path(extension):
    w = torch.randn(64, 128).to(torch.bfloat16)
    w[40, 3] = float("nan")
    for block in ((128, 128), (1, -1), (-1, -1)):
        with pytest.raises(InputError, match=r"at \[40, 3\]"):
            quantize_scaled(w, "e4m3", block, "fp32", name="layer")


def test_the_native_path_takes_large_weights_by_default(monkeypatch):
    monkeypatch.delenv("QTOOL_SCALED_QUANT_EXT", raising=False)
    w = torch.zeros(1024, 1024, dtype=torch.bfloat16)
    assert sq.applies(w, "e4m3") and sq.applies(w, "int8")
    assert not sq.applies(w[:8], "e4m3") and not sq.applies(w, "e5m2")
    monkeypatch.setenv("QTOOL_SCALED_QUANT_EXT", "0")
    assert not sq.applies(w, "e4m3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("element", ["e4m3", "int8"])
def test_every_build_of_the_loops_gives_the_same_codes_maxima_and_sums(extension, dtype, element):
    """The AVX-512, AVX2 and portable loops (those this CPU runs) agree: codes and block maxima bit for bit; the
    two vector builds' error sums exactly (the same 16 lanes), the portable one's to rounding."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(70, 300, generator=g) * torch.exp(torch.randn(70, 1, generator=g) * 2)).to(dtype)
    w[3, 10:50] = 0
    w[4, :] = -0.0
    levels = range(sq.isa() + 1)
    got = {}
    for level in levels:
        amax, bad = sq.row_amax(w, 40, level=level, bo=16)  # ragged groups (300 = 7 x 40 + 20) and block rows
        assert bad == 0
        s = (amax / (448 if element == "e4m3" else 127)).clamp_min(1e-30)
        codes = torch.empty(w.shape, dtype=torch.uint8)
        sums = sq.quantize(w, element, 16, 40, s, torch.reciprocal(s), codes, level=level)
        got[level] = (amax, codes, sums)
    ref = w.float().abs().reshape(70, 1, 300)
    want = torch.nn.functional.pad(ref, (0, 20, 0, 0, 0, 10)).reshape(5, 16, 8, 40).amax(dim=(1, 3))
    for level in levels:
        assert torch.equal(got[level][0], want), level
        assert torch.equal(got[level][1], got[0][1]), level
        assert got[level][2] == pytest.approx(got[0][2], rel=1e-5)
    if 2 in got:
        assert got[2][2] == got[1][2]


def test_nan_and_inf_are_counted_per_row_by_every_build(extension):
    w = torch.randn(8, 100).to(torch.bfloat16)
    w[1, 99] = float("nan")
    w[6, 0] = float("-inf")
    for level in range(sq.isa() + 1):
        assert sq.row_amax(w, 32, level=level)[1] == 2
        assert sq.row_amax(w.float(), 32, level=level, bo=4)[1] == 2
