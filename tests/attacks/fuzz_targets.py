"""Fuzz targets shared by tests/attacks/test_fuzz.py (a few hundred cases in CI) and
benchmarks/fuzz_headers.py (10,000 per target): hypothesis strategies for hostile inputs, and one `run_*`
function per parser that feeds it one input.

A `run_*` function returns "accepted", "refused" (a qtool.errors.QtoolError: the contract) or, for the GGUF
reader, which describes damage instead of raising, "reported" (problems listed in the header); it raises
anything else: another exception type escaping the parser is the bug being hunted, and an AssertionError
means the parser accepted an input that breaks an invariant of its own result (offsets outside the file,
overlaps, a complete GGUF directory with the wrong tensor count, ...).

Inputs reach the parsers as files (they read paths), written under a per-process scratch directory.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from qtool.errors import QtoolError
from tests.attacks.generate_corpus import (
    ARRAY,
    STRING,
    gguf_bytes,
    gstr,
    kv_str,
    kv_u32,
    tensor_info,
    u32,
    u64,
)

_SCRATCH: Path | None = None


def scratch() -> Path:
    """A private scratch directory for this process (created once, removed by the caller's cleanup)."""
    global _SCRATCH
    if _SCRATCH is None or not _SCRATCH.is_dir():
        _SCRATCH = Path(tempfile.mkdtemp(prefix="qtool-fuzz-"))
    return _SCRATCH


def cleanup() -> None:
    if _SCRATCH is not None:
        shutil.rmtree(_SCRATCH, ignore_errors=True)


# --- shared value strategies ----------------------------------------------------------------------

# Integers a hostile header would use: small, at type boundaries, and past every boundary.
BOUNDARY_INTS = [0, 1, 2, 3, 7, 8, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**60, 2**63 - 1,
                 2**63, 2**64 - 1, 2**64, 2**100, -1, -(2**63)]
ints = st.one_of(st.integers(0, 64), st.sampled_from(BOUNDARY_INTS), st.integers(-(2**70), 2**70))
json_scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=12))
json_like = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """`data` cut, with bytes overwritten, inserted or deleted at random places."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["cut", "flip", "insert", "delete"]))
        k = draw(st.integers(0, max(len(out), 1) - 1)) if out else 0
        if op == "cut":
            del out[k:]
        elif op == "flip" and out:
            out[k] = draw(st.integers(0, 255))
        elif op == "insert":
            out[k:k] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and out:
            del out[k:k + draw(st.integers(1, 8))]
    return bytes(out)


# --- safetensors header -----------------------------------------------------------------------------

ST_DTYPES = ["F16", "BF16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F4", "F6_E2M3"]
ST_DTYPE_BITS = {"F16": 16, "BF16": 16, "F32": 32, "F64": 64, "I8": 8, "U8": 8, "I16": 16, "I32": 32, "I64": 64,
                 "BOOL": 8, "F8_E4M3": 8, "F4": 4, "F6_E2M3": 6}


@st.composite
def st_entry(draw) -> Any:
    """A tensor entry: mostly well-formed with plausible numbers (so some files are accepted), sometimes
    hostile in one field, sometimes any JSON value."""
    kind = draw(st.sampled_from(["plausible", "plausible", "hostile", "garbage"]))
    if kind == "garbage":
        return draw(json_like)
    dtype = draw(st.sampled_from(ST_DTYPES)) if kind == "plausible" else draw(
        st.one_of(st.sampled_from(ST_DTYPES + ["Q4_K", "f16", "", "F16 "]), json_like))
    shape = draw(st.lists(st.integers(0, 6), max_size=3)) if kind == "plausible" else draw(
        st.one_of(st.lists(ints, max_size=4), json_like))
    begin = draw(st.integers(0, 64)) if kind == "plausible" else draw(st.one_of(ints, json_like))
    entry: dict[str, Any] = {"dtype": dtype, "shape": shape}
    if kind == "plausible" and dtype in ST_DTYPE_BITS and isinstance(shape, list):
        n = 1
        for d in shape:
            n *= d
        nbits = n * ST_DTYPE_BITS[dtype]
        size = nbits // 8 if draw(st.booleans()) else draw(st.integers(0, 80))
        entry["data_offsets"] = [begin, begin + size]
    else:
        entry["data_offsets"] = draw(st.one_of(st.lists(ints, max_size=3), json_like))
    if draw(st.integers(0, 9)) == 0:
        del entry[draw(st.sampled_from(sorted(entry)))]
    return entry


@st.composite
def safetensors_files(draw) -> bytes:
    kind = draw(st.sampled_from(["structured", "structured", "structured", "bytes", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    header: dict[str, Any] = draw(st.dictionaries(st.one_of(st.sampled_from(["w", "b", "model.x.weight"]),
                                                            st.text(max_size=10)), st_entry(), max_size=4))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(st.dictionaries(st.text(max_size=6), st.text(max_size=6),
                                                                max_size=3), json_like))
    raw = json.dumps(header).encode()
    ends = [e["data_offsets"][1] for e in header.values() if isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and isinstance(e["data_offsets"][1], int) and 0 <= e["data_offsets"][1] <= 4096]
    data_len = max(ends, default=0) if draw(st.booleans()) else draw(st.integers(0, 200))
    n = len(raw) if draw(st.integers(0, 3)) else draw(st.one_of(ints.filter(lambda v: 0 <= v < 2**64),
                                                                st.integers(0, len(raw) + 16)))
    blob = struct.pack("<Q", n) + raw + bytes(data_len)
    return draw(mutated(blob)) if kind == "mutated" else blob


def run_safetensors_header(blob: bytes) -> str:
    from qtool.io.safetensors_header import DTYPE_BITS, read_header

    path = scratch() / "fuzz.safetensors"
    path.write_bytes(blob)
    try:
        infos, meta = read_header(path)
    except QtoolError:
        return "refused"
    size = len(blob)
    assert isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    spans = []
    for name, t in infos.items():
        assert t.name == name and t.file == path
        assert 8 <= t.start <= t.end <= size, (name, t.start, t.end, size)
        assert t.numel * DTYPE_BITS[t.dtype] == 8 * (t.end - t.start), (name, t.dtype, t.shape)
        spans.append((t.start, t.end))
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), "overlapping tensors accepted"
    return "accepted"


# --- checkpoints (directory, file or index) ----------------------------------------------------------

def _small_safetensors(names: list[str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for k, name in enumerate(names):
        header[name] = {"dtype": "F16", "shape": [2], "data_offsets": [4 * k, 4 * k + 4]}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(4 * len(names))


CK_FILES = ["model.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json", "config.json", "quantize_config.json", "pytorch_model.bin", "x.gguf",
            "other.safetensors"]
TENSOR_NAMES = ["a.weight", "a.qweight", "a.scales", "b.weight", ""]


@st.composite
def checkpoint_dirs(draw) -> tuple[dict[str, bytes], str]:
    """({file name: content}, what to open: "." for the directory or one of the names)."""
    files: dict[str, bytes] = {}
    for name in draw(st.lists(st.sampled_from(CK_FILES), unique=True, max_size=5)):
        if name.endswith(".safetensors"):
            content = draw(st.one_of(
                st.lists(st.sampled_from(TENSOR_NAMES), unique=True, max_size=3).map(_small_safetensors),
                safetensors_files()))
        elif name.endswith(".index.json"):
            wm = draw(st.one_of(
                st.dictionaries(st.sampled_from(TENSOR_NAMES), st.one_of(st.sampled_from(CK_FILES),
                                st.sampled_from(["../x.safetensors", "/etc/passwd", "", ".", "a\x00b"])),
                                max_size=4), json_like))
            content = json.dumps({"metadata": {}, "weight_map": wm} if draw(st.booleans()) else draw(json_like)
                                 ).encode()
            if draw(st.integers(0, 5)) == 0:
                content = draw(mutated(content))
        elif name.endswith(".json"):
            quant = draw(st.one_of(st.none(), quant_configs(), json_like))
            content = json.dumps({"model_type": "llama", "quantization_config": quant} if name == "config.json"
                                 else quant).encode()
            if draw(st.integers(0, 5)) == 0:
                content = draw(mutated(content))
        else:
            content = draw(st.binary(max_size=64))
        files[name] = content
    target = draw(st.sampled_from(["."] + sorted(files)))
    return files, target


def run_checkpoint(spec: tuple[dict[str, bytes], str]) -> str:
    from qtool.io.checkpoint import open_checkpoint
    from qtool.io.qconfig import parse_quant_config

    files, target = spec
    root = Path(tempfile.mkdtemp(dir=scratch()))
    try:
        for name, content in files.items():
            (root / name).write_bytes(content)
        try:
            ck = open_checkpoint(root / target if target != "." else root)
            modules = ck.modules()
            parse_quant_config(ck.quant_config, source=ck.root)
        except QtoolError:
            return "refused"
        assert ck.files and all(f.is_file() and f.parent == root for f in ck.files)
        assert all(t.file in ck.files for t in ck.tensors.values())
        assert sum(len(m) for m in modules.values()) == len(ck.tensors)
        if ck.index is not None:
            for name, shard in ck.index["weight_map"].items():
                assert ck.tensors[name].file.name == shard
        return "accepted"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- quantization configs ------------------------------------------------------------------------------

QC_KEYS = ["quant_method", "method", "bits", "w_bit", "wbits", "group_size", "q_group_size", "desc_act", "sym",
           "zero_point", "checkpoint_format", "format", "version", "load_in_4bit", "load_in_8bit",
           "config_groups", "weights", "num_bits", "strategy", "symmetric", "actorder"]
QC_VALUES = ["gptq", "awq", "compressed-tensors", "fp8", "bitsandbytes", "marlin", "gemm", "gemv", "gemv_fast",
             "gptq_v2", "pack-quantized", "float-quantized", "channel", "group", "static"]


@st.composite
def quant_configs(draw) -> Any:
    value = st.one_of(json_like, st.sampled_from(QC_VALUES), ints, st.booleans())
    raw = draw(st.dictionaries(st.one_of(st.sampled_from(QC_KEYS), st.text(max_size=6)), value, max_size=8))
    if draw(st.booleans()):
        weights = draw(st.dictionaries(st.sampled_from(QC_KEYS), value, max_size=6))
        raw["quant_method"] = "compressed-tensors"
        raw["config_groups"] = draw(st.one_of(st.just({"group_0": {"weights": weights}}), json_like))
    return raw if draw(st.integers(0, 9)) else draw(json_like)


def run_quant_config(raw: Any) -> str:
    from qtool.io.qconfig import QuantConfig, parse_quant_config

    try:
        qc = parse_quant_config(raw, source="fuzz/config.json")
    except QtoolError:
        return "refused"
    assert qc is None or isinstance(qc, QuantConfig)
    if qc is not None:
        for v in (qc.bits, qc.group_size):
            assert v is None or (isinstance(v, int) and not isinstance(v, bool)), qc
        for v in (qc.sym, qc.desc_act):
            assert v is None or isinstance(v, bool), qc
    return "accepted"


# --- YAML job specs -----------------------------------------------------------------------------------

YAML_TOKENS = ["bits", "group_size", "group-size", "to", "quiet", "json", "include", "force", "out", ":", ": ",
               "\n", "\n  ", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "!!int ", "!!str ", "!!float ", "!!binary ",
               "!!python/object/apply:os.system ", "!!timestamp ", "2001-13-45", "4", "-1", "1e400", "true", "yes",
               "null", "~", "'", '"', "#", "? ", "%YAML 1.1\n", "---\n", "...\n", "|\n", ">\n", "\t", "\x00",
               "9" * 20, "0x1f", "0o17", ".inf", ".nan"]


@st.composite
def yaml_specs(draw) -> bytes:
    kind = draw(st.sampled_from(["tokens", "tokens", "tokens", "text", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    return "".join(draw(st.lists(st.one_of(st.sampled_from(YAML_TOKENS), st.text(max_size=4)), max_size=30))
                   ).encode("utf-8", "surrogatepass")


class _NoCommandLine:
    """Stands in for typer.Context: apply_config only asks where each parameter came from."""

    def get_parameter_source(self, name: str) -> None:
        return None


def run_yaml_spec(text: bytes) -> str:
    """load_yaml_mapping, then the --config merge against `qtool pack`'s options (types and unknown keys)."""
    from qtool.cli.common import apply_config
    from qtool.cli.pack import pack_cmd

    path = scratch() / "fuzz.yaml"
    path.write_bytes(text)
    try:
        out = apply_config(_NoCommandLine(), path, {}, pack_cmd)
    except QtoolError:
        return "refused"
    assert isinstance(out, dict)
    return "accepted"


