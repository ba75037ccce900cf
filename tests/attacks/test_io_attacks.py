"""Attacks on qtool's inputs and outputs, run as real processes (fresh interpreters under the 4 GiB
address-space cap of tests/attacks/runner.py): issue 22 items 7-9 and 13, issue 27 items 1-6, names over
the system's limits and a full disk while writing a GGUF target.

Every refusal is exit 2 with one line on stderr and no traceback; inputs stay byte-identical and no
temporary `.qtool-tmp-*` entry is left beside the destination. Runs that must be caught mid-write use
QTOOL_TEST_WRITE_DELAY (the writer sleeps before each tensor) and wait for the first shard file to appear in
the temporary output before acting.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.attacks.generate_corpus import (
    GPTQ_CONFIG,
    T_F32,
    T_Q4_0,
    _config,
    _dense_tensors,
    _gptq_tensors,
    _save,
    gguf_bytes,
    gstr,
    kv_str,
    kv_u32,
    q4_0_rows,
    tensor_info,
    u32,
)
from tests.attacks.runner import REPO, Result, child_env, limit_memory, run_batch, run_qtool

TMP = ".qtool-tmp-"
DELAY = "0.4"  # seconds the writer sleeps per tensor in the runs that are caught mid-write


# --- inputs ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """dense/ (with a tokenizer.json), sharded/ (two shards and an index), gptq/, split GGUF, an earlier
    qtool output (prior/)."""
    root = tmp_path_factory.mktemp("io")
    dense = _dense_tensors()
    _save(dense, root / "dense" / "model.safetensors")
    _config(root / "dense")
    (root / "dense" / "tokenizer.json").write_text('{"model": {}}\n')
    names = sorted(dense)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        _save({k: dense[k] for k in keys}, root / "sharded" / shard)
    (root / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    _config(root / "sharded")
    _save(_gptq_tensors(), root / "gptq" / "model.safetensors")
    _config(root / "gptq", GPTQ_CONFIG)
    _split_gguf(root / "split")
    r = run_qtool(["pack", root / "dense", "--group-size", "32", "-q", "-o", root / "prior"])
    assert r.rc == 0, r.stderr
    return root


def _split_gguf(d: Path) -> None:
    """A valid GGUF split in two: blk.0.attn_q in the first file, blk.0.ffn_up and the norm in the second."""
    d.mkdir()
    kvs = [kv_str("general.architecture", "llama"), kv_u32("general.alignment", 32),
           kv_u32("general.file_type", 2), kv_u32("general.quantization_version", 2), kv_u32("llama.block_count", 1)]

    def split(no: int) -> list[bytes]:
        return [gstr("split.no") + u32(2) + struct.pack("<H", no), gstr("split.count") + u32(2) + struct.pack("<H", 2)]

    a, b = q4_0_rows(32, 64, 1), q4_0_rows(32, 64, 2)
    (d / "m-00001-of-00002.gguf").write_bytes(
        gguf_bytes(kvs + split(0), [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0)], a))
    off = len(b) + (-len(b) % 32)
    (d / "m-00002-of-00002.gguf").write_bytes(
        gguf_bytes(split(1), [tensor_info("blk.0.ffn_up.weight", (64, 32), T_Q4_0, 0),
                              tensor_info("output_norm.weight", (64,), T_F32, off)],
                   b + b"\0" * (off - len(b)) + struct.pack("<64f", *([1.0] * 64))))


def digest(path: Path) -> dict[str, str]:
    """{relative name: sha256 or link target} of a file or a tree, links not followed."""
    if path.is_file() and not path.is_symlink():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = ("-> " + os.readlink(p)) if p.is_symlink() else \
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(TMP))


def one_line(r: Result, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.rc == 2, (r.argv, r.rc, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("qtool: error: "), (r.argv, r.stderr)
    assert "Traceback" not in r.stderr and all(n in lines[0] for n in needles), (r.argv, needles, lines[0])
    return lines[0]


def pack(src: Path, dest: Path, *extra: str) -> list[str]:
    return ["pack", str(src), "--group-size", "32", "-q", "-o", str(dest), *extra]


# --- processes caught mid-write ------------------------------------------------------------------------

def start(argv: list[str], delay: str = DELAY, preexec=limit_memory) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qtool", *map(str, argv)], cwd=REPO,
                            env=child_env({"QTOOL_TEST_WRITE_DELAY": delay}), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec)


def wait_writing(p: subprocess.Popen, parent: Path, timeout: float = 120) -> Path:
    """The temporary output of `p` once its first shard file exists (the write has begun)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        for d in parent.glob(f"{TMP}{p.pid}-*"):
            if any(d.glob("*.part")):
                return d
        time.sleep(0.01)
    raise AssertionError(f"no temporary output of {p.pid} appeared (exit {p.poll()})")


