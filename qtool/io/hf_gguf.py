"""What llama.cpp and transformers each expect of a model, per architecture, so a conversion between a Hugging
Face directory and a GGUF file gives a file the other side loads.

One row per architecture (ARCHS): the llama.cpp architecture, the transformers model_type and class, the
Hugging Face name prefixes used to invert the gguf package's tensor-name map, the tensors llama.cpp's own
converter leaves out, and whether the rotary projections' rows are in llama.cpp's order. Everything else comes
from the gguf package: tensor names (`gguf.get_tensor_name_map`), metadata keys and their value types (the
`GGUFWriter.add_*` methods), the vocabulary readers (`gguf.vocab.BpeVocab`, `gguf.vocab.SpecialVocab`), token
types and pooling types.

Facts from llama.cpp's convert_hf_to_gguf.py and transformers' GGUF loader:
- BERT: tokenizer model "bert" with WordPiece tokens written in "phantom space" form (a word-initial piece gets
  a leading U+2581, a "##" continuation loses its "##", control tokens stay as they are); `bert.attention.causal`
  false; `bert.pooling_type` from sentence-transformers' 1_Pooling/config.json; `embeddings.position_ids`, the
  pooler and the masked-LM head are not loaded by llama.cpp.
- Llama: q_proj and k_proj rows are reordered from Hugging Face's half-split rotary layout to llama.cpp's
  interleaved pairs: per head, w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2) (k with the key-value head count);
  transformers undoes it on load. `rope.dimension_count` is the head dimension.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.errors import InputError


@dataclass(frozen=True)
class ArchRow:
    """One architecture. gguf_arch: llama.cpp's name; model_type / hf_class: what config.json says;
    hf_names: the transformers module names of this family (a regex: the gguf package's map lists the
    names of many families for one GGUF tensor, and inverting it picks the one this matches); skip: regexes of Hugging Face tensors llama.cpp does not load (left out, and said
    so); permute_qk: q/k rows are reordered for llama.cpp's rotary pairs; causal: decoder attention."""

    gguf_arch: str
    model_type: str
    hf_class: str
    hf_names: str
    skip: tuple[str, ...]
    permute_qk: bool
    causal: bool
    hidden_act: str


ARCHS: dict[str, ArchRow] = {
    "bert": ArchRow("bert", "bert", "BertModel",
                    r"embeddings\.((word|position|token_type)_embeddings|LayerNorm)|encoder\.layer\.\d+\.(attention\."
                    r"(self\.(query|key|value)|output\.(dense|LayerNorm))|intermediate\.dense|output\.(dense|LayerNorm))",
                    (r"^embeddings\.position_ids$", r"^pooler\.", r"^cls\."), False, False, "gelu"),
    "llama": ArchRow("llama", "llama", "LlamaForCausalLM",
                     r"lm_head|model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                     r"input_layernorm|post_attention_layernorm))",
                     (r"\.rotary_emb\.inv_freq$",), True, True, "silu"),
}
# config.json key <-> GGUFWriter method; the GGUF key each method writes is asked of the gguf package
HPARAMS = (("max_position_embeddings", "add_context_length"), ("hidden_size", "add_embedding_length"),
           ("intermediate_size", "add_feed_forward_length"), ("num_hidden_layers", "add_block_count"),
           ("num_attention_heads", "add_head_count"), ("num_key_value_heads", "add_head_count_kv"),
           ("rms_norm_eps", "add_layer_norm_rms_eps"), ("layer_norm_eps", "add_layer_norm_eps"),
           ("rope_theta", "add_rope_freq_base"), ("vocab_size", "add_vocab_size"),
           ("head_dim", "add_rope_dimension_count"),
           # mixture of experts (llama.cpp's converter: Qwen2/3-MoE, Mixtral's num_local_experts)
           ("num_experts", "add_expert_count"), ("num_local_experts", "add_expert_count"),
           ("num_experts_per_tok", "add_expert_used_count"), ("moe_intermediate_size", "add_expert_feed_forward_length"),
           ("shared_expert_intermediate_size", "add_expert_shared_feed_forward_length"))
