"""Launch each chosen `cuda-w4a16` kernel once per batch size on one layer, for Nsight Compute to profile.

    ncu --clock-control none -k regex:qt_ -c 2 --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy python tools/profile_cuda_w4a16.py            # M = 1 and 256, Llama-3-70B gate_proj
    python tools/profile_cuda_w4a16.py 16 --shape 28672x8192              # M = 16 on another layer (K x N)
    python tools/profile_cuda_w4a16.py 256 --dense                        # and cuBLAS's dense GEMM after it

Batch sizes from the command line (default 1 and 256); the layer is random, group size 128, fp16; each launch is
the one rows.choose() makes (printed with its description).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qtool.bench.layers import random_plain  # noqa: E402
from qtool.kernels.base import PackedLayer, get_kernel  # noqa: E402

args = sys.argv[1:]
dense = "--dense" in args
k, n = 8192, 28672
if "--shape" in args:
    i = args.index("--shape")
    k, n = (int(v) for v in args[i + 1].split("x"))
    del args[i : i + 2]
sizes = [int(a) for a in args if not a.startswith("--")] or [1, 256]

dev = torch.device("cuda")
kern = get_kernel("cuda-w4a16")
plain = random_plain(n, k, group_size=128, dtype=torch.float16, device=dev, seed=1)
state = kern.prepare(PackedLayer.from_plain(plain))
w = torch.randn(n, k, device=dev).half() if dense else None
del plain
for m in sizes:
    x = torch.randn(m, k, device=dev).half()
    print(m, kern.describe(state, m))
    kern.forward(x, state)
    if dense:
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
