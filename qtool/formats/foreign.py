"""Layouts qtool recognizes but has no format module for yet: described from the header, never converted.

Each detector has the shape of `Format.detect`: (module, {short name: Sig}, Claims) -> Detected | None, None
meaning "not this layout"; inspect asks them among the formats in one fixed order (inspect/detect.py). A layout
that gains a format module moves its detector into that module's `detect`.

    awq_gemv        qweight I32 [O, I/8], qzeros I32 [O, W], scales F16 [O, 8W] (W = padded nG/8)
    awq_gemv_fast   qweight I16 [O/4, I], qzeros F16 [8W, O] (-scale*zero), scales F16 [8W, O]
    gptq_int16      GPTQ packed in int16 words (GPTQModel pack_dtype int16): qweight I16 [I*b/16, O]
    qqq             B I32 [K/16, N*16/8] in Marlin tiles, s_channel F32 [1, N], s_group F16 [K/g, N]
    exl3            trellis I16 [K/16, N/16, 16*bits], suh [K], svh [N]
    bnb             weight U8 + weight.absmax / weight.quant_state.bitsandbytes__nf4|fp4 (4-bit),
                    weight I8 + SCB (LLM.int8)
    mlx             weight U32 [O, I*b/32] packed along the input, scales and biases [O, I/g]
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from qtool.formats.awq import awq_gemm_shaped
from qtool.formats.detection import (
    AWQ_FAMILY,
    FLOAT_DTYPES,
    GPTQ_FAMILY,
    INT_DTYPES,
    Claims,
    Detected,
    Sig,
    bits_note,
    exact_div,
    group_from,
    unclaimed,
)
from qtool.formats.gptq import gptq_shaped


def _complete_qweight(t: Mapping[str, Sig], dtype: str) -> bool:
    """A 2-D qweight of `dtype` beside a 2-D scales (incomplete modules are gptq's detect to report)."""
    qw, sc = t.get("qweight"), t.get("scales")
    return qw is not None and sc is not None and qw[0] == dtype and len(qw[1]) == 2 and len(sc[1]) == 2


# --- AWQ GEMV / GEMV_FAST and GPTQ in int16 words ---------------------------------------------------------

def int16_words(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    if not _complete_qweight(t, "I16"):
        return None
    return _int16_words(t, c)


def awq_gemv(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    """qweight [O, I/8] beside qzeros [O, W]: AWQ GEMV when the config says so or no GPTQ/AWQ GEMM shape fits."""
    if not _complete_qweight(t, "I32"):
        return None
    qw, scs, qz = t["qweight"][1], t["scales"][1], t.get("qzeros")
    gemv_shape = qz is not None and qw[0] == scs[0] and qz[1][0] == qw[0] and qz[1][1] * 8 == scs[1]
    if not (c.format == "awq_gemv" and gemv_shape or (not gptq_shaped(t) and not awq_gemm_shaped(t)
                                                       and gemv_shape)):
        return None
    return _awq_gemv(t, c)

def _calc_zeros_width(in_features: int, group_size: int, pack_num: int = 8) -> int:
    """AutoAWQ's GEMV/GEMV_FAST padded zeros width (calculate_zeros_width)."""
    g = in_features if group_size == -1 else group_size
    mult = 1 if g >= 128 else (2 if g == 64 else (4 if g == 32 else 1))
    base = -(-(in_features // g) // pack_num)
    return -(-base // mult) * mult

def _awq_gemv(t: Mapping[str, Sig], c: Claims) -> Detected:
    qw = t["qweight"][1]
    out = qw[0]
    in_f = qw[1] * 8
    zw = t["qzeros"][1][1]
    group = c.group_size
    if group is None:
        fits = [g for g in (128, 64, 32, -1) if _calc_zeros_width(in_f, g) == zw]
        group = fits[0] if fits else None
    notes = [] if c.format in (None, "awq_gemv") else [("error", f"config says {c.format} but the tensors have the "
                                                                "AWQ GEMV layout")]
    notes += bits_note(c, 4)
    return Detected("awq_gemv", 4, group, c.sym if c.sym is not None else False, False, in_f, out, in_f * out,
                    detail="AWQ gemv", notes=notes)

def _int16_words(t: Mapping[str, Sig], c: Claims) -> Detected:
    """An int16 qweight is one of two layouts, told apart by the zeros: AWQ GEMV_FAST (AutoAWQ `qzeros`,
    LLM-AWQ/TinyChat `scaled_zeros`) keeps float zeros shaped like the scales; GPTQ packed in int16 words
    (GPTQModel pack_dtype int16) keeps integer qzeros [nG, O*b/16] and qweight [I*b/16, O]."""
    qw = t["qweight"][1]
    zname = "qzeros" if "qzeros" in t else "scaled_zeros" if "scaled_zeros" in t else None
    z = t.get(zname) if zname else None
    scs = t["scales"][1]
    if zname == "qzeros" and z[0] in INT_DTYPES:
        return _gptq_int16(t, c)
    if z is None or z[0] in FLOAT_DTYPES and z[1] == scs:
        return _awq_gemv_fast(t, c, zname)
    return Detected("unknown", notes=[("error", f"int16 qweight {list(qw)} with {zname} {z[0]} {list(z[1])}: "
                                                "neither AWQ GEMV_FAST (float zeros shaped like the scales) "
                                                "nor GPTQ in int16 words (integer qzeros)")])

def _gptq_int16(t: Mapping[str, Sig], c: Claims) -> Detected:
    qw = t["qweight"][1]
    n_groups, out = t["scales"][1]
    qz = t["qzeros"][1]
    notes: list[tuple[str, str]] = []
    bits = exact_div(qz[1] * 16, out) if len(qz) == 2 else None
    in_f = exact_div(qw[0] * 16, bits) if bits else None
    if bits not in (2, 4, 8) or in_f is None or qw[1] != out or qz[0] != n_groups:
        return Detected("unknown", notes=[("error", f"int16 qweight {list(qw)}, qzeros {list(qz)}, scales "
                                                    f"{[n_groups, out]} match no GPTQ layout in 16-bit words")])
    pack = c.raw.get("pack_dtype") if isinstance(c.raw, dict) else None
    if pack is not None and str(pack) != "int16":
        notes.append(("error", f"config says pack_dtype {pack} but qweight and qzeros are int16 words"))
    if c.format in AWQ_FAMILY or c.format in ("ct", "ct_fp8", "nvfp4", "mxfp4", "mxfp8", "fp8", "bnb", "marlin"):
        notes.append(("error", f"config says {c.format} but the tensors are GPTQ in int16 words"))
    g_idx = t.get("g_idx")
    if g_idx is not None and g_idx[1] != (in_f,):
        notes.append(("error", f"g_idx shape {list(g_idx[1])} != [{in_f}] (in_features from qweight)"))
    group, gnote = group_from(in_f, n_groups, c.group_size)
    if gnote:
        notes.append(("error", gnote))
    notes += bits_note(c, bits)
    notes.append(("warning", "GPTQ packed in int16 words (GPTQModel pack_dtype int16): described from the "
                             "header only; qtool decodes, repacks and runs int32-word GPTQ"))
    fmt = c.format if c.format in GPTQ_FAMILY else "gptq"
    return Detected(f"{fmt}_int16", bits, group, c.sym, c.desc_act, in_f, out, in_f * out,
                    detail=f"qweight int16 [{qw[0]}, {qw[1]}]", notes=notes)

def _awq_gemv_fast(t: Mapping[str, Sig], c: Claims, zname: str | None = "qzeros") -> Detected:
    qw = t["qweight"][1]
    out = t["scales"][1][1]
    in_f = qw[1] if len(qw) == 2 else None
    notes: list[tuple[str, str]] = []
    if len(qw) != 2 or qw[0] * 4 != out:
        notes.append(("error", f"int16 qweight {list(qw)} is not [O/4, I] for O = {out}"))
    group = c.group_size
    if group is None and in_f:
        rows = t["scales"][1][0]
        fits = [g for g in (128, 64, 32, 16, -1) if _calc_zeros_width(in_f, g) * 8 == rows]
        group = fits[0] if fits else None
    if c.format not in (None, "awq_gemv_fast"):
        notes.append(("error", f"config says {c.format} but the tensors have the AWQ GEMV_FAST layout "
                               "(int16 qweight)"))
    notes += bits_note(c, 4)
    if zname is None:
        notes.append(("error", "AWQ GEMV_FAST qweight and scales without zeros (qzeros or scaled_zeros)"))
    detail = "LLM-AWQ (TinyChat) gemv_fast, scaled_zeros" if zname == "scaled_zeros" else "AWQ gemv_fast"
    return Detected("awq_gemv_fast", 4, group, c.sym if c.sym is not None else False, False, in_f, out,
                    (in_f or 0) * out or None, detail=detail, notes=notes)


# --- QQQ, EXL3, MLX ----------------------------------------------------------------------------------------

def qqq(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    if "B" not in t or not ("s_channel" in t or "s_group" in t):
        return None
    return _qqq(t, c)


def exl3(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    if "trellis" not in t:
        return None
    return _exl3(t, c)


def mlx(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    w = t.get("weight")
    if w is None or w[0] != "U32" or "scales" not in t or len(w[1]) != 2:
        return None
    return _mlx(module, t, c)


def _qqq(t: Mapping[str, Sig], c: Claims) -> Detected:
    """QQQ (vLLM `qqq`): B int32 [K/16, N*16/8] in Marlin tile order, s_channel F32 [1, N], s_group F16
    [K/g, N] (empty [0] for per-channel), workspace; 4-bit codes, int8 activations. qtool reads it header-only."""
    b_dt, b = t["B"]
    sch = t.get("s_channel")
    sg = t.get("s_group")
    n = sch[1][-1] if sch is not None and len(sch[1]) >= 1 else (sg[1][1] if sg is not None and len(sg[1]) == 2
                                                                else None)
    if b_dt != "I32" or len(b) != 2 or n is None or b[1] * 8 != n * 16:
        return unclaimed(t) or Detected("unknown")
    k = b[0] * 16
    group: int | None = -1
    if sg is not None and len(sg[1]) == 2 and sg[1][0] > 0:
        group = exact_div(k, sg[1][0])
    notes = [] if c.format in (None, "qqq") else [("error", f"config says {c.format} but the tensors are QQQ "
                                                            "(B, s_channel, s_group)")]
    notes += bits_note(c, 4)
    return Detected("qqq", 4, group, True, False, k, n, k * n, detail="QQQ (w4a8, Marlin tiles)", notes=notes)

def _exl3(t: Mapping[str, Sig], c: Claims) -> Detected:
    """EXL3 (exllamav3): trellis I16 [K/16, N/16, 16*bits], suh F16 [K] / svh F16 [N] (or packed su/sv
    I16), optional mcg / mul1 codebook tags. bits may be half-integer (mul1)."""
    tr_dt, tr = t["trellis"]
    if tr_dt != "I16" or len(tr) != 3 or tr[2] % 8:
        return unclaimed(t) or Detected("unknown")
    k, n = tr[0] * 16, tr[1] * 16
    bits = tr[2] // 16 if tr[2] % 16 == 0 else None
    notes: list[tuple[str, str]] = []
    for side, want in (("suh", k), ("svh", n)):
        if side in t and t[side][1] != (want,):
            notes.append(("error", f"EXL3 {side} {list(t[side][1])} != [{want}] (from trellis {list(tr)})"))
    if c.format not in (None, "exl3"):
        notes.append(("error", f"config says {c.format} but the tensors are EXL3 (trellis, suh, svh)"))
    return Detected("exl3", bits, None, None, False, k, n, k * n,
                    detail=f"EXL3 trellis, {tr[2] / 16:g} bits/weight", notes=notes)

# MLX stores bits and group size in config.json "quantization" only; these are the sizes its tools write.
_MLX_BITS = (2, 3, 4, 5, 6, 8)
_MLX_GROUPS = (32, 64, 128)

def _mlx(name: str, t: Mapping[str, Sig], c: Claims) -> Detected:
    """MLX affine quantization: weight U32 [O, I*b/32] packed along the input, scales and biases [O, I/g].
    Per-module overrides sit in the same config dict, keyed by module path."""
    o, words = t["weight"][1]
    sc = t["scales"][1]
    notes: list[tuple[str, str]] = []
    if len(sc) != 2 or sc[0] != o or ("biases" in t and t["biases"][1] != sc):
        return unclaimed(t) or Detected("unknown")
    ng = sc[1]
    over = c.raw.get(name) if isinstance(c.raw, dict) else None
    bits = over.get("bits") if isinstance(over, dict) else c.bits
    group = over.get("group_size") if isinstance(over, dict) else c.group_size
    fits = [(b, g) for b in _MLX_BITS for g in _MLX_GROUPS if (words * 32) % b == 0 and words * 32 // b == ng * g]
    if isinstance(bits, int) and isinstance(group, int) and not isinstance(bits, bool):
        i = exact_div(words * 32, bits) if bits > 0 else None
        if i is None or group <= 0 or i != ng * group:
            notes.append(("error", f"config says {bits}-bit, group {group} but weight [{o}, {words}] with {ng} "
                                   f"groups does not hold that"))
            i = None
    elif len(fits) == 1:
        (bits, group), i = fits[0], words * 32 // fits[0][0]
    else:
        bits = group = i = None
        shown = ", ".join(f"{b}-bit/g{g}" for b, g in fits) or "no MLX bits/group size"
        notes.append(("error", f"MLX weight [{o}, {words}] with {ng} groups fits {shown}; the bits and group "
                               "size live only in config.json 'quantization'; fix: add it"))
    if "biases" not in t:
        notes.append(("warning", "MLX weight and scales without biases (affine mode stores them)"))
    if c.format not in (None, "mlx"):
        notes.append(("error", f"config says {c.format} but the tensors are MLX (U32 weight, scales, biases)"))
    return Detected("mlx", bits, group, False, False, i, o, (i or 0) * o or None, detail="MLX affine", notes=notes)


# --- bitsandbytes --------------------------------------------------------------------------------------------

def bnb_4bit(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    if not any(k.startswith("weight.quant_state.") or k == "weight.absmax" for k in t):
        return None
    return _bnb4(t, c, c.bnb_shape)


def bnb_int8(module: str, t: Mapping[str, Sig], c: Claims) -> Detected | None:
    if "weight" not in t or "SCB" not in t:
        return None
    return _bnb8(t)


# bitsandbytes' 4-bit block sizes (quantize_4bit asserts one of these; 32 on newer CUDA builds)
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def bnb_state(blob: bytes) -> tuple[tuple[int, int] | None, int | None]:
    """([out, in], blocksize) as bitsandbytes records them in its packed 4-bit quant state (the uint8 tensor
    `weight.quant_state.bitsandbytes__nf4|fp4` holds UTF-8 JSON: quant_type, blocksize, dtype, shape, ...);
    None for a field that is absent or not a plausible value."""
    try:
        d = json.loads(bytes(blob).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    if not isinstance(d, dict):
        return None, None
    shape, block = d.get("shape"), d.get("blocksize")
    ok_shape = isinstance(shape, list) and len(shape) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1 << 40 for x in shape)
    ok_block = isinstance(block, int) and not isinstance(block, bool) and 0 < block < 1 << 40
    return ((shape[0], shape[1]) if ok_shape else None), (block if ok_block else None)


def _bnb4(t: Mapping[str, Sig], c: Claims, state_shape: tuple[int, int] | None = None) -> Detected:
    """bitsandbytes 4-bit: weight U8 [O*I/2, 1] holds two codes a byte, so the header gives O*I only; the
    shape comes from the quant state (read by the caller, see `bnb_state`), else from the bias. The block
    size is the quant state's (or the config's); absmax holds one scale per block, the last one partial."""
    w = t.get("weight")
    qs = [k for k in t if k.startswith("weight.quant_state.")]
    kind = qs[0].rsplit("__", 1)[-1] if qs and "__" in qs[0] else "4bit"
    n = w[1][0] * 2 if w is not None and len(w[1]) >= 1 else None
    if w is not None and len(w[1]) == 2 and w[1][1] != 1:
        n = w[1][0] * w[1][1] * 2
    notes = []
    o = i = None
    if state_shape is not None:
        o, i = state_shape
        if n is not None and o * i not in (n, n - 1):  # an odd O*I leaves half of the last byte unused
            notes.append(("error", f"quant state says shape [{o}, {i}] but the weight holds {n} codes"))
    elif "bias" in t and len(t["bias"][1]) == 1 and n:
        o = t["bias"][1][0]
        i = exact_div(n, o)
        o = o if i else None
    if o is None:
        notes.append(("warning", "bitsandbytes 4-bit module without a readable quant state or bias: in/out "
                                 "features unknown from the header"))
    elif i is not None:
        n = o * i
    group, why = _bnb_block(t.get("weight.absmax"), n, c.bnb_blocksize)
    if why:
        notes.append(("error", why))
    if c.format not in (None, "bnb"):
        notes.append(("error", f"config says {c.format} but the tensors are bitsandbytes 4-bit"))
    notes += bits_note(c, 4)
    return Detected("bnb", 4, group, True, False, i, o, n, detail=f"bitsandbytes {kind}", notes=notes)


def _bnb_block(absmax: Sig | None, n: int | None, declared: int | None) -> tuple[int | None, str | None]:
    """The block size, and what is wrong with absmax: one scale per block of `n` codes, the last partial."""
    if absmax is None:
        return declared, "bitsandbytes 4-bit weight without weight.absmax (its block scales)"
    if not n:
        return declared, None
    count = 1
    for d in absmax[1]:
        count *= d
    if declared is not None:
        need = -(-n // declared)
        if count != need:
            return declared, (f"weight.absmax holds {count} scales, but {n} codes in blocks of {declared} "
                              f"need {need}")
        return declared, None
    fits = [b for b in BNB_BLOCKSIZES if -(-n // b) == count]
    if not fits:
        return None, (f"weight.absmax holds {count} scales: no bitsandbytes block size "
                      f"({BNB_BLOCKSIZES[0]}..{BNB_BLOCKSIZES[-1]}) gives that many blocks of {n} codes")
    if len(fits) > 1:
        return None, (f"weight.absmax holds {count} scales, which fits block sizes {', '.join(map(str, fits))} "
                      f"for {n} codes; the quant state or config must name it")
    return fits[0], None


def _bnb8(t: Mapping[str, Sig]) -> Detected:
    o, i = t["weight"][1] if len(t["weight"][1]) == 2 else (t["weight"][1][0], 1)
    return Detected("bnb", 8, -1, True, False, i, o, i * o, detail="bitsandbytes LLM.int8 (SCB)")
