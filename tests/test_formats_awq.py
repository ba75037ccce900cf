"""AWQ GEMM layout `awq`: hand-decoded interleave, golden digests, round trips, AWQ <-> GPTQ-v2 relation.

Hand words follow FORMATS.md: nibble i (shift 4i) of word c holds output column 8c + [0,2,4,6,1,3,5,7][i].
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
from qtool.scheme import QuantScheme

AWQ = get_format("awq")
V2 = get_format("gptq_v2")
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def words(t: torch.Tensor) -> list:
    return [[x & 0xFFFFFFFF for x in row] for row in t.tolist()]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def random_plain(seed: int, O: int, I: int, G: int, sym: bool) -> Plain:
    gen = torch.Generator().manual_seed(seed)
    ng = 1 if G == -1 else I // G
    q = torch.randint(0, 16, (O, I), generator=gen, dtype=torch.uint8)
    s = (torch.rand(O, ng, generator=gen) + 0.01).to(torch.float16)
    z = None if sym else torch.randint(0, 16, (O, ng), generator=gen, dtype=torch.uint8)
    return Plain(q, s, z, None, 4, G)


def test_hand_group_interleave():
    # O = 8 columns, I = 16 rows, one group. Row 0 holds codes 0..7 in columns 0..7.
    q = torch.zeros(8, 16, dtype=torch.uint8)
    q[:, 0] = torch.arange(8, dtype=torch.uint8)
    q[3, 5] = 9       # column 3 sits in nibble 5 -> row 5 word 0x00900000
    z = torch.tensor([[8], [9], [10], [11], [12], [13], [14], [15]], dtype=torch.uint8)
    s = torch.tensor([[0.5]] * 8, dtype=torch.float16)
    p = Plain(q, s, z, None, 4, 16)
    t = AWQ.pack(p)
    assert t["qweight"].shape == (16, 1) and t["qzeros"].shape == (1, 1) and t["scales"].shape == (1, 8)
    qw = words(t["qweight"])
    assert qw[0] == [0x75316420]       # nibbles hold columns 0,2,4,6,1,3,5,7
    assert qw[5] == [0x00900000]
    assert all(qw[r] == [0] for r in range(16) if r not in (0, 5))
    assert words(t["qzeros"]) == [[0xFDB9ECA8]]  # zeros 8..15 interleaved, true zeros (no -1)
    w = dequantize(AWQ.unpack(t, QuantScheme(bits=4, group_size=16)))
    assert w[3, 5].item() == 0.5 * (9 - 11) and w[7, 0].item() == 0.5 * (7 - 15) and w[0, 0].item() == -4.0


def test_golden_digest():
    O, I, G = 16, 16, 8
    o = torch.arange(O).unsqueeze(1)
    q = ((7 * o + 3 * torch.arange(I) + 1) % 16).to(torch.uint8)
    z = (1 + (5 * o + 3 * torch.arange(I // G)) % 15).to(torch.uint8)
    s = ((o + 1) * 0.25 + torch.arange(I // G) * 0.0625).to(torch.float16)
    t = AWQ.pack(Plain(q, s, z, None, 4, G))
    assert t["qweight"].tolist()[0] == [610844145, -1394592391]
    assert t["qzeros"].tolist() == [[1796609713, 380744043], [-1639364124, 1239737502]]
    assert sha(t["qweight"]) == "40f026ddfb4edee91656e039a8c7d0cd756fd440d45f43ca9ab93e084b64e8ad"
    assert sha(t["qzeros"]) == "b9b0af13308b82ed7f590571b2bbf1c4ff6d700c7cf3f9bec6d53ec78079aa92"


def nibbles(w: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> int64 [..., n, 8], nibble k = (w >> 4k) & 15 (test-local, independent of qtool)."""
    return (w.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8))) & 15


def from_nibbles(n: torch.Tensor) -> torch.Tensor:
    v = (n << (4 * torch.arange(8))).sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


@given(O=st.sampled_from([8, 16, 64]), I=st.sampled_from([32, 64, 128]), G=st.sampled_from([-1, 32]),
       sym=st.booleans(), seed=st.integers(0, 2**16))
