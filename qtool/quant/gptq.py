"""GPTQ: quantize one linear layer column by column, feeding each column's error into the columns not yet done.

Given the layer's inputs X [n, I], the proxy loss is ‖(W − Q) Xᵀ‖² whose Hessian is H = 2 X Xᵀ / n [I, I]
(`Hessian` accumulates it batch by batch). With U the upper Cholesky factor of H⁻¹ (H dampened by
`damp` x mean(diag H) so it is positive definite):

    for each block of `block` columns, for each column j in it:
        q_j = quant(w_j)   (the group's scale/zero, rtn.py conventions, from the weights as updated so far)
        e_j = (w_j − q_j) / U[j, j]
        w[:, j+1:] −= e_j U[j, j+1:]          (inside the block, then once for the rest: lazy batch update)

Act-order (`act_order=True`) visits columns by decreasing diag(H). Without `static_groups` the groups are
formed in that order, so g_idx[perm[k]] = k // G (a desc_act checkpoint); with `static_groups` every
group's parameters are computed from the original weights of the natural groups i // G before any update,
and g_idx stays trivial (loaders need no g_idx). With `group_aware` (and not static groups) the order
keeps each natural group's columns together (groups by their loudest column, columns by decreasing diag(H)
inside), so each group's parameters come from its weights as updated so far and g_idx is trivial too.
Columns whose inputs were always zero (diag H = 0) carry
no information: their weights become 0 and H gets a 1 on the diagonal there, as in the reference
implementation. With `clip` a group's scale comes from the clip search of mse.py on the group's weights as
updated so far, instead of their min-max range.

The loss reported is the Hessian-weighted relative error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) with the undampened H:
the relative error of the layer's output on its calibration inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import InputError
from qtool.formats.plain import Plain
from qtool.quant import mse
from qtool.quant.rtn import codes, group_params

# pack's defaults (the function arguments below stay explicit): 10 % dampening and clip-searched group scales
# (`clip`, pack --mse). On MiniLM at 3 and 4 bits, two calibration seeds each, these closed 68-72 % of RTN's
# embedding gap against 33-64 % with min-max scales at 1 %, and the worst paragraph improved too
# (benchmarks/results/quant.md). The search minimises the squared error, which GPTQModel's config records as
# mse = 2 (the error's exponent; 0 = min-max scales).
DAMP = 0.1
MSE = True
MSE_NORM = 2.0
BLOCK = 128


class Hessian:
    """H = 2 X Xᵀ / n in float32 over every row x [.., I] passed to `add` (on `device`), and with
    `track_mean` the mean |x| per input channel (AWQ's activation statistic).

    The rows are summed and scaled once when `H` is read, so adding a batch is one matmul. Linears that
    read the same input share one Hessian."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu", track_mean: bool = False) -> None:
        self._S = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._abs = torch.zeros(in_features, dtype=torch.float32, device=device) if track_mean else None
        self._scale = 1.0  # _S holds the sum of x xᵀ times this
        self.n = 0

    def _held(self) -> torch.Tensor:
        if self._S is None:
            raise ValueError("this Hessian was handed over by take()")
        return self._S

    def add(self, x: torch.Tensor) -> None:
        self._held()
        x = x.reshape(-1, x.shape[-1]).to(device=self._S.device, dtype=torch.float32)
        if x.shape[0] == 0:
            return
        if self._scale != 1.0:
            self._S.mul_(1.0 / self._scale)
            self._scale = 1.0
        self.n += x.shape[0]
        self._S.addmm_(x.t(), x)
        if self._abs is not None:
            self._abs.add_(x.abs().sum(0))

    @property
    def H(self) -> torch.Tensor:
        """float32 [I, I] = 2 X Xᵀ / n (scaled in place: no second copy)."""
        want = 2.0 / max(self.n, 1)
        self._held()
        if self._scale != want:
            self._S.mul_(want / self._scale)
            self._scale = want
        return self._S

    def take(self) -> torch.Tensor:
        """H (as `H`), handing over this object's reference: the caller's is then the only one, so the
        matrix can be freed as soon as the caller is done with it. `H` and `add` refuse afterwards."""
        H = self.H
        self._S = None
        return H

    @property
    def x_mean(self) -> torch.Tensor:
        """float32 [I] mean |x| per input channel (only with track_mean)."""
        if self._abs is None:
            raise ValueError("this Hessian was built without track_mean")
        return self._abs / max(self.n, 1)