FLOAT_HPARAMS = frozenset({"rms_norm_eps", "layer_norm_eps", "rope_theta"})
# YaRN parameters: transformers' rope_scaling key <-> llama.cpp's `{arch}.rope.scaling.<suffix>` (its converter's
# mapping; transformers also reads attention_factor as attn_factor)
YARN_KEYS = (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
             ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"))
# sentence-transformers pooling flags -> llama.cpp pooling type names (gguf.PoolingType)
POOLING = (("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
           ("pooling_mode_lasttoken", "LAST"))
POOLING_MODES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}  # sentence-transformers 6's pooling_mode
PHANTOM = "\u2581"


def arch_row(arch: str | None) -> ArchRow | None:
    return ARCHS.get(arch or "")


def gguf_key(arch: str, method: str) -> str:
    """The metadata key a GGUFWriter method writes for `arch` (the gguf package names it)."""
    import gguf

    w = gguf.GGUFWriter(None, arch)
    arg: Any = 1.0 if method in ("add_layer_norm_rms_eps", "add_layer_norm_eps", "add_rope_freq_base") else 1
    getattr(w, method)(arg)
    return list(w.kv_data[0])[-1]


# --- tensor names and row order ------------------------------------------------------------------------------
def skip_reason(arch: str | None, hf_name: str) -> str | None:
    """Why llama.cpp's converter leaves this Hugging Face tensor out (None: it is written)."""
    row = arch_row(arch)
    if row is None:
        return None
    for rx in row.skip:
        if re.search(rx, hf_name):
            return f"llama.cpp's {row.gguf_arch} graph does not load it (its converter leaves it out)"
    return None


def inverse_name_map(arch: str, n_blocks: int) -> dict[str, str]:
    """{GGUF tensor base name: Hugging Face base name} for `arch`, from the gguf package's map: of the
    Hugging Face names it lists for one GGUF name, the one the row's hf_names matches."""
    import gguf

    row = arch_row(arch)
    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(arch)
    if enum is None or row is None:
        return {}
    tmap = gguf.get_tensor_name_map(enum, n_blocks)
    ours = re.compile(row.hf_names)
    out: dict[str, str] = {}
    for hf, (_, gg) in tmap.mapping.items():
        if hf != gg and gg not in out and ours.fullmatch(hf):
            out[gg] = hf
    return out


def gguf_to_hf_name(inverse: dict[str, str], name: str) -> str | None:
    """`blk.0.attn_q.weight` -> `model.layers.0.self_attn.q_proj.weight` (None when the map lacks it)."""
    for suffix in (".weight", ".bias", ""):
        if suffix and not name.endswith(suffix):
            continue
        base = name[:len(name) - len(suffix)] if suffix else name
        if base in inverse:
            return inverse[base] + suffix
    return None


def rotary_heads(arch: str | None, gguf_name: str, n_head: int | None, n_head_kv: int | None) -> int | None:
    """The head count whose rotary row order differs between Hugging Face and llama.cpp for this tensor
    (attn_q: n_head; attn_k: n_head_kv), or None when its rows are the same in both."""
    row = arch_row(arch)
    if row is None or not row.permute_qk or not n_head:
        return None
    base = gguf_name.rsplit(".", 1)[0]
    if base.endswith(".attn_q"):
        return n_head
    if base.endswith(".attn_k"):
        return n_head_kv or n_head
    return None


def rotary_rows(n_rows: int, n_head: int, to_gguf: bool, name: str = ""):
    """int64 [n_rows]: out = w[idx] reorders the rows of a q/k projection (or its bias) from Hugging Face's
    half-split rotary layout to llama.cpp's interleaved pairs (to_gguf) or back."""
    import torch

    if n_head <= 0 or n_rows % (2 * n_head):
        raise InputError(f"{n_rows} rows do not split into {n_head} heads of rotary pairs", tensor=name,
                         fix="check num_attention_heads / num_key_value_heads")
    idx = torch.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2).reshape(-1)
    return idx if to_gguf else torch.argsort(idx)


# --- Hugging Face -> GGUF metadata ----------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read it as JSON ({e})", path=path, fix="repair or remove the file") from None
    return d if isinstance(d, dict) else None


def pooling_type(root: Path) -> tuple[str | None, list[str]]:
    """(llama.cpp pooling type name or None, warnings) from sentence-transformers' modules.json and Pooling
    config: the flags `pooling_mode_mean_tokens` ... of sentence-transformers <= 5, or the `pooling_mode`
    string of 6. A pooling llama.cpp has no type for is said."""
    modules = _read_json_list(root / "modules.json")
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling") and isinstance(m.get("path"), str):
            cfg = _read_json(root / m["path"] / "config.json") or {}
            mode = cfg.get("pooling_mode")
            if isinstance(mode, str):
                name = POOLING_MODES.get(mode)
                return name, [] if name else [f"{m['path']}/config.json pooling_mode '{mode[:40]}' has no llama.cpp "
                                              "pooling type; the GGUF gets none (llama.cpp returns every token's "
                                              "embedding)"]
            for flag, name in POOLING:
                if cfg.get(flag):
                    return name, []
            on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            if on:
                return None, [f"{m['path']}/config.json {on[0][:40]}: no llama.cpp pooling type; the GGUF gets "
                              "none (llama.cpp returns every token's embedding)"]
    return None, []


