"""The one-pass E4M3 dequantizer (csrc/e4m3_dequant.cpp via qtool.packing.e4m3) gives the torch path's bits:
every code byte (subnormals, +-448, both NaNs), per-tensor / per-channel / ragged 128x128 blocks, row slices,
tiny and huge fp32 scales, fp32 and bf16 outputs."""

from __future__ import annotations

import pytest
import torch

from qtool.formats.scaled import ScaledPlain, dequantize, scale_grid
from qtool.packing import e4m3
from tests.conftest import require_extension

INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.fixture
def extension(monkeypatch):
    require_extension(monkeypatch, "QTOOL_E4M3_EXT", e4m3)


@pytest.mark.parametrize("o,i,block", [(300, 520, (128, 128)), (200, 256, (-1, -1)), (130, 136, (1, -1)),
                                       (256, 384, (1, 128))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extension_equals_torch_bit_for_bit(extension, monkeypatch, o, i, block, dtype):
    g = torch.Generator().manual_seed(o + i)
    codes = torch.randint(0, 256, (o, i), dtype=torch.uint8, generator=g)
    codes[0, : min(256, i)] = torch.arange(min(256, i), dtype=torch.uint8)  # every byte, where i allows
    scales = torch.exp(torch.randn(scale_grid(o, i, block), generator=g) * 40).float()  # subnormal to huge
    p = ScaledPlain(codes.view(torch.float8_e4m3fn), "e4m3", scales, "fp32", block)
    for rows in (slice(None), slice(3, o - 7), slice(129, 130)):
        fast = dequantize(p, dtype, rows)
        monkeypatch.setenv("QTOOL_E4M3_EXT", "0")
        ref = dequantize(p, dtype, rows)
        monkeypatch.setenv("QTOOL_E4M3_EXT", "1")
        assert torch.equal(fast.view(INT[dtype]), ref.view(INT[dtype])), (rows, dtype)
        for level in range(e4m3.isa() + 1):  # the portable loop and, where the CPU has it, the AVX-512 one
            r = p.codes[rows]
            bo, group = p.block_shape
            got = e4m3.dequant_counted(r, _scales_of(p, rows), group, dtype, bo=bo,
                                       first=(rows.start or 0) % bo, level=level)
            assert torch.equal(got[0].view(INT[dtype]), ref.view(INT[dtype])), (rows, dtype, level)
            assert got[1] == int(((r.view(torch.uint8) & 0x7F) == 0x7F).sum())


def _scales_of(p, rows):
    from qtool.formats.scaled import effective_scales

    return effective_scales(p, rows)


def test_extension_declines_what_it_does_not_compute(extension):
    q = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    assert e4m3.dequant(q, torch.ones(4, 1), 8, torch.float16) is None  # fp16 out: torch's
    assert e4m3.dequant(q, torch.ones(4, 1, dtype=torch.bfloat16), 8, torch.float32) is None  # bf16 scales
    assert e4m3.dequant(q, torch.ones(2, 1), 8, torch.float32) is None  # scales not one row per code row
    assert e4m3.dequant(q, torch.ones(4, 1), 8, torch.float32) is not None


def test_count_masked_counts_what_numpy_counts(extension):
    g = torch.Generator().manual_seed(5)
    b = torch.randint(0, 256, ((1 << 20) + 13,), dtype=torch.uint8, generator=g)
    for mask, value in ((0x7F, 0x7F), (0x7C, 0x7C)):
        want = int(((b & mask) == value).sum())
        assert e4m3.count_masked(b, mask, value) == want > 0
    assert e4m3.count_masked(torch.zeros(1 << 20, dtype=torch.uint8), 0x7F, 0x7F) == 0
