"""A bounded GGUF header reader: metadata and tensor directory, never tensor data.

Why not `gguf.GGUFReader`: it builds a numpy view of every tensor and of every array value while it parses,
so a 7B file's header with a 32000-entry vocabulary takes seconds, and a truncated file fails with an opaque
`cannot reshape array`. This reader walks the header with `struct` over an mmap, checks every length and
count against the bytes that remain before using it, summarises huge arrays instead of materialising them,
and reports truncation (`truncated: X of Y bytes; k of n tensors complete`) instead of raising.

The `gguf` package supplies only its tables (type ids, block sizes, file-type names). Its package
`__init__` imports numpy and yaml (~0.25 s); the tables live in the pure-Python `gguf/constants.py`, so that
file alone is loaded when the package has not been imported yet.

Layout (little-endian; a big-endian file is detected from its version field):
    magic "GGUF" | version u32 (2 or 3) | tensor_count u64 | kv_count u64
    kv_count x  { key: string | value_type u32 | value }
    tensor_count x { name: string | n_dims u32 | ne[n_dims] u64 | type u32 | offset u64 }
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
    string = u64 length + UTF-8 bytes;  array = item_type u32 + count u64 + items
"""

from __future__ import annotations

import importlib.util
import mmap
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtool.errors import InputError, UsageError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
# Counts above these are corruption, not models: they bound the work a hostile header can ask for.
MAX_TENSORS = 10_000_000
MAX_KV = 1_000_000
MAX_ARRAY_NESTING = 4
MAX_ELEMENTS = (1 << 63) - 1    # ggml counts elements in int64
MAX_REPORTED = 5                # problems of one kind listed one by one; the rest are counted
# Arrays longer than this are summarised (count, item type, byte size, a short preview).
ARRAY_INLINE_LIMIT = 64
ARRAY_PREVIEW = 5

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


# --- the gguf package's tables, without its numpy import ------------------------------------------

def _constants():
    mod = sys.modules.get("gguf.constants")
    if mod is not None:
        return mod
    try:
        spec = importlib.util.find_spec("gguf")
    except (ImportError, ValueError):  # pragma: no cover - gguf is a dependency
        spec = None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locs[0]) / "constants.py" if locs else None
    if path is not None and path.is_file():
        cspec = importlib.util.spec_from_file_location("_qtool_gguf_constants", path)
        mod = importlib.util.module_from_spec(cspec)
        cspec.loader.exec_module(mod)
        return mod
    import gguf.constants as mod  # pragma: no cover

    return mod


_C = _constants()


def gguf_constants():
    """The gguf package's constants module (key names, architecture names, types), loaded without numpy."""
    return _C

_QTYPE_NAMES: dict[int, str] = {int(t): t.name for t in _C.GGMLQuantizationType}
_QTYPE_SIZES: dict[int, tuple[int, int]] = {int(t): v for t, v in _C.GGML_QUANT_SIZES.items()}
_FILE_TYPE_NAMES: dict[int, str] = {int(t): t.name for t in _C.LlamaFileType}

# value type id -> (name, struct code or None for string/array)
_VTYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "B"), 1: ("INT8", "b"), 2: ("UINT16", "H"), 3: ("INT16", "h"), 4: ("UINT32", "I"),
    5: ("INT32", "i"), 6: ("FLOAT32", "f"), 7: ("BOOL", "?"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "Q"), 11: ("INT64", "q"), 12: ("FLOAT64", "d"),
}
_STRING, _ARRAY = 8, 9


def qtype_name(type_id: int) -> str:
    return _QTYPE_NAMES.get(type_id, f"UNKNOWN_{type_id}")


def qtype_block(type_id: int) -> tuple[int, int] | None:
    """(elements per block, bytes per block) from gguf.GGML_QUANT_SIZES, or None for an unknown id."""
    return _QTYPE_SIZES.get(type_id)


def file_type_name(ftype: int) -> str:
    return _FILE_TYPE_NAMES.get(ftype, f"UNKNOWN_{ftype}")


def nominal_bits(type_name: str) -> int | None:
    """The code width a type is named for: Q4_K -> 4, IQ3_S -> 3, F16 -> 16, MXFP4 -> 4."""
    m = re.match(r"^(?:Q|IQ|TQ)(\d)", type_name)
    if m:
        return int(m.group(1))
    return {"F32": 32, "F16": 16, "BF16": 16, "F64": 64, "I8": 8, "I16": 16, "I32": 32, "I64": 64,
            "MXFP4": 4, "NVFP4": 4}.get(type_name)


