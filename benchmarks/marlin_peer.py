"""The original Marlin kernel as a peer, measured in the same process as cuda-w4a16 and dense, on any GPU.

An anchor file (benchmarks/anchors/marlin-orig-*.csv) holds Marlin's figures from one card. On another card
its ratios are not the same run's: this script measures the peer on the card at hand, the way the anchors are
made, writes its figures in the anchor format (so `qtool bench --anchor` reads them), and times cuda-w4a16 and
dense beside it for the goal table of issue 28 (x Marlin's speedup at M <= 64, x dense at every M).

    # build (any machine with nvcc; a checkout of https://github.com/IST-DASLab/marlin, never committed here)
    python benchmarks/marlin_peer.py build MARLIN_CHECKOUT --out libmarlin.so
    # measure (on the GPU): DIR/peer.json, DIR/marlin-orig.csv and the goal table
    python benchmarks/marlin_peer.py run --lib libmarlin.so --out DIR [--models ...] [--batch-sizes ...]
    # the goal table again, with `qtool bench --dtype bf16 --json` reports of the same models beside it
    python benchmarks/marlin_peer.py report DIR --bf16 REPORT.json ...

As for the anchors (benchmarks/anchors/README.md): the kernel is built for sm_80 and sm_90a with its L2
evict-first copy hint replaced by a plain `cp.async.cg`; its input is qtool's own Marlin packing
(`qtool.formats.marlin`, 4-bit symmetric, group 128, fp16) of a random layer; each output is checked against
the float64 oracle (output poisoned with NaN; cuda-w4a16 within 4x the dense fp16 baseline's error, Marlin within
32x: see PEER_ERR_FACTOR) before it is timed as `qtool bench --graphs` times (CUDA-graph replays over weight
copies rotated past L2, median), the three kernels in two passes of opposite order, each figure the mean of its
two (`*_us_passes` in peer.json holds both).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ERR_FACTOR = 4.0
# Marlin sums the partials of its K slices in fp16 through the output (its global reduction), so its error grows
# with the number of slices: up to 17x dense fp16's on narrow layers and at M > 128 (4.7e-3 against 2.7e-4,
# as the anchor's 3e-4 to 3.4e-3). Its bound only rejects a wrong result; cuda-w4a16 keeps ERR_FACTOR.
PEER_ERR_FACTOR = 32.0
DEFAULT_MODELS = ("llama-3-70b,llama-3-8b,qwen2.5-32b,qwen2.5-7b,qwen3-30b-a3b-expert,llama-3-70b@tp2,"
                  "llama-3-70b@tp4")
DEFAULT_M = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
HINT_OLD = ("createpolicy.fractional.L2::evict_first.b64 p, 1.0;",
            "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], %2, p;")
HINT_NEW = ("", "cp.async.cg.shared.global [%0], [%1], %2;")
# A C entry point over Marlin's own host function, so ctypes can call it without torch's extension build.
WRAPPER = """
#include "marlin_cuda_kernel.cu"
extern "C" int qt_marlin(const void* a, const void* b, void* c, void* s, int m, int n, int k, void* ws,
                         int groupsize, int dev, void* stream) {
  return marlin_cuda(a, b, c, s, m, n, k, ws, groupsize, dev, (cudaStream_t) stream, -1, -1, -1, 16);
}
"""


def fail(problem: str, fix: str) -> int:
    print(f"error: {problem}; fix: {fix}", file=sys.stderr)
    return 2


def build(src: Path, out: Path, nvcc: str) -> int:
    kernel = src / "marlin" / "marlin_cuda_kernel.cu"
    if not kernel.is_file():
        return fail(f"{kernel}: no such file", "give the root of a checkout of IST-DASLab/marlin")
    text = kernel.read_text()
    for old, new in zip(HINT_OLD, HINT_NEW):
        if old not in text:
            return fail(f"{kernel}: the copy hint '{old}' is not there",
                        "use the checkout the anchors name (IST-DASLab/marlin 2f6d7c1)")
        text = text.replace(old, new)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "marlin_cuda_kernel.cu").write_text(text)
        (Path(tmp) / "wrap.cu").write_text(WRAPPER)
        cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-std=c++17", "--expt-relaxed-constexpr",
               "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
               "-o", str(out), str(Path(tmp) / "wrap.cu")]
        print(" ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode


class MarlinPeer:
    def __init__(self, lib: Path):
        self.lib = ctypes.CDLL(str(lib))
        f = self.lib.qt_marlin
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                                   ctypes.c_void_p]

    def __call__(self, x, b, s, out, ws) -> None:
        import torch

        m, k = x.shape
        n = out.shape[1]
        rc = self.lib.qt_marlin(x.data_ptr(), b.data_ptr(), out.data_ptr(), s.data_ptr(), m, n, k, ws.data_ptr(),
                                k // s.shape[0] if s.shape[0] > 1 else -1, x.device.index or 0,
                                torch.cuda.current_stream(x.device).cuda_stream)
        if rc:
            raise RuntimeError(f"marlin_cuda returned {rc} for M={m} K={k} N={n} (1: shape, 2: no kernel)")


def run(lib: Path, out_dir: Path, models: str, batch_sizes: list[int], seconds: float) -> int:
    import torch
    import torch.nn.functional as F

    from qtool.bench.layers import random_plain
    from qtool.bench.shapes import parse_shapes
    from qtool.bench.timing import rotation_count, time_calls
    from qtool.formats.base import get_format
    from qtool.formats.plain import Plain, dequantize
    from qtool.kernels.base import PackedLayer, get_kernel

    if not lib.is_file():
        return fail(f"{lib}: no such file", "build it first: python benchmarks/marlin_peer.py build CHECKOUT --out LIB")
    if not torch.cuda.is_available():
        return fail("no CUDA device", "run it on the GPU machine")
    dev = torch.device("cuda")
    dt = torch.float16
    peer = MarlinPeer(lib)
    kern = get_kernel("cuda-w4a16")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, bad = [], 0
    gpu = torch.cuda.get_device_name(dev)
    for model in models.split(","):
        shapes: dict[tuple[int, int], list] = {}
        for sh in parse_shapes(model, "cuda"):
            shapes.setdefault((sh.K, sh.N), []).append(sh.name)
        for (k, n), names in shapes.items():
            plain = random_plain(n, k, group_size=128, sym=True, dtype=dt, device=dev, seed=k + n)
            w64 = dequantize(plain, torch.float64)
            w16 = dequantize(plain, dt)
            host = Plain(plain.qweight.cpu(), plain.scales.cpu(), None, None, 4, 128)
            packed = get_format("marlin").pack(host)
            b0, s0 = packed["qweight"].to(dev), packed["scales"].to(dev)
            layer = PackedLayer.from_plain(plain)
            del plain, host, packed
            nq = rotation_count(dev, b0.numel() * 4 + s0.numel() * 2 + max(batch_sizes) * k * 2)
            bs = [(b0, s0)] + [(b0.clone(), s0.clone()) for _ in range(nq - 1)]
            states = [kern.prepare(layer if i == 0 else layer.clone()) for i in range(nq)]
            w16s = [w16] + [w16.clone() for _ in range(rotation_count(dev, w16.numel() * 2) - 1)]
            ws = torch.zeros(n // 128 * 16, dtype=torch.int32, device=dev)
            for m in batch_sizes:
                xs = [torch.randn(m, k, device=dev).to(dt) for _ in range(max(len(bs), len(states), len(w16s)))]
                outs = [torch.empty(m, n, dtype=dt, device=dev) for _ in range(2)]
                ref = xs[0].double() @ w64.t()
                base = float((F.linear(xs[0], w16).double() - ref).norm() / ref.norm())
                row = dict(model=model, shape="/".join(names), count_in_layer=len(names), K=k, N=n, M=m,
                           dense_err=base)
                kernels = {
                    "marlin": [(lambda x=x, bw=bs[i % len(bs)], o=outs[i % 2], ws=ws: peer(x, *bw, o, ws))
                               for i, x in enumerate(xs)],
                    "cuda_w4a16": [(lambda x=x, st=states[i % len(states)], o=outs[i % 2]: kern.forward(x, st, out=o))
                                   for i, x in enumerate(xs)]}
                timed = {"fp16": [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, w16s)]}
                for name, calls in kernels.items():
                    outs[0].fill_(float("nan"))
                    try:
                        calls[0]()
                    except RuntimeError as e:  # a shape the kernel has no tiles for: recorded, not timed
                        print(f"REFUSED {model} {k}x{n} M={m} {name}: {e}", flush=True)
                        row[f"{name}_err"] = row[f"{name}_us"] = None
                        continue
                    torch.cuda.synchronize()
                    y = outs[0]
                    err = float((y.double() - ref).norm() / ref.norm()) if torch.isfinite(y).all() else float("inf")
                    row[f"{name}_err"] = err
                    if not err <= (PEER_ERR_FACTOR if name == "marlin" else ERR_FACTOR) * base:
                        bad += 1
                        print(f"FAIL {model} {k}x{n} M={m} {name}: err {err:.3g} vs dense {base:.3g}", flush=True)
                        row[f"{name}_us"] = None
                        continue
                    timed[name] = calls
                # Two passes of opposite order, each time the mean of its two: a launch timed right after another
                # (dense cuBLAS at large M) runs at the clocks that one left, up to 25 % off the same launch timed
                # elsewhere in the order (benchmarks/tune_cuda_w4a16.py --curve does the same).
                passes: dict[str, list[float]] = {name: [] for name in timed}
                for order in (list(timed), list(timed)[::-1]):
                    for name in order:
                        t = time_calls(timed[name], dev, graphs=True, max_seconds=seconds / 2)
                        passes[name].append(t.median_s * 1e6)
                for name, us in passes.items():
                    row[f"{name}_us"] = sum(us) / len(us)
                    row[f"{name}_us_passes"] = us
                rows.append(row)
                print(f"{model} {k}x{n} M={m}: dense {row['fp16_us']:.1f} marlin {row['marlin_us'] or 0:.1f} "
                      f"cuda-w4a16 {row['cuda_w4a16_us'] or 0:.1f} us", flush=True)
                del xs, outs
            torch.cuda.empty_cache()
        # after each model, so a run stopped by a time limit keeps the models it finished
        (out_dir / "peer.json").write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, rows=rows), indent=1))
    write_anchor(rows, out_dir / "marlin-orig.csv")
    print(goal_table(rows, gpu))
    print(oracle_line(rows, bad))
    return 1 if bad else 0


def oracle_line(rows: list[dict], bad: int) -> str:
    """How many outputs were checked and passed, and each kernel's error range."""
    ran = sum(r[f"{name}_err"] is not None for r in rows for name in ("marlin", "cuda_w4a16"))

    def spread(key: str) -> str:
        errs = [r[key] for r in rows if r[key] is not None]
        return f"{min(errs):.2g}-{max(errs):.2g}" if errs else "-"

    return (f"oracle: {ran - bad} of {ran} kernel outputs within their bound ({2 * len(rows) - ran} refused); "
            f"error: Marlin {spread('marlin_err')}, cuda-w4a16 {spread('cuda_w4a16_err')}, dense fp16 "
            f"{spread('dense_err')}")


