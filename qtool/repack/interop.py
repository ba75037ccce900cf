"""What a repack between containers adds so the output loads in the other side's tools: a GGUF source written
as a Hugging Face directory gets transformers' tensor names, row order, embeddings and config; per-tensor GGUF
types are kept or overridden (`--tensor-type`). The architecture facts are in qtool.io.hf_gguf.

GGUF -> Hugging Face:
- names: the gguf package's tensor-name map, inverted (hf_gguf.inverse_name_map); a block tensor it lacks (an
  expert, a q/k norm) refuses the conversion, since the model would run without it; one outside the blocks keeps
  its GGUF name and the plan says transformers will not read it; an architecture with no transformers mapping
  is refused;
- llama.cpp's llama3 RoPE factors (rope_freqs.weight) go back into config.json rope_scaling where that is exact;
  GGUF keys of the architecture that config.json does not carry are named;
- q/k rows of Llama-family models go back from llama.cpp's rotary pair order (an exact row permutation of the
  canonical Plain, or of the dequantized weight);
- modules outside the transformer blocks (token embeddings, output) are what transformers reads as dense
  tensors: written dequantized as float32, which holds every GGUF block value exactly;
- config.json from the GGUF metadata, and the tokenizer files from its tokenizer.* keys.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from qtool.errors import InputError, UsageError

BLOCK = re.compile(r"^blk\.\d+\.")


def dense_modules_for_hf(source, plan) -> None:
    """GGUF source, Hugging Face target: modules outside the blocks are written dequantized (float32), and
    tensors that become config.json entries (llama3 rope_freqs) are said and not copied."""
    for mp in plan.modules:
        if not BLOCK.match(mp.module) and mp.kind != "impossible":
            mp.kind, mp.copy, mp.steps = "keep", False, ["dequantize"]
            mp.reasons = ["outside the transformer blocks: transformers reads it as a dense tensor; written "
                          "dequantized as F32 (every block value exactly)"]
    g2h = hf_view(source)
    plan.warnings += g2h.notes
    plan.passthrough -= len(g2h.folded)


ROPE_FREQS = "rope_freqs.weight"


def hf_view(source) -> GGUFToHF | None:
    """The GGUF source's Hugging Face view (None for a safetensors source), built once: planning and writing
    read the same one."""
    if source.container != "gguf":
        return None
    if source._hf is None:
        source._hf = GGUFToHF(source)
    return source._hf


class GGUFToHF:
    """Names, row orders and config of a GGUF source written as a Hugging Face directory."""

    def __init__(self, source):
        from qtool.io.hf_gguf import arch_row, blocks_present, gguf_to_hf_name, hf_config, inverse_name_map

        self.source = source
        self.arch = source.architecture
        self.row = arch_row(self.arch)
        kv = source.metadata
        # an architecture with no transformers mapping is refused here, before anything is written
        try:
            self.config = hf_config(self.arch, kv, source.order)
        except InputError as e:
            if e.path is not None:
                raise
            raise InputError(e.problem, path=source.path, tensor=e.tensor, fix=e.fix) from None
        self.n_head = _int(kv.get(f"{self.arch}.attention.head_count"))
        self.n_kv = _int(kv.get(f"{self.arch}.attention.head_count_kv")) or self.n_head
        self.inverse = inverse_name_map(self.arch, blocks_present(source.order, source.path))
        # GGUF tensors that become config.json entries instead of tensors: {name: what the plan says of it}
        self.folded: dict[str, str] = {}
        self.notes: list[str] = []
        if ROPE_FREQS in source.order:
            self._fold_rope(kv)
        self.unmapped = [n for n in source.order if n not in self.folded and gguf_to_hf_name(self.inverse, n) is None]
        lost = [n for n in self.unmapped if BLOCK.match(n)]
        if lost:
            raise InputError(f"{len(lost)} tensors of the transformer blocks have no name in transformers' "
                             f"{self.row.hf_class} (e.g. {', '.join(lost[:3])}): the Hugging Face model would "
                             "run without them; nothing was written", path=source.path,
                             fix="keep the model as GGUF (--to q4_0, q4_1, q8_0)")
        self._note_uncarried(kv)

    def _note_uncarried(self, kv: dict) -> None:
        from qtool.io.hf_gguf import uncarried_keys

        keys = uncarried_keys(self.arch, kv)
        if keys:
            shown = ", ".join(f"{k} = {str(kv[k])[:24]}" for k in keys[:4]) + (" ..." if len(keys) > 4 else "")
            self.notes.append(f"{len(keys)} GGUF key(s) of {self.arch} have no config.json entry here and are "
                              f"not carried ({shown}): check that the model does not depend on them")

    def _fold_rope(self, kv: dict) -> None:
        """llama.cpp's llama3 RoPE factors back into transformers' `rope_scaling`, where one reproduces them
        bit for bit; otherwise the tensor keeps its GGUF name and the plan says that transformers ignores it."""
        from qtool.io.hf_gguf import rope_scaling_from_factors

        info = self.source.tensor_info(ROPE_FREQS)
        orig = _int(kv.get(f"{self.arch}.rope.scaling.original_context_length"))
        rs = None
        if info.type_name == "F32" and len(info.shape) == 1:
            rs = rope_scaling_from_factors(self.arch, self.config, self.source.get(ROPE_FREQS).numpy(), orig)
        if rs is None:
            self.notes.append(f"{ROPE_FREQS}: its per-frequency RoPE factors match no llama3 rope_scaling (checked "
                              "by recomputing them); it keeps its GGUF name, which transformers does not read, so "
                              "transformers runs this model with unscaled RoPE")
            return
        self.config["rope_scaling"] = rs
        said = ", ".join(f"{k} {v:g}" for k, v in rs.items() if k != "rope_type")
        self.folded[ROPE_FREQS] = f"llama3 RoPE factors written as config.json rope_scaling ({said})"
        self.notes.append(f"{ROPE_FREQS}: {self.folded[ROPE_FREQS]}, which gives back all {info.shape[0]} "
                          "factors bit for bit")

    def name(self, gguf_name: str) -> str:
        from qtool.io.hf_gguf import gguf_to_hf_name

        return gguf_to_hf_name(self.inverse, gguf_name) or gguf_name

    def module(self, gguf_module: str) -> str:
        return self.name(gguf_module + ".weight").removesuffix(".weight")

    def rows(self, gguf_name: str):
        """The row permutation back to Hugging Face's order for this tensor, or None."""
        from qtool.io.hf_gguf import rotary_heads, rotary_rows

        heads = rotary_heads(self.arch, gguf_name, self.n_head, self.n_kv)
        if heads is None:
            return None
        n = self.source.tensor_info(gguf_name).shape
        return rotary_rows(n[-1] if len(n) > 1 else n[0], heads, False, gguf_name)

    def warnings(self) -> list[str]:
        if not self.unmapped:
            return []
        return [f"{len(self.unmapped)} tensors outside the blocks have no transformers name in the gguf package's "
                f"map for {self.arch} and keep their GGUF names ({', '.join(self.unmapped[:3])}): transformers "
                "does not read them"]

    def write_files(self, tmp: Path) -> list[str]:
        """The tokenizer files, and sentence-transformers' pooling where the GGUF names one; `config` is the
        config.json (without quantization_config: the caller adds it). The tokenizer is in the first file of a
        split set."""
        from qtool.io.hf_gguf import hf_tokenizer_files, sentence_transformers_files, write_files

        files, warns = hf_tokenizer_files(self.source.gguf_header.path)
        write_files(tmp, files | sentence_transformers_files(self.arch, self.source.metadata))
        return warns


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def permute_plain_rows(plain, idx):
    """The same quantized weight with its output rows reordered (out row r = in row idx[r]): codes, scales and
    zero points move together, so every dequantized value moves exactly."""
    return plain.with_(qweight=plain.qweight[idx], scales=plain.scales[idx],
                       zeros=None if plain.zeros is None else plain.zeros[idx])


