"""Writing outputs safely: atomic destinations and a streaming, sharded safetensors writer.

Atomicity: every output is built under a hidden temporary name beside the destination and renamed into
place only when complete. An existing destination is refused unless `force`; with `force` the old one is
moved aside only after the new one is complete, then deleted. A run killed with SIGKILL leaves at most a
hidden `.NAME.qtool-tmp-PID` entry, never a partial destination; the next run cleans such leftovers whose
process is gone.

Streaming: tensors are written to the shard file as they arrive (nothing is buffered beyond one tensor), so
peak memory is the largest tensor, not the shard. The header goes into space reserved at the front of the
file and is padded with spaces, as the safetensors format allows; if it outgrows the reservation the
shard is rewritten once with a larger header.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

from qtool.errors import OutputError
from qtool.io.safetensors_header import TensorInfo

TMP_TAG = ".qtool-tmp-"
HEADER_RESERVE = 64 << 10  # bytes reserved for a shard's JSON header; 8-aligned
DEFAULT_MAX_SHARD = 4_000_000_000

_TORCH_TO_ST = {
    "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
    "torch.int8": "I8", "torch.uint8": "U8", "torch.int16": "I16", "torch.int32": "I32", "torch.int64": "I64",
    "torch.bool": "BOOL", "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2",
    "torch.uint16": "U16", "torch.uint32": "U32", "torch.uint64": "U64",
}


def st_dtype(t) -> str:
    """safetensors dtype name of a torch tensor."""
    key = str(t.dtype)
    if key not in _TORCH_TO_ST:
        raise OutputError(f"cannot store dtype {t.dtype} in safetensors")
    return _TORCH_TO_ST[key]


def parse_size(text: str | int) -> int:
    """'4GB', '500MB', '2GiB', '1000' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, mult = s, 1
    try:
        val = float(num)
    except ValueError:
        raise OutputError(f"cannot read size '{text}'", fix="use e.g. 4GB, 500MB or 2GiB") from None
    if val <= 0:
        raise OutputError(f"size '{text}' must be positive")
    return int(val * mult)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def clean_stale(dest: Path) -> None:
    """Remove leftovers of earlier killed runs for this destination (their process no longer exists)."""
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        return
    prefix = f".{dest.name}{TMP_TAG}"
    for p in parent.iterdir():
        if p.name.startswith(prefix):
            pid = p.name[len(prefix):].split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                _remove(p)


@contextlib.contextmanager
def atomic_output(dest: str | Path, force: bool = False, *, directory: bool = True) -> Iterator[Path]:
    """Yield a temporary path (a created directory, or a file path when directory=False) to write into;
    on normal exit it replaces `dest`; on any exception (Ctrl-C included) it is removed and dest is untouched.
    """
    dest = Path(dest)
    if dest.exists() and not force:
        raise OutputError("destination exists", path=dest, fix="choose another -o, or pass --force to replace it")
    if not dest.parent.exists():
        raise OutputError("parent directory does not exist", path=dest, fix="create it first")
    clean_stale(dest)
    tmp = dest.parent / f".{dest.name}{TMP_TAG}{os.getpid()}-{os.urandom(3).hex()}"
    if directory:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if dest.exists():
        old = dest.parent / f".{dest.name}{TMP_TAG}{os.getpid()}-old"
        os.replace(dest, old) if not old.exists() else (_remove(old), os.replace(dest, old))
        os.replace(tmp, dest)
        _remove(old)
    else:
        os.replace(tmp, dest)


class ShardedWriter:
    """Stream tensors into `model.safetensors`, or into `model-0000k-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when the total exceeds `max_shard_size` bytes.

    metadata: str -> str, written into every shard; {"format": "pt"} is always included.
    """

    def __init__(self, directory: Path, max_shard_size: int = DEFAULT_MAX_SHARD,
                 metadata: dict[str, str] | None = None):
        self.dir = Path(directory)
        self.max = max_shard_size
        self.metadata = {"format": "pt", **(metadata or {})}
        self._shards: list[tuple[Path, list[str]]] = []
        self._f = None
        self._entries: dict[str, dict] = {}
        self._pos = 0
        self._total = 0
        self._names: set[str] = set()

    # --- adding ------------------------------------------------------------------------------------
    def add(self, name: str, tensor) -> None:
        """Append one tensor (any device/layout; written little-endian, C order)."""
        import torch

        t = tensor.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        self._begin(name, n)
        if n:
            buf = t.reshape(-1).view(torch.uint8).numpy()
            self._f.write(memoryview(buf))
        self._finish(name, st_dtype(t), list(t.shape), n)

    def add_raw(self, name: str, info: TensorInfo) -> None:
        """Copy a tensor's bytes from a source file unchanged (byte for byte)."""
        n = info.nbytes
        self._begin(name, n)
        with info.file.open("rb") as src:
            src.seek(info.start)
            left = n
            while left:
                chunk = src.read(min(left, 16 << 20))
                if not chunk:
                    raise OutputError(f"source ended early while copying '{name}'", path=info.file, tensor=name)
                self._f.write(chunk)
                left -= len(chunk)
        self._finish(name, info.dtype, list(info.shape), n)

    def _begin(self, name: str, nbytes: int) -> None:
        if name in self._names:
            raise OutputError(f"tensor '{name}' written twice", tensor=name)
        self._names.add(name)
        if self._f is not None and self._pos > 0 and self._pos + nbytes > self.max:
            self._close_shard()
        if self._f is None:
            self._open_shard()

    def _finish(self, name: str, dtype: str, shape: list[int], n: int) -> None:
        self._entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [self._pos, self._pos + n]}
        self._pos += n
        self._total += n

    # --- shards ------------------------------------------------------------------------------------
    def _open_shard(self) -> None:
        k = len(self._shards) + 1
        path = self.dir / f"model-{k:05d}.safetensors.part"
        self._f = path.open("wb")
        self._f.seek(8 + HEADER_RESERVE)
        self._shards.append((path, []))
        self._entries = {}
        self._pos = 0

    def _close_shard(self) -> None:
        path, names = self._shards[-1]
        names.extend(self._entries)
        header = {"__metadata__": self.metadata, **self._entries}
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(raw) <= HEADER_RESERVE:
            self._f.seek(0)
            self._f.write(struct.pack("<Q", HEADER_RESERVE))
            self._f.write(raw + b" " * (HEADER_RESERVE - len(raw)))
            self._f.close()
        else:  # rare: very many tensors in one shard; rewrite once with an exact header
            self._f.close()
            pad = (-len(raw)) % 8
            fixed = path.with_suffix(".rewrite")
            with path.open("rb") as src, fixed.open("wb") as dst:
                dst.write(struct.pack("<Q", len(raw) + pad))
                dst.write(raw + b" " * pad)
                src.seek(8 + HEADER_RESERVE)
                shutil.copyfileobj(src, dst, 16 << 20)
            os.replace(fixed, path)
        self._f = None

    def close(self) -> list[Path]:
        """Finish the last shard, name the files, write the index when sharded. Returns the files."""
        if self._f is None and not self._shards:
            self._open_shard()  # an empty model still gets a valid file
        if self._f is not None:
            self._close_shard()
        n = len(self._shards)
        final: list[Path] = []
        weight_map: dict[str, str] = {}
        for k, (path, names) in enumerate(self._shards, start=1):
            name = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            target = self.dir / name
            os.replace(path, target)
            final.append(target)
            for t in names:
                weight_map[t] = name
        if n > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return final

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
