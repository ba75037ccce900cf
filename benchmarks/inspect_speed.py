"""Header-only `qtool inspect` speed on synthetic files of real model shapes (issue: <= 0.2 s for a 7B GGUF,
<= 1 s for a sharded 70B safetensors directory).

Both files are sparse: headers are written, then the file is extended with `truncate` to its full size, so
no disk space is used for tensor data and nothing but the header is ever read.

- 7B GGUF (llama-2-7b shapes, Q4_K_M-like type mix): 291 tensors, metadata with a 32000-entry
  tokenizer.ggml.tokens string array plus scores (f32) and token_type (i32) arrays.
- 70B sharded safetensors (llama-2-70b shapes, GPTQ 4-bit g128): 80 layers x 7 modules x (qweight, qzeros,
  scales, g_idx) + norms + embeddings + lm_head, split into 30 shards with an index and a config.json.

    .venv/bin/python benchmarks/inspect_speed.py [--dir /tmp/qtool-bench] [--repeat 7] [--compare-gguf]

Prints a Markdown block (what benchmarks/results/inspect.md records).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# --- 7B GGUF -------------------------------------------------------------------------------------------

def _s(b: bytearray, text: str) -> None:
    raw = text.encode()
    b += struct.pack("<Q", len(raw)) + raw


def _kv(b: bytearray, key: str, vtype: int, value) -> None:
    _s(b, key)
    b += struct.pack("<I", vtype)
    if vtype == 8:
        _s(b, value)
    elif vtype == 4:
        b += struct.pack("<I", value)
    elif vtype == 6:
        b += struct.pack("<f", value)
    elif vtype == 9:
        itype, items = value
        b += struct.pack("<IQ", itype, len(items))
        if itype == 8:
            for it in items:
                _s(b, it)
        elif itype == 6:
            b += struct.pack(f"<{len(items)}f", *items)
        elif itype == 5:
            b += struct.pack(f"<{len(items)}i", *items)


def make_gguf_7b(path: Path) -> int:
    """Write a llama-2-7b-shaped GGUF header, extend the file sparsely to full size; returns the size."""
    from qtool.io.gguf_reader import qtype_block

    Q4_K, Q6_K, F32 = 12, 14, 0
    d, ff, nl, vocab = 4096, 11008, 32, 32000
    tensors = [("token_embd.weight", (d, vocab), Q4_K)]
    for i in range(nl):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (d,), F32), (p + "attn_q.weight", (d, d), Q4_K),
                    (p + "attn_k.weight", (d, d), Q4_K), (p + "attn_v.weight", (d, d), Q6_K),
                    (p + "attn_output.weight", (d, d), Q4_K), (p + "ffn_gate.weight", (d, ff), Q4_K),
                    (p + "ffn_down.weight", (ff, d), Q6_K), (p + "ffn_up.weight", (d, ff), Q4_K),
                    (p + "ffn_norm.weight", (d,), F32)]
    tensors += [("output_norm.weight", (d,), F32), ("output.weight", (d, vocab), Q6_K)]
    assert len(tensors) == 291
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581tok{i}" for i in range(vocab - len(tokens))]
    kvs = [("general.architecture", 8, "llama"), ("general.name", 8, "synthetic-7b"),
           ("llama.context_length", 4, 4096), ("llama.embedding_length", 4, d), ("llama.block_count", 4, nl),
           ("llama.feed_forward_length", 4, ff), ("llama.rope.dimension_count", 4, 128),
           ("llama.attention.head_count", 4, 32), ("llama.attention.head_count_kv", 4, 32),
           ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5), ("general.file_type", 4, 15),
           ("tokenizer.ggml.model", 8, "llama"), ("tokenizer.ggml.tokens", 9, (8, tokens)),
           ("tokenizer.ggml.scores", 9, (6, [float(-i) for i in range(vocab)])),
           ("tokenizer.ggml.token_type", 9, (5, [1] * vocab)), ("tokenizer.ggml.bos_token_id", 4, 1),
           ("tokenizer.ggml.eos_token_id", 4, 2), ("general.quantization_version", 4, 2)]
    b = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for k, t, v in kvs:
        _kv(b, k, t, v)
    off = 0
    for name, shape, typ in tensors:
        _s(b, name)
        b += struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack("<IQ", typ, off)
        n = 1
        for x in shape:
            n *= x
        blk = qtype_block(typ)
        off += -(-(n // blk[0] * blk[1]) // 32) * 32
    data_start = -(-len(b) // 32) * 32
    b += bytes(data_start - len(b))
    path.write_bytes(bytes(b))
    os.truncate(path, data_start + off)
    return data_start + off


# --- 70B sharded safetensors ---------------------------------------------------------------------------

def make_safetensors_70b(root: Path, shards: int = 30) -> int:
    """llama-2-70b shapes, GPTQ 4-bit g128, 30 sparse shards + index + config; returns total bytes."""
    d, ff, nl, vocab, kv = 8192, 28672, 80, 32000, 1024
    G, b = 128, 4

    def gptq(prefix: str, i: int, o: int) -> list:
        return [(prefix + ".qweight", "I32", [i * b // 32, o]), (prefix + ".qzeros", "I32", [i // G, o * b // 32]),
                (prefix + ".scales", "F16", [i // G, o]), (prefix + ".g_idx", "I32", [i])]

    tensors = [("model.embed_tokens.weight", "F16", [vocab, d])]
    for layer in range(nl):
        p = f"model.layers.{layer}."
        for name, i, o in (("self_attn.q_proj", d, d), ("self_attn.k_proj", d, kv), ("self_attn.v_proj", d, kv),
                           ("self_attn.o_proj", d, d), ("mlp.gate_proj", d, ff), ("mlp.up_proj", d, ff),
                           ("mlp.down_proj", ff, d)):
            tensors += gptq(p + name, i, o)
        tensors += [(p + "input_layernorm.weight", "F16", [d]), (p + "post_attention_layernorm.weight", "F16", [d])]
    tensors += [("model.norm.weight", "F16", [d]), ("lm_head.weight", "F16", [vocab, d])]
    size_of = {"I32": 4, "F16": 2}
    per = -(-len(tensors) // shards)
    root.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for s in range(shards):
        part = tensors[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, dt, shape in part:
            n = size_of[dt]
            for x in shape:
                n *= x
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f = root / fname
        f.write_bytes(struct.pack("<Q", len(raw)) + raw)
        os.truncate(f, 8 + len(raw) + off)
        total += off
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": d, "num_hidden_layers": nl,
        "quantization_config": {"quant_method": "gptq", "bits": b, "group_size": G, "desc_act": False,
                                "sym": True, "checkpoint_format": "gptq"}}))
    return total


# --- timing ---------------------------------------------------------------------------------------------

def time_inproc(path: Path, repeat: int) -> tuple[float, float, float, object]:
    """(median wall, best wall, median CPU seconds, report). CPU time is reported too because a shared
    machine's wall clock includes other processes' time slices."""
    from qtool.inspect import inspect_path

    report = inspect_path(path)  # warm (imports, page cache)
    times, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        report = inspect_path(path)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(times), min(times), statistics.median(cpu), report


def time_cli(path: Path, repeat: int, args: tuple[str, ...] = ("inspect",)) -> tuple[float, float]:
    """(median wall, median user+sys CPU) of a whole `qtool ...` process."""
    import resource

    exe = REPO / ".venv" / "bin" / "qtool"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "qtool"]
    cmd = base + list(args) + ([str(path), "--json"] if path else ["--help"])
    times, cpu = [], []
    for _ in range(repeat):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return statistics.median(times), statistics.median(cpu)


def time_gguf_reader(path: Path) -> float:
    from gguf import GGUFReader

    t = time.perf_counter()
    GGUFReader(str(path))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qtool-bench-inspect"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--compare-gguf", action="store_true", help="also time gguf.GGUFReader on the 7B header")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    g = a.dir / "synthetic-7b-Q4_K_M.gguf"
    gsize = make_gguf_7b(g)
    st = a.dir / "synthetic-70b-gptq"
    ssize = make_safetensors_70b(st)
    rows = []
    med, best, cpu, rep = time_inproc(g, a.repeat)
    rows.append(("7B GGUF (291 tensors, 32000-entry vocab)", gsize, rep.tensor_count, med, best, cpu,
                 *time_cli(g, 5)))
    med2, best2, cpu2, rep2 = time_inproc(st, a.repeat)
    rows.append((f"70B GPTQ safetensors ({len(rep2.files)} shards)", ssize, rep2.tensor_count, med2, best2, cpu2,
                 *time_cli(st, 5)))
    help_wall, help_cpu = time_cli(None, 5, ())
    print(f"- date: {date.today()}; machine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}; "
          f"python {platform.python_version()}")
    print(f"- command: `.venv/bin/python benchmarks/inspect_speed.py --repeat {a.repeat}"
          f"{' --compare-gguf' if a.compare_gguf else ''}`\n")
    print("| file | size | tensors | `inspect_path` wall median (best) | CPU median | "
          "`qtool inspect --json` process wall | process CPU |")
    print("|---|---|---|---|---|---|---|")
    for name, size, n, m, b_, c, pw, pc in rows:
        print(f"| {name} | {size / 2**30:.1f} GiB (sparse) | {n} | {m * 1000:.1f} ms ({b_ * 1000:.1f} ms) | "
              f"{c * 1000:.1f} ms | {pw * 1000:.0f} ms | {pc * 1000:.0f} ms |")
    print(f"\nBaseline `qtool --help` process: wall {help_wall * 1000:.0f} ms, CPU {help_cpu * 1000:.0f} ms "
          "(interpreter + Typer start-up, common to every command).")
    print(f"\nDetected: GGUF format {rep.format}, {len(rep.modules)} modules, bpw {rep.bpw:.3f}; "
          f"safetensors format {rep2.format}, {len(rep2.modules)} modules, bpw {rep2.bpw:.3f}; "
          f"anomalies {len(rep.anomalies)} / {len(rep2.anomalies)}")
    if a.compare_gguf:
        print(f"\ngguf.GGUFReader on the same 7B file: {time_gguf_reader(g) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
