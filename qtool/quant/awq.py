"""AWQ: activation-aware per-input-channel scales, then a clip search, then round-to-nearest with zero points.

For linears that read the same input x [n, I] (q/k/v; gate/up), the output error of quantizing W·diag(s) and
feeding x/s is measured exactly from H = xᵀx / n (the `Hessian` of gptq.py without the factor 2):

    err(s) = Σ_linears tr(ΔW H ΔWᵀ),  ΔW = Q(W·diag(s))·diag(1/s) − W

Candidates follow AWQ's grid: for r in 0, 1/20, ..., 19/20, s = x̄^r / (w̄^(1−r) + 1e-4) (x̄ the mean |x| per
channel, w̄ the mean of |w| normalised per group), normalised so that sqrt(max s · min s) = 1; s = 1 (plain
RTN) is a candidate too, so the chosen scales never do worse than RTN on this measure. The scales are then
folded into the op that produces x (calib.py decides which op and checks the fold is exact).

The clip search shrinks each group's range by r in 1.0, 0.975, ..., 0.5 (mse.py's ratios) and keeps, per
group, the ratio with the least output error d H_g dᵀ, d = Q(w_g) − w_g, with H_g the group's diagonal block
of H: the same measure, restricted to one group, so groups are chosen independently and exactly.
"""

from __future__ import annotations

import torch

from qtool.formats.plain import Plain
from qtool.quant.mse import RATIOS
from qtool.quant.rtn import codes, group_range, params_from_range

N_GRID = 20


def fake_quant(W: torch.Tensor, bits: int, G: int, sym: bool, scale_dtype: torch.dtype) -> torch.Tensor:
    """RTN quantize-dequantize of W float32 [O, I] with groups of G along I (float32 result)."""
    n_out, n_in = W.shape
    wg = W.reshape(n_out, n_in // G, G)
    xmin, xmax = group_range(wg, sym)
    s, z = params_from_range(xmin, xmax, bits, sym, scale_dtype)
    return ((codes(wg, s, z, bits) - z) * s).reshape(n_out, n_in)


def output_error(dW: torch.Tensor, H: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ) in float64."""
    return float(torch.sum((dW.double() @ H.double()) * dW.double()))


def search_scales(weights: list[torch.Tensor], H: torch.Tensor, x_mean: torch.Tensor, bits: int, G: int,
                  sym: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, float, float]:
    """weights: float32 [O_k, I] of the linears reading one input; H float32 [I, I]; x_mean float32 [I].
    -> (s float32 [I], error with s, error of plain RTN), the errors as err(s) above."""
    W = torch.cat([w.float() for w in weights], 0)
    n_out, n_in = W.shape
    wa = W.abs().reshape(n_out, n_in // G, G)
    w_mean = (wa / wa.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(n_out, n_in).mean(0)
    x_mean = x_mean.float().clamp(min=0)
    ones = torch.ones(n_in, dtype=torch.float32, device=W.device)
    rtn_err = output_error(fake_quant(W, bits, G, sym, scale_dtype) - W, H)
    best_s, best_err = ones, rtn_err
    for k in range(N_GRID):
        r = k / N_GRID
        s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if not bool(torch.isfinite(s).all()):
            continue
        err = output_error(fake_quant(W * s, bits, G, sym, scale_dtype) / s - W, H)
        if err < best_err:
            best_s, best_err = s, err
    return best_s, best_err, rtn_err


def clip_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool,
                  scale_dtype: torch.dtype, ratios: tuple[float, ...] = RATIOS) -> Plain:
    """W float32 [O, I], H float32 [I, I] -> Plain (codes uint8 [O, I], scales [O, I/G], zeros uint8 or None)
    with each group's clip ratio chosen for the least output error (see the module docstring)."""
    n_out, n_in = W.shape
    G = n_in if group_size == -1 else group_size
    ng = n_in // G
    wg = W.float().reshape(n_out, ng, G)
    idx = torch.arange(ng, device=W.device)
    Hg = H.float().reshape(ng, G, ng, G)[idx, :, idx, :]  # [ng, G, G] diagonal blocks
    xmin, xmax = group_range(wg, sym)
    maxq = (1 << bits) - 1
    best = None
    for r in ratios:
        s, z = params_from_range(xmin, xmax, bits, sym, scale_dtype, ratio=r)
        d = (torch.div(wg, s).round_().clamp_(-z, maxq - z)).mul_(s).sub_(wg)  # [O, ng, G]
        err = torch.einsum("ogi,gij,ogj->og", d, Hg, d).unsqueeze(-1)
        if best is None:
            best = (err, s, z)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better, s, best[1]), torch.where(better, z, best[2]))
    _, s, z = best
    q = codes(wg, s, z, bits).reshape(n_out, n_in).to(torch.uint8)
    zeros = None if sym else z.squeeze(-1).to(torch.uint8).cpu()
    return Plain(q.cpu(), s.squeeze(-1).to(scale_dtype).cpu(), zeros, None, bits, group_size,
                 meta={"method": "awq"})
