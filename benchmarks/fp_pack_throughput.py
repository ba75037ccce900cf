"""`pack --to fp8` throughput: MB/s of bf16 input on one 4096x14336 layer (Llama-3-8B's down_proj shape).

Two numbers per thread count: the quantizer alone (qtool.quant.scaled.quantize_scaled with its in-pass
error sums, 128x128 blocks, fp32 scales) and the whole `qtool pack --to fp8` command on a one-layer
checkpoint (read, quantize, error, write; Python start-up and the torch import excluded by timing the
command's own report). Each is also given in CPU seconds per GB of bf16 input (user + system time of this
process, every thread), which does not depend on how busy the machine is; the load average is recorded before
and after each run: on a shared 2-core VM it decides the wall-clock numbers more than the code does.

    .venv/bin/python benchmarks/fp_pack_throughput.py [--repeat 3] [--threads 1 2] > run.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool.pack import PackJob, run_pack
from qtool.packing import scaled_quant
from qtool.quant.scaled import quantize_scaled

O, I = 4096, 14336


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    w = torch.randn(O, I, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    mb = w.numel() * 2 / 1e6
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        src.mkdir()
        save_file({"model.layers.0.mlp.down_proj.weight": w}, src / "model.safetensors")
        (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
        quantize_scaled(w[:1024], "e4m3", (128, 128), "fp32", stats={})  # builds the C++ library, once
        for threads in a.threads:
            torch.set_num_threads(threads)
            core, cmd, core_cpu, cmd_cpu = [], [], [], []
            load_before = os.getloadavg()[0]
            for k in range(a.repeat):
                c0, t0 = _cpu(), time.perf_counter()
                quantize_scaled(w, "e4m3", (128, 128), "fp32", stats={})
                core.append(time.perf_counter() - t0)
                core_cpu.append(_cpu() - c0)
                c0, t0 = _cpu(), time.perf_counter()
                run_pack(PackJob(src, Path(d) / f"o{threads}-{k}", to="fp8", bits=8, group_size=128))
                cmd.append(time.perf_counter() - t0)
                cmd_cpu.append(_cpu() - c0)
            runs[f"pack-fp8-bf16-{O}x{I}-threads{threads}"] = {
                "input_mb": mb, "threads": threads, "codes": scaled_quant.status(),
                "quantize_mb_s": [round(mb / t, 1) for t in core],
                "quantize_mb_s_median": round(mb / statistics.median(core), 1),
                "quantize_cpu_s_per_gb": round(statistics.median(core_cpu) / (mb / 1000), 2),
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