def _read_json_list(path: Path) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read it as JSON ({e})", path=path, fix="repair or remove the file") from None
    return d if isinstance(d, list) else []


def hf_metadata(arch: str, config: dict, root: Path | None, n_vocab: int | None) -> tuple[dict, list[str]]:
    """({key: (value type id, value, item type id or None)}, warnings): the hyperparameters, flags and
    tokenizer llama.cpp reads for `arch`, from config.json and the tokenizer files in `root`, keyed and typed
    by the gguf package's GGUFWriter."""
    import gguf

    w = gguf.GGUFWriter(None, arch)
    row = arch_row(arch)
    cfg, warnings = rope_fields(config)
    cfg = dict(cfg)
    if row is not None and row.permute_qk and "head_dim" not in cfg and cfg.get("num_attention_heads"):
        cfg["head_dim"] = cfg.get("hidden_size", 0) // cfg["num_attention_heads"]
    if n_vocab and not cfg.get("vocab_size"):
        cfg["vocab_size"] = n_vocab
    for key, method in HPARAMS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if key in FLOAT_HPARAMS:
            import math

            if not math.isfinite(v) or abs(v) > 3.4028234663852886e38:
                raise InputError(f"config.json {key} = {v!r} is not a finite float32, which GGUF stores it as",
                                 path=root, fix="correct config.json")
            getattr(w, method)(float(v))
        else:
            if not isinstance(v, int) or not 0 <= v < 1 << 32:
                raise InputError(f"config.json {key} = {v!r} is not an integer in [0, 2^32), which GGUF stores "
                                 "it as", path=root, fix="correct config.json")
            getattr(w, method)(v)
    head_dim, heads, hidden = config.get("head_dim"), cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if _ints(head_dim, heads, hidden) and heads > 0 and head_dim != hidden // heads:
        # llama.cpp takes a head's width as hidden / heads unless these keys say otherwise (and refuses the
        # rope dimension count when they disagree)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    warnings += _rope_scaling(w, cfg)
    if row is not None:
        w.add_causal_attention(row.causal)
        if row.gguf_arch == "bert":
            w.add_token_type_count(int(cfg.get("type_vocab_size", 1)))
    if root is not None:
        pool, said_pool = pooling_type(root)
        warnings += said_pool
        if pool is not None:
            w.add_pooling_type(gguf.PoolingType[pool])
        with _gguf_log() as said:
            warnings += _add_tokenizer(w, arch, root, cfg, n_vocab)
        warnings += [f"tokenizer: {m}" for m in said if "No handler for special token type" not in m]
    return {k: (int(v.type), v.value, None if v.sub_type is None else int(v.sub_type))
            for k, v in w.kv_data[0].items()}, warnings


def rope_fields(cfg: dict) -> tuple[dict, list[str]]:
    """config.json with transformers 5's `rope_parameters` (the base and the scaling in one mapping, the form
    its save_pretrained writes) read as the flat `rope_theta` / `rope_scaling` this module reads, the mapping
    winning where both are present (llama.cpp's converter reads it so too); a warning for a mapping per
    attention type (full / sliding), which no architecture qtool converts has."""
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict):
        return cfg, []
    if any(isinstance(v, dict) for v in rp.values()):
        return cfg, ["config.json rope_parameters holds one mapping per attention type, which qtool does not "
                     "read: the GGUF gets no RoPE base or scaling from it"]
    out = dict(cfg)
    if "rope_theta" in rp:
        out["rope_theta"] = rp["rope_theta"]
    if (rp.get("rope_type") or rp.get("type")) not in (None, "default"):
        out["rope_scaling"] = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return out, []


