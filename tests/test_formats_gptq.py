"""GPTQ continuous layout (`gptq` v1, `gptq_v2`): hand-decoded groups, golden bytes, round trips, zero conventions.

Expected words below were worked out by hand from FORMATS.md (code j of a run of 32 codes at stream bits
[j*b, (j+1)*b)), or by an independent pure-Python bit loop (golden digests), never by the code under test.
"""

# O and I are FORMATS.md's notation for out_features and in_features.
# ruff: noqa: E741

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qtool.errors import FormatError, NotRepresentable, UsageError
from qtool.formats import Plain, dequantize, get_format
from qtool.formats.gptq import (
    META_KEY,
    decode_qzeros,
    encode_qzeros,
    v1_word_constant,
    zero_convention_evidence,
)
from qtool.scheme import QuantScheme

V1 = get_format("gptq")
V2 = get_format("gptq_v2")


def i32(u: int) -> int:
    """uint32 literal -> the int32 with the same bits."""
    return u - (1 << 32) if u >= (1 << 31) else u


def words(t: torch.Tensor) -> list:
    return [[x & 0xFFFFFFFF for x in row] for row in t.tolist()]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def formula_plain(O: int, I: int, G: int, bits: int, zero_lo: int = 1) -> Plain:
    """Deterministic Plain: q = (7o + 3i + 1) mod 2^b, z = zero_lo + (5o + 3g) mod (2^b - 1)."""
    o = torch.arange(O).unsqueeze(1)
    q = ((7 * o + 3 * torch.arange(I) + 1) % (1 << bits)).to(torch.uint8)
    ng = I // G
    z = (zero_lo + (5 * o + 3 * torch.arange(ng)) % ((1 << bits) - 1)).to(torch.uint8)
    s = ((o + 1) * 0.25 + torch.arange(ng) * 0.0625).to(torch.float16)
    return Plain(q, s, z, None, bits, G)


