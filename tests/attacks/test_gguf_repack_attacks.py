"""Hostile GGUF inputs and flags against `qtool repack`, each in a fresh process under the 4 GiB address-space cap
(tests/attacks/runner.py): a refusal is exit 2 with one `qtool: error:` line naming the file, no traceback, and
nothing written; the inputs that are valid convert in bounded time and memory. Never exit 3.

Cases: duplicate metadata keys, invalid UTF-8 (key, string value, tensor name), n_dims 0 and a zero dimension
(to q4_0), a block count of 10^12 claimed by a GGUF or by config.json, a tensor name numbering block 10^12,
--group-size 0 / -2, a big-endian block type qtool does not swap, an empty metadata array, and a 2,000,000-token
vocabulary (GGUF -> GGUF must take seconds and little memory, metadata byte for byte)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.attacks.generate_corpus import (
    ARRAY,
    GPTQ_CONFIG,
    STRING,
    T_F32,
    T_Q4_0,
    UINT64,
    _gptq_tensors,
    _save,
    gguf_bytes,
    gstr,
    kv_str,
    kv_u32,
    q4_0_rows,
    tensor_info,
    u32,
    u64,
)
from tests.attacks.runner import Result, run_batch, run_qtool

MAX_RSS_MB = 1024
BASE = [kv_str("general.architecture", "llama"), kv_u32("general.file_type", 2)]
ONE = [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0)]


def _gguf(kvs: list[bytes], infos: list[bytes] = ONE, data: bytes | None = None) -> bytes:
    return gguf_bytes(BASE + kvs, infos, q4_0_rows(32, 64, 1) if data is None else data)


def _hf(root: Path, num_hidden_layers: int = 1, rename: tuple[str, str] | None = None) -> Path:
    """A GPTQ 4-bit g32 symmetric checkpoint (exact to q4_0), its config claiming `num_hidden_layers`."""
    t = _gptq_tensors()
    if rename:
        t = {k.replace(*rename): v for k, v in t.items()}
    _save(t, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": num_hidden_layers,
                                                  "quantization_config": GPTQ_CONFIG}))
    return root


def _big_endian_q5_0() -> bytes:
    """A big-endian GGUF (version field big-endian) holding a Q5_0 tensor: a block type qtool does not swap."""
    be32, be64 = (lambda v: struct.pack(">I", v)), (lambda v: struct.pack(">Q", v))

    def bstr(s: str) -> bytes:
        return be64(len(s)) + s.encode()

    head = b"GGUF" + be32(3) + be64(1) + be64(1) + bstr("general.architecture") + be32(STRING) + bstr("llama")
    head += bstr("blk.0.attn_q.weight") + be32(2) + be64(32) + be64(64) + be32(6) + be64(0)  # 6 = Q5_0
    head += b"\0" * (-len(head) % 32)
    return head + b"\1" * (64 * 22)


def tokens_gguf(n: int) -> bytes:
    """A Q4_0 GGUF whose tokenizer.ggml.tokens holds `n` one-byte strings, built as one numpy block."""
    items = np.zeros(n, dtype=np.dtype([("len", "<u8"), ("c", "u1")]))
    items["len"] = 1
    items["c"] = np.resize(np.arange(97, 123, dtype=np.uint8), n)
    arr = gstr("tokenizer.ggml.tokens") + u32(ARRAY) + u32(STRING) + u64(n) + items.tobytes()
    return _gguf([arr, kv_u32("llama.block_count", 1)])


# name -> (files to write, argv tail after SRC, source path inside the case dir)
def build(root: Path) -> dict[str, tuple[Path, list[str]]]:
    cases: dict[str, tuple[Path, list[str]]] = {}

    def g(name: str, content: bytes, *flags: str) -> None:
        d = root / name
        d.mkdir()
        (d / "m.gguf").write_bytes(content)
        cases[name] = (d / "m.gguf", ["--to", "q4_0", *flags])

    g("dup_key", _gguf([kv_u32("llama.block_count", 1), kv_u32("llama.block_count", 2)]))
    g("utf8_key", _gguf([gstr(b"llama.\xff\xfe") + u32(4) + u32(1)]))
    g("utf8_value", _gguf([gstr("general.name") + u32(STRING) + gstr(b"\xc3\x28")]))
    g("utf8_tensor", _gguf([], [gstr(b"blk.0.\xffq.weight") + u32(2) + u64(64) + u64(32) + u32(T_Q4_0) + u64(0)]))
    g("n_dims_0", _gguf([], [tensor_info("blk.0.attn_q.weight", (), T_Q4_0, 0)]))
    g("n_dims_0_f32", _gguf([], [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0),
                                 tensor_info("output_norm.weight", (), T_F32, 1152)],
                            q4_0_rows(32, 64, 1) + b"\0" * 4))
    g("zero_dim", _gguf([], [tensor_info("blk.0.attn_q.weight", (64, 0), T_Q4_0, 0)]))
    g("zero_rows", _gguf([], [tensor_info("blk.0.attn_q.weight", (0, 32), T_Q4_0, 0)]))
    g("big_endian_q5_0", _big_endian_q5_0())
    g("group_size_0", _gguf([]), "--group-size", "0")
    g("group_size_-2", _gguf([]), "--group-size", "-2")
    for name, rename, layers in (("hf_block_count_1e12", None, 10**12),
                                 ("hf_block_index_1e12", ("layers.0.", "layers.1000000000000."), 1)):
        d = root / name
        d.mkdir()
        cases[name] = (_hf(d / "src", layers, rename), ["--to", "q4_0"])
    return cases


# Inputs that are valid: they must convert (exit 0) quickly.
VALID = {
    "gguf_block_count_1e12": _gguf([gstr("llama.block_count") + u32(UINT64) + u64(10**12)]),
    "empty_array": _gguf([gstr("test.empty") + u32(ARRAY) + u32(4) + u64(0)]),
}


def _one_error_line(r: Result, src: Path | None) -> str:
    assert r.rc == 2, (r.argv, r.rc, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert src is None or str(src) in lines[0] or str(src.parent) in lines[0], lines[0]
    return lines[0]


EXPECT = {
    "dup_key": "'llama.block_count' appears twice",
    "utf8_key": "not valid UTF-8",
    "utf8_value": "'general.name' is not valid UTF-8",
    "utf8_tensor": "not valid UTF-8",
    "n_dims_0": "0 dimensions",
    "n_dims_0_f32": "0 dimensions",
    "zero_dim": "zero dimension",
    "zero_rows": "zero dimension",
    "big_endian_q5_0": "big-endian GGUF tensor of type Q5_0",
    "group_size_0": "--group-size 0 is not a group size",
    "group_size_-2": "--group-size -2 is not a group size",
    "hf_block_count_1e12": "num_hidden_layers = 1000000000000",
    "hf_block_index_1e12": "names of at most 1024 blocks",
}


def test_hostile_gguf_repacks_are_one_line_refusals(tmp_path):
    cases = build(tmp_path)
    assert set(cases) == set(EXPECT)
    names = sorted(cases)
    outs = {n: tmp_path / n / "out.gguf" for n in names}
    results = run_batch([["repack", str(cases[n][0]), *cases[n][1], "-o", str(outs[n])] for n in names],
                        timeout=30.0)
    for n, r in zip(names, results, strict=True):
        assert not r.timed_out and r.maxrss_mb < MAX_RSS_MB, (n, r.seconds, r.maxrss_mb)
        line = _one_error_line(r, None if n.startswith("group_size") else cases[n][0])  # a flag: no file
        assert EXPECT[n] in line, (n, line)
        assert not outs[n].exists() and sorted(p.name for p in outs[n].parent.iterdir()) == \
            sorted(p.name for p in (tmp_path / n).iterdir())  # nothing beside it either
        assert not [p for p in (tmp_path / n).iterdir() if p.name.startswith(".")], n


def test_counts_claimed_by_a_gguf_do_not_size_work_and_empty_arrays_carry(tmp_path):
    names = sorted(VALID)
    for n in names:
        (tmp_path / f"{n}.gguf").write_bytes(VALID[n])
    results = run_batch([["repack", str(tmp_path / f"{n}.gguf"), "--to", "q8_0", "-o", str(tmp_path / f"{n}-o.gguf")]
                         for n in names], timeout=30.0)
    for n, r in zip(names, results, strict=True):
        assert r.rc == 0 and not r.timed_out, (n, r.rc, r.stderr[-2000:])
        assert (tmp_path / f"{n}-o.gguf").is_file()


def test_two_million_token_vocabulary_repacks_in_seconds_and_bounded_memory(tmp_path):
    """gguf.GGUFReader-based carrying took ~260 s and ~2.9 GB here; the bytes are now copied as they are."""
    src = tmp_path / "vocab.gguf"
    src.write_bytes(tokens_gguf(2_000_000))
    r = run_qtool(["repack", str(src), "--to", "q8_0", "-o", str(tmp_path / "o.gguf"), "-q"], timeout=60.0)
    assert r.rc == 0 and not r.timed_out, (r.rc, r.seconds, r.stderr[-2000:])
    assert r.maxrss_mb < 600, r.maxrss_mb
    from qtool.io.gguf_reader import read_gguf_header

    a, b = read_gguf_header(src), read_gguf_header(tmp_path / "o.gguf")
    s0, e0 = a.kv_spans["tokenizer.ggml.tokens"]
    s1, e1 = b.kv_spans["tokenizer.ggml.tokens"]
    with open(src, "rb") as fa, open(tmp_path / "o.gguf", "rb") as fb:
        fa.seek(s0)
        fb.seek(s1)
        assert e0 - s0 == e1 - s1 and fa.read(e0 - s0) == fb.read(e1 - s1)


@pytest.mark.parametrize("layers", [10**12])
def test_gguf_block_count_never_reaches_the_name_map(tmp_path, layers):
    """In-process as well: the claimed count is not what sizes gguf.get_tensor_name_map."""
    import gguf

    from qtool.repack.plan import RepackJob
    from qtool.repack.run import run_repack

    calls = []
    real = gguf.get_tensor_name_map

    def spy(arch, n):
        calls.append(n)
        assert n < 1024
        return real(arch, n)

    src = tmp_path / "m.gguf"
    src.write_bytes(_gguf([gstr("llama.block_count") + u32(UINT64) + u64(layers)]))
    gguf.get_tensor_name_map = spy
    try:
        run_repack(RepackJob(src, "q8_0", tmp_path / "o.gguf"))
        hf = _hf(tmp_path / "hf", 1)
        run_repack(RepackJob(hf, "q4_0", tmp_path / "hf.gguf"))
    finally:
        gguf.get_tensor_name_map = real
    assert calls == [1]  # only the Hugging Face source is mapped, for the one block its names hold
