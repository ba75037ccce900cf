"""The kernels check of one layer: every registered kernel that takes it on the device runs it at several M.

Per kernel and M, against the oracle y* = x · dequantize(plain, float64)ᵀ:
    err  = ‖y − y*‖ / ‖y*‖                   the kernel
    base = ‖F.linear(x, Ŵ_dtype) − y*‖ / ‖y*‖  the same-precision torch baseline (fp32 accumulate)
passes when err ≤ k · max(base, u) (k: the kernel's declared `err_factor`; u: the dtype's unit roundoff,
so a baseline that happens to be exact does not demand an exact kernel), the output is finite, and a
second forward gives the same bits. The kernel's state (what `prepare` built, what a loaded engine keeps) is
measured before and after the forwards: growing by a dense weight's bytes means a dense copy was kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qtool.formats.plain import Plain, dequantize

DTYPES = (torch.float16, torch.bfloat16)


def act_dtype(plain: Plain) -> torch.dtype:
    """The activations an engine feeds this layer: its scales' dtype when that is 16-bit, else fp16."""
    return plain.scales.dtype if plain.scales.dtype in DTYPES else torch.float16


def state_bytes(obj: Any, seen: set | None = None, depth: int = 0) -> int:
    """Bytes of every distinct tensor storage reachable from a kernel state (dataclass fields, attributes,
    dicts, lists, tuples)."""
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = ("storage", obj.device, st.data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return st.nbytes()
    if isinstance(obj, dict):
        return sum(state_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(state_bytes(v, seen, depth + 1) for v in obj)
    d = getattr(obj, "__dict__", None)
    if d is not None and not isinstance(obj, type):
        return sum(state_bytes(v, seen, depth + 1) for v in d.values())
    return 0


def eligible(plain: Plain, device: torch.device, only: tuple[str, ...] | None = None):
    """([(kernel, layer on device)], [(kernel id, why not)]) for the registered kernels."""
    from qtool.kernels.base import PackedLayer, all_kernels

    dtype = act_dtype(plain)
    layer = PackedLayer.from_plain(plain)
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


def run_kernel(kernel, layer, plain: Plain, device: torch.device, batch_sizes: tuple[int, ...],
               seed: int = 0) -> tuple[str, str, dict]:
    """(status, detail, numbers) for one kernel on one layer."""
    import torch.nn.functional as F

    dtype = act_dtype(plain)
    factor = float(kernel.err_factor)
    u = torch.finfo(dtype).eps / 2
    w64 = dequantize(plain, torch.float64).to(device)
    wd = dequantize(plain, dtype).to(device).float()
    dense_bytes = plain.out_features * plain.in_features * torch.empty((), dtype=dtype).element_size()
    state = kernel.prepare(layer)
    before = state_bytes(state)
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
        bound = factor * max(base, u)
        if not math.isfinite(err) or err > bound:
            problems.append(f"M={m}: error {err:.3g} > {factor:g} × baseline {max(base, u):.3g}")
        if not torch.equal(y, y2):
            problems.append(f"M={m}: a second forward gave different values")
        if not worst or err / max(bound, 1e-300) > worst["err"] / max(worst["bound"], 1e-300):
            worst = {"m": m, "err": err, "base": base, "bound": bound}
    after = state_bytes(state)
    numbers = {"k": factor, "batch_sizes": list(batch_sizes), "state_bytes_before": before,
               "state_bytes_after": after, "dense_bytes": dense_bytes, **{f"worst_{k}": v for k, v in worst.items()}}
    if after - before >= dense_bytes:
        problems.append(f"state grew by {after - before} bytes during the forwards (a dense weight is "
                        f"{dense_bytes} bytes): it keeps a dense copy of the weight")
    if before >= dense_bytes + layer.nbytes():
        problems.append(f"prepare built {before} bytes of state, more than the packed layer plus a dense "
                        "weight: it holds a dense copy of the weight")
    if problems:
        return "fail", f"{kernel.id}: " + "; ".join(problems), numbers
    w = worst or {"err": float("nan"), "m": 0, "bound": float("nan")}
    return "pass", (f"{kernel.id}: worst error {w['err']:.3g} at M={w['m']} (bound {w['bound']:.3g}); repeatable; "
                    f"no dense weight kept"), numbers
