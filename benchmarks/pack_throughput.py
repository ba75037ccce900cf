"""Pack throughput: MB/s of fp16 input for RTN 4-bit g128 on one 4096x14336 layer (Llama-3-8B down_proj
transposed shape), quantize + GPTQ pack, and the same through the whole `qtool pack` command on a one-layer
checkpoint (read, quantize, pack, error measurement, write).

    .venv/bin/python benchmarks/pack_throughput.py [--repeat 3] [--method rtn]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from qtool.formats import get_format
from qtool.quant import quantize

O, I = 4096, 14336


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--format", default="gptq")
    a = ap.parse_args()
    w = torch.randn(O, I, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    mb = w.numel() * 2 / 1e6
    fmt = get_format(a.format)
    core = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        fmt.pack(quantize(w, 4, 128, True, method=a.method))
        core.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        src.mkdir()
        save_file({"model.layers.0.mlp.down_proj.weight": w}, src / "model.safetensors")
        cli = []
        for k in range(a.repeat):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "qtool", "pack", str(src), "-o", str(Path(d) / f"o{k}"), "--to",
                            a.format, "--method", a.method, "-q"], check=True)
            cli.append(time.perf_counter() - t0)
    res = {"shape": [O, I], "input_MB": mb, "method": a.method, "format": a.format,
           "core_s_median": statistics.median(core), "core_MB_per_s": mb / statistics.median(core),
           "cli_s_median": statistics.median(cli), "cli_MB_per_s": mb / statistics.median(cli),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