def finish(p: subprocess.Popen, argv: list[str]) -> Result:
    out, err = p.communicate(timeout=300)
    return Result(argv, p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), 0.0, 0.0)


# --- 22.7: publishing refuses an existing destination atomically --------------------------------------------

def test_two_runs_to_one_new_destination(inputs, tmp_path):
    """Both runs find no destination when they start; exactly one publishes, the other exits 2 and leaves
    the winner's output as it is and nothing of its own."""
    dest = tmp_path / "out"
    argv = pack(inputs / "dense", dest)
    procs = [start(argv) for _ in range(2)]
    results = [finish(p, argv) for p in procs]
    assert sorted(r.rc for r in results) == [0, 2], [(r.rc, r.stderr) for r in results]
    one_line(next(r for r in results if r.rc == 2), str(dest), "appeared while qtool was writing")
    assert (dest / "model.safetensors").is_file() and (dest / "report.json").is_file()
    assert not leftovers(tmp_path)


def test_destination_appearing_mid_run_is_left_alone(inputs, tmp_path):
    dest = tmp_path / "out"
    argv = pack(inputs / "dense", dest)
    p = start(argv)
    wait_writing(p, tmp_path)
    dest.mkdir()
    (dest / "mine.txt").write_text("the user's")
    r = finish(p, argv)
    one_line(r, str(dest), "appeared while qtool was writing")
    assert digest(dest) == {"mine.txt": hashlib.sha256(b"the user's").hexdigest()} and not leftovers(tmp_path)


