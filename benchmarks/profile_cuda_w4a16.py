"""One call of each `cuda-w4a16` kernel on a Llama-3-70B gate_proj layer (K 8192, N 28672), for Nsight Compute.

    ncu --clock-control none -k regex:qt_ -c 2 --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy python benchmarks/profile_cuda_w4a16.py

    # M = 256 only, with cuBLAS's dense fp16 GEMM of the same shape after it (profile both: -k regex:'qt_|nvjet')
    python benchmarks/profile_cuda_w4a16.py 256 --dense
    # the x-in-registers kernel forced (M <= 16)
    python benchmarks/profile_cuda_w4a16.py 16 --xr     # --xr=2: its probe 2
    # another layer shape (K x N; down_proj here)
    python benchmarks/profile_cuda_w4a16.py 16 --shape 28672x8192

Batch sizes from the command line (default 1 and 256: the stream-K kernel and the wgmma kernel); results in
benchmarks/results/bench.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qtool.bench.layers import random_plain  # noqa: E402
from qtool.kernels.base import PackedLayer, get_kernel  # noqa: E402
from qtool.kernels.cuda.launch import XR, Config  # noqa: E402

args = sys.argv[1:]
dense = "--dense" in args
k, n = 8192, 28672
if "--shape" in args:
    i = args.index("--shape")
    k, n = (int(v) for v in args[i + 1].split("x"))
    del args[i : i + 2]
# --xr[=P]: force the x-in-registers kernel as the eleventh pass chose it (16 warps, 4 blocks per warp, 3-unit
# rings; its probes are built for this shape; probe P) at M <= 16
xr = next((a for a in args if a.startswith("--xr")), None)
xr_probe = int(xr.partition("=")[2] or 0) if xr else 0
sizes = [int(a) for a in args if not a.startswith("--")] or [1, 256]

dev = torch.device("cuda")
kern = get_kernel("cuda-w4a16")
plain = random_plain(n, k, group_size=128, dtype=torch.float16, device=dev, seed=1)
state = kern.prepare(PackedLayer.from_plain(plain))
w = torch.randn(n, k, device=dev).half() if dense else None
del plain
for m in sizes:
    x = torch.randn(m, k, device=dev).half()
    if xr:
        # two batch tiles at every M <= 16: the one-tile kernel is not built with 3-unit rings or as probes
        state.override = Config(kind=XR, nt=2, r=4, warps=16, depth=3, ctas_per_sm=1.0, pdl=True, probe=xr_probe)
    print(m, kern.describe(state, m))
    kern.forward(x, state)
    if dense:
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
