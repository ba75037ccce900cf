"""`inspect_path`: header-only description of a safetensors or GGUF checkpoint, with anomalies.

No tensor data is read unless `deep=True` (then see deep.py), except bitsandbytes' packed 4-bit quant state
(a few hundred bytes of JSON that alone records a module's shape). The safetensors path does not import torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qtool.formats.detection import SIDECARS, Claims, Detected
from qtool.formats.gguf_blocks import detect_gguf
from qtool.inspect.detect import (
    claims_from,
    config_claims,
    detect_module,
    disagreements,
    group_modules,
    metadata_claims,
)
from qtool.inspect.report import Anomaly, InspectReport, ModuleReport, TensorRow, merge_notes
from qtool.scheme import QuantScheme

# Tensors that are part of a module's packed layout; any other tensor of a module (bias) adds parameters.
LAYOUT_NAMES = frozenset({
    "qweight", "qzeros", "scales", "g_idx", "B", "s", "workspace", "perm", "weight_packed", "weight_scale",
    "weight_zero_point", "weight_g_idx", "weight_shape", "weight_global_scale", "input_global_scale",
    "input_scale", "weight", "weight_scale_inv", "SCB", "weight_format", "output_scale", "k_scale", "v_scale",
}) | SIDECARS
# gpt-oss names its codes and scales after the projection they hold (`gate_up_proj_blocks`, `down_proj_scales`)
LAYOUT_SUFFIXES = ("_blocks", "_scales")
MAX_STRING = 2048
_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> list:
    """`layers.2` before `layers.10`."""
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


def is_gguf_path(p: Path) -> bool:
    if p.is_file():
        if p.suffix == ".gguf":
            return True
        try:
            with p.open("rb") as f:
                return f.read(4) == b"GGUF"
        except OSError:
            return False
    if p.is_dir():
        # A directory with a safetensors model (model.safetensors or an index) is that model, even when a
        # .gguf sits beside it; otherwise any .gguf makes it a GGUF directory.
        if (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
            return False
        return any(p.glob("*.gguf"))
    return False


def inspect_path(path: str | Path, deep: bool = False,
                 on_progress: Callable[[int, int], None] | None = None) -> InspectReport:
    """Describe the checkpoint at `path` (.safetensors, directory, *.index.json, .gguf or split GGUF).

    deep: also read tensor data and check it (deep.py); on_progress(done, total) is called per module then.
    Raises InputError only when nothing can be read; every other problem is an anomaly in the report.
    """
    from qtool.inspect.loadable import gguf_anomalies, hf_anomalies, unread_files

    p = Path(path)
    report, handle, claims = open_inspected(p)
    if report.container == "gguf":
        report.anomalies += gguf_anomalies(handle.kv, handle.kv_types, handle.headers[0].kv_complete)
        if p.is_dir():  # strays of a split set are named by the header report already
            report.anomalies += unread_files(p, [*(h.path for h in handle.headers), *handle.extra])
    elif p.is_dir():
        report.anomalies += hf_anomalies(handle.root)
        wm = handle.index.get("weight_map") if isinstance(handle.index, dict) else None
        named = [handle.root / str(v) for v in wm.values()] if isinstance(wm, dict) else []  # reported if bad
        report.anomalies += unread_files(handle.root, [*handle.files, *named])
    if report.tensor_count == 0 and not report.has_errors():
        # "no anomalies" would say everything was checked when there was nothing to check
        what = " (a vocabulary-only GGUF?)" if report.container == "gguf" else ""
        report.anomalies.append(Anomaly("warning", None, f"the checkpoint holds no tensors{what}: there are no "
                                                         "weights to describe or check; fix: point at the model's "
                                                         "weight files"))
    if deep:
        if report.container == "gguf":
            from qtool.inspect.deep import deep_gguf

            deep_gguf(report, handle, on_progress)
        else:
            from qtool.inspect.deep import deep_safetensors

            deep_safetensors(report, handle, claims, on_progress)
    report.deep = deep
    _finish(report)
    return report


def open_inspected(path: str | Path) -> tuple[InspectReport, Any, Claims | None]:
    """The header-only report plus what reads the data behind it, for callers that check tensor data one
    module at a time (`inspect --deep`, `validate`): (report, handle, claims). handle is an
    `inspect.sources.Source` (safetensors; close it when done) or a `GGUFSet` (GGUF; claims None). The report's
    anomalies hold the header findings; its summary fields are filled by `finish_report`."""
    p = Path(path)
    if is_gguf_path(p):
        report, gset = _inspect_gguf(p)
        return report, gset, None
    return _inspect_safetensors(p)


def finish_report(report: InspectReport) -> None:
    """Sort the anomalies and fill the dominant format and bits per weight."""
    _finish(report)


# --- shared ------------------------------------------------------------------------------------------

def _dominant(modules: list[ModuleReport]) -> str:
    counts: dict[str, list[int]] = {}
    for m in modules:
        if m.quantized:
            c = counts.setdefault(m.scheme.format, [0, 0])
            c[0] += 1
            c[1] += m.n_weights or 0
    if not counts:
        if any(m.scheme.format == "unknown" for m in modules):
            return "unknown"  # a layout qtool cannot read is never reported as dense
        return "dense" if modules else "empty"
    return max(counts.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]


def _finish(report: InspectReport) -> None:
    order = {"error": 0, "warning": 1, "info": 2}
    report.anomalies.sort(key=lambda a: order.get(a.severity, 3))
    report.format = _dominant(report.modules)
    params = sum(m.n_weights or 0 for m in report.modules) + report.other_bytes_params[1]
    # bytes_total leaves out tensors whose size the header cannot give (an unknown GGUF type): no ratio then
    report.bpw = 8.0 * report.bytes_total / params if params and not report.unsized_tensors else None


def _module_report(name: str, d: Detected, nbytes: int, extra_params: int, tensor_names: tuple[str, ...]
                   ) -> ModuleReport:
    n = (d.n_weights or 0) + extra_params or None
    extra = {"activations": d.activations} if d.activations else {}
    if d.experts:
        extra["experts"] = d.experts
    if d.weight_scale:
        extra["weight_scale"] = d.weight_scale
        if d.block:
            extra["block"] = d.block
    scheme = QuantScheme(format=d.format, bits=d.bits, group_size=d.group_size, sym=d.sym, desc_act=d.desc_act,
                         extra=extra)
    return ModuleReport(name=name, scheme=scheme, in_features=d.in_features, out_features=d.out_features,
                        bytes=nbytes, n_weights=n, detail=d.detail, tensor_names=tensor_names)


# --- safetensors -------------------------------------------------------------------------------------

def _inspect_safetensors(p: Path):
    from qtool.errors import InputError
    from qtool.inspect.sources import read_headers
    from qtool.io.qconfig import parse_quant_config

    src = read_headers(p)
    anomalies = list(src.anomalies)
    qc = None
    if src.quant_raw is not None:
        try:
            qc = parse_quant_config(src.quant_raw, source=src.root / (src.quant_source or "config"))
        except InputError as e:
            anomalies.append(Anomaly("error", None, f"{src.quant_source}: {e.problem}"))
    cfg_file = src.root / (src.quant_source or "config.json").split()[0]
    said = config_claims(qc, src.quant_raw, src.quant_source or "", path=cfg_file)
    meta = metadata_claims(src.metadata)
    claims = claims_from(said, meta)

    # Header order is arbitrary (safetensors writers sort by dtype or registration); show a natural order.
    sigs = {n: (src.tensors[n].dtype, src.tensors[n].shape) for n in sorted(src.tensors, key=natural_key)}
    groups = group_modules(sigs)
    modules: list[ModuleReport] = []
    notes: list[tuple[str, str, str]] = []
    module_of: dict[str, str] = {}
    other_bytes = other_params = 0
    for prefix, t in groups.items():
        pre = f"{prefix}." if prefix else ""
        names = tuple(pre + s for s in t)
        d = detect_module(prefix, t, claims, *_bnb_state(src, pre, t))
        if d is None:
            for n in names:
                other_bytes += src.tensors[n].nbytes
                other_params += src.tensors[n].numel
            continue
        nbytes = sum(src.tensors[n].nbytes for n in names)
        extra = sum(src.tensors[pre + s].numel for s in t
                    if s not in LAYOUT_NAMES and not s.startswith("weight.") and not s.endswith(LAYOUT_SUFFIXES))
        modules.append(_module_report(prefix, d, nbytes, extra, names))
        for n in names:
            module_of[n] = prefix
        notes += [(sev, prefix, msg) for sev, msg in d.notes]
        b = t.get("bias")
        if b is not None and len(b[1]) == 1 and d.out_features and b[1][0] != d.out_features:
            # an nn.Linear's bias has one entry per output; a Conv1D's weight is stored [in, out]
            notes.append(("error", prefix, f"bias has {b[1][0]} entries but the weight {d.out_features} outputs: "
                                           "the weight is stored transposed ([in, out], a Conv1D) or the two do "
                                           "not belong together"))
    anomalies += merge_notes(notes)
    anomalies += _file_level(claims, modules, src)
    anomalies += _source_level(said, meta)
    anomalies += _lm_head_flag(said, modules)

    rows = [TensorRow(n, src.tensors[n].dtype, src.tensors[n].shape, src.tensors[n].nbytes, src.tensors[n].file.name,
                      n not in src.incomplete, module_of.get(n)) for n in sigs]
    metadata: dict[str, Any] = dict(src.quant_raw or {})
    extra_meta = {k: v for k, v in src.metadata.items() if k != "format"}
    if extra_meta:
        metadata["__metadata__"] = extra_meta
    info = {}
    sources = [_source_dict(c, engines=c is said) for c in (said, meta) if c is not None]
    metadata["qtool.sources"] = sources
    report = InspectReport(
        path=str(p), container="safetensors", format="", modules=modules, tensor_count=len(src.tensors),
        bytes_total=sum(t.nbytes for t in src.tensors.values()), bpw=None, metadata=metadata,
        anomalies=anomalies, files=[str(f) for f in src.files], tensors=rows,
        other_bytes_params=(other_bytes, other_params), config_source=src.quant_source, info=info)
    tail = {"config": _says(said) if said is not None else "none"}
    if meta is not None:
        tail["qtool metadata"] = _says(meta)
    if said is not None:
        tail["engines read"] = f"{said.source} (engines take the quantization from it, never from qtool's metadata)"
    elif meta is not None or any(m.scheme.format != "dense" for m in modules):
        tail["engines read"] = "no quantization config: engines would load this checkpoint as dense or fail"
    report.info_tail = tail
    return report, src, claims


_SAYS = (("quant_method", "quant_method"), ("format", "format"), ("checkpoint_format", "checkpoint_format"),
         ("bits", "bits"), ("group_size", "group_size"), ("sym", "sym"), ("desc_act", "desc_act"))


def _says(c: Claims) -> str:
    """One source's statement, for the summary: `config.json quantization_config: format gptq, bits 4, ...`."""
    said = [f"{label} {getattr(c, attr)}" for attr, label in _SAYS if getattr(c, attr) is not None]
    return f"{c.source}: " + (", ".join(said) or "nothing qtool reads")


