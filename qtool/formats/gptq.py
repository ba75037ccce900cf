"""GPTQ checkpoint layout (continuous little-endian bit stream): `gptq` (v1 zeros) and `gptq_v2` (true zeros).

Tensors of one linear module (FORMATS.md "GPTQ (continuous)"), with I = in_features, O = out_features,
b = bits, n_groups = ceil(I / G):

    qweight  int32 [I*b/32, O]        codes packed along the input rows: code j of each run of 32 input
                                       rows occupies stream bits [j*b, (j+1)*b) of the run's b words
    qzeros   int32 [n_groups, O*b/32]  zero points packed the same way along the output columns
    scales   fp16/bf16/fp32 [n_groups, O]
    g_idx    int32 [I]                 group of each input row (always written; i // G unless act-order)

Bias is not part of the layout (the I/O layer copies it). Plain is [O, I], so both packers transpose at the
edge.

Zero-point conventions (the part that bites):
- `gptq_v2` stores the true zero z.
- `gptq` (v1) stores z - 1. Two encodings of that exist in the wild and give identical bytes unless some
  zero is 0:
  * "word" (GPTQModel, the default for reading): for 2/4/8-bit the whole int32 word is shifted by the
    constant with a 1 in every field (0x55555555, 0x11111111, 0x01010101) mod 2^32, so a zero of 0 borrows
    from the next field up. Reading adds the constant back, which inverts the write exactly.
  * "field": each field independently, stored = (z - 1) & mask, read = (stored + 1) & mask.
  3-bit fields do not tile a word, so 3-bit v1 is always per field.
  qtool never *writes* a v1 zero of 0 (it has no per-field encoding, and a word borrow corrupts neighbours
  for per-field readers): such a Plain is NotRepresentable and the fix is `--to gptq_v2`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from qtool.errors import FormatError, NotRepresentable, UsageError
from qtool.formats.base import Format, FormatSpec, expect, register
from qtool.formats.detection import (
    AWQ_FAMILY,
    GPTQ_FAMILY,
    Claims,
    Detected,
    Sig,
    bits_note,
    exact_div,
    group_from,
)
from qtool.formats.plain import FLOAT_DTYPES, Plain
from qtool.lazy import lazy_module
from qtool.packing.bitstream import pack_stream, to_int32, to_uint32, unpack_stream
from qtool.scheme import QuantScheme

torch = lazy_module("torch")

GPTQ_BITS = (2, 3, 4, 8)
PLANAR_BITS = (2, 3, 4, 5, 6, 7, 8)   # gptq_p: every width, one bit plane per word

# Convention names recorded in Plain.meta["gptq_zero_convention"].
V2 = "v2"
V1_WORD = "v1-word"
V1_FIELD = "v1-field"
CONVENTIONS = (V2, V1_WORD, V1_FIELD)
META_KEY = "gptq_zero_convention"


def v1_word_constant(bits: int) -> int:
    """The uint32 constant GPTQModel adds (read) / subtracts (write) for v1 qzeros: a 1 in every b-bit field.

    0x55555555 (2-bit), 0x11111111 (4-bit), 0x01010101 (8-bit). Undefined for widths that do not divide 32.
    """
    if 32 % bits:
        raise FormatError(f"the v1 whole-word zero convention needs bits dividing 32, not {bits}")
    return sum(1 << (bits * k) for k in range(32 // bits))


def pack_multiple(bits: int) -> int:
    """How many codes one packed dimension must be a multiple of: 32/b words' worth, or 32 for 3-bit."""
    return 32 // bits if 32 % bits == 0 else 32


GPTQ_MULTIPLES = {b: pack_multiple(b) for b in GPTQ_BITS}


def _resolve_convention(convention: str | None, bits: int, version: int) -> str:
    if version == 2:
        return V2
    c = (convention or "word").lower().replace("_", "-")
    c = {"word": V1_WORD, "field": V1_FIELD}.get(c, c)
    if c not in (V1_WORD, V1_FIELD):
        raise UsageError(f"unknown GPTQ v1 zero convention '{convention}'",
                         fix="use 'word' (GPTQModel whole-word add, default) or 'field' (per-field z-1)")
    if c == V1_WORD and 32 % bits:
        return V1_FIELD  # no whole-word constant exists; every known writer goes field by field
    return c