# --- GGUF header ----------------------------------------------------------------------------------------

GGML_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 30]  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q4_K Q6_K BF16


@st.composite
def gguf_value(draw, depth: int = 0) -> bytes:
    vtype = draw(st.one_of(st.integers(0, 12), st.sampled_from([13, 255, 2**32 - 1])))
    body = b""
    if vtype == STRING:
        s = draw(st.binary(max_size=12))
        n = len(s) if draw(st.integers(0, 4)) else draw(ints.filter(lambda v: 0 <= v < 2**64))
        body = u64(n) + s
    elif vtype == ARRAY:
        itype = draw(st.integers(0, 13))
        count = draw(st.integers(0, 4)) if draw(st.integers(0, 3)) else draw(ints.filter(lambda v: 0 <= v < 2**64))
        items = b""
        for _ in range(min(count, 4)):
            items += draw(gguf_value(depth + 1))[4:] if itype in (STRING, ARRAY) and depth < 3 else \
                draw(st.binary(min_size=8, max_size=8))
        body = u32(itype) + u64(count) + items
    elif vtype <= 12:
        size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}[vtype]
        body = draw(st.binary(min_size=size, max_size=size))
    return u32(vtype) + body


@st.composite
def gguf_files(draw) -> bytes:
    kind = draw(st.sampled_from(["structured", "structured", "structured", "bytes", "plausible"]))
    version = draw(st.sampled_from([3, 3, 3, 2, 1, 4, 2**32 - 1]))
    if kind == "bytes":
        return b"GGUF" + u32(version) + draw(st.binary(max_size=300))
    alignment = draw(st.sampled_from([32, 32, 16, 64, 0, 24, 1, 2**31]))
    kvs = [kv_str("general.architecture", "llama")]
    if alignment != 32 or draw(st.booleans()):
        kvs.append(kv_u32("general.alignment", alignment))
    infos, data, offset = [], b"", 0
    for k in range(draw(st.integers(0, 3))):
        ttype = draw(st.one_of(st.sampled_from(GGML_TYPES), st.integers(0, 2**32 - 1)))
        ne0 = draw(st.sampled_from([32, 64, 256]))
        dims = (ne0, draw(st.integers(1, 4)))
        infos.append(tensor_info(f"blk.{k}.attn_q.weight", dims, ttype, offset))
        nbytes = draw(st.integers(0, 600))
        data += bytes(nbytes) + bytes(-nbytes % 32)
        offset = len(data)
    if kind == "plausible":
        return gguf_bytes(kvs, infos, data, version=version if version in (2, 3) else 3)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.one_of(st.text(max_size=10), st.sampled_from(["general.alignment", "split.count"])))
        kvs.append(gstr(key) + draw(gguf_value()))
    for _ in range(draw(st.integers(0, 2))):
        nd = draw(st.one_of(st.integers(0, 5), st.sampled_from([2**32 - 1, 2**31])))
        dims = tuple(draw(ints.filter(lambda v: 0 <= v < 2**64)) for _ in range(min(nd, 5)))
        infos.append(gstr(draw(st.text(max_size=8))) + u32(nd) + b"".join(u64(d) for d in dims)
                     + u32(draw(st.integers(0, 2**32 - 1))) + u64(draw(ints.filter(lambda v: 0 <= v < 2**64))))
    n_tensors = None if draw(st.integers(0, 3)) else draw(ints.filter(lambda v: 0 <= v < 2**64))
    n_kv = None if draw(st.integers(0, 3)) else draw(ints.filter(lambda v: 0 <= v < 2**64))
    order = draw(st.permutations(list(range(len(kvs)))))
    blob = gguf_bytes([kvs[i] for i in order], infos, data, version=version, n_tensors=n_tensors, n_kv=n_kv,
                      pad=draw(st.booleans()))
    return draw(mutated(blob)) if draw(st.booleans()) else blob


