"""Would the tools that load this checkpoint accept it? Warnings for what llama.cpp needs in a GGUF file
(a known architecture, a tokenizer, the hyperparameters every graph reads) and what transformers and
sentence-transformers need in a Hugging Face directory (config.json with a model_type, every folder
modules.json names), and which weight files in a directory the report does not cover. Header facts only;
warnings, not errors: the tensors may still be right."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qtool.errors import InputError
from qtool.inspect.report import Anomaly
from qtool.io.checkpoint import PICKLE_SUFFIXES, list_dir, read_json, unread_weight_files

WEIGHT_SUFFIXES = (".safetensors", ".gguf", *PICKLE_SUFFIXES)
# sentence-transformers modules whose load reads no file: their folder may be absent (all-MiniLM-L6-v2 ships
# no 2_Normalize/)
FILELESS = frozenset({"sentence_transformers.models.Normalize",  # sentence-transformers <= 5
                      "sentence_transformers.base.modules.normalize.Normalize"})  # 6

# `<arch>.*` keys llama.cpp's model loader requires of every architecture (llama-model.cpp reads them without
# a default); the names are gguf's Keys.LLM templates
REQUIRED = ("CONTEXT_LENGTH", "EMBEDDING_LENGTH", "BLOCK_COUNT")
REQUIRED_ATTN = ("HEAD_COUNT",)

# Keys llama.cpp reads with one fixed GGUF type ({arch}: the file's architecture). Its loader checks the stored
# type exactly, optional keys included (GGUFMeta::GKV::get_kv: "key %s has wrong type %s but expected type %s"),
# so a block_count written as a string, or as a UINT64, stops the load. Per-layer keys may also be arrays.
KEY_TYPES: dict[str, tuple[str, ...]] = {
    "general.architecture": ("STRING",), "general.name": ("STRING",), "general.file_type": ("UINT32",),
    "split.no": ("UINT16",), "split.count": ("UINT16",), "split.tensors.count": ("INT32",),
    "tokenizer.ggml.model": ("STRING",),
    "{arch}.context_length": ("UINT32",), "{arch}.embedding_length": ("UINT32",), "{arch}.block_count": ("UINT32",),
    "{arch}.attention.head_count": ("UINT32", "ARRAY"), "{arch}.feed_forward_length": ("UINT32", "ARRAY"),
}


def gguf_anomalies(kv: dict[str, Any], kv_types: dict[str, str] | None = None,
                   kv_complete: bool = True) -> list[Anomaly]:
    """Warnings for what stops llama.cpp loading a GGUF whose metadata is `kv` (value types `kv_types`, the
    reader's names). kv_complete False: the header was cut inside the metadata, so a key not read may still be
    in the file; only the keys read are judged then."""
    from qtool.io.gguf_reader import gguf_constants, short_value

    c = gguf_constants()
    out = []
    arch = kv.get("general.architecture")
    types = kv_types or {}
    keys = {k.format(arch=arch): ok for k, ok in KEY_TYPES.items() if "{arch}" not in k or isinstance(arch, str)}
    for key, ok in keys.items():
        if key in types and types[key] not in ok:
            out.append(Anomaly("warning", None, f"llama.cpp will not load it: {key} is {types[key]} "
                                                f"({short_value(kv[key])}), expected {' or '.join(ok)} (\"key {key} "
                                                f"has wrong type\"); fix: rewrite {key} as {ok[0]}"))
    if not isinstance(arch, str) or arch not in set(c.MODEL_ARCH_NAMES.values()):
        if arch is None and not kv_complete or arch is not None and not isinstance(arch, str):
            # the header was cut before the key could be read (the cut is the finding), or the type warning
            # above named it
            return out
        why = "has no general.architecture" if arch is None else f"architecture '{arch}' is unknown"
        return out + [Anomaly("warning", None, f"llama.cpp will not load it: {why} (\"unknown model "
                                               "architecture\"); fix: write it from a Hugging Face directory whose "
                                               "config.json has a model_type")]
    if not kv_complete:
        return out
    missing = [t.format(arch=arch) for t in [getattr(c.Keys.LLM, k) for k in REQUIRED] +
               [getattr(c.Keys.Attention, k) for k in REQUIRED_ATTN] if t.format(arch=arch) not in kv]
    if missing:
        out.append(Anomaly("warning", None, f"llama.cpp will not load it: missing hyperparameters "
                                            f"{', '.join(missing)}; fix: convert from a directory whose "
                                            "config.json has them"))
    model = kv.get(c.Keys.Tokenizer.MODEL)
    if model is None:
        out.append(Anomaly("warning", None, f"llama.cpp will not load it: no tokenizer ({c.Keys.Tokenizer.MODEL} "
                                            "is missing: \"error loading model vocabulary\"); fix: convert from a "
                                            "directory with tokenizer.json or vocab.txt"))
    elif model not in ("none", "no_vocab"):
        need = [c.Keys.Tokenizer.LIST] + ([c.Keys.Tokenizer.MERGES] if model == "gpt2" else [])
        gone = [k for k in need if k not in kv]
        if gone:
            out.append(Anomaly("warning", None, f"llama.cpp will not load it: tokenizer model '{model}' without "
                                                f"{', '.join(gone)}"))
    return out


def hf_anomalies(root: Path) -> list[Anomaly]:
    """A Hugging Face directory: config.json and model_type (transformers), modules.json's folders
    (sentence-transformers)."""
    out = []
    cfg = _json(root / "config.json", out)
    if cfg is None:
        out.append(Anomaly("warning", None, "transformers will not load it: no config.json (it names the model "
                                            "type); fix: copy the source model's config.json beside the weights"))
    elif not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        out.append(Anomaly("warning", None, "transformers will not load it: config.json has no model_type; fix: "
                                            "add the source model's model_type and architectures"))
    modules = _json(root / "modules.json", out)
    if isinstance(modules, list):
        for m in modules:
            path = m.get("path") if isinstance(m, dict) else None
            if isinstance(m, dict) and m.get("type") in FILELESS:
                continue
            if isinstance(path, str) and path and not (root / path).is_dir():
                out.append(Anomaly("warning", None, f"sentence-transformers will not load it: modules.json names "
                                                    f"'{path}', which is not here; fix: copy that folder from "
                                                    "the source model"))
    return out


def _json(p: Path, out: list[Anomaly]):
    """The parsed file, None when absent, {} when unreadable (with a warning naming why)."""
    if not os.path.lexists(p):
        return None
    try:
        return read_json(p)
    except InputError as e:
        out.append(Anomaly("warning", None, f"{p.name} not read: {e.problem}"))
        return {}


def unread_files(root: Path, read: Iterable[Path]) -> list[Anomaly]:
    """A warning for each weight file in `root` the report does not cover, and for each sub-folder holding
    weight files (sentence-transformers' 2_Dense, a second model): the report speaks for what it read."""
    out = []
    for p in unread_weight_files(root, read, WEIGHT_SUFFIXES):
        why = "a pickle, never loaded" if p.name.endswith(PICKLE_SUFFIXES) else "not part of the model read here"
        out.append(Anomaly("warning", None, f"{p.name} not read ({why}); fix: inspect it on its own, or remove it"))
    for e in sorted(list_dir(root), key=lambda e: e.name):
        if not e.is_dir(follow_symlinks=False):
            continue
        held = sorted(x.name for x in list_dir(Path(e.path)) if x.name.endswith(WEIGHT_SUFFIXES))
        if held:
            out.append(Anomaly("warning", None, f"sub-folder '{e.name}' holds weights ({', '.join(held[:3])}"
                                                f"{' ...' if len(held) > 3 else ''}) this report does not cover; "
                                                f"fix: qtool inspect {root / e.name}"))
    return out
