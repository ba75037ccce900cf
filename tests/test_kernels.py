"""Kernels against the float64 oracle (dequantize(plain, float64) @ x in float64), on the CPU.

Error bound (flash-attention style): a kernel's relative error may be at most ERR_FACTOR times the error of
the same-precision torch baseline (weight dequantized and rounded to the activation dtype, F.linear).
Outputs are poisoned with NaN before each call, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qtool.bench.layers import random_plain
from qtool.errors import FormatError, UsageError
from qtool.formats import get_format
from qtool.formats.plain import dequantize
from qtool.kernels.base import (
    PackedLayer,
    all_kernels,
    dequantize_packed,
    get_kernel,
    pack_gptq_v2,
)
from qtool.kernels.devices import cuda_index, torch_device
from qtool.scheme import QuantScheme
from tests.oracles.layouts import stream_decode

ERR_FACTOR = 4.0
CPU = torch.device("cpu")

# (N, K, group_size, act_order, sym): N not a multiple of 64, K = group x odd, act-order, one group.
AWKWARD = [
    (96, 192, 64, False, False),
    (96, 192, 64, True, False),
    (48, 160, 32, False, True),
    (112, 96, 32, True, True),
    (80, 128, -1, False, False),
    (64, 384, 128, True, False),
]


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has NaN/inf (unwritten or overflow)"
    return float((y.double() - ref).norm() / ref.norm())


def check_kernel(name: str, n, k, g, act, sym, dtype, m=5, seed=0, bits=4):
    plain = random_plain(n, k, bits=bits, group_size=g, act_order=act, sym=sym, dtype=dtype, seed=seed)
    layer = PackedLayer.from_plain(plain)
    kern = get_kernel(name)
    assert kern.check(layer, dtype, CPU) == []
    state = kern.prepare(layer)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = x.double() @ dequantize(plain, torch.float64).t()
    base = rel(F.linear(x.float(), dequantize(plain, dtype).float()).to(dtype), ref)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = kern.forward(x, state, out=out)
    assert y.shape == (m, n) and y.dtype == dtype
    err = rel(y, ref)
    assert err <= ERR_FACTOR * base, f"{name} {n}x{k} g{g} act={act}: err {err:.3g} vs baseline {base:.3g}"
    y2 = kern.forward(x, state)  # the allocating path gives the same values
    assert torch.equal(y2, y)
    return err, base


def test_device_packer_matches_gptq_v2_format():
    for n, k, g, act, sym in AWKWARD:
        plain = random_plain(n, k, group_size=g, act_order=act, sym=sym, seed=3)
        ref = get_format("gptq_v2").pack(plain)
        mine = pack_gptq_v2(plain)
        assert torch.equal(mine.qweight, ref["qweight"])
        assert torch.equal(mine.qzeros, ref["qzeros"])
        assert torch.equal(mine.scales, ref["scales"])
        assert (mine.g_idx is not None) == act
        if act:
            assert torch.equal(mine.g_idx, ref["g_idx"])


def test_dequantize_packed_is_plain_dequantize():
    for n, k, g, act, sym in AWKWARD:
        plain = random_plain(n, k, group_size=g, act_order=act, sym=sym, seed=4)
        layer = PackedLayer.from_plain(plain)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            assert torch.equal(dequantize_packed(layer, dt).t(), dequantize(plain, dt))


@pytest.mark.parametrize("shape", AWKWARD)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_ref_vs_oracle(shape, dtype):
    err, base = check_kernel("torch-ref", *shape, dtype)
    assert err == pytest.approx(base, rel=0.05)  # it is the baseline (up to summation order)


@pytest.mark.parametrize("shape", [s for s in AWKWARD if s[2] == -1 or s[2] % 32 == 0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_int4_cpu_vs_oracle(shape, dtype):
    kern = get_kernel("torch-int4-cpu")
    if kern.available(CPU):
        pytest.skip(kern.available(CPU))
    n, k, g, act, sym = shape
    if g == -1 and k % 32:
        pytest.skip("one group of K rows needs K % 32 == 0")
    check_kernel("torch-int4-cpu", n, k, g, act, sym, dtype)


def test_torch_int4_cpu_affine_offset_matters():
    """The zero offset handed to ATen is (8 - z) * s; handing it the raw zero code gives wrong results."""
    kern = get_kernel("torch-int4-cpu")
    if kern.available(CPU):
        pytest.skip(kern.available(CPU))
    plain = random_plain(64, 256, group_size=64, dtype=torch.float32, seed=5)
    st = kern.prepare(PackedLayer.from_plain(plain))
    x = torch.randn(3, 256)
    ref = x.double() @ dequantize(plain, torch.float64).t()
    assert rel(kern.forward(x, st), ref) < 1e-5
    zeros = plain.zeros.t().to(torch.float32)  # [G, N]
    wrong = st.scale_offset.clone()
    wrong[..., 1] = zeros.repeat_interleave(64 // st.qgroup, 0)
    bad = torch.ops.aten._weight_int4pack_mm_for_cpu(x, st.packed, st.qgroup, wrong)
    assert rel(bad, ref) > 0.1


def test_refusals_name_the_constraint():
    plain3 = random_plain(64, 256, bits=8, group_size=64, seed=6)
    layer8 = PackedLayer.from_plain(plain3)
    why = get_kernel("torch-int4-cpu").check(layer8, torch.float16, CPU)
    assert any("4-bit" in w and "8-bit" in w for w in why)
    why = get_kernel("triton-w4a16").check(layer8, torch.float16, CPU)
    assert any("8-bit" in w for w in why)
    odd = PackedLayer.from_plain(random_plain(64, 192, group_size=48, seed=7))
    why = get_kernel("torch-int4-cpu").check(odd, torch.float16, CPU)
    assert any("multiple of 32" in w for w in why)
    # torch-ref reads 8-bit words too, and agrees with the oracle
    kern = get_kernel("torch-ref")
    assert kern.check(layer8, torch.float16, CPU) == []
    x = torch.randn(2, 256, dtype=torch.float16)
    ref = x.double() @ dequantize(plain3, torch.float64).t()
    base = rel(F.linear(x.float(), dequantize(plain3, torch.float16).float()).half(), ref)
    assert rel(kern.forward(x, kern.prepare(layer8)), ref) <= ERR_FACTOR * base


def test_act_order_with_uneven_groups_refused_by_int4_cpu():
    plain = random_plain(64, 256, group_size=64, act_order=True, seed=8)
    g = plain.g_idx.clone()
    g[:2] = 0  # group 0 now has more than 64 rows; sorting cannot make groups of 64
    layer = PackedLayer.from_plain(plain.with_(g_idx=g))
    why = get_kernel("torch-int4-cpu").check(layer, torch.float16, CPU)
    assert any("exactly 64 rows" in w for w in why)


def test_registry_and_device_errors():
    names = set(all_kernels())
    assert {"torch-ref", "torch-int4-cpu", "triton-w4a16"} <= names
    with pytest.raises(UsageError, match="unknown kernel"):
        get_kernel("marlin-9000")
    assert torch_device("cpu") == CPU
    if not torch.cuda.is_available():
        from qtool.errors import DeviceError

        with pytest.raises(DeviceError, match="no CUDA"):
            torch_device("cuda:0")
        why = get_kernel("triton-w4a16").available(torch.device("cuda"))
        assert why is None or "cuda" in why.lower() or "compute capability" in why


def test_cuda_index_names_the_ordinal_and_bare_cuda_the_current_device(monkeypatch):
    assert cuda_index(torch.device("cuda", 3)) == 3
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert cuda_index(torch.device("cuda")) == 5


def test_triton_unavailable_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = get_kernel("triton-w4a16").available(CPU)
    assert why and "TRITON_INTERPRET" in why


# (bits, N, K, group_size, act_order, sym): every width qtool writes; K a whole number of packing runs but not of
# 32 codes where the width allows (2/4/8-bit), odd N everywhere (qzeros padded to whole runs).
EVERY_BITS = [
    (2, 37, 48, 16, False, False),
    (2, 9, 80, -1, True, True),
    (3, 33, 96, 32, False, False),
    (3, 45, 160, 32, True, False),
    (4, 41, 40, -1, False, False),
    (4, 7, 72, 24, True, True),
    (5, 35, 96, 32, False, False),
    (5, 1, 64, -1, False, True),
    (6, 39, 160, 32, True, False),
    (6, 64, 96, 48, False, True),
    (7, 31, 96, 32, False, False),
    (7, 17, 192, 64, True, True),
    (8, 13, 36, 12, False, False),
    (8, 3, 20, -1, True, True),
]


def _oracle_codes(layer: PackedLayer) -> tuple[np.ndarray, np.ndarray]:
    """codes [K, N] and zeros [G, N] read from the layer's words by the bit-by-bit oracle decoder."""
    b, n = layer.bits, layer.out_features
    codes = stream_decode(layer.qweight.numpy(), b, layer.in_features)
    nz = layer.qzeros.shape[1] * 32 // b  # N padded to whole runs
    zeros = stream_decode(layer.qzeros.t().contiguous().numpy(), b, nz).T[:, :n]
    return codes, zeros


