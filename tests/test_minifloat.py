"""E2M1 / E8M0 / E4M3 element codecs: hand-worked golden values, exhaustive round trips, nearest-even."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.packing.minifloat import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e4m3_nan_mask,
    e8m0_decode,
    e8m0_from_exponent,
    floor_log2,
    pack_nibbles,
    unpack_nibbles,
)


def test_e2m1_encode_golden():
    # ties to the even code (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4), saturation at 6,
    # and the sign of values that round to zero kept (-0.1 -> code 8)
    x = torch.tensor([0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, math.inf,
                      -0.0, -0.1, -6.0, -100.0, -math.inf, 0.74, 2.51])
    want = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 8, 8, 15, 15, 15, 1, 5]
    assert e2m1_encode(x).tolist() == want
    xb = torch.tensor([0.75, 1.25, 5.0, -0.1, 2.5], dtype=torch.bfloat16)
    assert e2m1_encode(xb).tolist() == [2, 2, 6, 8, 4]


def test_e2m1_nan_refused():
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, math.nan]))


def test_e2m1_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals.tolist() == list(E2M1_VALUES)
    assert torch.signbit(vals[8])  # code 8 is -0
    assert torch.equal(e2m1_encode(vals), codes)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-8.0, max_value=8.0, allow_nan=False, width=32))
def test_e2m1_is_nearest(v):
    code = int(e2m1_encode(torch.tensor([v]))[0])
    got = E2M1_VALUES[code]
    best = min(abs(abs(v) - m) for m in E2M1_VALUES[:8])
    assert abs(abs(v) - abs(got)) == best or abs(v) > 6.0
    if v != 0.0:
        assert (code >= 8) == (v < 0)


def test_nibble_order_golden():
    codes = torch.tensor([[1, 2, 3, 15], [8, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    # element 2i low nibble, 2i+1 high nibble
    assert packed.tolist() == [[0x21, 0xF3], [0x08, 0x97]]
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


def test_e8m0_decode_golden():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_decode(e, torch.float64)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(v[6])
    with pytest.raises(ValueError):
        e8m0_decode(e, torch.bfloat16)


def test_e8m0_agrees_with_torch_dtype():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    e = torch.arange(256, dtype=torch.uint8)
    ours = e8m0_decode(e)
    theirs = e.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours[:255], theirs[:255])
    assert math.isnan(ours[255]) and math.isnan(theirs[255])


def test_e8m0_from_exponent():
    assert e8m0_from_exponent(torch.tensor([-127, 0, 127])).tolist() == [0, 127, 254]
    with pytest.raises(ValueError, match="2\\^-127"):
        e8m0_from_exponent(torch.tensor([128]))


def test_floor_log2_exact():
    x = torch.tensor([1.0, 1.5, 0.99999994, 2.0 ** -149, 3 * 2.0 ** -149, 2.0 ** 127 * 1.99, 6.0, 0.375])
    assert floor_log2(x).tolist() == [0, 0, -1, -149, -148, 127, 2, -2]


def test_e4m3_encode_golden_bytes():
    x = torch.tensor([1.0, 448.0, -448.0, 500.0, -1e9, math.inf, 2.0 ** -9, 0.0, -0.0, 1.0625, 1.1875])
    b = e4m3_encode(x).view(torch.uint8).tolist()
    # 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): even mantissa wins -> 0x38; 1.1875 -> 0x3A
    assert b == [0x38, 0x7E, 0xFE, 0x7E, 0xFE, 0x7E, 0x01, 0x00, 0x80, 0x38, 0x3A]
    with pytest.raises(ValueError, match="NaN"):
        e4m3_encode(torch.tensor([math.nan]))
    assert e4m3_nan_mask(torch.tensor([0x7F, 0xFF, 0x7E, 0x00], dtype=torch.uint8)).tolist() == [
        True, True, False, False]