def _source_dict(c: Claims, engines: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"source": c.source}
    d.update({attr: getattr(c, attr) for attr, _ in _SAYS})
    d["read_by_engines"] = engines
    return d


def _source_level(said: Claims | None, meta: Claims | None) -> list[Anomaly]:
    """Each source of truth for what it says: the config (what engines read) against qtool's metadata."""
    out = []
    for label, a, b in disagreements(said, meta):
        out.append(Anomaly("error", None, f"{said.source} says {label} {a} but qtool's safetensors metadata says "
                                          f"{b}; engines read only the config and would load it as {label} {a}; "
                                          f"fix: correct {said.source} (inspect --deep checks the data) or "
                                          "rewrite the file with qtool"))
    if said is None and meta is not None:
        out.append(Anomaly("info", None, f"only qtool's safetensors metadata names the format ({meta.format}); "
                                         "engines read config.json and find no quantization_config there"))
    return out


def _lm_head_flag(said: Claims | None, modules: list[ModuleReport]) -> list[Anomaly]:
    """A GPTQ config's `"lm_head"` against the LM head the file holds. vLLM's GPTQ configs and GPTQModel's
    QuantizeConfig build the head (is_lm_head) packed only under `"lm_head": true` and dense otherwise (the
    key's default is false), so a flag that disagrees with the tensors stops the load at the first missing
    parameter. Only `quant_method: gptq` configs carry the key (qtool writes it for gptq, gptq_v2 and Marlin);
    compressed-tensors names its dense modules in `ignore`, which its detector checks per module."""
    from qtool.formats.detection import config_regex
    from qtool.formats.gptq import is_lm_head

    if said is None or said.quant_method != "gptq":
        return []
    heads = [m for m in modules if is_lm_head(m.name)]
    if not heads:  # tied embeddings: no head tensors, nothing for the flag to disagree with
        return []
    given = "lm_head" in said.raw
    flag = said.raw.get("lm_head", False)
    if not isinstance(flag, bool):
        return [Anomaly("warning", None, f'{said.source} says "lm_head": {str(flag)[:40]!r}, not true or false: '
                                         "loaders may read it either way, so the LM head is not checked against "
                                         'it; fix: write "lm_head": true for a quantized head, false for a dense one')]
    says = f'{said.source} says "lm_head": {str(flag).lower()}' if given else \
        f'{said.source} has no "lm_head" key (loaders default it to false)'
    dyn = said.raw.get("dynamic") if isinstance(said.raw.get("dynamic"), dict) else {}
    out = []
    for m in heads:
        if m.quantized and not flag:
            out.append(Anomaly("error", m.name, f"{says} but the LM head {m.name} is quantized ({m.scheme.format}): "
                                                "vLLM and GPTQModel build it dense and find no "
                                                f"'{m.name}.weight' to load; fix: set \"lm_head\": true in "
                                                f"{said.source}"))
        elif m.scheme.format == "dense" and flag:
            # a GPTQModel "-:" override keeps a module dense whatever the flag says (vLLM reads it the same way)
            if any(isinstance(k, str) and k.startswith("-:") and config_regex(said, k[2:], "dynamic").match(m.name)
                   for k in dyn):
                continue
            out.append(Anomaly("error", m.name, f"{says} but the LM head {m.name} is dense: vLLM and GPTQModel "
                                                "build it packed and find no qweight/scales to load; fix: set "
                                                f"\"lm_head\": false in {said.source}, or quantize the head "
                                                "(qtool pack --include lm_head)"))
    return out