def _rope_scaling(w, cfg: dict) -> list[str]:
    """The rope.scaling keys llama.cpp reads for linear and YaRN scaling (llama3 scaling is a tensor:
    `rope_factors`); a warning for a scaling GGUF cannot carry."""
    import math

    import gguf

    rs = cfg.get("rope_scaling")
    if not isinstance(rs, dict):
        return []
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default", "llama3"):
        return []
    factor = rs.get("factor")
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor) and factor > 0
    if kind in ("linear", "yarn") and ok:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(factor))
        if kind == "linear":
            return []
        orig = rs.get("original_max_position_embeddings")
        if isinstance(orig, int) and not isinstance(orig, bool) and 0 < orig < 1 << 32:
            w.add_rope_scaling_orig_ctx_len(orig)
        for hf, suffix in YARN_KEYS:
            v = rs.get(hf, rs.get("attn_factor") if hf == "attention_factor" else None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                w.add_key_value(f"{w.arch}.rope.scaling.{suffix}", float(v), gguf.GGUFValueType.FLOAT32)
        left = sorted(set(rs) - {"rope_type", "type", "factor", "original_max_position_embeddings", "attn_factor",
                                 "rope_theta", "partial_rotary_factor"} - {hf for hf, _ in YARN_KEYS})
        return [f"config.json rope_scaling yarn {', '.join(left)[:80]}: llama.cpp has no key for it; not written "
                "into the GGUF"] if left else []
    return [f"config.json rope_scaling {str(kind)[:40]!r} (factor {str(factor)[:20]}) is not written into the GGUF: "
            "llama.cpp would run plain RoPE, whose outputs differ at long positions"]


def _ints(*vs) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in vs)


