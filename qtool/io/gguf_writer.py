"""Writing a .gguf file with the `gguf` package's GGUFWriter, streaming: every tensor's directory entry is
declared first (name, shape, type, bytes), then the data is written one tensor at a time, so peak memory
is one tensor.

Names: llama.cpp looks tensors up by its own names (`blk.0.attn_q.weight`). When the architecture is known
(GGUF `general.architecture`, or config.json `model_type` / `architectures`), Hugging Face names are mapped
with `gguf.get_tensor_name_map(arch, n_blocks)`; names the map does not know are kept as they are.

Metadata: a GGUF source's keys are carried over (minus the ones this writer owns: architecture, file type,
quantization version, split and alignment keys); a Hugging Face source contributes `general.name` and the
hyperparameters llama.cpp reads under `<arch>.*` where config.json has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.errors import OutputError

MAX_NAME = 63  # GGML_MAX_NAME (64) minus the terminating NUL
_OWNED_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
# model_type values whose llama.cpp architecture has another name
_ARCH_ALIASES = {"mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                 "gpt_neox": "gptneox", "phi3": "phi3", "gpt2": "gpt2", "modernbert": "modern-bert"}
# config.json key -> GGUFWriter method, for the `<arch>.*` hyperparameters llama.cpp reads
_HPARAMS = (("max_position_embeddings", "add_context_length"), ("hidden_size", "add_embedding_length"),
            ("intermediate_size", "add_feed_forward_length"), ("num_attention_heads", "add_head_count"),
            ("num_key_value_heads", "add_head_count_kv"), ("rms_norm_eps", "add_layer_norm_rms_eps"),
            ("layer_norm_eps", "add_layer_norm_eps"), ("rope_theta", "add_rope_freq_base"))


@dataclass
class GGUFTensorSpec:
    """One tensor to write. shape: numpy order (rows last-dim-fastest, i.e. [O, I] for a weight);
    type_name: GGML type ("Q4_0", "F16", ...); nbytes: bytes of its data."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    nbytes: int


def resolve_arch(config: dict | None, gguf_arch: str | None = None) -> str | None:
    """The llama.cpp architecture name, or None when unknown."""
    import gguf

    names = set(gguf.MODEL_ARCH_NAMES.values())
    if gguf_arch:
        return gguf_arch
    if not config:
        return None
    cands = []
    mt = config.get("model_type")
    if isinstance(mt, str):
        cands += [_ARCH_ALIASES.get(mt, mt), mt.replace("_", "-"), mt.replace("_", "")]
    for a in config.get("architectures") or []:
        if isinstance(a, str):
            base = a.lower()
            for suffix in ("forcausallm", "model", "formaskedlm", "forsequenceclassification"):
                base = base.removesuffix(suffix)
            cands.append(base)
    return next((c for c in cands if c in names), None)


def name_mapper(arch: str | None, n_blocks: int | None) -> Callable[[str], str]:
    """HF tensor name -> GGUF tensor name via the gguf package's map for `arch` (identity when unknown)."""
    import gguf

    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(arch or "")
    if enum is None:
        return lambda n: n
    tmap = gguf.get_tensor_name_map(enum, n_blocks or 0)

    def mapped(name: str) -> str:
        got = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        return got if got else name

    return mapped


def hparams_from_config(config: dict | None) -> list[tuple[str, Any]]:
    """[(GGUFWriter method, value)] for the hyperparameters config.json has."""
    out = []
    if not config:
        return out
    for key, method in _HPARAMS:
        v = config.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((method, v))
    if isinstance(config.get("num_hidden_layers"), int):
        out.append(("add_block_count", config["num_hidden_layers"]))
    return out


def carried_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, value type, array item type) of a GGUF file's metadata, minus writer-owned keys.
    Uses gguf.GGUFReader (it materialises arrays such as a tokenizer vocabulary, which we must copy)."""
    import gguf

    r = gguf.GGUFReader(path)
    out = []
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key.startswith("split.") or key in _OWNED_KEYS or not f.types:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 2:
            continue  # nested arrays: GGUFWriter cannot write them back faithfully
        out.append((key, f.contents(), vtype, sub))
    return out


def write_gguf(path: Path, arch: str, tensors: list[GGUFTensorSpec], data: Iterable,
               file_type: int | None = None, kv: list[tuple[str, Any, Any, Any]] | None = None,
               hparams: list[tuple[str, Any]] | None = None, name: str | None = None) -> None:
    """Write `tensors` (specs, in order) whose data arrays `data` yields in the same order.

    data items: numpy arrays; quantized types as uint8 [O, row_bytes], float types in their dtype (BF16 as
    uint8 bytes). kv: carried (key, value, type, item type); hparams: (GGUFWriter method, value).
    """
    import gguf
    import numpy as np

    for t in tensors:
        if len(t.name) > MAX_NAME:
            raise OutputError(f"GGUF tensor name '{t.name}' is {len(t.name)} characters; GGUF allows {MAX_NAME}",
                              path=path, fix="the architecture's name map does not cover it; --exclude it")
    w = gguf.GGUFWriter(path, arch)
    if name:
        w.add_name(name)
    for key, value, vtype, sub in kv or []:
        if key == "general.name" and name:
            continue
        w.add_key_value(key, value, vtype, sub_type=sub)
    for method, value in hparams or []:
        getattr(w, method)(value)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for t in tensors:
        qt = gguf.GGMLQuantizationType[t.type_name]
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        byte_shape = (*t.shape[:-1], t.shape[-1] // block * type_size)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, arr in zip(tensors, data, strict=True):
        a = np.ascontiguousarray(arr)
        if a.nbytes != t.nbytes:
            raise OutputError(f"tensor '{t.name}' has {a.nbytes} bytes, its directory entry says {t.nbytes}",
                              path=path)
        try:
            w.write_tensor_data(a.reshape(-1).view(np.uint8))
        except OSError as e:
            if e.errno is not None:
                raise
            raise _short_write(path, a.nbytes) from None
    w.close()


def _short_write(path: Path, nbytes: int) -> OSError:
    """The OSError a short write should have been. GGUFWriter writes data with ndarray.tofile, whose error
    for a short write ("N requested and M written") carries no errno, so the output's writer cannot tell a
    full disk from a bug: EFBIG when the process's file-size limit explains it, ENOSPC otherwise."""
    import errno
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    code = errno.EFBIG if soft != resource.RLIM_INFINITY and size + nbytes > soft else errno.ENOSPC
    return OSError(code, os.strerror(code), str(path))
