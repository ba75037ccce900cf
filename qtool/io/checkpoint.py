"""Opening a checkpoint: a .safetensors file, a Hugging Face style directory, or a
model.safetensors.index.json. Headers are read eagerly (cheap); tensor data only on `get`, one tensor at a
time with a positioned read, so peak memory is one tensor, not the model.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.errors import InputError
from qtool.io.safetensors_header import TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
# Any index of safetensors shards (transformers names them `<weights name>.index.json`): it maps tensors to the
# source's shard files, so an output never carries one; it writes its own where it is sharded
INDEX_SUFFIX = ".safetensors.index.json"
# The name of qtool's temporary outputs (io.writer.atomic_output): a run writing beside a lone-file source has one
# in its folder while it works, which is no part of the source
TMP_PREFIX = ".qtool-tmp-"
MAX_ENTRIES = 10_000  # directory entries looked at when listing a folder: bounded by what is there
SINGLE_NAME = "model.safetensors"
# One routed expert's module: `P.experts.{e}.ROLE` (Mixtral's `block_sparse_moe.experts.3.w1`); inspect, repack,
# validate and the quantizers group a mixture-of-experts layer's modules by it
EXPERT_MODULE = re.compile(r"^(?P<parent>.+)\.experts\.(?P<e>\d+)\.(?P<role>[^.]+)$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# The index of pickle shards (transformers' `pytorch_model.bin.index.json`): qtool never reads or writes such
# shards, so an output carrying the index would point its readers at files it does not hold
PICKLE_INDEX_SUFFIXES = tuple(f"{s}.index.json" for s in PICKLE_SUFFIXES)
MAX_JSON_BYTES = 64 << 20

_REFUSE_PICKLE = ("pickle checkpoints are never loaded (loading one can run arbitrary code)",
                  "convert it to safetensors in a trusted environment first")


def model_config(path: str | Path) -> dict:
    """The config.json beside a checkpoint (in its directory, or beside its file or index), or {} where there is
    none or it is not a readable JSON object: for callers that use what a config says when it says it."""
    p = Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    try:
        d = read_json(cfg) if cfg.is_file() else {}
    except InputError:
        return {}
    return d if isinstance(d, dict) else {}


def read_json(path: Path) -> Any:
    """A small JSON file (config, index), bounded and with errors that name it."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read forever
            raise InputError("is not a regular file, expected JSON", path=path)
        if st.st_size > MAX_JSON_BYTES:
            raise InputError(f"JSON file is {st.st_size} bytes, over the {MAX_JSON_BYTES} byte limit", path=path)
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("file not found", path=path) from None
    except PermissionError:
        raise InputError("permission denied", path=path) from None
    except OSError as e:
        raise InputError(f"cannot read ({e.strerror or type(e).__name__})", path=path) from None
    # ValueError: JSONDecodeError, and integers past Python's 4300-digit conversion limit.
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"invalid JSON ({type(e).__name__}: {str(e)[:80]})", path=path) from None


