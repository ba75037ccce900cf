"""Repack to and from the float / int8 layouts (fp8, ct_fp8, ct_int8, nvfp4, modelopt_nvfp4, mxfp4, mxfp8,
gptoss_mxfp4): their canonical form is ScaledPlain.

Deciding a module (from its data: the scales decide whether a stored type can change):
    scaled -> scaled   exact when the target's `adapt` re-expresses the ScaledPlain without changing one
                       dequantized value (HF fp8 block <-> compressed-tensors block, tensor <-> tensor: the
                       codes and scales are renamed, the config rewritten); otherwise lossy, with its reasons
                       (per-channel scales into HF fp8, int8 into an FP8 layout ...)
    integer <-> scaled lossy: integer codes with zero points and float codes are different grids
Lossy modules are converted by the least change that fits: the target's own lossy conversion where it has
one (NVFP4 between compressed-tensors and ModelOpt: the global scale's reciprocal, as compressed-tensors'
converter takes it, when that scale is no power of two), else dequantized (the source format's arithmetic)
and requantized with the target's quantizer: absmax scales in its default strategy (fp8: 128x128 blocks;
ct_fp8, ct_int8: per channel; NVFP4 per 16, MX per 32, qtool.quant.fp4); the error is measured.
"""

from __future__ import annotations

from dataclasses import replace

from qtool.errors import NotRepresentable, UsageError

# formats whose quantizer is qtool.quant.fp4 (E2M1 codes or E8M0 scales, which quantize_scaled does not write)
MICRO_FLOAT = ("nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4")


def is_scaled(fmt) -> bool:
    return getattr(fmt, "canonical", None) == "scaled"


def decide(source, m, mp, dst, job, known: dict, lossy_target) -> None:
    """Fill the ModulePlan `mp` of source module `m` for target `dst` (see the module docstring);
    `lossy_target` is the planner's choice of requantization parameters for integer targets."""
    from qtool.formats.scaled_format import module_meta

    src = known.get(m.scheme.format)
    if is_scaled(dst) and job.group_size is not None:
        raise UsageError(f"--group-size does not apply to --to {dst.spec.id}: its scales are per tensor, channel or "
                         "block", fix="drop --group-size (pack --strategy chooses the scales of a new file)")
    if m.scheme.format == dst.spec.id:
        mp.copy = True
        mp.to_bits, mp.to_group_size, mp.to_sym = m.scheme.bits, m.scheme.group_size, m.scheme.sym
        mp.reasons.append("same layout: tensors copied byte for byte")
        return
    from qtool.repack.source import unpack_module

    mp.decided_by = "data"
    plain = unpack_module(source, m, mapped=True)  # a format's error names the file and the module's tensor
    mp.shape = [plain.out_features, plain.in_features]
    if is_scaled(src):
        bad = [msg for sev, msg in plain.anomalies() if sev == "error"]
        if bad:  # converting would carry undefined weights on (or turn them into numbers): the source is broken
            mp.kind, mp.reasons = "impossible", [f"the source data is broken: {'; '.join(bad)}"]
            return
        bo, bi = plain.block
        mp.src = replace(mp.src, bits=src.spec.bits[0], group_size=bi if bo == 1 else -1, sym=plain.zeros is None,
                         desc_act=False)
    else:
        mp.src = replace(mp.src, bits=plain.bits, group_size=plain.group_size, sym=plain.sym,
                         desc_act=plain.desc_act)
    if is_scaled(src) and is_scaled(dst):
        q, why = dst.adapt(plain)
        if q is not None:
            mp.kind = "exact"
            mp.to_bits, mp.to_sym = dst.spec.bits[0], q.zeros is None
            mp.to_group_size = mp.src.group_size
            mp.target_meta = module_meta(q)
            if q.scale_type != plain.scale_type:
                mp.reasons.append(f"scales stored as {q.scale_type} (were {plain.scale_type}): same values")
            return
        mp.kind, mp.reasons = "lossy", why
        inplace = _lossy_in_place(dst, plain)
        if inplace is not None:
            mp.steps = ["invert global scale"]
            mp.to_bits, mp.to_sym, mp.to_group_size = dst.spec.bits[0], True, mp.src.group_size
            mp.target_meta = module_meta(inplace)
            return
    elif is_scaled(dst):
        mp.kind = "lossy"
        mp.reasons = [f"{dst.spec.id} stores {'/'.join(dst.elements)} codes with scales; {m.scheme.format}'s "
                      f"{plain.bits}-bit integer codes with zero points are another grid"]
    else:
        mp.kind = "lossy"
        mp.reasons = [f"{dst.spec.id} stores integer codes; {m.scheme.format} stores {plain.element} codes"]
        lossy_target(m, mp, dst, job)
        return
    mp.steps = ["requantize"]
    mp.to_bits, mp.to_sym = dst.spec.bits[0], True
    bo, bi = dst.default_block
    mp.to_group_size = bi if bo == 1 else -1
    mp.target_meta = {"strategy": _strategy(dst.default_block), "block": list(dst.default_block),
                      "scale_type": _scale_type(plain, dst), "element": dst.elements[0], "zeros": False,
                      "act_dynamic": True, "act_strategy": None, "act_group_size": None}


