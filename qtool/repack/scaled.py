"""Repack decisions and conversions where the source or the target layout is a view of `ScaledPlain`
(float / int8 codes: fp8, ct_fp8, ct_int8, nvfp4, modelopt_nvfp4, mxfp4, mxfp8, gptoss_mxfp4).

Exactness is the target's `adapt` asked about the real data (the module is unpacked: a global scale's
value decides whether its reciprocal is exact, so the header cannot): exact when the target stores the same
codes, scales and arithmetic; else lossy. A lossy module is converted, with --allow-lossy, by the least
change that fits: the target's own lossy conversion where it has one (NVFP4's global-scale reciprocal, the
conversion compressed-tensors' ModelOpt converter makes), otherwise by requantizing the dequantized weight
with the target's quantizer. Between integer and float layouts every conversion requantizes.
"""

from __future__ import annotations

from qtool.errors import NotRepresentable


def is_scaled(fmt) -> bool:
    """True for a format whose canonical form is ScaledPlain (its row says so: ScaledFormat.canonical)."""
    return getattr(fmt, "canonical", None) == "scaled"


def _lossy_in_place(dst, plain):
    """The target's own lossy conversion of `plain` (no requantization), or None when it has none."""
    req = getattr(dst, "require", None)
    try:
        return req(plain, lossy=True)
    except TypeError:  # a require() without a lossy mode
        return None
    except NotRepresentable:
        return None


def decide(source, m, mp, dst, job, lossy_target) -> None:
    """Fill ModulePlan `mp` for module `m` when the source or the target is a scaled layout; `lossy_target`
    is the planner's requantization rule for integer targets (plan._lossy_target)."""
    from qtool.formats import get_format
    from qtool.formats.scaled_format import module_meta

    src = get_format(m.scheme.format)
    mp.decided_by = "data"
    if not is_scaled(dst):  # float codes into an integer layout: its requantization rules (bits, group)
        mp.kind = "lossy"
        mp.reasons.append(f"{m.scheme.format} holds float codes and {dst.spec.id} integer ones: converting requantizes "
                          "the dequantized weight")
        lossy_target(m, mp, dst, job)
        return
    mp.to_bits, mp.to_group_size, mp.to_sym = dst.spec.bits[0], dst.default_block[1], True
    if job.bits is not None or job.group_size is not None:
        mp.kind = "impossible"
        mp.reasons.append(f"--bits/--group-size do not apply to float layouts ({m.scheme.format} -> {dst.spec.id}): "
                          "the layout fixes its element and scale block")
        return
    if not is_scaled(src):
        mp.kind, mp.steps = "lossy", ["requantize"]
        mp.reasons.append(f"{m.scheme.format} holds integer codes and {dst.spec.id} float ones: converting requantizes "
                          "the dequantized weight")
        return
    plain = src.unpack(source.load(m), m.scheme)
    q, why = dst.adapt(plain)
    if not why:
        mp.kind = "exact"
        mp.target_meta = module_meta(q)
        return
    mp.kind, mp.reasons = "lossy", list(why)
    inplace = _lossy_in_place(dst, plain)
    if inplace is not None:
        mp.steps = ["invert global scale"]
        mp.target_meta = module_meta(inplace)
    else:
        mp.steps = ["requantize"]


def requantize(conv, m, mp, plain) -> dict:
    """Target tensors for a lossy module into a scaled layout (ModuleConverter._requantize's scaled branch);
    records the measured error on `mp`."""
    import torch

    from qtool.formats import dequantize

    dst = conv.dst
    w = conv.source_weight(m, plain)
    ref = w.to(torch.float64)
    q = _lossy_in_place(dst, plain) if plain is not None and is_scaled_plain(plain) else None
    if q is None:
        q = _quantize_for(dst, w, conv.plan.job.method, m.name)
    got = dequantize(q, torch.float64)
    out = dst.pack(q)
    diff = got - ref
    mp.max_error = float(diff.abs().max()) if diff.numel() else 0.0
    mp.rel_error = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref)), 1e-300))
    return out


def is_scaled_plain(p) -> bool:
    from qtool.formats.scaled import ScaledPlain

    return isinstance(p, ScaledPlain)


def _quantize_for(dst, w, method: str, name: str):
    """The target layout's quantizer for a dense fp32 weight."""
    fid = dst.spec.id
    method = method if method in ("rtn", "mse") else "rtn"
    from qtool.quant import fp4

    if fid in ("nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4"):
        return fp4.quantize_for(fid, w, method, name=name)
    from qtool.quant.scaled import quantize_scaled

    stype = dst.scale_types[0]
    return quantize_scaled(w, dst.elements[0], tuple(dst.default_block), stype, dst.compute_for(stype), "bfloat16",
                           method=method, name=name)


__all__ = ["decide", "is_scaled", "requantize"]
