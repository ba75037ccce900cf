"""`qtool validate --checks integrity,hashes` read throughput against `cat` of the same files, and its peak
memory (issue 23, item 3: >= 1 GB/s, or within 1.5x of cat).

Builds a synthetic GPTQ 4-bit g128 symmetric checkpoint with Llama-3-70B linear shapes (hidden 8192, MLP
28672, 8 KV heads of 128: q/k/v/o/gate/up/down per layer, random codes, fp16 scales, v1 qzeros 0x77777777,
trivial g_idx, two RMSNorm weights; ~0.44 GB per layer, two layers per shard, an index and a GPTQ config),
then alternates

    cat:      `cat SHARDS > /dev/null`
    validate: `qtool validate DIR --checks integrity,hashes --json` in a subprocess (peak RSS from wait4)

and reports medians and their ratio. The page cache is not dropped (that needs root); each timed step is
preceded by nothing, so both read whatever the previous step left cached: with a checkpoint larger than the
page cache, both read mostly from disk. The files are deleted at the end unless --keep.

    .venv/bin/python benchmarks/validate_throughput.py [--dir /tmp/qtool-validate-bench] [--layers 36]
                                                       [--repeat 2] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTER, KV = 8192, 28672, 1024
MODULES = {  # name: (out_features N, in_features K)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
BITS, GROUP, LAYERS_PER_SHARD = 4, 128, 2


def build(dest: Path, layers: int) -> int:
    """Write the checkpoint; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    n_shards = -(-layers // LAYERS_PER_SHARD)
    weight_map, total = {}, 0
    for s in range(n_shards):
        tensors = {}
        for layer in range(s * LAYERS_PER_SHARD, min(layers, (s + 1) * LAYERS_PER_SHARD)):
            pre = f"model.layers.{layer}."
            for mod, (n, k) in MODULES.items():
                tensors[f"{pre}{mod}.qweight"] = torch.randint(-2**31, 2**31 - 1, (k * BITS // 32, n),
                                                               dtype=torch.int32, generator=gen)
                tensors[f"{pre}{mod}.qzeros"] = torch.full((k // GROUP, n * BITS // 32), 0x77777777,
                                                           dtype=torch.int32)
                tensors[f"{pre}{mod}.scales"] = (torch.rand(k // GROUP, n, generator=gen) / 100 + 1e-3).half()
                tensors[f"{pre}{mod}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
            tensors[f"{pre}input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
            tensors[f"{pre}post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, dest / name, metadata={"format": "pt"})
        for t in tensors:
            weight_map[t] = name
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    qc = {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "sym": True, "desc_act": False,
          "checkpoint_format": "gptq"}
    (dest / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN,
                                                  "intermediate_size": INTER, "num_hidden_layers": layers,
                                                  "torch_dtype": "float16", "quantization_config": qc}))
    return total


def timed(cmd: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit status) of a subprocess; its CPU seconds in timed.last_cpu."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out_chunks = []
    while True:
        chunk = p.stdout.read(1 << 16)
        if not chunk:
            break
        out_chunks.append(chunk)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    timed.last_stdout = b"".join(out_chunks)
    timed.last_cpu = usage.ru_utime + usage.ru_stime
    return wall, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qtool-validate-bench"))
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    qtool = str(Path(sys.executable).with_name("qtool"))
    t0 = time.perf_counter()
    total = build(a.dir, a.layers)
    build_s = time.perf_counter() - t0
    shards = sorted(str(p) for p in a.dir.glob("*.safetensors"))
    file_bytes = sum(os.path.getsize(s) for s in shards)
    print(f"built {a.layers} layers: {file_bytes / 1e9:.2f} GB in {len(shards)} shards ({build_s:.0f} s)", flush=True)
    runs = {"cat": [], "validate": []}
    cpu = {"cat": [], "validate": []}
    rss, summary = [], None
    try:
        for r in range(a.repeat):
            w, _, code = timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *shards])
            assert code == 0
            runs["cat"].append(w)
            cpu["cat"].append(timed.last_cpu)
            w, peak, code = timed([qtool, "validate", str(a.dir), "--checks", "integrity,hashes", "--json"])
            summary = json.loads(timed.last_stdout)["summary"]
            if code != 0:
                raise SystemExit(f"validate exited {code}: {summary}")
            runs["validate"].append(w)
            cpu["validate"].append(timed.last_cpu)
            rss.append(peak)
            print(f"run {r + 1}: cat {runs['cat'][-1]:.1f} s, validate {w:.1f} s, peak RSS {peak / 2**30:.2f} GiB",
                  flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "command": "benchmarks/validate_throughput.py " + " ".join(sys.argv[1:]),
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs, "
                                                    f"{platform.system()} {platform.release()}",
        "load_avg_1m_at_end": os.getloadavg()[0],
        "layers": a.layers, "shards": len(shards), "file_bytes": file_bytes, "tensor_bytes": total,
        "runs_s": runs, "median_s": med, "cpu_s": cpu,
        "gb_per_s": {k: file_bytes / v / 1e9 for k, v in med.items()},
        "ratio_validate_over_cat": med["validate"] / med["cat"],
        "peak_rss_bytes": max(rss), "validate_summary": summary,
    }
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
