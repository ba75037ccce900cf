"""`qtool repack`: convert a quantized checkpoint to another layout, module by module, streaming.

Order of work: open the source (headers), plan every module (plan.py), refuse before writing anything if a
module is lossy without --allow-lossy or impossible, then stream: for each tensor in source order either copy
its bytes (passthrough, unchanged modules) or convert its module and write the result. Peak memory is one
module's tensors (and its canonical Plain), never the model. Output is built under a temporary name and
renamed into place only when complete.

Conversion of one module: a registered direct path when the plan is an exact relayout and one applies (its
bytes equal the composition's, tested), else `B.pack(steps(A.unpack(x)))`; lossy modules are dequantized and
requantized (qtool.quant for integer layouts, gguf.quants for GGUF types) and their error is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import InputError, NotRepresentable, UsageError
from qtool.formats.gguf_blocks import GGUF_IDS, type_name
from qtool.repack.plan import ModulePlan, RepackJob, RepackPlan, apply_steps, check_one_awq_config, make_plan
from qtool.repack.report import RunReport
from qtool.repack.source import unpack_module


class Refused(NotRepresentable):
    """The plan has lossy (without --allow-lossy) or impossible modules; nothing was written."""

    def __init__(self, plan: RepackPlan):
        self.plan = plan
        super().__init__(plan.refusal_message(), path=plan.job.src, fix=plan.refusal_fix())


@dataclass
class RepackReport(RunReport):
    def to_dict(self) -> dict:
        return (self.plan.to_dict() | {"dry_run": self.plan.job.dry_run, "allow_lossy": self.plan.job.allow_lossy}
                | self.outcome())


def fast_paths() -> dict:
    """(src, dst) -> direct conversion, gathered from the format modules that offer them."""
    import importlib

    out = {}
    for mod in ("compressed_tensors", "marlin", "gptq", "awq", "gptq_planar", "gguf_blocks"):
        try:
            m = importlib.import_module(f"qtool.formats.{mod}")
        except ModuleNotFoundError:
            continue
        out.update(getattr(m, "FAST_PATHS", {}) or {})
    return out


def plan_repack(job: RepackJob):
    """(source, plan) without writing anything."""
    from qtool.repack.source import open_source

    job.validate()
    source = open_source(job.src)
    if not source.modules:
        raise UsageError("no quantized modules to convert", path=job.src,
                         fix="repack converts quantized checkpoints; use `qtool pack` for dense ones")
    plan = make_plan(source, job)
    if plan.target in GGUF_IDS:
        from qtool.repack.interop import plan_gguf_types

        plan.float_types = plan_gguf_types(source, plan, ModuleConverter(source, plan, {}))
    elif job.tensor_type:
        raise UsageError("--tensor-type sets GGUF tensor types; it does not apply to --to " + plan.target,
                         fix="drop --tensor-type, or choose a GGUF target (q4_0, q4_1, q8_0)")
    elif source.container == "gguf":
        from qtool.repack.interop import dense_modules_for_hf

        dense_modules_for_hf(source, plan)
    check_one_awq_config(source, plan)
    if plan.target not in GGUF_IDS and not writes_quantize_config(plan.target):
        for f in source.replaced_files:
            plan.warnings.append(f"{f.name}: not copied: it describes the source's {plan.source_format} "
                                 f"quantization; the {plan.target} config.json quantization_config describes the "
                                 "output")
    return source, plan


def writes_quantize_config(target: str) -> bool:
    """Whether a `target` output gets its own quantize_config.json: the GPTQ and AWQ families (Marlin
    included), whose loaders also read that file (see _write_configs)."""
    from qtool.formats import get_format

    return target == "marlin" or hasattr(get_format(target), "config_for")


def run_repack(job: RepackJob, on_progress: Callable[[str, int, int], None] | None = None,
               use_fast_paths: bool = True) -> RepackReport:
    """Plan; refuse (Refused) or, unless dry_run, convert and write atomically. Returns the report."""
    t0 = time.perf_counter()
    source, plan = plan_repack(job)
    report = RepackReport(plan, bytes_in=sum(source.tensor_nbytes(n) for n in source.order))
    if plan.blocking():
        raise Refused(plan)
    if job.dry_run:
        report.seconds = time.perf_counter() - t0
        return report
    from qtool.io.writer import refuse_overwriting_input

    refuse_overwriting_input(job.src, plan.out)
    if plan.out.exists() and not job.force:
        from qtool.errors import OutputError

        raise OutputError("destination exists", path=plan.out, fix="choose another -o, or pass --force to replace it")
    conv = ModuleConverter(source, plan, fast_paths() if use_fast_paths else {})
    source.prefetch()
    try:
        if plan.target in GGUF_IDS:
            _write_gguf(source, plan, conv, report, on_progress)
        else:
            _write_hf(source, plan, conv, report, on_progress)
    finally:
        source.close()
    report.written = True
    report.seconds = time.perf_counter() - t0
    return report


# --- one module --------------------------------------------------------------------------------------------
class ModuleConverter:
    """Converts one source module to the target's tensors, following its ModulePlan."""

    def __init__(self, source, plan: RepackPlan, fast: dict):
        from qtool.formats import get_format

        self.source, self.plan, self.fast = source, plan, fast
        self.dst = get_format(plan.target)
        self.rows: dict = {}  # module -> output row order (GGUF -> Hugging Face q/k rows)

    def source_plain(self, m):
        """The module's canonical Plain (None for GGUF types readable only by dequantizing)."""
        if m.scheme.format.startswith("gguf:"):
            return None
        p = unpack_module(self.source, m)  # a format's error names the file and the module's tensor
        if "format" not in p.meta:
            p = p.with_(meta={**p.meta, "format": m.scheme.format})
        return p

    def source_weight(self, m, plain):
        """float32 [O, I]: the source's dequantized weight (what its engine computes, widened)."""
        import torch

        from qtool.formats import dequantize

        if plain is not None:
            return dequantize(plain, torch.float32)
        from qtool.formats.gguf_blocks import dequantize_any

        return dequantize_any(self.source.load(m)["weight"], m.scheme.format, m.name, fix="--exclude this module")

    def scratch_words(self, m, mp: ModulePlan) -> int:
        """int32 elements of a reusable output buffer worth handing to `convert` for this module: the source's
        packed weight size (a direct path's output without padding has as many) when a direct path that
        takes `out` applies and the weight is large; else 0."""
        fn = self.fast.get((m.scheme.format, self.dst.spec.id))
        if fn is None or not mp.relayout or mp.steps or not _takes_out(fn) \
                or self.source.container == "gguf" or "qweight" not in m.layout:
            return 0
        nbytes = self.source.tensor_nbytes(m.layout["qweight"])
        return nbytes // 4 if nbytes >= 1 << 20 else 0

    def convert(self, m, mp: ModulePlan, scratch=None) -> dict:
        """Target tensors {short name: tensor} (GGUF: {"weight": uint8 [O, row_bytes]}).

        scratch: optional reusable int32 buffer that a direct path may write its packed weight into (the
        result then views it: the caller must not reuse it before the result is written)."""
        from qtool.repack.scaled import convert as convert_scaled
        from qtool.repack.scaled import is_scaled

        if is_scaled(self.dst):
            return convert_scaled(self, m, mp)
        if mp.relayout and not mp.steps and m.name not in self.rows:
            fn = self.fast.get((m.scheme.format, self.dst.spec.id))
            if fn is not None:
                kw = {"out": scratch} if scratch is not None and _takes_out(fn) else {}
                out = fn(self.source.load(m, mapped=True), m.scheme, m.scheme.format, self.dst.spec.id, **kw)
                if out is not None:
                    mp.fast = True
                    return out
        if mp.relayout:
            return self._relayout(m, mp, self.source_plain(m))
        try:
            plain = None if m.scheme.format.startswith("gguf:") else self.source_plain(m)
        except NotRepresentable:  # e.g. GGUF Q4_1 offsets: no Plain, but the blocks still dequantize
            plain = None
        return self._requantize(m, mp, plain)

    def _relayout(self, m, mp: ModulePlan, plain) -> dict:
        plain = apply_steps(plain, mp)
        if m.name in self.rows:
            from qtool.repack.interop import permute_plain_rows

            plain = permute_plain_rows(plain, self.rows[m.name])
        if self.dst.spec.id in GGUF_IDS:
            raw, why = self.dst.encode(plain)  # the check and the bytes in one pass
            if raw is not None:
                return {"weight": raw}
        else:
            why = self.dst.check(plain)
        if why:
            raise NotRepresentable(
                f"{m.name}: planned as {mp.kind} from the header ({mp.src.format} {mp.src.bits}-bit, sym={mp.src.sym}, "
                f"desc_act={mp.src.desc_act}) but the data cannot be stored as {self.dst.spec.id}: {'; '.join(why)}; "
                "nothing was written", tensor=m.name,
                fix="the config misdescribes this module; rerun with --allow-lossy or --exclude it")
        return self._pack(plain)

    def _pack(self, plain) -> dict:
        if self.dst.spec.id == "ct":
            # the config written says compressed-tensors >= 0.18, whose readers expect the dense packing
            return self.dst.pack(plain, packing="dense")
        return self.dst.pack(plain)

    def _requantize(self, m, mp: ModulePlan, plain) -> dict:
        import torch

        from qtool.formats import dequantize
        w = self.source_weight(m, plain)
        if m.name in self.rows:
            w = w[self.rows[m.name]]
        ref = w.to(torch.float64)
        if self.dst.spec.id in GGUF_IDS:
            import gguf

            from qtool.formats.gguf_blocks import dequantize_blocks

            qt = gguf.GGMLQuantizationType[type_name(self.dst.spec.id)]
            raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), qt).copy())
            got = dequantize_blocks(raw, self.dst.spec.id).to(torch.float64)
            out = {"weight": raw}
        else:
            from qtool.quant import quantize, scale_underflow

            sdt = plain.scales.dtype if plain is not None and plain.scales.dtype in (torch.float16,
                                                                                    torch.bfloat16) else torch.float16
            q = quantize(w, mp.to_bits, mp.to_group_size, bool(mp.to_sym), method=self.plan.job.method,
                         scale_dtype=sdt, name=m.name)
            why = self.dst.check(q)
            if why and not mp.to_sym:  # e.g. a zero point the target cannot store: symmetric never has one
                q2 = quantize(w, mp.to_bits, mp.to_group_size, True, method=self.plan.job.method,
                              scale_dtype=sdt, name=m.name)
                if not self.dst.check(q2):
                    q, why, mp.to_sym = q2, [], True
            q = q.with_(meta={**q.meta, "format": m.scheme.format})
            if why:
                raise NotRepresentable(f"{m.name}: requantized weight still cannot be stored as {self.dst.spec.id}: "
                                       + "; ".join(why), tensor=m.name, fix="--exclude this module")
            lost = scale_underflow(w, q)  # a group zeroed by its scale's dtype raises nothing: say so
            if lost is not None:
                self.plan.warnings.append(f"{m.name}: " + lost.message(
                    "repack writes the source's scale dtype where it is fp16 or bf16, fp16 otherwise; --exclude this "
                    "module to keep it as it is"))
            got = dequantize(q, torch.float64)
            out = self._pack(q)
        diff = got - ref
        mp.max_error = float(diff.abs().max()) if diff.numel() else 0.0
        mp.rel_error = float(torch.linalg.vector_norm(diff) / max(float(torch.linalg.vector_norm(ref)), 1e-300))
        return out