def run_gguf_header(blob: bytes) -> str:
    from qtool.io.gguf_reader import MAX_DIMS, read_gguf_header

    path = scratch() / "fuzz.gguf"
    path.write_bytes(blob)
    try:
        h = read_gguf_header(path)
    except QtoolError:
        return "refused"
    # Everything a report derives from the header must work on whatever the header says.
    h.truncation_message()
    _ = h.expected_size, h.truncated, h.tensors_complete
    for t in h.tensors:
        _ = t.type_name, t.n_elements, t.end, t.bpw, t.block
        assert len(t.shape) <= MAX_DIMS
        assert not t.complete or (t.end is not None and t.end <= len(blob))
    if h.complete:
        assert len(h.tensors) == h.tensor_count and len(h.kv) <= h.kv_count
        assert h.data_start is not None and h.data_start % h.alignment == 0
    return "accepted" if h.complete and not any(sev == "error" for sev, _, _ in h.problems) else "reported"


TARGETS = {
    "safetensors_header": (safetensors_files, run_safetensors_header,
                           "qtool.io.safetensors_header.read_header"),
    "checkpoint": (checkpoint_dirs, run_checkpoint, "qtool.io.checkpoint.open_checkpoint (+ modules, "
                                                    "parse_quant_config of what it found)"),
    "quant_config": (quant_configs, run_quant_config, "qtool.io.qconfig.parse_quant_config"),
    "yaml_spec": (yaml_specs, run_yaml_spec, "qtool.spec.job.load_yaml_mapping + qtool.cli.common.apply_config "
                                             "(pack's options)"),
    "gguf_header": (gguf_files, run_gguf_header, "qtool.io.gguf_reader.read_gguf_header"),
}