@dataclass
class GptqResult:
    plain: Plain
    loss: float  # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)
    damp: float  # the dampening fraction that made H positive definite
    deq: torch.Tensor  # float32 [O, I] on H's device: exactly dequantize(plain, float32), computed on the way
    row_num: torch.Tensor  # float64 [O] on the CPU: each row's tr(ΔW H ΔWᵀ) part (losses of row slices)
    row_den: torch.Tensor  # float64 [O]: each row's tr(W H Wᵀ) part


def _inverse_cholesky(work: list[torch.Tensor], damp: float, name: str | None) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + λI)⁻¹ (λ = damp x mean(diag H), raised tenfold until H + λI is
    positive definite), given `work` = [J H J], H with its rows and columns reversed.

    With R the lower Cholesky factor of J H J, H⁻¹ = J R⁻ᵀ R⁻¹ J = Uᵀ U with U = J R⁻¹ J upper triangular
    with a positive diagonal: the factor wanted, from one Cholesky and one triangular solve (no inverse of
    H, no second factorization; torch's cholesky_inverse is slow on the CPU). `work` holds the only
    reference to its matrix, which is consumed: dampened in place and dropped once factored."""
    Hr = work.pop()
    diag = Hr.diagonal()
    mean_diag = float(diag.mean())
    d, added = damp, 0.0
    for _ in range(6):
        diag.add_(d * mean_diag - added)
        added = d * mean_diag
        R, info = torch.linalg.cholesky_ex(Hr)
        if int(info) == 0:
            del Hr, diag
            Rinv = torch.linalg.solve_triangular(R, torch.eye(R.shape[0], dtype=R.dtype, device=R.device),
                                                 upper=False)
            del R
            return Rinv.flip(0, 1), d
        d *= 10
    raise InputError(f"the calibration Hessian is not positive definite even with dampening {d / 10:g}",
                     tensor=name, fix="give more or longer calibration samples (--calib-samples/--calib-seqlen)")


def group_aware_order(key: torch.Tensor, G: int) -> torch.Tensor:
    """int64 [I] processing order that keeps the natural groups whole: within each group its columns by
    decreasing key, and the groups by decreasing largest key (GPTQModel's act_group_aware)."""
    n_groups = key.numel() // G
    kg = key.reshape(n_groups, G)
    vals, local = torch.sort(kg, dim=1, descending=True, stable=True)
    order = torch.argsort(vals[:, 0], descending=True, stable=True)
    return (local[order] + order.unsqueeze(1) * G).reshape(-1)


class _one_thread:
    """On the CPU, run the column loop's many small ops on one thread: with more, every op pays a thread
    hand-off that costs more than the op (30x slower on a shared 2-core machine)."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = device.type == "cpu"

    def __enter__(self):
        if self.cpu:
            self.n = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.cpu:
            torch.set_num_threads(self.n)


def _params(wg: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype, clip: bool):
    """A group's (scale, zero) [R, n_groups, 1]: min-max, or with `clip` the range shrink of least squared
    error (mse.py's search, as GPTQ's own quantizer does with mse=True)."""
    if not clip:
        return group_params(wg, bits, sym, scale_dtype)
    _, s, z = mse.quantize_groups(wg, bits, sym, scale_dtype)
    return s, z


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool,
                  scale_dtype: torch.dtype = torch.float16, act_order: bool = False, static_groups: bool = False,
                  damp: float = 0.01, block: int = BLOCK, name: str | None = None, clip: bool = False,
                  group_aware: bool = False, consume: bool = False) -> GptqResult:
    """weight float [O, I], H float32 [I, I] (Hessian.H) -> GptqResult with a Plain (codes uint8 [O, I],
    scales scale_dtype [O, I/G], zeros uint8 or None when sym, g_idx int32 [I] under act-order else None).

    group_size must divide I (or be -1); qtool.quant.validate checks that before any work is done.
    With `consume` the caller holds no other reference to H (Hessian.take): on a GPU it waits in host
    memory while its working copy is factored, so the device never holds H, its copy and the factor
    together (down_proj's [14336, 14336] is 0.77 GiB each). The result is the same either way.
    """
    H0 = H
    del H
    W = weight.to(device=H0.device, dtype=torch.float32).clone()
    n_out, n_in = W.shape
    G = n_in if group_size == -1 else group_size
    n_groups = n_in // G
    row_den = torch.sum((W @ H0) * W, 1).double().cpu()
    den = float(row_den.sum())
    dead = torch.diag(H0) == 0
    W[:, dead] = 0

    static = None
    if static_groups:
        s, z = _params(W.reshape(n_out, n_groups, G), bits, sym, scale_dtype, clip)
        static = (s.squeeze(-1), z.squeeze(-1))  # [O, n_groups] each
    perm = None
    if act_order:
        key = torch.diag(H0).masked_fill(dead, 1)
        perm = group_aware_order(key, G) if group_aware and static is None else torch.argsort(key, descending=True)
        W, dead = W[:, perm], dead[perm]
    order = torch.arange(n_in - 1, -1, -1, device=H0.device) if perm is None else perm.flip(0)
    H = H0.index_select(0, order).index_select(1, order)  # J H J (permuted), as _inverse_cholesky takes it
    H[dead.flip(0), dead.flip(0)] = 1
    device = H0.device
    parked = None
    if consume:  # on the CPU the "copy" is H0 itself: nothing moves, and the code path is the same
        parked = H0.to("cpu")
        del H0
    work = [H]
    del H
    U, used_damp = _inverse_cholesky(work, damp, name)

    # the loop works on Wᵀ [I, O]: a column of W is then a contiguous row, and reading, updating and
    # storing it touches O consecutive floats instead of O cache lines (3x faster on the CPU at O = 3072)
    Wt = W.t().contiguous()
    del W
    Qt = torch.zeros_like(Wt)
    codes_t = torch.zeros(n_in, n_out, dtype=torch.uint8, device=Wt.device)
    scales = torch.zeros(n_out, n_groups, dtype=torch.float32, device=Wt.device)
    zeros = torch.zeros(n_out, n_groups, dtype=torch.float32, device=Wt.device)
    s_col = z_col = None
    # static groups: the natural group of the column at each position (a list: no device sync per column)
    static_of = ((perm if perm is not None else torch.arange(n_in)) // G).tolist() if static is not None else None
    # group-aware order: the k-th run of G columns processed is the natural group gar_group[k]
    gar = perm is not None and group_aware and static is None
    gar_group = (perm[::G] // G).tolist() if gar else None
    # whole groups per block, so a group's parameters come from weights that carry every update so far
    block = G * max(1, block // G)
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        W1 = Wt[i1:i2].clone()  # [b, O]: columns i1..i2 of W
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        with _one_thread(Wt.device):
            for i in range(i2 - i1):
                j = i1 + i  # position in processing order
                if static is not None:
                    g = static_of[j]
                    s_col, z_col = static[0][:, g], static[1][:, g]
                elif j % G == 0:
                    g = j // G if gar_group is None else gar_group[j // G]
                    s, z = _params(W1[i:i + G].t().contiguous().unsqueeze(1), bits, sym, scale_dtype, clip)
                    s_col, z_col = s[:, 0, 0], z[:, 0, 0]
                    scales[:, g], zeros[:, g] = s_col, z_col
                w = W1[i]
                q = codes(w.unsqueeze(-1), s_col.unsqueeze(-1), z_col.unsqueeze(-1), bits).squeeze(-1)
                deq = (q - z_col) * s_col
                codes_t[j] = q.to(torch.uint8)
                Qt[j] = deq
                err = (w - deq) / U1[i, i]
                W1[i:].addr_(U1[i, i:], err, alpha=-1)  # one fused rank-1 update, no [b, O] temporary
                Err1[i] = err
        Wt[i2:] -= U[i1:i2, i2:].t() @ Err1
    del U, Wt
    if parked is not None:
        H0 = parked.to(device)
        del parked

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Qt, codes_t = Qt[inv], codes_t[inv]
        if static is None and not gar:
            g_idx = (inv // G).to(torch.int32)  # column c sits at position inv[c] of the processing order
    Q, q_codes = Qt.t().contiguous(), codes_t.t().contiguous()
    del Qt, codes_t
    if static is not None:
        scales, zeros = static
    dW = weight.to(device=device, dtype=torch.float32) - Q
    row_num = torch.sum((dW @ H0) * dW, 1).double().cpu()
    num = float(row_num.sum())
    loss = num / den if den > 0 else 0.0
    plain = Plain(q_codes.cpu(), scales.to(scale_dtype).cpu(), None if sym else zeros.to(torch.uint8).cpu(),
                  None if g_idx is None else g_idx.cpu().contiguous(), bits, group_size,
                  meta={"method": "gptq"})
    return GptqResult(plain, loss, used_damp, Q, row_num, row_den)
