"""The transformers side of calibration and evaluation: loading a model directory offline, and matching the
model's parameter names to the checkpoint's tensor names.

transformers is an optional extra (`pip install qtool[calib]`), imported only here and only when a
calibrated method or `qtool eval` runs. Loading is local only (`local_files_only`): no download, ever.
"""

from __future__ import annotations

import re
from pathlib import Path

from qtool.errors import InputError, UsageError

INSTALL_FIX = "install the calibration extra: pip install 'qtool[calib]' (it adds transformers)"


def transformers():
    try:
        import transformers as tf
    except ImportError:
        raise UsageError("calibration and evaluation run the model through transformers, which is not "
                         "installed", fix=INSTALL_FIX) from None
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    return tf


def is_causal(config: dict | None) -> bool:
    """True for a causal LM, else an encoder: an architecture transformers lists as a causal LM (its auto
    mapping: ...ForCausalLM, GPT2LMHeadModel, ...), one named ...ForCausalLM, or is_decoder."""
    cfg = config or {}
    archs = [str(a) for a in cfg.get("architectures") or []]
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    except ImportError:
        causal = {}
    names = set(causal.values())
    return any(a.endswith("ForCausalLM") or a in names for a in archs) or bool(cfg.get("is_decoder"))


def default_device(device: str | None = None) -> str:
    import torch

    if device:
        dev = device.strip().lower()
        m = re.fullmatch(r"cpu|cuda(?::(\d{1,4}))?", dev)
        if m is None:
            raise UsageError(f"--device {device}: not a device name", fix="use --device cpu, cuda or cuda:N")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: CUDA is not available here", fix="use --device cpu")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
                             fix=f"use --device cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return dev
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | Path, device: str = "cpu"):
    """(model on CPU in eval mode, tokenizer, causal) for a Hugging Face model directory.

    float32 on the CPU (its fp16 matmuls are slow and lossy); the config's dtype on CUDA."""
    import torch

    tf = transformers()
    p = Path(path)
    if p.is_file() or not (p / "config.json").is_file():
        raise UsageError("calibration and evaluation need a model directory with config.json and a tokenizer",
                         path=p, fix="point at the Hugging Face model directory, not a single .safetensors file")
    from qtool.io.checkpoint import read_json

    cfg = read_json(p / "config.json")
    if not isinstance(cfg, dict):
        raise InputError("config.json is not a JSON object", path=p / "config.json",
                         fix="give the model's own config.json")
    cfg.pop("quantization_config", None)
    if cfg.get("is_encoder_decoder"):
        what = ", ".join(map(str, cfg.get("architectures") or []))[:60] or cfg.get("model_type")
        raise UsageError(f"an encoder-decoder model ({what}): calibration and evaluation run decoder-only "
                         "language models and encoders", path=p,
                         fix="pack it without --method/--eval (round to nearest), or check it with `qtool validate`")
    causal = is_causal(cfg)
    try:
        config = tf.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a config it cannot read
        raise InputError(f"transformers cannot read its config.json ({_said(e)})", path=p,
                         fix="check model_type and the sizes against the source model's config") from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    dtype = torch.float32 if device == "cpu" else getattr(config, "dtype", None) or torch.float16
    cls = tf.AutoModelForCausalLM if causal else tf.AutoModel
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a missing/broken tokenizer
        raise InputError(f"no usable tokenizer ({type(e).__name__}: {str(e)[:120]})", path=p,
                         fix="copy the tokenizer files of the source model into this directory") from None
    return cls, config, dtype, tok, causal


def _said(e: Exception) -> str:
    """An exception from transformers as a short clause: its type and the first line of its message."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


def _tied_names(model) -> set[str]:
    """The parameters this model fills from another (the output embedding from the input one). transformers 5's
    `_tied_weights_keys` lists the candidates of the class whatever the config says; the expanded map is empty
    unless the config ties them (an untied model lacking lm_head.weight has a hole, not a tie)."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if expand is not None:
        return set(expand(all_submodels=True))
    if not getattr(model.config, "tie_word_embeddings", True):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or ())