def random_plain(seed: int, bits: int, O: int, I: int, G: int, sym: bool, act: bool,
                 scale_dtype=torch.float16, no_zero0: bool = False) -> Plain:
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    eff = I if G == -1 else G
    ng = I // eff
    q = torch.randint(0, top, (O, I), generator=gen, dtype=torch.uint8)
    s = (torch.rand(O, ng, generator=gen) + 0.01).to(scale_dtype)
    z = None if sym else torch.randint(1 if no_zero0 else 0, top, (O, ng), generator=gen, dtype=torch.uint8)
    g_idx = None
    if act:
        perm = torch.randperm(I, generator=gen)
        g_idx = torch.empty(I, dtype=torch.int32)
        g_idx[perm] = (torch.arange(I) // eff).to(torch.int32)
    return Plain(q, s, z, g_idx, bits, G)


# --- hand-built single groups ----------------------------------------------------------------------

def hand_plain_4bit(zeros: list[int]) -> Plain:
    # I = 8 input rows (one 4-bit word per column), O = 8 columns, one group.
    cols = [
        [0, 1, 2, 3, 4, 5, 6, 7],           # -> 0x76543210
        [8, 9, 10, 11, 12, 13, 14, 15],     # -> 0xFEDCBA98
        [15] * 8,                           # -> 0xFFFFFFFF
        [1, 0, 0, 0, 0, 0, 0, 0],           # -> 0x00000001
        [0, 0, 0, 0, 0, 0, 0, 1],           # -> 0x10000000
        [10, 5] * 4,                        # -> 0x5A5A5A5A
        [0] * 8,                            # -> 0x00000000
        [15, 0, 0, 0, 0, 0, 0, 0],          # -> 0x0000000F
    ]
    q = torch.tensor(cols, dtype=torch.uint8)  # [O, I]: row o is column o of qweight
    s = torch.tensor([[0.5], [0.25], [1.0], [2.0], [0.125], [1.5], [3.0], [0.75]], dtype=torch.float16)
    z = torch.tensor([[v] for v in zeros], dtype=torch.uint8)
    return Plain(q, s, z, None, 4, 8)


HAND_QWEIGHT = [0x76543210, 0xFEDCBA98, 0xFFFFFFFF, 0x00000001, 0x10000000, 0x5A5A5A5A, 0x00000000, 0x0000000F]


def test_hand_group_4bit_v2():
    p = hand_plain_4bit([0, 1, 2, 3, 4, 5, 6, 15])
    t = V2.pack(p)
    assert words(t["qweight"]) == [HAND_QWEIGHT]
    assert words(t["qzeros"]) == [[0xF6543210]]  # column c's zero in nibble c
    assert t["scales"].tolist() == [[0.5, 0.25, 1.0, 2.0, 0.125, 1.5, 3.0, 0.75]]
    assert t["g_idx"].tolist() == [0] * 8
    # Decode by hand: column 1 row 2 = 0.25 * (10 - 1); column 7 row 0 = 0.75 * (15 - 15); column 0 row 7 = 0.5*7.
    w = dequantize(V2.unpack(t, QuantScheme(bits=4, group_size=8)))
    assert w[1, 2].item() == 2.25 and w[7, 0].item() == 0.0 and w[0, 7].item() == 3.5
    assert w[4, 7].item() == 0.125 * (1 - 4)


def test_hand_group_4bit_v1():
    p = hand_plain_4bit([1, 2, 3, 4, 5, 6, 7, 15])
    t = V1.pack(p)
    assert words(t["qweight"]) == [HAND_QWEIGHT]
    assert words(t["qzeros"]) == [[0xE6543210]]  # z - 1 per nibble
    back = V1.unpack({k: v.clone() for k, v in t.items()}, QuantScheme(bits=4, group_size=8))
    assert back.equal(p) and back.zeros[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 15]


def test_hand_group_3bit_straddle_codes_10_and_21():
    # I = O = 32: column 0 has code 10 = 7 (stream bits 30..32), column 1 code 21 = 5 (bits 63..65).
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[0, 10] = 7
    q[1, 21] = 5
    p = Plain(q, torch.ones(32, 1, dtype=torch.float16), None, None, 3, -1)
    t = V2.pack(p)
    qw = words(t["qweight"])
    assert [r[0] for r in qw] == [0xC0000000, 0x00000001, 0x00000000]   # bits 30, 31 | bit 0
    assert [r[1] for r in qw] == [0x00000000, 0x80000000, 0x00000002]   # bit 63 | bit 65 (5 = 0b101)
    assert all(r[c] == 0 for r in qw for c in range(2, 32))
    # Symmetric zeros 4 = 0b100 repeat every 3 bits across the three words of the run.
    assert words(t["qzeros"]) == [[0x24924924, 0x49249249, 0x92492492]]
    assert words(V1.pack(p)["qzeros"]) == [[0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D]]  # v1 stores 3 = 0b011
    back = V2.unpack(t, QuantScheme(bits=3, group_size=-1))
    assert back.qweight[0, 10].item() == 7 and back.qweight[1, 21].item() == 5 and back.equal(p)


def test_hand_group_8bit_and_2bit():
    q8 = torch.tensor([[0x12, 0x34, 0x56, 0x78], [0xFF, 0x00, 0x80, 0x01],
                       [0, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.uint8)
    p8 = Plain(q8, torch.ones(4, 1, dtype=torch.float16), torch.tensor([[1], [2], [255], [128]], dtype=torch.uint8),
               None, 8, -1)
    t = V2.pack(p8)
    assert words(t["qweight"]) == [[0x78563412, 0x018000FF, 0x00000000, 0x04030201]]
    assert words(t["qzeros"]) == [[0x80FF0201]]
    assert words(V1.pack(p8)["qzeros"]) == [[0x7FFE0100]]
    q2 = torch.tensor([[0, 1, 2, 3] * 4] + [[3] * 16] * 15, dtype=torch.uint8)  # O = 16, I = 16
    p2 = Plain(q2, torch.ones(16, 1, dtype=torch.float16), None, None, 2, 16)
    t2 = V2.pack(p2)
    assert words(t2["qweight"])[0][:2] == [0xE4E4E4E4, 0xFFFFFFFF]
    assert words(t2["qzeros"]) == [[0xAAAAAAAA]]            # sym zero 2 = 0b10 in every field
    assert words(V1.pack(p2)["qzeros"]) == [[0x55555555]]   # v1 stores 1


# --- golden bytes ------------------------------------------------------------------------------------

def test_golden_4bit_exact_words():
    p = formula_plain(8, 16, 8, 4)
    t = V2.pack(p)
    assert t["qweight"].tolist() == [
        [1661839169, -629924168, 1105954095, -1202520938, 801727245, -1775183244, 229065195, 1948170322],
        [-343593015, 1392285232, -916255321, 819622942, -1488852091, 515396348, -2060465821, -57265958]]
    assert t["qzeros"].tolist() == [[1639324513], [-1796649324]]
    assert V1.pack(p)["qzeros"].tolist() == [[1352993360], [-2082980477]]
    assert t["g_idx"].tolist() == [0] * 8 + [1] * 8


@pytest.mark.parametrize("bits,qw,qz", [
    (2, "ed8999923346f0dc4c5d6edf96f1c322b9f5b700ef8d320b49b7b588cb72d9e4",
     "70359f845e04137bfdf721adfee64b760838f2e359910c0d58cb783891a3a7a7"),
    (3, "ba02fb8d65ce8f347324a8b8baf182746b32f23ecbc61ffa5ee69431b2a9f882",
     "2ef8a0f61e0bd100b65e151b351886310bed804942e94af9ca970eda93126fa5"),
    (8, "1f3b2376bce308cff225842bebd57ccaf53af1852b20692bd29c20324b4011dd",
     "e19135c735421d3b1a1bada06ef89fedbf5bea978280a98dccf4308e26a8b41a"),
])
def test_golden_digests(bits, qw, qz):
    t = V2.pack(formula_plain(32, 64, 32, bits))
    assert (sha(t["qweight"]), sha(t["qzeros"])) == (qw, qz)
    assert t["qweight"].shape == (64 * bits // 32, 32) and t["qzeros"].shape == (2, bits)


# --- round trips ----------------------------------------------------------------------------------

SHAPES = st.sampled_from([(32, 64), (64, 32), (32, 128), (96, 256)])


@given(bits=st.sampled_from([2, 3, 4, 8]), shape=SHAPES, G=st.sampled_from([-1, 16, 32]),
       sym=st.booleans(), act=st.booleans(), seed=st.integers(0, 2**16),
       sdt=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_roundtrip_plain_v2(bits, shape, G, sym, act, seed, sdt):
    p = random_plain(seed, bits, *shape, G, sym, act, sdt)
    t = V2.pack(p)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (shape[1] * bits // 32, shape[0])
    assert t["scales"].dtype == sdt
    back = V2.unpack(t, QuantScheme(bits=bits, group_size=G))
    assert back.equal(p)
    assert torch.equal(dequantize(back).view(torch.int16 if sdt != torch.float32 else torch.int32),
                       dequantize(p).view(torch.int16 if sdt != torch.float32 else torch.int32))
    again = V2.pack(back)
    assert all(torch.equal(again[k], t[k]) for k in t)


@given(bits=st.sampled_from([2, 3, 4, 8]), shape=SHAPES, G=st.sampled_from([-1, 32]),
       sym=st.booleans(), act=st.booleans(), seed=st.integers(0, 2**16),
       conv=st.sampled_from(["word", "field"]))
def test_roundtrip_plain_v1(bits, shape, G, sym, act, seed, conv):
    p = random_plain(seed, bits, *shape, G, sym, act, no_zero0=True)
    t = V1.pack(p)
    back = V1.unpack(t, QuantScheme(bits=bits, group_size=G, convention=conv))
    assert back.equal(p)
    assert back.meta[META_KEY] == ("v1-field" if bits == 3 else f"v1-{conv}")
    assert all(torch.equal(V1.pack(back)[k], t[k]) for k in t)


@given(bits=st.sampled_from([2, 3, 4, 8]), O=st.sampled_from([32, 64]), I=st.sampled_from([32, 128]),
       ng=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_bytes_v2(bits, O, I, ng, seed):
    """pack(unpack(b)) == b for arbitrary qweight/qzeros words (every bit pattern is a valid code)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31, (I * bits // 32, O), generator=gen, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (ng, O * bits // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.randn(ng, O, generator=gen).to(torch.float16)
    g_idx = (torch.arange(I) // (I // ng)).to(torch.int32)
    b = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    out = V2.pack(V2.unpack(b, QuantScheme(bits=bits, group_size=I // ng)))
    assert all(torch.equal(out[k], b[k]) for k in b)
    # bits and group_size inferred from shapes give the same Plain.
    assert V2.unpack(b, QuantScheme()).equal(V2.unpack(b, QuantScheme(bits=bits, group_size=I // ng)))


@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_bytes_v1_word(bits, seed):
    """Any v1 qzeros word whose word-decoded zeros contain no 0 re-packs to the same word."""
    gen = torch.Generator().manual_seed(seed)
    O, I = 32, 64
    top = (1 << bits) - 1
    stored = torch.randint(0, top, (2, O), generator=gen, dtype=torch.uint8)  # fields 0..2^b-2: no carry
    qzeros = encode_qzeros(stored, bits, "v2")
    b = {"qweight": torch.randint(-2**31, 2**31, (I * bits // 32, O), generator=gen, dtype=torch.int64).to(torch.int32),
         "qzeros": qzeros, "scales": torch.rand(2, O, generator=gen).to(torch.float16),
         "g_idx": (torch.arange(I) // 32).to(torch.int32)}
    out = V1.pack(V1.unpack(b, QuantScheme(bits=bits, group_size=32)))
    assert all(torch.equal(out[k], b[k]) for k in b)


def test_act_order_g_idx_kept():
    p = random_plain(3, 4, 32, 64, 16, False, True)
    t = V2.pack(p)
    assert torch.equal(t["g_idx"], p.g_idx)
    back = V2.unpack(t, QuantScheme(bits=4, group_size=16))
    assert back.desc_act and torch.equal(back.g_idx, p.g_idx)


# --- zero conventions ------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_zeros_0_and_max(bits):
    top = (1 << bits) - 1
    O = 32
    z = torch.tensor([[0, top] * (O // 2)], dtype=torch.uint8).t().contiguous()  # [O, 1]
    q = torch.full((O, 32), top, dtype=torch.uint8)
    p = Plain(q, torch.ones(O, 1, dtype=torch.float16), z, None, bits, -1)
    # v2 stores both ends exactly.
    back = V2.unpack(V2.pack(p), QuantScheme(bits=bits, group_size=-1))
    assert back.zeros[:, 0].tolist() == [0, top] * (O // 2)
    # v1 refuses the zero of 0, names gptq_v2, and check() gives the same reason.
    with pytest.raises(NotRepresentable, match="gptq_v2"):
        V1.pack(p)
    assert any("zero point of 0" in r for r in V1.check(p))
    assert V2.check(p) == []
    # A zero of 2^b - 1 alone is fine in v1: stored 2^b - 2 in every field.
    pmax = p.with_(zeros=torch.full((O, 1), top, dtype=torch.uint8))
    t = V1.pack(pmax)
    fields = decode_qzeros(t["qzeros"], bits, O, "v2")  # raw stored fields
    assert fields.unique().tolist() == [top - 1]
    assert V1.unpack(t, QuantScheme(bits=bits, group_size=-1)).equal(pmax)


def test_word_borrow_readme_example():
    """FORMATS/fixtures README: true zeros 0 8 8 7 6 7 7 8 7 0 0 8 8 7 7 0 -> words 0x7665676f 0xf6676ef6."""
    true = torch.tensor([[0, 8, 8, 7, 6, 7, 7, 8, 7, 0, 0, 8, 8, 7, 7, 0]], dtype=torch.uint8)
    w = encode_qzeros(true, 4, "v1-word")
    assert words(w) == [[0x7665676F, 0xF6676EF6]]
    assert decode_qzeros(w, 4, 16, "v1-word").tolist() == true.tolist()
    assert decode_qzeros(w, 4, 16, "v1-field").tolist() == [[0, 7, 8, 7, 6, 7, 7, 8, 7, 0, 15, 7, 8, 7, 7, 0]]
    # The per-field encoding of the same zeros wraps 0 -> 15 with no borrow.
    assert words(encode_qzeros(true, 4, "v1-field")) == [[0x7665677F, 0xF6677FF6]]


@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_word_and_field_identical_without_zero0(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randint(1, 1 << bits, (3, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(encode_qzeros(z, bits, "v1-word"), encode_qzeros(z, bits, "v1-field"))
    w = encode_qzeros(z, bits, "v1-word")
    assert torch.equal(decode_qzeros(w, bits, 64, "v1-word"), z)
    assert torch.equal(decode_qzeros(w, bits, 64, "v1-field"), z)


def test_word_constants():
    assert [v1_word_constant(b) for b in (2, 4, 8)] == [0x55555555, 0x11111111, 0x01010101]
    with pytest.raises(FormatError):
        v1_word_constant(3)


def test_unknown_convention_is_usage_error():
    p = random_plain(0, 4, 32, 32, -1, True, False)
    with pytest.raises(UsageError, match="word"):
        V1.unpack(V1.pack(p), QuantScheme(bits=4, group_size=-1, convention="bogus"))


def test_evidence_sym_v2_labelled_v1():
    """A symmetric v2 file read with v1 rules decodes to 9: the evidence says v2."""
    p = random_plain(1, 4, 32, 64, 32, True, False)
    qz = V2.pack(p)["qzeros"]
    assert words(qz) == [[0x88888888] * 4] * 2
    ev = zero_convention_evidence(qz, 4, 32)
    assert ev.verdict == "v2" and ev.decoded["v1-word"].unique().tolist() == [9]
    ev1 = zero_convention_evidence(V1.pack(p)["qzeros"], 4, 32)
    assert ev1.verdict == "v1" and ev1.decoded["v2"].unique().tolist() == [7]
    assert ev1.word_field_diff == 0


def test_evidence_asym_counts_word_field_disagreement():
    true = torch.tensor([[0, 8, 8, 7, 6, 7, 7, 8, 7, 0, 0, 8, 8, 7, 7, 0]], dtype=torch.uint8)
    ev = zero_convention_evidence(encode_qzeros(true, 4, "v1-word"), 4, 16)
    assert ev.verdict is None and ev.word_field_diff == 3  # fields 1, 10 and 11 (see README example)
    assert ev.stored_max == 3


# --- check() and malformed tensors ------------------------------------------------------------------

def test_check_lists_every_reason():
    q = torch.zeros(12, 48, dtype=torch.uint8)
    p3 = Plain(q, torch.ones(12, 1, dtype=torch.float16), torch.zeros(12, 1, dtype=torch.uint8), None, 3, -1)
    why = V1.check(p3)
    assert len(why) == 3
    assert "in_features is 48" in why[0] and "out_features is 12" in why[1] and "zero point of 0" in why[2]
    p5 = Plain(torch.zeros(32, 32, dtype=torch.uint8), torch.ones(32, 1, dtype=torch.float16), None, None, 5, -1)
    assert V2.check(p5) == ["gptq_v2 holds 2, 3, 4, 8-bit codes, not 5-bit"]
    p4 = Plain(torch.zeros(12, 64, dtype=torch.uint8), torch.ones(12, 1, dtype=torch.float16), None, None, 4, -1)
    assert len(V2.check(p4)) == 1 and "out_features is 12" in V2.check(p4)[0]
    with pytest.raises(NotRepresentable, match="out_features is 12"):
        V2.pack(p4)


def test_unpack_rejects_bad_shapes():
    t = V2.pack(random_plain(0, 4, 32, 64, 32, False, False))
    bad = dict(t, qzeros=t["qzeros"][:, :3].contiguous())
    with pytest.raises(FormatError, match="qzeros"):
        V2.unpack(bad, QuantScheme(bits=4, group_size=32))
    with pytest.raises(FormatError, match="missing tensor 'scales'"):
        V2.unpack({k: v for k, v in t.items() if k != "scales"}, QuantScheme())
    with pytest.raises(FormatError, match="g_idx values"):
        V2.unpack(dict(t, g_idx=t["g_idx"] + 5), QuantScheme(bits=4, group_size=32))
    with pytest.raises(FormatError, match="int32"):
        V2.unpack(dict(t, qweight=t["qweight"].to(torch.int64)), QuantScheme())
    with pytest.raises(FormatError, match="8-bit"):
        V2.unpack(t, QuantScheme(bits=8, group_size=32))


def test_unpack_rejects_group_size_mismatch():
    t = V2.pack(random_plain(0, 4, 32, 128, 32, False, True))
    with pytest.raises(FormatError, match="4 scale rows do not match in_features 128 with group_size 64"):
        V2.unpack(t, QuantScheme(bits=4, group_size=64))
    assert V2.unpack(t, QuantScheme(bits=4)).group_size == 32  # inferred: 128 rows / 4 groups