_TAKES_OUT: dict = {}


def _takes_out(fn) -> bool:
    if fn not in _TAKES_OUT:
        import inspect

        _TAKES_OUT[fn] = "out" in inspect.signature(fn).parameters
    return _TAKES_OUT[fn]


class ScratchPool:
    """A few reusable int32 buffers for direct conversions' packed weights. Fresh memory costs a page fault
    and a zeroed page per 4 KiB on first touch — on a 2-core machine that was a third of the conversion time
    — so each buffer is taken for one module and handed back by the writer thread once that module is
    written. `count` bounds both the memory (count x the largest packed weight) and how far conversion may
    run ahead of writing."""

    def __init__(self, count: int = 3):
        import queue

        self._free: queue.Queue = queue.Queue()
        for _ in range(count):
            self._free.put(None)

    def take(self, words: int):
        """An int32 buffer of at least `words` elements (blocks until one is free)."""
        import torch

        buf = self._free.get()
        if buf is None or buf.numel() < words:
            buf = torch.empty(words, dtype=torch.int32)
        return buf

    def give(self, buf) -> None:
        self._free.put(buf)


# --- Hugging Face directory targets -------------------------------------------------------------------------
def _target_metadata(plan: RepackPlan) -> dict[str, str]:
    from qtool import __version__

    conv = [m for m in plan.modules if m.converts]
    meta = {"qtool.version": __version__, "qtool.format": plan.target, "qtool.repack.source": plan.source_format}
    for key, attr in (("qtool.bits", "to_bits"), ("qtool.group_size", "to_group_size")):
        vals = {getattr(m, attr) for m in conv}
        if len(vals) == 1 and None not in vals:
            meta[key] = str(vals.pop())
    if plan.target == "marlin":
        from qtool.formats import marlin

        metas = {m.module: m.target_meta for m in conv if m.target_meta}
        if metas:
            meta.update(marlin.contract(marlin.summarize(metas)))
    return meta


