"""The round-trip and reference checks of one module, given its stored tensors and their canonical Plain.

round trip: the format's `pack(unpack(stored))` must give the stored bytes back, tensor by tensor.
reference:  against the dense weight W the checkpoint was made from,
    rel_err  = ‖W − Ŵ‖ / ‖W‖                      (Ŵ = dequantize(plain), float64)
    out_err  = ‖X Wᵀ − X Ŵᵀ‖ / ‖X Wᵀ‖              (X: fixed random activations, OUT_ROWS rows)
    max_step = max |W − Ŵ| / s                       (s: the scale of the weight's group: error in code steps)
must stay within bounds derived from bits b and group size G (see `bounds`).
"""

from __future__ import annotations

import math

import torch

from qtool.formats.plain import Plain, dequantize

OUT_ROWS = 8
BLOCK_ROWS = 512
# A quantizer's error is at most a few code steps; REF_SLACK covers heavier-than-Gaussian tails and error
# feedback (GPTQ) on top of the Gaussian round-to-nearest estimate.
REF_SLACK = 2.0


def bounds(bits: int, group: int) -> dict[str, float]:
    """Bounds from the bits and the group size.

    rel_err: round-to-nearest on a uniform grid of 2^b − 1 steps spanning a group's range has RMS error
    step/√12; a group of G Gaussian weights spans about 2·√(2 ln G) standard deviations, so
    rel ≈ 2√(2 ln G) / ((2^b − 1)·√12), times REF_SLACK.
    max_step: a stored code that moved by half the code range (a flipped high bit, a swapped scale) is out
    of reach of any quantizer: max(2^(b−2), 1.5) steps.
    """
    g = max(group, 2)
    rel = REF_SLACK * 2 * math.sqrt(2 * math.log(g)) / (((1 << bits) - 1) * math.sqrt(12))
    return {"rel_bound": rel, "step_bound": max(float(1 << max(bits - 2, 0)), 1.5)}


def round_trip(fmt, plain: Plain, stored: dict[str, torch.Tensor]) -> tuple[str, str, dict]:
    """(status, detail, numbers): the format's pack of `plain` against the stored layout tensors."""
    from qtool.errors import QtoolError

    try:
        packed = fmt.pack(plain)
    except QtoolError as e:
        return "skip", f"{fmt.spec.id} cannot write this data back ({e.problem}): round trip not provable", {}
    layout = [n for n in stored if n in fmt.spec.tensors]
    differ, checked = [], 0
    for name in layout:
        if name not in packed:
            continue
        a, b = stored[name], packed[name]
        checked += a.numel() * a.element_size()
        if a.dtype != b.dtype or a.shape != b.shape:
            differ.append(f"{name} ({a.dtype} {list(a.shape)} stored, {b.dtype} {list(b.shape)} repacked)")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            n = int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())
            differ.append(f"{name} ({n} bytes differ)")
    missing = [n for n in packed if n not in stored]
    unread = [n for n in layout if n not in packed]
    numbers = {"bytes_compared": checked}
    if differ:
        return "fail", f"unpack → pack does not reproduce the stored bytes: {', '.join(differ)}", numbers
    extra = ""
    if missing:
        extra += f"; the packer also writes {', '.join(missing)}, which the file does not store"
    if unread:
        extra += f"; stored {', '.join(unread)} not rewritten by the packer (not compared)"
    return "pass", f"{fmt.spec.id}: {checked} stored bytes reproduced exactly" + extra, numbers


def reference(plain: Plain, weight: torch.Tensor, seed: int = 0) -> tuple[str, str, dict]:
    """(status, detail, numbers) of the dequantized weight against the dense `weight` [O, I]."""
    if tuple(weight.shape) != (plain.out_features, plain.in_features):
        return "fail", (f"reference weight is {list(weight.shape)} but the module is "
                        f"[{plain.out_features}, {plain.in_features}]"), {}
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(OUT_ROWS, plain.in_features, generator=gen, dtype=torch.float64)
    if not isinstance(plain, Plain):
        return _reference_scaled(plain, weight, x)
    gi = plain.group_index()

    def unit(sl: slice, d: torch.Tensor) -> torch.Tensor:
        return plain.scales[sl].to(torch.float64).abs().index_select(1, gi)

    rel, out, max_step = _errors(plain, weight, x, BLOCK_ROWS, unit)
    return _verdict(rel, out, max_step, bounds(plain.bits, plain.effective_group_size))


