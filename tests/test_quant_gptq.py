"""GPTQ on one layer against a float64 reference of the same algorithm written here, act-order's g_idx, and
static groups."""

from __future__ import annotations

import pytest
import torch

from qtool.formats import get_format
from qtool.formats.plain import dequantize
from qtool.quant import mse, quantize
from qtool.quant.gptq import Hessian, gptq_quantize, group_aware_order
from qtool.quant.rtn import group_params


def _layer(o=48, i=128, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(o, i, generator=g)
    # correlated inputs with a few loud channels: where GPTQ's error feedback matters
    X = torch.randn(n, i, generator=g) @ (torch.eye(i) + 0.3 * torch.randn(i, i, generator=g))
    X[:, :4] *= 8
    return W, X


def reference_gptq(W, X, bits, G, sym, act_order=False, damp=0.01, perm=None, clip=False):
    """Column by column in float64 with the same conventions (scales rounded to fp16 first, group parameters
    from the weights as updated so far: min-max, or with `clip` mse.py's clip search): returns (dequantized W
    float64, g_idx or None)."""
    W = W.double().clone()
    O, I = W.shape
    H = 2 * X.double().T @ X.double() / X.shape[0]
    if perm is None:
        perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(I)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + damp * torch.diag(H).mean() * torch.eye(I, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    maxq = (1 << bits) - 1
    for j in range(I):
        if j % G == 0:
            wg = W[:, j:j + G].float().unsqueeze(1)
            s, z = mse.quantize_groups(wg, bits, sym, torch.float16)[1:] if clip else \
                group_params(wg, bits, sym, torch.float16)
            s, z = s[:, 0, 0].double(), z[:, 0, 0].double()
        q = torch.clamp(torch.round(W[:, j] / s) + z, 0, maxq)
        Q[:, j] = s * (q - z)
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:] -= err[:, None] * U[j, j:][None, :]
    inv = torch.argsort(perm)
    g_idx = (inv // G).to(torch.int32) if act_order else None
    return Q[:, inv], g_idx


def _out_err(W, Q, X):
    y = X.double() @ W.double().T
    return float((X.double() @ Q.double().T - y).norm() / y.norm())


@pytest.mark.parametrize("bits,G,sym", [(4, 32, True), (3, 64, False), (4, 128, False)])
def test_gptq_matches_float64_reference(bits, G, sym):
    W, X = _layer()
    H = Hessian(W.shape[1])
    for chunk in X.split(100):  # batch by batch, as the block driver feeds it
        H.add(chunk)
    r = gptq_quantize(W, H.H, bits, G, sym, block=64)
    Q = dequantize(r.plain, torch.float64)
    Qref, _ = reference_gptq(W, X, bits, G, sym)
    # float32 vs float64 may flip a rounding tie now and then; the errors they make must agree closely
    same = float((Q == Qref).double().mean())
    assert same > 0.98, same
    e, e_ref = _out_err(W, Q, X), _out_err(W, Qref, X)
    assert abs(e - e_ref) <= 0.02 * e_ref, (e, e_ref)
    # and GPTQ must beat round-to-nearest on the inputs it saw
    rtn = dequantize(quantize(W, bits, G, sym), torch.float64)
    assert e < 0.8 * _out_err(W, rtn, X)
    assert abs(r.loss - e * e) <= 0.05 * e * e  # the reported loss is the squared output error


def test_act_order_g_idx_valid_and_decodes():
    W, X = _layer(seed=1)
    H = Hessian(W.shape[1])
    H.add(X)
    r = gptq_quantize(W, H.H, 4, 32, True, act_order=True)
    p = r.plain
    assert p.g_idx is not None and p.desc_act
    assert p.check_ranges() == []
    assert torch.equal(torch.bincount(p.g_idx.long()), torch.full((W.shape[1] // 32,), 32))
    Qref, gref = reference_gptq(W, X, 4, 32, True, act_order=True)
    assert torch.equal(p.g_idx, gref)
    assert float((dequantize(p, torch.float64) == Qref).double().mean()) > 0.98
    # the loudest channels are quantized first, so they are all in group 0
    assert set(p.g_idx[:4].tolist()) == {0}
    # through the gptq layout and back, the same weights
    fmt = get_format("gptq")
    from qtool.scheme import QuantScheme

    back = fmt.unpack(fmt.pack(p), QuantScheme(bits=4, group_size=32, sym=True, desc_act=True))
    assert torch.equal(dequantize(back, torch.float64), dequantize(p, torch.float64))
    assert _out_err(W, dequantize(p), X) < _out_err(W, dequantize(quantize(W, 4, 32, True)), X)


def test_static_groups_keep_trivial_g_idx():
    W, X = _layer(seed=2)
    H = Hessian(W.shape[1])
    H.add(X)
    r = gptq_quantize(W, H.H, 4, 32, False, act_order=True, static_groups=True)
    assert r.plain.g_idx is None
    # the group parameters are RTN's of the original weights
    rtn = quantize(W, 4, 32, False)
    assert torch.equal(r.plain.scales, rtn.scales) and torch.equal(r.plain.zeros, rtn.zeros)
    assert _out_err(W, dequantize(r.plain), X) < _out_err(W, dequantize(rtn), X)


def test_dead_inputs_and_damping():
    W, X = _layer(seed=3)
    X[:, 5] = 0  # a channel that never fires
    H = Hessian(W.shape[1])
    H.add(X)
    r = gptq_quantize(W, H.H, 4, 32, True)
    assert torch.isfinite(dequantize(r.plain)).all()
    assert r.damp == 0.01


@pytest.mark.parametrize("bits,sym", [(3, True), (4, False)])
def test_clip_with_uncorrelated_inputs_is_the_mse_method(bits, sym):
    # with H diagonal no column's error feeds another, so GPTQ's clip search must give mse.py's result exactly
    W, _ = _layer(seed=5)
    H = torch.diag(torch.rand(W.shape[1], generator=torch.Generator().manual_seed(5)) + 0.5)
    r = gptq_quantize(W, H, bits, 32, sym, clip=True)
    ref = quantize(W, bits, 32, sym, "mse")
    assert torch.equal(r.plain.qweight, ref.qweight) and torch.equal(r.plain.scales, ref.scales)
    plain = gptq_quantize(W, H, bits, 32, sym)
    assert not torch.equal(plain.plain.scales, r.plain.scales)  # the search moved some groups' ranges


@pytest.mark.parametrize("bits,sym,act", [(3, True, False), (4, False, True)])
def test_clip_changes_only_how_each_groups_scale_is_chosen(bits, sym, act):
    # --mse: the same column loop and error feedback, each group's (scale, zero) from the clip search of the
    # group's weights as updated so far; the float64 reference does exactly that
    W, X = _layer(seed=6)
    H = Hessian(W.shape[1])
    H.add(X)
    r = gptq_quantize(W, H.H, bits, 32, sym, act_order=act, clip=True)
    Q = dequantize(r.plain, torch.float64)
    Qref, g_ref = reference_gptq(W, X, bits, 32, sym, act_order=act, clip=True)
    assert float((Q == Qref).double().mean()) > 0.98
    e, e_ref = _out_err(W, Q, X), _out_err(W, Qref, X)
    assert abs(e - e_ref) <= 0.02 * e_ref, (e, e_ref)
    assert (r.plain.g_idx is None) == (not act) and (not act or torch.equal(r.plain.g_idx, g_ref))
    # the first group processed sees the original weights: its parameters are mse.py's, not min-max's
    c = torch.argsort(torch.diag(H.H), descending=True)[:32] if act else torch.arange(32)
    _, s0, z0 = mse.quantize_groups(W[:, c].unsqueeze(1), bits, sym, torch.float16)
    g0 = 0 if not act else int(r.plain.g_idx[c[0]])
    assert torch.equal(r.plain.scales[:, g0], s0[:, 0, 0].half())
    assert torch.equal(gptq_quantize(W, H.H, bits, 32, sym, act_order=act).plain.scales[:, g0],
                       group_params(W[:, c].unsqueeze(1), bits, sym, torch.float16)[0][:, 0, 0].half())


@pytest.mark.parametrize("act", [False, True])
def test_consuming_the_hessian_gives_the_same_result(act):
    W, X = _layer(seed=7)
    H = Hessian(W.shape[1])
    H.add(X)
    keep = gptq_quantize(W, H.H.clone(), 4, 32, True, act_order=act)
    taken = H.take()
    with pytest.raises(ValueError):
        H.add(X)  # handed over: the Hessian no longer holds it
    used = gptq_quantize(W, taken, 4, 32, True, act_order=act, consume=True)
    assert torch.equal(used.plain.qweight, keep.plain.qweight) and torch.equal(used.plain.scales, keep.plain.scales)
    assert used.loss == keep.loss


def test_stacked_rows_are_each_layers_own_gptq():
    # the driver quantizes q/k/v (one input, one H) as one stacked weight: rows are independent given H
    W, X = _layer(seed=8)
    H = Hessian(W.shape[1])
    H.add(X)
    a, b = W[:16], W[16:]
    both = gptq_quantize(torch.cat([a, b]), H.H, 4, 32, True, act_order=True)
    for rows, w in ((slice(0, 16), a), (slice(16, None), b)):
        one = gptq_quantize(w, H.H, 4, 32, True, act_order=True)
        assert torch.equal(one.plain.g_idx, both.plain.g_idx)
        assert float((one.plain.qweight == both.plain.qweight[rows]).double().mean()) > 0.995
        part = float(both.row_num[rows].sum() / both.row_den[rows].sum())
        assert part == pytest.approx(one.loss, rel=1e-3)


def test_group_aware_order_keeps_groups_whole_and_matches_the_reference():
    W, X = _layer(seed=4)
    H = Hessian(W.shape[1])
    H.add(X)
    key = torch.diag(H.H).clone()
    perm = group_aware_order(key, 32)
    assert sorted(perm.tolist()) == list(range(W.shape[1]))
    runs = perm.view(-1, 32) // 32
    assert bool((runs == runs[:, :1]).all())  # every run of 32 is one natural group
    assert int(runs[0, 0]) == int(torch.argmax(key)) // 32  # the group of the loudest column first
    r = gptq_quantize(W, H.H, 4, 32, True, act_order=True, group_aware=True)
    assert r.plain.g_idx is None and r.plain.check_ranges() == []
    Qref, _ = reference_gptq(W, X, 4, 32, True, perm=perm)
    Q = dequantize(r.plain, torch.float64)
    assert float((Q == Qref).double().mean()) > 0.98
    assert _out_err(W, Q, X) < _out_err(W, dequantize(quantize(W, 4, 32, True)), X)
