"""`qtool repack SRC --to dense`: every quantized module written as the float weight its format decodes to.

What is written: a Hugging Face directory (safetensors shards + index), config.json without its
`quantization_config` and with `torch_dtype` naming the dtype written, and every other file and sub-directory
of the source copied (tokenizer, generation_config.json, 1_Pooling/, ...). A GGUF source gets transformers'
names, row order, config and tokenizer files, as the GGUF -> Hugging Face repack writes them.

Values: each module is decoded by its own format (`unpack` then the shared `dequantize` for integer codes;
the block dequantizers of the GGUF types), never by a second decoder here. In fp32 the weights equal the
format's own fp32 dequantization bit for bit: lossless with respect to the stored codes. bf16 and fp16 round
each weight once (the plan says so per module); a value the dtype cannot hold (fp16 past 65504) or a NaN is an
error, never a line in a report.

Tensors outside the quantized modules are copied byte for byte; with an explicit --dtype, float ones (F16,
BF16, F32) are cast to it, and the plan lists each cast. Integer tensors are never cast.

Memory: one module's packed tensors and its canonical form, plus the writer's queue of at most QUEUE_DEPTH
pieces of CHUNK_BYTES each. A module is dequantized CHUNK_BYTES of output rows at a time and each piece is
written as it comes (ShardedWriter.begin_tensor / write_chunk), so no dequantized tensor is ever whole in
memory and the peak does not grow with the model or its largest tensor.

Output is built under a temporary name and published atomically (io.writer.atomic_output); inputs are never
touched; a signal or an error removes the temporary output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qtool.errors import InputError, NotRepresentable, OutputError, UsageError
from qtool.repack.report import RunReport

# --dtype spellings -> safetensors dtype name; and what each name means for the values written
DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "half": "F16", "fp32": "F32",
          "float32": "F32", "float": "F32"}
TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
ROUNDING = {"F32": "exact: every weight equals the format's own fp32 dequantization of the stored codes",
            "BF16": "rounded: every weight is the exact dequantized value rounded once to bf16 (8 significant bits)",
            "F16": "rounded: every weight is the exact dequantized value rounded once to fp16 (11 significant bits; "
                   "a weight past fp16's 65504 stops the run)"}
FLOAT_ST = ("F16", "BF16", "F32")
# layout tensors that quantize activations, not weights: a dense model has none (listed as dropped)
ACTIVATION_SCALES = frozenset({"input_scale", "input_zero_point", "input_global_scale"})
# files beside the weights that describe the source's quantization (ModelOpt's hf_quant_config.json, the GPTQ
# and AWQ loaders' quantize_config.json): a loader that finds one treats the model as quantized, so the dense
# output leaves them out (and the plan says so)
QUANT_CONFIG_FILES = frozenset({"hf_quant_config.json", "quantize_config.json"})
CHUNK_BYTES = 16 << 20  # output bytes dequantized (or cast) at a time
QUEUE_DEPTH = 4  # pieces waiting for the writer thread: the write buffer is QUEUE_DEPTH x CHUNK_BYTES


@dataclass(frozen=True)
class DenseJob:
    """What `qtool repack --to dense` was asked (the CLI flags, one to one).

    dtype: bf16 | fp16 | fp32, or None: the source config's torch_dtype when it names one of them (else
           bf16), and tensors outside the modules copied as they are.
    keep / drop: regexes for tensors under a module that its layout does not read (see qtool.repack.plan)."""

    src: Path
    out: Path | None = None
    dtype: str | None = None
    keep: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    dry_run: bool = False
    force: bool = False
    max_shard_size: str = "4GB"


@dataclass
class DenseModule:
    """One quantized module's fate: dequantized from `src_format` into the tensor `name`."""

    module: str
    name: str
    src_format: str
    shape: list[int]
    bits: int | None
    group_size: int | None
    dtype: str
    kind: str  # "exact" (fp32) | "rounded" (bf16/fp16)
    source_tensors: list[str] = field(default_factory=list)


