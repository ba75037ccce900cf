"""Opening a safetensors checkpoint for inspection: like `qtool.io.checkpoint.open_checkpoint`, but a broken
checkpoint is something to describe, not a reason to stop.

A missing shard, an index naming a tensor no shard holds, a truncated file, or two configs that disagree
become anomalies; whatever can still be read is returned. Only headers are read.
"""

from __future__ import annotations

import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import InputError
from qtool.inspect.report import Anomaly
from qtool.io.checkpoint import INDEX_NAME, PICKLE_SUFFIXES, SINGLE_NAME, Checkpoint, read_json
from qtool.io.safetensors_header import MAX_HEADER_BYTES, TensorInfo, parse_entry, parse_json, read_header


@dataclass
class Headers:
    """The headers, configs and metadata of a checkpoint as inspect reads them (no tensor data; repack opens
    its own `qtool.repack.source.Source` on top of inspect). `incomplete`: tensors whose data runs past the
    end of their file."""

    path: Path
    root: Path
    files: list[Path]
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    config: dict | None
    quant_raw: dict | None
    quant_source: str | None
    index: dict | None
    incomplete: set[str] = field(default_factory=set)
    anomalies: list[Anomaly] = field(default_factory=list)
    cut_files: set[Path] = field(default_factory=set)
    _ckpt: Checkpoint | None = None

    def checkpoint(self) -> Checkpoint:
        """A Checkpoint over the complete tensors, for reading data under --deep."""
        if self._ckpt is None:
            ok = {n: t for n, t in self.tensors.items() if n not in self.incomplete}
            self._ckpt = Checkpoint(path=self.path, root=self.root, files=self.files, tensors=ok,
                                    metadata=self.metadata, config=self.config, quant_config=self.quant_raw,
                                    index=self.index)
        return self._ckpt

    def get(self, name: str):
        """One complete tensor as torch.Tensor. Files cut short are refused by safetensors' own reader, so
        their complete tensors are read here from the validated offsets."""
        info = self.tensors[name]
        if info.file not in self.cut_files:
            return self.checkpoint().get(name)
        import torch

        with info.file.open("rb") as f:
            f.seek(info.start)
            raw = bytearray(f.read(info.nbytes))
        if len(raw) != info.nbytes:
            raise InputError("data truncated", path=info.file, tensor=name)
        return torch.frombuffer(raw, dtype=_torch_dtype(info.dtype)).reshape(info.shape) if raw else \
            torch.empty(info.shape, dtype=_torch_dtype(info.dtype))

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


def _torch_dtype(name: str):
    import torch

    table = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
             "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    if name not in table:
        raise InputError(f"dtype {name} cannot be read into torch")
    return table[name]


def _err(anoms: list[Anomaly], msg: str, tensor: str | None = None, severity: str = "error") -> None:
    anoms.append(Anomaly(severity, tensor, msg))