# K-quants: a 256-weight super-block (the group an engine splits the rows at) holds sub-blocks of this many
# weights, each with its own 4- or 6-bit scale (and min) under the super-block's fp16 d (ggml-common.h).
K_SUB_BLOCK = {"Q2_K": 16, "Q3_K": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}

# Types whose blocks carry a minimum/offset besides the scale (w = d*q + m or d*q - dmin*m).
ASYM_TYPES = frozenset({"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


# --- results --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArraySummary:
    """A GGUF array value too long to materialise (a tokenizer vocabulary, merges, scores)."""

    item_type: str
    count: int
    nbytes: int
    preview: tuple
    offset: int = field(default=-1, compare=False)  # of its first item in the file (read_array)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "array", "item_type": self.item_type, "count": self.count, "nbytes": self.nbytes,
                "preview": list(self.preview)}


# Big-endian GGUF data, per type: (bytes per unit, [(offset, size) of each multi-byte scalar in a unit]).
# Float and integer tensors swap every element; Q4_0/Q8_0 blocks swap their fp16 d, Q4_1 its d and m; the
# 4- and 8-bit codes are single bytes. Other block types hold packed multi-byte fields of their own and are
# refused rather than guessed.
SWAPPABLE: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = {
    "F64": (8, ((0, 8),)), "I64": (8, ((0, 8),)), "F32": (4, ((0, 4),)), "I32": (4, ((0, 4),)),
    "F16": (2, ((0, 2),)), "BF16": (2, ((0, 2),)), "I16": (2, ((0, 2),)), "I8": (1, ()),
    "Q4_0": (18, ((0, 2),)), "Q8_0": (34, ((0, 2),)), "Q4_1": (20, ((0, 2), (2, 2))),
}


def to_little_endian(raw, type_name: str):
    """uint8 bytes of a big-endian GGUF tensor -> the same values' little-endian bytes (a new array)."""
    unit, fields = SWAPPABLE[type_name]
    out = raw.reshape(-1, unit).copy()
    for off, size in fields:
        out[:, off:off + size] = out[:, off:off + size][:, ::-1]
    return out.reshape(-1)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor-directory entry. `shape` is GGUF order (ne0 first: ne0 = in_features for a weight).

    start/end are absolute byte offsets in `file`; nbytes is None when the type id is unknown.
    """

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    start: int
    nbytes: int | None
    file: Path
    complete: bool

    @property
    def type_name(self) -> str:
        return qtype_name(self.type_id)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int | None:
        return None if self.nbytes is None else self.start + self.nbytes

    @property
    def block(self) -> tuple[int, int] | None:
        return qtype_block(self.type_id)

    @property
    def bpw(self) -> float | None:
        b = self.block
        return None if b is None else 8.0 * b[1] / b[0]


@dataclass
class GGUFHeader:
    """What one .gguf file's header says, plus what was wrong with it.

    complete: the header parsed to its end (metadata and whole tensor directory).
    kv_complete: every metadata record was read (the tensor directory may still be cut): a key absent from `kv`
                 is absent from the file.
    kv_spans: key -> (start, end) byte offsets of its whole record (key, value type, value) in the file, for
              copying metadata without materialising it (a repack carries them byte for byte).
    problems: (severity, tensor name or None, message) found while parsing; never raised.
    """

    path: Path
    file_size: int
    version: int
    byte_order: str
    tensor_count: int
    kv_count: int
    kv: dict[str, Any] = field(default_factory=dict)
    kv_types: dict[str, str] = field(default_factory=dict)
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int | None = None
    header_end: int = 0
    complete: bool = False
    kv_complete: bool = False
    problems: list[tuple[str, str | None, str]] = field(default_factory=list)

    @property
    def expected_size(self) -> int:
        """Bytes the file needs: the end of its last tensor (a lower bound when the header is cut)."""
        ends = [t.end for t in self.tensors if t.end is not None]
        base = self.data_start if self.data_start is not None else self.header_end
        return max([base, *ends])

    @property
    def tensors_complete(self) -> int:
        return sum(1 for t in self.tensors if t.complete)

    @property
    def truncated(self) -> bool:
        return not self.complete or self.file_size < self.expected_size

    def truncation_message(self) -> str | None:
        if not self.truncated:
            return None
        if not self.complete:  # parsing stopped inside the header: the file ends there, or a value is corrupt
            return (f"header unreadable from byte {self.header_end} of the {self.file_size}-byte file (cut short "
                    f"or corrupt): {len(self.kv)} of {self.kv_count} metadata keys and {len(self.tensors)} of "
                    f"{self.tensor_count} tensor entries read; {self.tensors_complete} of {self.tensor_count} "
                    "tensors complete")
        msg = (f"truncated: {self.file_size} of {self.expected_size} bytes; "
               f"{self.tensors_complete} of {self.tensor_count} tensors complete")
        first = next((t.name for t in self.tensors if not t.complete), None)
        if first is not None:
            msg += f"; first incomplete tensor '{first}'"
        return msg


@dataclass
class GGUFSet:
    """A single GGUF file or a split set `<stem>-0000k-of-0000n.gguf` read as one model.

    kv: metadata of the first readable file (split files repeat only the split.* keys).
    missing: split files named by the set that are absent.
    extra: files beside the set named like its members but outside it (`<stem>-00004-of-00003.gguf`, a member
           of a set of another size): a second download, or a set that was re-split.
    """

    path: Path
    headers: list[GGUFHeader]
    missing: list[Path] = field(default_factory=list)
    extra: list[Path] = field(default_factory=list)

    @property
    def kv(self) -> dict[str, Any]:
        return self.headers[0].kv if self.headers else {}

    @property
    def kv_types(self) -> dict[str, str]:
        return self.headers[0].kv_types if self.headers else {}

    @property
    def tensors(self) -> list[GGUFTensor]:
        return [t for h in self.headers for t in h.tensors]

    @property
    def files(self) -> list[Path]:
        return [h.path for h in self.headers]

    @property
    def file_size(self) -> int:
        return sum(h.file_size for h in self.headers)


# --- parsing --------------------------------------------------------------------------------------

class _Cut(Exception):
    """The header ends before a field it announces (truncated file or a corrupt length)."""


class _Parser:
    def __init__(self, buf, size: int, order: str):
        self.buf = buf
        self.size = size
        self.o = order
        self.pos = 0
        self.bad_utf8: list[str] = []  # what held bytes that are not UTF-8 (decoded with U+FFFD for display)
        self._u32 = struct.Struct(order + "I").unpack_from
        self._u64 = struct.Struct(order + "Q").unpack_from
        self._scalar = {k: struct.Struct(order + c) for k, (_, c) in _VTYPES.items() if c}

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise _Cut(f"{what} needs {n} bytes at offset {self.pos} but the file has {self.size - self.pos} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = self._u32(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = self._u64(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what + " length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.bad_utf8.append(what)
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth)
        st = self._scalar.get(vtype)
        if st is None:
            raise _Cut(f"{what}: unknown value type {vtype}")
        self.need(st.size, what)
        v = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return v

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise _Cut(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        itype = self.u32(what + " item type")
        count = self.u64(what + " count")
        if itype not in _VTYPES:
            raise _Cut(f"{what}: unknown array item type {itype}")
        iname, code = _VTYPES[itype]
        start = self.pos
        if code is not None:
            st = self._scalar[itype]
            # Check the whole array against the file before touching it; a corrupt count fails here.
            if count > (self.size - self.pos) // st.size:
                raise _Cut(f"{what}: {count} x {iname} needs {count * st.size} bytes at offset {self.pos} "
                           f"but the file has {self.size - self.pos} left")
            n_prev = count if count <= ARRAY_INLINE_LIMIT else ARRAY_PREVIEW
            items = [st.unpack_from(self.buf, self.pos + k * st.size)[0] for k in range(n_prev)]
            self.pos += count * st.size
        elif itype == _STRING:
            # Every string costs at least its 8-byte length: bound the count before the loop.
            if count > (self.size - self.pos) // 8:
                raise _Cut(f"{what}: {count} strings need at least {8 * count} bytes at offset {self.pos} "
                           f"but the file has {self.size - self.pos} left")
            keep = count if count <= ARRAY_INLINE_LIMIT else ARRAY_PREVIEW
            items = [self.string(f"{what}[{k}]") for k in range(min(keep, count))]
            # The skip loop is the hot path for vocabularies: locals, no per-item objects.
            buf, pos, size, u64 = self.buf, self.pos, self.size, self._u64
            for k in range(len(items), count):
                if size - pos < 8:
                    self.pos = pos
                    raise _Cut(f"{what}[{k}] length needs 8 bytes at offset {pos}")
                n = u64(buf, pos)[0]
                pos += 8
                if n > size - pos:
                    self.pos = pos
                    raise _Cut(f"{what}[{k}] needs {n} bytes at offset {pos} but the file has {size - pos} left")
                pos += n
            self.pos = pos
        else:  # nested arrays: rare (none in llama.cpp's own keys); materialise up to the limit
            if count > (self.size - self.pos) // 12:
                raise _Cut(f"{what}: {count} nested arrays cannot fit in the {self.size - self.pos} bytes left")
            items = []
            for k in range(count):
                v = self.array(f"{what}[{k}]", depth + 1)
                if k < ARRAY_PREVIEW or count <= ARRAY_INLINE_LIMIT:
                    items.append(v)
        if count <= ARRAY_INLINE_LIMIT:
            return items
        return ArraySummary(item_type=iname, count=count, nbytes=self.pos - start, preview=tuple(items[:ARRAY_PREVIEW]),
                            offset=start)


def read_array(header: GGUFHeader, value: Any) -> list:
    """A metadata value in full: an ArraySummary (a vocabulary, merges, scores) read from its file at the offset
    the header recorded, with the header's bounds and UTF-8 handling; any other value as it is (a short
    array is whole already). Strings and numbers come back as Python values, as the gguf package's reader
    gives them."""
    if not isinstance(value, ArraySummary):
        return value
    itype = next(k for k, (name, _) in _VTYPES.items() if name == value.item_type)
    with open(header.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            p = _Parser(mm, header.file_size, "<" if header.byte_order == "little" else ">")
            p.pos = value.offset
            code = _VTYPES[itype][1]
            if code is not None:
                st = p._scalar[itype]
                p.need(value.count * st.size, value.item_type + " array")
                return [x[0] for x in st.iter_unpack(mm[p.pos:p.pos + value.count * st.size])]
            if itype == _STRING:
                return [p.string(f"item {k}") for k in range(value.count)]
            return [p.array(f"item {k}", 1) for k in range(value.count)]
        except _Cut as e:
            raise InputError(f"metadata array: {e}", path=header.path,
                             fix="the file changed since its header was read, or is corrupt") from None
        finally:
            mm.close()


_CACHE: dict[tuple, GGUFHeader] = {}
_CACHE_SIZE = 4


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse one .gguf file's header (the last few parsed are reused while the file's identity, size and
    modification time are unchanged: a repack reads the header once for inspection and once to convert)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    h = _read_gguf_header(path)
    if key is not None:
        while len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = h
    return h


def _read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse one .gguf file's header. Raises InputError only when the file is not GGUF at all
    (missing, too short for the fixed header, wrong magic, unsupported version); everything else
    (truncation, corrupt lengths, unaligned or overlapping tensors) lands in `header.problems`."""
    path = Path(path)
    if not path.is_file():
        raise InputError("no such GGUF file", path=path, fix="check the path")
    size = path.stat().st_size
    if size < 24:
        raise InputError(f"file is {size} bytes, shorter than the 24-byte GGUF header", path=path,
                         fix="the file is empty or cut; download it again")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse(path, mm, size)
        finally:
            mm.close()


