"""Writing a .gguf file with the `gguf` package's GGUFWriter, streaming: every tensor's directory entry is
declared first (name, shape, type, bytes), then the data is written one tensor at a time, so peak memory
is one tensor.

Names: llama.cpp looks tensors up by its own names (`blk.0.attn_q.weight`). When the architecture is known
(GGUF `general.architecture`, or config.json `model_type` / `architectures`), Hugging Face names are mapped
with `gguf.get_tensor_name_map(arch, n_blocks)`; names the map does not know are kept as they are.

Metadata: a GGUF source's records are carried by their bytes, in their order (qtool.io.gguf_reader records
where each one lies), never decoded into Python objects: a 2,000,000-entry vocabulary costs a copy, not
2,000,000 objects; a big-endian source's records are re-encoded little-endian. The keys this writer owns
(architecture, file type, quantization version) are written in place of the source's; split keys and the
alignment are not carried. A Hugging Face source contributes `general.name` and the hyperparameters llama.cpp
reads under `<arch>.*` where config.json has them. The file itself is laid out here (header, records, tensor
directory, aligned data) because the gguf package's GGUFWriter takes metadata only as Python values; key
names and types still come from it.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtool.errors import OutputError

MAX_NAME = 63  # GGML_MAX_NAME (64) minus the terminating NUL
_OWNED_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
# model_type values whose llama.cpp architecture has another name
_ARCH_ALIASES = {"mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                 "gpt_neox": "gptneox", "phi3": "phi3", "gpt2": "gpt2", "modernbert": "modern-bert"}


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


class NameMap:
    """HF tensor name -> GGUF tensor name via the gguf package's map (identity without one); the names the
    map lacks, kept as they are, collect in `unmapped`."""

    def __init__(self, tmap=None) -> None:
        self.tmap = tmap
        self.unmapped: list[str] = []

    def __call__(self, name: str) -> str:
        if self.tmap is None:
            return name
        got = self.tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if not got and name not in self.unmapped:
            self.unmapped.append(name)
        return got or name


def name_mapper(arch: str | None, n_blocks: int | None) -> NameMap:
    """The NameMap of `arch` (identity, with nothing unmapped, when the gguf package has no map for it)."""
    import gguf

    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(arch or "")
    return NameMap(None if enum is None else gguf.get_tensor_name_map(enum, n_blocks or 0))


@dataclass(frozen=True)
class CarriedKV:
    """One metadata record of a source GGUF, carried by its bytes: [start, end) in `file` holds the whole
    record (key, value type, value) in the file's byte order."""

    key: str
    file: Path
    start: int
    end: int
    big_endian: bool = False


def carried_kv(header) -> list[CarriedKV]:
    """A GGUF header's metadata records (qtool.io.gguf_reader.GGUFHeader, its kv_spans) in file order, minus the
    split keys (the output is one file) and the alignment (the output uses the default)."""
    big = header.byte_order == "big"
    return [CarriedKV(k, header.path, a, b, big) for k, (a, b) in header.kv_spans.items()
            if not k.startswith("split.") and k != "general.alignment"]