def _lossy_in_place(dst, plain):
    """The target's own lossy conversion of `plain` without requantizing (NVFP4's `require(lossy=True)`), or
    None when it has none or it does not apply."""
    try:
        return dst.require(plain, lossy=True)
    except TypeError:  # a require() without a lossy mode
        return None
    except NotRepresentable:
        return None


def _strategy(block) -> str:
    from qtool.formats.scaled import strategy_of

    return strategy_of(tuple(block))


def _scale_type(plain, dst) -> str:
    """The requantized scales' type: the source's where the target stores it, else fp32."""
    st = getattr(plain, "scale_type", None)
    if st is None:
        st = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(plain.scales.dtype), "fp32")
    return st if st in dst.scale_types else "fp32"


def convert(conv, m, mp) -> dict:
    """Target tensors of one module planned by `decide` (ModuleConverter.convert for scaled targets)."""
    import torch

    from qtool.errors import NotRepresentable
    from qtool.formats import dequantize
    from qtool.formats.scaled import SCALE_TYPES
    from qtool.quant.scaled import quantize_scaled

    dst = conv.dst
    plain = conv.source_plain(m)
    if mp.relayout:
        q, why = dst.adapt(plain)
        if q is None:
            raise NotRepresentable(f"{m.name}: planned as exact but the data cannot be stored as {dst.spec.id}: "
                                   + "; ".join(why) + "; nothing was written", tensor=m.name,
                                   fix="rerun with --allow-lossy or --exclude it")
        return dst.pack(q)
    if "invert global scale" in mp.steps:
        q = dst.require(plain, lossy=True)
        ref = dequantize(plain, torch.float64)
        diff = dequantize(q, torch.float64) - ref
        mp.max_error = float(diff.abs().max()) if diff.numel() else 0.0
        mp.rel_error = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref)), 1e-300))
        return dst.pack(q)
    w = conv.source_weight(m, plain)
    meta = mp.target_meta or {}
    st = meta.get("scale_type", "fp32")
    compute = dst.compute_for(st)
    out = compute if dst.compute == "scale" else getattr(plain, "out_dtype", None) or \
        SCALE_TYPES["bf16"].storage
    keep = {k: v for k, v in getattr(plain, "meta", {}).items() if k.startswith(("act_", "input_scale"))}
    method = conv.plan.job.method if conv.plan.job.method in ("rtn", "mse") else "rtn"
    if dst.spec.id in MICRO_FLOAT:
        from qtool.quant.fp4 import quantize_for

        q = quantize_for(dst.spec.id, w, method, name=m.name)
    else:
        q = quantize_scaled(w, dst.elements[0], tuple(meta.get("block", dst.default_block)), st, compute, out,
                            method=method, name=m.name, meta=keep)
    ref = w.to(torch.float64)
    diff = dequantize(q, torch.float64) - ref
    mp.max_error = float(diff.abs().max()) if diff.numel() else 0.0
    mp.rel_error = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref)), 1e-300))
    return dst.pack(q)


def dense_linears(source, plan) -> list[str]:
    """Modules whose 2-D float weight is copied dense (lm_head, a skipped layer): an FP8 config names them so
    that loaders which convert every Linear (transformers' FineGrainedFP8) leave them alone. Embeddings and
    norms are no Linear and are not named."""
    quantized = {m.module for m in plan.modules}
    out = []
    for name in source.passthrough:
        if not name.endswith(".weight") or source.container != "safetensors":
            continue
        info = source.tensor_info(name)
        mod = name[: -len(".weight")]
        low = mod.lower()
        if len(info.shape) == 2 and info.dtype in ("F16", "BF16", "F32") and mod not in quantized \
                and "embed" not in low and "norm" not in low and "wte" not in low and "wpe" not in low:
            out.append(mod)
    return out
