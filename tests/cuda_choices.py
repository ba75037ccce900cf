"""The launch `cuda-w4a16` picks at every point of a grid, as plain data (tests/data/cuda_choices.json).

    python tests/cuda_choices.py   # rewrites tests/data/cuda_choices.json from the current rows.py and launch.py

The JSON holds the points (devices, group shifts, layer shapes: every layer and fused layer of
configs/models.yaml plus a few odd ones) and, per (device, group shift, shape), runs of M with the same
launch. tests/test_kernels_cuda.py asserts that choose() and plan() still give exactly these launches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "cuda_choices.json"
# [compute capability, SMs, launch.cluster_slots, memory GB/s]: sm_90's slots as launch.cluster_slots returns them
# on an H100 80GB HBM3 (driver 580.159.04, 2026-12-05), its bandwidth the h100 profile's (configs/devices.yaml);
# the H200 profile's bandwidth with the same slots, and a 114-SM device without clusters (the rules' other sides)
H100_SLOTS = [0, 0, 66, 39, 30, 22, 17, 15, 15]
H100_GBPS, H200_GBPS = 3350, 4800
DEVICES = {"sm_80": [[8, 0], 108, [], 2039], "sm_90": [[9, 0], 132, H100_SLOTS, H100_GBPS],
           "sm_90-h200": [[9, 0], 132, H100_SLOTS, H200_GBPS], "sm_90-114": [[9, 0], 114, [], H100_GBPS]}
# group shift of a layer: -1 the group table (groups of 32, act-order), 6/7/8 groups of 64/128/256, 30 one group
GSHIFTS = (-1, 6, 7, 8, 30)
MS = [*range(1, 257), 257, 300, 384, 500, 512, 1000, 1024, 2048, 4096, 8192]
ODD_SHAPES = [[384, 200], [160, 48], [4104, 4096], [8192, 1000], [1024, 16]]


def state(k, n, post=True, cc=(9, 0), slots=tuple(H100_SLOTS), gbps=H200_GBPS, *, gshift=None, n_sm=132):
    """A layer's state as the dispatch reads it (CudaState's device and shape fields): 132 SMs, groups of 128
    (post) or the group table unless gshift says otherwise, cluster slots on sm_90 only (the H100's unless told
    otherwise) and the H200 profile's bandwidth unless told otherwise."""
    gs = gshift if gshift is not None else 7 if post else -1
    return SimpleNamespace(K=k, N=n, n_sm=n_sm, cc=tuple(cc), gshift_blk=gs,
                           cluster_slots=tuple(slots) if tuple(cc) == (9, 0) else (), hbm_gbps=gbps)


def model_shapes() -> list[list[int]]:
    """(K, N) of every layer and fused layer of every model in configs/models.yaml."""
    from qtool.bench.shapes import parse_shapes

    names = yaml.safe_load((ROOT / "configs" / "models.yaml").read_text())["models"]
    return sorted([k, n] for k, n in {(s.K, s.N) for name in names for spec in (name, f"{name}+fused")
                                      for s in parse_shapes(spec, "cuda")})


def launch_of(m: int, st) -> tuple[dict, dict]:
    """Everything a launch is: the Config's non-default fields, the kernel per dtype, whether it is a dependent
    launch; and the rest of its plan (grid, block, shared memory, split, workspace) and flags."""
    from qtool.kernels.cuda import launch, rows

    cfg = rows.choose(m, st)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if getattr(cfg, f.name) != f.default}
    p = dict(launch.plan(cfg, m, st))
    name = p.pop("name")
    p["grid"], p["cluster"] = list(p["grid"]), list(p["cluster"])
    g = p["grid"]
    p["flags"] = launch.flags(cfg, g[0] * g[1] * g[2], st.n_sm)
    return ({"config": fields, "names": [name.replace("{dt}", dt) for dt in ("f16", "bf16")],
             "pdl": launch.use_pdl(cfg, st)}, p)


def record(shapes: list[list[int]]) -> dict:
    """runs {"device/gshift/KxN": [[m_first, m_last, launch index], ...]}, the distinct launches, and plans
    {"device/gshift/KxN": SHA-256 of the plans over every M} (they vary with M too often to list)."""
    launches: list[str] = []
    index: dict[str, int] = {}
    runs: dict[str, list] = {}
    plans: dict[str, str] = {}
    for dev, (cc, n_sm, slots, gbps) in DEVICES.items():
        for gs in GSHIFTS:
            for k, n in shapes:
                st = state(k, n, cc=cc, slots=slots, gbps=gbps, gshift=gs, n_sm=n_sm)
                spans: list = []
                h = hashlib.sha256()
                for m in MS:
                    what, p = launch_of(m, st)
                    h.update(json.dumps([m, p], sort_keys=True).encode())
                    key = json.dumps(what, sort_keys=True)
                    i = index.setdefault(key, len(launches))
                    if i == len(launches):
                        launches.append(key)
                    if spans and spans[-1][2] == i:
                        spans[-1][1] = m
                    else:
                        spans.append([m, m, i])
                runs[f"{dev}/{gs}/{k}x{n}"] = spans
                plans[f"{dev}/{gs}/{k}x{n}"] = h.hexdigest()[:16]
    return {"runs": runs, "launches": [json.loads(s) for s in launches], "plans": plans}


def main() -> None:
    sys.path.insert(0, str(ROOT))
    shapes = model_shapes() + ODD_SHAPES
    out = {"devices": DEVICES, "gshifts": list(GSHIFTS), "ms": MS, "shapes": shapes, **record(shapes)}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(out, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