def _write_hf(source, plan: RepackPlan, conv: ModuleConverter, report: RepackReport, on_progress) -> None:
    from qtool.io.writer import BackgroundWriter, ShardedWriter, atomic_output, parse_size, write_json

    by_first, skip = _module_order(source)
    plans = {m.module: m for m in plan.modules}
    total = len(source.order)
    dropped = plan.dropped
    pool = ScratchPool()
    from qtool.repack.interop import hf_view

    g2h = hf_view(source)
    if g2h is not None:
        conv.rows = {m.name: r for m in source.modules if (r := g2h.rows(m.layout["weight"])) is not None}
    rn = g2h.name if g2h else (lambda n: n)

    def gguf_tensor(name: str):
        t = source.get(name) if source.tensor_info(name).type_name in ("F32", "F16", "BF16") else \
            source.gguf_bytes(name)
        r = g2h.rows(name)
        return t if r is None else t[r]

    replacing = plan.out.exists() or plan.out.is_symlink()  # then the output is fsynced before the swap
    with atomic_output(plan.out, plan.job.force) as tmp:
        # a converted module writes at most 6 tensors (marlin: qweight, scales, qzeros, g_idx, perm, shape)
        with BackgroundWriter(ShardedWriter(tmp, parse_size(plan.job.max_shard_size), _target_metadata(plan),
                                            expected_tensors=len(source.order) + 6 * len(plans),
                                            writeback=replacing)) as w:
            for k, name in enumerate(source.order):
                if on_progress:
                    on_progress(name, k, total)
                m = by_first.get(name)
                if m is None:
                    if name in skip or name in dropped or (g2h and name in g2h.folded):
                        continue
                    if g2h:
                        w.add(rn(name), gguf_tensor(name))
                    else:
                        w.add_raw(name, source.tensor_info(name))
                    continue
                mp = plans[m.name]
                if mp.copy:
                    for full in m.layout.values():
                        if g2h:
                            w.add(rn(full), gguf_tensor(full))
                        else:
                            w.add_raw(full, source.tensor_info(full))
                    continue
                if mp.kind == "keep":  # GGUF module outside the blocks: dense, exact float32
                    wt = conv.source_weight(m, None)
                    r = g2h.rows(m.layout["weight"])
                    w.add(rn(m.layout["weight"]), (wt if r is None else wt[r]).contiguous())
                    continue
                words = conv.scratch_words(m, mp)
                buf = pool.take(words) if words else None
                out_mod = g2h.module(m.name) if g2h else m.name
                w.add_many([(f"{out_mod}.{short}" if out_mod else short, t)
                            for short, t in conv.convert(m, mp, scratch=buf).items()])
                if buf is not None:
                    w.after_written(lambda b=buf: pool.give(b))
        files = w.files
        report.files = [f.name for f in files]
        report.bytes_out = sum(f.stat().st_size for f in files)
        base_cfg = None
        if g2h:
            plan.warnings.extend(g2h.write_files(tmp))
            plan.warnings.extend(g2h.warnings())
            base_cfg = getattr(g2h, "config", None)
            if conv.rows:
                plan.warnings.append(f"{len(conv.rows)} q/k modules: rows put back from llama.cpp's rotary pair "
                                     "order into transformers' (exact)")
        _write_configs(tmp, source, plan, conv.dst, (g2h.module if g2h else None), base_cfg)
        from qtool.io.writer import copy_extras

        subdirs = source._ck.sub_directories() if source._ck is not None else []
        left_out = source._ck.left_out_files() if source._ck is not None else []
        plan.warnings.extend(copy_extras(source.other_files, source.root, tmp, subdirs, left_out))
        write_json(tmp / "qtool_repack.json", report.to_dict() | {"written": True})
    if on_progress:
        on_progress("", total, total)