@dataclass
class Checkpoint:
    """A set of safetensors files read as one model.

    path:     what the user named; root: the directory holding configs and other files
    files:    the .safetensors files, in shard order
    tensors:  {full tensor name: TensorInfo} across all files (header only)
    metadata: the first file's __metadata__ (qtool writes the same metadata into every shard)
    config:   config.json or None; quant_config: config.json["quantization_config"] or quantize_config.json
    """

    path: Path
    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    config: dict | None = None
    quant_config: dict | None = None
    index: dict | None = None

    # --- structure ---------------------------------------------------------------------------------
    def modules(self) -> OrderedDict[str, dict[str, TensorInfo]]:
        """{module prefix: {short name: TensorInfo}}; prefix = name up to the last '.' ('' for top-level)."""
        out: OrderedDict[str, dict[str, TensorInfo]] = OrderedDict()
        for name, info in self.tensors.items():
            prefix, _, short = name.rpartition(".")
            out.setdefault(prefix, {})[short] = info
        return out

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # --- data ----------------------------------------------------------------------------------------
    def get(self, name: str, mapped: bool = False):
        """One tensor as a torch.Tensor (dtype and shape as stored), read with a plain positioned read into
        a fresh tensor (see read_tensor): the header was validated by `read_header`, and nothing of the
        source stays resident once the caller drops the tensor (peak memory = one tensor)."""
        info = self.tensors.get(name)
        if info is None:
            raise InputError(f"no tensor named '{name}'", path=self.path, tensor=name)
        return read_tensor(info, mapped)

    def module_tensors(self, prefix: str, names: list[str] | None = None) -> dict:
        """{short name: tensor} for one module (all its tensors, or only `names`)."""
        mods = self.modules() if names is None else None
        shorts = names if names is not None else list(mods.get(prefix, {}))
        pre = f"{prefix}." if prefix else ""
        return {s: self.get(pre + s) for s in shorts if pre + s in self.tensors}

    def close(self) -> None:
        """Nothing is held open between reads; kept so callers can use the checkpoint as a context."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lone_file(self) -> bool:
        return self.path.is_file() and self.path.suffix == ".safetensors"

    def carries_folder(self) -> bool:
        """Whether the rest of `root` belongs to the model read: always for a directory or an index; for a lone
        .safetensors file when its folder holds config.json, the config the model is read with, and loaders
        read the tokenizer and the other files from beside it (an output carries them as for a directory)."""
        return not self._lone_file() or (self.root / "config.json").is_file()

    def _opened_index(self) -> str | None:
        """The name of the index this checkpoint was read through (whatever its name), or None."""
        if self.path.is_file() and self.path.name.endswith(".index.json"):
            return self.path.name
        return INDEX_NAME if self.index is not None else None

    def _entries(self) -> list[Path]:
        """The entries of `root` (sorted; at most MAX_ENTRIES), qtool's own temporaries left out."""
        return sorted(Path(e.path) for e in list_dir(self.root) if not e.name.startswith(TMP_PREFIX))

    def _is_index(self, p: Path) -> bool:
        return p.name.endswith(INDEX_SUFFIX) or p.name == self._opened_index()

    def other_files(self) -> list[Path]:
        """Entries of the source folder that are not weights, indexes or configs we rewrite (tokenizer, ...):
        everything but sub-directories, so that writer.copy_extras copies each regular file, decides what a
        link becomes and names what it does not copy (a FIFO, a socket, a device). [] when the folder is not
        the model's (carries_folder)."""
        if not self.carries_folder():
            return []
        skip = {f.name for f in self.files} | {"config.json", "quantize_config.json"}
        return [p for p in self._entries()
                if (p.is_symlink() or not p.is_dir()) and p.name not in skip and not self._is_index(p)
                and p.suffix not in (".safetensors",) + PICKLE_SUFFIXES and not p.name.endswith(PICKLE_INDEX_SUFFIXES)]

    def replaced_files(self) -> list[Path]:
        """The source's own quantize_config.json (other_files leaves it out: it describes the source's
        quantization, so an output writes its own or none, and the writer says which), where the folder is
        the model's (carries_folder)."""
        if not self.carries_folder():
            return []
        q = self.root / "quantize_config.json"
        return [q] if q.is_file() else []

    def shard_notes(self) -> list[str]:
        """Warnings on what of a lone file's folder is read: when the user named one shard of a sharded model
        only its tensors are read; when the folder holds no config.json, none of its other entries is carried."""
        if not self._lone_file():
            return []
        if not self.carries_folder():
            rest = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in self._entries()
                    if p.name != self.path.name]
            if not rest:
                return []
            shown = ", ".join(rest[:5]) + (", ..." if len(rest) > 5 else "")
            return [f"{self.path.name}: no config.json beside it, so its folder is not read as the model's: its "
                    f"{len(rest)} other entries ({shown}) are not copied; give the directory to copy them"]
        index = self.root / INDEX_NAME
        try:
            wm = read_json(index).get("weight_map") if index.is_file() else None
        except (InputError, AttributeError):
            return []
        if not isinstance(wm, dict) or self.path.name not in set(wm.values()):
            return []
        n = len(set(wm.values()))
        return [f"{self.path.name} is one of the {n} shards {INDEX_NAME} names: only its {len(self.tensors)} "
                f"tensors are read; give the directory to convert the whole model"]

    def left_out_files(self) -> list[Path]:
        """Entries of the source folder that are not part of the model read and never copied into an output,
        each named in a warning (writer.copy_extras): weight files the model read does not include (a
        .safetensors file beside model.safetensors or outside the index, pickles), shard indexes other than the
        one read (that one the output's own index replaces, unnamed), pickle shard indexes, and a lone file's
        sub-directories (sub_directories)."""
        if not self.carries_folder():
            return []
        entries, opened = self._entries(), self._opened_index()
        indexes = [p for p in entries if p.name.endswith((INDEX_SUFFIX, *PICKLE_INDEX_SUFFIXES))
                   and p.name != opened and not p.is_dir()]
        subs = [p for p in entries if p.is_dir() and not p.is_symlink()] if self._lone_file() else []
        weights = [p for p in unread_weight_files(self.root, self.files, (".safetensors", *PICKLE_SUFFIXES))
                   if not p.name.startswith(TMP_PREFIX)]
        return sorted(weights + indexes + subs)

    def sub_directories(self) -> list[Path]:
        """Sub-directories of a directory checkpoint, copied into an output. A lone file's folder carries its
        files only (left_out_files names its sub-directories): an output written beside the file, repack's
        default, lies in that folder, and would be copied into itself."""
        if self._lone_file():
            return []
        return [p for p in self._entries() if p.is_dir() and not p.is_symlink()]