def decode_qzeros(qzeros: torch.Tensor, bits: int, out_features: int, convention: str) -> torch.Tensor:
    """qzeros int32 [n_groups, O*b/32] -> true zeros uint8 [n_groups, O] under one convention.

    convention: "v2" (stored = z), "v1-word" (add the whole-word constant mod 2^32, then split fields;
    3-bit falls back to per field) or "v1-field" (per field: (stored + 1) & mask).
    """
    mask = (1 << bits) - 1
    if convention == V2:
        return unpack_stream(qzeros, bits, out_features, dim=1)
    if convention == V1_WORD and 32 % bits == 0:
        words = to_int32((to_uint32(qzeros) + v1_word_constant(bits)) & 0xFFFFFFFF)
        return unpack_stream(words, bits, out_features, dim=1)
    if convention in (V1_WORD, V1_FIELD):
        stored = unpack_stream(qzeros, bits, out_features, dim=1)
        return ((stored.to(torch.int16) + 1) & mask).to(torch.uint8)
    raise UsageError(f"unknown zero convention '{convention}'", fix=f"use one of {', '.join(CONVENTIONS)}")


def encode_qzeros(zeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """True zeros uint8 [n_groups, O] -> qzeros int32 [n_groups, O*b/32] under one convention.

    "v1-word" reproduces GPTQModel's writer (whole-word subtraction, borrowing across fields where a zero
    is 0); "v1-field" wraps a zero of 0 to 2^b - 1. Both are exposed so tools and tests can state the
    relation; the `gptq` format's pack refuses zeros of 0 before either is reached, so what it writes is
    the same under both.
    """
    mask = (1 << bits) - 1
    if convention == V2:
        return pack_stream(zeros, bits, dim=1)
    if convention == V1_WORD and 32 % bits == 0:
        v2 = to_uint32(pack_stream(zeros, bits, dim=1))
        return to_int32((v2 - v1_word_constant(bits)) & 0xFFFFFFFF)
    if convention in (V1_WORD, V1_FIELD):
        stored = ((zeros.to(torch.int16) - 1) & mask).to(torch.uint8)
        return pack_stream(stored, bits, dim=1)
    raise UsageError(f"unknown zero convention '{convention}'", fix=f"use one of {', '.join(CONVENTIONS)}")


@dataclass(frozen=True)
class ZeroEvidence:
    """What the stored qzeros say about their own convention (for `inspect --deep`).

    decoded:         convention -> true zeros uint8 [n_groups, O] under that reading ("v2", "v1-word",
                     "v1-field"; for 3-bit the two v1 readings are the same per-field decode)
    midpoint:        convention -> True when every zero reads as 2^(b-1) (symmetric) under it
    word_field_diff: number of zero fields where the v1 word and field readings disagree (0 = the v1
                     encodings are indistinguishable here, i.e. no v1 zero of 0 was stored)
    stored_max:      number of raw fields equal to 2^b - 1 (what a v1 zero of 0 looks like on disk)
    verdict:         "v2", "v1", or None when the data cannot decide (asymmetric zeros read validly both ways)
    reason:          one line explaining the verdict
    """

    bits: int
    decoded: dict
    midpoint: dict
    word_field_diff: int
    stored_max: int
    verdict: str | None
    reason: str


def zero_convention_evidence(qzeros: torch.Tensor, bits: int, out_features: int) -> ZeroEvidence:
    """Decode GPTQ qzeros int32 [n_groups, O*b/32] under v2, v1-word and v1-field and judge which fits.

    Symmetric data decides v1 vs v2: midpoint zeros store 2^(b-1) under v2 and 2^(b-1) - 1 under v1, so a
    file labelled v1 whose zeros all read as 2^(b-1) + 1 (9 for 4-bit) is really v2, and vice versa.
    Asymmetric zeros are valid under both readings, so the verdict is None and the config decides; the
    word/field disagreement count says whether the v1 reading convention matters for this tensor.
    """
    mid = 1 << (bits - 1)
    decoded = {c: decode_qzeros(qzeros, bits, out_features, c) for c in CONVENTIONS}
    midpoint = {c: bool(z.numel() > 0 and (z == mid).all()) for c, z in decoded.items()}
    diff = int((decoded[V1_WORD] != decoded[V1_FIELD]).sum())
    stored_max = int((unpack_stream(qzeros, bits, out_features, dim=1) == (1 << bits) - 1).sum())
    if midpoint[V2]:
        verdict, reason = V2, f"every zero is {mid} read as v2 (it would be {mid + 1} as v1): symmetric v2 data"
    elif midpoint[V1_WORD] or midpoint[V1_FIELD]:
        verdict, reason = "v1", f"every zero is {mid} read as v1 (stored {mid - 1}): symmetric v1 data"
    else:
        verdict = None
        reason = "asymmetric zeros read validly as v1 and as v2; the checkpoint config decides"
        if diff:
            reason += (f"; v1 word and field readings differ in {diff} fields (GPTQModel files need the "
                       f"word reading)")
    return ZeroEvidence(bits, decoded, midpoint, diff, stored_max, verdict, reason)


def infer_group_size(in_features: int, n_groups: int, fmt: str) -> int:
    """group_size from shapes when the config is silent: one group -> -1, else I / n_groups."""
    if n_groups == 1:
        return -1
    if n_groups <= 0 or in_features % n_groups:
        raise FormatError(f"{fmt}: cannot infer group_size from in_features {in_features} and {n_groups} groups",
                          fix="give group_size in the checkpoint config")
    return in_features // n_groups


def read_g_idx(tensors: dict, in_features: int, n_groups: int, group_size: int, fmt: str) -> torch.Tensor | None:
    """g_idx int32 [I] from the file, or None when absent or equal to the trivial i // G map."""
    if "g_idx" not in tensors:
        return None
    g = expect(tensors, "g_idx", fmt, dims=1)
    if g.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"{fmt}: 'g_idx' must be int32, got {g.dtype}", tensor="g_idx")
    if g.shape[0] != in_features:
        raise FormatError(f"{fmt}: g_idx has {g.shape[0]} entries but qweight holds {in_features} input rows",
                          tensor="g_idx")
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= n_groups):
        raise FormatError(f"{fmt}: g_idx values span [{int(g.min())}, {int(g.max())}] but there are "
                          f"{n_groups} groups", tensor="g_idx")
    eff = in_features if group_size == -1 else group_size
    trivial = torch.arange(in_features, dtype=torch.int64) // eff
    if torch.equal(g.to(torch.int64), trivial):
        return None
    return g.to(torch.int32).contiguous()