def write_anchor(rows: list[dict], path: Path) -> None:
    """Marlin's rows in the anchor format (benchmarks/anchors/README.md), for `qtool bench --anchor`."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "shape", "count_in_layer", "K", "N", "M", "fp16_us", "marlin_orig_us", "marlin_x_fp16"])
        for r in rows:
            if r["marlin_us"]:
                w.writerow([r["model"], r["shape"], r["count_in_layer"], r["K"], r["N"], r["M"],
                            f"{r['fp16_us']:.2f}", f"{r['marlin_us']:.2f}", f"{r['fp16_us'] / r['marlin_us']:.3f}"])


def goal_table(rows: list[dict], gpu: str, bf16: dict[str, dict] | None = None) -> str:
    """Layer sums per model and M: cuda-w4a16 x dense, Marlin x dense and their ratio (fp16, this run); with
    `qtool bench --dtype bf16 --json` reports of the same models (bf16: model -> report), cuda-w4a16's bf16 x dense
    beside its fp16 one, and at M = 1 both dtypes' fraction of the copy bandwidth (the report's bytes and copy
    bandwidth; the byte counts are the same for fp16)."""
    lines = [f"layer sums on {gpu}: cuda-w4a16 x fp16 | Marlin x fp16 | ratio (goal >= 1.15 at M <= 64)"
             + (" | cuda-w4a16 bf16 x bf16 | bf16 / fp16 speedup" if bf16 else "")]
    for model in dict.fromkeys(r["model"] for r in rows):
        rep = (bf16 or {}).get(model)
        for m in dict.fromkeys(r["M"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["M"] == m]
            if any(r["marlin_us"] is None or r["cuda_w4a16_us"] is None for r in rs):
                lines.append(f"{model:<24} M={m:<4} (a kernel failed the oracle check or refused a shape)")
                continue
            ours_us = sum(r["cuda_w4a16_us"] * r["count_in_layer"] for r in rs)
            dense = sum(r["fp16_us"] * r["count_in_layer"] for r in rs)
            ours, marlin = dense / ours_us, dense / sum(r["marlin_us"] * r["count_in_layer"] for r in rs)
            line = f"{model:<24} M={m:<4} {ours:5.2f} {marlin:5.2f} {ours / marlin:5.2f}"
            b = rep and rep["summary"]["per_m"].get("cuda-w4a16", {}).get(str(m))
            if b:
                line += f" | {b['total_speedup_vs_dense']:5.2f} {b['total_speedup_vs_dense'] / ours:5.2f}"
                if m == 1:
                    nbytes = sum(x["bytes"] for x in rep["results"] if x["kernel"] == "cuda-w4a16" and x["M"] == 1)
                    copy = rep["device"]["copy_bandwidth_gbs"] * 1e9
                    line += (f" | copy bandwidth: fp16 {nbytes / (ours_us * 1e-6) / copy:.1%}, bf16 "
                             f"{b['total_bw_fraction']:.1%} of {copy / 1e9:.0f} GB/s")
            lines.append(line)
    return "\n".join(lines)


def report(run_dir: Path, bf16_reports: list[Path]) -> int:
    missing = [p for p in (run_dir / "peer.json", *bf16_reports) if not p.is_file()]
    if missing:
        return fail(f"{missing[0]}: no such file", "give the --out folder of `run` and existing bench reports")
    d = json.loads((run_dir / "peer.json").read_text())
    layers: dict[str, list] = {}  # model -> its projections' (K, N), once per occurrence, sorted
    for r in d["rows"]:
        if r["M"] == d["rows"][0]["M"]:
            layers.setdefault(r["model"], []).extend([(r["K"], r["N"])] * r["count_in_layer"])
    bf16 = {}
    for path in bf16_reports:  # matched to a model by its shapes (a report names shapes, not models)
        rep = json.loads(path.read_text())
        shapes = sorted((x["K"], x["N"]) for x in rep["settings"]["shapes"])
        bf16.update({model: rep for model, ks in layers.items() if sorted(ks) == shapes})
    print(goal_table(d["rows"], d["gpu"], bf16))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("src", type=Path, help="a checkout of IST-DASLab/marlin")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--nvcc", default="nvcc")
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--models", default=DEFAULT_MODELS)
    r.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_M))
    r.add_argument("--seconds", type=float, default=0.25)
    p = sub.add_parser("report", help="the goal table of a run, with qtool bench's bf16 reports beside it")
    p.add_argument("dir", type=Path)
    p.add_argument("--bf16", type=Path, nargs="*", default=[], help="`qtool bench --dtype bf16 --json` reports")
    a = ap.parse_args()
    if a.cmd == "build":
        return build(a.src, a.out, a.nvcc)
    if a.cmd == "report":
        return report(a.dir, a.bf16)
    return run(a.lib, a.out, a.models, a.batch_sizes, a.seconds)


if __name__ == "__main__":
    sys.exit(main())
