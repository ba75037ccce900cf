"""Kernels over the float/int8 canonical form on the CPU: torch-ref for every ScaledPlain scheme, the FP8
scaled-matmul kernels' declarations, refusals, error bound and arithmetic (GPU runs: test_kernels_fp8_gpu.py).

torch's CPU `_scaled_mm` runs the tensor-wise and row-wise recipes, so the kernels' forward math (scales in
the GEMM's layouts, activations quantized per token or per tensor) is checked here against the oracle too;
the block-wise recipe is CUDA-only, so its operands are checked by an emulation of what cuBLAS computes from
them. The kernels themselves are declared for CUDA only: on the CPU they refuse, with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qtool.bench.layers import random_scaled
from qtool.formats.scaled import E2M1_VALUES, ScaledPlain, dequantize
from qtool.kernels.base import PackedLayer, ScaledLayer, get_kernel, layer_for
from qtool.kernels.decls import load_engine
from qtool.kernels.devices import profile
from qtool.kernels.scaled_mm import (
    E4M3_MAX,
    MIN_AMAX,
    act_quant_torch,
    block_weight_scales,
    quantize_activations,
)
from qtool.kernels.select import LayerQuant, select_kernel
from qtool.quant.scaled import quantize_scaled
from qtool.scheme import QuantScheme
from qtool.validate import kernelcheck

CPU = torch.device("cpu")
FP8_KERNELS = ("scaled-mm-fp8", "scaled-mm-fp8-tensor", "scaled-mm-fp8-block", "cuda-fp8", "cuda-fp8-block")


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _nvfp4(n: int, k: int, seed: int = 0) -> ScaledPlain:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 16, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    return ScaledPlain(codes, "e2m1", scales, "e4m3", (1, 16), global_scale=torch.tensor([3.0]),
                       global_op="div", out_dtype="bfloat16")


def _mxfp4(n: int, k: int, seed: int = 0) -> ScaledPlain:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 131, (n, k // 32), generator=g, dtype=torch.uint8)
    return ScaledPlain(codes, "e2m1", scales, "e8m0", (1, 32), out_dtype="bfloat16")


def _int8_asym(n: int, k: int) -> ScaledPlain:
    p = quantize_scaled(torch.randn(n, k), "int8", block=(1, -1), scale_type="bf16", compute="bfloat16",
                        out_dtype="bfloat16")
    zeros = torch.randint(-3, 4, tuple(p.scales.shape), dtype=torch.int8)
    return p.with_(zeros=zeros)


SCHEMES = {
    "fp8-tensor": lambda: quantize_scaled(torch.randn(96, 160), "e4m3", block=(-1, -1)),
    "fp8-channel-bf16": lambda: quantize_scaled(torch.randn(96, 160), "e4m3", block=(1, -1), scale_type="bf16",
                                                compute="bfloat16"),
    "fp8-block-ragged": lambda: quantize_scaled(torch.randn(200, 300), "e4m3", block=(128, 128)),
    "e5m2-channel": lambda: quantize_scaled(torch.randn(64, 96), "e5m2", block=(1, -1)),
    "int8-channel": lambda: quantize_scaled(torch.randn(96, 160), "int8", block=(1, -1)),
    "int8-asym": lambda: _int8_asym(48, 128),
    "nvfp4": lambda: _nvfp4(64, 128),
    "mxfp4": lambda: _mxfp4(64, 128),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_torch_ref_runs_every_scaled_scheme_against_the_oracle(scheme):
    plain = SCHEMES[scheme]()
    layer = layer_for(plain)
    assert isinstance(layer, ScaledLayer) and layer.K == plain.in_features and layer.N == plain.out_features
    ref_k = get_kernel("torch-ref")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert ref_k.check(layer, dtype, CPU) == []
        x = torch.randn(7, plain.in_features).to(dtype)
        y64 = x.double() @ dequantize(plain, torch.float64).t()
        base = _rel(F.linear(x.float(), dequantize(plain, dtype).float()).to(dtype), y64)
        out = torch.full((7, plain.out_features), float("nan"), dtype=dtype)
        y = ref_k.forward(x, ref_k.prepare(layer), out=out)
        assert torch.isfinite(out).all()
        assert _rel(y, y64) <= ref_k.error_factor(dtype) * max(base, torch.finfo(dtype).eps / 16)


@pytest.mark.parametrize("scheme", ["fp8-tensor", "nvfp4", "int8-asym"])
def test_validate_kernel_check_runs_scaled_layers(scheme):
    plain = SCHEMES[scheme]()
    run, refused = kernelcheck.eligible(plain, CPU)
    assert [k.id for k, _ in run] == ["torch-ref"]
    why = dict(refused)
    for kid in FP8_KERNELS:
        assert "runs on cuda, not cpu" in why[kid]
    assert "integer GPTQ v2 words only" in why["torch-int4-cpu"]
    status, detail, numbers = kernelcheck.run_kernel(run[0][0], run[0][1], plain, CPU, (1, 5))
    assert status == "pass", detail
    assert "no dense weight kept" in detail and numbers["worst_err"] <= numbers["worst_bound"]
    assert kernelcheck.describe_layer(plain).startswith(f"[{plain.out_features}, {plain.in_features}]")


def test_validate_kernel_check_fails_a_wrong_scaled_kernel(monkeypatch):
    plain = SCHEMES["fp8-channel-bf16"]()
    kern = get_kernel("torch-ref")
    layer = layer_for(plain)
    real = kern.forward
    monkeypatch.setattr(type(kern), "forward", lambda self, x, st, out=None: real(x, st, out) * 1.01)
    status, detail, _ = kernelcheck.run_kernel(kern, layer, plain, CPU, (1, 4))
    assert status == "fail" and "error" in detail


def test_fp8_codes_are_not_a_dense_copy_but_16_bit_weights_are():
    plain = SCHEMES["fp8-tensor"]()
    assert kernelcheck.dense_copies(layer_for(plain), plain.out_features, plain.in_features) == []
    dense = {"w": dequantize(plain, torch.bfloat16)}
    assert kernelcheck.dense_copies(dense, plain.out_features, plain.in_features)


# --- the FP8 kernels: declarations and refusals -------------------------------------------------------

def test_fp8_kernels_refuse_what_they_cannot_run_with_the_reason():
    cuda = torch.device("cuda")
    tensor = ScaledLayer(random_scaled(64, 200, strategy="tensor"))
    why = get_kernel("scaled-mm-fp8").check(tensor, torch.bfloat16, cuda)
    assert any("K=200 is not a multiple of 16" in w for w in why)
    channel = ScaledLayer(random_scaled(100, 256, strategy="channel"))
    why = get_kernel("scaled-mm-fp8-tensor").check(channel, torch.bfloat16, cuda)
    assert any("reads tensor weight scales, not channel scales" in w for w in why)
    assert any("N=100 is not a multiple of 16" in w for w in why)
    block = ScaledLayer(random_scaled(256, 200, strategy="block"))
    why = get_kernel("scaled-mm-fp8-block").check(block, torch.bfloat16, cuda)
    assert any("K=200 is not a multiple of 128" in w for w in why)
    why = get_kernel("scaled-mm-fp8").check(block, torch.bfloat16, cuda)
    assert any("not 128x128 block scales" in w for w in why)
    for plain, text in ((SCHEMES["nvfp4"](), "not e2m1 codes"), (SCHEMES["int8-asym"](), "not int8 codes")):
        assert any(text in w for w in get_kernel("scaled-mm-fp8").check(layer_for(plain), torch.bfloat16, cuda))
    gptq = PackedLayer.from_tensors({"qweight": torch.zeros(4, 16, dtype=torch.int32),
                                     "qzeros": torch.zeros(1, 2, dtype=torch.int32),
                                     "scales": torch.ones(1, 16, dtype=torch.float16)}, 4, -1)
    assert any("not 4-bit integer GPTQ words" in w
               for w in get_kernel("scaled-mm-fp8").check(gptq, torch.float16, cuda))
    assert any("not e4m3 codes" in w for w in get_kernel("triton-w4a16").check(tensor, torch.float16, cuda))
    for kid in FP8_KERNELS:
        assert "runs on cuda, not cpu" in get_kernel(kid).available(CPU)


def test_cuda_fp8_refuses_what_its_w8a8_path_cannot_run():
    """cuda-fp8 takes every M, so it keeps the scaled-mm kernel's refusals for the M > 8 path."""
    cuda = torch.device("cuda")
    block = ScaledLayer(random_scaled(256, 200, strategy="block"))
    assert any("K=200 is not a multiple of 128" in w for w in get_kernel("cuda-fp8-block").check(block, torch.bfloat16, cuda))
    tensor = ScaledLayer(random_scaled(64, 200, strategy="tensor"))
    assert any("K=200 is not a multiple of 16" in w for w in get_kernel("cuda-fp8").check(tensor, torch.bfloat16, cuda))
    assert get_kernel("cuda-fp8").error_factor(torch.bfloat16) == get_kernel("scaled-mm-fp8").error_factor(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(1024, 8192), (8192, 8192), (28672, 8192), (8192, 28672), (1024, 4096),
                                 (14336, 4096), (48, 144), (5120, 27648), (16, 128)])
