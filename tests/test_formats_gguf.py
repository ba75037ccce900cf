"""GGUF Q4_0 / Q4_1 / Q8_0 blocks: the llama.cpp fixture read exactly, golden block bytes, the gguf package as
an independent decoder of what qtool writes, exactness boundaries (ranges, block/group alignment, fp16)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from qtool.errors import NotRepresentable
from qtool.formats import Plain, dequantize, get_format
from qtool.formats.gguf_blocks import BLOCKS, dequantize_blocks
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES
from tests.test_formats_ct import random_plain, raw_equal

Q4_0, Q4_1, Q8_0 = (get_format(f) for f in ("gguf_q4_0", "gguf_q4_1", "gguf_q8_0"))
GGML = {"gguf_q4_0": gguf.GGMLQuantizationType.Q4_0, "gguf_q4_1": gguf.GGMLQuantizationType.Q4_1,
        "gguf_q8_0": gguf.GGMLQuantizationType.Q8_0}
BY_TYPE = {2: "gguf_q4_0", 3: "gguf_q4_1", 8: "gguf_q8_0"}
GGUF_DIR = FIXTURES / "gguf-q4_0-q4_1-q8_0"


def gguf_decode(raw: torch.Tensor, fmt_id: str) -> torch.Tensor:
    """The gguf package's own dequantizer (llama.cpp's numpy port): fp32 [O, I]."""
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), GGML[fmt_id]).copy())


@pytest.fixture(scope="module")
def fixture_tensors():
    reader = gguf.GGUFReader(GGUF_DIR / "gguf-q4_0-q4_1-q8_0.gguf")
    ref = load_file(GGUF_DIR / "reference.safetensors")
    out = [(t.name, BY_TYPE[int(t.tensor_type)], torch.from_numpy(np.array(t.data)), ref[t.name])
           for t in reader.tensors if int(t.tensor_type) in BY_TYPE]
    assert sorted(f for _, f, _, _ in out) == ["gguf_q4_0"] * 3 + ["gguf_q4_1"] * 2 + ["gguf_q8_0"]
    return out


def test_fixture_blocks_decode_to_the_reference_bit_for_bit(fixture_tensors):
    for name, fid, raw, ref in fixture_tensors:
        assert raw_equal(dequantize_blocks(raw, fid), ref), name


def test_fixture_q4_0_and_q8_0_are_exact_plains_and_repack_to_the_same_bytes(fixture_tensors):
    for name, fid, raw, ref in fixture_tensors:
        if fid == "gguf_q4_1":
            continue
        fmt = get_format(fid)
        p = fmt.unpack({"weight": raw}, QuantScheme())
        assert (p.bits, p.group_size, p.sym, p.scales.dtype) == (4 if fid == "gguf_q4_0" else 8, 32, True,
                                                                 torch.float16)
        assert raw_equal(dequantize(p, torch.float32), ref), name
        assert torch.equal(fmt.pack(p)["weight"], raw), name
        assert fmt.assess(p).kind == "exact"


def test_fixture_q4_1_min_offsets_are_not_integer_zero_points(fixture_tensors):
    q41 = [(n, raw) for n, f, raw, _ in fixture_tensors if f == "gguf_q4_1"]
    for _name, raw in q41:
        with pytest.raises(NotRepresentable, match=r"Q4_1 offset m is not -d\*z .* blocks.*--allow-lossy"):
            Q4_1.unpack({"weight": raw}, QuantScheme())


# --- golden bytes -----------------------------------------------------------------------------------
def test_golden_q4_0_block():
    codes = torch.tensor([list(range(16)) * 2], dtype=torch.uint8)
    p = Plain(codes, torch.tensor([[0.5]], dtype=torch.float16), None, None, 4, 32)
    raw = Q4_0.pack(p)["weight"]
    assert raw.tolist() == [[0x00, 0x38] + [j | (j << 4) for j in range(16)]]
    assert gguf_decode(raw, "gguf_q4_0").tolist() == [[0.5 * (j - 8) for j in range(16)] * 2]


def test_golden_q4_1_and_q8_0_blocks():
    codes = torch.tensor([list(range(16)) * 2], dtype=torch.uint8)
    p = Plain(codes, torch.tensor([[0.25]], dtype=torch.float16), torch.tensor([[3]], dtype=torch.uint8),
              None, 4, 32)
    raw = Q4_1.pack(p)["weight"]
    # d = 0.25 (0x3400), m = -0.75 (0xBA00)
    assert raw.tolist() == [[0x00, 0x34, 0x00, 0xBA] + [j | (j << 4) for j in range(16)]]
    raw8 = Q8_0.pack(p)["weight"]
    assert raw8.tolist() == [[0x00, 0x34] + [(j - 3) & 0xFF for j in range(16)] * 2]


# --- qtool writes, the gguf package reads -------------------------------------------------------------
@given(seed=st.integers(0, 2**16), o=st.sampled_from([8, 16, 32]), i=st.sampled_from([32, 64, 128]),
       group=st.sampled_from([32, 64, -1]))
def test_gptq_sym_4bit_to_q4_0_decodes_to_exactly_qtools_dequantization(seed, o, i, group):
    group = group if group == -1 or i % group == 0 else 32
    p = random_plain(seed, o, i, 4, group, sym=True)
    gptq = get_format("gptq_v2")
    p = gptq.unpack(gptq.pack(p), QuantScheme(bits=4, group_size=group))
    raw = Q4_0.pack(p)["weight"]
    assert raw.shape == (o, i // 32 * 18)
    assert raw_equal(gguf_decode(raw, "gguf_q4_0"), dequantize(p, torch.float32))
    back = Q4_0.unpack({"weight": raw}, QuantScheme())
    assert torch.equal(dequantize(back, torch.float64), dequantize(p, torch.float64))
    assert torch.equal(Q4_0.pack(back)["weight"], raw)


@given(seed=st.integers(0, 2**16), bits=st.integers(2, 8), sym=st.booleans(), group=st.sampled_from([32, 96]))
def test_q8_0_holds_sym_8bit_and_every_narrower_code_exactly(seed, bits, sym, group):
    if bits == 8 and not sym:
        sym = True  # q - z of asymmetric 8-bit can leave int8; covered below
    p = random_plain(seed, 8, 96, bits, group, sym)
    raw = Q8_0.pack(p)["weight"]
    assert raw_equal(gguf_decode(raw, "gguf_q8_0"), dequantize(p, torch.float32))
    assert Q8_0.assess(p).kind == "exact"


@given(seed=st.integers(0, 2**16), o=st.sampled_from([2, 16]), bits=st.sampled_from([2, 3, 4]),
       dt=st.sampled_from([torch.float16, torch.bfloat16]))
def test_asym_to_q4_1_is_within_the_fp16_rounding_of_m(seed, o, bits, dt):
    p = random_plain(seed, o, 64, bits, 32, sym=False, scale_dtype=dt)
    raw = Q4_1.pack(p)["weight"]
    got = gguf_decode(raw, "gguf_q4_1").to(torch.float64)
    ref = dequantize(p, torch.float64)
    d16 = p.scales.to(torch.float16).to(torch.float64)
    dz = (d16 * p.zeros.to(torch.float64)).abs().repeat_interleave(32, dim=1)
    # m = fp16(-d*z): at most half an fp16 ulp of |d*z| away; d itself moves by half an ulp of |s| for bf16
    bound = dz * 2.0**-11 + (p.scales.to(torch.float64) - d16).abs().repeat_interleave(32, 1) * (1 << bits)
    err = (got - ref).abs()
    assert bool((err <= bound).all())
    a = Q4_1.assess(p)
    assert a.kind in ("exact", "near-exact") and a.max_error == pytest.approx(float(err.max()), abs=0)


def test_q4_1_with_integral_offsets_is_exact_both_ways():
    p = random_plain(7, 8, 64, 4, 32, sym=False)
    p = p.with_(scales=torch.full_like(p.scales, 2.0**-6))  # powers of two: -d*z is an fp16 value
    assert Q4_1.assess(p).kind == "exact"
    raw = Q4_1.pack(p)["weight"]
    back = Q4_1.unpack({"weight": raw}, QuantScheme())
    assert back.equal(p)
    assert raw_equal(gguf_decode(raw, "gguf_q4_1"), dequantize(p, torch.float32))


def test_q4_1_constant_block_with_zero_scale_is_exact():
    raw = torch.zeros((1, 20), dtype=torch.uint8)
    raw[0, 2:4] = torch.tensor([1.5], dtype=torch.float16).view(torch.uint8)  # d = 0, m = 1.5
    p = Q4_1.unpack({"weight": raw}, QuantScheme())
    assert torch.equal(dequantize(p, torch.float32), gguf_decode(raw, "gguf_q4_1"))


@given(seed=st.integers(0, 2**16), fid=st.sampled_from(["gguf_q4_0", "gguf_q8_0"]))
def test_random_blocks_round_trip_byte_for_byte(seed, fid):
    g = torch.Generator().manual_seed(seed)
    nbytes = BLOCKS[fid][0]
    raw = torch.randint(0, 256, (3, 2 * nbytes), generator=g).to(torch.uint8)
    d = (torch.rand((3, 2), generator=g) - 0.5).to(torch.float16).view(torch.uint8)  # finite d (and -0.0)
    raw.view(3, 2, nbytes)[..., 0:2] = d.view(3, 2, 2)
    fmt = get_format(fid)
    assert torch.equal(fmt.pack(fmt.unpack({"weight": raw}, QuantScheme()))["weight"], raw)


# --- refusals ---------------------------------------------------------------------------------------------
def test_q4_0_refuses_asymmetric_codes_out_of_range_and_says_why():
    p = random_plain(8, 4, 64, 4, 32, sym=False)
    why = Q4_0.check(p)
    assert why and "q - z outside" in why[0] and "[-8, 7]" in why[0]
    with pytest.raises(NotRepresentable, match="--allow-lossy"):
        Q4_0.pack(p)
    assert Q4_0.assess(p).kind == "impossible"


def test_blocks_must_not_straddle_groups():
    p = random_plain(9, 4, 64, 4, 16, sym=True)
    assert "not a multiple of 32" in Q4_0.check(p)[0]
    act = random_plain(10, 4, 64, 4, 32, sym=True, act_order=True)
    assert "act-order" in Q4_0.check(act)[0]


def test_asym_3bit_fits_q4_0_exactly():
    p = random_plain(11, 4, 64, 3, 32, sym=False)
    raw = Q4_0.pack(p)["weight"]
    assert raw_equal(gguf_decode(raw, "gguf_q4_0"), dequantize(p, torch.float32))


def test_fp32_scales_round_to_fp16_and_the_error_is_reported():
    p = random_plain(12, 4, 64, 4, 32, sym=True, scale_dtype=torch.float32)
    a = Q4_0.assess(p)
    ref = dequantize(p, torch.float64)
    got = gguf_decode(Q4_0.pack(p)["weight"], "gguf_q4_0").to(torch.float64)
    assert a.kind == "near-exact" and a.max_error == float((got - ref).abs().max()) > 0


def test_gguf_writer_passes_a_full_disk_to_the_publisher():
    """A full disk reaches atomic_output as its OSError, which names the output and the space needed."""
    import errno

    from qtool.io.gguf_writer import GGUFTensorSpec, write_gguf

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    spec = GGUFTensorSpec("output_norm.weight", (1 << 20,), "F32", 4 << 20)
    with pytest.raises(OSError) as e:
        write_gguf(Path("/dev/full"), "llama", [spec], [np.zeros(1 << 20, np.float32)])
    assert e.value.errno == errno.ENOSPC