SCHEME_KEYS = ("bits", "group_size", "sym", "desc_act")
# The model's LM head (the output embedding: `lm_head`, ChatGLM's `output_layer`, GPT-NeoX's `embed_out`), the
# names pack keeps dense unless --include names them. vLLM builds it as a ParallelLMHead, which its GPTQ configs
# quantize only under `"lm_head": true`, as GPTQModel's QuantizeConfig.lm_head does.
LM_HEAD = re.compile(r"(^|\.)(lm_head|output_layer|embed_out)(\.|$)")


def is_lm_head(module: str) -> bool:
    return LM_HEAD.search(module) is not None


def majority(keys) -> tuple:
    """The most common of `keys` (the first seen among equals)."""
    return Counter(keys).most_common(1)[0][0]


def majority_and_overrides(schemes, dense=()) -> tuple[tuple, dict]:
    """(base, dynamic) for `schemes`, [(module name, (bits, group_size, sym, desc_act))]: the majority tuple
    as the base scheme, GPTQModel `dynamic` overrides ("+:^name$": the fields that differ) for the modules
    that differ, and exclusions ("-:^name$") for the linear modules kept dense. The GPTQ family, AWQ and Marlin
    configs share this shape."""
    base = majority(k for _n, k in schemes)
    dynamic = dense_exclusions(dense)
    for name, k in schemes:
        if k != base:
            dynamic[f"+:^{re.escape(name)}$"] = {f: v for f, v, b in zip(SCHEME_KEYS, k, base, strict=True)
                                                 if v != b}
    return base, dynamic


