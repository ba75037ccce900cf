"""The source side of a repack: which modules are quantized in what layout, and reading their tensors.

Detection is `qtool.inspect.inspect_path` (header-only: format, bits, group size, sym, desc_act, shape per
module); this module adds what a conversion needs on top: the QuantScheme each reader wants, the tensors that
belong to the layout versus those copied as they are (bias), and tensor data one module at a time.

Two containers:
- safetensors (file, directory, index): module tensors by short name, read through `Checkpoint.get`;
- GGUF (one file or a split set): a module is `<prefix>.weight`, read as its raw block bytes uint8
  [O, I/block*block_bytes] (GGUF dims are [ne0 = I, ne1 = O]); Q4_0/Q4_1/Q8_0 map to the `gguf_*` formats,
  every other quantized type is readable only through the gguf package's dequantizer (`gguf:<TYPE>`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qtool.errors import FormatError, InputError
from qtool.formats.base import format_id
from qtool.io.config_regex import WorkBudget, compile_config_regex
from qtool.io.gguf_reader import SWAPPABLE, to_little_endian
from qtool.scheme import QuantScheme

# A module's tensors that are not part of any packed layout: copied as they are.
NOT_LAYOUT = frozenset({"bias"})
# Short names a source format reads besides its spec's `tensors`: legacy Marlin's B/s, and its `workspace`
# (the kernel's lock buffer, zeros by construction: no weight data to carry).
READS_ALSO = {"marlin": frozenset({"B", "s", "workspace"})}
# qtool's own reports about the source checkpoint: stale for the converted one, so not copied
QTOOL_REPORTS = frozenset({"report.json", "report.md", "qtool_repack.json"})


@dataclass(slots=True)
class SourceModule:
    """One quantized linear module of the source.

    scheme:   format: qtool format id ("gptq", "ct", "gguf_q4_0", ...) or "gguf:<TYPE>" (dequantize-only GGUF
              type); bits / group_size / sym / desc_act: what the header and config say (None = not known
              without reading data); extra: the facts the format's unpack reads beside them (compressed-tensors
              version, Marlin source, GGUF type). It is what `unpack` and the fast paths are given.
    layout:   {short name: full tensor name} of the packed layout (read, converted)
    others:   full names of the module's other tensors (bias ...); they are in Source.passthrough too
    extra:    full names of tensors under the module's prefix that its format does not read (a rotation, a
              smoothing vector, ...): converting without them loses them, so the plan carries them (--keep),
              discards them (--drop) or refuses the module; they are in Source.passthrough too
    in_features / out_features: what the header says (None = not known without reading data)
    """

    name: str
    scheme: QuantScheme
    layout: dict[str, str]
    others: list[str]
    in_features: int | None
    out_features: int | None
    nbytes: int = 0
    scale_dtype: str | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int] | None:
        if self.in_features is None or self.out_features is None:
            return None
        return (self.out_features, self.in_features)


@dataclass
class Source:
    """A checkpoint opened for repacking. `passthrough`: tensors outside every quantized module, in file
    order (embeddings, norms, dense weights ...); they are copied byte for byte."""

    path: Path
    container: str  # "safetensors" | "gguf"
    modules: list[SourceModule]
    passthrough: list[str]
    order: list[str]  # every tensor name in source order
    config: dict | None = None
    quant_config: dict | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    root: Path | None = None
    other_files: list[Path] = field(default_factory=list)
    replaced_files: list[Path] = field(default_factory=list)  # quantize_config.json: never copied, said so
    warnings: list[str] = field(default_factory=list)
    gguf_header: Any = None  # the first GGUFHeader of a GGUF source: its metadata records are carried
    _ck: Any = None
    _gguf: dict = field(default_factory=dict)  # name -> GGUFTensor
    _big: frozenset = frozenset()  # GGUF files whose data is big-endian
    _hf: Any = None  # a GGUF source's Hugging Face view (repack.interop.hf_view), built once

    # --- facts -----------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        """Model architecture name: GGUF general.architecture, or config.json model_type."""
        if self.container == "gguf":
            a = self.metadata.get("general.architecture")
            return a if isinstance(a, str) else None
        if self.config:
            mt = self.config.get("model_type")
            return mt if isinstance(mt, str) else None
        return None

    def tensor_nbytes(self, name: str) -> int:
        if self.container == "gguf":
            return self._gguf[name].nbytes or 0
        return self._ck.tensors[name].nbytes

    # --- data --------------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Tell the kernel every weight file will be read start to end (POSIX_FADV_WILLNEED), so pages that
        are not cached are read ahead in the background while the first modules are converted."""
        if not hasattr(os, "posix_fadvise"):
            return
        files = {info.file for info in self._ck.tensors.values()} if self._ck is not None else \
            {t.file for t in self._gguf.values()}
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue  # reading it later reports the problem with its name
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint
            finally:
                os.close(fd)

    def load(self, m: SourceModule, mapped: bool = False) -> dict:
        """{short name: torch.Tensor} of one module's layout tensors (mapped: large ones as copy-on-write
        maps of the file, see io.checkpoint.read_tensor)."""
        if self.container == "gguf":
            return {"weight": self.gguf_bytes(m.layout["weight"])}
        return {short: self._ck.get(full, mapped) for short, full in m.layout.items()}

    def get(self, name: str):
        """One tensor as torch (GGUF: float tensors in numpy order [ne_last, ..., ne0], others raw bytes)."""
        if self.container == "gguf":
            return self.gguf_float(name)
        return self._ck.get(name)

    def tensor_info(self, name: str):
        """safetensors TensorInfo (for byte-for-byte copies) or the GGUFTensor entry."""
        return self._gguf[name] if self.container == "gguf" else self._ck.tensors[name]

    def gguf_bytes(self, name: str):
        """uint8 [rows, row_bytes] raw data of a GGUF tensor (rows = product of ne1..)."""
        import torch

        from qtool.io.checkpoint import read_bytes

        t = self._gguf[name]
        if t.nbytes is None or not t.complete:
            raise InputError("tensor data is missing or truncated", path=t.file, tensor=name)
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        raw = read_bytes(t.file, t.start, t.nbytes, name)  # a checked read: a truncated file is an InputError
        if t.file in self._big:
            raw = to_little_endian(raw, t.type_name)
        return torch.from_numpy(raw.reshape(rows, t.nbytes // rows))

    def gguf_float(self, name: str):
        """A GGUF F32/F16/BF16 tensor as torch, numpy-order shape (reversed GGUF dims)."""
        import torch

        t = self._gguf[name]
        raw = self.gguf_bytes(name).reshape(-1)
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(t.type_name)
        if dt is None:
            raise InputError(f"GGUF tensor of type {t.type_name} is not a float tensor", path=t.file, tensor=name)
        return raw.view(dt).reshape(tuple(reversed(t.shape)))

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()


# --- opening -------------------------------------------------------------------------------------------------
def open_source(path: str | Path) -> Source:
    """Open a safetensors checkpoint or a GGUF model for repacking."""
    from qtool.inspect import inspect_path
    from qtool.inspect.core import is_gguf_path

    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=p, fix="check the path")
    report = inspect_path(p)
    errors = [a for a in report.anomalies if a.severity == "error"]
    if errors:
        # An inconsistent or damaged source has no exact conversion: name the problem, write nothing.
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise InputError(f"{_anomaly_text(errors[0])}{more}", path=p, tensor=errors[0].tensor,
                         fix="run `qtool inspect` on it for every problem; nothing was written")
    if is_gguf_path(p):
        return _open_gguf(p, report, errors)
    return _open_safetensors(p, report, errors)


def _anomaly_text(a) -> str:
    return f"{a.module}: {a.message}" if getattr(a, "module", None) else a.message


def _open_safetensors(p: Path, report, errors) -> Source:
    from qtool.formats import all_formats
    from qtool.io.checkpoint import open_checkpoint

    ck = open_checkpoint(p)
    raw = ck.quant_config or {}
    version = raw.get("version") if raw.get("quant_method") == "compressed-tensors" else None
    dynamic = raw.get("dynamic") if isinstance(raw.get("dynamic"), dict) else {}
    regexes: dict[str, Any] = {}
    budget = WorkBudget()
    modules, in_module = [], set()
    known = all_formats()
    for mr in report.modules:
        if not mr.quantized:
            continue
        pre = f"{mr.name}." if mr.name else ""
        reads = _reads(known.get(mr.scheme.format), mr.scheme.format)
        layout, others, unread = {}, [], []
        for full in mr.tensor_names:
            short = full[len(pre):]
            if short in NOT_LAYOUT:
                others.append(full)
            elif reads is not None and short not in reads:
                unread.append(full)
            else:
                layout[short] = full
                in_module.add(full)
        bits, group = mr.scheme.bits, mr.scheme.group_size
        for pat, over in dynamic.items():  # GPTQModel per-module overrides ("+:regex" or bare regex)
            if isinstance(over, dict) and not pat.startswith("-:"):
                rx = pat[2:] if pat.startswith("+:") else pat
                if rx not in regexes:  # bounded matcher: the pattern comes from the file (config_regex.py)
                    regexes[rx] = compile_config_regex(rx, path=ck.root / "config.json", key="dynamic",
                                                       budget=budget)
                if regexes[rx].match(mr.name):
                    bits = over.get("bits", bits)
                    group = over.get("group_size", group)
        extra = {"quant_config": raw, "metadata": dict(ck.metadata), "module": mr.name}
        if mr.scheme.extra.get("experts"):  # a fused [experts, out, in] stack: the planner refuses to convert it
            extra["experts"] = mr.scheme.extra["experts"]
        named = (ck.config or {}).get("torch_dtype", (ck.config or {}).get("dtype"))  # transformers 5: `dtype`
        if named in ("bfloat16", "float16", "float32"):
            extra["model_dtype"] = named  # what float layouts dequantize to (fp8)
        if version:
            extra["version"] = str(version)
        if mr.scheme.format == "marlin":  # the checkpoint's own contract names the layout it converts back to
            from qtool.formats.marlin import params_from_contract

            contract = params_from_contract(ck.metadata, ck.quant_config)
            extra.update(contract.extra)
            bits = contract.bits if contract.bits is not None else bits
            group = contract.group_size if contract.group_size is not None else group
        sdt = _scale_dtype(ck, layout)
        modules.append(SourceModule(
            name=mr.name, scheme=replace(mr.scheme, bits=bits, group_size=group, extra=extra), layout=layout,
            others=others, in_features=mr.in_features, out_features=mr.out_features, nbytes=mr.bytes, scale_dtype=sdt, extra=unread))
    order = list(ck.tensors)
    passthrough = [n for n in order if n not in in_module]
    warnings = [_anomaly_text(a) for a in errors] + ck.shard_notes()
    return Source(path=p, container="safetensors", modules=modules, passthrough=passthrough, order=order,
                  config=ck.config, quant_config=ck.quant_config, metadata=dict(ck.metadata), root=ck.root,
                  other_files=[f for f in ck.other_files() if f.name not in QTOOL_REPORTS],
                  replaced_files=ck.replaced_files(), warnings=warnings,
                  _ck=ck)


def _reads(fmt, fmt_id: str) -> frozenset[str] | None:
    """Short names the source format's unpack reads; None when qtool cannot read the format at all (the
    module is then planned impossible and copied nowhere)."""
    if fmt is None:
        return None
    return frozenset(fmt.spec.tensors) | READS_ALSO.get(fmt_id, frozenset())


def _scale_dtype(ck, layout: dict[str, str]) -> str | None:
    for short in ("scales", "weight_scale", "s"):
        if short in layout:
            return ck.tensors[layout[short]].dtype
    return None


def _open_gguf(p: Path, report, errors) -> Source:
    from qtool.io.gguf_reader import read_gguf

    gs = read_gguf(p)
    if gs.missing:
        raise InputError(f"split file {gs.missing[0].name} is missing", path=p, fix="download it next to the others")
    by_name = {}
    for t in gs.tensors:
        by_name.setdefault(t.name, t)
    for t in by_name.values():
        if not t.complete:
            raise InputError("tensor data is missing or truncated", path=t.file, tensor=t.name,
                             fix="re-download the file")
    big = frozenset(h.path for h in gs.headers if h.byte_order == "big")
    for t in by_name.values():
        if t.file in big and t.type_name not in SWAPPABLE:
            raise InputError(f"big-endian GGUF tensor of type {t.type_name}: qtool converts big-endian "
                             f"{', '.join(sorted(SWAPPABLE))} tensors only", path=t.file, tensor=t.name,
                             fix="convert the file to little-endian with gguf-py's gguf_convert_endian.py; "
                                 "nothing was written")
    modules, in_module = [], set()
    for mr in report.modules:
        if not mr.quantized:
            continue
        pre = f"{mr.name}." if mr.name else ""
        weight = pre + "weight"
        # inspect names every GGUF type "gguf:<TYPE>"; those a block format holds exactly are its aliases
        fmt = format_id(mr.scheme.format) or mr.scheme.format
        others = [n for n in mr.tensor_names if n[len(pre):] in NOT_LAYOUT]
        unread = [n for n in mr.tensor_names if n != weight and n not in others]
        modules.append(SourceModule(
            name=mr.name, scheme=replace(mr.scheme, format=fmt, desc_act=False,
                                         extra={"gguf_type": by_name[weight].type_name}),
            layout={"weight": weight}, others=others, in_features=mr.in_features, out_features=mr.out_features,
            nbytes=mr.bytes, scale_dtype="F16", extra=unread))
        in_module.add(weight)
    order = list(by_name)
    passthrough = [n for n in order if n not in in_module]
    return Source(path=p, container="gguf", modules=modules, passthrough=passthrough, order=order,
                  metadata=dict(gs.kv), warnings=[_anomaly_text(a) for a in errors], _gguf=by_name,
                  root=p.parent, gguf_header=gs.headers[0], _big=big)


# Say what a damaged module means and what to do, where the format's own error has no fix.
DAMAGED_FIX = ("the checkpoint is damaged or mislabelled: `qtool inspect --deep` lists every problem; re-export or "
               "re-download it, or --exclude the module to copy it unchanged; nothing was written")


def located(e: FormatError, source, m, fix: str = DAMAGED_FIX) -> FormatError:
    """A format's error (it names the short tensor only) naming the checkpoint and the module's full tensor
    name, with the format's fix or `fix`."""
    tensor = (m.layout.get(e.tensor) or f"{m.name}.{e.tensor}") if e.tensor else m.name
    return FormatError(e.problem, path=source.path, tensor=tensor, fix=e.fix or fix)


def unpack_module(source, m, mapped: bool = False, fix: str = DAMAGED_FIX):
    """The module's canonical Plain (or ScaledPlain) through its format's own unpack; a FormatError names the
    checkpoint and the tensor (located), and says what to do (`fix` where the format does not)."""
    from qtool.formats import get_format

    try:
        return get_format(m.scheme.format).unpack(source.load(m, mapped=mapped), m.scheme)
    except FormatError as e:
        raise located(e, source, m, fix) from None
