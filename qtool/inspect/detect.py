"""Per-module format detection from tensor names, dtypes, shapes and the checkpoint's claims.

Pure functions over `{short_name: (dtype, shape)}` (safetensors dtype names: "I32", "F16", "F8_E4M3", ...)
plus a `Claims` built from the config and file metadata; no tensor data, no torch, no file I/O.

Rules (FORMATS.md; I = in_features, O = out_features, b = bits, pf = 32/b, nG = number of groups):

    gptq / gptq_v2 / gptq_p  qweight I32 [I*b/32, O], qzeros I32 [nG, O*b/32], scales [nG, O], g_idx [I]
                             (v1/v2/planar share shapes: the config decides, --deep checks the zeros)
    awq (gemm)               qweight I32 [I, O*b/32] packed along O, qzeros [nG, O*b/32], scales [nG, O]
    awq_gemv                 qweight I32 [O, I/8], qzeros I32 [O, W], scales F16 [O, 8W] (W = padded nG/8)
    awq_gemv_fast            qweight I16 [O/4, I], qzeros F16 [8W, O] (-scale*zero), scales F16 [8W, O]
    marlin                   B (or qweight) I32 [K/16, N*16/pf], s (or scales) [nG, N]; qtool files say
                             so in safetensors metadata `qtool.format: marlin`; legacy files have B/s
    ct (pack-quantized)      weight_packed I32 [O, ceil(I*b/32)], weight_scale [O, nG],
                             weight_zero_point (asym), weight_g_idx (act-order), weight_shape I64 [2]
    nvfp4, modelopt_nvfp4,   the formats in SELF_DETECTING answer for themselves (Format.detect, in their
    mxfp4, mxfp8,            modules): NVFP4 U8 pairs + E4M3 per 16 + fp32 global (compressed-tensors and
    gptoss_mxfp4             ModelOpt names), MX E2M1/E4M3 + E8M0 per 32, gpt-oss `_blocks`/`_scales`
    ct_fp8 / fp8             weight F8_E4M3 + weight_scale (ct, vLLM fp8) or weight_scale_inv (HF block fp8)
    bnb                      weight U8 + weight.absmax / weight.quant_state.bitsandbytes__nf4|fp4 (4-bit),
                             weight I8 + SCB (LLM.int8)
    dense                    weight F16/BF16/F32 2-D
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from qtool.formats.base import get_format
from qtool.formats.detection import (
    AWQ_FAMILY,
    FLOAT_DTYPES,
    FP8_DTYPES,
    GPTQ_FAMILY,
    INT_DTYPES,
    SIDECARS,
    Claims,
    Detected,
    Sig,
    bits_note,
    config_regex,
    ct_scheme_for,
    exact_div,
    group_from,
    unclaimed,
)

# bitsandbytes hangs its 4-bit state off "<module>.weight.<...>": those names belong to <module>.
# Formats whose own `detect` inspect asks, in this order, before the detectors below (the micro-float
# layouts: an E4M3 weight with E8M0 scales is MXFP8, not FP8; a U8 weight with E4M3 scales is ModelOpt NVFP4).
SELF_DETECTING = ("nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4")

_BNB_SUFFIX = re.compile(r"^(?P<mod>.+)\.(?P<short>weight\.(?:absmax|quant_map|nested_absmax|nested_quant_map"
                         r"|quant_state\..+))$")


def split_name(name: str) -> tuple[str, str]:
    """Tensor name -> (module prefix, short name); bitsandbytes' `x.weight.absmax` -> ("x", "weight.absmax")."""
    m = _BNB_SUFFIX.match(name)
    if m:
        return m.group("mod"), m.group("short")
    prefix, _, short = name.rpartition(".")
    return prefix, short


def group_modules(names_sigs: dict[str, Sig]) -> dict[str, dict[str, Sig]]:
    """{full name: sig} -> {module prefix: {short name: sig}} in first-seen order."""
    out: dict[str, dict[str, Sig]] = {}
    for name, sig in names_sigs.items():
        prefix, short = split_name(name)
        out.setdefault(prefix, {})[short] = sig
    return out


