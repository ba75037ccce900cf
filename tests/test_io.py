"""I/O layer: header reader, checkpoint opening (file / dir / index), streaming sharded writer, atomicity."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtool.errors import InputError, OutputError
from qtool.io.checkpoint import open_checkpoint
from qtool.io.qconfig import parse_quant_config
from qtool.io.safetensors_header import read_header
from qtool.io.writer import HEADER_RESERVE, ShardedWriter, atomic_output, parse_size


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(8, 16, generator=g), "a.bias": torch.randn(8, generator=g).half(),
            "b.weight": torch.randint(-5, 5, (4, 4), dtype=torch.int32, generator=g),
            "c": torch.randn(3, generator=g).bfloat16()}


def test_header_matches_safetensors(tmp_path):
    t = _tensors()
    save_file(t, tmp_path / "m.safetensors", metadata={"format": "pt", "k": "v"})
    infos, meta = read_header(tmp_path / "m.safetensors")
    assert meta == {"format": "pt", "k": "v"}
    assert {n: (i.dtype, i.shape) for n, i in infos.items()} == {
        "a.weight": ("F32", (8, 16)), "a.bias": ("F16", (8,)), "b.weight": ("I32", (4, 4)), "c": ("BF16", (3,))}
    raw = (tmp_path / "m.safetensors").read_bytes()
    for n, i in infos.items():  # offsets are absolute and point at the tensor's own bytes
        assert raw[i.start:i.end] == t[n].contiguous().view(torch.uint8).numpy().tobytes()


def _raw_file(path, header: bytes, data: bytes = b"", n: int | None = None):
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)
    return path


@pytest.mark.parametrize("header,data,n,msg", [
    (b"{}", b"", 10**9, "over the"),
    (b"{}", b"", 50, "bad header length: beyond the end"),
    (b"{not json", b"", None, "not valid JSON"),
    (json.dumps({"x": {"dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"\0" * 4, None,
     "beyond"),
    (json.dumps({"x": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, None,
     "needs 6 bytes"),
    (json.dumps({"x": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                 "y": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}).encode(), b"\0" * 6, None,
     "overlaps"),
    (json.dumps({"x": {"dtype": "F16", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}).encode(), b"\0" * 4,
     None, "elements"),
    (json.dumps({"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, None,
     "unknown dtype"),
    # no element, but a dimension past any reader's index (the safetensors library refuses it too)
    (json.dumps({"x": {"dtype": "F16", "shape": [2**64, 0], "data_offsets": [0, 0]}}).encode(), b"", None,
     "integers in"),
])
def test_header_rejects_bad_files(tmp_path, header, data, n, msg):
    p = _raw_file(tmp_path / "bad.safetensors", header, data, n)
    with pytest.raises(InputError, match=msg) as e:
        read_header(p)
    assert "bad.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_open_dir_file_and_index(tmp_path):
    t = _tensors()
    d = tmp_path / "ck"
    d.mkdir()
    save_file({k: t[k] for k in ("a.weight", "a.bias")}, d / "model-00001-of-00002.safetensors")
    save_file({k: t[k] for k in ("b.weight", "c")}, d / "model-00002-of-00002.safetensors")
    wm = {"a.weight": "model-00001-of-00002.safetensors", "a.bias": "model-00001-of-00002.safetensors",
          "b.weight": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text(json.dumps({"model_type": "x", "quantization_config": {"quant_method": "gptq",
                                                                                          "bits": 4}}))
    (d / "tokenizer.json").write_text("{}")
    for path in (d, d / "model.safetensors.index.json"):
        ck = open_checkpoint(path)
        assert set(ck.tensors) == set(t)
        assert torch.equal(ck.get("b.weight"), t["b.weight"])
        assert ck.quant_config["bits"] == 4
        assert set(ck.modules()) == {"a", "b", ""}
        assert [p.name for p in ck.other_files()] == ["tokenizer.json"]
    # a missing shard and an index naming a tensor no shard holds
    wm2 = dict(wm, ghost="model-00002-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm2}))
    with pytest.raises(InputError, match="'ghost'.*does not hold it"):
        open_checkpoint(d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError, match="shard 'model-00002-of-00002.safetensors'.*missing"):
        open_checkpoint(d)


def test_pickle_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    for p in (tmp_path / "pytorch_model.bin", tmp_path):
        with pytest.raises(InputError, match="pickle"):
            open_checkpoint(p)


def test_writer_streams_shards_and_index(tmp_path):
    t = {f"m{i}.w": torch.full((100,), float(i)) for i in range(5)}
    with atomic_output(tmp_path / "out") as tmp:
        w = ShardedWriter(tmp, max_shard_size=900, metadata={"qtool.format": "gptq"})
        for k, v in t.items():
            w.add(k, v)
        files = w.close()
    out = tmp_path / "out"
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            assert h.metadata() == {"format": "pt", "qtool.format": "gptq"}
        got.update(load_file(f))
    assert all(torch.equal(got[k], v) for k, v in t.items())
    assert all(index["weight_map"][k] for k in t)
    # header is reserved space padded with blanks; data starts 8-aligned
    assert struct.unpack("<Q", (out / files[0].name).read_bytes()[:8])[0] == HEADER_RESERVE


def test_add_raw_copies_bytes(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file({"x": torch.randn(7, 3).bfloat16()}, src)
    infos, _ = read_header(src)
    with atomic_output(tmp_path / "o") as tmp:
        w = ShardedWriter(tmp)
        w.add_raw("x", infos["x"])
        w.close()
    assert torch.equal(load_file(tmp_path / "o" / "model.safetensors")["x"].view(torch.int16),
                       load_file(src)["x"].view(torch.int16))


def test_atomic_output_refuses_and_rolls_back(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()  # an earlier qtool output: what --force may replace
    save_file({"w": torch.zeros(1)}, dest / "model.safetensors", metadata={"qtool.version": "0"})
    (dest / "keep").write_text("old")
    with pytest.raises(OutputError, match="destination exists"):
        with atomic_output(dest):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output(dest, force=True) as tmp:
            (tmp / "new").write_text("half")
            raise RuntimeError("boom")
    assert (dest / "keep").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # the temp dir is gone
    with atomic_output(dest, force=True) as tmp:
        (tmp / "new").write_text("complete")
    assert [p.name for p in dest.iterdir()] == ["new"]


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("500") == 500
    with pytest.raises(OutputError):
        parse_size("lots")


@pytest.mark.parametrize("raw,fmt,bits,group,sym", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "checkpoint_format": "gptq_v2"},
     "gptq_v2", 4, 128, True),
    ({"quant_method": "gptq", "wbits": 3, "q_group_size": 64, "sym": False}, "gptq", 3, 64, False),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}, "awq", 4,
     128, False),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_p"}, "gptq_p", 4, 128, None),
])
def test_quant_config_synonyms(raw, fmt, bits, group, sym):
    q = parse_quant_config(raw)
    assert (q.format, q.bits, q.group_size, q.sym) == (fmt, bits, group, sym)


def test_quant_config_fixtures(fixtures_dir):
    ct = parse_quant_config(json.loads((fixtures_dir / "compressed-tensors-w4a16-g128-asym" / "config.json")
                                       .read_text())["quantization_config"])
    assert (ct.format, ct.bits, ct.group_size, ct.sym) == ("ct", 4, 128, False)
    ck = open_checkpoint(fixtures_dir / "gptqmodel-gptq-v1-4bit-g128-sym")
    q = parse_quant_config(ck.quant_config)
    assert (q.format, q.bits, q.group_size, q.sym, q.desc_act) == ("gptq", 4, 128, True, False)
    assert [f.name for f in ck.files] == ["model.safetensors"]  # reference.safetensors is not part of the model


@pytest.mark.parametrize("expected", [0, 1500])
def test_writer_header_reservation_and_overflow(tmp_path, expected):
    """Many tensors: the reserved header space grows with the hint; without a hint the shard is rewritten
    once with an exact header. Both give a valid file holding every tensor."""
    names = [f"model.layers.{i}.mlp.gate_proj.qweight" for i in range(1500)]
    with atomic_output(tmp_path / "o") as tmp:
        w = ShardedWriter(tmp, expected_tensors=expected)
        for k, n in enumerate(names):
            w.add(n, torch.tensor([k], dtype=torch.int32))
        w.close()
    f = tmp_path / "o" / "model.safetensors"
    got = load_file(f)
    assert len(got) == 1500 and all(int(got[n]) == k for k, n in enumerate(names))
    header_len = struct.unpack("<Q", f.read_bytes()[:8])[0]
    assert header_len > HEADER_RESERVE and header_len % 8 == 0


def test_background_writer_same_bytes_and_errors(tmp_path):
    from qtool.io.writer import BackgroundWriter

    t = {f"t{i}": torch.arange(i * 10, i * 10 + 50, dtype=torch.int32) for i in range(20)}
    for name, cls in (("fg", lambda w: w), ("bg", BackgroundWriter)):
        with atomic_output(tmp_path / name) as tmp:
            w = cls(ShardedWriter(tmp, max_shard_size=1000))
            for k, v in t.items():
                w.add(k, v)
            w.close()
    a, b = ((tmp_path / n).glob("*.safetensors") for n in ("fg", "bg"))
    assert [p.read_bytes() for p in sorted(a)] == [p.read_bytes() for p in sorted(b)]
    # an error on the writer thread surfaces in the caller
    with atomic_output(tmp_path / "err") as tmp:
        w = BackgroundWriter(ShardedWriter(tmp))
        w.add("x", torch.zeros(2))
        w.add("x", torch.zeros(2))  # written twice
        with pytest.raises(OutputError, match="written twice"):
            w.close()


def test_background_writer_batches_and_callbacks_run_after_earlier_writes(tmp_path):
    """add_many writes like repeated add; after_written runs once everything queued before it is on file
    (the repack hands reusable buffers back this way), and still runs after a writer error."""
    from qtool.io.writer import BackgroundWriter

    t = {f"t{i}": torch.randint(-9, 9, (300,), dtype=torch.int32) for i in range(6)}
    seen = []
    with atomic_output(tmp_path / "one") as tmp:
        w = ShardedWriter(tmp)
        for k, v in t.items():
            w.add(k, v)
        w.close()
    with atomic_output(tmp_path / "many") as tmp:
        sw = ShardedWriter(tmp)
        w = BackgroundWriter(sw, depth=1)
        w.add_many(list(t.items())[:3])
        w.after_written(lambda: seen.append(sorted(sw._names)))
        w.add_many(list(t.items())[3:])
        w.close()
    assert seen == [["t0", "t1", "t2"]]
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "many" / "model.safetensors").read_bytes()
    ran = []
    with atomic_output(tmp_path / "err") as tmp:
        w = BackgroundWriter(ShardedWriter(tmp))
        w.add_many([("x", torch.zeros(2)), ("x", torch.zeros(2))])
        w.after_written(lambda: ran.append(1))
        with pytest.raises(OutputError, match="written twice"):
            w.close()
    assert ran == [1]


def test_background_writer_as_a_block_closes_or_aborts(tmp_path):
    """A block that ends closes the files (`files` lists them); one that raises, or whose close raises, stops
    the thread and aborts the shard in progress, and the error reaches the caller."""
    from qtool.io.writer import BackgroundWriter

    with atomic_output(tmp_path / "ok") as tmp, BackgroundWriter(ShardedWriter(tmp)) as w:
        w.add("x", torch.zeros(2))
    assert [f.name for f in w.files] == ["model.safetensors"] and not w._thread.is_alive()
    assert (tmp_path / "ok" / "model.safetensors").is_file()

    aborted = []
    for name, body in (("raises", lambda w: 1 / 0), ("close-raises", lambda w: w.add("x", torch.zeros(2)))):
        (tmp_path / name).mkdir()
        sw = ShardedWriter(tmp_path / name)
        sw.abort = lambda sw=sw, name=name: aborted.append(name) or ShardedWriter.abort(sw)
        with pytest.raises((ZeroDivisionError, OutputError)):
            with BackgroundWriter(sw) as w:
                w.add("x", torch.zeros(2))
                body(w)  # "close-raises": x twice, found when the block's end closes the files
        assert w.files is None and not w._thread.is_alive()
    assert aborted == ["raises", "close-raises"]


def test_fsync_only_when_replacing_unless_asked(tmp_path, monkeypatch):
    """A new destination is published without waiting for the disk; a replaced one (or sync=True) is
    fsynced before the swap, so the old output is never given up for one that is not on disk."""
    import qtool.io.writer as w

    synced = []
    monkeypatch.setattr(w, "_sync_tree", lambda root: synced.append(root.name))
    with atomic_output(tmp_path / "out") as tmp:
        (tmp / "f").write_text("1")
        save_file({"w": torch.zeros(1)}, tmp / "model.safetensors", metadata={"qtool.version": "0"})
    assert synced == []
    with atomic_output(tmp_path / "out", force=True) as tmp:
        (tmp / "f").write_text("2")
    assert len(synced) == 1 and (tmp_path / "out" / "f").read_text() == "2"
    with atomic_output(tmp_path / "new", sync=True) as tmp:
        (tmp / "f").write_text("3")
    assert len(synced) == 2


def test_writeback_hint_keeps_bytes(tmp_path):
    """The early-writeback hint (sync_file_range) changes when data reaches the disk, never what is written."""
    import qtool.io.writer as w

    t = {f"t{i}": torch.randint(-9, 9, (1 << 16,), dtype=torch.int32) for i in range(4)}
    kicked = []
    real = w.start_writeback
    for name, writeback in (("plain", False), ("kick", True)):
        with atomic_output(tmp_path / name) as tmp:
            sw = ShardedWriter(tmp, writeback=writeback)
            old = w._WRITEBACK_CHUNK
            w._WRITEBACK_CHUNK = 1 << 17
            w.start_writeback = lambda fd, off, n: (kicked.append((off, n)), real(fd, off, n))
            try:
                for k, v in t.items():
                    sw.add(k, v)
                sw.close()
            finally:
                w._WRITEBACK_CHUNK, w.start_writeback = old, real
    assert kicked and all(n >= 1 << 17 for _, n in kicked)
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (tmp_path / "kick" / "model.safetensors").read_bytes()


def test_mapped_read_equals_read_and_checks_the_file(tmp_path):
    """mapped=True gives the same tensor as a positioned read, writing to it leaves the file alone, and a
    truncated file is an InputError, not a crash."""
    _MAP_MIN = 1 << 20  # large tensors: the size a map would have been used for

    g = torch.Generator().manual_seed(3)
    big = torch.randint(-2**31, 2**31 - 1, (_MAP_MIN // 4 + 37,), dtype=torch.int32, generator=g)
    save_file({"a": torch.ones(3, dtype=torch.int8), "big": big, "h": torch.randn(700_000, generator=g).half()},
              tmp_path / "m.safetensors")
    before = (tmp_path / "m.safetensors").read_bytes()
    ck = open_checkpoint(tmp_path / "m.safetensors")
    for name in ("big", "h", "a"):
        a, b = ck.get(name), ck.get(name, mapped=True)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                         b.view(-1).view(torch.uint8))
    m = ck.get("big", mapped=True)
    m.fill_(7)
    del m
    assert (tmp_path / "m.safetensors").read_bytes() == before
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(before[: len(before) - 100])
    info = open_checkpoint(tmp_path / "m.safetensors").tensors["h"]
    import dataclasses

    from qtool.io.checkpoint import read_tensor
    with pytest.raises(InputError, match="truncated"):
        read_tensor(dataclasses.replace(info, file=cut), mapped=True)


def test_tensors_copied_in_the_kernel_or_not_give_the_same_file(tmp_path, monkeypatch):
    """add_raw copies a source tensor with copy_file_range(2) where it can, else by reads and writes; both give
    the bytes a plain writer gives, between tensors written by add, and a source cut short is an InputError."""
    import os

    g = torch.Generator().manual_seed(1)
    src = {"big": torch.randint(-9, 9, (5 << 20,), dtype=torch.int8, generator=g), "small": torch.randn(10, generator=g),
           "big2": torch.randn(1 << 20, generator=g)}
    save_file(src, tmp_path / "src.safetensors")
    ck = open_checkpoint(tmp_path / "src.safetensors")
    outs = {}
    for name in ("kernel", "read"):
        if name == "read":
            monkeypatch.delattr(os, "copy_file_range", raising=False)
        with atomic_output(tmp_path / name) as tmp:
            sw = ShardedWriter(tmp)
            sw.add("first", torch.randn(7, generator=torch.Generator().manual_seed(2)).half())
            for k in src:
                sw.add_raw(k, ck.tensors[k])
            sw.add("last", torch.arange(5))
            sw.close()
        monkeypatch.undo()
        outs[name] = (tmp_path / name / "model.safetensors").read_bytes()
    assert outs["kernel"] == outs["read"]
    got = load_file(tmp_path / "kernel" / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in src.items()) and torch.equal(got["last"], torch.arange(5))
    info = ck.tensors["big2"]
    with open(tmp_path / "src.safetensors", "r+b") as f:
        f.truncate(info.start + 100)
    with atomic_output(tmp_path / "cut") as tmp, pytest.raises(InputError, match="file ends after 100 of"):
        ShardedWriter(tmp).add_raw("big2", info)
