"""`qtool pack`: quantize the linear weights of a dense safetensors model into a packed layout.

One tensor at a time: read W, quantize to a Plain, pack with the target format, stream the packed
tensors to the output, measure ‖W − Ŵ‖/‖W‖ with the shared dequantizer. Everything else is copied byte for
byte; other files of the source directory (tokenizer, ...) are copied.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from qtool.errors import InputError, QtoolError, UsageError
from qtool.formats.gptq import LM_HEAD, is_lm_head, majority
from qtool.io.checkpoint import Checkpoint, open_checkpoint
from qtool.io.memory import available_bytes
from qtool.io.safetensors_header import TensorInfo
from qtool.scheme import QuantScheme
from qtool.spec import INT32_MAX

PACK_FORMATS = ("gptq", "gptq_v2", "gptq_p", "awq", "fp8", "ct_fp8", "ct_int8", "nvfp4", "modelopt_nvfp4", "mxfp4",
                "mxfp8", "gptoss_mxfp4")
# Layouts whose codes are numbers of their own element type (qtool.formats.scaled): --strategy/--block apply.
SCALED_PACK = {"fp8": "e4m3", "ct_fp8": "e4m3", "ct_int8": "int8", "nvfp4": "e2m1", "modelopt_nvfp4": "e2m1",
               "mxfp4": "e2m1", "mxfp8": "e4m3", "gptoss_mxfp4": "e2m1"}
# ... of which these quantize with qtool.quant.fp4 (E2M1 codes, E4M3 scales under a global scale, E8M0 scales)
MICRO_PACK = ("nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4")
# code width of each scaled layout (the --bits default; anything else is refused)
SCALED_BITS = {"nvfp4": 4, "modelopt_nvfp4": 4, "mxfp4": 4, "gptoss_mxfp4": 4}
STRATEGIES = ("tensor", "channel", "group", "block")
METHODS = ("rtn", "mse", "gptq", "awq")
CALIBRATED = ("gptq", "awq")
# --calib-dtype: the torch dtype the gptq calibration forward runs in
CALIB_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Names of 2-D weights that are not linear layers, or that engines keep dense by convention.
# transformers' model types whose projections are pytorch_utils.Conv1D (weight [in, out], y = x @ W + b)
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})

_SKIP_PATTERNS = (
    (re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|position_embeddings|"
                r"token_type_embeddings|tok_embeddings|embed_positions|shared)(\.|$)"), "embedding"),
    (LM_HEAD, "lm_head"),
    # T5's relative position bias is an embedding table (nn.Embedding), not a linear weight
    (re.compile(r"(^|\.)relative_attention_bias(\.|$)"), "embedding"),
    (re.compile(r"(norm|ln_|layernorm|LayerNorm)", re.IGNORECASE), "norm"),
    # outside an encoder's blocks: transformers' GPTQ path quantizes only inside block_name_to_quantize and
    # would leave a packed pooler randomly initialised; llama.cpp does not load it at all
    (re.compile(r"(^|\.)pooler(\.|$)"), "pooler"),
)



@dataclass(frozen=True)
class TypeRule:
    """--tensor-type REGEX=BITS[:GROUP]: modules matching REGEX get these bits (and group size)."""

    pattern: re.Pattern
    bits: int
    group_size: int | None

    @staticmethod
    def parse(text: str) -> TypeRule:
        regex, sep, spec = text.rpartition("=")
        if not sep or not regex:
            raise UsageError(f"--tensor-type '{text}' is not REGEX=BITS[:GROUP]", fix="e.g. 'mlp\\.down=8:64'")
        bits_s, _, group_s = spec.partition(":")
        try:
            bits = int(bits_s)
            group = int(group_s) if group_s else None
        except ValueError:
            raise UsageError(f"--tensor-type '{text}': BITS and GROUP must be integers") from None
        return TypeRule(_compile(regex, "--tensor-type"), bits, group)


def _compile(regex: str, flag: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as e:
        raise UsageError(f"{flag} '{regex}' is not a valid regular expression ({e})") from None


@dataclass(frozen=True)
class PackJob:
    src: Path
    out: Path
    to: str = "gptq"
    bits: int = 4
    group_size: int = 128
    sym: bool | None = None  # None: the target's convention (resolve_sym)
    method: str = "rtn"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    tensor_types: tuple[str, ...] = ()
    dtype: str = "fp16"
    max_shard_size: str = "4GB"
    force: bool = False
    dry_run: bool = False
    # calibrated methods (gptq, awq): qtool.quant.calib
    calib: Path | None = None  # text or .jsonl; None = the default text (qtool.quant.calib_text)
    calib_samples: int = 128
    calib_seqlen: int = 256
    calib_seed: int = 0  # the windows' random offsets
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = False
    damp: float | None = None  # gptq dampening fraction; None: qtool.quant.gptq.DAMP
    mse: bool | None = None  # gptq: clip-searched group scales; None: qtool.quant.gptq.MSE
    calib_dtype: str | None = None  # gptq: "bf16"/"fp16"/"fp32" for the calibration forward; None: as loaded
    device: str | None = None  # None: cuda when present, else cpu
    eval: bool = False  # run `qtool eval` against the source at the end; its numbers go into report.md
    # fp8 / ct_fp8 / ct_int8: the scale strategy (None: the layout's default) and the block of --strategy block
    strategy: str | None = None
    block: str | None = None  # "128x128"


@dataclass
class ModulePlan:
    """One 2-D weight and what pack will do with it: `scheme` is the quantization a "quantize" module gets
    (None for "keep"). Serialized flat (`to_dict`), the scheme's bits and group_size beside the rest."""

    module: str
    weight: str
    shape: tuple[int, int]  # [out_features, in_features]
    action: str  # "quantize" | "keep"
    reason: str = ""
    scheme: QuantScheme | None = None

    @property
    def bits(self) -> int | None:
        return self.scheme.bits if self.scheme else None

    @property
    def group_size(self) -> int | None:
        return self.scheme.group_size if self.scheme else None

    def to_dict(self) -> dict:
        return {"module": self.module, "weight": self.weight, "shape": list(self.shape), "action": self.action,
                "reason": self.reason, "bits": self.bits, "group_size": self.group_size}


