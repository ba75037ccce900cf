"""Would the tools that load this checkpoint accept it? Warnings for what llama.cpp needs in a GGUF file
(a known architecture, a tokenizer, the hyperparameters every graph reads) and what transformers and
sentence-transformers need in a Hugging Face directory (config.json with a model_type, every folder
modules.json names). Header facts only; warnings, not errors: the tensors may still be right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qtool.inspect.report import Anomaly

# `<arch>.*` keys llama.cpp's model loader requires of every architecture (llama-model.cpp reads them without
# a default); the names are gguf's Keys.LLM templates
REQUIRED = ("CONTEXT_LENGTH", "EMBEDDING_LENGTH", "BLOCK_COUNT")
REQUIRED_ATTN = ("HEAD_COUNT",)


def gguf_anomalies(kv: dict[str, Any]) -> list[Anomaly]:
    from qtool.io.gguf_reader import gguf_constants

    c = gguf_constants()
    out = []
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or arch not in set(c.MODEL_ARCH_NAMES.values()):
        why = "has no general.architecture" if not isinstance(arch, str) else f"architecture '{arch}' is unknown"
        return [Anomaly("warning", None, f"llama.cpp will not load it: {why} (\"unknown model architecture\"); "
                                         "fix: write it from a Hugging Face directory whose config.json has a "
                                         "model_type")]
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
    cfg = _json(root / "config.json")
    if cfg is None:
        out.append(Anomaly("warning", None, "transformers will not load it: no config.json (it names the model "
                                            "type); fix: copy the source model's config.json beside the weights"))
    elif not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        out.append(Anomaly("warning", None, "transformers will not load it: config.json has no model_type; fix: "
                                            "add the source model's model_type and architectures"))
    modules = _json(root / "modules.json")
    if isinstance(modules, list):
        for m in modules:
            path = m.get("path") if isinstance(m, dict) else None
            if isinstance(path, str) and path and not (root / path).is_dir():
                out.append(Anomaly("warning", None, f"sentence-transformers will not load it: modules.json names "
                                                    f"'{path}', which is not here; fix: copy that folder from "
                                                    "the source model"))
    return out


def _json(p: Path):
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: other checks report it