@dataclass
class TensorFate:
    """A tensor outside the quantized layouts: copied, cast, carried beside its module, or dropped."""

    name: str  # in the output ("" when dropped)
    source: str
    fate: str  # "copied" | "cast" | "carried" | "dropped"
    dtype: str
    note: str = ""


@dataclass
class DensePlan:
    job: DenseJob
    out: Path
    dtype: str  # safetensors name of the dequantized modules' dtype
    dtype_explicit: bool
    modules: list[DenseModule]
    tensors: list[TensorFate]
    source_format: str
    container: str
    warnings: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return "dense"

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for t in self.tensors:
            c[t.fate] = c.get(t.fate, 0) + 1
        return c

    def to_dict(self) -> dict:
        return {"target": "dense", "dtype": TORCH_NAMES[self.dtype], "out": str(self.out),
                "source_format": self.source_format, "container": self.container, "values": ROUNDING[self.dtype],
                "modules": [asdict(m) for m in self.modules], "tensors": [asdict(t) for t in self.tensors],
                "counts": {"dequantized": len(self.modules), **self.counts()}, "warnings": list(self.warnings)}


@dataclass
class DenseReport(RunReport):
    def to_dict(self) -> dict:
        return self.plan.to_dict() | {"dry_run": self.plan.job.dry_run} | self.outcome()


# --- planning ------------------------------------------------------------------------------------------------
def _dtype_of(job: DenseJob, config: dict | None) -> tuple[str, bool]:
    if job.dtype is not None:
        st = DTYPES.get(str(job.dtype).strip().lower())
        if st is None:
            raise UsageError(f"--dtype {job.dtype} is not a dense dtype", fix="choose bf16, fp16 or fp32")
        return st, True
    cfg = config or {}
    named = cfg.get("torch_dtype", cfg.get("dtype"))
    return (DTYPES.get(named, "BF16") if isinstance(named, str) else "BF16"), False


def plan_dense(job: DenseJob):
    """(source, plan): every tensor's fate, decided before anything is written. Refuses (UsageError /
    NotRepresentable, nothing written) a source with modules qtool cannot decode or unread tensors that
    --keep/--drop do not name."""
    from qtool.repack.plan import _compile, default_out
    from qtool.repack.source import open_source

    if job.dtype is not None:
        _dtype_of(job, None)  # a bad --dtype is a usage error before the source is opened
    keep = [_compile(r, "--keep") for r in job.keep]
    drop = [_compile(r, "--drop") for r in job.drop]
    source = open_source(job.src)
    try:
        return source, _plan(source, job, keep, drop, default_out)
    except BaseException:
        source.close()
        raise


# the note of a GGUF q/k tensor copied with its rows put back in transformers' order
REORDERED = "rows put back from llama.cpp's rotary pair order (exact)"