MAX_QUANT_STATE = 1 << 16


def _bnb_state(src, pre: str, t: dict) -> tuple[tuple[int, int] | None, int | None]:
    """([out, in], block size) of a bitsandbytes 4-bit module from its packed quant state: a few hundred bytes
    of JSON, the one piece of tensor data inspect reads without --deep (bounded by MAX_QUANT_STATE)."""
    from qtool.formats.foreign import bnb_state

    qs = [k for k in t if k.startswith("weight.quant_state.bitsandbytes__")]
    if len(qs) != 1:
        return None, None
    info = src.tensors[pre + qs[0]]
    if info.dtype != "U8" or info.nbytes > MAX_QUANT_STATE or pre + qs[0] in src.incomplete:
        return None, None
    try:
        with info.file.open("rb") as f:
            f.seek(info.start)
            blob = f.read(info.nbytes)
    except OSError:
        return None, None
    return bnb_state(blob) if len(blob) == info.nbytes else (None, None)


def _file_level(claims: Claims | None, modules: list[ModuleReport], src) -> list[Anomaly]:
    out = []
    quantized = [m for m in modules if m.quantized]
    if quantized and claims is None:
        out.append(Anomaly("warning", None, "no quantization config (config.json quantization_config or "
                                            "quantize_config.json): format details are inferred from tensor "
                                            "shapes; a GPTQ file is assumed v1 (run --deep to check its zeros)"))
    if claims is not None and claims.quantized and not quantized and modules:
        out.append(Anomaly("error", None, f"the config says {claims.format or claims.quant_method} but no module "
                                          "holds quantized tensors"))
    if quantized:
        from qtool.inspect.detect import collapse_layers

        qpat = {collapse_layers(m.name) for m in quantized}
        dense_in_layers = [m for m in modules if m.scheme.format == "dense" and "#" in collapse_layers(m.name)
                           and collapse_layers(m.name) not in qpat]
        if dense_in_layers:
            out.append(Anomaly("info", dense_in_layers[0].name,
                               f"{len(dense_in_layers)} linear weights inside numbered layers are dense (not "
                               "quantized)"))
        mixed = {collapse_layers(m.name) for m in modules if m.scheme.format == "dense"} & qpat
        for pat in sorted(mixed)[:5]:
            first = next(m for m in modules if m.scheme.format == "dense" and collapse_layers(m.name) == pat)
            out.append(Anomaly("warning", first.name, f"'{pat}' is quantized in some layers and dense in others"))
    return out