def list_dir(folder: Path) -> list[os.DirEntry]:
    """At most MAX_ENTRIES entries of `folder` ([] when it cannot be listed)."""
    out: list[os.DirEntry] = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                out.append(e)
                if len(out) >= MAX_ENTRIES:
                    break
    except OSError:
        return []
    return out


def unread_weight_files(root: Path, read, suffixes: tuple[str, ...]) -> list[Path]:
    """Files (or links) in `root` ending in one of `suffixes` that are not among `read`, sorted."""
    done = {Path(f).name for f in read if Path(f).parent == root}
    return sorted(Path(e.path) for e in list_dir(root)
                  if e.name not in done and e.name.endswith(suffixes) and not e.is_dir(follow_symlinks=False))


def read_tensor(info: TensorInfo, mapped: bool = False, into=None):
    """The bytes of one tensor as a torch.Tensor; InputError when the dtype has no torch equivalent or the
    file ends early.

    The data is always read (a positioned read checked for its length), never memory-mapped; `mapped` is
    accepted from callers and has no effect. A map of a file that another process truncates meanwhile
    kills the reader with SIGBUS, while a read comes back short and becomes an InputError naming the file.
    into: a writable numpy uint8 buffer of at least `info.nbytes` bytes to read into (the tensor is a view of
    it); a fresh one is allocated when None."""
    import torch

    dtype = _torch_dtype(info.dtype)
    if dtype is None:
        raise InputError(f"dtype {info.dtype} cannot be loaded as a torch tensor", path=info.file, tensor=info.name)
    if into is None or not info.nbytes:
        t = torch.empty(info.shape, dtype=dtype)
    else:
        t = torch.from_numpy(into[:info.nbytes]).view(dtype).reshape(info.shape)
    if info.nbytes:
        _read_into(info.file, info.start, t.reshape(-1).view(torch.uint8).numpy(), info.name)
    return t


def read_bytes(path: Path, start: int, nbytes: int, tensor: str | None = None, into=None):
    """nbytes bytes of `path` from `start` as a numpy uint8 array (a checked read; see read_tensor): a fresh
    one, or the first nbytes of the writable uint8 buffer `into`."""
    import numpy as np

    buf = np.empty(nbytes, dtype=np.uint8) if into is None else into[:nbytes]
    if nbytes:
        _read_into(path, start, buf, tensor)
    return buf


