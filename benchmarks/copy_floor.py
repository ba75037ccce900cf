"""What a plain device-to-device copy reaches at the size of each projection, timed as `qtool bench --graphs` times
a kernel: the reference for issue 28's goal of "85 % of the copy bandwidth" at M = 1.

    python benchmarks/copy_floor.py --models llama-3-8b,llama-3-70b --json copy-floor.json

For each layer of each model, the bytes a W4A16 kernel streams at M = 1 (a random GPTQ 4-bit layer of group 128,
PackedLayer.nbytes, and x and y in 16 bits: the `bytes` of a `qtool bench` row) are moved by torch copies of half
that size (each reads and writes it), rotated over buffers past the L2 and replayed as a CUDA graph
(qtool.bench.timing).
Each figure is the moved bytes per second over the 1 GiB copy bandwidth (qtool.bench.roofline), the measure
`qtool bench` reports as the bandwidth fraction; the layer figure adds the projections' bytes and times as
the bench's layer sums do. A copy that cannot reach a fraction at a size bounds what a kernel moving the same
bytes in one launch per projection can reach.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qtool.bench.layers import random_plain  # noqa: E402
from qtool.bench.roofline import copy_bandwidth  # noqa: E402
from qtool.bench.shapes import parse_shapes  # noqa: E402
from qtool.bench.timing import rotation_count, time_calls  # noqa: E402
from qtool.kernels.base import PackedLayer  # noqa: E402


def w4a16_bytes(k: int, n: int, dev: torch.device) -> int:
    """What `qtool bench` counts for a 4-bit g128 layer at M = 1: the packed layer's bytes, x and y in 16 bits."""
    return PackedLayer.from_plain(random_plain(n, k, device=dev)).nbytes() + (k + n) * 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3-8b,llama-3-70b")
    ap.add_argument("--seconds", type=float, default=0.3, help="longest time per timed size")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    props = torch.cuda.get_device_properties(dev)
    out = {"gpu": props.name, "torch": torch.__version__, "copy_bandwidth_gbs": bw / 1e9, "models": {}}
    print(f"{props.name}: 1 GiB copy {bw / 1e9:.0f} GB/s")
    for model in a.models.split(","):
        rows = []
        for s in parse_shapes(model, "cuda"):
            nbytes = w4a16_bytes(s.K, s.N, dev)
            half = nbytes // 4 * 2  # an even count of 2-byte elements, read once and written once
            copies = rotation_count(dev, 2 * half)
            src = [torch.empty(half // 2, dtype=torch.float16, device=dev).normal_() for _ in range(copies)]
            dst = [torch.empty_like(t) for t in src]
            calls = [lambda d=d, t=t: d.copy_(t) for d, t in zip(dst, src)]
            t = time_calls(calls, dev, graphs=True, max_seconds=a.seconds)
            rows.append({"shape": s.name, "K": s.K, "N": s.N, "bytes": 2 * half, "us": t.median_s * 1e6,
                         "fraction": 2 * half / t.median_s / bw, "rotation": copies, "graphs": t.graphs})
            print(f"  {model} {s.name:10s} {2 * half / 1e6:8.2f} MB  {t.median_s * 1e6:7.2f} us  "
                  f"{rows[-1]['fraction']:.3f}")
            del src, dst
        total_b, total_t = sum(r["bytes"] for r in rows), sum(r["us"] for r in rows) / 1e6
        out["models"][model] = {"layers": rows, "layer_fraction": total_b / total_t / bw}
        print(f"  {model} layer: {total_b / 1e6:.1f} MB in {total_t * 1e6:.1f} us, "
              f"{out['models'][model]['layer_fraction']:.3f} of the copy bandwidth")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