# --- GGUF --------------------------------------------------------------------------------------------

def _json_value(v: Any) -> Any:
    from qtool.io.gguf_reader import ArraySummary

    if isinstance(v, ArraySummary):
        d = v.to_dict()
        d["preview"] = [_json_value(x) for x in d["preview"]]
        return d
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    if isinstance(v, str) and len(v) > MAX_STRING:
        return v[:MAX_STRING] + f"... ({len(v)} chars)"
    if isinstance(v, float) and v != v:
        return None
    return v


def _split_members(gs) -> list[Anomaly]:
    """Each file of a split set against its place in the set: llama.cpp loads the files named after the first
    one's split.count and refuses one whose split.no is not its position ("invalid split file idx"), so
    renamed or swapped members stop the load; files beside the set that name another member or a set of
    another size are named, not passed over."""
    from qtool.io.gguf_reader import MAX_REPORTED, SPLIT_RE, short_value

    out = []
    n_files = len(gs.headers) + len(gs.missing)
    first_count = gs.headers[0].kv.get("split.count")
    for h in gs.headers if n_files > 1 else []:
        m = SPLIT_RE.match(h.path.name)
        if m is None:
            continue
        place = int(m.group("no")) - 1
        no, count = h.kv.get("split.no"), h.kv.get("split.count")
        if h is gs.headers[0] and count is None and h.kv_complete:
            out.append(Anomaly("error", None, f"{h.path.name} has no split.count: llama.cpp loads it as a whole "
                                              f"model and never reads the other {n_files - 1} files; fix: "
                                              "re-split the model with gguf-split"))
        if no is None:
            if place > 0 and h.kv_complete:
                out.append(Anomaly("error", None, f"{h.path.name} has no split.no (llama.cpp: \"missing key "
                                                  "split.no in GGUF split\"); fix: re-download the set"))
        elif no != place:
            which = f", the header of file {no + 1}," if isinstance(no, int) and not isinstance(no, bool) else ""
            out.append(Anomaly("error", None, f"{h.path.name} holds split.no {short_value(no)}{which} but is "
                                              f"named as file {place + 1}: llama.cpp refuses the set (\"invalid "
                                              "split file idx\"); fix: restore the original file names or "
                                              "re-download the set"))
        if h is not gs.headers[0] and None not in (count, first_count) and count != first_count:
            out.append(Anomaly("error", None, f"{h.path.name} says split.count {short_value(count)} but "
                                              f"{gs.headers[0].path.name} says {short_value(first_count)}: the "
                                              "files come from different splits; fix: re-download the set"))
    for e in gs.extra[:MAX_REPORTED]:
        out.append(Anomaly("warning", None, f"{e.name} beside the {n_files}-file set is not part of it (not read); "
                                            "fix: remove it, or re-download the set if the split changed"))
    if len(gs.extra) > MAX_REPORTED:
        out.append(Anomaly("warning", None, f"... and {len(gs.extra) - MAX_REPORTED} more files named like members "
                                            "of the set but outside it"))
    return out