def _module_order(source):
    """{first layout tensor name: module}, and the other layout tensor names (written with their module)."""
    by_first, skip = {}, set()
    position = {n: k for k, n in enumerate(source.order)}
    for m in source.modules:
        names = sorted((n for n in m.layout.values() if n in position), key=position.__getitem__)
        if names:
            by_first[names[0]] = m
            skip.update(names[1:])
    return by_first, skip


def _write_configs(tmp: Path, source, plan: RepackPlan, dst, rename=None, base: dict | None = None) -> None:
    """config.json (the source's, or `base`) with the target format's quantization_config (and
    quantize_config.json, which GPTQ/AWQ loaders also read); `rename` gives a module's output name (GGUF
    sources)."""
    from qtool.io.writer import write_json

    conv = [m for m in plan.modules if m.converts]
    if rename is not None:
        from qtool.repack.interop import renamed

        conv = renamed(conv, rename)
    modules = [(m.module, m.target_scheme(), m.target_meta) for m in conv]
    from qtool.repack.scaled import dense_linears

    dense = dense_linears(source, plan)
    qcfg = dst.quantization_config(modules, dense=dense)
    if qcfg is not None and qcfg.get("quant_method") in ("gptq", "awq"):
        from qtool.io.hf_gguf import loader_keys

        qcfg.update(loader_keys(plan.target, [m.module for m in conv], dense))
    cfg = dict(base if base is not None else source.config or {})
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    write_json(tmp / "config.json", cfg)
    if qcfg is not None and qcfg.get("quant_method") in ("gptq", "awq"):
        write_json(tmp / "quantize_config.json", qcfg)