def renamed(conv: list, rename) -> list:
    """ModulePlans with their module names as the output names them (for the configs written)."""
    return [replace(m, module=rename(m.module)) for m in conv]


# --- per-tensor GGUF types ------------------------------------------------------------------------------------
def parse_tensor_types(specs: tuple[str, ...]) -> list[tuple[re.Pattern, str]]:
    """`--tensor-type REGEX=TYPE` flags -> [(compiled regex, GGML type name)], in order (the first match wins)."""
    import gguf

    from qtool.repack.plan import _compile

    out = []
    for s in specs:
        rx, sep, typ = s.rpartition("=")
        if not sep or not rx:
            raise UsageError(f"--tensor-type '{s}' is not REGEX=TYPE", fix="e.g. --tensor-type 'token_embd=Q8_0'")
        name = typ.strip().upper()
        if name not in gguf.GGMLQuantizationType.__members__ or name not in WRITABLE:
            raise UsageError(f"--tensor-type '{s}': {typ} is not a GGUF type qtool writes",
                             fix=f"one of {', '.join(WRITABLE)}")
        out.append((_compile(rx, "--tensor-type"), name))
    return out


# GGML types qtool writes as targets of --tensor-type: those whose encoder the gguf package has
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def type_for(rules: list[tuple[re.Pattern, str]], *names: str) -> str | None:
    for rx, typ in rules:
        if any(rx.search(n) for n in names):
            return typ
    return None