def test_awq_gptq_v2_relation(O, I, G, sym, seed):
    """Same Plain: AWQ words = GPTQ-v2 codes, transposed to pack along O, then interleaved per 8 columns."""
    p = random_plain(seed, O, I, G, sym)
    a, g = AWQ.pack(p), V2.pack(p)
    codes_io = nibbles(g["qweight"]).permute(0, 2, 1).reshape(I, O)           # [I, O] natural order
    expect = from_nibbles(codes_io.reshape(I, O // 8, 8)[..., ORDER])
    assert torch.equal(a["qweight"], expect)
    zeros_go = nibbles(g["qzeros"]).reshape(-1, O)                            # [n_groups, O]
    assert torch.equal(a["qzeros"], from_nibbles(zeros_go.reshape(-1, O // 8, 8)[..., ORDER]))
    assert torch.equal(a["scales"], g["scales"])
    # And the two unpack to the same Plain: conversion is exact both ways.
    pa = AWQ.unpack(a, QuantScheme(bits=4, group_size=G))
    pg = V2.unpack(g, QuantScheme(bits=4, group_size=G))
    assert pa.equal(pg) and pa.equal(p)
    assert all(torch.equal(V2.pack(pa)[k], g[k]) for k in g)


@given(O=st.sampled_from([8, 24, 64]), ng=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_bytes(O, ng, seed):
    gen = torch.Generator().manual_seed(seed)
    I = 32 * ng
    b = {"qweight": torch.randint(-2**31, 2**31, (I, O // 8), generator=gen, dtype=torch.int64).to(torch.int32),
         "qzeros": torch.randint(-2**31, 2**31, (ng, O // 8), generator=gen, dtype=torch.int64).to(torch.int32),
         "scales": torch.rand(ng, O, generator=gen).to(torch.float16)}
    out = AWQ.pack(AWQ.unpack(b, QuantScheme()))
    assert set(out) == set(b) and all(torch.equal(out[k], b[k]) for k in b)


def test_act_order_and_bits_refused():
    p = random_plain(0, 16, 64, 32, False)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    g = torch.empty(64, dtype=torch.int32)
    g[perm] = (torch.arange(64) // 32).to(torch.int32)
    act = p.with_(g_idx=g)
    assert any("act-order" in r for r in AWQ.check(act))
    with pytest.raises(NotRepresentable, match="gptq_v2"):
        AWQ.pack(act)
    p3 = Plain(torch.zeros(12, 32, dtype=torch.uint8), torch.ones(12, 1, dtype=torch.float16), None, None, 3, -1)
    why = AWQ.check(p3)
    assert why == ["awq holds 4-bit codes, not 3-bit"]
    p4 = p3.with_(bits=4)
    assert AWQ.check(p4) == ["awq 4-bit packs zeros along out_features in runs of 8, but out_features is 12"]
    with pytest.raises(FormatError, match="4-bit"):
        AWQ.unpack(AWQ.pack(p), QuantScheme(bits=8))
    with pytest.raises(FormatError, match="qweight"):
        AWQ.unpack(dict(AWQ.pack(p), scales=torch.ones(2, 24, dtype=torch.float16)), QuantScheme())


# --- what one AWQ config can describe ----------------------------------------------------------------------------------
def test_awq_mismatch_names_the_lm_head_and_mixed_schemes():
    from qtool.formats.awq import awq_mismatch

    layer = [(f"model.layers.0.{n}", 4, 128, False) for n in ("q_proj", "k_proj", "v_proj")]
    assert awq_mismatch(layer) is None and awq_mismatch([]) is None
    head = awq_mismatch([*layer, ("lm_head", 4, 128, False)])
    assert head.lm_head and head.module == "lm_head" and "LM head (lm_head)" in head.problem
    assert "gptq_v2" in head.conversion_fix and "--group-size" not in head.conversion_fix
    # a head is named first, whatever else differs: no --group-size mends it
    assert awq_mismatch([*layer, ("lm_head", 4, 32, False)]).lm_head
    groups = awq_mismatch([*layer, ("model.layers.0.o_proj", 4, 64, False), ("model.layers.0.up", 4, -1, False)])
    assert not groups.lm_head and groups.module == "model.layers.0.o_proj"
    assert groups.group_size == 64  # splits 128 and 64 (and a whole row) exactly
    assert "--group-size 64" in groups.conversion_fix
    assert "1 at 4-bit group 64 (model.layers.0.o_proj)" in groups.problem
    assert awq_mismatch([*layer, ("o", 4, 96, False)]).group_size == 32  # not 96: 128 splits into 32s only
    sym = awq_mismatch([*layer, ("o", 4, 128, True)])  # zero points differ: no group size mends that
    assert sym.group_size is None and "--group-size" not in sym.conversion_fix and "symmetric (o)" in sym.problem


def test_decode_zeros_is_unpacks_decoding():
    """decode_zeros, which repack calls on qzeros alone (its sym check), gives the zeros unpack gives, on any run of
    group rows."""
    p = random_plain(3, 16, 128, 32, False)
    t = AWQ.pack(p)
    zeros, conv = AWQ.decode_zeros(t["qzeros"], 4, 16, QuantScheme("awq", 4, 32))
    assert conv == "v2" and torch.equal(zeros.t(), AWQ.unpack(t, QuantScheme()).zeros)
    assert torch.equal(AWQ.decode_zeros(t["qzeros"][1:3], 4, 16, QuantScheme())[0], zeros[1:3])
    with pytest.raises(FormatError, match="4-bit"):
        AWQ.decode_zeros(t["qzeros"], 8, 16, QuantScheme("awq", 8, 32))