def _read_into(path: Path, start: int, buf, tensor: str | None) -> None:
    """Fill the writable buffer `buf` from `path` at `start`; InputError when the file ends first."""
    want, got = len(memoryview(buf).cast("B")), 0
    try:
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf).cast("B")
            while got < want:
                n = os.preadv(f.fileno(), [view[got:]], start + got) if hasattr(os, "preadv") else \
                    _seek_readinto(f, start + got, view[got:])
                if not n:
                    break
                got += n
    except OSError as e:
        raise InputError(f"cannot read tensor data ({e.strerror or type(e).__name__})", path=path,
                         tensor=tensor) from None
    if got != want:
        raise InputError(f"file ends after {got} of the tensor's {want} bytes", path=path, tensor=tensor,
                         fix="the file is truncated or was changed during the run; download it again")


def _seek_readinto(f, pos: int, view) -> int:
    f.seek(pos)
    return f.readinto(view) or 0


def _torch_dtype(name: str):
    import torch

    return {
        "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
        "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
    }.get(name)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open `path` (file, directory or index). Raises InputError naming what is wrong and what to do."""
    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=p, fix="check the path")
    if p.is_file() and p.suffix in PICKLE_SUFFIXES:
        raise InputError(_REFUSE_PICKLE[0], path=p, fix=_REFUSE_PICKLE[1])
    if p.is_file() and p.suffix == ".gguf":
        raise InputError("is a GGUF file; this command reads safetensors checkpoints", path=p,
                         fix="use `qtool inspect` or `qtool repack` for GGUF")
    index = None
    if p.is_dir():
        root = p
        if (p / INDEX_NAME).is_file():
            index_path = p / INDEX_NAME
        elif (p / SINGLE_NAME).is_file():
            index_path = None
        else:
            index_path = None
    elif p.name.endswith(".index.json"):
        root, index_path = p.parent, p
    elif p.suffix == ".safetensors":
        root, index_path = p.parent, None
    else:
        raise InputError("not a .safetensors file, a directory, or a *.index.json", path=p,
                         fix="give a safetensors checkpoint")

    if index_path is not None:
        index = read_json(index_path)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise InputError("index has no valid 'weight_map' {tensor: shard}", path=index_path)
        if not wm:
            raise InputError("index maps no tensors (empty 'weight_map')", path=index_path,
                             fix="regenerate model.safetensors.index.json")
        files = []
        for shard in dict.fromkeys(wm.values()):
            sp = (root / shard)
            if Path(shard).name != shard:
                raise InputError(f"index names shard '{shard}' outside the checkpoint directory", path=index_path)
            if not sp.is_file():
                raise InputError(f"shard '{shard}' named by the index is missing", path=index_path,
                                 fix="download the missing shard or fix the index")
            files.append(sp)
    elif p.is_dir():
        if (p / SINGLE_NAME).is_file():
            files = [p / SINGLE_NAME]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            pickles = [f.name for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise InputError(f"only pickle weights here ({pickles[0]}); {_REFUSE_PICKLE[0]}", path=p,
                                 fix=_REFUSE_PICKLE[1])
            raise InputError("no .safetensors files in the directory", path=p,
                             fix="point at a checkpoint directory or a .safetensors file")
    else:
        files = [p]

    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for i, f in enumerate(files):
        infos, meta = read_header(f)
        if i == 0:
            metadata = meta
        for name, info in infos.items():
            if name in tensors:
                raise InputError(f"tensor '{name}' appears in two shards ({tensors[name].file.name}, {f.name})",
                                 path=f, tensor=name)
            tensors[name] = info
    if index is not None:
        for name, shard in index["weight_map"].items():
            info = tensors.get(name)
            if info is None or info.file.name != shard:
                raise InputError(f"index maps tensor '{name}' to '{shard}', which does not hold it",
                                 path=index_path, tensor=name, fix="the index and shards disagree; fix the index")

    config = quant = None
    if (root / "config.json").is_file():
        config = read_json(root / "config.json")
        if not isinstance(config, dict):
            raise InputError("config.json is not a JSON object", path=root / "config.json")
        quant = config.get("quantization_config")
    if quant is None and (root / "quantize_config.json").is_file():
        quant = read_json(root / "quantize_config.json")
    if quant is not None and not isinstance(quant, dict):
        raise InputError("quantization config is not a JSON object", path=root)
    return Checkpoint(path=p, root=root, files=files, tensors=tensors, metadata=metadata, config=config,
                      quant_config=quant, index=index)