@pytest.mark.parametrize("n_sm", [132, 78, 16])
def test_fp8_gemv_plan_covers_k_once_and_fills_its_waves(n, k, n_sm):
    from qtool.kernels.cuda_fp8 import WARPS_PER_SM, plan

    pl = plan(1, n, k, n_sm)
    nsteps = -(-k // 128)
    assert pl.tiles * 16 >= n > (pl.tiles - 1) * 16
    assert (pl.splits - 1) * pl.steps < nsteps <= pl.splits * pl.steps  # every step once, no empty split
    assert pl.warps in (4, 8)
    wave = n_sm * WARPS_PER_SM
    warps = pl.tiles * pl.splits * pl.warps
    fill = warps / wave / -(-warps // wave)
    for w in (4, 8):  # no other width (with its own splits) fills the waves better
        other = plan(1, n, k, n_sm, warps=w)
        ow = other.tiles * other.splits * w
        assert round(ow / wave / -(-ow // wave), 2) <= round(fill, 2)
    if pl.splits > 1:  # split only where the tiles alone leave most of a wave idle
        assert pl.tiles * pl.warps * 2 <= wave
    forced = plan(1, n, k, n_sm, warps=8, splits=3)
    assert (forced.warps, forced.splits) == (8, min(3, nsteps))


def test_fp8_gemv_plan_on_the_h200_shapes():
    """The H200 choices the tuning run measured as best or within 3 % (benchmarks/results/fp.md)."""
    from qtool.kernels.cuda_fp8 import plan

    def got(n, k):
        p = plan(1, n, k, 132)
        return p.warps, p.splits

    assert got(8192, 28672) == (8, 1)   # Llama-3-70B down: 512 tiles x 8 warps, 0.97 of a wave
    assert got(5120, 27648) == (4, 3)   # Qwen2.5-32B down: 4 warps x 3 splits, 0.91 (8 x 1: 0.61)
    assert got(28672, 8192) == (4, 1)   # 70B gate/up: 1.7 waves either way, fewer CTAs
    assert got(1024, 8192) == (8, 8)    # 70B k/v: 64 tiles, K split 8 ways


def test_fp8_error_bound_is_derived_from_the_unit_roundoffs():
    k = get_kernel("scaled-mm-fp8")
    # 2 * u(e4m3) / u(dtype): 2 * 2^-4 / 2^-8 and 2 * 2^-4 / 2^-11
    assert k.error_factor(torch.bfloat16) == 32.0 and k.error_factor(torch.float16) == 256.0
    assert get_kernel("torch-ref").error_factor(torch.bfloat16) == 4.0


def test_fp8_declarations_and_select():
    q = load_engine("qtool")
    row, blk = q.kernel("scaled-mm-fp8"), q.kernel("scaled-mm-fp8-block")
    assert row.min_cc == (8, 9) and row.scales == ("tensor", "channel") and row.k_part_multiple == 16
    assert blk.exact_cc == ((9, 0),) and blk.blocks == ((128, 128),) and blk.k_part_multiple == 128
    for fmt in ("fp8", "ct_fp8", "ct_int8", "nvfp4", "mxfp4"):
        assert fmt in q.kernel("torch-ref").formats

    def fp8(scale, K=8192, N=1024, **kw):
        return LayerQuant("l", K, N, QuantScheme("fp8", 8, -1, True, False), act_dtype="bfloat16", scale=scale, **kw)

    h100, a100, l40s, b200 = (profile(n) for n in ("h100", "a100", "l40s", "b200"))
    # cuda-fp8 (the GEMV at M <= 8, else the scaled-mm path) ranks above the scaled-mm kernel it extends
    assert q.kernel("cuda-fp8").formats["fp8"] > row.formats["fp8"] > q.kernel("scaled-mm-fp8-tensor").formats["fp8"]
    sel = select_kernel(fp8("tensor"), h100, "qtool")
    ok = [c.kernel for c in sel.candidates if c.ok]
    assert sel.chosen == "cuda-fp8" and ok[:2] == ["cuda-fp8", "scaled-mm-fp8"]
    assert select_kernel(fp8("channel"), l40s, "qtool").chosen == "cuda-fp8"
    sel = select_kernel(fp8("block", block=(128, 128)), h100, "qtool")
    assert sel.chosen == "cuda-fp8-block"
    sel = select_kernel(fp8("block", block=(128, 128)), b200, "qtool")
    assert sel.chosen == "torch-ref"
    for kid in ("cuda-fp8-block", "scaled-mm-fp8-block"):
        assert "CC 10.0 != 9.0" in next(c.reason for c in sel.candidates if c.kernel == kid)
    sel = select_kernel(fp8("tensor"), a100, "qtool")
    assert sel.chosen == "torch-ref"
    for kid in ("cuda-fp8", "scaled-mm-fp8"):
        assert "CC 8.0 < 8.9" in next(c.reason for c in sel.candidates if c.kernel == kid)
    sel = select_kernel(fp8("tensor", N=1000), h100, "qtool")
    assert sel.chosen == "torch-ref"
    assert "N 1000 % 16 != 0" in next(c.reason for c in sel.candidates if c.kernel == "scaled-mm-fp8")


# --- the arithmetic: activation quantization and the GEMM operands ------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_act_quant_per_token_reconstructs_within_e4m3_rounding(dtype):
    x = (torch.randn(6, 256) * torch.logspace(-2, 2, 256)).to(dtype)
    x[3] = 0
    q, s = quantize_activations(x, "token")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1) and s.dtype == torch.float32
    assert torch.equal(s[:, 0], x.float().abs().amax(1).clamp_min(MIN_AMAX) / E4M3_MAX)
    assert float(q.float().abs().max()) == E4M3_MAX
    xr = q.float() * s
    assert torch.equal(xr[3], torch.zeros(256))
    rows = [r for r in range(6) if r != 3]
    err = (xr[rows] - x[rows].float()).abs()
    # half a step of E4M3 (3 mantissa bits) of each value, or half the smallest subnormal step 2^-9 * scale
    bound = torch.maximum(x[rows].float().abs() * 2.0 ** -4, s[rows] * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all())


def test_act_quant_of_no_rows_is_one_padded_row_at_the_floor_scale():
    x = torch.empty(0, 256, dtype=torch.float16)
    for act in ("token", "tensor", "group"):
        q, s = quantize_activations(x, act)
        assert q.shape == (1, 256) and torch.equal(q.float(), torch.zeros(1, 256)), act
        assert bool((s > 0).all()) and bool(torch.isfinite(s).all()), act


def test_act_quant_tensor_and_group_layouts():
    x = torch.randn(5, 384, dtype=torch.bfloat16)
    q, s = quantize_activations(x, "tensor")
    assert s.shape == () and torch.equal(s, x.float().abs().max() / E4M3_MAX)  # fp32 division, as the kernel
    q, s = quantize_activations(x, "group", pad_rows=4)
    assert q.shape == (8, 384) and s.shape == (8, 3) and s.stride() == (1, 8)  # outer-dim-major, M padded
    assert torch.equal(q[5:].float(), torch.zeros(3, 384))
    g = x.float().view(5, 3, 128).abs().amax(-1) / E4M3_MAX
    assert torch.equal(s[:5], g)
    out_q = torch.empty(5, 384, dtype=torch.float8_e4m3fn)
    out_s = torch.empty(5, 1)
    act_quant_torch(x, out_q, out_s, 384)
    assert torch.equal(out_q.view(torch.uint8), quantize_activations(x, "token")[0].view(torch.uint8))


@pytest.mark.parametrize("kid,strategy", [("scaled-mm-fp8", "tensor"), ("scaled-mm-fp8", "channel"),
                                          ("scaled-mm-fp8-tensor", "tensor")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_forward_math_on_cpu_scaled_mm(kid, strategy, dtype):
    """The tensor-/row-wise forwards through torch's CPU _scaled_mm: within k of the baseline, poisoned output
    fully written, and the error ratio near the derivation's u8 / (sqrt 2 u16) (the bound is not vacuous)."""
    kern = get_kernel(kid)
    plain = random_scaled(80, 272, strategy=strategy, dtype=dtype, seed=3)
    st = kern.prepare(ScaledLayer(plain))
    assert st.w_t.data_ptr() == plain.codes.data_ptr()
    ratios = []
    for m in (1, 3, 33):
        x = torch.randn(m, 272).to(dtype)
        y64 = x.double() @ dequantize(plain, torch.float64).t()
        base = _rel(F.linear(x, dequantize(plain, dtype)), y64)
        out = torch.full((m, 80), float("nan"), dtype=dtype)
        y = kern.forward(x, st, out=out)
        assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
        err = _rel(out, y64)
        assert err <= kern.error_factor(dtype) * base, (m, err, base)
        ratios.append(err / base)
    assert max(ratios) >= kern.error_factor(dtype) / 16  # within 16x of the bound: the bound means something


def test_block_operands_emulated_match_the_oracle():
    """What cuBLAS's 1x128 x 128x128 GEMM computes from the operands the block kernel passes, emulated in
    float64: y[m, n] = sum over k-blocks of sa[m, kb] * sb[kb, nb] * (q_x[m, kblock] . q_w[n, kblock])."""
    kern = get_kernel("scaled-mm-fp8-block")
    plain = random_scaled(256, 1280, strategy="block", dtype=torch.bfloat16, seed=5)  # K/128 = 10 -> padded 12
    st = kern.prepare(ScaledLayer(plain))
    assert st.scale_b.shape == (12, 2) and st.scale_b.stride() == (1, 12)
    assert torch.equal(block_weight_scales(plain.scales)[:10], plain.scales.t())
    x = torch.randn(3, 1280).to(torch.bfloat16)
    q, sa = quantize_activations(x, "group", pad_rows=4)
    qx = q.double().view(4, 10, 128)
    qw = st.w_t.t().double().view(256, 10, 128)
    partial = torch.einsum("mkc,nkc->mnk", qx, qw)  # [M, N, K blocks]
    sw = st.scale_b[:10].double().repeat_interleave(128, 1)  # [K blocks, N]
    y = (partial * sa.double().unsqueeze(1) * sw.t().unsqueeze(0)).sum(-1)[:3]
    y64 = x.double() @ dequantize(plain, torch.float64).t()
    base = _rel(F.linear(x, dequantize(plain, torch.bfloat16)), y64)
    assert _rel(y, y64) <= kern.error_factor(torch.bfloat16) * base


def test_e2m1_values_table_is_what_torch_ref_reads():
    plain = _mxfp4(32, 64)
    w = dequantize(plain, torch.float64)
    s = 2.0 ** (plain.scales.double() - 127)
    expect = torch.tensor(E2M1_VALUES, dtype=torch.float64)[plain.codes.long()] * s.repeat_interleave(32, 1)
    assert torch.equal(w, expect)


def test_validate_runs_torch_ref_on_compressed_tensors_fp8_and_int8(fixtures_dir):
    """`qtool validate --checks kernels` decodes the compressed-tensors fixtures to ScaledPlain and runs the
    kernels that take them on the CPU (torch-ref), against the float64 oracle."""
    from qtool.validate.core import ValidateOptions, validate_path

    for name in ("compressed-tensors-fp8", "compressed-tensors-int8"):
        rep = validate_path(fixtures_dir / "ct-float" / name, ValidateOptions(checks=("kernels",), device="cpu"))
        runs = [c for c in rep.checks if c.name == "kernels" and c.status == "pass"]
        assert runs and all("torch-ref" in c.detail for c in runs), [c.detail for c in rep.checks]
        assert not [c for c in rep.checks if c.status == "fail"]


# --- csrc/fp8_gemv.cu emulated lane by lane (its arithmetic and fragment order, on the CPU) ------------

def _e4m3_hi_pair(q: np.ndarray, bf16: bool) -> np.ndarray:
    """e4m3_hi_pair: the codes in bytes 1 and 3 of q spliced into 16-bit floats, then times 2^8 / 2^120."""
    from tests.test_mma_tiles import _fma_bf16, _fma_f16

    q = q.astype(np.uint32)
    h = (q & np.uint32(0x80008000)) | ((q & np.uint32(0x7F007F00)) >> np.uint32(4 if bf16 else 1))
    return (_fma_bf16 if bf16 else _fma_f16)(h, np.uint32(0x7B807B80 if bf16 else 0x5C005C00), np.uint32(0x80008000))


@pytest.mark.parametrize("bf16", [False, True])
def test_fp8_gemv_splice_is_exact_for_every_finite_code(bf16):
    from tests.test_mma_tiles import _pair_values

    codes = np.arange(256, dtype=np.uint32)
    finite = (codes & 0x7F) != 0x7F
    want = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    for shift in (8, 24):  # the code as byte 1 (low half) or byte 3 (high half) of the word
        got = _pair_values([_e4m3_hi_pair(codes << np.uint32(shift), bf16)], bf16)[0 if shift == 8 else 1]
        assert np.array_equal(got[finite], want[finite])  # subnormals and both zeros included
        assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize("bf16", [False, True])
def test_fp8_gemv_lane_fragments_reproduce_a_tile_step(bf16):
    """One warp, one 128-k step: each lane's loads (32 codes of rows r and r + 8 at k = 32 g, x of batch row r
    at the same k), the splice, the x permutation and eight m16n8k16 mmas as PTX lays out their fragments give
    the tile's product W[16, 128] @ x[M, 128]^T."""
    from tests.test_mma_tiles import _pair_values, fragment_coords

    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (16, 128), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN codes: the GEMV leaves such weights to the W8A8 path
    m = 5
    xdt = torch.bfloat16 if bf16 else torch.float16
    x = torch.randn(m, 128, generator=gen).to(xdt)
    want = x.double().numpy() @ codes.view(torch.float8_e4m3fn).double().numpy().T  # [M, 16]
    cb = codes.numpy().astype(np.uint32)
    xb = np.zeros((8, 128), dtype=np.uint32)
    xb[:m] = x.view(torch.int16).numpy().astype(np.uint16)
    d = np.zeros((16, 8))
    for h in range(2):
        for s in range(4):
            a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
            for lane in range(32):
                r, g = lane >> 2, lane & 3
                k0 = 32 * g + 16 * h + 4 * s  # the lane's four codes (one word) of this mma

                def word(row, k0=k0):
                    return cb[row, k0] | cb[row, k0 + 1] << 8 | cb[row, k0 + 2] << 16 | cb[row, k0 + 3] << 24

                fa = [_e4m3_hi_pair(np.array([v]), bf16) for v in (word(r) << 8, word(r + 8) << 8, word(r), word(r + 8))]
                vals = _pair_values(fa, bf16)[:, 0]
                for (row, kk), v in zip(fragment_coords(r, g), vals):
                    a_mat[row, kk] = v
                xa = xb[r, k0] | xb[r, k0 + 1] << 16
                xbw = xb[r, k0 + 2] | xb[r, k0 + 3] << 16
                b0 = (xa & 0xFFFF) | (xbw & 0xFFFF) << 16  # __byte_perm(xa, xb, 0x5410): (x0, x2)
                b1 = (xa >> 16) | (xbw & 0xFFFF0000)  # 0x7632: (x1, x3)
                bv = _pair_values([np.array([b0]), np.array([b1])], bf16)[:, 0]
                # PTX B fragment of lane 4 n + t: b0, b1 = B[2t, n], B[2t+1, n]; b2, b3 = B[2t+8, n], B[2t+9, n]
                for i, kk in enumerate((2 * g, 2 * g + 1, 2 * g + 8, 2 * g + 9)):
                    b_mat[kk, r] = bv[i]
            d += a_mat @ b_mat
    assert np.allclose(d[:, :m].T, want, rtol=1e-12, atol=1e-12)
    assert not d[:, m:].any()  # batch columns past M stay zero