_LAYER_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def collapse_layers(name: str) -> str:
    """`model.layers.17.mlp.down_proj` -> `model.layers.#.mlp.down_proj` (every dotted integer)."""
    return _LAYER_NUM.sub("#", name)


# --- claims -------------------------------------------------------------------------------------------


def config_claims(qc: Any, raw: dict | None, source: str, path: object = None) -> Claims | None:
    """What a quantization config says: a parsed QuantConfig (qtool.io.qconfig) and its raw dict.

    Regexes the config carries (GPTQModel `dynamic` keys, compressed-tensors `re:` targets and ignore entries)
    are compiled here, all of them, so that a pattern qtool will not run is refused even when no module
    would reach it. The config's own "qtool" entry (qtool's Marlin contract repeated for config readers)
    belongs to the config."""
    if qc is None:
        return None
    r = raw or {}
    c = Claims(format=qc.format, quant_method=qc.quant_method, bits=qc.bits, group_size=qc.group_size,
               sym=qc.sym, desc_act=qc.desc_act, checkpoint_format=qc.checkpoint_format, source=source,
               raw=dict(r), path=str(path) if path is not None else None)
    if qc.quant_method == "compressed-tensors":
        groups = r.get("config_groups") or {}
        if isinstance(groups, dict):
            for g in groups.values():
                if isinstance(g, dict):
                    t = g.get("targets") or []
                    c.ct_groups.append(([str(x) for x in t] if isinstance(t, list) else [str(t)],
                                        g.get("weights") if isinstance(g.get("weights"), dict) else {},
                                        g.get("format")))
        ig = r.get("ignore") or []
        c.ct_ignore = [str(x) for x in ig] if isinstance(ig, list) else []
        c.ct_version = str(r["version"]) if r.get("version") is not None else None
        for pat in [t for targets, _w, _f in c.ct_groups for t in targets] + c.ct_ignore:
            if pat.startswith("re:"):
                config_regex(c, pat[3:], "compressed-tensors targets/ignore")
    dyn = r.get("dynamic")
    if isinstance(dyn, dict):
        for key in dyn:
            if isinstance(key, str):
                config_regex(c, key[2:] if key[:2] in ("+:", "-:") else key, "dynamic")
    bs = r.get("weight_block_size")
    if isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs):
        c.block_size = (bs[0], bs[1])
    if qc.quant_method == "bitsandbytes" and isinstance(r.get("bnb_4bit_blocksize"), int):
        c.bnb_blocksize = r["bnb_4bit_blocksize"]
    q = r.get("qtool")
    if isinstance(q, dict):
        md = {f"qtool.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in q.items()}
        if c.format is None and "qtool.marlin.contract" in md:
            c.format = "marlin"
        _contract_into(c, md, c.format, overwrite=False)
    return c


def metadata_claims(metadata: dict[str, str] | None) -> Claims | None:
    """What qtool's own safetensors metadata says (`qtool.format`, `qtool.<format>.bits`, ...), or None.
    Engines never read it; it is qtool's record of what it wrote."""
    md = metadata or {}
    qf = md.get("qtool.format") or ("marlin" if "qtool.marlin.contract" in md else None)
    if not qf:
        return None
    c = Claims(format=qf, source="safetensors metadata (qtool.*)")
    _contract_into(c, md, qf, overwrite=True)
    return c


def _contract_into(c: Claims, md: dict[str, str], qf: str | None, overwrite: bool) -> None:
    """bits / group_size / act-order / zero points / Marlin padding from qtool.* keys into `c` (only where
    `c` is silent unless `overwrite`)."""
    def put(attr: str, value: Any) -> None:
        if overwrite or getattr(c, attr) is None:
            setattr(c, attr, value)

    for key, attr in (("bits", "bits"), ("group_size", "group_size")):
        v = md.get(f"qtool.{qf}.{key}", md.get(f"qtool.{key}"))
        if v is not None and re.fullmatch(r"-?\d{1,9}", str(v)):
            put(attr, int(v))
    act = md.get(f"qtool.{qf}.act_order", md.get("qtool.desc_act"))
    if act is not None:
        put("desc_act", str(act).lower() == "true")
    zp = md.get(f"qtool.{qf}.zero_points")
    if zp is not None:
        put("sym", str(zp).lower() != "true")
    pad = md.get("qtool.marlin.padding")
    if pad and (overwrite or not c.marlin_padding):
        try:
            d = json.loads(pad)
            c.marlin_padding = {str(k): list(v) for k, v in d.items()
                                if isinstance(v, list) and len(v) == 4} if isinstance(d, dict) else {}
        except (ValueError, TypeError, RecursionError):
            c.marlin_padding = {}


# Fields two sources can disagree on, and how a message names them.
_COMPARED = (("format", "format"), ("bits", "bits"), ("group_size", "group_size"), ("sym", "sym"),
             ("desc_act", "act-order"))


def disagreements(config: Claims | None, meta: Claims | None) -> list[tuple[str, object, object]]:
    """(field, config's value, metadata's value) wherever both sources speak and differ."""
    if config is None or meta is None:
        return []
    out = []
    for attr, label in _COMPARED:
        a, b = getattr(config, attr), getattr(meta, attr)
        if a is not None and b is not None and a != b:
            out.append((label, a, b))
    return out


def claims_from(config: Claims | None, meta: Claims | None) -> Claims | None:
    """The claims detection works from: the config's, which engines read, when there is one; qtool's own
    metadata only fills facts the config cannot state (Marlin padding) or stands in when there is no config.
    A disagreement between the two is reported by the caller (see `disagreements`), never resolved here."""
    if config is None:
        return meta
    if meta is not None and not config.marlin_padding and meta.marlin_padding:
        config.marlin_padding = dict(meta.marlin_padding)
    return config


# --- detection ----------------------------------------------------------------------------------------


def _calc_zeros_width(in_features: int, group_size: int, pack_num: int = 8) -> int:
    """AutoAWQ's GEMV/GEMV_FAST padded zeros width (calculate_zeros_width)."""
    g = in_features if group_size == -1 else group_size
    mult = 1 if g >= 128 else (2 if g == 64 else (4 if g == 32 else 1))
    base = -(-(in_features // g) // pack_num)
    return -(-base // mult) * mult


def module_claims(c: Claims, module: str) -> Claims:
    """The claims for one module, after GPTQModel's per-module `dynamic` overrides in the config:
    {"+:REGEX": {"bits": 8, "group_size": 64, ...}} changes the scheme of matching modules (the first match
    wins, and a match is anchored at the start of the name, as GPTQModel's re.match applies them).
    "-:REGEX" (module left unquantized) needs nothing here: detection of a dense module does not compare it
    with the config."""
    dyn = c.raw.get("dynamic") if isinstance(c.raw, dict) else None
    if not isinstance(dyn, dict):
        return c
    for key, over in dyn.items():
        if not isinstance(key, str) or not isinstance(over, dict):
            continue
        sign, pattern = (key[:2], key[2:]) if key[:2] in ("+:", "-:") else ("+:", key)
        hit = config_regex(c, pattern, "dynamic").match(module)
        if hit and sign == "+:":
            fields = {k: over[k] for k in ("bits", "group_size", "sym", "desc_act") if k in over}
            for k, v in fields.items():
                want = bool if k in ("sym", "desc_act") else int
                if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                    from qtool.errors import InputError

                    raise InputError(f"dynamic['{key[:80]}'].{k} is {str(v)[:40]!r}, not {want.__name__}",
                                     path=c.path or c.source, fix=f"give {k} as a JSON {want.__name__}")
            return dataclasses.replace(c, **fields) if fields else c
        if hit:
            return c
    return c


def detect_module(name: str, t: dict[str, Sig], claims: Claims | None,
                  bnb_shape: tuple[int, int] | None = None) -> Detected | None:
    """Detect one module's layout; None when the prefix holds no linear weight (norms, biases alone).

    A module no detector claims that holds an integer weight-like tensor or a quantization sidecar is an
    "unknown quantized layout" (severity error): qtool never calls what it does not understand dense.
    bnb_shape: [out, in] from a bitsandbytes quant state, which only the tensor data records."""
    c = module_claims(claims, name) if claims is not None else Claims()
    s = set(t)
    meta_marlin = c.format == "marlin"
    if "qweight" in s and meta_marlin or {"B", "s"} <= s:
        return _marlin(name, t, c)
    if "B" in s and ("s_channel" in s or "s_group" in s):
        return _qqq(t, c)
    if "trellis" in s:
        return _exl3(t, c)
    if "qweight" in s:
        return _qweight(t, c)
    for fid in SELF_DETECTING:
        d = get_format(fid).detect(name, t, c)
        if d is not None:
            return d
    if "weight_packed" in s:
        return _ct_packed(name, t, c)
    w = t.get("weight")
    if any(k.startswith("weight.quant_state.") or k == "weight.absmax" for k in s):
        return _bnb4(t, c, bnb_shape)
    if w is not None and "SCB" in s:
        return _bnb8(t)
    if w is not None and w[0] in FP8_DTYPES and len(w[1]) == 2:
        return _fp8(t, c)
    if w is not None and w[0] == "I8" and "weight_scale" in s and len(w[1]) == 2:
        o, i = w[1]
        d = Detected("ct_int8", 8, -1, True, False, i, o, i * o, detail="int8 weight + weight_scale")
        return d
    if w is not None and w[0] == "U32" and "scales" in s and len(w[1]) == 2:
        return _mlx(name, t, c)
    if w is not None and len(w[1]) == 2 and w[0] in FLOAT_DTYPES and not s & SIDECARS:
        o, i = w[1]
        return Detected("dense", FLOAT_DTYPES[w[0]], None, None, None, i, o, i * o, detail=w[0])
    return unclaimed(t)


def _qqq(t: dict[str, Sig], c: Claims) -> Detected:
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


def _exl3(t: dict[str, Sig], c: Claims) -> Detected:
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


def _mlx(name: str, t: dict[str, Sig], c: Claims) -> Detected:
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


def _qweight(t: dict[str, Sig], c: Claims) -> Detected:
    qw_dt, qw = t["qweight"]
    sc = t.get("scales")
    qz = t.get("qzeros")
    if sc is None or len(qw) != 2 or len(sc[1]) != 2:
        missing = [n for n in ("scales", "qzeros") if n not in t]
        return Detected("unknown", notes=[("error", f"qweight {list(qw)} without {missing or 'a 2-D scales'}: "
                                                    "incomplete or unknown layout")])
    scs = sc[1]
    if qw_dt == "I16":
        return _int16_words(t, c)
    if qw_dt != "I32":
        return Detected("unknown", notes=[("error", f"qweight is {qw_dt}; GPTQ/AWQ pack into int32")])
    n_groups, out = scs
    claimed = c.format
    gptq_shape = qw[1] == out and qz is not None and qz[1][0] == n_groups
    awq_shape = qw[1] != out and qz is not None and qz[1][0] == n_groups and qz[1][1] == qw[1] \
        and out % qw[1] == 0
    gemv_shape = qz is not None and qw[0] == scs[0] and qz[1][0] == qw[0] and qz[1][1] * 8 == scs[1]
    if claimed == "awq_gemv" and gemv_shape or (not gptq_shape and not awq_shape and gemv_shape):
        return _awq_gemv(t, c)
    if awq_shape and not gptq_shape:
        return _awq_gemm(t, c)
    if gptq_shape:
        return _gptq(t, c)
    return Detected("unknown", notes=[("error", f"qweight {list(qw)}, qzeros {list(qz[1]) if qz else None}, "
                                                f"scales {list(scs)} match no GPTQ/AWQ layout")])


def _gptq(t: dict[str, Sig], c: Claims) -> Detected:
    qw = t["qweight"][1]
    n_groups, out = t["scales"][1]
    qz = t["qzeros"][1]
    notes: list[tuple[str, str]] = []
    bits = exact_div(qz[1] * 32, out)
    if bits is None or bits not in (2, 3, 4, 5, 6, 7, 8):
        return Detected("unknown", notes=[("error", f"qzeros {list(qz)} does not hold whole zero points for "
                                                    f"{out} outputs")])
    in_f = exact_div(qw[0] * 32, bits)
    if in_f is None:
        notes.append(("error", f"qweight has {qw[0]} rows: not a whole number of {bits}-bit codes"))
    g_idx = t.get("g_idx")
    if g_idx is not None and in_f is not None and g_idx[1] != (in_f,):
        notes.append(("error", f"g_idx shape {list(g_idx[1])} != [{in_f}] (in_features from qweight)"))
    fmt = "gptq"
    if c.format in GPTQ_FAMILY:
        fmt = c.format
    elif c.format in AWQ_FAMILY:
        notes.append(("error", f"config says {c.format} but the tensors have the GPTQ layout (qweight packed "
                               f"along inputs, [I*b/32, O]); fix: quant_method: gptq"))
    elif c.format in ("ct", "ct_fp8", "nvfp4", "mxfp4", "mxfp8", "fp8", "bnb", "marlin"):
        notes.append(("error", f"config says {c.format} but the tensors have the GPTQ layout"))
    elif c.format is None:
        pass  # the file-level "no config" finding covers it
    if fmt == "gptq" and bits not in (2, 4, 8) and c.format is None:
        notes.append(("warning", f"{bits}-bit qweight without a config: continuous (gptq) and planar (gptq_p) "
                                 "layouts have the same shapes; assuming continuous"))
    if fmt in ("gptq", "gptq_v2") and bits not in (2, 3, 4, 8):
        notes.append(("error", f"{bits}-bit codes have no continuous GPTQ layout (2, 3, 4, 8); "
                               "fix: checkpoint_format: gptq_p if the file is planar"))
    group, gnote = group_from(in_f, n_groups, c.group_size)
    if gnote:
        notes.append(("error", gnote))
    notes += bits_note(c, bits)
    d = Detected(fmt, bits, group, c.sym, c.desc_act, in_f, out, (in_f or 0) * out or None,
                 detail=f"qweight [{qw[0]}, {qw[1]}]", notes=notes)
    return d


def _awq_gemm(t: dict[str, Sig], c: Claims) -> Detected:
    qw = t["qweight"][1]
    n_groups, out = t["scales"][1]
    bits = exact_div(qw[1] * 32, out)
    notes: list[tuple[str, str]] = []
    if bits != 4:
        notes.append(("warning", f"AWQ GEMM with {bits}-bit codes: the classic interleaved layout is 4-bit only"))
    in_f = qw[0]
    if c.format in GPTQ_FAMILY:
        notes.append(("error", f"config says {c.format} but the tensors have the AWQ GEMM layout (qweight "
                               f"packed along outputs, [I, O*b/32]); fix: quant_method: awq, version: gemm"))
    elif c.format not in (None, "awq"):
        notes.append(("error", f"config says {c.format} but the tensors have the AWQ GEMM layout"))
    if "g_idx" in t:
        notes.append(("warning", "AWQ GEMM has no g_idx, but this module carries one"))
    group, gnote = group_from(in_f, n_groups, c.group_size)
    if gnote:
        notes.append(("error", gnote))
    notes += bits_note(c, bits)
    sym = c.sym if c.sym is not None else False
    return Detected("awq", bits, group, sym, False, in_f, out, in_f * out, detail="AWQ gemm", notes=notes)


def _awq_gemv(t: dict[str, Sig], c: Claims) -> Detected:
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


def _int16_words(t: dict[str, Sig], c: Claims) -> Detected:
    """An int16 qweight is one of two layouts, told apart by the zeros: AWQ GEMV_FAST (AutoAWQ `qzeros`,
    LLM-AWQ/TinyChat `scaled_zeros`) keeps float zeros shaped like the scales; GPTQ packed in int16 words
    (GPTQModel pack_dtype int16) keeps integer qzeros [nG, O*b/16] and qweight [I*b/16, O]."""
    qw = t["qweight"][1]
    zname = "qzeros" if "qzeros" in t else "scaled_zeros" if "scaled_zeros" in t else None
    z = t.get(zname) if zname else None
    scs = t["scales"][1]
    if z is not None and z[0] in INT_DTYPES:
        return _gptq_int16(t, c)
    if z is None or z[0] in FLOAT_DTYPES and z[1] == scs:
        return _awq_gemv_fast(t, c, zname)
    return Detected("unknown", notes=[("error", f"int16 qweight {list(qw)} with {zname} {z[0]} {list(z[1])}: "
                                                "neither AWQ GEMV_FAST (float zeros shaped like the scales) "
                                                "nor GPTQ in int16 words (integer qzeros)")])


def _gptq_int16(t: dict[str, Sig], c: Claims) -> Detected:
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


def _awq_gemv_fast(t: dict[str, Sig], c: Claims, zname: str | None = "qzeros") -> Detected:
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


def _marlin(name: str, t: dict[str, Sig], c: Claims) -> Detected:
    bname = "B" if "B" in t else "qweight"
    sname = "s" if "s" in t else "scales"
    if sname not in t:
        return Detected("unknown", notes=[("error", f"Marlin '{bname}' without scales ('s' or 'scales')")])
    b = t[bname][1]
    n_groups, n = t[sname][1] if len(t[sname][1]) == 2 else (1, t[sname][1][0])
    k = b[0] * 16
    bits = exact_div(b[1] * 32, n * 16)
    notes: list[tuple[str, str]] = []
    if bits not in (4, 8):
        notes.append(("error", f"Marlin {bname} {list(b)} with {n} outputs gives {bits}-bit codes (4 or 8 expected)"))
    if c.format not in (None, "marlin") and "B" in t:
        notes.append(("error", f"config says {c.format} but the tensors are Marlin's B/s"))
    # Padded modules: the contract records [N, K, Np, Kp]; the shapes here are the padded ones.
    pad = c.marlin_padding.get(name) or (c.marlin_padding.get("") if len(c.marlin_padding) == 1 else None)
    k_pad = k
    if pad and pad[2:] == [n, k]:
        n, k = pad[0], pad[1]
    group, gnote = group_from(k_pad, n_groups, c.group_size)
    if gnote:
        notes.append(("error", gnote))
    notes += bits_note(c, bits)
    legacy = bname == "B"
    sym = "qzeros" not in t
    desc = "perm" in t or "g_idx" in t
    if c.desc_act is not None and c.desc_act != desc and not legacy:
        notes.append(("warning", f"contract says act_order {str(c.desc_act).lower()} but the module "
                                 f"{'has' if desc else 'has no'} perm/g_idx"))
    return Detected("marlin", bits, group, sym, desc, k, n, k * n,
                    detail="legacy marlin (B/s)" if legacy else "qtool marlin contract", notes=notes)


def _ct_packed(name: str, t: dict[str, Sig], c: Claims) -> Detected:
    wp_dt, wp = t["weight_packed"]
    sc = t.get("weight_scale")
    notes: list[tuple[str, str]] = []
    weights, _gfmt, ignored = ct_scheme_for(c, name) if c.ct_groups else (None, None, False)
    if ignored:
        notes.append(("warning", "module is on the compressed-tensors ignore list but is quantized"))
    if sc is None or len(wp) != 2:
        return Detected("unknown", notes=[("error", "weight_packed without a 2-D weight_scale")])
    o = wp[0]
    if wp_dt != "I32":
        return Detected("unknown", notes=[("error", f"weight_packed is {wp_dt}; pack-quantized uses int32")])
    cbits = cgroup = csym = None
    cdesc = None
    if weights:
        cbits = weights.get("num_bits") if isinstance(weights.get("num_bits"), int) else None
        cgroup = weights.get("group_size") if isinstance(weights.get("group_size"), int) else None
        if weights.get("strategy") == "channel":
            cgroup = -1
        csym = weights.get("symmetric") if isinstance(weights.get("symmetric"), bool) else None
        cdesc = weights.get("actorder") not in (None, False, "static", "weight")
    else:
        cbits, cgroup, csym, cdesc = c.bits, c.group_size, c.sym, c.desc_act
    packing = "padded" if c.ct_version and _version_lt(c.ct_version, (0, 18)) else "dense"
    n_groups = sc[1][1]
    gi = t.get("weight_g_idx")
    in_f = gi[1][0] if gi is not None and len(gi[1]) == 1 else None
    bits = cbits
    if in_f is not None:
        fits = [b for b in range(2, 9) if _ct_words(in_f, b, packing) == wp[1]]
        if bits is None and len(fits) == 1:
            bits = fits[0]
        elif bits is not None and bits not in fits:
            notes.append(("error", f"config says {bits}-bit but weight_packed holds {wp[1]} words for {in_f} inputs"))
    elif bits is not None:
        if cgroup not in (None, -1) and n_groups > 1:
            cand = [i for i in range((n_groups - 1) * cgroup + 1, n_groups * cgroup + 1)
                    if _ct_words(i, bits, packing) == wp[1]]
            in_f = cand[-1] if cand else None
        else:
            in_f = exact_div(wp[1] * 32, bits) if packing == "dense" else wp[1] * (32 // bits)
        if in_f is None:
            notes.append(("error", f"weight_packed {list(wp)} cannot hold {bits}-bit codes in {n_groups} groups of "
                                   f"{cgroup}"))
    else:
        notes.append(("warning", "pack-quantized without num_bits in the config: bits unknown from the header"))
    group, gnote = group_from(in_f, n_groups, cgroup)
    if gnote:
        notes.append(("error", gnote))
    sym = "weight_zero_point" not in t
    if csym is False and sym:
        notes.append(("error", "config says asymmetric but there is no weight_zero_point"))
    if csym is True and not sym:
        notes.append(("warning", "config says symmetric but the module stores weight_zero_point"))
    desc = gi is not None
    if cdesc is False and desc:
        notes.append(("warning", "config has no act-order but the module stores weight_g_idx"))
    if c.format not in (None, "ct"):
        notes.append(("error", f"config says {c.format} but the tensors are pack-quantized (int32 weight_packed)"))
    if "weight_shape" not in t:
        notes.append(("error", "weight_shape missing: the unpacked [O, I] cannot be recovered"))
    return Detected("ct", bits, group, sym, desc, in_f, o, (in_f or 0) * o or None, detail=f"pack-quantized ({packing})",
                    notes=notes)


def _ct_words(n: int, bits: int, packing: str) -> int:
    return -(-n * bits // 32) if packing == "dense" else -(-n // (32 // bits))


def _version_lt(v: str, ref: tuple[int, int]) -> bool:
    nums = [int(x) for x in re.findall(r"\d+", v)[:2]]
    return len(nums) == 2 and tuple(nums) < ref


def _fp8(t: dict[str, Sig], c: Claims) -> Detected:
    o, i = t["weight"][1]
    notes: list[tuple[str, str]] = []
    if "weight_scale_inv" in t:
        fmt, scale = "fp8", t["weight_scale_inv"][1]
    elif "weight_scale" in t:
        fmt = "fp8" if c.quant_method == "fp8" else "ct_fp8"
        scale = t["weight_scale"][1]
    else:
        return Detected("unknown", notes=[("error", "FP8 weight without weight_scale or weight_scale_inv")])
    numel = 1
    for d in scale:
        numel *= d
    if numel == 1:
        group, detail = -1, "per-tensor scale"
    elif tuple(scale) in ((o, 1), (o,)):
        group, detail = -1, "per-channel scale"
    elif len(scale) == 2:
        bo = c.block_size[0] if c.block_size else _div_ceil_match(o, scale[0])
        bi = c.block_size[1] if c.block_size else _div_ceil_match(i, scale[1])
        group, detail = bi, f"block {bo}x{bi} scales"
        if c.block_size and (-(-o // bo) != scale[0] or -(-i // bi) != scale[1]):
            notes.append(("error", f"weight_block_size {list(c.block_size)} does not match scales {list(scale)} "
                                   f"for weight [{o}, {i}]"))
        if scale[1] == i // 16 and scale[0] == o:
            group, detail = 16, "per-16 group scales"
    else:
        group, detail = None, f"scale shape {list(scale)}"
    if c.format not in (None, fmt, "ct_fp8", "fp8"):
        notes.append(("error", f"config says {c.format} but the tensors are FP8 ({t['weight'][0]})"))
    return Detected(fmt, 8, group, True, False, i, o, i * o, detail=detail, notes=notes)


def _div_ceil_match(n: int, blocks: int) -> int | None:
    """The power-of-two block size b with ceil(n/b) == blocks (128 for DeepSeek-style files)."""
    for b in (128, 64, 256, 32, 512, 16):
        if -(-n // b) == blocks:
            return b
    return None


def bnb_state_shape(blob: bytes) -> tuple[int, int] | None:
    """The [out, in] shape bitsandbytes records in its packed 4-bit quant state (the uint8 tensor
    `weight.quant_state.bitsandbytes__nf4|fp4` holds UTF-8 JSON: quant_type, blocksize, dtype, shape, ...)."""
    try:
        d = json.loads(bytes(blob).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    shape = d.get("shape") if isinstance(d, dict) else None
    if isinstance(shape, list) and len(shape) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                           and 0 < x < 1 << 40 for x in shape):
        return shape[0], shape[1]
    return None


def _bnb4(t: dict[str, Sig], c: Claims, state_shape: tuple[int, int] | None = None) -> Detected:
    """bitsandbytes 4-bit: weight U8 [O*I/2, 1] holds two codes a byte, so the header gives O*I only; the
    shape comes from the quant state (read by the caller, see `bnb_state_shape`), else from the bias."""
    w = t.get("weight")
    qs = [k for k in t if k.startswith("weight.quant_state.")]
    kind = qs[0].rsplit("__", 1)[-1] if qs and "__" in qs[0] else "4bit"
    n = w[1][0] * 2 if w is not None and len(w[1]) >= 1 else None
    if w is not None and len(w[1]) == 2 and w[1][1] != 1:
        n = w[1][0] * w[1][1] * 2
    ab = t.get("weight.absmax")
    group = c.bnb_blocksize
    if group is None and ab is not None and n:
        numel = 1
        for d in ab[1]:
            numel *= d
        group = exact_div(n, numel)
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
    if c.format not in (None, "bnb"):
        notes.append(("error", f"config says {c.format} but the tensors are bitsandbytes 4-bit"))
    notes += bits_note(c, 4)
    return Detected("bnb", 4, group, True, False, i, o, n, detail=f"bitsandbytes {kind}", notes=notes)


def _bnb8(t: dict[str, Sig]) -> Detected:
    o, i = t["weight"][1] if len(t["weight"][1]) == 2 else (t["weight"][1][0], 1)
    return Detected("bnb", 8, -1, True, False, i, o, i * o, detail="bitsandbytes LLM.int8 (SCB)")


# --- GGUF types -----------------------------------------------------------------------------------------

def detect_gguf(shape: tuple[int, ...], type_name: str, block: tuple[int, int] | None) -> Detected | None:
    """A GGUF weight: dims [ne0 = I, ne1 = O, ...]; 1-D tensors (norms, biases) are not modules."""
    from qtool.io.gguf_reader import ASYM_TYPES, FLOAT_TYPES, nominal_bits

    if len(shape) < 2:
        return None
    i = shape[0]
    o = 1
    for d in shape[1:]:
        o *= d
    if type_name in FLOAT_TYPES:
        return Detected("dense", nominal_bits(type_name), None, None, None, i, o, i * o, detail=type_name)
    group = block[0] if block else None
    return Detected(f"gguf:{type_name}", nominal_bits(type_name), group, type_name not in ASYM_TYPES, False, i, o,
                    i * o, detail=type_name)