def gptqmodel_config(fmt: Format, modules, dense=()) -> dict:
    """The majority scheme of `modules` as the base config, GPTQModel `dynamic` overrides for modules that
    differ and exclusions for the linear modules kept dense (majority_and_overrides)."""
    base, dynamic = majority_and_overrides(
        [(name, (s.bits, s.group_size, bool(s.sym), bool(s.desc_act))) for name, s, _m in modules], dense)
    return fmt.config_for(*base, {"dynamic": dynamic} if dynamic else None,
                          lm_head=any(is_lm_head(name) for name, _s, _m in modules))


def dense_exclusions(dense) -> dict:
    """GPTQModel / vLLM `dynamic` entries that keep linear modules out of quantization ("-:^name$"). A dense
    lm_head needs none: the config's `"lm_head": false` keeps it so."""
    return {f"-:^{re.escape(m)}$": {} for m in dense if m.rpartition(".")[2] != "lm_head"}


def quantizer_meta() -> dict:
    from qtool import __version__

    return {"quantizer": [f"qtool:{__version__}"]}


def gptq_shaped(t: Mapping[str, Sig]) -> bool:
    """A complete int32 qweight module whose qweight keeps O columns and whose qzeros has one row per scale
    row: the GPTQ family's shapes (AWQ and GEMV detectors ask it to leave GPTQ files alone)."""
    qz = t.get("qzeros")
    n_groups, out = t["scales"][1]
    return t["qweight"][1][1] == out and qz is not None and qz[1][0] == n_groups


def _detect_gptq(t: Mapping[str, Sig], c: Claims) -> Detected:
    qw = t["qweight"][1]
    n_groups, out = t["scales"][1]
    qz = t["qzeros"][1]
    notes: list[tuple[str, str]] = []
    bits = exact_div(qz[1] * 32, out)
    if bits is None or bits not in PLANAR_BITS:
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
    elif c.format in ("ct", "ct_fp8", "ct_nvfp4", "fp8", "bnb", "marlin"):
        notes.append(("error", f"config says {c.format} but the tensors have the GPTQ layout"))
    # No config (c.format None): the file-level "no config" finding covers it.
    if fmt == "gptq" and 32 % bits and c.format is None:  # 3, 5, 6, 7 bits: codes straddle words
        notes.append(("warning", f"{bits}-bit qweight without a config: continuous (gptq) and planar (gptq_p) "
                                 "layouts have the same shapes; assuming continuous"))
    if fmt in ("gptq", "gptq_v2") and bits not in GPTQ_BITS:
        notes.append(("error", f"{bits}-bit codes have no continuous GPTQ layout ({', '.join(map(str, GPTQ_BITS))}); "
                               "fix: checkpoint_format: gptq_p if the file is planar"))
    group, gnote = group_from(in_f, n_groups, c.group_size)
    if gnote:
        notes.append(("error", gnote))
    notes += bits_note(c, bits)
    return Detected(fmt, bits, group, c.sym, c.desc_act, in_f, out, (in_f or 0) * out or None,
                    detail=f"qweight [{qw[0]}, {qw[1]}]", notes=notes)