@pytest.mark.parametrize("case", EVERY_BITS, ids=lambda c: f"b{c[0]}-{c[1]}x{c[2]}-g{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_ref_every_bits_vs_oracle(case, dtype):
    b, n, k, g, act, sym = case
    plain = random_plain(n, k, bits=b, group_size=g, act_order=act, sym=sym, dtype=dtype, seed=20 + b)
    layer = PackedLayer.from_plain(plain)
    assert layer.bits == b and (layer.out_features, layer.in_features) == (n, k)
    # the words hold the Plain's codes and zeros, as the independent stream decoder reads them
    codes, zeros = _oracle_codes(layer)
    assert np.array_equal(codes, plain.qweight.t().numpy())
    assert np.array_equal(zeros, plain.zeros_or_midpoint().t().numpy())
    for dt in (torch.float32, dtype):
        assert torch.equal(dequantize_packed(layer, dt).t(), dequantize(plain, dt))
    err, base = check_kernel("torch-ref", n, k, g, act, sym, dtype, bits=b, seed=20 + b)
    assert err == pytest.approx(base, rel=0.05)
    # the same layer read back from its tensors, as a checkpoint would give them
    t = {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales}
    if layer.g_idx is not None:
        t["g_idx"] = layer.g_idx
    again = PackedLayer.from_tensors(t, b, g)
    assert again.in_features == k and torch.equal(dequantize_packed(again, torch.float32),
                                                  dequantize_packed(layer, torch.float32))


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_gptq_writers_and_torch_ref_agree_on_straddling_widths(bits):
    """Where a qtool format writes the width in the continuous stream (gptq/gptq_v2 3-bit), the layer's words
    are the format's bytes; 5/6/7-bit are written planar (gptq_p), whose Plain runs through torch-ref."""
    plain = random_plain(64, 128, bits=bits, group_size=32, seed=bits)
    layer = PackedLayer.from_plain(plain)
    if bits == 3:
        ref = get_format("gptq_v2").pack(plain)
        assert torch.equal(layer.qweight, ref["qweight"]) and torch.equal(layer.qzeros, ref["qzeros"])
    # a gptq_p (planar) pack of the same Plain, unpacked by its format, runs through torch-ref unchanged
    p2 = get_format("gptq_p").unpack(get_format("gptq_p").pack(plain), QuantScheme(bits=bits, group_size=32))
    assert torch.equal(dequantize_packed(PackedLayer.from_plain(p2), torch.float32),
                       dequantize_packed(layer, torch.float32))


def test_packed_layer_refuses_what_it_cannot_hold():
    with pytest.raises(FormatError, match="K=48 is not a multiple of 32"):
        PackedLayer.from_plain(random_plain(8, 48, bits=3, group_size=16))
    layer = PackedLayer.from_plain(random_plain(33, 64, bits=5, group_size=32))
    assert layer.qzeros.shape == (2, 10)  # 33 zeros padded to 64: 2 runs of 5 words
    t = {"qweight": layer.qweight, "qzeros": layer.qzeros[:, :5], "scales": layer.scales}
    with pytest.raises(FormatError, match="shapes disagree"):
        PackedLayer.from_tensors(t, 5, 32)
    t = {"qweight": layer.qweight[:7], "qzeros": layer.qzeros, "scales": layer.scales}
    with pytest.raises(FormatError, match="not whole runs of 32 5-bit codes"):
        PackedLayer.from_tensors(t, 5, 32)
    with pytest.raises(FormatError, match="2..8-bit"):
        PackedLayer.from_tensors({"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales}, 9, 32)
    # the 4-bit-only kernels still say so, and triton names the odd N
    why = get_kernel("triton-w4a16").check(PackedLayer.from_plain(random_plain(41, 64, group_size=32)),
                                           torch.float16, CPU)
    assert any("N=41" in w for w in why)
    assert any("5-bit" in w for w in get_kernel("torch-int4-cpu").check(layer, torch.float16, CPU))


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_bench_runs_every_width_through_torch_ref(bits):
    """`qtool bench --bits B` checks torch-ref against the float64 oracle for the widths no fast kernel reads,
    on an N that is no multiple of a packing run."""
    import json

    from typer.testing import CliRunner

    import qtool.cli.main  # noqa: F401  (registers the commands)
    from qtool.cli.app import app

    r = CliRunner().invoke(app, ["bench", "--device", "cpu", "--bits", str(bits), "--group-size", "32", "--shapes",
                                 "96x45", "--batch-sizes", "3", "--seconds", "0.02", "--kernels", "torch-ref",
                                 "--json", "-"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    rows = [x for x in json.loads(r.stdout)["results"] if x["kernel"] == "torch-ref"]
    assert rows and all(x["status"] == "ok" for x in rows), rows
    assert all(x["rel_err"] <= ERR_FACTOR * x["baseline_rel_err"] for x in rows)


@pytest.mark.parametrize("bits,fmt", [(3, "gptq"), (5, "gptq_p"), (6, "gptq_p"), (7, "gptq_p"), (2, "gptq_v2")])
def test_select_finds_torch_ref_for_every_width_qtool_writes(bits, fmt):
    """The declaration agrees with the kernel: `qtool select --engine qtool` has a kernel for every pack."""
    from qtool.kernels.devices import profile
    from qtool.kernels.select import LayerQuant, select_kernel
    from qtool.scheme import QuantScheme

    layer = LayerQuant(name="layer", in_features=4096, out_features=4104,
                       scheme=QuantScheme(fmt, bits, 128, False, True), act_dtype="bfloat16", parallel="column")
    for dev in ("cpu", "h100"):
        sel = select_kernel(layer, profile(dev), "qtool")
        assert sel.chosen == "torch-ref", sel
    assert bits in get_kernel("torch-ref").bits
