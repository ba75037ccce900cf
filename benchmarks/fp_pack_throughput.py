"""`pack --to fp8` throughput: MB/s of bf16 input over whole layers of Llama-3-8B's shapes.

The checkpoint is LAYERS decoder layers of Llama-3-8B (q/k/v/o 4096x4096 and 1024x4096, gate/up 14336x4096,
down 4096x14336, bf16, plus the norms): seven weights of five shapes a layer, 436 MB of bf16 each. Two numbers
per thread count: the quantizer alone on the layer's largest weight (qtool.quant.scaled.quantize_scaled with
its in-pass error sums, 128x128 blocks, fp32 scales, codes into a reused buffer, the C++ loops on one thread
fewer than torch's count as pack runs them) and the whole `pack --to fp8` (run_pack: read, quantize, error,
write, report; Python start-up and the torch import excluded). Each also in CPU seconds per GB of bf16 input
(user + system time of this process, every thread), which depends little on how busy the machine is; the load
average is recorded before and after each run: on a shared 2-core VM it decides the wall-clock numbers more
than the code does. The source is read once before timing (it is in the page cache, as a model just
downloaded or converted is); the outputs go to --dir and are deleted.

    flock /work/cpu.lock .venv/bin/python benchmarks/fp_pack_throughput.py --dir DIR [--layers 2] \\
        [--repeat 3] [--threads 2] > run.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool.pack import PackJob, run_pack
from qtool.packing import scaled_quant
from qtool.quant.scaled import quantize_scaled

SHAPES = {"self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (1024, 4096), "self_attn.v_proj": (1024, 4096),
          "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (14336, 4096), "mlp.up_proj": (14336, 4096),
          "mlp.down_proj": (4096, 14336)}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _checkpoint(d: Path, layers: int) -> float:
    """Write the checkpoint; MB of bf16 weights it holds."""
    g = torch.Generator().manual_seed(0)
    t = {}
    for layer in range(layers):
        for name, shape in SHAPES.items():
            t[f"model.layers.{layer}.{name}.weight"] = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        t[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(4096, dtype=torch.bfloat16)
    d.mkdir(parents=True)
    save_file(t, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (d / "model.safetensors").read_bytes()  # in the page cache
    return sum(v.numel() * 2 for k, v in t.items() if k.endswith("proj.weight")) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoint and outputs go (default: /tmp)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    a = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        src = Path(d) / "src"
        mb = _checkpoint(src, a.layers)
        w = (torch.randn(14336, 4096, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
        w_mb = w.numel() * 2 / 1e6
        codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        quantize_scaled(w[:1024], "e4m3", (128, 128), "fp32", stats={})  # builds the C++ library, once
        for threads in a.threads:
            torch.set_num_threads(threads)
            core, cmd, core_cpu, cmd_cpu = [], [], [], []
            load_before = os.getloadavg()[0]
            for k in range(a.repeat):
                c0, t0 = _cpu(), time.perf_counter()
                quantize_scaled(w, "e4m3", (128, 128), "fp32", stats={}, codes=codes, threads=max(1, threads - 1))
                core.append(time.perf_counter() - t0)
                core_cpu.append(_cpu() - c0)
                out = Path(d) / f"o{threads}-{k}"
                c0, t0 = _cpu(), time.perf_counter()
                run_pack(PackJob(src, out, to="fp8", bits=8, group_size=128))
                cmd.append(time.perf_counter() - t0)
                cmd_cpu.append(_cpu() - c0)
                shutil.rmtree(out)
            runs[f"pack-fp8-bf16-llama3-8b-{a.layers}layers-threads{threads}"] = {
                "input_mb": round(mb, 1), "layers": a.layers, "threads": threads, "codes": scaled_quant.status(),
                "quantize_mb_s": [round(w_mb / t, 1) for t in core],
                "quantize_mb_s_median": round(w_mb / statistics.median(core), 1),
                "quantize_cpu_s_per_gb": round(statistics.median(core_cpu) / (w_mb / 1000), 2),
                "pack_command_mb_s": [round(mb / t, 1) for t in cmd],
                "pack_command_mb_s_median": round(mb / statistics.median(cmd), 1),
                "pack_command_cpu_s_per_gb": round(statistics.median(cmd_cpu) / (mb / 1000), 2),
                "loadavg_1m_before": round(load_before, 2),
                "loadavg_1m_after": round(os.getloadavg()[0], 2),
            }
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__}
    print(json.dumps({k: {**v, **info} for k, v in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
