"""Deciding, per module and before any byte is written, how exactly a repack can be done.

Kinds (ModulePlan.kind):
    exact       the target stores the same quantization (same codes, scales, zeros, groups); dequantized
                weights are bit-identical
    near-exact  only the fp16 rounding of a stored float moves weights (GGUF d / Q4_1 m); max_error says by
                how much
    lossy       the target cannot hold this quantization; converting means dequantize + requantize
                (only with --allow-lossy; the error is measured when it runs)
    dropped     converted exactly or near-exactly, but tensors of the module that its layout does not read
                were discarded because --drop named them: the output equals the source only where they did
                not matter (the plan lists them)
    impossible  not even requantization helps (shapes the target cannot tile, a source qtool cannot read, a
                3-D expert stack, AWQ and GPTQ modules in one marlin config), or the module holds a tensor its
                layout does not read that neither --keep nor --drop names
    keep        not selected by --include/--exclude: copied in the source layout, unchanged

A plan the target's one config cannot describe as a whole is refused before any module is converted: an awq
output of modules in more than one scheme, or with its LM head quantized (check_one_awq_config).

Tensors a module's layout does not read (SourceModule.extra: a rotation, a smoothing vector) are never lost
silently: a module copied unchanged (same layout, or not selected) carries them; a converted module carries
those --keep names, discards those --drop names (listed in ModulePlan.dropped), and is refused otherwise.

How a verdict is reached (ModulePlan.decided_by):
    "header"  from the header and config facts (bits, group size, sym, act-order, shape) by asking the target
              format's `check` about a stand-in Plain of that shape (zero-stride tensors, no data); the real
              Plain is checked again while converting and a disagreement stops the run before anything is
              renamed into place;
    "data"    where exactness depends on values: GGUF targets (q - z ranges, fp16 d), GPTQ v1 targets of
              asymmetric sources (a zero of 0 has no v1 encoding), GGUF Q4_1 sources (is -m/d an integer?),
              and any module whose facts the header leaves open. The module is unpacked and checked.
Either way the small tensors that carry facts are read first (_check_stored_facts): a g_idx must be an
integer map of the input rows into the groups, and a config's sym must agree with the stored zero points.
A contradiction is an input error naming the tensor (exit 2), never a lossy verdict: no requantization
repairs a damaged map, and a sym label over varying zeros means two different weights to two engines.

Exact transformations of a Plain (applied when --bits / --group-size ask for them):
    widen    b -> b' > b: q' = q + c, z' = z + c with c = 2^(b'-1) - 2^(b-1) (the symmetric midpoint moves
             with it), so s * (q' - z') = s * (q - z);
    regroup  G -> G' dividing G (or G = -1 -> G' dividing I): scales and zeros repeated G/G' times.
Fewer bits, or groups merged, change the quantization: lossy.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from qtool.errors import FormatError, InputError, UsageError
from qtool.formats.base import Format, format_id
from qtool.formats.gguf_blocks import GGUF_IDS
from qtool.formats.plain import Plain
from qtool.repack.scaled import decide as decide_scaled
from qtool.repack.scaled import is_scaled
from qtool.repack.source import DAMAGED_FIX, located, unpack_module
from qtool.scheme import QuantScheme

KINDS = ("exact", "near-exact", "dropped", "lossy", "impossible", "keep")
# a regex flag longer than this is refused: patterns are matched against every tensor name of the checkpoint
MAX_REGEX = 1000
# per-module counts inside reasons, blanked so identical reasons group together in a refusal
_COUNTS = re.compile(r"\b[0-9]+ (groups|weights|of [0-9]+ blocks)")
_ST_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def target_id(name: str) -> str:
    """The format id --to names (an id or an alias from the format rows), else the name as given."""
    return format_id(name) or name.strip().lower().replace("-", "_")


@dataclass(frozen=True)
class RepackJob:
    """Everything `qtool repack` was asked (the CLI flags, one to one)."""

    src: Path
    to: str
    out: Path | None = None
    allow_lossy: bool = False
    bits: int | None = None
    group_size: int | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dry_run: bool = False
    force: bool = False
    max_shard_size: str = "4GB"
    method: str = "rtn"
    keep: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    tensor_type: tuple[str, ...] = ()  # GGUF targets: REGEX=TYPE per-tensor type overrides (repack/interop.py)

    def validate(self) -> None:
        """Usage errors that need no file: flag values out of range."""
        if self.group_size is not None and self.group_size != -1 and self.group_size <= 0:
            raise UsageError(f"--group-size {self.group_size} is not a group size",
                             fix="pass a positive number of inputs per group, or -1 for one group per row")
        if self.bits is not None and self.bits <= 0:
            raise UsageError(f"--bits {self.bits} is not a code width", fix="pass a positive number of bits")
        for flag, regexes in (("--include", self.include), ("--exclude", self.exclude), ("--keep", self.keep),
                              ("--drop", self.drop)):
            for r in regexes:
                _compile(r, flag)


@dataclass(slots=True)
class ModulePlan:
    """What happens to one module. Source facts, target parameters, the verdict and its reasons.

    src:   the source module's scheme as the header and config give it (format, bits, group_size, sym,
           desc_act; None where unknown); the plan JSON writes it flat (src_format, bits, ...)

    steps: exact Plain transformations on the way ("regroup 128->32", "widen 4->8") or "requantize".
    fast:  True when a direct tensor-to-tensor path (same bytes as the composition) will be used.
    max_error: near-exact: max |w_target - w_source| predicted; lossy: measured max after the run.
    rel_error: lossy: ||W_target - W_source|| / ||W_source||, measured.
    """

    module: str
    src: QuantScheme
    dst_format: str
    shape: list[int] | None
    kind: str = "exact"
    reasons: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    to_bits: int | None = None
    to_group_size: int | None = None
    to_sym: bool | None = None
    decided_by: str = "header"
    copy: bool = False
    fast: bool = False
    max_error: float | None = None
    rel_error: float | None = None
    target_meta: dict | None = None
    carried: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def converts(self) -> bool:
        return self.kind in ("exact", "near-exact", "dropped", "lossy")

    @property
    def relayout(self) -> bool:
        """Converted without requantizing (the layout's values move exactly, or with fp16 rounding only)."""
        return self.kind in ("exact", "near-exact") or (self.kind == "dropped" and "requantize" not in self.steps)

    def target_scheme(self) -> QuantScheme:
        """What is written for this module (act-order survives unless the module is requantized)."""
        return QuantScheme(self.dst_format, self.to_bits, self.to_group_size, self.to_sym,
                           bool(self.src.desc_act) and "requantize" not in self.steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("target_meta")
        src = d.pop("src")
        head = {"module": d.pop("module"), "src_format": src["format"], "dst_format": d.pop("dst_format"),
                "shape": d.pop("shape")}
        return head | {k: src[k] for k in ("bits", "group_size", "sym", "desc_act")} | d


@dataclass
class RepackPlan:
    job: RepackJob
    target: str
    out: Path
    modules: list[ModulePlan]
    passthrough: int
    source_format: str
    container: str
    warnings: list[str] = field(default_factory=list)
    float_types: dict[str, str] = field(default_factory=dict)  # GGUF targets: --tensor-type of dense tensors

    @property
    def dropped(self) -> set[str]:
        """Full names of the tensors --drop discards: written nowhere."""
        return {n for m in self.modules for n in m.dropped}

    def counts(self) -> dict[str, int]:
        c = {k: 0 for k in KINDS}
        for m in self.modules:
            c[m.kind] += 1
        return c

    def blocking(self) -> list[ModulePlan]:
        """Modules that stop the run: impossible ones always, lossy ones without --allow-lossy."""
        return [m for m in self.modules
                if m.kind == "impossible" or (m.kind == "lossy" and not self.job.allow_lossy)]

    def refusal_message(self) -> str:
        """One line: how many modules block the run, grouped by reason (modules named, a few per reason)."""
        bad = self.blocking()
        by_reason: dict[str, list[str]] = {}
        for m in bad:
            why = _COUNTS.sub(r"N \1", "; ".join(m.reasons) or m.kind)
            by_reason.setdefault(f"[{m.kind}] {why}", []).append(m.module)
        parts = []
        for why, mods in by_reason.items():
            names = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
            parts.append(f"{why} ({len(mods)} module{'s' if len(mods) > 1 else ''}: {names})")
        return (f"{len(bad)} of {len(self.modules)} modules cannot be converted exactly to {self.target}: "
                + " | ".join(parts) + "; nothing was written")

    def refusal_fix(self) -> str:
        bad = self.blocking()
        if any(m.kind == "impossible" and m.reasons and m.reasons[0].startswith(STACK) for m in bad):
            return ("--exclude REGEX leaves the stacks in their source layout, copied unchanged (the target's "
                    "config does not describe them), and converts the rest")
        if any(m.kind == "impossible" and m.reasons and m.reasons[0].startswith(MIXED_FAMILY) for m in bad):
            return ("make the source one family first (`qtool repack SRC --to gptq_v2`: exact from AWQ), then "
                    "--to marlin; or --exclude the modules named here (they stay in their source layout)")
        if any(m.kind == "impossible" and m.reasons and m.reasons[0].startswith(UNREAD) for m in bad):
            return ("--keep REGEX carries such tensors unchanged beside the converted layout (only if the target's "
                    "readers apply them), --drop REGEX discards them (the plan lists them); or --exclude the module")
        if any(m.kind == "lossy" for m in bad) and not any(m.kind == "impossible" for m in bad):
            return "pass --allow-lossy to requantize them (the error is reported), or --exclude them"
        return "--exclude those modules or choose another --to" + (
            "; --allow-lossy requantizes the lossy ones" if any(m.kind == "lossy" for m in bad) else "")

    def to_dict(self) -> dict:
        return {"target": self.target, "out": str(self.out), "source_format": self.source_format,
                "container": self.container, "counts": self.counts(), "passthrough_tensors": self.passthrough,
                "dropped_tensors": sorted(self.dropped),
                "warnings": list(self.warnings), "modules": [m.to_dict() for m in self.modules]}


# --- exact transformations ---------------------------------------------------------------------------------
def can_regroup(group: int, in_features: int, to_group: int, desc_act: bool) -> bool:
    """True when every new group lies inside one old group (the old scale/zero just repeats)."""
    if to_group == group:
        return True
    if desc_act or to_group == -1 or to_group <= 0 or in_features % to_group:
        return False
    return group == -1 or (in_features % group == 0 and group % to_group == 0)


def regroup(p: Plain, to_group: int) -> Plain:
    """Same weights, smaller groups: scales/zeros repeated (exact; see can_regroup)."""
    if to_group == p.group_size:
        return p
    r = p.effective_group_size // to_group
    zeros = None if p.zeros is None else p.zeros.repeat_interleave(r, dim=1)
    return p.with_(scales=p.scales.repeat_interleave(r, dim=1), zeros=zeros, g_idx=None, group_size=to_group)


def widen(p: Plain, to_bits: int) -> Plain:
    """Same weights, wider codes: q and z shifted together so the midpoint stays the midpoint (exact)."""
    if to_bits == p.bits:
        return p
    c = (1 << (to_bits - 1)) - (1 << (p.bits - 1))
    q = (p.qweight.to(torch.int16) + c).to(torch.uint8)
    z = None if p.zeros is None else (p.zeros.to(torch.int16) + c).to(torch.uint8)
    return p.with_(qweight=q, zeros=z, bits=to_bits)


def apply_steps(p: Plain, m: ModulePlan) -> Plain:
    """The exact transformations the plan chose, in order (widen, then regroup). A ScaledPlain has none."""
    if not isinstance(p, Plain):
        return p
    if m.to_bits is not None and m.to_bits > p.bits:
        p = widen(p, m.to_bits)
    if m.to_group_size is not None and m.to_group_size != p.group_size and can_regroup(
            p.group_size, p.in_features, m.to_group_size, p.desc_act):
        p = regroup(p, m.to_group_size)
    return p


stand_in = Plain.stand_in


# --- the planner ---------------------------------------------------------------------------------------------
def _compile(regex: str, flag: str) -> re.Pattern:
    if len(regex) > MAX_REGEX:
        raise UsageError(f"{flag} pattern is {len(regex)} characters; at most {MAX_REGEX} are accepted",
                         fix="shorten the regular expression")
    try:
        return re.compile(regex)
    except re.error as e:
        raise UsageError(f"{flag} '{regex}' is not a valid regular expression ({e})") from None


def default_out(src: Path, target: str) -> Path:
    """`<src>-<format>` beside the source (`.gguf` added for GGUF targets)."""
    src = Path(src)
    stem = src.stem if src.is_file() else src.name
    if src.name.endswith(".index.json"):
        src = src.parent
        stem = src.name
    short = target.removeprefix("gguf_")
    base = src.parent / f"{stem}-{short}"
    return base.with_name(base.name + ".gguf") if target in GGUF_IDS else base


def make_plan(source, job: RepackJob) -> RepackPlan:
    """Decide every module of `source` (qtool.repack.source.Source) for `job`."""
    from qtool.formats import all_formats, get_format

    target = target_id(job.to)
    dst = get_format(target)
    if target in GGUF_IDS and (job.bits is not None or job.group_size is not None):
        raise UsageError(f"--bits/--group-size do not apply to {target}: GGUF blocks fix them (32 inputs per "
                         "block, the type's own code width)", fix="drop --bits/--group-size")
    if job.bits is not None and job.bits not in dst.spec.bits:
        raise UsageError(f"{target} holds {', '.join(map(str, dst.spec.bits))}-bit codes, not --bits {job.bits}")
    job.validate()
    incl = [_compile(r, "--include") for r in job.include]
    excl = [_compile(r, "--exclude") for r in job.exclude]
    keep = [_compile(r, "--keep") for r in job.keep]
    drop = [_compile(r, "--drop") for r in job.drop]
    known = all_formats()
    plans = []
    for m in source.modules:
        mp = ModulePlan(m.name, m.scheme, target, list(m.shape) if m.shape else None)
        if (incl and not any(r.search(m.name) for r in incl)) or any(r.search(m.name) for r in excl):
            mp.kind, mp.copy = "keep", True
            mp.reasons.append("not selected by --include/--exclude: copied in the source layout")
        elif m.scheme.format not in known and not m.scheme.format.startswith("gguf:"):
            mp.kind = "impossible"
            mp.reasons.append(f"qtool cannot read '{m.scheme.format}' modules")
        elif (m.scheme.extra or {}).get("experts") and source.container == "safetensors" \
                and m.scheme.format != target:
            # a fused [experts, out, in] stack (gpt-oss): no format's unpack reads it as one linear weight
            mp.kind = "impossible"
            mp.reasons.append(f"{STACK} ({m.scheme.extra['experts']} experts, {m.scheme.format}): repack converts "
                              "2-D linear modules only")
        elif is_scaled(dst) or is_scaled(known.get(m.scheme.format)):
            decide_scaled(source, m, mp, dst, job, known, _lossy_target)
        else:
            _decide(source, m, mp, dst, job, known)
        _resolve_unread(m, mp, keep, drop)
        plans.append(mp)
    if target == "marlin":
        _one_marlin_family(plans)
    out = Path(job.out) if job.out else default_out(job.src, target)
    fmts = sorted({m.scheme.format for m in source.modules})
    warnings = list(source.warnings)
    for flag, regexes, got in (("--keep", keep, [n for p in plans for n in p.carried]),
                               ("--drop", drop, [n for p in plans for n in p.dropped])):
        for r in regexes:
            if not any(r.search(n) for n in got):
                warnings.append(f"{flag} '{r.pattern}' names no tensor that a converted module's layout leaves "
                                "unread; it changed nothing")
    if target == "fp8":
        from qtool.formats.fp8 import loader_notes

        warnings += loader_notes([(m.module, None, m.target_meta) for m in plans if m.converts])
    kept = [m for m in plans if m.kind == "keep"]
    if kept and target not in GGUF_IDS:
        layouts = ", ".join(sorted({m.src.format for m in kept}))
        warnings.append(f"{len(kept)} module(s) kept in their source layout ({layouts}); the {target} config "
                        "written does not describe them")
    dropped = {n for p in plans for n in p.dropped}
    return RepackPlan(job, target, out, plans, len(source.passthrough) - len(dropped), ",".join(fmts) or "none",
                      source.container, warnings)


UNREAD = "holds tensors its layout does not read"
STACK = "a 3-D mixture-of-experts stack"


def _one_marlin_family(plans: list[ModulePlan]) -> None:
    """A Marlin config names one quant_method (gptq: uint4b8/uint8b128 or zero points; awq: AWQ-Marlin), and
    the contract one source layout family: when converted modules come from both an AWQ and a GPTQ-style
    source, the fewer family is refused (no `dynamic` override changes quant_method)."""
    fam: dict[str, list[ModulePlan]] = {}
    for mp in plans:
        if mp.converts and mp.target_meta:
            fam.setdefault("awq" if mp.target_meta.get("marlin.source") == "awq" else "gptq", []).append(mp)
    if len(fam) < 2:
        return
    few, many = sorted(fam, key=lambda f: (len(fam[f]), f))
    for mp in fam[few]:
        mp.kind, mp.copy = "impossible", False
        mp.reasons = [f"{MIXED_FAMILY}: {len(fam[many])} converted modules are {many}-family and {len(fam[few])} "
                      f"(this one among them) {few}-family"]


MIXED_FAMILY = "a marlin checkpoint's config names one quant_method (gptq or awq) for all its modules"


def check_one_awq_config(source, plan: RepackPlan) -> None:
    """Refuse (UsageError, exit 2) an awq plan whose converted modules one AWQ config cannot describe (a quantized
    LM head, more than one scheme: qtool.formats.awq.awq_mismatch, the rule pack applies too). Called once the
    plan is final (a GGUF source's modules outside the blocks are kept dense by then), so the refusal comes
    before any module is converted, --dry-run included; the config writer's own guard would come only after."""
    if plan.target != "awq":
        return
    from qtool.formats.awq import awq_mismatch

    conv = [mp for mp in plan.modules if mp.converts]
    bad = awq_mismatch([(mp.module, t.bits, t.group_size, t.sym) for mp in conv for t in (mp.target_scheme(),)])
    if bad is None:
        return
    layout = next((m.layout for m in source.modules if m.name == bad.module), {})
    tensor = layout.get("qweight") or next(iter(layout.values()), f"{bad.module}.qweight")
    raise UsageError(f"{bad.problem}; nothing was written", path=source.path, tensor=tensor, fix=bad.conversion_fix)


def _resolve_unread(m, mp: ModulePlan, keep: list[re.Pattern], drop: list[re.Pattern]) -> None:
    """Carry, drop or refuse the module's tensors that its source layout does not read (see the docstring)."""
    extra = getattr(m, "extra", None) or []
    if not extra or mp.kind in ("keep", "impossible") or mp.copy:
        mp.carried = list(extra)  # copied unchanged beside an unchanged layout (or nothing is written)
        return
    unresolved = []
    for name in extra:
        k, d = any(r.search(name) for r in keep), any(r.search(name) for r in drop)
        if k and d:
            raise UsageError(f"tensor '{name}' matches both --keep and --drop", fix="narrow one of the patterns")
        if k:
            mp.carried.append(name)
        elif d:
            mp.dropped.append(name)
        else:
            unresolved.append(name)
    if unresolved:
        names = ", ".join(f"'{n}'" for n in unresolved[:3]) + (f" and {len(unresolved) - 3} more"
                                                              if len(unresolved) > 3 else "")
        mp.kind, mp.copy = "impossible", False
        mp.reasons = [f"{UNREAD} ({names}): converting to {mp.dst_format} would lose them"]
        return
    if mp.dropped:
        mp.reasons.append("--drop discarded " + ", ".join(mp.dropped))
        if mp.kind in ("exact", "near-exact"):
            mp.kind = "dropped"
    if mp.carried:
        mp.reasons.append("--keep carried unchanged: " + ", ".join(mp.carried))


def _decide(source, m, mp: ModulePlan, dst: Format, job: RepackJob, known: dict) -> None:
    target = dst.spec.id
    if m.scheme.format.startswith("gguf:"):
        mp.kind = "lossy"
        mp.reasons.append(f"GGUF {m.scheme.format[5:]} is read only by dequantizing; integer layouts need "
                          "requantization")
        _lossy_target(m, mp, dst, job)
        return
    g_idx = _check_stored_facts(source, m)
    tb = job.bits if job.bits is not None else m.scheme.bits
    tg = job.group_size if job.group_size is not None else m.scheme.group_size
    if m.scheme.format == target and tb == m.scheme.bits and tg == m.scheme.group_size:
        mp.copy = True
        mp.to_bits, mp.to_group_size, mp.to_sym = m.scheme.bits, m.scheme.group_size, m.scheme.sym
        mp.reasons.append("same layout: tensors copied byte for byte")
        return
    facts_known = None not in (m.scheme.bits, m.scheme.group_size, m.scheme.sym, m.scheme.desc_act, m.shape)
    if facts_known and target in GGUF_IDS and m.scheme.format != "gguf_q4_1" and job.bits is None \
            and job.group_size is None and _gguf_exact_by_header(m, target):
        mp.to_bits, mp.to_group_size, mp.to_sym = m.scheme.bits, m.scheme.group_size, m.scheme.sym
        return
    needs_data = (target in GGUF_IDS or m.scheme.format == "gguf_q4_1" or not facts_known
                  or (target == "gptq" and m.scheme.sym is not True))
    if not needs_data:
        _decide_from_header(source, m, mp, dst, job, tb, tg, g_idx)
    else:
        _decide_from_data(source, m, mp, dst, job, known)


def _gguf_exact_by_header(m, target: str) -> bool:
    """True when a GGUF block type holds the module exactly whatever its values: fp16 scales (d needs no
    rounding), every 32-input block inside one group, and q - z within the type's integer range for every
    possible code (Q4_0: symmetric <= 4-bit or any <= 3-bit; Q8_0: symmetric, or any <= 7-bit).
    Q4_1 of asymmetric codes rounds m = -d*z, so the data decides it."""
    o, i = m.shape
    if m.scale_dtype != "F16" or m.scheme.desc_act or i % 32:
        return False
    if m.scheme.group_size != -1 and m.scheme.group_size % 32:
        return False
    if target == "gguf_q4_0":
        return (m.scheme.sym and m.scheme.bits <= 4) or m.scheme.bits <= 3
    if target == "gguf_q8_0":
        return m.scheme.sym or m.scheme.bits <= 7
    return False


def _transform_reasons(bits: int, group: int, in_features: int, desc_act: bool, tb: int | None,
                       tg: int | None) -> tuple[list[str], list[str]]:
    """(exact steps, lossy reasons) for changing bits/group size."""
    steps, lossy = [], []
    if tb is not None and tb != bits:
        if tb > bits:
            steps.append(f"widen {bits}->{tb} bits")
        else:
            lossy.append(f"--bits {tb} is narrower than the source's {bits}-bit codes")
    if tg is not None and tg != group:
        if can_regroup(group, in_features, tg, desc_act):
            steps.append(f"regroup {group}->{tg}")
        else:
            lossy.append(f"group size {group} -> {tg} merges or splits groups across scales"
                         + (" (act-order)" if desc_act else ""))
    return steps, lossy


def _decide_from_header(source, m, mp: ModulePlan, dst: Format, job: RepackJob, tb: int, tg: int,
                        checked_g_idx: torch.Tensor | None = None) -> None:
    o, i = m.shape
    steps, lossy = _transform_reasons(m.scheme.bits, m.scheme.group_size, i, m.scheme.desc_act, tb, tg)
    if lossy:
        mp.kind, mp.reasons = "lossy", lossy
        _lossy_target(m, mp, dst, job)
        return
    g_idx = None
    if m.scheme.desc_act:
        g_idx = checked_g_idx if checked_g_idx is not None else _read_g_idx(source, m)
        if g_idx is None:
            _decide_from_data(source, m, mp, dst, job, None)
            return
    scale_dtype = _ST_FLOATS.get(m.scale_dtype or "F16", torch.float16)
    bits = tb if tb > m.scheme.bits else m.scheme.bits
    group = tg if steps and tg != m.scheme.group_size else m.scheme.group_size
    probe = stand_in(o, i, bits, group, m.scheme.sym, g_idx if group == m.scheme.group_size else None, scale_dtype,
                     {"format": m.scheme.format})
    why = dst.check(probe)
    mp.steps = steps
    mp.to_bits, mp.to_group_size, mp.to_sym = bits, group, m.scheme.sym
    if why:
        mp.kind, mp.reasons = "lossy", why
        _lossy_target(m, mp, dst, job)
        return
    mp.kind = "exact"
    mp.target_meta = _target_meta(dst, probe)


def _decide_from_data(source, m, mp: ModulePlan, dst: Format, job: RepackJob, known: dict | None) -> None:
    """Unpack the module and ask the target about the real Plain."""
    from qtool.errors import NotRepresentable

    mp.decided_by = "data"
    try:
        plain = unpack_module(source, m)
    except NotRepresentable as e:  # e.g. GGUF Q4_1 whose offsets are not integer zero points
        mp.kind, mp.reasons = "lossy", [e.problem]
        _lossy_target(m, mp, dst, job)
        return
    mp.src = replace(mp.src, bits=plain.bits, group_size=plain.group_size, sym=plain.sym, desc_act=plain.desc_act)
    mp.shape = [plain.out_features, plain.in_features]
    if dst.spec.id in GGUF_IDS:
        a = dst.assess(plain)
        mp.to_bits, mp.to_group_size, mp.to_sym = plain.bits, plain.group_size, plain.sym
        if a.kind == "impossible":
            mp.kind, mp.reasons = "lossy", list(a.reasons)
            _lossy_target(m, mp, dst, job)
        else:
            mp.kind, mp.max_error = a.kind, a.max_error
            if a.kind == "near-exact":
                mp.reasons.append("d (and Q4_1's m) rounded to fp16")
        return
    tb = job.bits if job.bits is not None else plain.bits
    tg = job.group_size if job.group_size is not None else plain.group_size
    steps, lossy = _transform_reasons(plain.bits, plain.group_size, plain.in_features, plain.desc_act, tb, tg)
    if lossy:
        mp.kind, mp.reasons = "lossy", lossy
        _lossy_target(m, mp, dst, job)
        return
    mp.steps = steps
    mp.to_bits, mp.to_group_size, mp.to_sym = tb, tg, plain.sym
    plain = apply_steps(plain, mp)
    why = dst.check(plain)
    if why:
        mp.kind, mp.reasons = "lossy", why
        _lossy_target(m, mp, dst, job)
        return
    mp.kind = "exact"
    mp.target_meta = _target_meta(dst, plain)


# Layouts whose g_idx is the natural act-order map, int [I] with values in [0, ceil(I/G)) (Marlin stores a
# sorted one beside its perm; its unpack checks both).
_NATURAL_G_IDX = {"gptq": "g_idx", "gptq_v2": "g_idx", "gptq_p": "g_idx", "ct": "weight_g_idx"}
# Layouts that store zero points whatever their config's sym says: the config's sym is a claim about them.
_ZEROS_BESIDE_SYM = {"gptq": "qzeros", "gptq_v2": "qzeros", "gptq_p": "qzeros", "awq": "qzeros"}


def _check_stored_facts(source, m) -> torch.Tensor | None:
    """Read the small tensors that decide a module's facts before any verdict, and refuse (InputError) a module
    whose data contradicts its config or cannot be read: a g_idx that is no integer [I] map into the groups,
    and a sym claim over zero points that vary. Returns the checked g_idx (None when there is none)."""
    if source.container != "safetensors" or None in (m.in_features, m.scheme.bits, m.scheme.group_size):
        return None
    g_idx = None
    short = _NATURAL_G_IDX.get(m.scheme.format)
    if short in m.layout:
        g_idx = _checked_g_idx(source, m, m.layout[short])
    short = _ZEROS_BESIDE_SYM.get(m.scheme.format)
    if m.scheme.sym is True and short in m.layout and m.out_features is not None:
        _check_sym_claim(source, m, short)
    return g_idx


def _checked_g_idx(source, m, name: str) -> torch.Tensor:
    """The stored g_idx as int32 [I], or an InputError naming the tensor (a float, mis-sized or out-of-range
    map would otherwise be planned as a layout difference and fail later without a fix)."""
    from qtool.formats.gptq import read_g_idx

    g = source.get(name)
    i, group = m.in_features, m.scheme.group_size
    n_groups = 1 if group == -1 else -(-i // group)
    try:
        read_g_idx({"g_idx": g}, i, n_groups, group, m.scheme.format)
    except FormatError as e:
        raise InputError(e.problem, path=source.path, tensor=name,
                         fix="g_idx maps each input row to its group: an int32 [in_features] with values below "
                             f"{n_groups} (group_size {group}); " + DAMAGED_FIX) from None
    return g.to(torch.int32)


def _check_sym_claim(source, m, short: str) -> None:
    """Refuse a module whose config says sym while its stored zero points vary. Such a file means two weights:
    engines that trust the config take the midpoint (vLLM's GPTQ Marlin path reads uint4b8 and never opens
    qzeros), engines that read the zeros (GPTQModel's and exllama's kernels) do not, and no conversion can be
    both; inspect --deep reports the same error."""
    from qtool.formats import get_format

    qz = source.get(m.layout[short])
    bits, o = m.scheme.bits, m.out_features
    mid = 1 << (bits - 1)
    # symmetric files repeat one row of zero words: compare the rows, decode one
    same = qz.shape[0] > 1 and torch.equal(qz[1:], qz[:-1])
    rows = qz[:1] if same else qz
    try:
        zeros, _conv = get_format(m.scheme.format).decode_zeros(rows, bits, o, m.scheme)
    except FormatError as e:
        raise located(e, source, m) from None
    off = int((zeros != mid).sum()) * (qz.shape[0] if same else 1)
    total = qz.shape[0] * o
    other = {"gptq": ("gptq_v2", mid + 1), "gptq_v2": ("gptq", mid - 1)}.get(m.scheme.format)
    if off and other and bool((zeros == other[1]).all()):
        # symmetric data of the other GPTQ version (v1 stores z - 1): the version label is what is wrong
        raise InputError(f"every zero point of module {m.name} decodes to {other[1]} under the config's "
                         f"{m.scheme.format}, not the midpoint {mid}: the data is symmetric {other[0]}",
                         path=source.path, tensor=m.layout[short],
                         fix=f"set \"checkpoint_format\": \"{other[0]}\" in the quantization config; `qtool inspect "
                             "--deep` says the same; nothing was written")
    if off:
        raise InputError(f"the config says sym, but {off} of {total} zero points of module {m.name} are not "
                         f"the midpoint {mid}: engines that trust the config (vLLM's GPTQ Marlin path) ignore them "
                         "and those that read them (GPTQModel, exllama) do not, so the file means two different "
                         "weights", path=source.path, tensor=m.layout[short],
                         fix="if the zero points are right, set \"sym\": false in the quantization config (or this "
                             "module's entry in its \"dynamic\": "
                             f"{json.dumps({f'+:^{re.escape(m.name)}$': {'sym': False}})}); if the label is right, "
                             "the zero points are damaged: re-export the checkpoint. `qtool inspect --deep` lists "
                             "every such module; nothing was written")


def _read_g_idx(source, m) -> torch.Tensor | None:
    for short in ("g_idx", "weight_g_idx"):
        if short in m.layout and source.container == "safetensors":
            g = source.get(m.layout[short])
            if g.dim() == 1 and not g.dtype.is_floating_point:
                return g.to(torch.int32)
    return None


def _lossy_target(m, mp: ModulePlan, dst: Format, job: RepackJob) -> None:
    """Parameters a requantization would use, and whether the target can take even that. Facts come from
    `mp` (the header's, or the data's when the module was unpacked)."""
    from qtool.quant import GROUP_RANGE

    spec = dst.spec
    mp.steps = ["requantize"]
    o, i = mp.shape or (None, None)
    if spec.id in GGUF_IDS:
        mp.to_bits = {"gguf_q8_0": 8}.get(spec.id, 4)
        mp.to_group_size, mp.to_sym = 32, spec.id != "gguf_q4_1"
        if i is not None and i % 32:
            mp.kind = "impossible"
            mp.reasons.append(f"in_features {i} is not a multiple of the 32-input GGUF block")
        return
    src_bits = mp.src.bits
    bits = job.bits or (src_bits if src_bits in spec.bits else
                        min((b for b in spec.bits if src_bits is not None and b >= src_bits), default=max(spec.bits)))
    if job.group_size is not None:
        group = job.group_size
    else:
        group = mp.src.group_size if mp.src.group_size is not None else 128
        allowed = spec.group_sizes
        if allowed is not None and group not in allowed:
            group = 128 if 128 in allowed else allowed[0]
        if group != -1 and not GROUP_RANGE[0] <= group <= GROUP_RANGE[1]:
            group = 128
        if i is not None and group != -1 and i % group:
            group = -1
    sym = mp.src.sym if mp.src.sym is not None else True
    if not spec.asym or spec.id == "gptq":
        sym = True  # GPTQ v1 cannot store a zero of 0, which asymmetric min-max produces on one-signed groups
    elif not spec.sym:
        sym = False
    mp.to_bits, mp.to_group_size, mp.to_sym = bits, group, sym
    if o is None:
        return
    probe = stand_in(o, i, bits, group, sym, meta={"format": mp.src.format})
    why = dst.check(probe)
    if why and not sym and spec.sym:
        # the target may hold zero points at other widths only (marlin: 4-bit); a symmetric requantization
        # stores none, as the converter's own fallback does
        sym_probe = stand_in(o, i, bits, group, True, meta={"format": mp.src.format})
        if not dst.check(sym_probe):
            probe, why, sym = sym_probe, [], True
            mp.to_sym = True
            mp.reasons.append(f"requantized symmetric: {spec.id} stores no zero points for {bits}-bit codes")
    if why:
        mp.kind = "impossible"
        mp.reasons.append("even requantized: " + "; ".join(why))
    else:
        mp.target_meta = _target_meta(dst, probe)


def _target_meta(dst: Format, plain: Plain) -> dict | None:
    """Per-module facts a target's file contract records (Marlin: source, shape, padding)."""
    if dst.spec.id == "marlin":
        from qtool.formats import marlin

        return marlin.module_meta(plain)
    return None

