"""GPTQ planar layout `gptq_p`: hand-decoded runs, golden digests, equality with the continuous stream for
2/4/8 bits and difference for the others, round trips, divisibility.

Expected words are worked out by hand from FORMATS.md (per run of 32 codes: each plane of width w fills w
words, word k holding codes [k*32/w, (k+1)*32/w) at shifts w*j, low plane first) or come from an
independent pure-Python bit loop (digests).
"""

# O and I are FORMATS.md's notation for out_features and in_features.
# ruff: noqa: E741

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qtool.errors import FormatError, NotRepresentable
from qtool.formats import Plain, dequantize, get_format
from qtool.packing.bitstream import pack_stream
from qtool.scheme import QuantScheme

P = get_format("gptq_p")
V2 = get_format("gptq_v2")


def words(t: torch.Tensor) -> list:
    return [[x & 0xFFFFFFFF for x in row] for row in t.tolist()]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def random_plain(seed: int, bits: int, O: int, I: int, G: int, sym: bool, act: bool) -> Plain:
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    eff = I if G == -1 else G
    ng = I // eff
    q = torch.randint(0, top, (O, I), generator=gen, dtype=torch.uint8)
    s = (torch.rand(O, ng, generator=gen) + 0.01).to(torch.float16)
    z = None if sym else torch.randint(0, top, (O, ng), generator=gen, dtype=torch.uint8)
    g_idx = None
    if act:
        perm = torch.randperm(I, generator=gen)
        g_idx = torch.empty(I, dtype=torch.int32)
        g_idx[perm] = (torch.arange(I) // eff).to(torch.int32)
    return Plain(q, s, z, g_idx, bits, G)


def test_hand_run_3bit_planar_codes_10_and_21():
    # 3 = 2 + 1 planes: words 0,1 hold the low 2 bits of codes 0..15 / 16..31, word 2 bit 2 of codes 0..31.
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[0, 10] = 7   # low plane 0b11 at word 0 bits 20,21; high plane at word 2 bit 10
    q[1, 21] = 5   # low plane 0b01 at word 1 bits 10,11 (index 5 of 16..31); high plane at word 2 bit 21
    p = Plain(q, torch.ones(32, 1, dtype=torch.float16), None, None, 3, -1)
    t = P.pack(p)
    qw = words(t["qweight"])
    assert [r[0] for r in qw] == [0x00300000, 0x00000000, 0x00000400]
    assert [r[1] for r in qw] == [0x00000000, 0x00000400, 0x00200000]
    # Sym zero 4 = 0b100: low planes all 0, high plane all 1.
    assert words(t["qzeros"]) == [[0x00000000, 0x00000000, 0xFFFFFFFF]]
    # The continuous stream puts the same codes elsewhere (FORMATS.md: 3-bit planar != continuous).
    assert [r[0] for r in words(V2.pack(p)["qweight"])] == [0xC0000000, 0x00000001, 0x00000000]
    back = P.unpack(t, QuantScheme(bits=3, group_size=-1))
    assert back.equal(p) and back.qweight[0, 10].item() == 7 and back.qweight[1, 21].item() == 5


def test_hand_run_5bit_planar():
    # 5 = 4 + 1: words 0..3 hold low nibbles of codes 0-7, 8-15, 16-23, 24-31; word 4 bit 4 of all 32.
    col = [(i % 32) for i in range(32)]              # code i = i
    q = torch.tensor([col] + [[31] * 32] * 31, dtype=torch.uint8)
    p = Plain(q, torch.ones(32, 1, dtype=torch.float16), torch.full((32, 1), 31, dtype=torch.uint8), None, 5, -1)
    t = P.pack(p)
    assert [r[0] for r in words(t["qweight"])] == [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98, 0xFFFF0000]
    assert [r[1] for r in words(t["qweight"])] == [0xFFFFFFFF] * 5
    assert words(t["qzeros"]) == [[0xFFFFFFFF] * 5]
    w = dequantize(P.unpack(t, QuantScheme(bits=5, group_size=-1)))
    assert w[0, :3].tolist() == [-31.0, -30.0, -29.0]


def formula_plain(O: int, I: int, G: int, bits: int) -> Plain:
    o = torch.arange(O).unsqueeze(1)
    q = ((7 * o + 3 * torch.arange(I) + 1) % (1 << bits)).to(torch.uint8)
    ng = I // G
    z = (1 + (5 * o + 3 * torch.arange(ng)) % ((1 << bits) - 1)).to(torch.uint8)
    s = ((o + 1) * 0.25 + torch.arange(ng) * 0.0625).to(torch.float16)
    return Plain(q, s, z, None, bits, G)


@pytest.mark.parametrize("bits,qw,qz", [
    (3, "984543cb56a1913747e15af04298ecb9d27e767e58406d4c55a64e8e766281da",
     "08e601ff16eea6b955b51e4befa0f96f32a3fe7e0061d7f2db8ee8c6eed33b89"),
    (5, "dd23ac319d2e4e5ae84a858203d8dc04a42008ca5bf2a4ba9cc5e3efff308da3",
     "7269755c0e831f092e37325380e702f32a687c2a08744b9a7845b9fae4ffaec7"),
])
def test_golden_digests(bits, qw, qz):
    t = P.pack(formula_plain(32, 64, 32, bits))
    assert (sha(t["qweight"]), sha(t["qzeros"])) == (qw, qz)


@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16), sym=st.booleans(), act=st.booleans())
def test_planar_equals_continuous_for_2_4_8(bits, seed, sym, act):
    p = random_plain(seed, bits, 64, 128, 32, sym, act)
    a, b = P.pack(p), V2.pack(p)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_planar_differs_from_continuous(bits):
    # gptq_v2 holds only 2/3/4/8 bits, so compare with the continuous stream itself.
    p = random_plain(bits, bits, 32, 64, 32, False, False)
    t = P.pack(p)
    assert not torch.equal(t["qweight"], pack_stream(p.qweight.t(), bits, dim=0))
    assert not torch.equal(t["qzeros"], pack_stream(p.zeros.t(), bits, dim=1))
    assert t["qweight"].shape == pack_stream(p.qweight.t(), bits, dim=0).shape