def _parse(path: Path, mm, size: int) -> GGUFHeader:
    if mm[:4] != GGUF_MAGIC:
        n = struct.unpack_from("<Q", mm, 0)[0]
        if 8 < n + 8 <= size and mm[8:9] == b"{":  # a safetensors header: u64 length, then a JSON object
            raise InputError("not a GGUF file: it holds a safetensors header (misnamed .gguf)", path=path,
                             fix="rename it to .safetensors and inspect it again")
        raise InputError("not a GGUF file (bad magic, expected b'GGUF')", path=path,  # bytes not shown
                         fix="pass a .gguf file, a .safetensors file or a checkpoint directory")
    v_le = struct.unpack_from("<I", mm, 4)[0]
    v_be = struct.unpack_from(">I", mm, 4)[0]
    if v_le in (2, 3):
        order, version = "<", v_le
    elif v_be in (2, 3):
        order, version = ">", v_be
    else:
        raise InputError(f"unsupported GGUF version {v_le}", path=path,
                         fix="qtool reads GGUF v2 and v3; convert older files with llama.cpp")
    p = _Parser(mm, size, order)
    p.pos = 8
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("kv count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise InputError(f"header claims {n_tensors} tensors and {n_kv} metadata keys; the file is corrupt",
                         path=path, fix="download the file again")
    h = GGUFHeader(path=path, file_size=size, version=version, byte_order="little" if order == "<" else "big",
                   tensor_count=n_tensors, kv_count=n_kv)
    problem = _Problems(h)
    entries: list[tuple[str, tuple[int, ...], int, int]] = []
    try:
        for i in range(n_kv):
            start = p.pos
            key = p.string(f"metadata key {i}")
            vtype = p.u32(f"type of '{key}'")
            if vtype not in _VTYPES:
                raise _Cut(f"metadata '{key}': unknown value type {vtype}")
            value = p.value(vtype, f"metadata '{key}'")
            if key in h.kv:
                # llama.cpp refuses the file; which value a reader keeps is undefined
                problem("duplicate key", None, f"metadata key '{key}' appears twice (records at offsets "
                                               f"{h.kv_spans[key][0]} and {start}); the second is ignored")
                continue
            h.kv[key] = value
            h.kv_types[key] = _VTYPES[vtype][0]
            h.kv_spans[key] = (start, p.pos)
        h.kv_complete = True
        align = h.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        atype = h.kv_types.get("general.alignment", "UINT32")
        if atype != "UINT32":
            # ggml reads the key with gguf_get_val_u32, which asserts the type: llama.cpp aborts on any other
            used = align if isinstance(align, int) and not isinstance(align, bool) else DEFAULT_ALIGNMENT
            h.problems.append(("error", None, f"general.alignment is {atype} {short_value(align)}, but GGUF stores "
                                              f"it as UINT32 (llama.cpp aborts on the file); read as {used} here; "
                                              "fix: rewrite the key as UINT32"))
            align = used
        if align <= 0 or align & (align - 1):
            h.problems.append(("error", None, f"general.alignment {align} is not a power of two; using 32"))
            align = DEFAULT_ALIGNMENT
        h.alignment = align
        for i in range(n_tensors):
            name = p.string(f"name of tensor {i}")
            nd = p.u32(f"n_dims of '{name}'")
            if nd > MAX_DIMS:
                raise _Cut(f"tensor '{name}' claims {nd} dims (max {MAX_DIMS}); the directory is corrupt")
            dims = tuple(p.u64(f"dim {k} of '{name}'") for k in range(nd))
            type_id = p.u32(f"type of '{name}'")
            offset = p.u64(f"offset of '{name}'")
            entries.append((name, dims, type_id, offset))
        h.complete = True
    except _Cut as e:
        h.problems.append(("error", None, f"header: {e}"))
    for what in p.bad_utf8[:MAX_REPORTED]:
        h.problems.append(("error", None, f"{what} is not valid UTF-8 (GGUF strings are UTF-8)"))
    if len(p.bad_utf8) > MAX_REPORTED:
        h.problems.append(("error", None, f"{len(p.bad_utf8) - MAX_REPORTED} more strings are not valid UTF-8"))
    h.header_end = p.pos
    if h.complete:
        h.data_start = -(-p.pos // h.alignment) * h.alignment
    _place_tensors(h, entries, problem)
    problem.close()
    return h


def short_value(v: Any, limit: int = 40) -> str:
    """A metadata value read from the file, shortened for a message (an array summary as its summary)."""
    text = repr(v.to_dict() if isinstance(v, ArraySummary) else v)
    return text if len(text) <= limit else text[:limit] + "..."


class _Problems:
    """Adds a header's problems, MAX_REPORTED of each kind one by one and the rest as a count: a directory of
    a million broken entries (24 bytes each) is one line per kind, not a million (memory and output grow
    with the file otherwise, tens of bytes of header costing kilobytes of report)."""

    def __init__(self, h: GGUFHeader):
        self.h = h
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str, tensor: str | None, msg: str) -> None:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        if n <= MAX_REPORTED:
            self.h.problems.append(("error", tensor, msg))

    def close(self) -> None:
        for kind, n in self.counts.items():
            if n > MAX_REPORTED:
                self.h.problems.append(("error", None, f"... and {n - MAX_REPORTED} more of the same kind "
                                                       f"({kind}; {n} in all)"))