@dataclass
class TensorResult:
    module: str
    shape: list[int]
    bits: int
    group_size: int
    bytes_before: int
    bytes_after: int
    bpw: float
    rel_error: float


@dataclass
class PackReport:
    src: str
    out: str
    format: str
    method: str
    sym: bool
    dtype: str
    dry_run: bool
    plan: list[ModulePlan] = field(default_factory=list)
    results: list[TensorResult] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    calibration: dict | None = None  # gptq/awq: data, settings and the per-layer losses
    evaluation: dict | None = None  # pack --eval: qtool.evaluate's report

    @property
    def quantized(self) -> list[TensorResult]:
        return self.results

    def totals(self) -> dict:
        qb = sum(r.bytes_before for r in self.results)
        qa = sum(r.bytes_after for r in self.results)
        n = sum(r.shape[0] * r.shape[1] for r in self.results)
        err = 0.0
        if self.results:
            # weight-count weighted mean of the per-tensor relative errors
            err = sum(r.rel_error * r.shape[0] * r.shape[1] for r in self.results) / max(n, 1)
        return {"modules_quantized": len(self.results),
                "modules_kept": sum(1 for p in self.plan if p.action == "keep"),
                "quantized_bytes_before": qb, "quantized_bytes_after": qa,
                "bpw": (8 * qa / n) if n else 0.0, "rel_error_mean": err,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def to_dict(self) -> dict:
        d = {"src": self.src, "out": self.out, "format": self.format, "method": self.method, "sym": self.sym,
             "dtype": self.dtype, "dry_run": self.dry_run,
             "plan": [p.to_dict() for p in self.plan], "tensors": [asdict(r) for r in self.results],
             "totals": self.totals(), "files": self.files, "notes": self.notes, "warnings": self.warnings}
        # only calibrated or evaluated packs carry these keys, so other reports keep their bytes
        if self.calibration is not None:
            d["calibration"] = self.calibration
        if self.evaluation is not None:
            d["evaluation"] = self.evaluation
        return d


AWQ_ASYM_NOTE = "AWQ: asymmetric by convention (zero points); --sym writes symmetric AWQ"
AWQ_SYM_WARNING = ("symmetric AWQ (--sym): vLLM's AWQ path refuses it on CUDA and AWQ readers expect zero points; "
                   "drop --sym for the asymmetric convention")


def resolve_sym(to: str, sym: bool | None) -> tuple[bool, list[str], list[str]]:
    """(sym, notes, warnings) for a target: AWQ checkpoints are zero-point by convention, GPTQ's are symmetric
    by default; an explicit --sym/--asym wins, and symmetric AWQ is written with a warning."""
    if to == "awq":
        if sym is None:
            return False, [AWQ_ASYM_NOTE], []
        return sym, [], [AWQ_SYM_WARNING] if sym else []
    return (True if sym is None else sym), [], []


def plan_modules(ck: Checkpoint, job: PackJob) -> list[ModulePlan]:
    """Decide, per 2-D float weight, whether to quantize it (and at which bits/group) or keep it dense."""
    from qtool.formats import get_format

    fmt = get_format(job.to)
    incl = [_compile(r, "--include") for r in job.include]
    excl = [_compile(r, "--exclude") for r in job.exclude]
    rules = [TypeRule.parse(t) for t in job.tensor_types]
    model_type = (ck.config or {}).get("model_type")
    if model_type in CONV1D_MODEL_TYPES:
        raise InputError(f"model_type '{model_type}' keeps its projections in transformers' Conv1D, weights [in, "
                         "out]; qtool packs linear weights [out, in], and would scale and group them along the "
                         "wrong axis", path=ck.path, fix="convert the Conv1D weights to linear ones ([out, in]) "
                                                        "first; nothing was written")
    plans = []
    from qtool.inspect.detect import moe_routers

    routers = moe_routers(ck.tensors)
    for name, info in ck.tensors.items():
        if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
            continue
        module = name[: -len(".weight")]
        o, i = info.shape
        plan = ModulePlan(module, name, (o, i), "quantize")
        if o == 0 or i == 0:
            # Nothing to quantize: carried through byte for byte, whatever --include says.
            plan.action, plan.reason = "keep", f"empty weight [{o}, {i}]: nothing to quantize"
            plans.append(plan)
            continue
        skip = next((why for pat, why in _SKIP_PATTERNS if pat.search(module)), None)
        if skip is None and module in routers:
            skip = "mixture-of-experts router"
        if incl:
            if not any(r.search(module) for r in incl):
                plan.action, plan.reason = "keep", "not matched by --include"
            elif skip:
                skip = None  # an explicit include wins over the default skips
        if plan.action == "quantize" and skip:
            plan.action, plan.reason = "keep", f"{skip} (kept dense by default; --include it to quantize)"
        if plan.action == "quantize" and any(r.search(module) for r in excl):
            plan.action, plan.reason = "keep", "matched by --exclude"
        bias = ck.tensors.get(module + ".bias")
        if plan.action == "quantize" and bias is not None and len(bias.shape) == 1 and bias.shape[0] == i != o:
            raise InputError(f"its bias has {i} entries, the weight's second dimension, not {o}: the weight is "
                             "stored [in, out] (a Conv1D), and packing it as [out, in] would quantize along the "
                             "wrong axis", path=ck.path, tensor=name,
                             fix="convert it to a linear weight ([out, in]) first, or --exclude it; nothing was "
                                 "written")
        if plan.action == "quantize":
            bits, group = job.bits, job.group_size
            origin = {"bits": "--bits", "group": "--group-size"}  # named where a value is refused
            for r, text in zip(rules, job.tensor_types):
                if r.pattern.search(module):
                    bits, group = r.bits, (r.group_size if r.group_size is not None else group)
                    origin["bits"] = f"--tensor-type '{text}'"
                    if r.group_size is not None:
                        origin["group"] = origin["bits"]
            plan.scheme = QuantScheme(job.to, bits, group, job.sym, job.method == "gptq" and job.act_order)
            _check_module(fmt, plan, ck, origin)
        plans.append(plan)
    return plans


def stacked_weights_note(ck: Checkpoint) -> list[str]:
    """A warning naming the float tensors of 3 or more dimensions, which pack copies as they are: its formats
    hold 2-D linear weights, and a 3-D one is most often a mixture-of-experts stack stored fused (gpt-oss's
    `mlp.experts.gate_up_proj` [E, H, 2I]), the bulk of such a model's weights."""
    big = [(n, i) for n, i in ck.tensors.items() if len(i.shape) >= 3 and i.dtype in FLOAT_DTYPES]
    if not big:
        return []
    n, i = big[0]
    share = sum(t.nbytes for _, t in big) / max(ck.total_bytes, 1)
    return [f"{len(big)} float tensor(s) of 3 or more dimensions ({share:.0%} of the bytes) copied dense, the first "
            f"'{n}' {list(i.shape)}: pack quantizes 2-D linear weights, so fused expert stacks stay as they are"]


def _check_module(fmt, plan: ModulePlan, ck: Checkpoint, origin: dict[str, str]) -> None:
    """Refuse a module its layout cannot hold; `origin` names the option each of its bits and group size came
    from ({"bits": "--bits", "group": "--tensor-type '...'"}), so a value a --config file set is traced."""
    from qtool.formats import Plain

    o, i = plan.shape
    b, g = plan.bits, plan.group_size
    where = dict(path=ck.path, tensor=plan.weight)
    if b not in fmt.spec.bits:
        raise UsageError(f"{fmt.spec.id} cannot hold {b}-bit codes ({origin['bits']})",
                         fix=f"use --bits in {list(fmt.spec.bits)} or another --to", **where)
    if g != -1 and (g <= 0 or i % g):
        if fmt.spec.id in MICRO_PACK:  # the layout's own group: no --group-size changes it
            raise UsageError(f"{fmt.spec.id}'s group of {g} does not divide in_features {i}",
                             fix="--exclude this module", **where)
        raise UsageError(f"group size {g} ({origin['group']}) does not divide in_features {i}",
                         fix="use a group size that divides it, -1, or --exclude this module", **where)
    # Layout divisibility: ask the format about a stand-in Plain of the real shape (no data, no memory).
    reasons = fmt.check(Plain.stand_in(o, i, b, g, sym=True))
    if reasons:
        raise UsageError("; ".join(reasons), fix="--exclude this module or choose another --to/--bits", **where)


def run_pack(job: PackJob, on_progress: Callable[[str, int, int], None] | None = None) -> PackReport:
    """Plan, then (unless dry_run) quantize, pack and write atomically. Returns the report."""
    import torch

    from qtool.formats import get_format
    from qtool.formats.plain import relative_error
    from qtool.io.writer import BackgroundWriter, ShardedWriter, atomic_output, parse_size
    from qtool.quant import quantize, scale_underflow

    if job.to not in PACK_FORMATS:
        raise UsageError(f"pack cannot write '{job.to}'", fix=f"choose --to from {', '.join(PACK_FORMATS)}")
    if job.method not in METHODS:
        raise UsageError(f"unknown --method '{job.method}'", fix="use rtn, mse, gptq or awq")
    if job.to in SCALED_PACK:
        return run_pack_scaled(job, on_progress)
    if job.strategy is not None or job.block is not None:
        raise UsageError(f"--strategy/--block apply to {', '.join(SCALED_PACK)}, not --to {job.to}",
                         fix="drop them, or use --group-size for the integer layouts")
    check_calibration_options(job)
    if not 2 <= job.bits <= 8:
        raise UsageError(f"--bits {job.bits} is outside 2..8")
    if job.dtype not in ("fp16", "bf16"):
        raise UsageError(f"--dtype {job.dtype} must be fp16 or bf16")
    scale_dtype = torch.float16 if job.dtype == "fp16" else torch.bfloat16
    max_shard = parse_size(job.max_shard_size)
    fmt = get_format(job.to)
    ck = open_checkpoint(job.src)
    if ck.quant_config is not None:
        raise InputError("the source is already quantized", path=ck.path,
                         fix="pack reads dense models; use `qtool repack` to convert quantized ones")
    sym, notes, warnings = resolve_sym(job.to, job.sym)
    job = replace(job, sym=sym)
    plans = plan_modules(ck, job)
    check_collisions(ck, plans, fmt)
    if job.to == "awq":
        check_awq_plan(ck, plans)
    warnings += [f"{p.weight}: {p.reason}; kept as it is" for p in plans if p.reason.startswith("empty weight")]
    warnings += ck.shard_notes() + stacked_weights_note(ck)
    report = PackReport(str(job.src), str(job.out), job.to, job.method, job.sym, job.dtype, job.dry_run, plans,
                        bytes_in=ck.total_bytes, notes=notes, warnings=warnings)
    to_quantize = {p.weight: p for p in plans if p.action == "quantize"}
    if not to_quantize:
        empty = [p for p in plans if p.reason.startswith("empty weight")]
        if empty:
            raise InputError(f"no linear weights to quantize: {len(empty)} empty weight(s), the first "
                             f"[{empty[0].shape[0]}, {empty[0].shape[1]}]", path=ck.path, tensor=empty[0].weight,
                             fix="pack needs at least one non-empty 2-D weight")
        raise UsageError("no linear weights to quantize", path=ck.path,
                         fix="check --include/--exclude; embeddings, lm_head and norms stay dense by default")
    if job.dry_run:
        return report
    check_memory(ck, to_quantize.values(), job.to)
    check_disk(ck, to_quantize, job.out)

    from qtool import __version__
    from qtool.io.writer import refuse_overwriting_input

    refuse_overwriting_input(job.src, job.out)
    meta = {"qtool.version": __version__, "qtool.format": job.to, "qtool.method": job.method}
    names = list(ck.tensors)
    calibrated = None
    if job.method in CALIBRATED:
        calibrated = _calibrate(ck, job, to_quantize, scale_dtype, report, on_progress)
    with atomic_output(job.out, job.force) as tmp:
        # every packed module writes at most 4 tensors in place of its weight
        with BackgroundWriter(ShardedWriter(tmp, max_shard, meta,
                                            expected_tensors=len(names) + 3 * len(to_quantize))) as w:
            for k, name in enumerate(names):
                info: TensorInfo = ck.tensors[name]
                if on_progress:
                    on_progress(name, k, len(names))
                plan = to_quantize.get(name)
                if plan is None:
                    if calibrated is not None and name in calibrated.dense_updates:
                        w.add(name, calibrated.dense_updates[name].to(ck.get(name).dtype))
                    else:
                        w.add_raw(name, info)
                    continue
                weight = ck.get(name)
                layer = calibrated.layers.get(name) if calibrated is not None else None
                if layer is not None:
                    p, err = layer.plain, layer.rel_error
                else:
                    try:
                        p = quantize(weight, plan.bits, plan.group_size, job.sym,
                                     method="rtn" if job.method in CALIBRATED else job.method,
                                     scale_dtype=scale_dtype, name=name)
                    except QtoolError as e:
                        raise _located(e, ck.path, name) from None
                    err = relative_error(weight, p)
                # a scale too small for its dtype zeroes its group (or blurs it) and raises nothing: say so,
                # once per tensor
                lost = scale_underflow(weight, p)
                if lost is not None:
                    report.warnings.append(f"{name}: {lost.message()}")
                _write_packed(w, fmt, p, plan, err, info, report, ck.path)
                del weight, p
        files = w.files
        report.bytes_out = sum(f.stat().st_size for f in files)
        report.files = [f.name for f in files]
        _write_configs(tmp, ck, job, plans, fmt)
        _finish(tmp, ck, job, report)
    if on_progress:
        on_progress("", len(names), len(names))
    return report


def _finish(tmp: Path, ck: Checkpoint, job: PackJob, report: PackReport) -> None:
    """The rest of an output beside its tensors and config: the source's other files, the --eval numbers,
    report.json and report.md."""
    from qtool.io.writer import copy_extras, write_json
    from qtool.report.pack import to_markdown

    report.warnings.extend(copy_extras(ck.other_files(), ck.root, tmp, ck.sub_directories(), ck.left_out_files()))
    if job.eval:
        from qtool.evaluate import evaluate

        report.evaluation = evaluate(tmp, job.src, device=job.device).to_dict()
    write_json(tmp / "report.json", report.to_dict())
    (tmp / "report.md").write_text(to_markdown(report), encoding="utf-8")


def _write_packed(w, fmt, p, plan: ModulePlan, err: float, info: TensorInfo, report: PackReport,
                  path: Path) -> None:
    """One quantized weight into the output: its error checked (a NaN is an error, not a report line), its
    format's tensors written under the module's name, its row added to the report."""
    if not math.isfinite(err):
        raise InputError(f"the relative error of the packed weight is {err} (not a number)",
                         path=path, tensor=plan.weight, fix="--exclude this tensor and report it")
    after = 0
    for short, t in fmt.pack(p).items():
        w.add(f"{plan.module}.{short}", t)
        after += t.numel() * t.element_size()
    o, i = plan.shape
    report.results.append(TensorResult(plan.module, [o, i], plan.bits, plan.group_size, info.nbytes, after,
                                       8 * after / (o * i), err))


def check_collisions(ck: Checkpoint, plans: list[ModulePlan], fmt) -> None:
    """Refuse, before anything is read, a source tensor beside a weight pack quantizes whose name the layout
    writes for that module (`X.qweight` beside `X.weight` for GPTQ): the output would hold the name twice."""
    for p in plans:
        if p.action != "quantize":
            continue
        for short in fmt.spec.tensors:
            name = f"{p.module}.{short}"
            if name != p.weight and name in ck.tensors:
                raise InputError(f"the source holds '{name}' beside the weight it quantizes, a name --to {fmt.spec.id} "
                                 "writes for that module", path=ck.path, tensor=name,
                                 fix=f"--exclude '{re.escape(p.module)}' to keep the module dense, or remove the tensor")


def check_awq_plan(ck: Checkpoint, plans: list[ModulePlan]) -> None:
    """Refuse, at plan time, an AWQ output its loaders would misread (a quantized LM head, more than one scheme:
    qtool.formats.awq.awq_mismatch, the rule repack applies too), with pack's fixes."""
    from qtool.formats.awq import awq_mismatch

    quantized = [p for p in plans if p.action == "quantize"]
    bad = awq_mismatch([(p.module, p.bits, p.group_size, p.scheme.sym) for p in quantized])
    if bad is None:
        return
    weight = next(p.weight for p in quantized if p.module == bad.module)
    fix = ("leave it out of --include, so it stays dense, or --to gptq_v2, whose config records \"lm_head\": true"
           if bad.lm_head else "give one --group-size (no GROUP in --tensor-type), or --to gptq_v2, whose loaders "
                               "read per-module overrides (dynamic)")
    raise UsageError(bad.problem, path=ck.path, tensor=weight, fix=fix)


def _located(e: QtoolError, path: Path, tensor: str) -> QtoolError:
    """The same error, naming the file and tensor it came from (the quantizer knows neither)."""
    if e.path is not None:
        return e
    return type(e)(e.problem, path=path, tensor=e.tensor or tensor, fix=e.fix)


# Memory one module needs while it is packed, in bytes per weight beyond the weight as read: the uint8 codes
# and their packing. Continuous widths dividing 32 pack in int32 slices (about 4 bytes per weight); the planar
# layout stages each plane in int64 (about 17); 3-bit continuous streams expand every bit to int64 (about
# 16 per bit, plus 12). Measured with ru_maxrss on 2048..8192 x 4096 layers; the quantizer's and the error
# measure's float32 row blocks are bounded (qtool.quant.CHUNK_ELEMENTS), about 140 MiB at most.
_BLOCK_BYTES = 256 << 20


def _per_weight(fmt: str, bits: int) -> int:
    if fmt == "gptq_p":
        return 17
    return 4 if 32 % bits == 0 else 16 * bits + 12


def module_bytes(info: TensorInfo, bits: int, fmt: str) -> int:
    """Peak bytes that packing one weight to `fmt` holds at once: the weight as read, plus its working set."""
    o, i = info.shape
    return info.nbytes + _per_weight(fmt, bits) * o * i + _BLOCK_BYTES


def check_memory(ck: Checkpoint, plans, fmt: str) -> None:
    """Refuse, before anything is read or written, a module whose packing needs more memory than there is."""
    worst = max(plans, key=lambda p: module_bytes(ck.tensors[p.weight], p.bits, fmt))
    need = module_bytes(ck.tensors[worst.weight], worst.bits, fmt)
    have, what = available_bytes()
    if need > have:
        o, i = worst.shape
        raise InputError(f"packing this [{o}, {i}] weight needs about {_gib(need)} but only {_gib(have)} is free "
                         f"({what})", path=ck.path, tensor=worst.weight,
                         fix="--exclude this module, or run where more memory is available")


def _size(f: Path) -> int:
    """A file's size through its link; 0 for a dangling link or a loop (copying names what it does with them)."""
    try:
        return f.stat().st_size
    except OSError:
        return 0


def output_bytes(ck: Checkpoint, to_quantize: dict[str, ModulePlan]) -> int:
    """Bytes the output holds, at most: tensors copied as they are, packed modules (codes, a 2-byte scale and a
    zero per group and output, g_idx), the other files of the source."""
    total = sum(_size(f) for f in ck.other_files())
    for name, info in ck.tensors.items():
        p = to_quantize.get(name)
        if p is None:
            total += info.nbytes
            continue
        o, i = p.shape
        groups = 1 if p.group_size == -1 else -(-i // p.group_size)
        total += -(-o * i * p.bits // 8) + groups * o * 3 + 4 * i
    return total


def check_disk(ck: Checkpoint, to_quantize: dict[str, ModulePlan], out: Path) -> None:
    """Refuse, before writing, an output larger than the free space where it goes."""
    where = Path(os.path.abspath(out)).parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # the destination's own checks name what is wrong with it
    need = output_bytes(ck, to_quantize)
    if need > free:
        from qtool.errors import OutputError

        raise OutputError(f"the output needs about {_gib(need)} but {where} has {_gib(free)} free", path=out,
                          fix="free space there, or choose another -o")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB ({n} bytes)"


def _write_configs(tmp: Path, ck: Checkpoint, job: PackJob, plans: list[ModulePlan], fmt) -> None:
    from qtool.io.hf_gguf import loader_keys
    from qtool.io.writer import write_json

    quantized = [p for p in plans if p.action == "quantize"]
    bits, group = job.bits, job.group_size
    if all((p.bits, p.group_size) != (bits, group) for p in quantized):
        # --tensor-type covers every module: the base is a scheme the modules have, since loaders that read only
        # the base (AWQ's) build every module with it
        bits, group = majority((p.bits, p.group_size) for p in quantized)
    dynamic = {}
    for p in plans:
        if p.action == "keep" and "lm_head" not in p.reason:
            dynamic[f"-:^{re.escape(p.module)}$"] = {}
        elif p.action == "quantize" and (p.bits, p.group_size) != (bits, group):
            dynamic[f"+:^{re.escape(p.module)}$"] = {"bits": p.bits, "group_size": p.group_size}
    desc_act = job.method == "gptq" and job.act_order and not job.static_groups
    extra: dict = {"dynamic": dynamic} if dynamic else {}
    kept = [p.module for p in plans if p.action == "keep" and not p.reason.startswith(("embedding", "norm"))]
    extra.update(loader_keys(job.to, [p.module for p in plans if p.action == "quantize"], kept))
    if job.method in CALIBRATED:
        from qtool import __version__

        extra["meta"] = {"quantizer": [f"qtool:{__version__}"], "method": job.method,
                         "static_groups": job.static_groups, "true_sequential": job.true_sequential}
        if job.method == "gptq":
            from qtool.quant.gptq import DAMP, MSE, MSE_NORM

            extra["meta"]["damp_percent"] = DAMP if job.damp is None else job.damp
            # GPTQModel's meta key: the error norm of the scale search, 0 when the scales are min-max
            extra["meta"]["mse"] = MSE_NORM if (MSE if job.mse is None else job.mse) else 0.0
    qcfg = fmt.config_for(bits, group, job.sym, desc_act, extra or None,
                          lm_head=any(is_lm_head(p.module) for p in quantized))
    cfg = dict(ck.config or {})
    cfg["quantization_config"] = qcfg
    if "torch_dtype" in cfg or "dtype" in cfg:
        # the dense dtype engines should compute in; scales are stored in it. transformers 5 names it `dtype`:
        # both names say the same
        cfg["torch_dtype"] = "float16" if job.dtype == "fp16" else "bfloat16"
        if "dtype" in cfg:
            cfg["dtype"] = cfg["torch_dtype"]
    write_json(tmp / "config.json", cfg)
    write_json(tmp / "quantize_config.json", qcfg)


# The most calibration windows a pack takes (GPTQModel and AutoAWQ use 128 to 1024), and the largest seed torch
# takes; the windows' activations are also checked against memory once the model's width is known.
MAX_CALIB_SAMPLES = 1 << 16
MAX_SEED = 2**63 - 1


def given(job: PackJob, name: str) -> bool:
    """Whether the job's field differs from PackJob's default: its flag was given."""
    return getattr(job, name) != PackJob.__dataclass_fields__[name].default


def calibration_flags(job: PackJob) -> list[tuple[str, bool]]:
    """(flag, given) for every option only a calibrated pack (--method gptq or awq) reads."""
    names = ("calib", "calib_samples", "calib_seqlen", "act_order", "static_groups", "true_sequential", "damp",
             "calib_dtype", "mse", "calib_seed")
    return [("--mse/--no-mse" if n == "mse" else "--" + n.replace("_", "-"), given(job, n)) for n in names]


def check_calibration_options(job: PackJob) -> None:
    """Refuse calibration options that do not apply, before any work."""
    from qtool.formats import get_format

    if job.device is not None and job.method not in CALIBRATED and not job.eval:
        raise UsageError("--device applies only to --method gptq or awq and to --eval", fix="drop it")
    if job.method not in CALIBRATED:
        used = [f for f, on in calibration_flags(job) if on]
        if used:
            verb = "applies" if len(used) == 1 else "apply"
            raise UsageError(f"{', '.join(used)} {verb} only to --method gptq or awq", fix="add --method gptq")
        return
    if not (1 <= job.calib_samples <= MAX_CALIB_SAMPLES and job.calib_seqlen >= 2 and 0 <= job.calib_seed <= MAX_SEED):
        raise UsageError(f"--calib-samples must be 1 to {MAX_CALIB_SAMPLES}, --calib-seqlen >= 2 and --calib-seed "
                         f"0 to {MAX_SEED}")
    if job.method == "awq" and (job.act_order or job.static_groups or job.damp is not None or job.mse is not None):
        raise UsageError("--act-order/--static-groups/--damp/--mse are GPTQ options (AWQ always clip-searches)",
                         fix="drop them, or use --method gptq")
    if job.calib_dtype is not None and (job.method != "gptq" or job.calib_dtype not in CALIB_DTYPES):
        raise UsageError(f"--calib-dtype {job.calib_dtype} needs --method gptq and one of "
                         f"{', '.join(CALIB_DTYPES)}", fix="drop --calib-dtype, or use --method gptq")
    if job.damp is not None and not 0 < job.damp < 1:
        raise UsageError(f"--damp {job.damp:g} is outside (0, 1)", fix="give a fraction of the mean Hessian "
                                                                       "diagonal, e.g. 0.1")
    if job.static_groups and not job.act_order:
        raise UsageError("--static-groups only changes --act-order", fix="add --act-order")
    if job.act_order and not job.static_groups and not get_format(job.to).spec.act_order:
        raise UsageError(f"--to {job.to} cannot store act-order's g_idx",
                         fix="add --static-groups (act-order without g_idx), or use --to gptq")
    if job.calib is not None and not Path(job.calib).is_file():
        raise InputError("calibration file not found", path=job.calib, fix="give a UTF-8 text or .jsonl file")


def _calibrate(ck: Checkpoint, job: PackJob, to_quantize: dict[str, ModulePlan], scale_dtype, report: PackReport,
               on_progress):
    """Run GPTQ/AWQ over the model's blocks; modules it does not cover are left to RTN, and the report says
    which."""
    import torch

    from qtool.quant.calib import CalibSettings, calibrate_checkpoint
    from qtool.quant.gptq import DAMP, MSE
    from qtool.quant.hf import default_device

    calib_dtype = None if job.calib_dtype is None else getattr(torch, CALIB_DTYPES[job.calib_dtype])
    settings = CalibSettings(job.method, bool(job.sym), scale_dtype, job.act_order, job.static_groups,
                             job.true_sequential, damp=DAMP if job.damp is None else job.damp,
                             device=default_device(job.device), forward_dtype=calib_dtype,
                             clip=MSE if job.mse is None else job.mse)
    targets = {name: (p.bits, p.group_size) for name, p in to_quantize.items()}

    def tick(b: int, n: int) -> None:
        if on_progress:
            on_progress(f"{job.method} block {b}/{n}", b, n)

    res, summary = calibrate_checkpoint(ck.root if ck.root is not None else job.src, list(ck.tensors), targets,
                                        settings, job.calib, job.calib_samples, job.calib_seqlen, tick,
                                        seed=job.calib_seed)
    report.calibration = summary
    if summary["default_text"]:
        report.notes.append(f"calibration: no --calib given, so {summary['text']}")
    report.notes.append(f"calibration: {summary['samples']} samples of {summary['seqlen']} tokens, "
                        f"seed {summary['seed']}, "
                        f"blocks {summary['blocks']}, device {summary['device']}"
                        + (f", damp {summary['damp']:g}, {'clip-searched (--mse)' if summary['mse'] else 'min-max'} "
                           "group scales" if job.method == "gptq" else ""))
    report.notes.extend(res.notes)
    rest = [n for n in to_quantize if n not in res.layers]
    if rest:
        report.notes.append(f"{len(rest)} module(s) the calibration did not cover (outside the blocks, or in a "
                            "fused expert stack) quantized with RTN: " + ", ".join(to_quantize[n].module for n in rest))
    return res


# --- float / int8 layouts (fp8, ct_fp8, ct_int8) ------------------------------------------------------------


def scaled_block(job: PackJob, fmt) -> tuple[int, int]:
    """(bo, bi) from --strategy / --block / --group-size, the layout's default when none is given."""
    from qtool.formats.scaled_format import block_of

    strategy = job.strategy
    if strategy is None:
        if job.block is not None:
            strategy = "block"
        else:
            return tuple(fmt.default_block)
    if strategy not in STRATEGIES:
        raise UsageError(f"unknown --strategy '{strategy}'", fix=f"use one of {', '.join(STRATEGIES)}")
    if strategy not in fmt.strategies:
        raise UsageError(f"{fmt.spec.id} stores {' or '.join(fmt.strategies)} scales, not --strategy {strategy}",
                         fix="choose another --strategy, or --to ct_fp8 for per-channel FP8")
    if job.block is not None and strategy != "block":
        raise UsageError(f"--block applies to --strategy block, not {strategy}")
    if strategy == "group":
        if job.group_size is None or job.group_size <= 0:
            raise UsageError("--strategy group needs a positive --group-size")
        return block_of("group", 0, 0, group=job.group_size)
    if strategy == "block":
        text = job.block or "128x128"
        m = re.fullmatch(r"([0-9]{1,12})x([0-9]{1,12})", text.strip())
        if not m or not all(0 < int(v) <= INT32_MAX for v in m.groups()):
            raise UsageError(f"--block '{text[:40]}' is not ROWSxCOLS of 1 to {INT32_MAX}", fix="e.g. --block 128x128")
        return (int(m.group(1)), int(m.group(2)))
    return block_of(strategy, 0, 0)


def run_pack_scaled(job: PackJob, on_progress: Callable[[str, int, int], None] | None = None) -> PackReport:
    """`pack --to fp8|ct_fp8|ct_int8`: absmax (or --method mse) scales per --strategy, one tensor at a time."""
    from qtool.formats import get_format

    if job.method not in ("rtn", "mse"):
        raise UsageError(f"--method {job.method} quantizes integer layouts; {job.to} takes rtn or mse")
    for flag, on in (*calibration_flags(job), ("--tensor-type", bool(job.tensor_types)),
                     ("--sym/--asym", job.sym is not None), ("--dtype", given(job, "dtype")),
                     ("--device", job.device is not None and not job.eval)):
        if on:  # --dtype sets the integer layouts' 16-bit scales; these store their scales in their own type
            raise UsageError(f"{flag} does not apply to --to {job.to}", fix="drop it")
    bits = SCALED_BITS.get(job.to, 8)
    if job.bits != bits:
        raise UsageError(f"--to {job.to} stores {bits}-bit codes, not --bits {job.bits}", fix="drop --bits")
    if job.group_size not in (None, 128) and job.strategy != "group" or job.group_size is None and \
            job.strategy == "group":
        raise UsageError("--group-size sets the inputs per scale of --strategy group (and is needed there)",
                         fix="add --strategy group, or drop --group-size")
    fmt = get_format(job.to)
    block = scaled_block(job, fmt)
    if job.to in MICRO_PACK and block != tuple(fmt.default_block):
        raise UsageError(f"{job.to} stores scales per {fmt.default_block[1]} inputs, not per {block}",
                         fix="drop --strategy/--group-size/--block")
    ck = open_checkpoint(job.src)
    if ck.quant_config is not None:
        raise InputError("the source is already quantized", path=ck.path,
                         fix="pack reads dense models; use `qtool repack` to convert quantized ones")
    job = replace(job, bits=bits, group_size=block[1] if block[0] == 1 and block[1] != -1 else -1, sym=True)
    plans = plan_modules(ck, job)
    for p in plans:
        if p.action == "quantize":
            p.scheme = QuantScheme(job.to, bits, job.group_size, True, False)
    check_collisions(ck, plans, fmt)
    warnings = [f"{p.weight}: {p.reason}; kept as it is" for p in plans if p.reason.startswith("empty weight")]
    warnings += ck.shard_notes() + stacked_weights_note(ck)
    if job.to == "fp8" and block == (-1, -1):
        from qtool.formats.fp8 import PER_TENSOR_NOTE

        warnings.append(PER_TENSOR_NOTE)
    report = PackReport(str(job.src), str(job.out), job.to, job.method, True, job.dtype, job.dry_run, plans,
                        bytes_in=ck.total_bytes, warnings=warnings)
    report.notes.append(f"{job.to}: {SCALED_PACK[job.to]} codes, scales per "
                        f"{'tensor' if block == (-1, -1) else 'channel' if block == (1, -1) else f'{block[0]}x{block[1]} block'}"
                        ", dynamic activations")
    to_quantize = {p.weight: p for p in plans if p.action == "quantize"}
    if not to_quantize:
        raise UsageError("no linear weights to quantize", path=ck.path,
                         fix="check --include/--exclude; embeddings, lm_head and norms stay dense by default")
    if job.dry_run:
        return report
    check_memory(ck, to_quantize.values(), job.to)
    check_disk(ck, to_quantize, job.out)
    _pack_scaled_files(ck, job, fmt, block, plans, to_quantize, report, on_progress)
    return report


def _read_with_maxima(info: TensorInfo, buf, block: tuple[int, int], element: str):
    """(the weight read into buf, its block maxima or None): on the reader thread, a piece of whole block rows
    at a time, each piece's maxima taken right after its read, while its bytes are in this core's cache (so
    the quantizer reads the weight once, and a core each does the reading and the codes)."""
    import torch

    from qtool.io.checkpoint import read_bytes, read_tensor
    from qtool.packing import scaled_quant as sq
    from qtool.quant.scaled import block_maxima, block_rows_per_piece

    o, i = info.shape
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(info.dtype)
    if dtype is None or not info.nbytes:
        return read_tensor(info, False, buf), None
    w = torch.from_numpy(buf[:info.nbytes]).view(dtype).reshape(o, i)
    if not sq.applies(w, element):
        return read_tensor(info, False, buf), None
    per_tensor = (block[0] in (-1, o)) and (block[1] in (-1, i)) and o > 1
    row_bytes = info.nbytes // o
    step = block_rows_per_piece((o, i), block, 1 << 20)
    parts, bad = [], 0
    for r0 in range(0, o, step):
        r1 = min(o, r0 + step)
        read_bytes(info.file, info.start + r0 * row_bytes, (r1 - r0) * row_bytes, info.name, buf[r0 * row_bytes:])
        got = block_maxima(w[r0:r1], block, (o, i), threads=1) if parts is not None else None
        if got is None:
            parts = None  # the loops are unavailable: read the rest, the quantizer takes its own maxima
            continue
        parts.append(got[0])
        bad += got[1]
    if parts is None:
        return w, None
    grid = torch.stack(parts).amax(0) if per_tensor else torch.cat(parts)
    return w, (grid, bad)


class _CodeBuffers:
    """The codes of each weight go into one of POOL reused buffers, sized for the largest weight: fresh memory
    costs a page fault per 4 KiB, as much as quantizing into it. A buffer comes back once the writer thread has
    written the codes in it, so while one weight is written the next is quantized into the other buffer."""

    POOL = 2

    def __init__(self, plans, element: str):
        import queue

        import torch

        from qtool.formats.scaled import ELEMENTS

        self.dtype = getattr(torch, ELEMENTS[element].storage)
        self.size = max(p.shape[0] * p.shape[1] for p in plans) * torch.empty((), dtype=self.dtype).element_size()
        self.free: queue.Queue = queue.Queue()
        self.made = 0
        self.last = None

    def take(self, shape: tuple[int, int]):
        """A [O, I] codes tensor in a free buffer (waits for the writer when both are in its queue)."""
        import torch

        if self.free.empty() and self.made < self.POOL:
            self.made += 1
            self.free.put(torch.empty(self.size, dtype=torch.uint8))
        self.last = self.free.get()
        o, i = shape
        return self.last[:o * i * self.dtype.itemsize].view(self.dtype).view(o, i)

    def give_back_when_written(self, writer) -> None:
        """The buffer last taken returns once the writer has written everything queued before this call."""
        buf, self.last = self.last, None
        writer.after_written(lambda: self.free.put(buf))


def _pack_scaled_files(ck, job, fmt, block, plans, to_quantize, report, on_progress) -> None:
    import torch

    from qtool import __version__
    from qtool.formats.scaled_format import module_meta
    from qtool.io.prefetch import Prefetcher
    from qtool.io.writer import (
        BackgroundWriter,
        ShardedWriter,
        atomic_output,
        parse_size,
        refuse_overwriting_input,
        write_json,
    )
    from qtool.quant.fp4 import quantize_for
    from qtool.quant.scaled import quantize_scaled

    refuse_overwriting_input(job.src, job.out)
    meta = {"qtool.version": __version__, "qtool.format": job.to, "qtool.method": job.method}
    names = list(ck.tensors)
    element = SCALED_PACK[job.to]
    packed_meta: list[tuple[str, QuantScheme, dict]] = []
    dtypes = {"F16": ("fp16", "float16"), "BF16": ("bf16", "bfloat16"), "F32": ("fp32", "float32")}
    # Three stages, a thread each: the next weight is read (Prefetcher) while this one is quantized, and the
    # writer thread writes the codes before. The quantizer's C++ loops take one thread fewer than torch's
    # count, so the reader and the writer keep a core (on two cores, OpenMP's second thread only waited).
    threads = max(1, torch.get_num_threads() - 1)
    codes = None if job.to in MICRO_PACK else _CodeBuffers(to_quantize.values(), element)
    with atomic_output(job.out, job.force) as tmp:
        read = None if codes is None else functools.partial(_read_with_maxima, block=block, element=element)
        with BackgroundWriter(ShardedWriter(tmp, parse_size(job.max_shard_size), meta,
                                            expected_tensors=len(names) + 2 * len(to_quantize))) as w:
            with Prefetcher([ck.tensors[n] for n in names if n in to_quantize], read) as reader:
                for k, name in enumerate(names):
                    info: TensorInfo = ck.tensors[name]
                    if on_progress:
                        on_progress(name, k, len(names))
                    plan = to_quantize.get(name)
                    if plan is None:
                        w.add_raw(name, info)
                        continue
                    weight, maxima = reader.get(name) if codes is not None else (reader.get(name), None)
                    # scales in the weight's dtype where the layout keeps it (compressed-tensors' observers do)
                    stype, model = dtypes.get(info.dtype, ("fp32", "float32"))
                    if stype not in fmt.scale_types:
                        stype = "fp32"
                    try:
                        # compressed-tensors returns the scale's dtype; HF fp8 readers round to the model's
                        out = fmt.compute_for(stype) if fmt.compute == "scale" else model
                        st: dict = {}
                        if job.to in MICRO_PACK:
                            p = quantize_for(job.to, weight, job.method, out_dtype=model, name=name)
                        else:
                            buf = codes.take(plan.shape) if codes is not None else None
                            p = quantize_scaled(weight, element, block, stype, fmt.compute_for(stype), out,
                                                method=job.method, name=name, stats=st, codes=buf, threads=threads,
                                                maxima=maxima)
                    except QtoolError as e:
                        raise _located(e, ck.path, name) from None
                    # the micro-float quantizers measure nothing on the way, and the sums the others keep
                    # overflow float32 squares on weights past ~1e19: then the error is measured in float64
                    if not st or not (math.isfinite(st["err2"]) and math.isfinite(st["ref2"])):
                        from qtool.formats.scaled import relative_error

                        err = relative_error(weight, p)
                    else:
                        err = math.sqrt(st["err2"] / st["ref2"]) if st["ref2"] > 0 else (0.0 if st["err2"] == 0 else
                                                                                         math.inf)
                    _write_packed(w, fmt, p, plan, err, info, report, ck.path)
                    if codes is not None:
                        codes.give_back_when_written(w)
                    packed_meta.append((plan.module, plan.scheme, module_meta(p)))
                    del weight, p
        files = w.files
        report.bytes_out = sum(f.stat().st_size for f in files)
        report.files = [f.name for f in files]
        report.dtype = ",".join(sorted({m[2]["scale_type"] for m in packed_meta}))
        dense = [p.module for p in plans if p.action == "keep" and not p.reason.startswith(("embedding", "norm"))]
        cfg = dict(ck.config or {})
        cfg["quantization_config"] = fmt.quantization_config(packed_meta, dense=dense)
        write_json(tmp / "config.json", cfg)
        _finish(tmp, ck, job, report)
    if on_progress:
        on_progress("", len(names), len(names))
