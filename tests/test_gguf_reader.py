"""qtool's bounded GGUF header reader: agreement with the gguf package, truncation, split sets, hostile headers."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from qtool.errors import InputError
from qtool.io.gguf_reader import (
    ARRAY_INLINE_LIMIT,
    MAX_REPORTED,
    ArraySummary,
    read_array,
    read_gguf,
    read_gguf_header,
    split_siblings,
)
from tests.conftest import fixture_path

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# (name, type, [O, I]); I is a multiple of 256 so Q6_K fits.
TENSORS = [("blk.0.attn_q.weight", T.Q4_0, (8, 256)), ("blk.0.attn_k.weight", T.Q4_1, (8, 256)),
           ("blk.0.ffn_up.weight", T.Q8_0, (16, 256)), ("blk.0.ffn_down.weight", T.Q6_K, (8, 512)),
           ("blk.0.attn_norm.weight", T.F32, (256,))]


def q6_k_blocks(shape: tuple[int, int], rng) -> np.ndarray:
    """Raw Q6_K rows uint8 [O, I/256*210]: gguf.quants has no Q6_K quantizer, so the blocks are built from
    random ql/qh/int8 scales and a finite fp16 d (the block's last two bytes)."""
    o, i = shape
    blocks = rng.integers(0, 256, size=(o * i // 256, 210), dtype=np.uint8)
    d = rng.uniform(1e-3, 1e-2, size=(blocks.shape[0], 1)).astype(np.float16)
    blocks[:, 208:] = d.view(np.uint8)
    return blocks.reshape(o, -1)


def write_gguf(path: Path, tensors=TENSORS, vocab: int = 1000, split_max_tensors: int = 0,
               endianess=None, seed: int = 0) -> dict[str, np.ndarray]:
    """A GGUF written by the gguf package's own writer; returns {name: raw data written (quantized bytes or
    fp32)}. Q4_0/Q4_1/Q8_0 come from gguf.quants.quantize."""
    rng = np.random.default_rng(seed)
    kw = {"split_max_tensors": split_max_tensors}
    if endianess is not None:
        kw["endianess"] = endianess
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_name("test model")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(2)
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([float(-i) for i in range(vocab)])
    w.add_array("test.small", [1, 2, 3])
    src = {}
    for name, qtype, shape in tensors:
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == T.F32:
            data = x
            w.add_tensor(name, x)
        else:
            data = q6_k_blocks(shape, rng) if qtype == T.Q6_K else gguf.quants.quantize(x, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
        src[name] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


@pytest.fixture(scope="module")
def gfile(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(p)
    return p


def test_agrees_with_gguf_reader(gfile):
    h = read_gguf_header(gfile)
    ref = gguf.GGUFReader(str(gfile))
    assert h.complete and not h.truncated and h.problems == []
    assert h.tensor_count == len(ref.tensors) == len(TENSORS)
    assert h.data_start == ref.data_offset
    for mine, theirs in zip(h.tensors, ref.tensors, strict=True):
        assert mine.name == theirs.name
        assert mine.shape == tuple(int(x) for x in theirs.shape)
        assert mine.type_id == int(theirs.tensor_type)
        assert mine.start == theirs.data_offset
        assert mine.nbytes == theirs.n_bytes
        assert mine.complete
    # metadata values equal what the writer put in
    assert h.kv["general.architecture"] == "llama"
    assert h.kv["general.name"] == "test model"
    assert h.kv["general.file_type"] == 2
    assert h.kv_types["general.file_type"] == "UINT32"
    assert h.kv["test.small"] == [1, 2, 3]
    toks = h.kv["tokenizer.ggml.tokens"]
    assert isinstance(toks, ArraySummary) and toks.count == 1000 and toks.item_type == "STRING"
    assert toks.preview[:3] == ("tok0", "tok1", "tok2")
    assert toks.nbytes == sum(8 + len(f"tok{i}") for i in range(1000))
    sc = h.kv["tokenizer.ggml.scores"]
    assert sc.count == 1000 and sc.nbytes == 4000 and sc.preview[1] == -1.0
    assert 1000 > ARRAY_INLINE_LIMIT
    # read in full at the recorded offsets, they are what the gguf package's reader gives
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "test.small", "general.name"):
        assert read_array(h, h.kv[key]) == ref.fields[key].contents(), key


def test_bits_per_weight_from_type_table(gfile):
    h = read_gguf_header(gfile)
    bpw = {t.type_name: t.bpw for t in h.tensors}
    assert bpw == {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q6_K": 6.5625, "F32": 32.0}


def test_fixture_header(fixtures_dir):
    h = read_gguf_header(fixture_path("gguf-q4_0-q4_1-q8_0/gguf-q4_0-q4_1-q8_0.gguf"))
    types = {t.name: t.type_name for t in h.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.ffn_up.weight"] == "Q4_1"
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.ffn_down.bias"] == "F32"
    assert h.expected_size == h.file_size == 142592
    assert h.kv["general.quantization_version"] == 2


@pytest.mark.parametrize("frac", [0.999, 0.9, 0.6, 0.3])
def test_truncated_data_reports_instead_of_raising(gfile, tmp_path, frac):
    raw = gfile.read_bytes()
    full = read_gguf_header(gfile)
    cut = int(full.data_start + (len(raw) - full.data_start) * frac)
    p = tmp_path / "cut.gguf"
    p.write_bytes(raw[:cut])
    h = read_gguf_header(p)
    assert h.complete and h.truncated
    k = sum(1 for t in full.tensors if t.start + t.nbytes <= cut)
    assert h.tensors_complete == k
    first = next(t.name for t in full.tensors if t.start + t.nbytes > cut)
    assert h.truncation_message() == (f"truncated: {cut} of {len(raw)} bytes; {k} of {len(TENSORS)} tensors "
                                      f"complete; first incomplete tensor '{first}'")


@pytest.mark.parametrize("cut", [30, 200, 5000, 18560])
def test_truncated_header_reports_partial(gfile, tmp_path, cut):
    full = read_gguf_header(gfile)
    assert cut < full.data_start
    p = tmp_path / "cut.gguf"
    p.write_bytes(gfile.read_bytes()[:cut])
    h = read_gguf_header(p)
    assert not h.complete and h.truncated and h.tensors_complete == 0
    assert h.problems and h.problems[0][0] == "error"
    msg = h.truncation_message()
    assert msg.startswith(f"header unreadable from byte {h.header_end} of the {cut}-byte file (cut short or "
                          "corrupt)") and f"0 of {len(TENSORS)} tensors complete" in msg
    assert h.header_end <= cut
    # what was parsed before the cut is right
    for k, v in h.kv.items():
        assert repr(v) == repr(full.kv[k])


def test_every_cut_point_is_handled(gfile, tmp_path):
    """No cut point raises anything but InputError (only below the 24-byte fixed header)."""
    raw = gfile.read_bytes()
    p = tmp_path / "cut.gguf"
    full = read_gguf_header(gfile)
    for cut in list(range(0, 64, 3)) + list(range(64, full.data_start + 64, 97)):
        p.write_bytes(raw[:cut])
        if cut < 24:
            with pytest.raises(InputError):
                read_gguf_header(p)
            continue
        h = read_gguf_header(p)
        assert h.truncated and h.tensors_complete == 0


def test_split_set_and_missing_member(tmp_path):
    base = tmp_path / "model.gguf"
    write_gguf(base, split_max_tensors=2)
    files = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert [f.name for f in files] == ["model-00001-of-00003.gguf", "model-00002-of-00003.gguf",
                                       "model-00003-of-00003.gguf"]
    assert split_siblings(files[1]) == files
    s = read_gguf(files[0])
    assert [t.name for t in s.tensors] == [t[0] for t in TENSORS]
    assert s.missing == [] and s.kv["split.count"] == 3 and s.kv["split.tensors.count"] == len(TENSORS)
    files[1].unlink()
    s = read_gguf(files[2])  # any member names the set
    assert s.missing == [files[1]]
    assert [t.name for t in s.tensors] == [TENSORS[0][0], TENSORS[1][0], TENSORS[4][0]]


def test_big_endian(tmp_path):
    p = tmp_path / "be.gguf"
    write_gguf(p, tensors=[("w.weight", T.F32, (4, 32))], endianess=gguf.GGUFEndian.BIG)
    h = read_gguf_header(p)
    assert h.byte_order == "big" and h.complete
    assert h.kv["general.file_type"] == 2 and h.tensors[0].shape == (32, 4)
    assert h.kv["tokenizer.ggml.tokens"].count == 1000


def _header(kvs: bytes, n_kv: int, tensors: bytes, n_t: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv) + kvs + tensors


def _str(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def test_hostile_lengths_are_bounded(tmp_path):
    p = tmp_path / "h.gguf"
    # a string claiming 2^62 bytes
    p.write_bytes(_header(struct.pack("<Q", 1 << 62) + b"x" * 40, 1, b"", 0))
    h = read_gguf_header(p)
    assert not h.complete and "needs 4611686018427387904 bytes" in h.problems[0][2]
    # an array of 2^40 strings in a tiny file: refused before the loop
    kv = _str("a") + struct.pack("<IIQ", 9, 8, 1 << 40)
    p.write_bytes(_header(kv, 1, b"", 0))
    h = read_gguf_header(p)
    assert not h.complete and "strings need at least" in h.problems[0][2]
    # a tensor with 9 dims
    t = _str("w") + struct.pack("<I", 9) + b"\0" * 80
    p.write_bytes(_header(b"", 0, t, 1))
    h = read_gguf_header(p)
    assert not h.complete and "claims 9 dims" in h.problems[0][2]
    # absurd counts: corrupt, not a model
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 50, 0) + b"\0" * 16)
    with pytest.raises(InputError, match="corrupt"):
        read_gguf_header(p)
    p.write_bytes(b"GGML" + b"\0" * 40)
    with pytest.raises(InputError, match="not a GGUF file"):
        read_gguf_header(p)


def test_unknown_type_and_bad_row_are_problems(tmp_path):
    p = tmp_path / "t.gguf"
    t = (_str("a.weight") + struct.pack("<I2QIQ", 2, 32, 2, 99, 0)
         + _str("b.weight") + struct.pack("<I2QIQ", 2, 33, 2, int(T.Q4_0), 64))
    raw = _header(b"", 0, t, 2)
    raw += b"\0" * (-len(raw) % 32) + b"\0" * 256
    p.write_bytes(raw)
    h = read_gguf_header(p)
    msgs = {(n, m) for _s, n, m in h.problems}
    assert ("a.weight", "unknown tensor type id 99") in msgs
    assert ("b.weight", "row size 33 is not a multiple of the Q4_0 block size (32)") in msgs
    assert h.tensors[0].nbytes is None and h.tensors[0].type_name == "UNKNOWN_99"


# --- hostile metadata and directories: reported, never raised ----------------------------------------------
def _hand_gguf(path: Path, kvs: list[bytes], infos: list[bytes] | None = None) -> Path:
    from tests.attacks.generate_corpus import T_Q4_0, gguf_bytes, q4_0_rows, tensor_info

    infos = infos if infos is not None else [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0)]
    path.write_bytes(gguf_bytes(kvs, infos, q4_0_rows(32, 64, 1)))
    return path


def _errors(h) -> list[str]:
    return [m for sev, _t, m in h.problems if sev == "error"]


def test_duplicate_metadata_key_is_an_error_and_the_first_value_stays(tmp_path):
    from tests.attacks.generate_corpus import kv_u32

    h = read_gguf_header(_hand_gguf(tmp_path / "d.gguf", [kv_u32("llama.block_count", 1),
                                                          kv_u32("llama.block_count", 2)]))
    assert h.kv["llama.block_count"] == 1 and h.complete
    assert any("'llama.block_count' appears twice" in m for m in _errors(h))


@pytest.mark.parametrize("where", ["key", "value", "tensor"])
def test_invalid_utf8_is_an_error(tmp_path, where):
    from tests.attacks.generate_corpus import STRING, T_Q4_0, gstr, u32, u64

    kvs = {"key": [gstr(b"bad.\xff") + u32(4) + u32(1)],
           "value": [gstr("general.name") + u32(STRING) + gstr(b"\xc3\x28")]}.get(where, [])
    infos = [gstr(b"blk.\xfe.weight") + u32(2) + u64(64) + u64(32) + u32(T_Q4_0) + u64(0)] \
        if where == "tensor" else None
    h = read_gguf_header(_hand_gguf(tmp_path / "u.gguf", kvs, infos))
    assert any("is not valid UTF-8" in m for m in _errors(h)), h.problems


@pytest.mark.parametrize("dims", [(), (64, 0), (0, 32)])
def test_zero_dims_or_a_zero_dimension_is_an_error(tmp_path, dims):
    from tests.attacks.generate_corpus import T_Q4_0, tensor_info

    h = read_gguf_header(_hand_gguf(tmp_path / "z.gguf", [], [tensor_info("blk.0.attn_q.weight", dims, T_Q4_0, 0)]))
    assert any("dimension" in m for m in _errors(h)) and h.tensors[0].nbytes is None


def test_kv_spans_hold_each_whole_record(gfile):
    h = read_gguf_header(gfile)
    raw = gfile.read_bytes()
    ends = sorted(h.kv_spans.values())
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # contiguous, in file order
    assert list(h.kv_spans) == list(h.kv)
    for key, (start, end) in h.kv_spans.items():
        n = struct.unpack_from("<Q", raw, start)[0]
        assert raw[start + 8:start + 8 + n].decode() == key and end > start + 8 + n + 4


@pytest.mark.parametrize("value,vtype,says", [
    ("32", "STRING", "general.alignment is STRING '32', but GGUF stores it as UINT32"),
    (32, "UINT64", "general.alignment is UINT64 32, but GGUF stores it as UINT32"),
])
def test_alignment_of_another_type_is_named_by_its_type(tmp_path, value, vtype, says):
    p = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_key_value("general.alignment", value, gguf.GGUFValueType[vtype])
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    errs = _errors(read_gguf_header(p))
    assert any(m.startswith(says) for m in errs) and not any("power of two" in m for m in errs), errs


def test_a_directory_of_broken_entries_is_counted_not_listed(tmp_path):
    """Each 24-byte entry with no dimensions is a problem; a million of them must not cost a million report
    lines (3 GB and 280 MB of JSON before the cap)."""
    from tests.attacks.generate_corpus import gstr, u32, u64

    n = 2000
    infos = [gstr("") + u32(0) + u32(0) + u64(0)] * n
    p = _hand_gguf(tmp_path / "many.gguf", [], infos)
    h = read_gguf_header(p)
    assert h.complete and len(h.tensors) == n
    assert len(h.problems) == MAX_REPORTED + 1, h.problems[-1]
    assert h.problems[-1][2] == f"... and {n - MAX_REPORTED} more of the same kind (empty tensor; {n} in all)"

    from qtool.inspect import inspect_path

    msgs = [a.message for a in inspect_path(p).anomalies]
    assert len(msgs) < 20, len(msgs)
    assert f"... and {n - 1 - MAX_REPORTED} more tensor entries repeat a name ({n - 1} in all); only the first of " \
           "each is read" in msgs


def test_safetensors_named_gguf_is_told_to_be_renamed(tmp_path):
    from safetensors.numpy import save_file

    p = tmp_path / "model.gguf"
    save_file({"a.weight": np.ones((4, 4), np.float32)}, str(p))
    with pytest.raises(InputError, match=r"holds a safetensors header") as e:
        read_gguf_header(p)
    assert e.value.fix == "rename it to .safetensors and inspect it again"


def _split3(d: Path) -> list[Path]:
    """A 3-file split set written by the gguf package (one tensor per file)."""
    w = gguf.GGUFWriter(str(d / "m.gguf"), "llama", split_max_tensors=1)
    w.add_block_count(3)
    for i in range(3):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(d.glob("m-*.gguf"))


def test_files_beside_a_split_set_named_like_its_members_are_listed(tmp_path):
    files = _split3(tmp_path)
    assert read_gguf(files[0]).extra == []
    stray = [tmp_path / "m-00004-of-00003.gguf", tmp_path / "m-00001-of-00002.gguf"]
    for s in stray:
        s.write_bytes(files[0].read_bytes())
    (tmp_path / "other-00001-of-00002.gguf").write_bytes(files[0].read_bytes())  # another model's set
    assert read_gguf(files[1]).extra == sorted(stray)