def _errors(plain, weight: torch.Tensor, x: torch.Tensor, step_rows: int, unit) -> tuple[float, float, float]:
    """(‖W−Ŵ‖/‖W‖, ‖x(W−Ŵ)ᵀ‖/‖xWᵀ‖, the largest |W−Ŵ| in code steps) over blocks of `step_rows` rows;
    unit(rows, W−Ŵ) gives each weight's code step there."""
    num = den = onum = oden = 0.0
    max_step = 0.0
    for r in range(0, plain.out_features, step_rows):
        sl = slice(r, r + step_rows)
        w = weight[sl].to(torch.float64)
        d = w - dequantize(plain, torch.float64, sl)
        num += float((d * d).sum())
        den += float((w * w).sum())
        yd, y = x @ d.t(), x @ w.t()
        onum += float((yd * yd).sum())
        oden += float((y * y).sum())
        u = unit(sl, d)
        steps = d.abs() / torch.where(u > 0, u, torch.full_like(u, math.inf))
        max_step = max(max_step, float(steps.max()) if steps.numel() else 0.0)
    return math.sqrt(num) / max(math.sqrt(den), 1e-300), math.sqrt(onum) / max(math.sqrt(oden), 1e-300), max_step


# Float codes round to a relative grid: E4M3 (3 mantissa bits) has RMS relative rounding error 2^-3/sqrt(12)
# for weights spread over its binades; int8 is the uniform grid of `bounds` with 8 bits.
_MANTISSA = {"e4m3": 3, "e5m2": 2, "e2m1": 1}


def _reference_scaled(plain, weight: torch.Tensor, x: torch.Tensor) -> tuple[str, str, dict]:
    """reference() for float/int8 codes (qtool.formats.scaled): rel_err and out_err as above; max_step is the
    error in units of the code's own rounding step at that weight (an ulp of the element times the scale;
    for int8 the scale), bounded like the integer layouts' code steps."""
    from qtool.formats.scaled import decode_codes, effective_scales

    bo, bi = plain.block_shape
    step_rows = max(bo, BLOCK_ROWS // bo * bo) if bo < plain.out_features else plain.out_features
    mant = _MANTISSA.get(plain.element)

    def unit(sl: slice, d: torch.Tensor) -> torch.Tensor:
        s = effective_scales(plain, sl).to(torch.float64).abs()
        s = s.repeat_interleave(bo, 0)[: d.shape[0]].repeat_interleave(bi, 1)[:, : d.shape[1]]
        if mant is None:
            return s
        q = decode_codes(plain.codes[sl], plain.element, torch.float64).abs()
        # the grid step around q: 2^(floor(log2 q) - mantissa bits), the subnormal step below the normals
        e = torch.floor(torch.log2(torch.where(q > 0, q, torch.ones_like(q))))
        sub = {"e4m3": -9.0, "e5m2": -16.0, "e2m1": -1.0}[plain.element]
        return torch.exp2(torch.clamp(e - mant, min=sub)) * s

    rel, out, max_step = _errors(plain, weight, x, step_rows, unit)
    if mant is not None:
        b = {"rel_bound": REF_SLACK * 2.0 ** -mant / math.sqrt(3), "step_bound": 1.5}
    else:
        b = bounds(8, bo * bi)
    return _verdict(rel, out, max_step, b)


def _verdict(rel: float, out: float, max_step: float, b: dict) -> tuple[str, str, dict]:
    """(status, detail, numbers) of the reference check from its three errors and their bounds."""
    numbers = {"rel_err": rel, "out_err": out, "max_step": max_step, **b}
    if not all(math.isfinite(v) for v in (rel, out, max_step)):
        return "fail", "error is NaN/Inf (non-finite scales or reference weights)", numbers
    bad = []
    if rel > b["rel_bound"]:
        bad.append(f"‖W−Ŵ‖/‖W‖ {rel:.4g} > bound {b['rel_bound']:.4g}")
    if out > b["rel_bound"]:
        bad.append(f"output error {out:.4g} > bound {b['rel_bound']:.4g}")
    if max_step > b["step_bound"]:
        bad.append(f"a weight is {max_step:.3g} code steps from the reference > bound {b['step_bound']:.3g} "
                   "(a corrupted code or scale)")
    text = (f"rel {rel:.4g}, output {out:.4g} (bound {b['rel_bound']:.4g}); max {max_step:.3g} steps "
            f"(bound {b['step_bound']:.3g})")
    return ("fail", "; ".join(bad), numbers) if bad else ("pass", text, numbers)