def read_headers(path: Path) -> Headers:
    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=p, fix="check the path")
    if p.is_file() and p.suffix in PICKLE_SUFFIXES:
        raise InputError("pickle checkpoints are never loaded (loading one can run arbitrary code)", path=p,
                         fix="convert it to safetensors in a trusted environment first")
    anoms: list[Anomaly] = []
    index = None
    index_path = None
    if p.is_dir():
        root = p
        if (p / INDEX_NAME).is_file():
            index_path = p / INDEX_NAME
    elif p.name.endswith(".index.json"):
        root, index_path = p.parent, p
    elif p.suffix == ".safetensors":
        root = p.parent
    else:
        raise InputError("not a .safetensors file, a .gguf file, a directory, or a *.index.json", path=p,
                         fix="give a checkpoint file or directory")

    files: list[Path] = []
    weight_map: dict[str, str] = {}
    if index_path is not None:
        index = read_json(index_path)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise InputError("index has no valid 'weight_map' {tensor: shard}", path=index_path,
                             fix="regenerate model.safetensors.index.json")
        weight_map = wm
        for shard in dict.fromkeys(wm.values()):
            if Path(shard).name != shard:
                _err(anoms, f"index names shard '{shard}' outside the checkpoint directory; not read")
                continue
            sp = root / shard
            if sp.is_file():
                files.append(sp)
            else:
                n = sum(1 for v in wm.values() if v == shard)
                _err(anoms, f"shard '{shard}' named by the index is missing ({n} tensors unavailable); fix: "
                            "download the missing shard")
    elif p.is_dir():
        if (p / SINGLE_NAME).is_file():
            files = [p / SINGLE_NAME]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise InputError("no .safetensors or .gguf files in the directory", path=p,
                             fix="point at a checkpoint directory, a .safetensors file or a .gguf file")
    else:
        files = [p]

    tensors: dict[str, TensorInfo] = {}
    incomplete: set[str] = set()
    metadata: dict[str, str] = {}
    read_files = []
    cut_files: set[Path] = set()
    for f in files:
        try:
            infos, meta = read_header(f)
            cut = set()
        except InputError as e:
            got = _tolerant_header(f)
            if got is None:
                _err(anoms, f"{f.name}: unreadable header: {e.problem}", tensor=e.tensor)
                continue
            infos, meta, cut, msg = got
            cut_files.add(f)
            _err(anoms, f"{f.name}: {msg}")
        read_files.append(f)
        if not metadata:
            metadata = meta
        for name, info in infos.items():
            if name in tensors:
                _err(anoms, f"tensor appears in two shards ({tensors[name].file.name}, {f.name}); the second "
                            "copy is ignored", tensor=name)
                continue
            tensors[name] = info
        incomplete |= cut
    if not read_files:
        errs = [a for a in anoms if a.severity == "error"]
        why = "; ".join(a.message for a in errs) or "no readable file"
        raise InputError(f"nothing readable: {why}", path=p, tensor=next((a.tensor for a in errs if a.tensor), None),
                         fix="the checkpoint is corrupt or incomplete")
    if weight_map:
        missing_files = {f.name for f in files} - {f.name for f in read_files}
        absent = []
        for name, shard in weight_map.items():
            info = tensors.get(name)
            if shard in missing_files or not (root / shard).is_file():
                continue
            if info is None or info.file.name != shard:
                absent.append((name, shard))
        for name, shard in absent[:20]:
            _err(anoms, f"index maps this tensor to '{shard}', which does not hold it; fix: correct the index "
                        "or restore the tensor", tensor=name)
        if len(absent) > 20:
            _err(anoms, f"... and {len(absent) - 20} more tensors the index maps to shards that lack them")
        extra = [n for n in tensors if n not in weight_map]
        if extra:
            _err(anoms, f"{len(extra)} tensors are in shards but not in the index (e.g. '{extra[0]}'); loaders "
                        "that follow the index will not see them", severity="warning")

    config, quant_raw, quant_source = _configs(root, anoms)
    return Headers(path=p, root=root, files=read_files, tensors=tensors, metadata=metadata, config=config,
                  quant_raw=quant_raw, quant_source=quant_source, index=index, incomplete=incomplete,
                  anomalies=anoms, cut_files=cut_files)


_COMPARE = ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "lm_head")


def config_disagreements(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(key, config.json's value, quantize_config.json's value) for every compared key the two set apart."""
    return [(k, a[k], b[k]) for k in _COMPARE if k in a and k in b and a[k] != b[k]]


def _configs(root: Path, anoms: list[Anomaly]) -> tuple[dict | None, dict | None, str | None]:
    config = None
    a = b = None
    if (root / "config.json").is_file():
        try:
            config = read_json(root / "config.json")
        except InputError as e:
            _err(anoms, f"config.json: {e.problem}")
        if config is not None and not isinstance(config, dict):
            _err(anoms, "config.json is not a JSON object")
            config = None
        if config is not None:
            a = config.get("quantization_config")
            if a is not None and not isinstance(a, dict):
                _err(anoms, "config.json quantization_config is not an object")
                a = None
            mlx = config.get("quantization")
            if a is None and isinstance(mlx, dict):  # MLX keeps {group_size, bits, <module>: {...}} here
                return config, mlx, "config.json quantization"
    if (root / "quantize_config.json").is_file():
        try:
            b = read_json(root / "quantize_config.json")
        except InputError as e:
            _err(anoms, f"quantize_config.json: {e.problem}")
        if b is not None and not isinstance(b, dict):
            _err(anoms, "quantize_config.json is not a JSON object")
            b = None
    if a is not None and b is not None:
        for k, va, vb in config_disagreements(a, b):
            _err(anoms, f"config.json says {k}={va!r} but quantize_config.json says {vb!r}; loaders "
                        "disagree on which file wins (transformers reads config.json)", severity="warning")
    if a is not None:
        return config, a, "config.json quantization_config"
    if b is not None:
        return config, b, "quantize_config.json"
    return config, None, None


def _tolerant_header(f: Path):
    """Parse a header whose data is cut: (infos of every entry, metadata, names past the end, message),
    or None when the header itself is unreadable."""
    try:
        st = f.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            return None
        size = st.st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return None
            header = parse_json(fh.read(n))
    # ValueError: bad JSON, 5000-digit ints, a name given twice (DuplicateName)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        meta = {}
    meta = {str(k): str(v) for k, v in meta.items()}
    base = 8 + n
    data_len = size - base
    infos, cut = {}, set()
    try:
        for name, entry in header.items():
            info = parse_entry(f, name, entry, base, 1 << 62)  # validate everything except the end of the file
            infos[name] = info
            if info.end - base > data_len:
                cut.add(name)
    except InputError:
        return None
    if not cut:
        return None
    need = max(t.end for t in infos.values())
    msg = f"truncated: {size} of {need} bytes; {len(infos) - len(cut)} of {len(infos)} tensors complete"
    return infos, meta, cut, msg