def encode_as(w, type_name: str):
    """(uint8 bytes [O, row_bytes] or a float array, exact): `w` (float32 torch [O, I]) stored as a GGML type
    by the gguf package's encoder, and whether the stored values equal w bit for bit."""
    import gguf
    import numpy as np
    import torch

    qt = gguf.GGMLQuantizationType[type_name]
    a = w.to(torch.float32).numpy()
    if type_name == "F32":
        return a, True
    if type_name == "F16":
        h = a.astype(np.float16)
        return h, bool(np.array_equal(h.astype(np.float32), a))
    raw = gguf.quants.quantize(a, qt)
    back = gguf.quants.dequantize(raw, qt).reshape(a.shape)
    return raw, bool(np.array_equal(back.astype(np.float32), a))


def type_nbytes(type_name: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of numpy shape [..., I] stored as a GGML type (None when I does not fill blocks)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    n = 1
    for d in shape:
        n *= d
    if shape[-1] % block:
        return None
    return n // block * size


def plan_gguf_types(source, plan, conv) -> dict[str, str]:
    """Per-tensor GGUF types of a GGUF target, decided before anything is written. Returns {source name of a
    float tensor outside the modules: GGML type} for --tensor-type rules that name one; modules get their
    type in ModulePlan.target_meta["gguf_type"] (a --tensor-type rule), or are copied in their own type (a
    GGUF source's modules of a type other than its dominant one: GGUF files are mixed by nature)."""
    from collections import Counter

    from qtool.errors import NotRepresentable
    from qtool.io.gguf_writer import NameMap, name_mapper, resolve_arch
    from qtool.io.hf_gguf import blocks_present, skip_reason

    job = plan.job
    rules = parse_tensor_types(job.tensor_type)
    by_name = {m.name: m for m in source.modules}
    gguf_src = source.container == "gguf"
    arch = None if gguf_src else resolve_arch(source.config, None)
    # a rule may name a tensor by its source name or by its GGUF one
    mapped = NameMap() if gguf_src or not rules else name_mapper(arch, blocks_present(source.order, source.path))
    dominant = Counter(m.scheme.format for m in source.modules).most_common(1)[0][0] if source.modules else None
    # tensors llama.cpp does not load are left out (the writer names each one); the count says what is copied
    plan.passthrough -= sum(1 for n in source.passthrough if skip_reason(arch, n))
    for mp in plan.modules:
        m = by_name[mp.module]
        why = skip_reason(arch, f"{m.name}.weight")
        if mp.kind == "keep" and not gguf_src and not why:
            # GGUF has no form for the source's packed layout: the module is written as the float tensor its
            # dequantization gives, in its scales' dtype (the writer's "dense" job)
            sd = {"F16": "F16", "BF16": "BF16"}.get(m.scale_dtype or "F16", "F32")
            mp.copy, mp.steps, mp.target_meta = False, [f"dequantize to {sd}"], {"dense_type": sd}
            mp.reasons = [f"not selected by --include/--exclude: GGUF cannot hold its {m.scheme.format} layout, so "
                          f"it is written as its dequantized weight in {sd}"]
            continue
        if why:
            mp.kind, mp.copy, mp.steps, mp.reasons = "dropped", False, [], [f"left out of the GGUF: {why}"]
            mp.dropped = [n for n in m.layout.values()]
            continue
        typ = type_for(rules, f"{m.name}.weight", m.layout.get("weight", ""), mapped(f"{m.name}.weight"))
        if typ is None:
            if gguf_src and m.scheme.format != dominant and not mp.copy and mp.kind != "impossible":
                own = m.scheme.extra.get("gguf_type", m.scheme.format)
                mp.kind, mp.copy, mp.steps, mp.dst_format = "exact", True, [], m.scheme.format
                mp.to_bits, mp.to_group_size, mp.to_sym = m.scheme.bits, m.scheme.group_size, m.scheme.sym
                mp.reasons = [f"keeps its own type {own} (the file's other modules are "
                              f"{dominant.removeprefix('gguf:').removeprefix('gguf_').upper()}; "
                              "--tensor-type overrides)"]
            continue
        mp.dst_format = f"gguf:{typ}"
        if gguf_src and m.scheme.extra.get("gguf_type") == typ:
            mp.kind, mp.copy, mp.steps = "exact", True, []
            mp.reasons = [f"--tensor-type {typ}: already {typ}; copied"]
            continue
        if type_nbytes(typ, tuple(mp.shape or (1, 1))) is None:
            mp.kind, mp.copy = "impossible", False
            mp.reasons = [f"--tensor-type {typ}: in_features {mp.shape[1]} does not fill its blocks"]
            continue
        w = module_weight(conv, m)
        _, exact = encode_as(w, typ)
        mp.copy, mp.steps = False, [f"encode {typ}"]
        mp.kind = "exact" if exact else "lossy"
        mp.target_meta = {"gguf_type": typ}
        mp.reasons = [f"--tensor-type {typ}: " + ("every value stored exactly" if exact else
                                                   "the values change (requantized)")]
    floats: dict[str, str] = {}
    if rules:
        in_modules = {n for m in source.modules for n in [*m.layout.values(), *m.others, *m.extra]}
        for name in source.passthrough:
            typ = type_for(rules, name, mapped(name))
            if typ is None or name in in_modules:
                continue
            info = source.tensor_info(name)
            kind = getattr(info, "type_name", None) or getattr(info, "dtype", "")
            shape = tuple(reversed(info.shape)) if gguf_src else tuple(info.shape)
            if kind not in ("F32", "F16", "BF16") or len(shape) != 2 or type_nbytes(typ, shape) is None:
                raise NotRepresentable(f"--tensor-type {typ}: only 2-D float tensors whose rows fill its blocks "
                                       f"are stored as another type ({kind} {list(shape)})", path=source.path,
                                       tensor=name, fix="narrow the --tensor-type pattern")
            _, exact = encode_as(source.get(name).float(), typ)
            if not exact and not job.allow_lossy:
                raise NotRepresentable(f"--tensor-type {typ} changes its values", path=source.path, tensor=name,
                                       fix="pass --allow-lossy to store it anyway, or narrow the pattern")
            plan.warnings.append(f"{name}: {kind} -> {typ} (--tensor-type; {'exact' if exact else 'lossy'})")
            floats[name] = typ
    plan.passthrough -= len(floats)
    return floats


def module_weight(conv, m):
    """float32 [O, I]: what the module's source decodes to."""
    from qtool.errors import NotRepresentable

    try:
        plain = conv.source_plain(m)
    except NotRepresentable:  # GGUF Q4_1 offsets that are no integer zero point: the blocks still decode
        plain = None
    return conv.source_weight(m, plain)