def _inspect_gguf(p: Path):
    from qtool.io.gguf_reader import MAX_REPORTED, file_type_name, read_gguf

    gs = read_gguf(p)
    anomalies: list[Anomaly] = []
    if p.is_file() and p.suffix != ".gguf":
        # read by its magic, as llama.cpp would; loaders that pick a reader by the name fail on it
        anomalies.append(Anomaly("warning", None, f"{p.name} is a GGUF file named '{p.suffix or '(no suffix)'}': "
                                                  "tools that choose a reader by extension will not read it as "
                                                  "GGUF; fix: rename it to .gguf"))
    for m in gs.missing:
        anomalies.append(Anomaly("error", None, f"split file {m.name} is missing; fix: download it next to the "
                                                "others"))
    for h in gs.headers:
        label = h.path.name if len(gs.headers) > 1 or gs.missing else None
        for sev, tensor, msg in h.problems:
            anomalies.append(Anomaly(sev, tensor, f"{label}: {msg}" if label else msg))
        tm = h.truncation_message()
        if tm:
            anomalies.append(Anomaly("error", None, f"{h.path.name}: {tm}"))
    kv = gs.kv
    n_split = kv.get("split.count")
    if isinstance(n_split, int) and n_split != len(gs.headers) + len(gs.missing):
        anomalies.append(Anomaly("error", None, f"split.count says {n_split} files but the set names "
                                                f"{len(gs.headers) + len(gs.missing)}"))
    anomalies += _split_members(gs)
    n_split_t = kv.get("split.tensors.count")
    if isinstance(n_split_t, int) and not gs.missing and n_split_t != sum(h.tensor_count for h in gs.headers):
        anomalies.append(Anomaly("error", None, f"split.tensors.count says {n_split_t} tensors but the files hold "
                                                f"{sum(h.tensor_count for h in gs.headers)}"))

    tensors = gs.tensors
    by_name = {}
    twice = 0
    for t in tensors:
        if t.name in by_name:
            # llama.cpp refuses the model ("tensor '%s' is duplicated"); listed MAX_REPORTED times, then counted
            twice += 1
            if twice <= MAX_REPORTED:
                anomalies.append(Anomaly("error", t.name, "tensor name appears twice; the second entry is ignored"))
            continue
        by_name[t.name] = t
    if twice > MAX_REPORTED:
        anomalies.append(Anomaly("error", None, f"... and {twice - MAX_REPORTED} more tensor entries repeat a name "
                                                f"({twice} in all); only the first of each is read"))
    groups = group_modules({n: (t.type_name, t.shape) for n, t in by_name.items()})
    modules: list[ModuleReport] = []
    module_of: dict[str, str] = {}
    other_bytes = other_params = 0
    for prefix, members in groups.items():
        pre = f"{prefix}." if prefix else ""
        w = by_name.get(pre + "weight")
        d = detect_gguf(w.shape, w.type_name, w.block) if w is not None else None
        names = tuple(pre + s for s in members)
        if d is None:
            for n in names:
                other_bytes += by_name[n].nbytes or 0
                other_params += by_name[n].n_elements
            continue
        nbytes = sum(by_name[n].nbytes or 0 for n in names)
        extra = sum(by_name[n].n_elements for n in names if n != pre + "weight")
        modules.append(_module_report(prefix, d, nbytes, extra, names))
        for n in names:
            module_of[n] = prefix

    hist: dict[str, list] = {}
    for t in by_name.values():
        h = hist.setdefault(t.type_name, [0, 0, t.bpw])
        h[0] += 1
        h[1] = None if h[1] is None or t.nbytes is None else h[1] + t.nbytes  # None: a size the header cannot give
    histogram = [(name, v[0], v[1], v[2]) for name, v in sorted(hist.items(), key=lambda kv: -(kv[1][1] or 0))]

    metadata = {k: _json_value(v) for k, v in kv.items()}
    first = gs.headers[0]
    ftype = kv.get("general.file_type")
    metadata["qtool.gguf"] = {
        "version": first.version, "byte_order": first.byte_order, "alignment": first.alignment,
        "file_type_name": file_type_name(ftype) if isinstance(ftype, int) else None,
        "split_files": len(gs.headers) + len(gs.missing),
        "tensor_types": {name: {"tensors": n, "bytes": b, "bpw": None if bpw is None else round(bpw, 4)}
                         for name, n, b, bpw in histogram},
    }
    info = {"architecture": kv.get("general.architecture", "?"),
            "file type": f"{file_type_name(ftype)} ({ftype})" if isinstance(ftype, int) else "?",
            "quantization version": kv.get("general.quantization_version", "?"),
            "gguf": f"v{first.version}, {first.byte_order}-endian, alignment {first.alignment}, "
                    f"{len(kv)} metadata keys"}
    if kv.get("general.name"):
        info["name"] = kv["general.name"]
    rows = [TensorRow(t.name, t.type_name, t.shape, t.nbytes, t.file.name, t.complete, module_of.get(t.name))
            for t in by_name.values()]
    report = InspectReport(
        path=str(p), container="gguf", format="", modules=modules, tensor_count=len(by_name),
        bytes_total=sum(t.nbytes or 0 for t in by_name.values()), bpw=None, metadata=metadata,
        anomalies=anomalies, files=[str(f) for f in gs.files], tensors=rows,
        other_bytes_params=(other_bytes, other_params), info=info, type_histogram=histogram)
    return report, gs