class GptqFamily(Format):
    """Shared pack/unpack of the GPTQ-style tensor set; subclasses fix the bit packer and zero convention.

    `version` 1 stores z - 1 (v1), 2 stores z; gptq_p overrides the bit layout hooks.
    """

    version: int = 2

    # --- detection (header only) ------------------------------------------------------------------
    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """Every module with a `qweight` that the layouts asked before (Marlin, int16 words, AWQ) left: the
        GPTQ family when qweight [I*b/32, O], qzeros [nG, O*b/32] and scales [nG, O] agree, else an unknown
        layout with the reason. The three ids share shapes: the config names which one (gptq by default)."""
        if "qweight" not in t:
            return None
        qw_dt, qw = t["qweight"]
        sc, qz = t.get("scales"), t.get("qzeros")
        if sc is None or len(qw) != 2 or len(sc[1]) != 2:
            missing = [n for n in self.spec.required if n not in t]
            return Detected("unknown", notes=[("error", f"qweight {list(qw)} without {missing or 'a 2-D scales'}: "
                                                        "incomplete or unknown layout")])
        if qw_dt != "I32":
            return Detected("unknown", notes=[("error", f"qweight is {qw_dt}; GPTQ/AWQ pack into int32")])
        if not gptq_shaped(t):
            return Detected("unknown", notes=[("error", f"qweight {list(qw)}, qzeros {list(qz[1]) if qz else None}, "
                                                        f"scales {list(sc[1])} match no GPTQ/AWQ layout")])
        return _detect_gptq(t, claims)

    # --- bit layout hooks (overridden by gptq_p) -------------------------------------------------
    def _pack_codes(self, codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
        return pack_stream(codes, bits, dim=dim)

    def _unpack_codes(self, words: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
        return unpack_stream(words, bits, n, dim=dim)

    # --- check / pack ------------------------------------------------------------------------------
    def check(self, plain: Plain) -> list[str]:
        why = super().check(plain)
        if plain.g_idx is not None:
            expected = 1 if plain.group_size == -1 else -(-plain.in_features // plain.group_size)
            if plain.n_groups != expected:
                why.append(f"{self.spec.id} stores ceil(I/G) = {expected} groups for group_size "
                           f"{plain.group_size}, but the act-order map uses {plain.n_groups}")
        why += plain.check_ranges()
        if self.version == 1 and plain.zeros is not None and bool((plain.zeros == 0).any()):
            n = int((plain.zeros == 0).sum())
            why.append(f"gptq (v1) stores z - 1, so a zero point of 0 ({n} groups here) has no encoding; "
                       f"write --to gptq_v2")
        return why

    def pack(self, plain: Plain) -> dict[str, torch.Tensor]:
        """Plain -> {"qweight", "qzeros", "scales", "g_idx"} (dtypes and shapes in the module docstring).

        Raises NotRepresentable listing every reason from check().
        """
        why = self.check(plain)
        if why:
            fix = "write --to gptq_v2" if any("zero point of 0" in w for w in why) else None
            raise NotRepresentable(f"cannot store this weight as {self.spec.id}: " + "; ".join(why), fix=fix)
        b = plain.bits
        qweight = self._pack_codes(plain.qweight.t(), b, dim=0)
        zeros = plain.zeros_or_midpoint().t()
        if self.version == 1:
            # No zero is 0 here, so the per-field and whole-word v1 encodings are the same bytes.
            zeros = zeros - 1
        qzeros = self._pack_codes(zeros.contiguous(), b, dim=1)
        return {
            "qweight": qweight.contiguous(),
            "qzeros": qzeros.contiguous(),
            "scales": plain.scales.t().contiguous(),
            "g_idx": plain.group_index().to(torch.int32).contiguous(),
        }

    # --- config ------------------------------------------------------------------------------------
    def config_for(self, bits: int, group_size: int, sym: bool, desc_act: bool, extra: dict | None = None, *,
                   lm_head: bool = False) -> dict:
        """The `quantization_config` transformers, GPTQModel and vLLM read; `extra` merged last. lm_head: the
        output holds the LM head quantized (is_lm_head): vLLM and GPTQModel build it packed only when the
        config says `"lm_head": true`, and a dense one otherwise, which finds no `weight` to load."""
        cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
               "checkpoint_format": self.spec.id, "format": self.spec.id, "pack_dtype": "int32", "lm_head": lm_head,
               "meta": quantizer_meta()}
        return cfg | (extra or {})

    def quantization_config(self, modules, dense=None) -> dict:
        return gptqmodel_config(self, modules, dense or ())

    # --- unpack ------------------------------------------------------------------------------------
    def decode_zeros(self, qzeros: torch.Tensor, bits: int, out_features: int, params: QuantScheme):
        """qzeros int32 [R, O*b/32] (any R group rows) -> (true zero points uint8 [R, O], the convention read:
        "v2", "v1-word" or "v1-field", from the version and params.convention; see decode_qzeros). The same
        decoding unpack uses, for callers that read the zeros alone (repack checks a config's sym against them
        before planning)."""
        conv = _resolve_convention(params.convention, bits, self.version)
        return decode_qzeros(qzeros, bits, out_features, conv), conv

    def unpack(self, tensors: dict[str, torch.Tensor], params: QuantScheme) -> Plain:
        """{"qweight", "qzeros", "scales"[, "g_idx"]} -> Plain; bits and group_size inferred from shapes
        when params leave them None. Records the zero convention read in meta["gptq_zero_convention"]."""
        fid = self.spec.id
        qweight = expect(tensors, "qweight", fid, dtype=torch.int32, dims=2)
        qzeros = expect(tensors, "qzeros", fid, dtype=torch.int32, dims=2)
        scales = expect(tensors, "scales", fid, dims=2)
        if scales.dtype not in FLOAT_DTYPES:
            raise FormatError(f"{fid}: 'scales' must be fp16/bf16/fp32, got {scales.dtype}", tensor="scales")
        n_groups, out_features = scales.shape
        if qzeros.shape[0] != n_groups:
            raise FormatError(f"{fid}: qzeros has {qzeros.shape[0]} group rows, scales {n_groups}", tensor="qzeros")
        if qweight.shape[1] != out_features:
            raise FormatError(f"{fid}: qweight has {qweight.shape[1]} columns, scales {out_features}",
                              tensor="qweight")
        bits = params.bits
        if bits is None:
            if out_features == 0 or (qzeros.shape[1] * 32) % out_features:
                raise FormatError(f"{fid}: cannot infer bits from qzeros {tuple(qzeros.shape)} and "
                                  f"{out_features} outputs", fix="give bits in the checkpoint config")
            bits = qzeros.shape[1] * 32 // out_features
        if bits not in self.spec.bits:
            raise FormatError(f"{fid} holds {', '.join(map(str, self.spec.bits))}-bit codes, not {bits}-bit",
                              tensor="qweight")
        if qzeros.shape[1] * 32 != out_features * bits:
            raise FormatError(f"{fid}: qzeros has {qzeros.shape[1]} words per group row; {out_features} "
                              f"{bits}-bit zeros need {out_features * bits / 32:g}", tensor="qzeros")
        if (qweight.shape[0] * 32) % bits:
            raise FormatError(f"{fid}: qweight rows {qweight.shape[0]} do not hold whole {bits}-bit codes",
                              tensor="qweight")
        in_features = qweight.shape[0] * 32 // bits
        group_size = params.group_size if params.group_size is not None else \
            infer_group_size(in_features, n_groups, fid)
        expected = 1 if group_size == -1 else -(-in_features // max(group_size, 1))
        if group_size == 0 or group_size < -1 or n_groups != expected:
            raise FormatError(f"{fid}: {n_groups} scale rows do not match in_features {in_features} with "
                              f"group_size {group_size} (expected {expected})", tensor="scales",
                              fix="check group_size in the checkpoint config")
        g_idx = read_g_idx(tensors, in_features, n_groups, group_size, fid)
        codes = self._unpack_codes(qweight, bits, in_features, dim=0).t().contiguous()
        zeros, conv = self.decode_zeros(qzeros, bits, out_features, params)
        zeros = zeros.t().contiguous()
        if bool((zeros == (1 << (bits - 1))).all()):
            zeros = None  # symmetric: Plain's None means the midpoint
        return Plain(codes, scales.t().contiguous(), zeros, g_idx, bits, group_size,
                     meta={"format": fid, META_KEY: conv})


@register
class GptqV1(GptqFamily):
    spec = FormatSpec(
        id="gptq",
        aliases=("gptq_v1",),
        bits=GPTQ_BITS,
        tensors=("qweight", "qzeros", "scales", "g_idx"),
        required=("qweight", "scales", "qzeros"),
        summary="GPTQ v1 (stores z-1): qweight int32 [I*b/32, O] little-endian bit stream along I, "
                "qzeros [ceil(I/G), O*b/32], scales [ceil(I/G), O], g_idx [I]",
        act_order=True,
        in_multiple=GPTQ_MULTIPLES,
        out_multiple=GPTQ_MULTIPLES,
    )
    version = 1


@register
class GptqV2(GptqFamily):
    spec = FormatSpec(
        id="gptq_v2",
        bits=GPTQ_BITS,
        tensors=("qweight", "qzeros", "scales", "g_idx"),
        required=("qweight", "scales", "qzeros"),
        summary="GPTQ v2 (stores true z): qweight int32 [I*b/32, O] little-endian bit stream along I, "
                "qzeros [ceil(I/G), O*b/32], scales [ceil(I/G), O], g_idx [I]",
        act_order=True,
        in_multiple=GPTQ_MULTIPLES,
        out_multiple=GPTQ_MULTIPLES,
    )
    version = 2