# --- GGUF targets -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertStack:
    """The experts of one mixture-of-experts projection (`...experts.{e}.gate_proj`), which llama.cpp holds as
    one [E, O, I] tensor named by the gguf package's map for `...experts.gate_proj`."""

    name: str  # the merged Hugging Face name, without .weight
    experts: tuple  # the source modules, by expert index


def expert_stacks(modules, shapes: dict[str, tuple[int, int]]) -> dict[str, ExpertStack]:
    """{module name: its ExpertStack} for modules named `P.experts.{e}.R` where experts 0..E-1 are all present
    with one [O, I] shape (`shapes`, by module name: the converter's merge); others are left as they are (and
    reported unmapped)."""
    from qtool.io.checkpoint import EXPERT_MODULE

    groups: dict[str, dict[int, object]] = {}
    for m in modules:
        hit = EXPERT_MODULE.match(m.name)
        if hit:
            groups.setdefault(f"{hit['parent']}.experts.{hit['role']}", {})[int(hit["e"])] = m
    out = {}
    for name, by_e in groups.items():
        shapes_of = {tuple(shapes[m.name]) for m in by_e.values()}
        if sorted(by_e) == list(range(len(by_e))) and len(shapes_of) == 1:
            stack = ExpertStack(name, tuple(by_e[e] for e in sorted(by_e)))
            out.update({m.name: stack for m in stack.experts})
    return out