def rope_factors(arch: str | None, cfg: dict):
    """Llama 3.1-style RoPE scaling ("rope_type": "llama3") as llama.cpp reads it: a float32 tensor
    `rope_freqs.weight` [head_dim / 2] by which each rotary frequency is divided. Wavelengths shorter than
    original_context / high_freq_factor keep their frequency, those longer than original_context /
    low_freq_factor are divided by `factor`, and the band between is interpolated smoothly. None when the
    config asks for no such scaling."""
    import numpy as np

    cfg = rope_fields(cfg)[0]
    rs = cfg.get("rope_scaling")
    row = arch_row(arch)
    if row is None or not row.permute_qk or not isinstance(rs, dict) or \
            (rs.get("rope_type") or rs.get("type")) != "llama3":
        return None
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    dim = cfg.get("head_dim") or (hidden // heads if _ints(heads, hidden) and heads > 0 else 0)
    try:
        base = float(cfg.get("rope_theta", 10000.0))
        factor, low, high = (float(rs.get(k, d)) for k, d in (("factor", 8.0), ("low_freq_factor", 1.0),
                                                              ("high_freq_factor", 4.0)))
        old = float(rs.get("original_max_position_embeddings", 8192))
    except (TypeError, ValueError):
        raise InputError("config.json rope_scaling (llama3) holds a value that is not a number",
                         fix="correct config.json") from None
    if not (_ints(dim) and dim > 0 and dim % 2 == 0 and base > 0 and factor > 0 and 0 < low < high and old > 0):
        raise InputError(f"config.json rope_scaling (llama3) cannot be computed for head_dim {dim}: {rs}",
                         fix="correct config.json")
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def rope_scaling_from_factors(arch: str, cfg: dict, factors, original: int | None = None) -> dict | None:
    """The llama3 `rope_scaling` whose per-frequency factors are exactly `factors` (a GGUF's rope_freqs.weight),
    or None. The factors fix the scaling `factor` (the largest) and the two wavelengths where the smooth band
    starts and ends, which is all the formula uses: original_max_position_embeddings / low_freq_factor and
    / high_freq_factor. `original` (the GGUF's rope.scaling.original_context_length) fixes the triple where
    it is known; otherwise low_freq_factor = 1 picks one of the equivalent ones (Meta's own: 8192, 1, 4).
    The band needs two frequencies inside it to be fitted; the result is kept only when `rope_factors`
    gives back every float32 factor bit for bit."""
    import numpy as np

    f = np.asarray(factors, dtype=np.float64)
    factor = float(f.max()) if f.size else 0.0
    if f.ndim != 1 or not np.isfinite(f).all() or factor <= 1.0 or f.min() < 1.0:
        return None
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    dim = cfg.get("head_dim") or (hidden // heads if _ints(heads, hidden) and heads > 0 else 0)
    base = cfg.get("rope_theta", 10000.0)
    if not _ints(dim) or dim != 2 * f.size or not isinstance(base, (int, float)) or base <= 0:
        return None
    x = 1.0 / (2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # 1 / wavelength
    mid = (f > 1.0) & (f < factor)
    if mid.sum() < 2:
        return None
    # in the band, the interpolation weight is affine in 1 / wavelength: 0 at 1 / T_low, 1 at 1 / T_high
    smooth = (1.0 / f[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, icept = np.polyfit(x[mid], smooth, 1)
    if not slope > 0:
        return None
    t_low, t_high = slope / -icept if icept < 0 else 0.0, slope / (1.0 - icept)
    if not t_low > t_high > 0:
        return None
    want = np.asarray(factors, np.float32).view(np.uint32)
    for old in ([original] if _ints(original) and original > 0 else []) + [int(round(t_low))]:
        rs = {"rope_type": "llama3", "factor": float(str(np.float32(factor))),
              "low_freq_factor": float(round(old / t_low, 6)), "high_freq_factor": float(round(old / t_high, 6)),
              "original_max_position_embeddings": old}
        back = rope_factors(arch, {**cfg, "rope_scaling": rs})
        if back is not None and np.array_equal(back.view(np.uint32), want):
            return rs
    return None


@contextlib.contextmanager
def _gguf_log():
    """Collect what the gguf package's vocabulary readers log (they warn through `logging`), so it reaches
    the report instead of stderr. llama.cpp has no key for a BERT cls token id (it uses bos): that notice is
    dropped by the caller."""
    import logging

    said: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    log = logging.getLogger("gguf")
    h, old = _Keep(logging.WARNING), log.propagate
    log.addHandler(h)
    log.propagate = False
    try:
        yield said
    finally:
        log.removeHandler(h)
        log.propagate = old


def _special_tokens(tok_json: dict | None) -> dict[str, bool]:
    """{content: special} of tokenizer.json's added tokens."""
    out = {}
    for t in (tok_json or {}).get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str):
            out[t["content"]] = bool(t.get("special"))
    return out


def _fits(tokens: list, n_vocab: int | None, root: Path) -> None:
    """llama.cpp sizes the vocabulary by the token list and refuses an embedding table of other rows."""
    if n_vocab is not None and len(tokens) > n_vocab:
        raise InputError(f"the tokenizer has {len(tokens)} tokens but the embedding table {n_vocab} rows; llama.cpp "
                         "refuses such a file", path=root, fix="put this model's own tokenizer beside it")


def _add_tokenizer(w, arch: str, root: Path, cfg: dict, n_vocab: int | None = None) -> list[str]:
    import gguf

    tok_json = _read_json(root / "tokenizer.json")
    model = (tok_json or {}).get("model") or {}
    added = _special_tokens(tok_json)
    pre = tokenizer_pre(root)
    if model.get("type") == "WordPiece" or (tok_json is None and (root / "vocab.txt").is_file()):
        vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else _vocab_txt(root / "vocab.txt")
        tokens = [None] * (max(vocab.values()) + 1 if vocab else 0)
        for t, i in vocab.items():
            tokens[i] = t
        types, out = [], []
        for i, t in enumerate(tokens):
            if t is None:
                t, ty = f"[PAD{i}]", gguf.TokenType.UNUSED
            elif added.get(t):
                ty = gguf.TokenType.CONTROL
            elif t in added:
                ty = gguf.TokenType.USER_DEFINED
            else:
                ty = gguf.TokenType.NORMAL
            types.append(int(ty))
            out.append(t if ty == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else PHANTOM + t)
        _fits(out, n_vocab, root)
        w.add_tokenizer_model("bert")
        w.add_tokenizer_pre(pre or "default")
        w.add_token_list(out)
        w.add_token_types(types)
        gguf.SpecialVocab(root, n_vocab=len(out)).add_to_gguf(w, quiet=True)
        return []
    if model.get("type") == "BPE" or (root / "vocab.json").is_file():
        try:
            v = gguf.vocab.BpeVocab(root)
        except (FileNotFoundError, ValueError) as e:
            return [f"tokenizer not written: {e}; llama.cpp will not load the file without one"]
        tokens, types = [], []
        for text, _, ty in v.all_tokens():
            s = text.decode("utf-8") if isinstance(text, bytes) else text
            if s in added:
                ty = gguf.TokenType.CONTROL if added[s] else gguf.TokenType.USER_DEFINED
            tokens.append(s)
            types.append(int(ty))
        n = cfg.get("vocab_size")
        for i in range(len(tokens), n if isinstance(n, int) and n > len(tokens) else len(tokens)):
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        _fits(tokens, n_vocab, root)
        w.add_tokenizer_model("gpt2")
        warnings = []
        if pre is None:
            warnings.append("tokenizer.ggml.pre: not known for this tokenizer; written as 'default' (GPT-2's "
                            "pre-tokenizer regex): llama.cpp may split text differently from transformers")
        w.add_tokenizer_pre(pre or "default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        gguf.SpecialVocab(root, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
        return warnings
    return ["tokenizer not written: no tokenizer.json (WordPiece or byte-level BPE), vocab.txt or vocab.json "
            "beside the weights; llama.cpp will not load the file without one"]


def _vocab_txt(path: Path) -> dict[str, int]:
    try:
        with open(path, encoding="utf-8") as f:
            return {line.rstrip("\n"): i for i, line in enumerate(f)}
    except FileNotFoundError:
        return {}


# qtool writes the GGUF pre-tokenizer name beside a tokenizer it builds from a GGUF file, so the way back
# names it again (llama.cpp picks its pre-tokenizer regex by this name; the tokenizer files do not say it)
PRE_FILE_KEY = "gguf_tokenizer_pre"


def tokenizer_pre(root: Path) -> str | None:
    cfg = _read_json(root / "tokenizer_config.json") or {}
    v = cfg.get(PRE_FILE_KEY)
    return v if isinstance(v, str) and v else None


# --- GGUF -> Hugging Face -------------------------------------------------------------------------------------
def hf_config(arch: str, kv: dict, tensor_names: list[str]) -> dict:
    """config.json for transformers from a GGUF file's metadata (`kv`: key -> value) and its tensor names."""
    import numpy as np

    row = arch_row(arch)
    if row is None:
        raise InputError(f"qtool writes a transformers config for GGUF architectures {', '.join(ARCHS)}, not "
                         f"'{arch}'", fix="convert to another GGUF type instead, or --to a GGUF target")
    cfg: dict[str, Any] = {"architectures": [row.hf_class], "model_type": row.model_type,
                           "hidden_act": row.hidden_act}
    for key, method in HPARAMS:
        v = kv.get(gguf_key(arch, method))
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            # GGUF holds float32: its shortest decimal (1e-05, not 9.999999747378752e-06) reads back the same
            cfg[key] = float(str(np.float32(v))) if key in FLOAT_HPARAMS else int(v)
    klen = kv.get(gguf_key(arch, "add_key_length"))
    if isinstance(klen, int) and not isinstance(klen, bool):
        cfg["head_dim"] = klen
    kind = kv.get(f"{arch}.rope.scaling.type")
    factor = kv.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and isinstance(factor, float):
        cfg["rope_scaling"] = {"rope_type": kind, "factor": float(str(np.float32(factor)))}
        orig = kv.get(f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and isinstance(orig, int) and not isinstance(orig, bool):
            cfg["rope_scaling"]["original_max_position_embeddings"] = orig
        for hf, suffix in YARN_KEYS if kind == "yarn" else ():
            v = kv.get(f"{arch}.rope.scaling.{suffix}")
            if isinstance(v, float):
                cfg["rope_scaling"][hf] = float(str(np.float32(v)))
    tokens = kv.get("tokenizer.ggml.tokens")
    if "vocab_size" not in cfg:
        n = _count(tokens)
        if n:
            cfg["vocab_size"] = n
    if row.gguf_arch == "bert":
        cfg["type_vocab_size"] = int(kv.get("tokenizer.ggml.token_type_count", 2))
    else:
        cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
        if "num_key_value_heads" not in cfg and "num_attention_heads" in cfg:
            cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    for name, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
        v = kv.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(v, int) and not isinstance(v, bool):
            cfg[f"{hf}_token_id"] = v
    if row.gguf_arch == "llama":
        cfg.update(_llama_biases(tensor_names))
    return cfg


# Llama's bias flags, each over a set of projections that has its biases all together or not at all
_LLAMA_BIASES = (("attention_bias", ("attn_q", "attn_k", "attn_v", "attn_output")),
                 ("mlp_bias", ("ffn_gate", "ffn_up", "ffn_down")))
_BIAS = re.compile(r"blk\.(\d+)\.(\w+)\.bias$")


def _llama_biases(tensor_names: list[str]) -> dict[str, bool]:
    """LlamaConfig's attention_bias / mlp_bias from the bias tensors a llama GGUF holds: transformers reads a
    bias only where its flag says so, and then expects it on every projection of the set in every block."""
    blocks = {m.group(1) for n in tensor_names if (m := re.match(r"blk\.(\d+)\.", n))}
    have = {(m.group(1), m.group(2)) for n in tensor_names if (m := _BIAS.match(n))}
    out = {}
    for flag, parts in _LLAMA_BIASES:
        got = {(b, p) for b, p in have if p in parts}
        if not got:
            continue
        want = {(b, p) for b in blocks for p in parts}
        if got != want:
            b, p = sorted(want - got)[0]
            raise InputError(f"a llama GGUF with {parts[0]} biases lacks blk.{b}.{p}.bias: transformers' "
                             f"LlamaForCausalLM ({flag}) has a bias on every one of {', '.join(parts)} or on none",
                             fix="convert to another GGUF type instead, or --to a GGUF target")
        out[flag] = True
    return out


def uncarried_keys(arch: str, kv: dict) -> list[str]:
    """The GGUF's `{arch}.*` keys that hf_config does not turn into config.json, except those that change
    nothing transformers computes (the causal flag where it is the architecture's own)."""
    row = arch_row(arch)
    known = {gguf_key(arch, m) for _, m in HPARAMS} | {gguf_key(arch, m) for m in ("add_key_length",
                                                                                  "add_value_length")}
    known |= {f"{arch}.{k}" for k in ("rope.scaling.type", "rope.scaling.factor",
                                      "rope.scaling.original_context_length", "rope.scaling.finetuned")}
    if kv.get(f"{arch}.rope.scaling.type") == "yarn":
        known |= {f"{arch}.rope.scaling.{suffix}" for _, suffix in YARN_KEYS}
    if row is not None and kv.get(f"{arch}.attention.causal", row.causal) == row.causal:
        known.add(f"{arch}.attention.causal")
    if sentence_transformers_files(arch, kv):  # the pooling goes to 1_Pooling/config.json
        known.add(f"{arch}.pooling_type")
    return sorted(k for k in kv if k.startswith(f"{arch}.") and k not in known)


def _count(v) -> int | None:
    if isinstance(v, list):
        return len(v)
    return getattr(v, "count", None)


def hf_tokenizer_files(gguf_path: Path) -> tuple[dict[str, Any], list[str]]:
    """({file name: JSON object or text}, warnings): the tokenizer files transformers reads, built from a
    GGUF file's tokenizer.* metadata (its arrays read in full at the offsets qtool's header parser recorded:
    the gguf package's reader maps every tensor and field first, seconds on a 7B file)."""
    from qtool.io.gguf_reader import read_array, read_gguf_header

    h = read_gguf_header(gguf_path)

    def val(key):
        return read_array(h, h.kv[key]) if key in h.kv else None

    model = val("tokenizer.ggml.model")
    tokens = val("tokenizer.ggml.tokens") or []
    types = val("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = {name: val(f"tokenizer.ggml.{name}_token_id") for name in
               ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask")}
    cfg: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    for name, hf in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                     ("padding", "pad_token"), ("seperator", "sep_token"), ("cls", "cls_token"),
                     ("mask", "mask_token")):
        i = special[name]
        if isinstance(i, int) and 0 <= i < len(tokens):
            cfg[hf] = tokens[i]
    adds: dict[str, tuple[str, int]] = {}  # the special tokens the GGUF adds to every sequence
    for flag in ("bos", "eos"):
        v = val(f"tokenizer.ggml.add_{flag}_token")
        if isinstance(v, bool):
            cfg[f"add_{flag}_token"] = v
        i = special[flag]
        if v is True and isinstance(i, int) and 0 <= i < len(tokens):
            adds[flag] = (tokens[i], i)
    tmpl = val("tokenizer.chat_template")
    if isinstance(tmpl, str):
        cfg["chat_template"] = tmpl
    ctx = None
    arch = val("general.architecture")
    if isinstance(arch, str):
        ctx = val(f"{arch}.context_length")
    if isinstance(ctx, int):
        cfg["model_max_length"] = ctx
    pre = val("tokenizer.ggml.pre")
    if isinstance(pre, str):
        cfg[PRE_FILE_KEY] = pre
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == 3} for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty in (3, 4)]
    if model == "gpt2":
        merges = val("tokenizer.ggml.merges") or []
        level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        pre_tok = ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, level]}
                   if pre in DIGIT_SPLITTING_PRE else level)
        tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
               "pre_tokenizer": pre_tok, "post_processor": _post_processor(level | {"trim_offsets": False}, adds),
               "decoder": level | {"add_prefix_space": True},
               "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                         "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                         "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
                         "merges": list(merges)}}
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        warnings = [] if pre in DIGIT_SPLITTING_PRE or pre in ("default", "gpt2", None) else [
            f"tokenizer.ggml.pre '{pre}': written as GPT-2's byte-level pre-tokenizer; transformers may split "
            "text differently from llama.cpp"]
        return {"tokenizer.json": tok, "tokenizer_config.json": cfg}, warnings
    if model == "bert":
        # llama.cpp marks a word-initial piece with a leading U+2581 and drops WordPiece's "##" from the rest;
        # bracketed reserved tokens ("[unused0]") are whole tokens even where an older converter typed them
        # NORMAL and gave them no marker
        vocab = []
        for t, ty in zip(tokens, types, strict=False):
            whole = ty == 3 or _BRACKETED.fullmatch(t)
            vocab.append(t if whole else t[1:] if t.startswith(PHANTOM) else "##" + t)
        cfg.update({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
        return {"vocab.txt": "\n".join(vocab) + "\n", "tokenizer_config.json": cfg}, []
    return {}, [f"tokenizer not written: GGUF tokenizer model '{model}' (qtool writes 'gpt2' and 'bert' ones)"]


def _post_processor(level: dict, added: dict[str, tuple[str, int]]) -> dict:
    """tokenizer.json's post-processor: byte-level offsets, then the BOS / EOS the GGUF adds (`added`: "bos" /
    "eos" -> (token, id), from tokenizer.ggml.add_bos_token / add_eos_token). transformers 5 adds them through
    this template alone: it ignores tokenizer_config.json's add_bos_token once a tokenizer.json exists."""
    if not added:
        return level
    bos, eos = added.get("bos"), added.get("eos")

    def seq(part: str, type_id: int) -> list[dict]:
        return ([{"SpecialToken": {"id": bos[0], "type_id": type_id}}] if bos else []) + \
            [{"Sequence": {"id": part, "type_id": type_id}}] + \
            ([{"SpecialToken": {"id": eos[0], "type_id": type_id}}] if eos else [])

    special = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in added.values()}
    template = {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
                "special_tokens": special}
    return {"type": "Sequence", "processors": [level, template]}


_BRACKETED = re.compile(r"\[[^\[\]\s]+\]")
# GGUF pre-tokenizer names whose regex splits digits one by one (llama.cpp's llama-vocab.cpp)
DIGIT_SPLITTING_PRE = frozenset({"smollm"})


def sentence_transformers_files(arch: str, kv: dict) -> dict[str, Any]:
    """modules.json and 1_Pooling/config.json that give sentence-transformers the pooling a GGUF encoder names
    (`{arch}.pooling_type` MEAN, CLS or LAST), or {} where it names none."""
    import gguf

    kind = kv.get(f"{arch}.pooling_type")
    names = {int(gguf.PoolingType[n]): n for _, n in POOLING}
    hidden = kv.get(f"{arch}.embedding_length")
    if not isinstance(kind, int) or kind not in names or not _ints(hidden):
        return {}
    cfg = {"word_embedding_dimension": hidden} | {flag: names[kind] == n for flag, n in POOLING} | \
        {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
         "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    return {"modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                             {"idx": 1, "name": "1", "path": "1_Pooling",
                              "type": "sentence_transformers.models.Pooling"}],
            "1_Pooling/config.json": cfg}