# --- 22.8: SIGTERM and SIGHUP are handled as SIGINT ---------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_signal_mid_write_removes_the_temporary_output(inputs, tmp_path, sig):
    dest = tmp_path / "out"
    argv = pack(inputs / "dense", dest)
    p = start(argv)
    wait_writing(p, tmp_path)
    p.send_signal(sig)
    r = finish(p, argv)
    assert r.rc == 128 + sig, (r.rc, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qtool: error: ") and "Traceback" not in r.stderr, r.stderr
    assert not dest.exists() and not leftovers(tmp_path)


# --- 22.9: a source truncated during repack ---------------------------------------------------------------

def _big_gptq(root: Path, modules: int = 8, o: int = 2048, i: int = 4096) -> Path:
    """GPTQ 4-bit g128 modules with 4 MB qweights (random codes: only their size matters here)."""
    import torch

    g = torch.Generator().manual_seed(0)
    t = {}
    for k in range(modules):
        pre = f"model.layers.{k}.mlp.up_proj"
        t[f"{pre}.qweight"] = torch.randint(-(1 << 31), 1 << 31, (i // 8, o), generator=g, dtype=torch.int64) \
            .to(torch.int32)
        t[f"{pre}.qzeros"] = torch.full((i // 128, o // 8), 0x77777777, dtype=torch.int32)
        t[f"{pre}.scales"] = torch.full((i // 128, o), 0.01, dtype=torch.float16)
        t[f"{pre}.g_idx"] = torch.arange(i, dtype=torch.int32) // 128
    _save(t, root / "model.safetensors")
    _config(root, {**GPTQ_CONFIG, "group_size": 128})
    return root


def test_source_truncated_during_repack(tmp_path):
    """The source shrinks to nothing at a random moment of the write: a one-line error naming the file
    (never a SIGBUS), nothing left behind; a run the truncation came too late for is complete."""
    master = _big_gptq(tmp_path / "master")
    rng = random.Random(int(os.environ.get("QTOOL_ATOMICITY_SEED", "0")) or None)
    errors = 0
    for k in range(3):
        src = tmp_path / f"src{k}"
        shutil.copytree(master, src)
        dest = tmp_path / f"out{k}"
        argv = ["repack", str(src), "--to", "marlin", "-q", "-o", str(dest)]
        # 10 ms before each tensor: the write of its 32 tensors spans over 0.3 s (0.7-1.0 s measured), so a moment
        # drawn from its first 0.2 s falls inside it on any machine; without the delay a fast run was over first
        p = start(argv, delay="0.01")
        while p.poll() is None and not any(tmp_path.glob(f"{TMP}{p.pid}-*")):
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.2))
        os.truncate(src / "model.safetensors", 0)
        r = finish(p, argv)
        assert r.rc in (0, 2), (k, r.rc, r.stderr)  # -7 is SIGBUS
        if r.rc == 2:
            errors += 1
            one_line(r, str(src / "model.safetensors"), "file ends after")
            assert not dest.exists()
        else:
            assert (dest / "model.safetensors").is_file()
        assert not leftovers(tmp_path), (k, leftovers(tmp_path))
        shutil.rmtree(src)
    assert errors, "the truncation never landed during the run: the test did not test anything"


# --- 27.1, 27.2: the destination is, holds or lies in any file the source resolves to ------------------------

def test_destination_overlapping_any_input_is_refused(inputs, tmp_path):
    """An index shard, the index itself, a split GGUF member, and a directory holding a shard's link target,
    each as -o with --force: refused naming the overlap; every input byte-identical."""
    s = inputs / "sharded"
    linked = tmp_path / "linked"  # a shard that is a link into the destination
    linked.mkdir()
    for f in s.iterdir():
        shutil.copy2(f, linked / f.name)
    target = tmp_path / "victim"
    target.mkdir()
    shard2 = "model-00002-of-00002.safetensors"
    (linked / shard2).rename(target / shard2)
    (linked / shard2).symlink_to(target / shard2)
    split = inputs / "split"
    runs = [
        (pack(s, s / shard2, "--force"), s),
        (pack(s, s / "model.safetensors.index.json", "--force"), s),
        (pack(s / "model.safetensors.index.json", s / shard2, "--force"), s),
        (["repack", split / "m-00001-of-00002.gguf", "--to", "gptq_v2", "-q", "-o", split / "m-00002-of-00002.gguf",
          "--force"], split),
        (pack(linked, target, "--force"), target),
    ]
    before = {str(root): digest(root) for _, root in runs} | {str(linked): digest(linked)}
    for r in run_batch([a for a, _ in runs], timeout=60):
        one_line(r, "overlaps")
    after = {str(root): digest(root) for _, root in runs} | {str(linked): digest(linked)}
    assert after == before
    # the split set is a valid source: the refusal is about the destination, not the input
    ok = run_qtool(["repack", split / "m-00001-of-00002.gguf", "--to", "gptq_v2", "-q", "-o", tmp_path / "ok"])
    assert ok.rc == 0, ok.stderr


# --- 27.3, 27.4: what --force may replace --------------------------------------------------------------------

def test_force_replaces_only_what_qtool_could_have_written(inputs, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    (tmp_path / "elsewhere").mkdir()
    link.symlink_to(tmp_path / "elsewhere")
    populated = tmp_path / "home"
    (populated / "docs").mkdir(parents=True)
    (populated / "notes.txt").write_text("keep me")
    (populated / "docs" / "a.txt").write_text("and me")
    flat = tmp_path / "flat"  # no sub-directory, but no qtool output either
    flat.mkdir()
    (flat / "model.safetensors").write_bytes((inputs / "dense" / "model.safetensors").read_bytes())
    (flat / "thesis.tex").write_text("years of work")
    plain_file = tmp_path / "notes.txt"
    plain_file.write_text("not a GGUF file")
    refused = [fifo, link, populated, flat, plain_file]
    if _mknod(tmp_path / "null"):
        refused.append(tmp_path / "null")
    prior = tmp_path / "prior"
    shutil.copytree(inputs / "prior", prior)
    empty = tmp_path / "empty"
    empty.mkdir()
    before = {str(p): (os.lstat(p).st_mode, digest(p) if not stat.S_ISFIFO(os.lstat(p).st_mode)
                       and not stat.S_ISCHR(os.lstat(p).st_mode) else None) for p in refused}
    results = run_batch([pack(inputs / "dense", d, "--force") for d in [*refused, prior, empty]], timeout=60)
    for d, r in zip(refused, results, strict=False):
        one_line(r, str(d), "--force replaces only")
    after = {str(p): (os.lstat(p).st_mode, digest(p) if not stat.S_ISFIFO(os.lstat(p).st_mode)
                      and not stat.S_ISCHR(os.lstat(p).st_mode) else None) for p in refused}
    assert after == before
    for d, r in zip([prior, empty], results[len(refused):], strict=True):
        assert r.rc == 0, (d, r.stderr)
        assert json.loads((d / "report.json").read_text())["out"] == str(d)
    assert not leftovers(tmp_path)


def _mknod(path: Path) -> bool:
    """A private character device 1:3 (what /dev/null is), where this process may create one."""
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        return True
    except (PermissionError, OSError):
        return False


# --- 27.5, 27.6: links out of the source, file contents in messages ----------------------------------------

def test_no_link_is_followed_out_of_the_source(inputs, tmp_path):
    secret = tmp_path / "outside" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    src = tmp_path / "src"
    shutil.copytree(inputs / "dense", src)
    (src / "id_ed25519").symlink_to(secret)
    (src / "tokenizer_alias.json").symlink_to("tokenizer.json")  # inside the tree: copied as a link
    (src / "original").mkdir()
    (src / "original" / "notes.txt").write_text("kept")
    (src / "original" / "key").symlink_to(secret)
    dest = tmp_path / "out"
    r = run_qtool(["pack", src, "--group-size", "32", "-o", dest])
    assert r.rc == 0, r.stderr
    assert not (dest / "id_ed25519").exists() and not (dest / "id_ed25519").is_symlink()
    assert all("PRIVATE KEY" not in p.read_text(errors="replace") for p in dest.iterdir() if p.is_file())
    assert (dest / "tokenizer_alias.json").is_symlink() and os.readlink(dest / "tokenizer_alias.json") == "tokenizer.json"
    assert (dest / "tokenizer.json").read_text() == '{"model": {}}\n'
    warnings = json.loads((dest / "report.json").read_text())["warnings"]
    assert any(w.startswith("id_ed25519: not copied: a symbolic link") for w in warnings), warnings
    assert (dest / "original" / "notes.txt").read_text() == "kept"  # sub-directories are carried over
    assert not (dest / "original" / "key").exists() and not (dest / "original" / "key").is_symlink()
    assert any(w.startswith("original/key: not copied: a symbolic link") for w in warnings), warnings
    assert "id_ed25519: not copied" in r.stdout and "original/key" in r.stdout


def test_error_messages_never_print_file_contents(inputs, tmp_path):
    """A shard linked to a passwd-like file: the refusal names the shard and what is wrong, not its bytes
    (neither as text nor as the number its first 8 bytes make); the same for a GGUF split member."""
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    src = tmp_path / "src"
    shutil.copytree(inputs / "sharded", src)
    shard = src / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(passwd)
    gg = tmp_path / "gg"
    shutil.copytree(inputs / "split", gg)
    (gg / "m-00002-of-00002.gguf").unlink()
    (gg / "m-00002-of-00002.gguf").symlink_to(passwd)
    number = str(struct.unpack("<Q", b"root:x:0")[0])
    results = run_batch([pack(src, tmp_path / "o1"), ["inspect", src], ["inspect", gg / "m-00001-of-00002.gguf"],
                         ["repack", gg / "m-00001-of-00002.gguf", "--to", "gptq_v2", "-o", tmp_path / "o2"]])
    for r in results:
        text = r.stdout + r.stderr  # inspect reports the problem in its table instead of refusing
        assert r.rc in (0, 2) and "Traceback" not in text, (r.argv, r.rc, r.stderr)
        assert number not in text and "root:x" not in text and "b'root'" not in text, (r.argv, text)
    one_line(results[0], str(src), "not a safetensors file (bad header length")
    one_line(results[3], "bad magic")


# --- names over the system's limits --------------------------------------------------------------------------

def test_names_over_the_limits_are_one_line_refusals(inputs, tmp_path):
    long_name = "n" * 300
    deep = "/".join(["d" * 200] * 21)  # 4220 bytes
    cfg = tmp_path / "job.yaml"
    cfg.write_text("group_size: 32\n")
    runs = [
        pack(tmp_path / long_name, tmp_path / "o1"),
        pack(inputs / "dense", tmp_path / long_name),
        pack(inputs / "dense", tmp_path / "o2") + ["--config", str(tmp_path / long_name)],
        pack(tmp_path / deep, tmp_path / "o3"),
        pack(inputs / "dense", tmp_path / deep),
        ["inspect", tmp_path / long_name],
        ["repack", inputs / "gptq", "--to", "gptq_v2", "-o", tmp_path / long_name],
    ]
    for r in run_batch(runs, timeout=60):
        one_line(r, "limit")
        assert len(r.stderr) < 400, r.stderr
    # the longest name a filesystem takes is a fine destination: the temporary name beside it fits too
    fits = tmp_path / ("m" * 250)
    r = run_qtool(pack(inputs / "dense", fits))
    assert r.rc == 0 and (fits / "model.safetensors").is_file(), r.stderr
    assert not leftovers(tmp_path)


# --- 22.13: missing parents of -o ----------------------------------------------------------------------------

def test_missing_parent_directories_are_created(inputs, tmp_path):
    dest = tmp_path / "out" / "sub" / "model"
    gguf = tmp_path / "gg" / "q" / "model.gguf"
    a, b = run_batch([pack(inputs / "dense", dest),
                      ["repack", inputs / "gptq", "--to", "q4_0", "-q", "-o", gguf]], timeout=60)
    assert a.rc == 0 and (dest / "model.safetensors").is_file(), a.stderr
    assert b.rc == 0 and gguf.read_bytes()[:4] == b"GGUF", b.stderr


# --- a full disk while writing a GGUF target ---------------------------------------------------------------

def _file_size_limit(nbytes: int):
    def hook() -> None:
        limit_memory()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return hook


def test_full_disk_writing_a_gguf_target(inputs, tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (the write fails with EFBIG as it would with ENOSPC): one line
    naming the output and the space it needs, nothing left behind."""
    dest = tmp_path / "model.gguf"
    r = run_qtool(["repack", inputs / "gptq", "--to", "q4_0", "-q", "-o", dest], preexec=_file_size_limit(4096))
    one_line(r, str(dest), "cannot write the output", "needed")
    assert not dest.exists() and not leftovers(tmp_path)