def _write_gguf(source, plan: RepackPlan, conv: ModuleConverter, report: RepackReport, on_progress) -> None:
    import gguf
    import torch

    from qtool.formats import dequantize
    from qtool.formats.gguf_blocks import BLOCKS
    from qtool.io.gguf_writer import (
        GGUFTensorSpec,
        NameMap,
        carried_kv,
        name_mapper,
        resolve_arch,
        write_gguf,
    )
    from qtool.io.hf_gguf import blocks_present, rotary_heads, rotary_rows, skip_reason
    from qtool.io.writer import atomic_output
    from qtool.repack.interop import encode_as, module_weight, type_nbytes

    gguf_src = source.container == "gguf"
    arch = resolve_arch(source.config, source.architecture if gguf_src else None)
    # GGUF names stay as they are; Hugging Face names are mapped for the blocks their tensors number (a
    # block count claimed by a file never sizes the map)
    mapped = NameMap() if gguf_src else name_mapper(arch, blocks_present(source.order, source.path))
    cfg = source.config or {}
    n_head, n_kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    by_first, skip = _module_order(source)
    plans = {m.module: m for m in plan.modules}
    nbytes_blk, _, tname = BLOCKS[plan.target]
    specs, jobs, rows = [], [], []
    dropped = plan.dropped
    _ST_GGML = {"F32": "F32", "F16": "F16", "BF16": "BF16", "I32": "I32", "I64": "I64", "I8": "I8", "I16": "I16"}
    float_types = plan.float_types

    def left_out(name: str) -> bool:
        why = None if gguf_src else skip_reason(arch, name)
        if why:
            plan.warnings.append(f"{name}: left out of the GGUF: {why}")
        return why is not None

    def add(spec, job):
        specs.append(spec)
        jobs.append(job)
        heads = None if gguf_src else rotary_heads(arch, spec.name, n_head, n_kv)
        rows.append(None if heads is None else rotary_rows(spec.shape[0], heads, True, spec.name))

    stacks = {} if gguf_src else expert_stacks([m for m in by_first.values() if m.name in plans],
                                               {n: tuple(p.shape) for n, p in plans.items()})
    stacked: set[str] = set()

    def module_job(m, mp, shp):
        """(GGML type, bytes, data job) of one module's tensor, written with dims `shp`; a "dense" job is the
        module kept out of the conversion, which its caller reports."""
        own = (mp.target_meta or {}).get("gguf_type")
        if own:  # --tensor-type: the module in its own GGML type
            return own, type_nbytes(own, shp), ("encode", m, own)
        if mp.copy and gguf_src:
            info = source.tensor_info(m.layout["weight"])
            return info.type_name, info.nbytes, ("raw", m.layout["weight"], None)
        if mp.kind == "keep":
            # GGUF cannot hold the source's packed layout: the float tensor its dequantization gives
            sd = mp.target_meta["dense_type"]  # plan_gguf_types chose it
            o, i = mp.shape
            return sd, o * i * (4 if sd == "F32" else 2), ("dense", m, mp)
        o, i = mp.shape  # all rows: a GGUF stack's [E, O/E, I] too
        return tname, o * (i // 32) * nbytes_blk, ("convert", m, mp)

    for name in source.order:
        m = by_first.get(name)
        if m is not None and m.name in stacks:
            stack = stacks[m.name]
            if stack.name in stacked:
                continue
            stacked.add(stack.name)
            parts = [module_job(e, plans[e.name], tuple(plans[e.name].shape)) for e in stack.experts]
            if len({p[0] for p in parts}) > 1:
                raise InputError(f"the experts of '{stack.name}' would be written in several GGML types "
                                 f"({', '.join(sorted({p[0] for p in parts}))}), and llama.cpp holds them in one "
                                 "tensor", path=source.path, fix="give all experts of a layer one --tensor-type")
            kept = sum(p[2][0] == "dense" for p in parts)
            if kept:
                plan.warnings.append(f"{stack.name}: {kept} of {len(parts)} experts kept out of the conversion; "
                                     f"written dequantized as {parts[0][0]}")
            o, i = plans[m.name].shape
            add(GGUFTensorSpec(mapped(f"{stack.name}.weight"), (len(parts), o, i), parts[0][0],
                               sum(p[1] for p in parts)), ("stack", [p[2] for p in parts], None))
            continue
        if m is None:
            if name in skip or name in dropped or left_out(name):
                continue
            info = source.tensor_info(name)
            if gguf_src and name in float_types:
                shape = tuple(reversed(info.shape))
                add(GGUFTensorSpec(name, shape, float_types[name], type_nbytes(float_types[name], shape)),
                    ("encode_raw", name, float_types[name]))
            elif gguf_src:
                add(GGUFTensorSpec(name, tuple(reversed(info.shape)), info.type_name, info.nbytes), ("raw", name, None))
            elif name in float_types:
                add(GGUFTensorSpec(mapped(name), tuple(info.shape), float_types[name],
                                   type_nbytes(float_types[name], tuple(info.shape))), ("encode_raw", name,
                                                                                     float_types[name]))
            elif len(info.shape) <= 1 and info.dtype in ("F16", "BF16"):
                # llama.cpp's binary ops (the norms' multiply, the biases' add) take F32 operands only; the
                # widening is exact
                add(GGUFTensorSpec(mapped(name), tuple(info.shape), "F32", 4 * info.numel), ("f32", name, None))
            elif info.dtype in _ST_GGML:
                add(GGUFTensorSpec(mapped(name), tuple(info.shape), _ST_GGML[info.dtype], info.nbytes),
                    ("raw", name, None))
            else:
                plan.warnings.append(f"{name}: dtype {info.dtype} has no GGUF type; left out")
            continue
        mp = plans[m.name]
        o, i = mp.shape
        if mp.dropped and set(m.layout.values()) <= set(mp.dropped):  # left out (plan_gguf_types says why)
            continue
        out_name = mapped(f"{m.name}.weight") if not gguf_src else f"{m.name}.weight"
        # a module is its rows [O, I]; a GGUF source's tensor keeps its own dims (3-D expert stacks [E, O/E, I])
        shp = tuple(reversed(source.tensor_info(m.layout["weight"]).shape)) if gguf_src else (o, i)
        gtype, nbytes, job = module_job(m, mp, shp)
        if job[0] == "dense":
            plan.warnings.append(f"{m.name}: kept out of the conversion; written dequantized as {gtype}")
        add(GGUFTensorSpec(out_name, shp, gtype, nbytes), job)
    if any(r is not None for r in rows):
        plan.warnings.append(f"{sum(r is not None for r in rows)} q/k tensors: rows reordered into llama.cpp's "
                             "rotary pair order (exact; transformers reorders them back on load)")
    if stacked:
        plan.warnings.append(f"{sum(m in stacks for m in plans)} expert modules written as "
                             f"{len(stacked)} [experts, out, in] stacks, llama.cpp's layout (their blocks in "
                             "expert order, byte for byte)")
    unmapped = mapped.unmapped
    if unmapped:
        plan.warnings.append(f"{len(unmapped)} tensors have no llama.cpp name for {arch} (e.g. '{unmapped[0]}'): "
                             "written under their own names, which llama.cpp refuses (wrong number of tensors)")

    tdt = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}

    def tensor(kind, a, mp, type_name):
        if kind == "raw":
            t = source.gguf_bytes(a) if gguf_src else source.get(a)
            return t.contiguous().view(torch.uint8) if t.dtype == torch.bfloat16 else t
        if kind == "f32":
            return source.get(a).float()
        if kind == "array":
            return torch.from_numpy(a)
        if kind == "dense":
            w = dequantize(conv.source_plain(a), tdt[type_name])
            return w.view(torch.uint8) if w.dtype == torch.bfloat16 else w
        if kind in ("encode", "encode_raw"):
            w = module_weight(conv, a) if kind == "encode" else source.get(a).float()
            return torch.from_numpy(encode_as(w, mp)[0].copy())
        if kind == "stack":
            return torch.stack([tensor(*job, type_name) for job in a])
        return conv.convert(a, mp)["weight"]

    def data():
        for k, (kind, a, mp) in enumerate(jobs):
            if on_progress:
                on_progress(specs[k].name, k, len(jobs))
            t = tensor(kind, a, mp, specs[k].type_name)
            if rows[k] is not None:
                t = t[rows[k]]
            yield t.numpy()

    kv = carried_kv(source.gguf_header) if gguf_src else []
    extra: dict = {}
    if not gguf_src and arch:
        from qtool.io.hf_gguf import arch_row, hf_metadata, rope_factors

        n_vocab = next((s.shape[0] for s in specs if s.name == "token_embd.weight"), None)
        extra, warns = hf_metadata(arch, cfg, source.root, n_vocab)
        plan.warnings.extend(warns)
        if arch_row(arch) is None:
            plan.warnings.append(f"architecture {arch}: qtool writes the hyperparameters every llama.cpp graph "
                                 f"reads, not those only {arch}'s reads, nor its row orders; check that llama.cpp "
                                 "loads the file")
        factors = rope_factors(arch, cfg)
        if factors is not None:
            add(GGUFTensorSpec("rope_freqs.weight", (len(factors),), "F32", 4 * len(factors)), ("array", factors, None))
            plan.warnings.append("rope_freqs.weight: llama3 RoPE scaling written as llama.cpp's per-frequency factors")
    elif not gguf_src:
        plan.warnings.append("architecture unknown (config.json model_type): the GGUF has no hyperparameters or "
                             "tokenizer, and llama.cpp will not load it")
    name = None if gguf_src else cfg.get("_name_or_path") or Path(source.path).name
    with atomic_output(plan.out, plan.job.force, directory=False, need_bytes=sum(s.nbytes for s in specs)) as tmp:
        write_gguf(tmp, arch or "unknown", specs, data(), gguf.LlamaFileType[f"MOSTLY_{type_name(plan.target)}"], kv,
                   [], name=name if isinstance(name, str) else None, extra=extra)
    report.files = [plan.out.name]
    report.bytes_out = plan.out.stat().st_size
    if on_progress:
        on_progress("", len(jobs), len(jobs))
