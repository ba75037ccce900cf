"""Triton W4A16 cases shared by the interpreter test (CPU, run in a subprocess) and the GPU test.

`run_cases(device, cases)` returns one dict per case: the kernel's relative error against the float64
oracle and the same-precision torch baseline's. Run as a script, it prints them as JSON (the interpreter
test starts it with TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (M, K, N, group_size, act_order, sym, dtype, config kwargs or None for the M-bucket table)
INTERP_CASES = [
    (3, 256, 96, 64, False, False, "fp16", dict(mode=0, block_m=1, block_n=64, block_k=128, split_k=2)),
    (3, 256, 96, 64, False, False, "fp16", dict(mode=1, block_m=16, block_n=32, block_k=128)),
    (3, 256, 96, 64, False, False, "fp16", dict(mode=2, block_m=16, block_n=64, block_k=128, split_k=2)),
    (3, 192, 96, 64, True, False, "fp16", dict(mode=1, block_m=16, block_n=64, block_k=128)),
    (3, 192, 96, 64, True, False, "bf16", dict(mode=0, block_m=1, block_n=32, block_k=128, f32=True)),
    (2, 160, 40, 32, False, True, "fp16", dict(mode=0, block_m=1, block_n=32, block_k=64, f32=True)),
    (3, 256, 96, 64, False, False, "fp16", dict(path="dequant+cublas")),
    (2, 256, 96, 64, False, False, "fp16", dict(mode=3, block_m=1, block_n=32, block_k=64, split_k=4)),
    (1, 384, 64, 32, False, False, "bf16", dict(mode=3, block_m=1, block_n=64, block_k=128)),
    (1, 512, 64, 128, False, True, "fp16", dict(mode=3, block_m=1, block_n=32, block_k=64, split_k=2)),
    (1, 512, 96, 64, False, False, "fp16", dict(mode=3, block_m=1, block_n=32, block_k=64, pair=True, split_k=2)),
    (1, 256, 96, 32, False, False, "fp16", None),
    # mode 4 (PTX dequant into the dot; the interpreter runs the Triton-ops twin of the PTX block)
    (3, 256, 96, 64, False, False, "fp16", dict(mode=4, block_m=16, block_n=32, block_k=64, split_k=2, swap=True)),
    (5, 384, 64, 32, False, True, "fp16", dict(mode=4, block_m=16, block_n=64, block_k=64, swap=True)),
    (3, 512, 104, 128, False, False, "fp16", dict(mode=4, block_m=16, block_n=64, block_k=256, split_k=2)),
    (3, 192, 96, 64, True, False, "fp16", dict(mode=4, block_m=16, block_n=64, block_k=64, swap=True)),
    (4, 256, 96, 64, False, False, "fp16", dict(path="dequant+cublas", mode=4, block_n=32, block_k=64)),
    (16, 256, 96, 32, False, False, "fp16", None),
    (200, 256, 96, 32, False, False, "fp16", None),
]


def run_cases(device: str, cases) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from qtool.bench.layers import random_plain
    from qtool.formats.plain import dequantize
    from qtool.kernels.base import PackedLayer, get_kernel
    from qtool.kernels.triton.launch import LaunchConfig

    dev = torch.device(device)
    kern = get_kernel("triton-w4a16")
    results = []
    for i, (m, k, n, g, act, sym, dt, cfg) in enumerate(cases):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt]
        plain = random_plain(n, k, group_size=g, act_order=act, sym=sym, dtype=dtype, device=dev, seed=10 + i)
        layer = PackedLayer.from_plain(plain)
        why = kern.check(layer, dtype, dev)
        state = kern.prepare(layer)
        if cfg is not None:
            state.override = LaunchConfig(**cfg)
        gen = torch.Generator(device=dev).manual_seed(i)
        x = torch.randn((m, k), generator=gen, device=dev).to(dtype)
        ref = x.double() @ dequantize(plain, torch.float64).t()
        base = F.linear(x.float(), dequantize(plain, dtype).float()).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
        y = kern.forward(x, state, out=out)
        finite = bool(torch.isfinite(y).all())
        err = float((y.double() - ref).norm() / ref.norm()) if finite else float("inf")
        results.append({"case": i, "refusals": why, "label": state.config(m).label(), "err": err,
                        "base": float((base.double() - ref).norm() / ref.norm()), "finite": finite,
                        "out_is_result": y.data_ptr() == out.data_ptr()})
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu", INTERP_CASES)))
