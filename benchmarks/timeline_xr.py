"""Where a call of the M = 16 x-in-registers kernel spends its time: each warp's timeline (probe 12).

    python benchmarks/timeline_xr.py [--json FILE]

For Llama-3-70B's q/o, gate/up and down at M = 16 (fp16) it times launch.choose()'s launch and the same launch
as probe 12, which computes the same result and also writes, per warp, %globaltimer (one clock for all SMs) and
clock64 at six points: entry, after pdl_wait, with the first x in registers, after the first unit, after the
loop, at exit (csrc/w4a16.cu xr_small). Calls are replayed as `qtool bench --graphs` does (rotating weight
copies, programmatic dependent launch), so a call starts while the one before it ends; the timelines read are
those of the last replay. Printed per layer, in microseconds from the first warp's entry: quantiles over warps of
each point and of the phases between them, and the call period (graph time per call).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.tune_cuda_w4a16 import rotated_layer  # noqa: E402
from qtool.bench.timing import time_calls  # noqa: E402
from qtool.kernels.base import get_kernel  # noqa: E402
from qtool.kernels.cuda import launch  # noqa: E402

LAYERS = [("q/o_proj", 8192, 8192), ("gate/up_proj", 8192, 28672), ("down_proj", 28672, 8192)]
POINTS = ["entry", "pdl_wait", "x loaded", "first unit", "loop end", "exit"]


def quantiles(v: torch.Tensor) -> list[float]:
    q = torch.quantile(v.double(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
    return [round(float(a), 2) for a in q]


def timeline(st, cfg, m: int) -> dict:
    """The last call's warp records of state st (launched with cfg, probe 12) as microseconds."""
    p = launch.plan(cfg, m, st)
    grid, warps = p["grid"][0], cfg.warps
    off = p["ws_floats"] - grid * warps * launch.XR_STAMP_U64 * 2
    rec = st.ws[off:off + grid * warps * launch.XR_STAMP_U64 * 2].view(torch.int64).view(grid * warps, -1).cpu()
    gt = rec[:, 0:6].double() / 1e3  # ns -> us
    t0 = gt[:, 0].min()
    rel = gt - t0
    phases = gt[:, 1:] - gt[:, :-1]
    cyc = (rec[:, 7:12] - rec[:, 6:11]).double()
    out = {"points_us": {nm: quantiles(rel[:, i]) for i, nm in enumerate(POINTS)},
           "phases_us": {f"{POINTS[i]} -> {POINTS[i + 1]}": quantiles(phases[:, i]) for i in range(5)},
           "phases_cycles": {f"{POINTS[i]} -> {POINTS[i + 1]}": quantiles(cyc[:, i]) for i in range(5)},
           "units": quantiles(rec[:, 13].double()), "sms": int(rec[:, 12].unique().numel()),
           "span_us": float(rel[:, 5].max())}
    units = rec[:, 13].double().clamp(min=2)
    out["loop_us_per_unit"] = quantiles(phases[:, 3] / (units - 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    kern = get_kernel("cuda-w4a16")
    dev = torch.device("cuda")
    m, dt = 16, torch.float16
    res = {}
    for name, k, n in LAYERS:
        layer, states, w16s = rotated_layer(kern, k, n, dt, dev, m, seed=k + n)
        xs = [torch.randn(m, k, device=dev).to(dt) for _ in states]
        base = states[0].config(m)
        probe = dataclasses.replace(base, probe=12)
        row = {"config": base.label()}
        for tag, cfg in (("default", base), ("probe 12", probe)):
            for s in states:
                s.override = cfg
            t = time_calls([(lambda x=x, s=s: kern.forward(x, s)) for x, s in zip(xs, states)], dev, graphs=True)
            row[f"{tag} us"] = round(t.median_s * 1e6, 2)
        torch.cuda.synchronize()
        tl = row["timeline"] = timeline(states[-1], probe, m)  # the last replay's (the probe's, timed last)
        # the probe's output against x @ the fp16-dequantized weight (a sanity check: it computes the same sums)
        ref = xs[0].double() @ w16s[0].double().t()
        y = kern.forward(xs[0], states[0]).double()
        row["probe rel err"] = float((y - ref).norm() / ref.norm())
        res[name] = row
        print(f"== {name} K {k} N {n} M {m}: {row['config']}: default {row['default us']} us, probe 12 "
              f"{row['probe 12 us']} us; probe's error {row['probe rel err']:.2e}")
        print(f"  span of the last call {tl['span_us']:.2f} us on {tl['sms']} SMs, units a CTA {tl['units']}")
        print(f"   {'point (us from the first entry)':<34} {'min':>7} {'p10':>7} {'p50':>7} {'p90':>7} {'max':>7}")
        for nm, q in [*tl["points_us"].items(), *tl["phases_us"].items(), ("loop per unit", tl["loop_us_per_unit"])]:
            print(f"   {nm:<34} " + " ".join(f"{v:7.2f}" for v in q))
        del states, layer, xs, w16s
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