def _place_tensors(h: GGUFHeader, entries: list[tuple[str, tuple[int, ...], int, int]], problem: _Problems
                   ) -> None:
    base = h.data_start
    spans = []
    for name, dims, type_id, offset in entries:
        blk = qtype_block(type_id)
        n = 1
        for d in dims:
            n *= d
        nbytes = None
        if not dims or 0 in dims:
            # no model tensor is a scalar or empty, and both break every consumer that tiles rows into blocks
            what = "0 dimensions" if not dims else f"a zero dimension (ne = {list(dims)})"
            problem("empty tensor", name, f"tensor has {what}; GGUF weights have 1 to {MAX_DIMS} non-zero "
                                          "dimensions")
        elif n > MAX_ELEMENTS:
            problem("element count overflow", name, f"dimensions {list(dims)} hold {n} elements, more than "
                                                    "ggml's int64 element count allows")
        elif blk is None:
            problem("unknown tensor type", name, f"unknown tensor type id {type_id}")
        elif dims[0] % blk[0]:
            problem("row not whole blocks", name, f"row size {dims[0]} is not a multiple of the "
                                                  f"{qtype_name(type_id)} block size ({blk[0]})")
        else:
            nbytes = n // blk[0] * blk[1]
        if offset % h.alignment:
            # llama.cpp refuses such a file, so it is an error, not a curiosity
            problem("misaligned offset", name, f"data offset {offset} is not a multiple of the alignment "
                                               f"{h.alignment}")
        start = (base if base is not None else h.header_end) + offset
        complete = base is not None and nbytes is not None and start + nbytes <= h.file_size
        h.tensors.append(GGUFTensor(name=name, shape=dims, type_id=type_id, offset=offset, start=start,
                                    nbytes=nbytes, file=h.path, complete=complete))
        if nbytes:
            spans.append((start, start + nbytes, name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False):
        if s1 < e0:
            problem("overlapping data", n1, f"data [{s1}, ...) overlaps tensor '{n0}' ending at {e0}")


def split_siblings(path: Path) -> list[Path] | None:
    """All files of the split set `path` belongs to (in order), or None when it is not a split name."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return None
    count = int(m.group("count"))
    if count < 1:
        return None
    return [path.with_name(f"{m.group('stem')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def resolve_gguf(path: str | Path) -> tuple[Path, list[Path]]:
    """(display path, ordered file list) for a .gguf file, a split member, or a directory holding one
    GGUF model. Missing split members stay in the list; `read_gguf` reports them."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise InputError("no .gguf file in directory", path=path)
        groups = {}
        for f in files:
            sib = split_siblings(f)
            key = tuple(sib) if sib else (f,)
            groups[key] = True
        if len(groups) > 1:
            names = ", ".join(sorted({k[0].name for k in groups})[:4])
            raise UsageError(f"directory holds {len(groups)} GGUF models ({names} ...)", path=path,
                             fix="pass one .gguf file (or the first file of a split set)")
        return path, list(next(iter(groups)))
    sib = split_siblings(path)
    if sib and path in sib:
        return path, sib
    return path, [path]


def read_gguf(path: str | Path) -> GGUFSet:
    """Read a GGUF model's headers: one file, or every file of a split set (missing ones listed)."""
    shown, files = resolve_gguf(path)
    headers, missing = [], []
    for f in files:
        if f.is_file():
            headers.append(read_gguf_header(f))
        else:
            missing.append(f)
    if not headers:
        raise InputError("no file of the split set exists", path=shown,
                         fix=f"expected {files[0].name} ... {files[-1].name}")
    return GGUFSet(path=shown, headers=headers, missing=missing, extra=_strays(files))


def _strays(files: list[Path]) -> list[Path]:
    """Files beside a split set named `<its stem>-NNNNN-of-MMMMM.gguf` that are not among `files`."""
    m = SPLIT_RE.match(files[0].name)
    if m is None:
        return []
    stem = m.group("stem")
    try:
        entries = list(files[0].parent.iterdir())
    except OSError:  # the set's own files were read; a directory that cannot be listed hides no more of it
        return []
    want = set(files)
    out = []
    for e in entries:
        n = SPLIT_RE.match(e.name)
        if n is not None and n.group("stem") == stem and e not in want:
            out.append(e)
    return sorted(out)