def _plan(source, job: DenseJob, keep, drop, default_out) -> DensePlan:
    from qtool.formats import all_formats

    if not source.modules and source.container != "gguf":  # a float GGUF still becomes a Hugging Face model
        raise UsageError("no quantized modules to dequantize: the checkpoint is dense already", path=job.src,
                         fix="nothing to do; `qtool inspect` shows what it holds")
    known = all_formats()
    bad = [m for m in source.modules
           if m.scheme.format not in known and not m.scheme.format.startswith("gguf:")]
    if bad:
        fmts = sorted({m.scheme.format for m in bad})
        names = ", ".join(m.name for m in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NotRepresentable(f"{len(bad)} of {len(source.modules)} modules are in layouts qtool cannot decode "
                               f"({', '.join(fmts)}: {names}); nothing was written", path=job.src,
                               fix="dequantize them with the tool that wrote them (qtool decodes "
                                   + ", ".join(sorted(known)) + " and GGUF)")
    _check_gguf_types(source)
    st, explicit = _dtype_of(job, source.config)
    from qtool.repack.interop import hf_view

    g2h = hf_view(source)
    rename = g2h.name if g2h else (lambda n: n)
    kind = "exact" if st == "F32" else "rounded"
    modules, fates, warnings = [], [], list(source.warnings)
    in_module: set[str] = set()
    for m in source.modules:
        experts = (m.scheme.extra or {}).get("experts") if source.container == "safetensors" else None
        if experts:
            # a fused [experts, out, in] stack (gpt-oss) has no 2-D weight for the dense writer to produce
            raise NotRepresentable(f"module {m.name} is a 3-D mixture-of-experts stack ({experts} experts, "
                                   f"{m.scheme.format}): repack --to dense dequantizes 2-D linear modules only; "
                                   "nothing was written", path=job.src, tensor=m.name,
                                   fix="dequantize the stacks with the engine that reads them; qtool inspect "
                                       "--deep decodes and checks them")
        weight = m.layout.get("weight") if source.container == "gguf" else None
        out_name = rename(weight) if weight else (f"{m.name}.weight" if m.name else "weight")
        modules.append(DenseModule(m.name, out_name, m.scheme.format, _out_shape(source, m), m.scheme.bits,
                                   m.scheme.group_size, st, kind, sorted(m.layout.values())))
        in_module.update(m.layout.values())
        for short, name in m.layout.items():
            if short in ACTIVATION_SCALES:
                fates.append(TensorFate("", name, "dropped", source.tensor_info(name).dtype,
                                        "activation quantization parameter: the dense model computes in "
                                        "floating point and has no use for it"))
        for name in m.extra:
            k, d = any(r.search(name) for r in keep), any(r.search(name) for r in drop)
            if k and d:
                raise UsageError(f"tensor '{name}' matches both --keep and --drop", fix="narrow one of the patterns")
            if not (k or d):
                raise NotRepresentable(f"module {m.name} holds '{name}', which its {m.scheme.format} layout does not "
                                       "read: the dense weight would lose it; nothing was written", path=job.src,
                                       tensor=name, fix="--keep REGEX carries it unchanged, --drop REGEX discards "
                                                        "it (the plan lists either)")
            if d:
                fates.append(TensorFate("", name, "dropped", source.tensor_info(name).dtype, "--drop"))
                in_module.add(name)
    dropped = {t.source for t in fates if t.note == "--drop"}
    extras = {n for m in source.modules for n in m.extra} - dropped
    for name in source.order:
        if name in in_module:
            continue
        info = source.tensor_info(name)
        sdt = info.type_name if source.container == "gguf" else info.dtype
        if g2h and name in g2h.folded:
            fates.append(TensorFate("", name, "dropped", sdt, g2h.folded[name]))
            continue
        if source.container == "gguf" and sdt not in FLOAT_ST:
            raise InputError(f"GGUF tensor of type {sdt} outside the quantized modules: qtool does not know what it "
                             "holds; nothing was written", path=info.file, tensor=name,
                             fix="convert the file with llama.cpp's tools first")
        fate = "carried" if name in extras else "copied"
        if explicit and sdt in FLOAT_ST and sdt != st:
            note = "exact (widened)" if _widens(sdt, st) else f"rounded once to {TORCH_NAMES[st]}"
            fates.append(TensorFate(rename(name), name, "cast", st, f"{sdt} -> {st}: {note}"))
        else:
            rows = g2h is not None and g2h.rows(name) is not None
            fates.append(TensorFate(rename(name), name, fate, sdt, "--keep" if fate == "carried" else
                                    REORDERED if rows else ""))
    for flag, regexes, got in (("--keep", keep, extras), ("--drop", drop, dropped)):
        for r in regexes:
            if not any(r.search(n) for n in got):
                warnings.append(f"{flag} '{r.pattern}' names no tensor that a module's layout leaves unread; it "
                                "changed nothing")
    for f in [*source.other_files, *source.replaced_files]:
        if f.name in QUANT_CONFIG_FILES:
            warnings.append(f"{f.name}: not copied: it describes the source's quantization, which the dense model "
                            "does not have")
    if g2h:  # every name is resolved above: the names the map lacks are known now (--dry-run shows them)
        warnings += g2h.notes + g2h.warnings()
    out = Path(job.out) if job.out else default_out(job.src, "dense")
    fmts = sorted({m.scheme.format for m in source.modules})
    return DensePlan(job, out, st, explicit, modules, fates, ",".join(fmts), source.container, warnings)


def _widens(a: str, b: str) -> bool:
    """Every value of float dtype a is a value of float dtype b."""
    return a == b or b == "F32"


def _out_shape(source, m) -> list[int]:
    if source.container == "gguf":
        return list(reversed(source.tensor_info(m.layout["weight"]).shape))
    return [m.out_features, m.in_features]


def _check_gguf_types(source) -> None:
    """Every GGUF type the modules use decodes (one row of each through its dequantizer), so that a type the
    gguf package cannot dequantize stops the run before anything is written."""
    seen: set[str] = set()
    for m in source.modules:
        if not m.scheme.format.startswith("gguf:") or m.scheme.format in seen:
            continue
        seen.add(m.scheme.format)
        _gguf_dequantize(source.gguf_bytes(m.layout["weight"])[:1], m.scheme.format, m.name)


# --- decoding one module, a piece at a time -------------------------------------------------------------------
def _gguf_dequantize(raw, fmt: str, module: str):
    """float32 [rows, I] of raw GGUF rows, by the type's own dequantizer."""
    from qtool.formats.gguf_blocks import dequantize_any

    return dequantize_any(raw, fmt, module, fix="nothing was written; convert the file with llama.cpp's tools "
                                                "first")


def module_pieces(source, m, dtype, rows=None, chunk_bytes: int | None = None) -> Iterator:
    """The module's dequantized weight in `dtype`, as consecutive pieces of whole output rows (each at most
    about chunk_bytes). rows: GGUF -> transformers row order (out row r = stored row rows[r]) or None."""
    import torch

    chunk_bytes = chunk_bytes or CHUNK_BYTES
    if source.container == "gguf":
        raw = source.gguf_bytes(m.layout["weight"])
        n_rows, width = raw.shape[0], _out_shape(source, m)[-1]
        step = max(1, chunk_bytes // max(1, width * torch.finfo(dtype).bits // 8))
        for r0 in range(0, n_rows, step):
            sel = raw[r0:r0 + step] if rows is None else raw[rows[r0:r0 + step]]
            yield _finite(_gguf_dequantize(sel, m.scheme.format, m.name).to(dtype), m.name, r0)
        return
    from qtool.formats import dequantize
    from qtool.repack.source import unpack_module

    # a format's error names the file and the module's tensor, with a fix
    p = unpack_module(source, m, fix="the checkpoint is damaged or mislabelled: `qtool inspect --deep` lists every "
                                     "problem; re-export or re-download it; nothing was written")
    step = max(1, chunk_bytes // max(1, p.in_features * torch.finfo(dtype).bits // 8))
    check = may_leave_range(p, dtype)
    first = _e4m3_piece(p, dtype, 0, step, m.name)
    if first is None:
        _refuse_nan_codes(p, m.name)
    for r0 in range(0, p.out_features, step):
        if first is not None:  # E4M3 through the C++ decode, which counts NaN codes on the way
            w = first if r0 == 0 else _e4m3_piece(p, dtype, r0, r0 + step, m.name)
        else:
            w = dequantize(p, dtype, rows=slice(r0, r0 + step))
        yield _finite(w, m.name, r0) if check else w


def _e4m3_piece(p, dtype, r0: int, r1: int, module: str):
    """Rows r0..r1 of an E4M3 module's weight by the C++ decode (qtool.packing.e4m3), the format's own bits,
    refused (NotRepresentable) when a code is NaN; None where that decode does not apply (the caller takes
    dequantize and the separate NaN check)."""
    import torch

    from qtool.formats.scaled import ScaledPlain, effective_scales

    if not (isinstance(p, ScaledPlain) and p.element == "e4m3" and p.zeros is None and p.compute == "float32"
            and dtype in (torch.float32, torch.bfloat16)):
        return None
    from qtool.packing.e4m3 import dequant_counted

    bo = p.block_shape[0]
    r1 = min(r1, p.out_features)
    got = dequant_counted(p.codes[r0:r1], effective_scales(p, slice(r0, r1)), p.block_shape[1], dtype, bo=bo,
                          first=r0 % bo)
    if got is None:
        return None
    if got[1]:
        _refuse_nan_codes(p, module)  # names the first NaN code and the count
    return got[0]


def may_leave_range(p, dtype) -> bool:
    """False when the largest |scale| times the largest |code - zero| provably stays inside dtype's range (then
    the pieces need no finiteness pass); True otherwise, NaN scales included. p: a Plain or a ScaledPlain."""
    import torch

    from qtool.formats import Plain

    if isinstance(p, Plain):
        top = float(p.scales.abs().max()) * (1 << p.bits) if p.scales.numel() else 0.0
    else:
        from qtool.formats.scaled import ELEMENTS, effective_scales

        s = effective_scales(p).to(torch.float64)
        z = int(p.zeros.abs().max()) if p.zeros is not None and p.zeros.numel() else 0
        top = float(s.abs().max()) * (ELEMENTS[p.element].max + z) if s.numel() else 0.0
    return not top <= torch.finfo(dtype).max


# float code bytes that are no number: E4M3 S.1111.111 (NaN); E5M2 S.11111.xx (inf and NaN)
_NOT_A_NUMBER = {"e4m3": (0x7F, 0x7F), "e5m2": (0x7C, 0x7C)}


def _refuse_nan_codes(p, module: str) -> None:
    """A float code that is NaN (or inf) would make the weight NaN: an error naming the module and the count."""
    rule = _NOT_A_NUMBER.get(getattr(p, "element", None))
    if rule is None:
        return
    import numpy as np
    import torch

    mask, value = rule
    from qtool.packing.e4m3 import count_masked

    n = count_masked(p.codes.view(torch.uint8), mask, value)  # one pass in C++ where it builds
    if n == 0:
        return
    if n is None:
        u = p.codes.contiguous().view(torch.uint8).reshape(-1).numpy()
        n8 = u.size // 8 * 8
        # eight codes per 64-bit word: a byte of t is zero exactly where (code & mask) == value, and
        # (t - 0x01..) & ~t & 0x80.. is non-zero exactly when t has a zero byte; an eighth of the bytewise work
        w = u[:n8].view(np.uint64)
        t = (w & np.uint64(mask * 0x0101010101010101)) ^ np.uint64(value * 0x0101010101010101)
        found = bool(((t - np.uint64(0x0101010101010101)) & ~t & np.uint64(0x8080808080808080)).any())
        if not found and not ((u[n8:] & mask) == value).any():
            return
    bad = (p.codes.view(torch.uint8) & mask) == value
    r, c = (int(x[0]) for x in bad.nonzero(as_tuple=True))
    raise NotRepresentable(f"module {module}: {int(bad.sum())} {p.element} weight code(s) are NaN or infinite "
                           f"(the first at [{r}, {c}]); nothing was written", tensor=module,
                           fix="the checkpoint is damaged there (`qtool inspect --deep` lists it); repair or "
                               "re-download it")


def _finite(w, module: str, r0: int):
    import torch

    if not bool(torch.isfinite(w).all()):
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        what = "NaN" if bool(torch.isnan(w).any()) else "infinite"
        raise NotRepresentable(f"module {module}: weight [{r0 + bad[0]}, {bad[1]}] dequantizes to a {what} value in "
                               f"{w.dtype}; nothing was written", tensor=module,
                               fix="a scale or code of the source is out of range (`qtool inspect --deep` shows it); "
                                   "for fp16 overflow choose --dtype bf16 or fp32")
    return w


def _float_pieces(file: Path, start: int, nbytes: int, st: str, dtype, name: str,
                  chunk_bytes: int | None = None) -> Iterator:
    """A float tensor outside the modules (safetensors dtype `st`, little-endian bytes at `start` of `file`),
    cast to `dtype`, in pieces of about chunk_bytes of output, read a piece at a time: a large embedding is
    never whole in memory."""
    import torch

    from qtool.io.checkpoint import _torch_dtype, read_bytes

    chunk_bytes = chunk_bytes or CHUNK_BYTES
    sdt = _torch_dtype(st)
    isz = torch.finfo(sdt).bits // 8
    n = nbytes // isz
    step = max(1, chunk_bytes // (torch.finfo(dtype).bits // 8))
    for e0 in range(0, n, step):
        k = min(step, n - e0)
        raw = read_bytes(file, start + e0 * isz, k * isz, name)
        x = torch.from_numpy(raw).view(sdt)
        yield x if dtype == sdt else _finite_cast(x.to(dtype), name)


def _finite_cast(t, name: str):
    """A cast float tensor piece; a value that turned infinite (fp16 overflow) is an error."""
    import torch

    if t.dtype == torch.float16 and not bool(torch.isfinite(t).all()):
        raise NotRepresentable(f"tensor {name}: a value overflows fp16; nothing was written", tensor=name,
                               fix="choose --dtype bf16 or fp32, or leave --dtype out to copy it as it is")
    return t


# --- running --------------------------------------------------------------------------------------------------
def run_dense(job: DenseJob, on_progress: Callable[[str, int, int], None] | None = None) -> DenseReport:
    """Plan, then (unless dry_run) write the dense checkpoint atomically. Returns the report."""
    t0 = time.perf_counter()
    source, plan = plan_dense(job)
    try:
        report = DenseReport(plan, bytes_in=sum(source.tensor_nbytes(n) for n in source.order))
        if job.dry_run:
            report.seconds = time.perf_counter() - t0
            return report
        from qtool.io.writer import refuse_overwriting_input

        refuse_overwriting_input(job.src, plan.out)
        if plan.out.exists() and not job.force:
            raise OutputError("destination exists", path=plan.out,
                              fix="choose another -o, or pass --force to replace it")
        source.prefetch()
        _write(source, plan, report, on_progress)
    finally:
        source.close()
    report.written = True
    report.seconds = time.perf_counter() - t0
    return report


def _write(source, plan: DensePlan, report: DenseReport, on_progress) -> None:
    import torch

    from qtool import __version__

    dtype = getattr(torch, TORCH_NAMES[plan.dtype])
    from qtool.repack.interop import hf_view

    g2h = hf_view(source)
    position = {n: k for k, n in enumerate(source.order)}
    by_first = {min(m.layout.values(), key=position.__getitem__): (m, dm)
                for m, dm in zip(source.modules, plan.modules, strict=True)}
    fates = {t.source: t for t in plan.tensors}
    total = len(source.order)
    meta = {"qtool.version": __version__, "qtool.repack.source": plan.source_format,
            "qtool.dtype": TORCH_NAMES[plan.dtype]}
    replacing = plan.out.exists() or plan.out.is_symlink()
    # two stages, decoding and the writer thread's write(2): the decode takes one thread fewer than torch's
    # count, so the writer keeps a core (on two vCPUs, two decode threads and the writer measured more CPU
    # time and no less wall time than one and the writer)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        _write_files(source, plan, report, on_progress, dtype, g2h, position, by_first, fates, total, meta,
                     replacing)
    finally:
        torch.set_num_threads(threads)


def _write_files(source, plan, report, on_progress, dtype, g2h, position, by_first, fates, total, meta,
                 replacing) -> None:
    from qtool.io.writer import (
        BackgroundWriter,
        ShardedWriter,
        atomic_output,
        copy_extras,
        parse_size,
        write_json,
    )

    with atomic_output(plan.out, plan.job.force) as tmp:
        with BackgroundWriter(ShardedWriter(tmp, parse_size(plan.job.max_shard_size), meta,
                                            expected_tensors=len(source.order), writeback=replacing),
                              depth=QUEUE_DEPTH) as w:
            for k, name in enumerate(source.order):
                if on_progress:
                    on_progress(name, k, total)
                if name in by_first:
                    m, dm = by_first[name]
                    rows = g2h.rows(m.layout["weight"]) if g2h else None
                    _stream(w, dm.name, plan.dtype, dm.shape, module_pieces(source, m, dtype, rows))
                    continue
                t = fates.get(name)
                if t is None or t.fate == "dropped":
                    continue  # a module's layout tensor (written with its module) or a --drop
                _write_other(w, source, g2h, t, dtype)
        files = w.files
        report.files = [f.name for f in files]
        report.bytes_out = sum(f.stat().st_size for f in files)
        cfg = source.config
        if g2h:
            plan.warnings.extend(g2h.write_files(tmp))
            cfg = getattr(g2h, "config", None)
            n_rot = sum(1 for m in source.modules if g2h.rows(m.layout["weight"]) is not None)
            if n_rot:
                plan.warnings.append(f"{n_rot} q/k modules: rows put back from llama.cpp's rotary pair order into "
                                     "transformers' (exact)")
        write_json(tmp / "config.json", dense_config(cfg, plan.dtype))
        subdirs = source._ck.sub_directories() if source._ck is not None else []
        extras = [f for f in source.other_files if f.name not in QUANT_CONFIG_FILES]
        plan.warnings.extend(copy_extras(extras, source.root, tmp, subdirs, source._ck.left_out_files())
                             if source._ck is not None else [])
        write_json(tmp / "qtool_repack.json", report.to_dict() | {"written": True})
    if on_progress:
        on_progress("", total, total)


def dense_config(config: dict | None, st: str) -> dict:
    """config.json of the dense model: the source's without `quantization_config`, with the dtype written."""
    cfg = {k: v for k, v in (config or {}).items() if k != "quantization_config"}
    cfg["torch_dtype"] = TORCH_NAMES[st]
    if "dtype" in cfg:  # newer transformers name it so; both say the same
        cfg["dtype"] = TORCH_NAMES[st]
    return cfg


def _stream(w, name: str, st: str, shape: list[int], pieces: Iterator) -> None:
    """One tensor through the writer thread a piece at a time."""
    nbytes = {"F32": 4, "F16": 2, "BF16": 2}[st]
    for d in shape:
        nbytes *= d
    w.apply(lambda sw: sw.begin_tensor(name, st, shape, nbytes))
    for piece in pieces:
        w.apply(lambda sw, p=piece: sw.write_chunk(p))
    w.apply(lambda sw: sw.end_tensor())


def _write_other(w, source, g2h, t: TensorFate, dtype) -> None:
    """A tensor outside the modules: copied byte for byte, or cast piece by piece."""
    info = source.tensor_info(t.source)
    if source.container != "gguf":
        if t.fate == "cast":
            _stream(w, t.name, t.dtype, list(info.shape), _float_pieces(info.file, info.start, info.nbytes,
                                                                        info.dtype, dtype, t.source))
        else:
            w.add_raw(t.name, info)
        return
    # GGUF: float tensors (the plan refused others) in numpy order (reversed GGUF dims), q/k rows put back in
    # transformers' order
    shape = list(reversed(info.shape))
    r = g2h.rows(t.source)
    if r is None and info.file not in source._big:  # the bytes are already safetensors' (C order, little-endian)
        out_dt = t.dtype if t.fate == "cast" else info.type_name
        _stream(w, t.name, out_dt, shape, _float_pieces(info.file, info.start, info.nbytes, info.type_name,
                                                        dtype if t.fate == "cast" else _st_torch(info.type_name),
                                                        t.source))
        return
    x = source.gguf_float(t.source)  # a q/k bias or a big-endian file: small, or rare; read whole
    if r is not None:
        x = x[r]
    w.add(t.name, _finite_cast(x.to(dtype), t.source) if t.fate == "cast" else x.contiguous())


def _st_torch(st: str):
    import torch

    return getattr(torch, TORCH_NAMES[st])
