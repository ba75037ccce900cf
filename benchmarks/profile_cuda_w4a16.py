"""One call of each `cuda-w4a16` kernel on a Llama-3-70B gate_proj layer (K 8192, N 28672), for Nsight Compute.

    ncu --clock-control none -k regex:qt_ -c 2 --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy python benchmarks/profile_cuda_w4a16.py

M = 1 (the mma kernel) and M = 256 (the wgmma kernel); results in benchmarks/results/bench.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qtool.bench.layers import random_plain  # noqa: E402
from qtool.kernels.base import PackedLayer, get_kernel  # noqa: E402

dev = torch.device("cuda")
kern = get_kernel("cuda-w4a16")
plain = random_plain(28672, 8192, group_size=128, dtype=torch.float16, device=dev, seed=1)
state = kern.prepare(PackedLayer.from_plain(plain))
del plain
for m in (1, 256):
    x = torch.randn(m, 8192, device=dev).half()
    print(m, kern.describe(state, m))
    kern.forward(x, state)
    torch.cuda.synchronize()