def write_files(out: Path, files: dict[str, Any]) -> None:
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        with open(out / name, "w", encoding="utf-8") as f:
            if isinstance(content, str):
                f.write(content)
            else:
                json.dump(content, f, indent=1, ensure_ascii=False)
                f.write("\n")


# gguf.get_tensor_name_map's cost grows with the block count (~3 s for 1000): the largest models have ~130
MAX_BLOCKS = 1024
_INDEX = re.compile(r"\.(\d+)\.")


def blocks_present(names: list[str], path=None) -> int:
    """1 + the largest block number the tensor names hold (0 when none); an InputError past MAX_BLOCKS."""
    top = -1
    for n in names:
        for x in _INDEX.findall(n):
            if len(x) > 6 or int(x) >= MAX_BLOCKS:
                raise InputError(f"tensor name numbers block {x[:12]}{'...' if len(x) > 12 else ''}; qtool maps "
                                 f"names of at most {MAX_BLOCKS} blocks to GGUF", path=path, tensor=n,
                                 fix="rename the tensors, or convert to a Hugging Face layout instead")
            top = max(top, int(x))
    return top + 1


# block prefixes transformers' GPTQ path finds by itself; any other is written as block_name_to_quantize
KNOWN_BLOCKS = ("transformer.h", "model.decoder.layers", "gpt_neox.layers", "model.layers")
_BLOCK = re.compile(r"^(.+?)\.\d+\.")


def loader_keys(format_id: str, quantized: list[str], kept_linear: list[str] = ()) -> dict:
    """Keys transformers' GPTQ and AWQ paths need beyond the scheme: `block_name_to_quantize` where the
    quantized modules lie in blocks it does not find by itself (an encoder's `encoder.layer`), and for AWQ
    `modules_to_not_convert`: the linear modules kept dense (`kept_linear`), which it would otherwise replace."""
    out: dict = {}
    blocks = {m.group(1) if (m := _BLOCK.match(name)) else None for name in quantized}
    if len(blocks) == 1 and None not in blocks and next(iter(blocks)) not in KNOWN_BLOCKS:
        out["block_name_to_quantize"] = next(iter(blocks))
    if format_id == "awq" and kept_linear:
        out["modules_to_not_convert"] = list(kept_linear)
    return out
