"""Per-module format detection: the orchestration around the formats' `detect` (formats/detection.py).

Claims from the config and qtool's file metadata, tensor names grouped into modules, GPTQModel's per-module
`dynamic` overrides, then the layouts asked in one fixed order (ASKED: format modules and the recognized
foreign layouts of formats/foreign.py), a dense float weight, and last `unclaimed`. Pure functions over
`{short_name: (dtype, shape)}` (safetensors dtype names: "I32", "F16", "F8_E4M3", ...); no tensor data, no
torch, no file I/O. Each layout's shapes are written once, in the module that detects it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from qtool.formats import foreign, get_format
from qtool.formats.detection import FLOAT_DTYPES, SIDECARS, Claims, Detected, Sig, config_regex, unclaimed

# bitsandbytes hangs its 4-bit state off "<module>.weight.<...>": those names belong to <module>.
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


# A mixture-of-experts router: `gate` or `router` beside the `experts` it routes to (Mixtral's
# block_sparse_moe.gate, Qwen-MoE's and DeepSeek's mlp.gate, gpt-oss's mlp.router, DBRX's ffn.router.layer),
# and Qwen2-MoE's shared_expert_gate beside its shared_expert. vLLM and SGLang build these unquantized (quant_config=None) and
# GPTQModel's and llm-compressor's recipes leave them out, so a packed router is a file no engine loads.
_ROUTER = re.compile(r"^(?P<parent>.+)\.(?:gate|router(?:\.layer)?|(?P<shared>shared_expert_gate))\.weight$")


def moe_routers(names) -> set[str]:
    """The module names among tensor `names` that are mixture-of-experts routers (see _ROUTER)."""
    names = list(names)
    parents = {n.split(".experts.", 1)[0] for n in names if ".experts." in n}
    shared = {n.split(".shared_expert.", 1)[0] for n in names if ".shared_expert." in n}
    out = set()
    for n in names:
        m = _ROUTER.match(n)
        if m and m["parent"] in (shared if m["shared"] else parents):
            out.add(n[: -len(".weight")])
    return out


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
                                        g.get("format"),
                                        g.get("input_activations") if isinstance(g.get("input_activations"),
                                                                                 dict) else {}))
        ig = r.get("ignore") or []
        c.ct_ignore = [str(x) for x in ig] if isinstance(ig, list) else []
        c.ct_version = str(r["version"]) if r.get("version") is not None else None
        for pat in [t for targets, *_ in c.ct_groups for t in targets] + c.ct_ignore:
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


# The order in which the layouts are asked; the first that answers (not None) describes the module. Layouts
# that share tensor names are ordered by how specific their evidence is: a Marlin claim or Marlin's B/s before
# QQQ's B; int16 words and AWQ GEMV before AWQ GEMM before GPTQ, whose detect reports any qweight left over;
# NVFP4 before pack-quantized, which reports any weight_packed left over; bitsandbytes' named state before
# the bare weight dtypes.
ASKED: tuple[Callable[[str, Mapping[str, Sig], Claims], Detected | None], ...] = (
    get_format("marlin").detect,
    foreign.qqq,
    foreign.exl3,
    foreign.int16_words,
    foreign.awq_gemv,
    get_format("awq").detect,
    get_format("gptq").detect,
    # the micro-float layouts before ct and fp8: a U8 weight_packed with E4M3 or E8M0 scales is NVFP4 / MXFP4,
    # an E4M3 weight with E8M0 scales MXFP8 (not FP8 with linear scales), a U8 weight with E4M3 scales ModelOpt
    get_format("nvfp4").detect,
    get_format("modelopt_nvfp4").detect,
    get_format("mxfp4").detect,
    get_format("mxfp8").detect,
    get_format("gptoss_mxfp4").detect,
    get_format("ct").detect,
    foreign.bnb_4bit,
    foreign.bnb_int8,
    get_format("fp8").detect,
    get_format("ct_fp8").detect,
    get_format("ct_int8").detect,
    foreign.mlx,
)


def detect_module(name: str, t: dict[str, Sig], claims: Claims | None,
                  bnb_shape: tuple[int, int] | None = None, bnb_block: int | None = None) -> Detected | None:
    """Detect one module's layout; None when the prefix holds no linear weight (norms, biases alone).

    The layouts of ASKED first, then a dense float weight; a module none of them claims that holds an integer
    weight-like tensor or a quantization sidecar is an "unknown quantized layout" (severity error): qtool
    never calls what it does not understand dense. bnb_shape, bnb_block: [out, in] and the block size from a
    bitsandbytes quant state, which only the tensor data records (the module's own block size wins over the
    config's)."""
    c = module_claims(claims, name) if claims is not None else Claims()
    if bnb_shape is not None:
        c = dataclasses.replace(c, bnb_shape=bnb_shape)
    if bnb_block is not None:
        c = dataclasses.replace(c, bnb_blocksize=bnb_block)
    for ask in ASKED:
        d = ask(name, t, c)
        if d is not None:
            return d
    w = t.get("weight")
    if w is not None and len(w[1]) == 2 and w[0] in FLOAT_DTYPES and not t.keys() & SIDECARS:
        o, i = w[1]
        return Detected("dense", FLOAT_DTYPES[w[0]], None, None, None, i, o, i * o, detail=w[0])
    return unclaimed(t)
