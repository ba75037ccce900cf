"""A bounded, validating reader of the safetensors header (no tensor data is touched).

File layout: u64 little-endian N, then N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the data buffer; offsets are relative to the buffer start (8 + N).
Everything read from the file is checked before it is used: the header length against the file size and a
100 MB cap (the limit the safetensors library itself enforces), dtype names, shapes, the byte count implied
by dtype x shape against the offsets, offsets within the file, that the tensors tile the data exactly (no
overlap, gap or trailing bytes), and that no name appears twice.
"""

from __future__ import annotations

import json
import stat
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from qtool.errors import InputError

MAX_HEADER_BYTES = 100_000_000
MAX_ELEMENTS = 1 << 48  # far past any real tensor; stops shape products that would overflow allocators

# Bits per element of every dtype the safetensors format names.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype is the safetensors name ("F16", "I32", ...); start/end are absolute byte
    offsets in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return prod(self.shape)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Return ({name: TensorInfo}, metadata) for a .safetensors file, reading only its header."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            # A FIFO or device would block or never end; a directory is a user mix-up.
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InputError(f"is {what}, expected a .safetensors file", path=p,
                             fix="point at the checkpoint's .safetensors file or its directory")
        size = st.st_size
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"file is {size} bytes, too short for a safetensors header", path=p,
                                 fix="the file is truncated or not safetensors")
            (n,) = struct.unpack("<Q", head)
            # The length is the file's first 8 bytes: never printed, as they may be anything (a shard that
            # is a link to /etc/passwd would show "root:x:0" as a number).
            if n > MAX_HEADER_BYTES:
                raise InputError(f"not a safetensors file (bad header length: over the {MAX_HEADER_BYTES} byte "
                                 "limit)", path=p, fix="the file is corrupt, hostile or not safetensors")
            if 8 + n > size:
                raise InputError(f"not a safetensors file (bad header length: beyond the end of the {size}-byte "
                                 "file)", path=p, fix="the file is truncated or not safetensors")
            raw = f.read(n)
            if len(raw) != n:  # the file shrank after stat (being rewritten?)
                raise InputError(f"the header could not be read in full (only {len(raw)} bytes)", path=p,
                                 fix="the file is truncated or changing; retry when it is complete")
    except FileNotFoundError:
        raise InputError("file not found", path=p) from None
    except PermissionError:
        raise InputError("permission denied", path=p) from None
    except OSError as e:  # EIO, ELOOP, ENAMETOOLONG ...: unreadable, not a bug
        raise InputError(f"cannot read ({e.strerror or type(e).__name__})", path=p) from None
    try:
        header = parse_json(raw)
    except DuplicateName as e:
        raise InputError("the header names this entry twice (readers would disagree on which one counts)",
                         path=p, tensor=_short(e.args[0]), fix="the file is corrupt or hostile") from None
    # ValueError also covers integers past Python's 4300-digit conversion limit ("shape": [999...]);
    # MemoryError: a 100 MB header of millions of tiny entries under a tight address-space limit.
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise InputError(f"header is not valid JSON ({type(e).__name__})", path=p,
                         fix="the file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise InputError("header is not a JSON object", path=p)
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("__metadata__ must map strings to strings", path=p)
    base = 8 + n
    data_len = size - base
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        infos[name] = parse_entry(p, name, entry, base, data_len)
        spans.append((infos[name].start, infos[name].end, name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise InputError(f"data of '{n1}' overlaps '{n0}'", path=p, tensor=n1,
                             fix="the file is corrupt or hostile")
    # The safetensors library reads only files whose tensors tile the data buffer exactly, from its start to
    # the end of the file; so does every loader built on it.
    end = base
    for s0, e0, name in spans:
        if s0 != end:
            raise InputError(f"{s0 - end} bytes before this tensor's data belong to no tensor (the safetensors "
                             "library refuses the file)", path=p, tensor=name, fix="the file is corrupt; rewrite it")
        end = e0
    if end != size:
        raise InputError(f"{size - end} bytes after the last tensor's data belong to no tensor (the safetensors "
                         "library refuses the file)", path=p, fix="the file is corrupt or was appended to; rewrite it")
    return infos, meta


class DuplicateName(ValueError):
    """The header JSON names a key twice (args[0]); JSON readers disagree on which one counts."""


def parse_json(raw: bytes):
    """The header bytes as JSON, refusing a key given twice (DuplicateName); ValueError / UnicodeDecodeError
    for text that is not JSON."""
    return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateName(k)
        out[k] = v
    return out


def _short(v: object, limit: int = 60) -> str:
    """A value from the file, shortened for an error message (it may be a 4000-digit integer)."""
    try:
        text = str(v)
    except ValueError:
        return "<a huge number>"
    return text if len(text) <= limit else text[:limit] + "..."


def parse_entry(p: Path, name: str, entry: object, base: int, data_len: int) -> TensorInfo:
    """Validate one header entry (dtype, shape, offsets against `data_len` bytes of data after `base`)."""
    def bad(msg: str) -> InputError:
        return InputError(msg, path=p, tensor=name, fix="the file is corrupt or hostile")

    if not isinstance(entry, dict):
        raise bad("entry is not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {_short(dtype, 20)!r}")
    # each dimension on its own too: [2**64, 0] holds no element, but no reader indexes past 2^48
    if not isinstance(shape, list) or len(shape) > 16 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in shape):
        raise bad("shape must be a list of at most 16 integers in [0, 2^48]")
    numel = prod(shape)
    if numel > MAX_ELEMENTS:
        # Neither number is printed in full: Python refuses to format integers past 4300 digits.
        raise bad(f"shape {_short(shape)} claims more than 2^48 elements")
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
        raise bad("data_offsets must be two integers")
    begin, end = offs
    if not 0 <= begin <= end:
        raise bad(f"data_offsets {_short(offs)} are not ordered")
    if end > data_len:
        raise bad(f"data_offsets end {_short(end)} is beyond the {data_len} data bytes in the file (truncated?)")
    nbits = numel * DTYPE_BITS[dtype]
    if nbits % 8 or nbits // 8 != end - begin:
        raise bad(f"{dtype} {shape} needs {nbits / 8:g} bytes but data_offsets give {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), p, base + begin, base + end)