@given(bits=st.integers(2, 8), shape=st.sampled_from([(32, 32), (64, 128), (32, 256)]),
       G=st.sampled_from([-1, 32, 64]), sym=st.booleans(), act=st.booleans(), seed=st.integers(0, 2**16))
def test_roundtrip_plain(bits, shape, G, sym, act, seed):
    O, I = shape
    if G != -1 and I % G:
        G = -1
    p = random_plain(seed, bits, O, I, G, sym, act)
    t = P.pack(p)
    assert t["qweight"].shape == (I * bits // 32, O) and t["qzeros"].shape[1] == O * bits // 32
    back = P.unpack(t, QuantScheme(bits=bits, group_size=G))
    assert back.equal(p) and back.meta["gptq_zero_convention"] == "v2"
    assert all(torch.equal(P.pack(back)[k], t[k]) for k in t)


@given(bits=st.integers(2, 8), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_bytes(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    O, I, ng = 32, 64, 2
    b = {"qweight": torch.randint(-2**31, 2**31, (I * bits // 32, O), generator=gen, dtype=torch.int64).to(torch.int32),
         "qzeros": torch.randint(-2**31, 2**31, (ng, O * bits // 32), generator=gen, dtype=torch.int64).to(torch.int32),
         "scales": torch.rand(ng, O, generator=gen).to(torch.bfloat16),
         "g_idx": (torch.arange(I) // 32).to(torch.int32)}
    out = P.pack(P.unpack(b, QuantScheme()))  # bits and group_size inferred from shapes
    assert all(torch.equal(out[k], b[k]) for k in b)


def test_check_needs_multiples_of_32():
    p = Plain(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1, dtype=torch.float16), None, None, 4, -1)
    why = P.check(p)
    assert len(why) == 2 and "in_features is 48" in why[0] and "out_features is 16" in why[1]
    assert V2.check(p) == []  # the continuous 4-bit layout only needs multiples of 8
    with pytest.raises(NotRepresentable):
        P.pack(p)
    with pytest.raises(FormatError):
        # 3 words of 4-bit codes = 24 input rows: not a whole planar run.
        P.unpack({"qweight": torch.zeros(3, 32, dtype=torch.int32), "qzeros": torch.zeros(1, 4, dtype=torch.int32),
                  "scales": torch.ones(1, 32, dtype=torch.float16)}, QuantScheme(bits=4))
