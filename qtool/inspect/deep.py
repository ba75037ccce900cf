"""`inspect --deep`: read tensor data and check it.

Per module: scales finite, non-zero and positive; codes and zeros within 2^bits; g_idx values inside the
groups, every group present, group sizes consistent; the GPTQ zero convention (v1 stores z - 1, v2 stores z)
judged from the data against the config's claim; dequantized weight statistics (mean, std, absmax) through
the format's own `unpack` and the shared `dequantize`. GGUF tensors are dequantized by the `gguf` package.

Findings are merged across modules (one anomaly per distinct message, with a module count), and each
module's `sym` / `desc_act` are replaced by what the data says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from qtool.formats.detection import Claims
from qtool.inspect.microfloat import deep_micro
from qtool.inspect.report import InspectReport, ModuleReport, merge_notes

Notes = list[tuple[str, str, str]]   # (severity, module, message)

_SCALE_NAMES = ("scales", "weight_scale", "s", "weight_scale_inv")
# Engines that trust a sym config drop the zero points (vLLM's GPTQ Marlin path reads uint4b8, no zeros) and
# those that read them (GPTQModel, exllama) compute other weights: the file means two things
ERR_SYM = ("error", "config says sym but the zero points vary (asymmetric data): engines that trust the config "
                    "ignore them; fix: sym: false")
_GIDX_NAMES = ("g_idx", "weight_g_idx")


def _stats(w) -> dict[str, float] | None:
    """Mean, std and absmax of the finite values; None when there are none (the caller notes why)."""
    import torch

    w = w.to(torch.float64)
    finite = torch.isfinite(w)
    v = w[finite] if not bool(finite.all()) else w.reshape(-1)
    if v.numel() == 0:
        return None
    a = float(v.abs().max())
    mean, std = float(v.mean()), float(v.std(unbiased=False))
    if not math.isfinite(mean) or not math.isfinite(std):
        # float64 values near its limit (1e308) overflow the sums: take them in units of absmax instead
        u = v / a
        mean, std = a * float(u.mean()), a * float(u.std(unbiased=False))
    return {"mean": mean, "std": std, "absmax": a}


def _check_weight(w, mod: str, notes: Notes) -> dict[str, float] | None:
    import torch

    if w.numel() == 0:
        notes.append(("warning", mod, "weight has no elements (a dimension is 0)"))
        return None
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        notes.append(("error", mod, "dequantized weight has NaN/Inf values"))
    return _stats(w)


def check_scales(s, mod: str, name: str, notes: Notes, allow_negative: bool = False) -> None:
    """NaN/Inf (error), zero (warning: the whole group collapses to 0), negative (warning)."""
    import torch

    s = s.float()
    if int((~torch.isfinite(s)).sum()):
        notes.append(("error", mod, f"'{name}' has NaN/Inf values"))
    zeros = int((s == 0).sum())
    if zeros:
        notes.append(("warning", mod, f"'{name}' has zero scales (their groups dequantize to 0)"))
    if not allow_negative and int((s < 0).sum()):
        notes.append(("warning", mod, f"'{name}' has negative scales (quantizers write positive ones)"))


def check_g_idx(g, in_features: int, n_groups: int, group_size: int | None, mod: str, name: str,
                notes: Notes) -> bool | None:
    """Validate a group map int [I]. Returns desc_act (True when not the trivial i // G), None if invalid."""
    import torch

    if g.dim() != 1 or g.shape[0] != in_features:
        notes.append(("error", mod, f"'{name}' has shape {list(g.shape)}, expected [{in_features}]"))
        return None
    if g.dtype.is_floating_point:
        notes.append(("error", mod, f"'{name}' is {g.dtype}, expected int32"))
        return None
    g = g.to(torch.int64)
    lo, hi = int(g.min()), int(g.max())
    if lo < 0 or hi >= n_groups:
        notes.append(("error", mod, f"'{name}' values span [{lo}, {hi}] but there are {n_groups} groups"))
        return None
    counts = torch.bincount(g, minlength=n_groups)
    empty = int((counts == 0).sum())
    if empty:
        notes.append(("error", mod, f"'{name}' leaves {empty} of {n_groups} groups without input channels"))
    G = in_features if group_size in (None, -1) else group_size
    if group_size not in (None, -1) and n_groups > 0:
        want = torch.full((n_groups,), G, dtype=torch.int64)
        want[-1] = in_features - (n_groups - 1) * G
        if not torch.equal(counts, want):
            notes.append(("warning", mod, f"'{name}' group sizes range {int(counts.min())}..{int(counts.max())}, "
                                          f"not {G} per group"))
    trivial = torch.arange(in_features, dtype=torch.int64) // max(G, 1)
    return not torch.equal(g, trivial)


# --- safetensors ---------------------------------------------------------------------------------------

def deep_safetensors(report: InspectReport, src, claims: Claims | None,
                     on_progress: Callable[[int, int], None] | None = None) -> None:
    notes: Notes = []
    total = len(report.modules)
    for k, m in enumerate(report.modules):
        cut = [n for n in m.tensor_names if n in src.incomplete]
        if cut:
            notes.append(("error", m.name, "data truncated: module not checked"))
        elif m.scheme.format != "unknown":
            try:
                t = load_module(m, src)
                _check_side(t, m.name, notes)
                deep_module(m, t, claims, notes, src)
            except Exception as e:  # noqa: BLE001 - a module that cannot be decoded is a finding, not a crash
                from qtool.errors import QtoolError

                msg = e.problem if isinstance(e, QtoolError) else f"{type(e).__name__}: {e}"
                notes.append(("error", m.name, f"cannot decode as {m.scheme.format}: {msg}"))
        if on_progress:
            on_progress(k + 1, total)
    in_modules = {n for m in report.modules for n in m.tensor_names}
    for name, info in src.tensors.items():  # norms, loose tensors: one at a time
        if name not in in_modules and name not in src.incomplete and info.dtype in _FLOAT_DTYPES:
            _check_finite(src.get(name), name, notes)
    src.close()
    report.anomalies += merge_notes(notes)


_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# The tensors of a module whose values the format's own checks cover (codes, scales, zero points, group maps)
_DECODED = frozenset({"weight", "qweight", "qzeros", "g_idx", "weight_packed", "weight_shape", "weight_zero_point",
                      "weight_g_idx", "weight_blocks", "weight_scales", "weight_global_scale", "weight_scale_2", "B",
                      "s", "zeros", *_SCALE_NAMES})


def _check_finite(t, name: str, notes: Notes) -> None:
    import torch

    if t.is_floating_point() and t.element_size() >= 2 and not bool(torch.isfinite(t).all()):
        notes.append(("error", name, "has NaN/Inf values"))


def _check_side(t: dict, mod: str, notes: Notes) -> None:
    """A module's other float tensors (bias, activation scales): finite."""
    for short, v in t.items():
        if short not in _DECODED:
            _check_finite(v, f"{mod}.{short}" if mod else short, notes)


def _params(m: ModuleReport, claims: Claims | None, fmt: str, src=None):
    from qtool.scheme import QuantScheme

    s = m.scheme
    if fmt == "marlin" and src is not None:
        from qtool.formats.marlin import params_from_contract

        p = params_from_contract(src.metadata, src.quant_raw)
        return QuantScheme(bits=p.bits or s.bits, group_size=p.group_size if p.group_size is not None else
                           s.group_size, desc_act=p.desc_act, extra=p.extra)
    extra: dict[str, Any] = {}
    if claims is not None and claims.ct_version:
        extra["version"] = claims.ct_version
    return QuantScheme(bits=s.bits, group_size=s.group_size, sym=s.sym if fmt.startswith("ct") else None,
                       desc_act=s.desc_act, extra=extra)


def load_module(m: ModuleReport, src) -> dict:
    """{short name: torch.Tensor} of every tensor of one module, read from the source."""
    from qtool.inspect.detect import split_name

    return {split_name(n)[1]: src.get(n) for n in m.tensor_names}


def _bit_fields_only(t: dict) -> bool:
    """True when every integer tensor of the layout except g_idx is int32 words (packed bit fields)."""
    ints = [v for k, v in t.items() if k not in _GIDX_NAMES and not v.is_floating_point()]
    return bool(ints) and all(str(v.dtype) == "torch.int32" for v in ints)


def deep_module(m: ModuleReport, t: dict, claims: Claims | None, notes: Notes, src=None,
                stats: bool = True, decode: bool = True) -> tuple[str, Any, Any] | None:
    """Check one module's tensors `t` ({short name: tensor}, see load_module), appending findings to `notes`.

    Returns (format id the data was read as, its QuantScheme, the Plain) for layouts qtool.formats decodes,
    else None. stats=False skips the dequantized-weight statistics (and the NaN/Inf check of the
    dequantized weight, which the scale check already covers for the formats decoded to a Plain).
    decode=False (with stats=False) skips decoding codes where the layout stores them as int32 bit fields
    (their range holds by construction) and returns None: for callers that need the checks, not the Plain.
    """
    import torch

    from qtool.formats.base import get_format
    from qtool.formats.plain import dequantize
    from qtool.inspect.detect import module_claims

    if claims is not None:  # the config's per-module `dynamic` overrides are this module's claims
        claims = module_claims(claims, m.name)
    fmt = m.scheme.format
    if fmt == "dense":
        if stats:
            # float64 weights stay float64: values past float32's range are finite, not Inf
            w = t["weight"]
            m.stats = _check_weight(w if w.dtype == torch.float64 else w.float(), m.name, notes)
        elif t["weight"].is_floating_point() and not bool(torch.isfinite(t["weight"]).all()):
            notes.append(("error", m.name, "dequantized weight has NaN/Inf values"))
        return None
    sname = next((n for n in _SCALE_NAMES if n in t), "scales")
    if fmt == "gptoss_mxfp4" and "weight_blocks" not in t:  # MoE expert stacks: no 2-D ScaledPlain
        return deep_micro(m, t, notes, _check_weight, stats)
    if fmt in _scaled_formats():
        return _deep_scaled(m, t, claims, notes, stats)
    try:
        f = get_format(fmt)
    except Exception:  # noqa: BLE001 - the registry says which formats exist
        notes.append(("info", m.name, f"deep check unavailable for format {fmt} (no decoder in qtool.formats)"))
        return None
    read_fmt = fmt
    if fmt in ("gptq", "gptq_v2") and "qzeros" in t and m.scheme.bits:
        read_fmt = _gptq_convention(m, t, claims, notes)
        f = get_format(read_fmt)
    for gname in _GIDX_NAMES:
        if gname in t and m.in_features:
            n_groups = t["scales"].shape[0] if "scales" in t else t["weight_scale"].shape[1]
            desc = check_g_idx(t[gname], m.in_features, n_groups, m.scheme.group_size, m.name, gname, notes)
            if desc is None:
                return None
            if claims is not None and claims.desc_act is False and desc:
                notes.append(("warning", m.name, "config says desc_act false but g_idx is not i // group_size "
                                                 "(act-order data)"))
            m.scheme = replace(m.scheme, desc_act=desc)
    if not decode and _bit_fields_only(t):
        # Codes and zeros are fixed-width fields of int32 words: every value a field can hold is in range,
        # so the range check needs no decoding; the scales are checked as stored (a permutation of them in
        # Marlin, whose padding may add zero scales: warnings, not errors).
        check_scales(t[sname], m.name, sname, notes)
        return None
    params = _params(m, claims, read_fmt, src)
    plain = f.unpack(t, params)
    # Checked in canonical form: padding (Marlin) is cropped and every layout's scales look alike.
    check_scales(plain.scales, m.name, sname, notes)
    for p in plain.check_ranges():
        notes.append(("error", m.name, p))
    sym = plain.sym
    if claims is not None and claims.sym is True and not sym and (ERR_SYM[0], m.name, ERR_SYM[1]) not in notes:
        notes.append((ERR_SYM[0], m.name, ERR_SYM[1]))
    m.scheme = replace(m.scheme, sym=sym, desc_act=plain.desc_act)
    if stats:
        # In the scales' dtype, as the format's own dequantizer returns it (the fixtures' references), so the
        # statistics describe the weights an engine would compute.
        m.stats = _check_weight(dequantize(plain), m.name, notes)
    return read_fmt, params, plain


def _scaled_formats() -> frozenset[str]:
    """Format ids whose canonical form is ScaledPlain (float / int8 codes in their element type)."""
    from qtool.formats import all_formats

    return frozenset(k for k, f in all_formats().items() if getattr(f, "canonical", None) == "scaled")


def _deep_scaled(m: ModuleReport, t: dict, claims: Claims | None, notes: Notes, stats: bool):
    """Decode through the format's unpack; the canonical form's own anomalies (NaN codes, scales zero / NaN /
    Inf / overflowing) are the findings."""
    from qtool.formats.base import get_format
    from qtool.formats.scaled import dequantize
    from qtool.scheme import QuantScheme

    extra = {"quant_config": dict(claims.raw) if claims is not None else {}, "module": m.name}
    params = QuantScheme(bits=m.scheme.bits, extra=extra)
    fmt = m.scheme.format
    plain = get_format(fmt).unpack(t, params)
    for sev, msg in plain.anomalies():
        notes.append((sev, m.name, msg))
    m.scheme = replace(m.scheme, sym=plain.zeros is None, desc_act=False)
    if stats:
        m.stats = _check_weight(dequantize(plain), m.name, notes)
    return fmt, params, plain


def _gptq_convention(m: ModuleReport, t: dict, claims: Claims | None, notes: Notes) -> str:
    """Judge v1 vs v2 from the qzeros; returns the format id to read the module with."""
    import torch

    from qtool.formats.gptq import zero_convention_evidence

    # The verdict rests on which zero rows occur, not how often: distinct rows only (one, for symmetric
    # data) decode in a fraction of the time on large layers.
    ev = zero_convention_evidence(torch.unique(t["qzeros"], dim=0), m.scheme.bits, m.out_features)
    mid = 1 << (m.scheme.bits - 1)
    claimed = "v2" if m.scheme.format == "gptq_v2" else "v1"
    said = claims is not None and claims.format in ("gptq", "gptq_v2")
    if ev.verdict is None and claims is not None and claims.sym is True:
        notes.append((ERR_SYM[0], m.name, ERR_SYM[1]))
    if ev.verdict is None:
        if claimed == "v1" and ev.word_field_diff:
            notes.append(("info", m.name, "v1 zero fields read differently by the whole-word (GPTQModel) and "
                                          "per-field conventions; qtool reads whole-word (a zero of 0 borrows "
                                          "from its neighbour)"))
        if not said:
            notes.append(("warning", m.name, "no config and asymmetric zeros: v1 and v2 both read validly; "
                                             "assuming gptq (v1)"))
        return m.scheme.format
    if ev.verdict == claimed:
        return m.scheme.format
    if not said:
        notes.append(("info", m.name, f"no config: zeros read as {mid} under {ev.verdict} (symmetric), so the "
                                      f"file is {'gptq_v2' if ev.verdict == 'v2' else 'gptq (v1)'}"))
    elif claimed == "v1":
        notes.append(("error", m.name, f"config says gptq (v1) but zeros decode to {mid + 1} under v1 — it is v2; "
                                       f"fix: checkpoint_format: gptq_v2"))
    else:
        notes.append(("error", m.name, f"config says gptq_v2 but zeros decode to {mid - 1} under v2 — it is v1; "
                                       f"fix: checkpoint_format: gptq"))
    fmt = "gptq_v2" if ev.verdict == "v2" else "gptq"
    m.scheme = replace(m.scheme, format=fmt)
    return fmt


# --- GGUF ----------------------------------------------------------------------------------------------

# Types whose blocks begin with an fp16 scale d.
_LEADING_D = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1"})


def deep_gguf(report: InspectReport, gset, on_progress: Callable[[int, int], None] | None = None) -> None:
    by_name: dict = {}
    for t in gset.tensors:  # the first of two entries of one name, as the header report reads it
        by_name.setdefault(t.name, t)
    notes: Notes = []
    total = len(report.modules)
    weights = set()
    big = frozenset(h.path for h in gset.headers if h.byte_order == "big")
    for k, m in enumerate(report.modules):
        wname = f"{m.name}.weight" if m.name else "weight"
        weights.add(wname)
        deep_gguf_module(m, by_name.get(wname), notes, big)
        if on_progress:
            on_progress(k + 1, total)
    for name, t in by_name.items():  # norms and other tensors outside the modules
        if name not in weights and t.complete and t.nbytes:
            _gguf_finite(t, notes, big)
    report.anomalies += merge_notes(notes)


def _gguf_finite(t, notes: Notes, big: frozenset = frozenset()) -> None:
    import numpy as np

    try:
        with np.errstate(all="ignore"):
            w = _gguf_tensor(t, notes, t.name, big)
    except Exception as e:  # noqa: BLE001 - an undecodable tensor is a finding
        notes.append(("error", t.name, f"cannot dequantize {t.type_name}: {type(e).__name__}: {e}"))
        return
    if w is not None and not bool(np.isfinite(w).all()):
        notes.append(("error", t.name, "has NaN/Inf values"))


def deep_gguf_module(m: ModuleReport, t, notes: Notes, big: frozenset = frozenset()) -> None:
    """Check one GGUF module's weight tensor `t` (a GGUFTensor, or None when absent), appending findings;
    `big`: the files of the set that are big-endian."""
    import numpy as np

    if t is None:
        notes.append(("error", m.name, "weight tensor not found: module not checked"))
        return
    if t.nbytes is None:  # the header findings say why (an unknown type id, a row that is not whole blocks)
        notes.append(("error", m.name, f"size of a {t.type_name} tensor of shape {list(t.shape)} unknown: "
                                       "module not checked"))
        return
    if not t.complete:
        notes.append(("error", m.name, "data truncated: module not checked"))
        return
    if t.nbytes == 0:
        notes.append(("warning", m.name, "weight has no elements (a dimension is 0)"))
        return
    try:
        with np.errstate(all="ignore"):  # NaN/Inf scales are reported below, not warned about
            w = _gguf_tensor(t, notes, m.name, big)
        if w is not None:
            bad = int((~np.isfinite(w)).sum())
            if bad:
                notes.append(("error", m.name, "dequantized weight has NaN/Inf values"))
            v = w[np.isfinite(w)].astype(np.float64) if bad else w.reshape(-1).astype(np.float64)
            m.stats = _np_stats(v) if v.size else None
    except Exception as e:  # noqa: BLE001 - an undecodable tensor is a finding
        notes.append(("error", m.name, f"cannot dequantize {t.type_name}: {type(e).__name__}: {e}"))


def _np_stats(v) -> dict[str, float]:
    """Mean, std and absmax of float64 values (all finite, at least one), as `_stats` takes them."""
    import numpy as np

    a = float(np.abs(v).max())
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = float(v.mean()), float(v.std())
    if not math.isfinite(mean) or not math.isfinite(std):  # sums past float64's range: in units of absmax
        u = v / a
        mean, std = a * float(u.mean()), a * float(u.std())
    return {"mean": mean, "std": std, "absmax": a}


# Plain element types gguf.quants does not dequantize: read as their numpy type (little-endian after the swap).
_PLAIN_GGUF = {"F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def _gguf_tensor(t, notes: Notes, mod: str, big: frozenset = frozenset()):
    import numpy as np

    from qtool.io.gguf_reader import SWAPPABLE, to_little_endian

    rows = 1
    for d in t.shape[1:]:
        rows *= d
    raw = np.memmap(t.file, dtype=np.uint8, mode="r", offset=t.start, shape=(t.nbytes,))
    name = t.type_name
    if t.file in big:  # the decoders read little-endian scalars
        if name not in SWAPPABLE:
            notes.append(("info", mod, f"deep check unavailable for big-endian gguf:{name} (qtool swaps the byte "
                                       f"order of {', '.join(sorted(SWAPPABLE))} only)"))
            return None
        raw = to_little_endian(np.asarray(raw), name)
    if name == "BF16":
        u = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(rows, -1)
    if name in _PLAIN_GGUF:  # float64 stays float64: values past float32's range are finite, not Inf
        return np.asarray(raw).view(_PLAIN_GGUF[name]).astype(np.float64).reshape(rows, -1)
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:  # pragma: no cover - gguf is a dependency
        notes.append(("info", mod, "deep check unavailable for GGUF (the gguf package is not installed)"))
        return None
    blk = t.block
    if name in _LEADING_D and blk is not None:
        d = np.asarray(raw).reshape(-1, blk[1])[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
        if int((~np.isfinite(d)).sum()):
            notes.append(("error", mod, f"{name} block scales have NaN/Inf values"))
        if int((d == 0).sum()):
            notes.append(("info", mod, f"{name} blocks with scale 0 (all-zero blocks)"))
    try:
        qtype = GGMLQuantizationType(t.type_id)
        w = dequantize(np.asarray(raw).reshape(rows, -1), qtype)
    except NotImplementedError:
        notes.append(("info", mod, f"deep check unavailable for format gguf:{name} (gguf cannot dequantize it)"))
        return None
    return np.asarray(w, dtype=np.float32).reshape(rows, -1)