def _owned_kv(arch: str, name: str | None, hparams: list[tuple[str, Any]], file_type: int | None,
              extra: dict | None = None) -> dict:
    """{key: (value type id, value, item type id or None)} of the keys this writer sets, named and typed by the
    gguf package's GGUFWriter methods (a writer without a file only collects them); `extra` records (from
    qtool.io.hf_gguf.hf_metadata) follow the general keys."""
    import gguf

    w = gguf.GGUFWriter(None, arch)
    if name:
        w.add_name(name)
    for method, value in hparams:
        getattr(w, method)(value)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    out = {k: (int(v.type), v.value, None) for k, v in w.kv_data[0].items()}
    for k, rec in (extra or {}).items():
        out.setdefault(k, rec)
    return out


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _gstr(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _encode_kv(key: str, vtype: int, value: Any, item_type: int | None = None) -> bytes:
    """One little-endian metadata record: a scalar, a string, or an array of either (item type as given, else
    the gguf package's choice for the first item: int32, float32, bool or string)."""
    return _gstr(key) + _encode_value(vtype, value, item_type)


def _encode_value(vtype: int, value: Any, item_type: int | None = None) -> bytes:
    if vtype == _STRING:
        return struct.pack("<I", vtype) + _gstr(value)
    if vtype != _ARRAY:
        return struct.pack("<I", vtype) + struct.pack("<" + _SCALAR[vtype], value)
    import gguf

    items = list(value)
    if item_type is None:
        item_type = int(gguf.GGUFValueType.get_type(items[0])) if items else _STRING
    head = struct.pack("<IIQ", _ARRAY, item_type, len(items))
    if item_type == _STRING:
        return head + b"".join(_gstr(x) for x in items)
    if item_type == _ARRAY:
        raise OutputError("nested metadata arrays are not written by qtool")
    import numpy as np

    return head + np.asarray(items, dtype=np.dtype("<" + _SCALAR[item_type])).tobytes()


class _BigToLittle:
    """Re-encodes one big-endian metadata record little-endian: every length, count and number byte-swapped,
    string bytes unchanged. Numeric arrays are swapped as one numpy block."""

    def __init__(self, buf: bytes):
        self.buf, self.pos, self.out = buf, 0, bytearray()

    def _take(self, code: str) -> int:
        v = struct.unpack_from(">" + code, self.buf, self.pos)[0]
        self.pos += struct.calcsize(code)
        self.out += struct.pack("<" + code, v)
        return v

    def _string(self) -> None:
        n = self._take("Q")
        self.out += self.buf[self.pos:self.pos + n]
        self.pos += n

    def _value(self, vtype: int) -> None:
        if vtype == _STRING:
            self._string()
        elif vtype == _ARRAY:
            import numpy as np

            itype = self._take("I")
            count = self._take("Q")
            if itype in _SCALAR:
                dt = np.dtype(">" + _SCALAR[itype])
                block = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.out += block.astype(dt.newbyteorder("<")).tobytes()
                self.pos += count * dt.itemsize
            else:
                for _ in range(count):
                    self._value(itype)
        else:
            self._take(_SCALAR[vtype])

    def record(self) -> bytes:
        self._string()
        self._value(self._take("I"))
        return bytes(self.out)


def _copy_record(out, rec: CarriedKV, chunk: int = 8 << 20) -> None:
    """Write one carried record: its bytes as they are (little-endian source), or re-encoded (big-endian)."""
    with open(rec.file, "rb") as f:
        if rec.big_endian:
            f.seek(rec.start)
            out.write(_BigToLittle(f.read(rec.end - rec.start)).record())
            return
        pos = rec.start
        while pos < rec.end:
            f.seek(pos)
            piece = f.read(min(chunk, rec.end - pos))
            if not piece:
                raise OutputError(f"metadata '{rec.key}' ends before its recorded end (the source changed while "
                                  "being read)", path=rec.file)
            out.write(piece)
            pos += len(piece)


def write_gguf(path: Path, arch: str, tensors: list[GGUFTensorSpec], data: Iterable,
               file_type: int | None = None, kv: list[CarriedKV] | None = None,
               hparams: list[tuple[str, Any]] | None = None, name: str | None = None,
               extra: dict | None = None) -> None:
    """Write `tensors` (specs, in order) whose data arrays `data` yields in the same order; GGUF v3,
    little-endian, default alignment.

    data items: numpy arrays; quantized types as uint8 [O, row_bytes], float types in their dtype (BF16 as
    uint8 bytes). kv: records carried from a source GGUF, copied byte for byte in their order; the keys this
    writer owns (architecture, file type, quantization version; general.name when `name` is given) take the
    place of the source's record where it has one, else come first. hparams: (GGUFWriter method, value).
    extra: {key: (value type id, value, item type id or None)} written with the owned keys (tokenizer,
    architecture flags: qtool.io.hf_gguf.hf_metadata).
    """
    import gguf

    for t in tensors:
        if len(t.name.encode("utf-8")) > MAX_NAME:
            raise OutputError(f"GGUF tensor name '{t.name}' is {len(t.name)} characters; GGUF allows {MAX_NAME}",
                              path=path, fix="the architecture's name map does not cover it; --exclude it")
    owned = _owned_kv(arch, name, hparams or [], file_type, extra)
    records: list = []
    for rec in kv or []:
        if rec.key in owned:
            records.append((rec.key, *owned.pop(rec.key)))
        else:
            records.append(rec)
    records = [(k, *tv) for k, tv in owned.items()] + records
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    try:
        with open(path, "wb", buffering=1 << 20) as out:
            _write_body(out, path, tensors, data, records, align)
    except OSError as e:  # the caller removes the partial file
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise  # atomic_output names the output and the space needed and free
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise OutputError(f"cannot write the GGUF file: {e.strerror or e}{where}", path=path,
                          fix="free space on the destination's file system or choose another -o") from None


def _write_body(out, path: Path, tensors: list[GGUFTensorSpec], data: Iterable, records: list, align: int) -> None:
    import gguf
    import numpy as np

    out.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(records)))
    for rec in records:
        if isinstance(rec, CarriedKV):
            _copy_record(out, rec)
        else:
            out.write(_encode_kv(*rec))
    offset = 0
    for t in tensors:
        qt = gguf.GGMLQuantizationType[t.type_name]
        ne = tuple(reversed(t.shape))
        out.write(_gstr(t.name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                  + struct.pack("<IQ", int(qt), offset))
        offset += -(-t.nbytes // align) * align
    out.write(b"\0" * (-out.tell() % align))
    for t, arr in zip(tensors, data, strict=True):
        a = np.ascontiguousarray(arr)
        if a.nbytes != t.nbytes:
            raise OutputError(f"tensor '{t.name}' has {a.nbytes} bytes, its directory entry says {t.nbytes}",
                              path=path)
        out.write(a.reshape(-1).view(np.uint8).data)
        out.write(b"\0" * (-t.nbytes % align))
