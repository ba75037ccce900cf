"""GPU tests of the FP8 kernels (scaled matmul, and cuda-fp8's GEMV at M <= 8) against the float64 oracle (skipped
without CUDA or FP8 GEMMs).

Each kernel, each activation dtype, awkward M and shapes: error within the kernel's declared k times the
dense same-precision baseline's, every element of a NaN-poisoned output written, a second call and a CUDA
graph replay bit-identical; the Triton activation quantizer gives the bytes of the torch one; the measured
error ratio is printed (-s) so the bound's margin is on record.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from qtool.bench.layers import random_scaled
from qtool.formats.scaled import dequantize
from qtool.kernels.base import ScaledLayer, get_kernel
from qtool.kernels.scaled_mm import act_quant_torch, quantize_activations

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (kernel, strategy, [(K, N)]): shapes multiples of the kernel's alignment, not of any tile size
CASES = [
    ("scaled-mm-fp8", "tensor", [(144, 48), (4096, 1040), (8192, 1024)]),
    ("scaled-mm-fp8", "channel", [(272, 208), (4096, 1040)]),
    ("scaled-mm-fp8-tensor", "tensor", [(144, 48), (4096, 1040)]),
    ("scaled-mm-fp8-block", "block", [(384, 256), (1280, 640), (7168, 1536)]),
    # the GEMV: a partial 128-k step (K 144, 272), K split across CTAs (N 48 and 1024: few tiles), a 16-row
    # tile past N's last 128-row block (N 1040)
    ("cuda-fp8", "tensor", [(144, 48), (4096, 1040), (8192, 1024)]),
    ("cuda-fp8", "channel", [(272, 208), (4096, 1040)]),
    ("cuda-fp8-block", "block", [(384, 256), (1280, 640), (7168, 1536)]),
]
MS = (1, 3, 8, 17, 64, 130)
# every CTA width csrc/fp8_gemv.cu builds
GEMV_WARPS = (4, 8)


def _runs_here(kid: str, layer: ScaledLayer, dtype: torch.dtype) -> list[str]:
    return get_kernel(kid).check(layer, dtype, DEV)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("kid,strategy,shapes", CASES)
def test_fp8_kernel_vs_oracle(kid, strategy, shapes, dt):
    dtype = DTYPES[dt]
    kern = get_kernel(kid)
    if kern.available(DEV):
        pytest.skip(kern.available(DEV))
    k_factor = kern.error_factor(dtype)
    for K, N in shapes:
        plain = random_scaled(N, K, strategy=strategy, dtype=dtype, device=DEV, seed=K + N)
        layer = ScaledLayer(plain)
        why = _runs_here(kid, layer, dtype)
        if why:
            pytest.skip("; ".join(why))
        st = kern.prepare(layer)
        mm = getattr(st, "mm", st)
        assert mm.w_t.data_ptr() == plain.codes.data_ptr()  # the stored codes, not a copy
        if kid.startswith("cuda-fp8"):
            assert st.gemv is not None, st.why_not
        w64 = dequantize(plain, torch.float64)
        wd = dequantize(plain, dtype)
        for m in MS:
            x = torch.randn(m, K, device=DEV, dtype=torch.float32).to(dtype)
            ref = x.double() @ w64.t()
            base = float((F.linear(x, wd).double() - ref).norm() / ref.norm())
            out = torch.full((m, N), float("nan"), device=DEV, dtype=dtype)
            y = kern.forward(x, st, out=out)
            assert y.dtype == dtype and y.shape == (m, N)
            assert torch.isfinite(out).all(), (kid, K, N, m, "unwritten or non-finite output")
            err = float((out.double() - ref).norm() / ref.norm())
            print(f"{kid} {strategy} {dt} K={K} N={N} M={m}: err {err:.4g} base {base:.4g} ratio "
                  f"{err / base:.1f} (k {k_factor:g})")
            assert err <= k_factor * base, (kid, K, N, m, err, base)
            y2 = kern.forward(x, st)
            assert torch.equal(y2, out), (kid, K, N, m, "second call differs")
            g = torch.cuda.CUDAGraph()
            gout = torch.full_like(out, float("nan"))
            with torch.cuda.graph(g):
                kern.forward(x, st, out=gout)
            gout.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(gout, out), (kid, K, N, m, "graph replay differs")


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("kid,strategy", [("cuda-fp8", "tensor"), ("cuda-fp8", "channel"),
                                          ("cuda-fp8-block", "block")])
def test_fp8_gemv_decodes_every_code_exactly(kid, strategy, dt):
    """Every finite E4M3 code (subnormals, both zeros, +-448) in every row: the GEMV's sums are the float64
    product rounded once (fp32 accumulation), so its error is the dense baseline's at most (same rounding of
    the output, exact weights in both), on one CTA per tile and with K split across CTAs."""
    from qtool.kernels.cuda_fp8 import gemv, plan

    dtype = DTYPES[dt]
    kern = get_kernel(kid)
    if kern.available(DEV):
        pytest.skip(kern.available(DEV))
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device=DEV)
    for K, N in ((256, 128), (8192, 128)):
        plain = random_scaled(N, K, strategy=strategy, dtype=dtype, device=DEV, seed=K)
        gen = torch.Generator(device=DEV).manual_seed(K)
        idx = torch.randint(0, finite.numel(), (N, K), generator=gen, device=DEV)
        idx[:, : finite.numel()] = torch.arange(finite.numel(), device=DEV)  # each row has every code
        plain = replace(plain, codes=finite[idx].view(torch.float8_e4m3fn))
        layer = ScaledLayer(plain)
        st = kern.prepare(layer)
        assert st.gemv is not None, st.why_not
        w64 = dequantize(plain, torch.float64)
        for m in (1, 2, 5, 8):
            x = torch.randn(m, K, device=DEV).to(dtype)
            ref = x.double() @ w64.t()
            base = float((F.linear(x, dequantize(plain, dtype)).double() - ref).norm() / ref.norm())
            for splits in {1, plan(m, N, K, st.gemv.n_sm).splits, 3}:
                for warps in GEMV_WARPS:
                    pl = plan(m, N, K, st.gemv.n_sm, warps=warps, splits=splits)
                    y = gemv(x, st.gemv, pl=pl)
                    err = float((y.double() - ref).norm() / ref.norm())
                    assert err <= 1.5 * base + 1e-7, (K, N, m, pl.label(), err, base)
        assert "gemv" in kern.describe(st, 8) and "x as given" in kern.describe(st, 8)
        assert "act quant" in kern.describe(st, 9) and "gemv" not in kern.describe(st, 9)


def test_fp8_gemv_chained_calls_read_each_others_outputs():
    """Each call is a programmatic dependent launch that streams its first weights before its dependency wait
    and reads x only after it: a chain of calls, each reading the last one's output, gives the bits of
    separate calls."""
    from qtool.kernels.cuda_fp8 import gemv, plan

    kern = get_kernel("cuda-fp8")
    if kern.available(DEV):
        pytest.skip(kern.available(DEV))
    for n, splits in ((1024, 1), (1024, 4)):
        st = kern.prepare(ScaledLayer(random_scaled(n, n, strategy="channel", dtype=torch.bfloat16, device=DEV, seed=n)))
        pl = plan(2, n, n, st.gemv.n_sm, splits=splits)
        x = torch.randn(2, n, device=DEV, dtype=torch.bfloat16)
        want = [x]
        for _ in range(6):
            want.append(gemv(want[-1], st.gemv, pl=pl))
            torch.cuda.synchronize()
        ys = [x]
        for _ in range(6):
            ys.append(gemv(ys[-1], st.gemv, pl=pl))
        torch.cuda.synchronize()
        for a, b in zip(ys, want):
            assert torch.equal(a, b)


def test_fp8_gemv_leaves_nan_codes_to_the_w8a8_path():
    kern = get_kernel("cuda-fp8")
    if kern.available(DEV):
        pytest.skip(kern.available(DEV))
    plain = random_scaled(64, 256, strategy="channel", device=DEV, seed=3)
    codes = plain.codes.clone().view(torch.uint8)
    codes[5, 7] = 0xFF
    st = kern.prepare(ScaledLayer(replace(plain, codes=codes.view(torch.float8_e4m3fn))))
    assert st.gemv is None and "1 E4M3 NaN codes" in st.why_not
    assert "GEMV not used: the weight holds 1 E4M3 NaN codes" in kern.describe(st, 1)
    y = kern.forward(torch.randn(1, 256, device=DEV, dtype=torch.bfloat16), st)
    assert torch.isnan(y[0, 5]) and torch.isfinite(y[0, :5]).all()


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("act,pad", [("token", 1), ("tensor", 1), ("group", 4)])
def test_triton_act_quant_matches_torch_bytes(act, pad, dt):
    pytest.importorskip("triton")
    dtype = DTYPES[dt]
    for m, k in ((1, 128), (3, 4096), (17, 28672), (64, 384)):
        x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, k, device=DEV)).to(dtype)
        x[m // 2] = 0  # a zero row: floor scale, zero codes
        q, s = quantize_activations(x, act, pad_rows=pad, use_triton=True)
        q2, s2 = quantize_activations(x, act, pad_rows=pad, use_triton=False)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), (act, m, k)
        assert torch.equal(s, s2), (act, m, k)
        assert s.stride() == s2.stride()


def test_act_quant_torch_on_gpu_matches_cpu():
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    q = torch.empty(8, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(8, 2)
    act_quant_torch(x, q, s, 128)
    qg = torch.empty(8, 256, dtype=torch.float8_e4m3fn, device=DEV)
    sg = torch.empty(8, 2, device=DEV)
    act_quant_torch(x.to(DEV), qg, sg, 128)
    assert torch.equal(q.view(torch.uint8), qg.cpu().view(torch.uint8)) and torch.equal(s, sg.cpu())


def test_fp8_refusals_name_the_reason():
    for kid, strategy, (K, N), text in (
            ("scaled-mm-fp8", "tensor", (200, 64), "K=200 is not a multiple of 16"),
            ("scaled-mm-fp8", "channel", (256, 100), "N=100 is not a multiple of 16"),
            ("scaled-mm-fp8-block", "block", (256, 200), "N=200 is not a multiple of 128"),
            ("scaled-mm-fp8-tensor", "channel", (256, 64), "not channel scales")):
        layer = ScaledLayer(random_scaled(N, K, strategy=strategy, device=DEV))
        why = get_kernel(kid).check(layer, torch.bfloat16, DEV)
        assert any(text in w for w in why), (kid, why)