def build_model(path: str | Path, device: str = "cpu", weights: dict | None = None):
    """(model, tokenizer, causal), with fused mixture-of-experts stacks split into linears where their layout
    allows (experts.split_experts). `weights` ({model parameter name: tensor}) replaces parameters after the
    dense weights are loaded from `path` (used by eval to put dequantized weights in)."""
    import torch

    from qtool.quant.experts import split_experts

    cls, config, dtype, tok, causal = load_model(path, device)
    if config.model_type and hasattr(config, "use_cache"):
        config.use_cache = False
    if weights is None:
        # transformers fills parameters the files lack with random values and only logs it: a reference
        # or calibration model with holes would give numbers that mean nothing
        try:
            model, info = cls.from_pretrained(str(path), config=config, dtype=dtype, local_files_only=True,
                                              output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - the weights do not fit the model config.json describes
            raise InputError(f"transformers cannot build the model from it ({_said(e)})", path=path,
                             fix="check that config.json describes these weights (sizes, layer count)") from None
        split_experts(model)
        tied = _tied_names(model)
        missing = [n for n in info.get("missing_keys") or () if n not in tied]
        if missing:
            raise InputError(f"{len(missing)} model parameters have no tensor in the checkpoint, the first "
                             f"'{sorted(missing)[0]}'", path=path,
                             fix="give the complete dense model (a quantized checkpoint is not one)")
    else:
        try:
            model = cls.from_config(config, dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a config transformers accepts but cannot build
            raise InputError(f"transformers cannot build the model its config.json describes ({_said(e)})",
                             path=path, fix="check model_type and the sizes against the source model's config") \
                from None
        split_experts(model)
        missing = [n for n, _ in model.named_parameters() if n not in weights]
        tied = _tied_names(model)
        missing = [n for n in missing if n not in tied]
        if missing:
            raise InputError(f"{len(missing)} model parameters have no tensor in the checkpoint, the first "
                             f"'{missing[0]}'", path=path, fix="check that --reference is the dense model")
        wrong = next(((n, prm) for n, prm in model.named_parameters()
                      if n in weights and weights[n].shape != prm.shape), None)
        if wrong is not None:
            n, prm = wrong
            raise InputError(f"tensor '{n}' is {list(weights[n].shape)} where the model its config.json "
                             f"describes has {list(prm.shape)}", path=path,
                             fix="check that --reference is the dense model these weights were made from")
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if n in weights:
                    prm.copy_(weights[n].to(prm.dtype))
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    model.eval()
    return model, tok, causal


def name_map(model_names, checkpoint_names, model=None) -> dict[str, str]:
    """{model parameter name: checkpoint tensor name}: equal names, else the unique checkpoint name that
    equals the model name with a leading prefix added or removed (`bert.`, `model.`, ...); then the same
    with the checkpoint names as transformers renames them when it loads `model` (Mixtral's
    `block_sparse_moe.` is `mlp.` in memory); then for a split expert's weight the checkpoint's name of that
    expert (by experts.canonical_expert)."""
    from qtool.quant.experts import canonical_expert

    model_names = list(model_names)
    ck = set(checkpoint_names)
    out = _match(model_names, ck)
    rename = _load_renaming(model) if model is not None else None
    if rename is not None and len(out) < len(model_names):
        renamed: dict[str, str] = {}
        for c in ck:
            renamed.setdefault(rename(c), c)
        left = [m for m in model_names if m not in out]
        out.update({m: renamed[r] for m, r in _match(left, set(renamed)).items()})
    left = {k: m for m in model_names if m not in out and (k := canonical_expert(m)) is not None}
    if left:  # the same once more over the experts' canonical names, each kept where it stands for one name
        by_canonical: dict[str, list[str]] = {}
        for c in ck:
            k = canonical_expert(c)
            if k is not None:
                by_canonical.setdefault(k, []).append(c)
        unique = {k: cs[0] for k, cs in by_canonical.items() if len(cs) == 1}
        out.update({left[k]: unique[c] for k, c in _match(list(left), set(unique)).items()})
    return out


def _match(model_names, ck: set[str]) -> dict[str, str]:
    by_tail: dict[str, list[str]] = {}
    for c in ck:
        parts = c.split(".")
        for k in range(len(parts)):
            by_tail.setdefault(".".join(parts[k:]), []).append(c)
    out = {}
    for m in model_names:
        if m in ck:
            out[m] = m
            continue
        hits = by_tail.get(m, [])
        if len(hits) == 1:
            out[m] = hits[0]
            continue
        parts = m.split(".")
        for k in range(1, len(parts)):
            tail = ".".join(parts[k:])
            if tail in ck:
                out[m] = tail
                break
    return out


def _load_renaming(model):
    """The key renamings transformers applies when it loads `model` from a checkpoint (its conversion
    mapping, the API PEFT uses too), as a function of the checkpoint name; None when there are none or this
    transformers has no such mapping (then only the rules above match names, and an unmatched one is
    reported by the caller)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return None
    try:
        renamings = [t for t in get_model_conversion_mapping(model) or () if isinstance(t, WeightRenaming)]
    except (TypeError, AttributeError):  # another transformers' signature: fall back as above
        return None
    return (lambda key: apply_renamings(key, renamings)) if renamings else None


def tokenize(tok, text: str):
    """int64 [T] token ids of the whole text, without special tokens."""
    import torch

    ids = tok(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def max_positions(model) -> int | None:
    cfg = model.config
    return getattr(cfg, "max_position_embeddings", None)


def specials(tok) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the tokenizer adds around one sequence ([CLS] / [SEP] for BERT, BOS for some
    decoders): calibration windows carry them so the model sees the activations it sees in use."""
    marker = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a", add_special_tokens=True)["input_ids"]
    for k in range(len(full) - len(marker) + 1):
        if full[k:k + len(marker)] == marker:
            return list(full[:k]), list(full[k + len(marker):])
    return [], []
