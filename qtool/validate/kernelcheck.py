"""The kernels check of one layer: every registered kernel that takes it on the device runs it at several M.

Per kernel and M, against the oracle y* = x · dequantize(plain, float64)ᵀ:
    err  = ‖y − y*‖ / ‖y*‖                   the kernel
    base = ‖F.linear(x, Ŵ_dtype) − y*‖ / ‖y*‖  the same-precision torch baseline (fp32 accumulate)
passes when err ≤ k · base (k: the kernel's declared `error_factor(dtype)`; base floored at an eighth of the dtype's
unit roundoff, so a baseline that happens to be exact does not demand an exact kernel), the output is finite, and a
second forward gives the same bits. The kernel's state (what `prepare` built, what a loaded engine keeps) is
measured before and after the forwards (bytes in the numbers), and searched for a floating-point tensor of
the weight's shape in a 16- or 32-bit dtype: a dense copy, which a packed kernel must never keep (FP8 codes
of that shape are the quantized weight itself).

The layer is either canonical form: a `Plain` (integer codes, run as GPTQ v2 words) or a `ScaledPlain`
(FP8/INT8/FP4 codes, run as they are stored).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qtool.formats.plain import Plain
from qtool.formats.scaled import ScaledPlain

DTYPES = (torch.float16, torch.bfloat16)


def act_dtype(plain: Plain | ScaledPlain) -> torch.dtype:
    """The activations an engine feeds this layer: a ScaledPlain's model dtype; a Plain's scales' dtype when
    that is 16-bit; else fp16."""
    if isinstance(plain, ScaledPlain):
        dt = getattr(torch, plain.out_dtype)
        return dt if dt in DTYPES else torch.bfloat16
    return plain.scales.dtype if plain.scales.dtype in DTYPES else torch.float16


def layer_key(plain: Plain | ScaledPlain) -> tuple:
    """What decides how kernels treat a layer: layers with equal keys are checked once."""
    if isinstance(plain, ScaledPlain):
        return (plain.out_features, plain.in_features, plain.element, plain.scale_type, plain.block_shape,
                plain.global_scale is not None, plain.zeros is not None, plain.out_dtype)
    return (plain.out_features, plain.in_features, plain.bits, plain.group_size, plain.sym, plain.desc_act,
            plain.scales.dtype)


def describe_layer(plain: Plain | ScaledPlain) -> str:
    """"[N, K] 4-bit g128" or "[N, K] e4m3 block 128x128 fp32 scales"."""
    if isinstance(plain, ScaledPlain):
        bo, bi = plain.block_shape
        how = f"block {bo}x{bi}" if plain.strategy == "block" else plain.strategy
        if plain.strategy == "group":
            how = f"group {bi}"
        return f"[{plain.out_features}, {plain.in_features}] {plain.element} {how} {plain.scale_type} scales"
    return f"[{plain.out_features}, {plain.in_features}] {plain.bits}-bit g{plain.group_size}"


def _walk(obj: Any, seen: set, depth: int = 0):
    """Every tensor reachable from a kernel state (dataclass fields, attributes, dicts, lists, tuples)."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _walk(v, seen, depth + 1)
    elif getattr(obj, "__dict__", None) is not None and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _walk(v, seen, depth + 1)


