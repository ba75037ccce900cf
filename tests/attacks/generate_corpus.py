"""Write a corpus of hostile and broken inputs for every command that reads a file.

    python tests/attacks/generate_corpus.py OUTDIR        # writes OUTDIR/<case>/..., prints one line per case

or, from tests: `build_corpus(outdir) -> list[Case]`.

Every case lives in its own directory, so a single-file case has no config.json beside it unless the case
puts one there, and every error message can be matched against a path that only that case has. Three
control cases (`ok_dense`, `ok_gptq`, `ok_gguf`) are valid inputs: the tests run them too, so a harness
that rejected everything would fail.

Files are built byte by byte (struct, json) rather than through the safetensors or gguf writers, because
the point is to produce what those writers never would. The layouts:

- safetensors: u64 LE header length N | N bytes of JSON {name: {dtype, shape, data_offsets}, "__metadata__"}
  | data; offsets are relative to byte 8 + N.
- GGUF: magic b"GGUF" | version u32 | n_tensors u64 | n_kv u64 | n_kv x (key string, value type u32, value)
  | n_tensors x (name string, n_dims u32, dims u64 x n_dims, type u32, offset u64) | padding to
  general.alignment (default 32) | data. A string is u64 length + bytes; an array is item type u32 + count
  u64 + items.

`MARKER` is the file a malicious pickle in the corpus would create if anything ever unpickled it; the
tests assert it never exists.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "PWNED-by-pickle"

# GGUF value type ids and GGML tensor type ids used below (gguf.constants.GGUFValueType / GGMLQuantizationType).
UINT32, INT32, FLOAT32, STRING, ARRAY, UINT64 = 4, 5, 6, 8, 9, 10
T_F32, T_Q4_0 = 0, 2
Q4_0_BLOCK, Q4_0_BYTES = 32, 18


@dataclass(frozen=True)
class Case:
    """One corpus entry.

    name:   directory under the corpus root; also the test id
    layer:  what is broken: "control" (nothing: a valid input), "safetensors" (one file's bytes), "gguf",
            "checkpoint" (how files fit together: index, shards, config.json), "layout" (quantized tensors
            or quantization config that disagree), "data" (tensor values only: seen by commands that read
            data), "yaml" (a --config job spec), "pickle"
    src:    input path relative to the corpus root (None for YAML cases: they use a command's control input)
    about:  what is wrong, for humans
    where:  the offending file, relative to the corpus root; an error must name it (or `src`)
    names:  what else an error must name: the tensor, key or shard at fault
    config: job spec relative to the corpus root, passed as --config (YAML cases only)
    """

    name: str
    layer: str
    src: str | None
    about: str
    where: str = ""
    names: tuple[str, ...] = ()
    config: str | None = None

    @property
    def valid(self) -> bool:
        return self.layer == "control"


# --- byte builders -----------------------------------------------------------------------------------

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def st_bytes(header: dict | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    """A safetensors file; `n` overrides the header length field."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return u64(len(raw) if n is None else n) + raw + data


def kv_u32(key: str, v: int) -> bytes:
    return gstr(key) + u32(UINT32) + u32(v)


def kv_str(key: str, v: str) -> bytes:
    return gstr(key) + u32(STRING) + gstr(v)


def tensor_info(name: str, dims: tuple[int, ...], ttype: int, offset: int) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ttype) + u64(offset)


def gguf_bytes(kvs: list[bytes], infos: list[bytes], data: bytes, *, magic: bytes = b"GGUF", version: int = 3,
               n_tensors: int | None = None, n_kv: int | None = None, alignment: int = 32,
               pad: bool = True) -> bytes:
    """A GGUF file from pre-encoded KV pairs and tensor infos; counts default to the list lengths."""
    head = magic + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    if pad:
        head += b"\0" * (-len(head) % alignment)
    return head + data


def q4_0_rows(rows: int, ne0: int, seed: int) -> bytes:
    """`rows` rows of Q4_0 blocks with a finite fp16 scale (0.01) and pseudo-random nibbles."""
    import random

    r = random.Random(seed)
    d = struct.pack("<e", 0.01)
    return b"".join(d + bytes(r.randrange(256) for _ in range(16)) for _ in range(rows * ne0 // Q4_0_BLOCK))


# --- valid building blocks ---------------------------------------------------------------------------

O, I, G = 64, 128, 32  # out_features, in_features, group size of the tiny quantized modules


def _dense_tensors(seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(O, I, generator=g).half(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(I, O, generator=g).half(),
        "model.norm.weight": torch.ones(I, dtype=torch.float16),
    }


def _gptq_tensors(seed: int = 0) -> dict:
    """Two GPTQ v1 4-bit g32 modules packed by qtool's own gptq format (qweight int32 [I/8, O], qzeros int32
    [I/G, O/8], scales fp16 [I/G, O], g_idx int32 [I]) and a dense norm."""
    import torch

    from qtool.formats import get_format
    from qtool.formats.plain import Plain

    g = torch.Generator().manual_seed(seed)
    fmt = get_format("gptq")
    out = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        codes = torch.randint(0, 16, (O, I), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = (torch.rand(O, I // G, generator=g) * 0.01 + 0.001).half()
        p = Plain(codes, scales, None, None, 4, G)
        for short, t in fmt.pack(p).items():
            out[f"{name}.{short}"] = t
    out["model.norm.weight"] = torch.ones(I, dtype=torch.float16)
    return out


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq"}


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _config(root: Path, quant: dict | None = None, **extra) -> None:
    cfg = {"model_type": "llama", "torch_dtype": "float16", **extra}
    if quant is not None:
        cfg["quantization_config"] = quant
    (root / "config.json").write_text(json.dumps(cfg))


def _valid_gguf() -> bytes:
    kvs = [kv_str("general.architecture", "llama"), kv_u32("general.alignment", 32), kv_u32("general.file_type", 2),
           kv_u32("general.quantization_version", 2), kv_u32("llama.block_count", 1)]
    a = q4_0_rows(32, 64, 1)
    b = q4_0_rows(32, 64, 2)
    b_off = len(a) + (-len(a) % 32)
    norm_off = b_off + len(b) + (-(b_off + len(b)) % 32)
    infos = [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0),
             tensor_info("blk.0.ffn_up.weight", (64, 32), T_Q4_0, b_off),
             tensor_info("output_norm.weight", (64,), T_F32, norm_off)]
    data = a + b"\0" * (b_off - len(a)) + b + b"\0" * (norm_off - b_off - len(b)) + struct.pack("<64f", *([1.0] * 64))
    return gguf_bytes(kvs, infos, data)


class _Boom:
    """Unpickling this creates the marker file (os.mkdir runs at load time). Nothing in qtool may do it."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


# --- the corpus ---------------------------------------------------------------------------------------

def build_corpus(out: str | Path) -> list[Case]:
    """Write every case under `out` (created; existing case directories are overwritten) and return them."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cases: list[Case] = []

    def case_dir(name: str) -> Path:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            if f.is_file() or f.is_symlink():
                f.unlink()
        return d

    def add(name: str, layer: str, src: str | None, about: str, where: str = "", names: tuple[str, ...] = (),
            config: str | None = None) -> None:
        cases.append(Case(name, layer, src, about, where or (src or ""), names, config))

    def file_case(name: str, layer: str, suffix: str, content: bytes, about: str, tensor: str | None = None):
        d = case_dir(name)
        (d / f"{name}{suffix}").write_bytes(content)
        rel = f"{name}/{name}{suffix}"
        add(name, layer, rel, about, rel, (tensor,) if tensor else ())

    # controls -------------------------------------------------------------------------------------
    d = case_dir("ok_dense")
    _save(_dense_tensors(), d / "model.safetensors")
    _config(d)
    add("ok_dense", "control", "ok_dense", "a valid dense model (pack reads it)")
    d = case_dir("ok_gptq")
    _save(_gptq_tensors(), d / "model.safetensors")
    _config(d, GPTQ_CONFIG)
    add("ok_gptq", "control", "ok_gptq", "a valid GPTQ 4-bit g32 checkpoint")
    d = case_dir("ok_gguf")
    (d / "ok_gguf.gguf").write_bytes(_valid_gguf())
    add("ok_gguf", "control", "ok_gguf/ok_gguf.gguf", "a valid Q4_0 GGUF file")

    # safetensors, single files -----------------------------------------------------------------------
    from safetensors.torch import save as st_save

    good = st_save(_dense_tensors(), metadata={"format": "pt"})
    n_good = struct.unpack("<Q", good[:8])[0]
    f16 = lambda shape, a, b: {"dtype": "F16", "shape": shape, "data_offsets": [a, b]}  # noqa: E731
    st = "safetensors"
    file_case("st_empty", st, ".safetensors", b"", "zero bytes")
    file_case("st_short", st, ".safetensors", b"\x10\0\0", "3 bytes: shorter than the length field")
    # Cut data: the file is what is broken, so only the file must be named (which tensors are whole varies).
    file_case("st_truncated_data", st, ".safetensors", good[:8 + n_good + 1000], "cut inside the tensor data")
    file_case("st_truncated_header", st, ".safetensors", good[:8 + n_good // 2], "cut inside the JSON header")
    file_case("st_header_len_beyond_file", st, ".safetensors", st_bytes({}, n=4096), "header length 4096, file 16 bytes")
    file_case("st_header_over_100mb", st, ".safetensors", st_bytes({}, n=100_000_001), "header claims 100 MB + 1")
    file_case("st_header_len_u64_max", st, ".safetensors", st_bytes({}, n=2**64 - 1), "header length 2^64 - 1")
    file_case("st_invalid_json", st, ".safetensors", st_bytes(b'{"a": {"dtype": "F16",, }'), "not JSON")
    file_case("st_invalid_utf8", st, ".safetensors", st_bytes(b'{"\xff\xfe": 1}'), "header is not UTF-8")
    file_case("st_json_not_object", st, ".safetensors", st_bytes(b"[1, 2, 3]"), "header is a JSON list")
    file_case("st_json_deep_nesting", st, ".safetensors", st_bytes(b"[" * 200_000 + b"]" * 200_000),
              "200,000 nested lists (recursion bomb)")
    file_case("st_json_huge_int", st, ".safetensors",
              st_bytes(b'{"t": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', b"\0"),
              "a 5000-digit integer (Python refuses to convert it)", tensor=None)
    file_case("st_entry_not_object", st, ".safetensors", st_bytes({"t": [1, 2]}), "tensor entry is a list",
              tensor="t")
    file_case("st_overlapping_offsets", st, ".safetensors",
              st_bytes({"a": f16([8], 0, 16), "b": f16([8], 8, 24)}, b"\0" * 24), "b's bytes overlap a's",
              tensor="b")
    file_case("st_offsets_out_of_range", st, ".safetensors",
              st_bytes({"a": f16([8], 0, 16), "b": f16([1 << 20], 16, 16 + (2 << 20))}, b"\0" * 16),
              "b ends 2 MiB past the end of the file", tensor="b")
    file_case("st_offsets_reversed", st, ".safetensors", st_bytes({"a": f16([4], 8, 0)}, b"\0" * 8),
              "data_offsets [8, 0]", tensor="a")
    file_case("st_offsets_negative", st, ".safetensors", st_bytes({"a": f16([4], -8, 0)}, b"\0" * 8),
              "data_offsets [-8, 0]", tensor="a")
    file_case("st_offsets_not_ints", st, ".safetensors",
              st_bytes({"a": {"dtype": "F16", "shape": [4], "data_offsets": ["0", 8.0]}}, b"\0" * 8),
              "data_offsets are a string and a float", tensor="a")
    file_case("st_dtype_shape_vs_bytes", st, ".safetensors", st_bytes({"a": f16([4, 4], 0, 16)}, b"\0" * 16),
              "F16 [4, 4] needs 32 bytes, offsets give 16", tensor="a")
    file_case("st_unknown_dtype", st, ".safetensors",
              st_bytes({"a": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2),
              "dtype Q4_K is not a safetensors dtype", tensor="a")
    file_case("st_shape_2e60", st, ".safetensors",
              st_bytes({"a": {"dtype": "U8", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 1 << 60]}}, b"\0" * 8),
              "shape [2^30, 2^30] = 2^60 elements, offsets to match", tensor="a")
    file_case("st_shape_product_wraps_u64", st, ".safetensors",
              st_bytes({"a": {"dtype": "F32", "shape": [1 << 32, 1 << 32, 1 << 32], "data_offsets": [0, 0]}}),
              "2^96 elements: wraps to 0 in 64-bit arithmetic", tensor="a")
    file_case("st_shape_negative", st, ".safetensors",
              st_bytes({"a": {"dtype": "F16", "shape": [-1, 4], "data_offsets": [0, 8]}}, b"\0" * 8),
              "shape [-1, 4]", tensor="a")
    file_case("st_shape_float", st, ".safetensors",
              st_bytes({"a": {"dtype": "F16", "shape": [1e400], "data_offsets": [0, 8]}}, b"\0" * 8),
              "shape [1e400] (parses as infinity)", tensor="a")
    file_case("st_shape_too_many_dims", st, ".safetensors",
              st_bytes({"a": {"dtype": "U8", "shape": [1] * 100_000, "data_offsets": [0, 1]}}, b"\0" * 8),
              "100,000 dimensions", tensor="a")
    file_case("st_metadata_not_strings", st, ".safetensors",
              st_bytes({"__metadata__": {"format": ["pt"]}, "a": f16([4], 0, 8)}, b"\0" * 8),
              "__metadata__ value is a list")
    evil = "evil\r\x1b[2J\x1b[31mname\u2028\u0085x"
    file_case("st_control_chars_in_name", st, ".safetensors",
              st_bytes({evil: {"dtype": "BAD", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8),
              "tensor name with CR, ANSI escapes and Unicode line separators", tensor="evil")
    # A directory whose only .safetensors entry is a FIFO: opening it for reading would block forever.
    d = case_dir("st_fifo")
    fifo = d / "model.safetensors"
    if fifo.exists() or fifo.is_symlink():
        fifo.unlink()
    os.mkfifo(fifo)
    add("st_fifo", st, "st_fifo", "a named pipe where model.safetensors should be (a read would hang)",
        where="st_fifo/model.safetensors")

    # GGUF ---------------------------------------------------------------------------------------------
    gg = "gguf"
    valid = _valid_gguf()
    kvs = [kv_str("general.architecture", "llama")]
    one = [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0)]
    one_data = q4_0_rows(32, 64, 3)
    file_case("gg_bad_magic", gg, ".gguf", b"GGML" + valid[4:], "magic b'GGML'")
    file_case("gg_short", gg, ".gguf", b"GGUF\x03\0", "6 bytes")
    file_case("gg_version_1", gg, ".gguf", gguf_bytes(kvs, one, one_data, version=1), "GGUF v1 (unsupported)")
    file_case("gg_version_huge", gg, ".gguf", gguf_bytes(kvs, one, one_data, version=0xDEADBEEF), "version 0xDEADBEEF")
    file_case("gg_tensor_count_u64_max", gg, ".gguf", gguf_bytes(kvs, one, one_data, n_tensors=2**64 - 1),
              "n_tensors = 2^64 - 1")
    file_case("gg_kv_count_2e62", gg, ".gguf", gguf_bytes(kvs, one, one_data, n_kv=1 << 62), "n_kv = 2^62")
    file_case("gg_tensor_count_beyond_file", gg, ".gguf", gguf_bytes(kvs, one, one_data, n_tensors=5_000_000),
              "5,000,000 tensors announced, one present")
    file_case("gg_huge_n_dims", gg, ".gguf",
              gguf_bytes(kvs, [gstr("blk.0.attn_q.weight") + u32(0xFFFFFFFF) + u64(64) + u64(32)], one_data),
              "n_dims = 2^32 - 1", tensor="blk.0.attn_q.weight")
    file_case("gg_dims_product_overflow", gg, ".gguf",
              gguf_bytes(kvs, [tensor_info("blk.0.attn_q.weight", (1 << 62, 1 << 62), T_Q4_0, 0)], one_data),
              "dims [2^62, 2^62]: 2^124 elements", tensor="blk.0.attn_q.weight")
    file_case("gg_key_len_beyond_file", gg, ".gguf", gguf_bytes([u64(1 << 62) + b"general"], one, one_data),
              "metadata key length 2^62")
    file_case("gg_string_len_beyond_file", gg, ".gguf",
              gguf_bytes([gstr("general.name") + u32(STRING) + u64(10**15) + b"x"], one, one_data),
              "string value length 10^15")
    file_case("gg_array_len_beyond_file", gg, ".gguf",
              gguf_bytes([gstr("tokenizer.ggml.scores") + u32(ARRAY) + u32(FLOAT32) + u64(1 << 60)], one, one_data),
              "float array of 2^60 items")
    file_case("gg_string_array_len_beyond_file", gg, ".gguf",
              gguf_bytes([gstr("tokenizer.ggml.tokens") + u32(ARRAY) + u32(STRING) + u64(1 << 40) + gstr("a")],
                         one, one_data),
              "string array of 2^40 items")
    nested = gstr("x") + u32(ARRAY) + (u32(ARRAY) + u64(1)) * 1000 + u32(UINT32) + u64(0)
    file_case("gg_nested_arrays", gg, ".gguf", gguf_bytes([nested], one, one_data), "arrays nested 1000 deep")
    file_case("gg_unknown_value_type", gg, ".gguf", gguf_bytes([gstr("x") + u32(77) + u32(0)], one, one_data),
              "metadata value type 77")
    file_case("gg_truncated_data", gg, ".gguf", valid[:len(valid) - 500], "last 500 bytes of tensor data cut")
    file_case("gg_truncated_header", gg, ".gguf", valid[:60], "cut inside the metadata")
    file_case("gg_misaligned_offset", gg, ".gguf",
              gguf_bytes(kvs, [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 7)], b"\0" * 7 + one_data),
              "tensor offset 7 with alignment 32", tensor="blk.0.attn_q.weight")
    file_case("gg_alignment_not_pow2", gg, ".gguf",
              gguf_bytes(kvs + [kv_u32("general.alignment", 24)], one, one_data), "general.alignment = 24")
    file_case("gg_alignment_zero", gg, ".gguf", gguf_bytes(kvs + [kv_u32("general.alignment", 0)], one, one_data),
              "general.alignment = 0")
    file_case("gg_overlapping_tensors", gg, ".gguf",
              gguf_bytes(kvs, one + [tensor_info("blk.0.ffn_up.weight", (64, 32), T_Q4_0, 32)], one_data + b"\0" * 64),
              "second tensor starts inside the first", tensor="blk.0.ffn_up.weight")
    file_case("gg_offset_beyond_file", gg, ".gguf",
              gguf_bytes(kvs, [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 1 << 62)], one_data),
              "tensor offset 2^62", tensor="blk.0.attn_q.weight")
    file_case("gg_unknown_tensor_type", gg, ".gguf",
              gguf_bytes(kvs, [tensor_info("blk.0.attn_q.weight", (64, 32), 9999, 0)], one_data),
              "tensor type id 9999", tensor="blk.0.attn_q.weight")
    file_case("gg_row_not_block_multiple", gg, ".gguf",
              gguf_bytes(kvs, [tensor_info("blk.0.attn_q.weight", (33, 32), T_Q4_0, 0)], one_data),
              "Q4_0 row of 33 elements (block 32)", tensor="blk.0.attn_q.weight")
    d = case_dir("gg_split_missing")
    (d / "split-00001-of-00002.gguf").write_bytes(
        gguf_bytes(kvs + [gstr("split.count") + u32(UINT32) + u32(2)], one, one_data))
    add("gg_split_missing", gg, "gg_split_missing/split-00001-of-00002.gguf", "second file of a split set absent",
        names=("split-00002-of-00002.gguf",))

    # checkpoints --------------------------------------------------------------------------------------
    ck = "checkpoint"
    gq = _gptq_tensors()
    q = "model.layers.0.self_attn.q_proj"

    def sharded(name: str, shards: dict[str, dict], weight_map: dict[str, str], quant: dict | None = GPTQ_CONFIG,
                write: tuple[str, ...] | None = None) -> Path:
        d = case_dir(name)
        for shard, tensors in shards.items():
            if write is None or shard in write:
                _save(tensors, d / shard)
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        _config(d, quant)
        return d

    s1 = {k: v for k, v in gq.items() if k.startswith(q)}
    s2 = {k: v for k, v in gq.items() if not k.startswith(q)}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    wm = {k: names[0] for k in s1} | {k: names[1] for k in s2}
    sharded("ck_missing_shard", dict(zip(names, (s1, s2), strict=True)), wm, write=(names[0],))
    add("ck_missing_shard", ck, "ck_missing_shard", "index names two shards; the second is absent",
        "ck_missing_shard/model.safetensors.index.json", (names[1],))
    sharded("ck_index_names_absent_tensor", dict(zip(names, (s1, s2), strict=True)),
            wm | {f"{q}.bias": names[0]})
    add("ck_index_names_absent_tensor", ck, "ck_index_names_absent_tensor",
        "index maps q_proj.bias to shard 1, which does not hold it",
        "ck_index_names_absent_tensor/model.safetensors.index.json", (f"{q}.bias",))
    sharded("ck_index_shard_outside", {names[0]: s1}, {k: "../ok_gptq/model.safetensors" for k in s1})
    add("ck_index_shard_outside", ck, "ck_index_shard_outside", "index names '../ok_gptq/model.safetensors'",
        "ck_index_shard_outside/model.safetensors.index.json", ("../ok_gptq/model.safetensors",))
    d = case_dir("ck_index_invalid_json")
    _save(gq, d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    _config(d, GPTQ_CONFIG)
    add("ck_index_invalid_json", ck, "ck_index_invalid_json", "index is not JSON",
        "ck_index_invalid_json/model.safetensors.index.json")
    d = case_dir("ck_index_no_weight_map")
    _save(gq, d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    _config(d, GPTQ_CONFIG)
    add("ck_index_no_weight_map", ck, "ck_index_no_weight_map", "weight_map is a list",
        "ck_index_no_weight_map/model.safetensors.index.json", ("weight_map",))
    sharded("ck_tensor_in_two_shards", {names[0]: s1, names[1]: s2 | {f"{q}.scales": s1[f"{q}.scales"]}},
            wm)
    add("ck_tensor_in_two_shards", ck, "ck_tensor_in_two_shards", "q_proj.scales is stored in both shards",
        names=(f"{q}.scales",))

    def quant_dir(name: str, tensors: dict, quant: dict | None = GPTQ_CONFIG, about: str = "",
                  names: tuple[str, ...] = (), raw_config: str | None = None, layer: str = "layout") -> None:
        d = case_dir(name)
        _save(tensors, d / "model.safetensors")
        if raw_config is not None:
            (d / "config.json").write_text(raw_config)
        else:
            _config(d, quant)
        add(name, layer, name, about, f"{name}/config.json" if raw_config is not None else name, names)

    import torch

    bad = dict(gq)
    bad[f"{q}.scales"] = torch.ones(I // G, O + 8, dtype=torch.float16)
    quant_dir("ck_scales_shape_disagrees", bad, about="q_proj scales [4, 72] for qweight [16, 64]",
              names=(q,))
    bad = dict(gq)
    bad[f"{q}.qzeros"] = torch.zeros(I // G, 3, dtype=torch.int32)
    quant_dir("ck_qzeros_shape_disagrees", bad, about="q_proj qzeros [4, 3], expected [4, 8]",
              names=(q,))
    bad = dict(gq)
    bad[f"{q}.qweight"] = gq[f"{q}.qweight"].float()
    quant_dir("ck_qweight_wrong_dtype", bad, about="q_proj qweight stored as F32",
              names=(q,))
    bad = dict(gq)
    bad[f"{q}.g_idx"] = torch.full((I,), 1_000_000, dtype=torch.int32)
    quant_dir("ck_g_idx_out_of_range", bad, about="q_proj g_idx entries are 10^6 (only 4 groups): visible only "
              "in the data", names=(q,), layer="data")
    quant_dir("ck_bits_disagree_config", gq, quant=GPTQ_CONFIG | {"bits": 8},
              about="config says 8-bit; qweight [16, 64] holds 4-bit codes for scales [4, 64]")
    quant_dir("ck_bits_unsupported", gq, quant=GPTQ_CONFIG | {"bits": 99}, about="config says 99-bit")
    quant_dir("ck_config_wrong_types", gq, quant=GPTQ_CONFIG | {"bits": "four", "group_size": [32]},
              about="bits is a string, group_size a list", names=("bits",))
    quant_dir("ck_config_invalid_json", gq, raw_config='{"quantization_config": {"bits": 4,', about="config.json is "
              "not JSON", layer=ck)
    quant_dir("ck_config_not_object", gq, raw_config="[]", about="config.json is a list",
              layer=ck)
    d = case_dir("ck_empty_dir")
    add("ck_empty_dir", ck, "ck_empty_dir", "a directory with no weights")
    d = case_dir("ck_dangling_symlink")
    link = d / "model.safetensors"
    os.symlink(d / "nowhere.safetensors", link)
    _config(d)
    add("ck_dangling_symlink", ck, "ck_dangling_symlink", "model.safetensors is a dangling symlink")

    # pickles --------------------------------------------------------------------------------------------
    marker = str(out / MARKER)
    boom = pickle.dumps({"model.layers.0.self_attn.q_proj.weight": _Boom(marker)}, protocol=4)
    file_case("pk_malicious_bin", "pickle", ".bin", boom, "a .bin pickle whose load runs os.mkdir")
    file_case("pk_malicious_pt", "pickle", ".pt", boom, "the same pickle named .pt")
    d = case_dir("pk_dir_only_bin")
    (d / "pytorch_model.bin").write_bytes(boom)
    _config(d)
    add("pk_dir_only_bin", "pickle", "pk_dir_only_bin", "a directory holding only pytorch_model.bin")
    file_case("pk_pickle_named_safetensors", "pickle", ".safetensors", boom, "the pickle renamed .safetensors")
    file_case("pk_pickle_named_gguf", "pickle", ".gguf", boom, "the pickle renamed .gguf")

    # YAML job specs (run against each command's control input) ------------------------------------------
    def spec(name: str, text: str | bytes, about: str, key: str | None = None) -> None:
        d = case_dir(name)
        p = d / f"{name}.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        rel = f"{name}/{name}.yaml"
        add(name, "yaml", None, about, rel, (key,) if key else (), config=rel)

    spec("y_unknown_key", "quiet: true\nbitz: 4\n", "unknown key 'bitz'", key="bitz")
    spec("y_wrong_type_int", "quiet: true\nbits: four\n", "bits: four", key="bits")
    spec("y_wrong_type_bool", "quiet: yes-please\n", "quiet: a string", key="quiet")
    spec("y_wrong_type_list", "quiet: [1, 2]\n", "quiet: a list", key="quiet")
    spec("y_wrong_type_mapping", "quiet: {a: 1}\n", "quiet: a mapping", key="quiet")
    spec("y_not_mapping", "- quiet\n- true\n", "a list, not a mapping")
    spec("y_invalid_yaml", "quiet: [true\n", "unclosed bracket")
    spec("y_not_utf8", b"quiet: \xff\xfe\n", "not UTF-8")
    spec("y_key_not_string", "1: 2\n", "an integer key")
    spec("y_python_object", f"quiet: !!python/object/apply:os.mkdir ['{marker}']\n",
         "a python/object tag that would run os.mkdir under an unsafe loader")
    # Nine levels of ten references each: 10^9 leaves if anything expands it (repr, str, json.dumps).
    levels = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    for k in range(1, 10):
        levels.append(f"&l{k} [" + ", ".join([f"*l{k - 1}"] * 10) + "]")
    spec("y_billion_laughs", "quiet: [" + ", ".join(levels) + "]\n", "alias bomb: 10^9 elements by reference")
    # Values the YAML loader itself cannot build: it cannot say which key, so the file (and line) is enough.
    spec("y_bad_timestamp", "quiet: 2001-13-45\n", "a timestamp with month 13 (the YAML loader raises ValueError)")
    spec("y_bad_int_tag", "quiet: !!int nope\n", "an explicit !!int tag on text (ValueError)")
    spec("y_timestamp_tag", "quiet: !!timestamp nope\n", "!!timestamp on text (AttributeError in the loader)")
    spec("y_empty_int_tag", "quiet: !!int ''\n", "!!int on an empty string (IndexError in the loader)")
    spec("y_bool_tag", "quiet: !!bool maybe\n", "!!bool on text (KeyError in the loader)")
    spec("y_deep_nesting", "quiet: " + "[" * 1500 + "]" * 1500 + "\n", "1500 nested lists (recursion bomb)")
    spec("y_huge_int", "quiet: " + "9" * 5000 + "\n", "a 5000-digit integer")
    spec("y_too_big", "quiet: true\n" + "# padding\n" * 120_000, "1.2 MB job spec")
    return cases


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python tests/attacks/generate_corpus.py OUTDIR\n")
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    cases = build_corpus(args[0])
    for c in cases:
        print(f"{c.name:34s} {c.layer:11s} {c.about}")
    print(f"{len(cases)} cases written to {Path(args[0]).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
