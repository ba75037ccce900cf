"""compressed-tensors pack-quantized ("ct"): foreign fixtures bit-exact, golden words, round trips, both packings.

Also home of `random_plain`, the small random Plain builder the GGUF and repack tests share.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from qtool.errors import FormatError
from qtool.formats import Plain, dequantize, get_format
from qtool.formats.compressed_tensors import pack_codes, packed_words, packing_for_version, unpack_codes
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES

CT = get_format("ct")
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def raw_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two float tensors (no tolerance; NaN payloads and -0.0 count)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_INT_VIEW[a.dtype]),
                                                                     b.view(_INT_VIEW[b.dtype]))


def random_plain(seed: int, o: int, i: int, bits: int, group_size: int, sym: bool, act_order: bool = False,
                 scale_dtype: torch.dtype = torch.float16, zero_extremes: bool = True) -> Plain:
    """A Plain with random codes; asymmetric zeros include 0 and 2^b - 1 when `zero_extremes`."""
    g = torch.Generator().manual_seed(seed)
    top = 1 << bits
    q = torch.randint(0, top, (o, i), generator=g, dtype=torch.int64).to(torch.uint8)
    ng = 1 if group_size == -1 else -(-i // group_size)
    s = (torch.rand((o, ng), generator=g) * 0.02 + 1e-3).to(scale_dtype)
    z = None
    if not sym:
        z = torch.randint(0, top, (o, ng), generator=g, dtype=torch.int64).to(torch.uint8)
        if zero_extremes and z.numel() >= 2:
            z.view(-1)[0], z.view(-1)[-1] = 0, top - 1
    gi = None
    if act_order:
        eff = i if group_size == -1 else group_size
        gi = (torch.arange(i) // eff)[torch.randperm(i, generator=g)].to(torch.int32)
    return Plain(q, s, z, gi, bits, group_size)


def _fixture_modules(name: str):
    model = load_file(FIXTURES / name / "model.safetensors")
    ref = load_file(FIXTURES / name / "reference.safetensors")
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in model.items():
        prefix, _, short = k.rpartition(".")
        if short != "bias":
            mods.setdefault(prefix, {})[short] = v
    return mods, ref


@pytest.mark.parametrize("name,sym,scale_dtype", [
    ("compressed-tensors-w4a16-g128", True, torch.bfloat16),
    ("compressed-tensors-w4a16-g128-asym", False, torch.float32),
])
def test_fixture_decodes_bit_exactly_and_repacks_to_identical_bytes(name, sym, scale_dtype):
    mods, ref = _fixture_modules(name)
    assert len(mods) == 6
    zero_ends = set()
    for prefix, tensors in mods.items():
        plain = CT.unpack(tensors, QuantScheme(bits=4, group_size=128, sym=sym, extra={"version": "0.18.0"}))
        w = dequantize(plain)
        assert w.dtype == scale_dtype
        assert raw_equal(w, ref[prefix + ".weight"]), prefix
        back = CT.pack(plain)
        assert set(back) == set(tensors), prefix
        for short, t in tensors.items():
            assert back[short].dtype == t.dtype and torch.equal(back[short], t), (prefix, short)
        if plain.zeros is not None:
            zero_ends |= {int(plain.zeros.min()), int(plain.zeros.max())}
    assert (zero_ends == {0, 15}) == (not sym)


def test_sym_4bit_weight_packed_is_gptq_qweight_transposed():
    p = random_plain(1, 64, 256, 4, 128, sym=True)
    assert torch.equal(CT.pack(p)["weight_packed"], get_format("gptq_v2").pack(p)["qweight"].t())


# --- golden words ---------------------------------------------------------------------------------
def test_golden_4bit_words_along_input_and_zeros_along_dim0():
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    assert pack_codes(codes, 4, 1).tolist() == [[0x76543210]]
    assert pack_codes(codes.t().contiguous(), 4, 0).tolist() == [[0x76543210]]


def test_golden_3bit_dense_straddles_words_and_padded_does_not():
    ones = torch.ones((1, 32), dtype=torch.uint8)
    dense = pack_codes(ones, 3, 1, "dense")
    assert [w & 0xFFFFFFFF for w in dense[0].tolist()] == [0x49249249, 0x92492492, 0x24924924]
    padded = pack_codes(ones, 3, 1, "padded")
    assert [w & 0xFFFFFFFF for w in padded[0].tolist()] == [0x09249249] * 3 + [0x9]
    assert packed_words(384, 3, "dense") == 36 and packed_words(384, 3, "padded") == 39


def test_dense_keeps_only_the_words_it_needs_for_a_ragged_tail():
    codes = torch.tensor([[5] * 11], dtype=torch.uint8)  # 33 bits: code 10 straddles into a second word
    words = pack_codes(codes, 3, 1, "dense")
    assert words.shape == (1, 2)
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == [0x6DB6DB6D & 0xFFFFFFFF, 0x1]
    assert torch.equal(unpack_codes(words, 3, 11, 1, "dense"), codes)


def test_version_chooses_the_packing():
    assert packing_for_version("0.18.0") == "dense"
    assert packing_for_version("0.19.2.a20260101") == "dense"
    assert packing_for_version("0.17.1") == "padded"
    assert packing_for_version("0.9") == "padded"
    assert packing_for_version(None) == "dense"


# --- round trips ------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**16), bits=st.integers(2, 8), o=st.sampled_from([1, 8, 24, 33]),
       i=st.sampled_from([32, 64, 96, 40]), group=st.sampled_from([-1, 8, 32]), sym=st.booleans(),
       act=st.booleans(), packing=st.sampled_from(["dense", "padded"]),
       dt=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_round_trip_both_ways(seed, bits, o, i, group, sym, act, packing, dt):
    if group != -1 and i % group:
        group = -1
    p = random_plain(seed, o, i, bits, group, sym, act_order=act and group != -1, scale_dtype=dt)
    packed = CT.pack(p, packing=packing)
    assert packed["weight_packed"].shape == (o, packed_words(i, bits, packing))
    assert ("weight_zero_point" in packed) == (not p.sym)
    assert ("weight_g_idx" in packed) == p.desc_act
    back = CT.unpack(packed, QuantScheme(bits=bits, group_size=group, extra={"packing": packing}))
    assert back.equal(p)
    again = CT.pack(back)  # the packing read is remembered in meta
    assert set(again) == set(packed) and all(torch.equal(again[k], packed[k]) for k in packed)


@given(seed=st.integers(0, 2**16), bits=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 70))
def test_dense_and_padded_agree_where_b_divides_32(seed, bits, n):
    c = torch.randint(0, 1 << bits, (3, n), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)
    assert torch.equal(pack_codes(c, bits, 1, "dense"), pack_codes(c, bits, 1, "padded"))


# --- hostile / inconsistent input ---------------------------------------------------------------------
def test_wrong_word_count_names_the_tensor_and_the_fix():
    p = random_plain(3, 8, 64, 3, 32, sym=True)
    packed = CT.pack(p, packing="dense")
    with pytest.raises(FormatError, match="weight_packed.*padded packing need 7"):
        CT.unpack(packed, QuantScheme(bits=3, extra={"version": "0.17.0"}))


def test_missing_zero_point_under_an_asymmetric_config_is_an_error():
    p = random_plain(4, 8, 64, 4, 32, sym=True)
    with pytest.raises(FormatError, match="weight_zero_point"):
        CT.unpack(CT.pack(p), QuantScheme(bits=4, sym=False))


def test_unpacked_signed_int8_zero_points_are_read():
    p = random_plain(5, 8, 64, 4, 32, sym=False)
    packed = CT.pack(p)
    packed["weight_zero_point"] = (p.zeros.to(torch.int16) - 8).to(torch.int8)
    assert CT.unpack(packed, QuantScheme(bits=4)).equal(p)


def test_bits_inferred_from_words_when_the_config_is_silent():
    p = random_plain(6, 8, 96, 6, 32, sym=True)
    assert CT.unpack(CT.pack(p), QuantScheme()).equal(p)