def state_bytes(state: Any) -> int:
    """Bytes of every distinct tensor storage a kernel state holds."""
    storages = {}
    for t in _walk(state, set()):
        st = t.untyped_storage()
        storages[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(storages.values())


def dense_copies(state: Any, n: int, k: int) -> list[str]:
    """Floating-point tensors of the weight's own shape ([N, K] or [K, N]) in a kernel state: a dense copy of
    the weight. Workspaces (split-K partial sums, per-M buffers) have other shapes and are not counted."""
    want = sorted((n, k))
    return [f"{t.dtype} {list(t.shape)}" for t in _walk(state, set())
            if t.is_floating_point() and t.element_size() >= 2 and t.dim() == 2 and sorted(t.shape) == want]


def eligible(plain: Plain | ScaledPlain, device: torch.device, only: tuple[str, ...] | None = None):
    """([(kernel, layer on device)], [(kernel id, why not)]) for the registered kernels."""
    from qtool.kernels.base import all_kernels, layer_for

    dtype = act_dtype(plain)
    layer = layer_for(plain)
    on_dev = None
    run, refused = [], []
    for kid, k in sorted(all_kernels().items()):
        if only is not None and kid not in only:
            continue
        why = k.available(device)
        if why is None:
            if on_dev is None:
                on_dev = layer.to(device)
            why = "; ".join(k.check(on_dev, dtype, device)) or None
        if why is None:
            run.append((k, on_dev))
        else:
            refused.append((kid, why))
    return run, refused


def need_bytes(n: int, k: int, m: int) -> int:
    """About the most memory `run_kernel` holds for an [n, k] layer at batch size m: the float64 and 16-bit
    dequantized weights (with the fp32 copy the baseline multiplies), and per M x in four precisions and the
    outputs, oracle and differences in 16, 32 and 64 bits."""
    return 16 * n * k + m * (16 * k + 40 * n)


def run_kernel(kernel, layer, plain: Plain | ScaledPlain, device: torch.device, batch_sizes: tuple[int, ...],
               seed: int = 0) -> tuple[str, str, dict]:
    """(status, detail, numbers) for one kernel on one layer."""
    import torch.nn.functional as F

    from qtool.kernels.base import dequantize_canonical

    dtype = act_dtype(plain)
    factor = float(kernel.error_factor(dtype))
    floor = torch.finfo(dtype).eps / 16  # an eighth of the unit roundoff
    w64 = dequantize_canonical(plain, torch.float64).to(device)
    wd = dequantize_canonical(plain, dtype).to(device).float()
    dense_bytes = plain.out_features * plain.in_features * torch.empty((), dtype=dtype).element_size()
    state = kernel.prepare(layer)
    before = state_bytes(state)
    early = dense_copies(state, plain.out_features, plain.in_features)
    problems, worst = [], {}
    for m in batch_sizes:
        gen = torch.Generator().manual_seed(seed + m)
        x = torch.randn(m, plain.in_features, generator=gen).to(dtype).to(device)
        y = kernel.forward(x, state)
        y2 = kernel.forward(x, state)
        ref = x.double() @ w64.t()
        base_y = F.linear(x.float(), wd).to(dtype)
        norm = float(ref.norm())
        if not bool(torch.isfinite(y).all()):
            problems.append(f"M={m}: output has NaN/Inf")
            continue
        if norm == 0.0:
            err = float((y.double() - ref).norm())
            base = float((base_y.double() - ref).norm())
        else:
            err = float((y.double() - ref).norm()) / norm
            base = float((base_y.double() - ref).norm()) / norm
        bound = factor * max(base, floor)
        if not math.isfinite(err) or err > bound:
            problems.append(f"M={m}: error {err:.3g} > {factor:g} × baseline {max(base, floor):.3g}")
        if not torch.equal(y, y2):
            problems.append(f"M={m}: a second forward gave different values")
        if not worst or err / max(bound, 1e-300) > worst["err"] / max(worst["bound"], 1e-300):
            worst = {"m": m, "err": err, "base": base, "bound": bound}
    after = state_bytes(state)
    numbers = {"k": factor, "batch_sizes": list(batch_sizes), "state_bytes_before": before,
               "state_bytes_after": after, "dense_bytes": dense_bytes, **{f"worst_{k}": v for k, v in worst.items()}}
    if early:
        problems.append(f"prepare built a dense copy of the weight ({', '.join(early)})")
    late = [c for c in dense_copies(state, plain.out_features, plain.in_features) if c not in early]
    if late:
        problems.append(f"the state keeps a dense copy of the weight after a forward ({', '.join(late)}; it grew "
                        f"by {after - before} bytes)")
    if not worst:  # no M ran: nothing was compared, so nothing can pass
        problems.append("no batch size ran")
    if problems:
        return "fail", f"{kernel.id}: " + "; ".join(problems), numbers
    return "pass", (f"{kernel.id}: worst error {worst['err']:.3g} at M={worst['m']} (bound {worst['bound']:.3g}); "
                    "repeatable; no dense weight kept"), numbers
