"""`qtool bench` core: for each shape x M x kernel, check against the float64 oracle, then time.

Per (shape, M):
- the oracle is y64 = x64 @ dequantize(plain, float64)^T; the honest baseline is the dense product in the
  activation dtype (torch's F.linear with the weight dequantized and rounded once to that dtype); a kernel
  passes when its relative error is within ERR_FACTOR of the baseline's (flash-attention style), with
  every output element written (outputs are poisoned with NaN before the call);
- a kernel that fails is reported (error, reason) and not timed;
- the dense baseline and each passing kernel are timed with rotating weight copies (timing.py).
Bytes counted per call: packed weight (qweight + qzeros + scales [+ g_idx]; FP8 codes + scales) or dense
weight, plus activations in and outputs out.

The layers are random: integer codes in GPTQ v2 words (format "gptq", --bits/--group-size), or E4M3 codes with
fp32 absmax scales per tensor, channel or 128x128 block (format "fp8", --strategy). A kernel's error bound
is its own `error_factor(dtype)` times the dense baseline's error: 4 for the W4A16 kernels, derived from the
E4M3 activation rounding for the W8A8 ones (qtool/kernels/scaled_mm.py).
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from qtool.bench import roofline
from qtool.bench.anchor import Anchor, apply_anchor
from qtool.bench.layers import random_plain, random_scaled
from qtool.bench.shapes import Shape
from qtool.bench.timing import rotation_count, time_calls
from qtool.errors import UsageError
from qtool.kernels.base import (
    ACT_DTYPES,
    PackedLayer,
    ScaledLayer,
    all_kernels,
    dequantize_canonical,
    get_kernel,
    pack_gptq_v2,
)
from qtool.kernels.devices import device_available_bytes
from qtool.report.common import human_bytes

ERR_FACTOR = 4.0  # the default k (base.Kernel.err_factor); kernels may declare their own per dtype
FORMATS = ("gptq", "fp8")
STRATEGIES = ("tensor", "channel", "block")
ERR_FLOOR = 1e-6  # relative error below which any two implementations agree (fp32 kernels on the CPU)
DENSE = "dense"


@dataclass
class BenchSettings:
    device: torch.device
    shapes: list[Shape]
    batch_sizes: list[int]
    kernels: list[str] | None = None  # None: every registered kernel available on the device
    bits: int = 4
    group_size: int = 128
    dtype: str = "fp16"
    graphs: bool = False
    act_order: bool = False
    seed: int = 0
    max_seconds: float = 1.0  # per timed point
    anchor: Anchor | None = None  # a reference kernel's speedups over fp16 (--anchor)
    format: str = "gptq"  # gptq: integer codes in GPTQ v2 words; fp8: E4M3 codes (ScaledPlain)
    strategy: str = "tensor"  # fp8 weight scales: tensor | channel | block (128x128)

    @property
    def weight_group(self) -> int:
        """Group size the byte and roofline arithmetic uses (FP8 scales are per tensor/channel/block)."""
        return -1 if self.format == "fp8" else self.group_size

    def to_dict(self) -> dict:
        return {"device": str(self.device), "shapes": [s.to_dict() for s in self.shapes],
                "batch_sizes": self.batch_sizes, "kernels": self.kernels, "bits": self.bits,
                "group_size": self.group_size, "dtype": self.dtype, "graphs": self.graphs,
                "act_order": self.act_order, "seed": self.seed,
                "anchor": self.anchor.path if self.anchor else None, "format": self.format,
                "strategy": self.strategy if self.format == "fp8" else None}


@dataclass
class Row:
    """One (shape, M, kernel) result. status: ok | failed (oracle check) | refused (kernel declined)."""

    shape: str
    K: int  # noqa: N815
    N: int  # noqa: N815
    M: int  # noqa: N815
    kernel: str
    status: str
    reason: str = ""
    path: str = ""
    rel_err: float | None = None
    baseline_rel_err: float | None = None
    median_us: float | None = None
    tflops: float | None = None
    gbs: float | None = None
    bw_fraction: float | None = None
    speedup_vs_dense: float | None = None
    bytes: int | None = None
    rotation: int | None = None
    graphs: bool | None = None
    anchor_x_dense: float | None = None  # the anchor kernel's speedup over fp16 at this K x N and M
    vs_anchor: float | None = None  # speedup_vs_dense / anchor_x_dense

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BenchReport:
    settings: BenchSettings
    device_info: dict
    roofline: dict
    kernels: dict  # kernel id -> {"status": available|unavailable, "reason": str, "summary": str}
    rows: list[Row] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(r.status == "failed" for r in self.rows)

    def to_dict(self) -> dict:
        return {"schema": "qtool.bench/1", "settings": self.settings.to_dict(), "device": self.device_info,
                "roofline": self.roofline, "kernels": self.kernels,
                "results": [r.to_dict() for r in self.rows], "summary": self.summary}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    d = (y.to(torch.float64) - ref).norm()
    n = ref.norm()
    return float(d / n) if n > 0 else float(d)


def _device_info(dev: torch.device) -> dict:
    info = {"type": dev.type, "torch": torch.__version__, "host": platform.node(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    l2_bytes=int(getattr(p, "L2_cache_size", 0)), memory_bytes=int(p.total_memory),
                    cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


# Bytes per weight element a shape holds at its peak, measured on the CPU (about 32 with torch 2.x) and
# rounded up: the float32 build of the random layer and its float64 oracle with their temporaries, the
# 16-bit dense copy, the packed codes.
WEIGHT_BYTES_PER_ELEMENT = 48
# Bytes per output element at M: the float64 oracle, a kernel's output and the float64 difference that
# measures its error, with their temporaries.
OUTPUT_BYTES_PER_ELEMENT = 40
# Bytes per input element at M beyond its rotating 16-bit copies: the float32 draw and the float64 oracle copy.
INPUT_BYTES_PER_ELEMENT = 12


def estimate_bytes(s: BenchSettings, shape: Shape, m: int) -> int:
    """Peak bytes the sweep holds on its device for one shape at batch size m (an upper estimate)."""
    nk = shape.N * shape.K
    cap = 64 if s.device.type == "cuda" else 4
    groups = shape.N * -(-shape.K // (shape.K if s.weight_group == -1 else s.weight_group))
    packed = nk * s.bits // 8 + 3 * groups  # codes, 16-bit scales, 8-bit zeros
    n_copies = rotation_count(s.device, packed + m * shape.K * 2, cap=cap)
    dense_copies = rotation_count(s.device, nk * 2, cap=cap)
    kernels = len(s.kernels) if s.kernels else len(all_kernels())
    # per group: the float32 minima, maxima and scales the random layer is built from
    weights = nk * WEIGHT_BYTES_PER_ELEMENT + 12 * groups + (dense_copies - 1) * nk * 2 + n_copies * packed * (kernels + 1)
    inputs = m * shape.K * (INPUT_BYTES_PER_ELEMENT + 2 * max(n_copies, dense_copies))
    return weights + inputs + m * shape.N * OUTPUT_BYTES_PER_ELEMENT


def check_memory(s: BenchSettings) -> None:
    """Refuse, before anything is allocated, a sweep whose largest point would not fit the device."""
    m = max(s.batch_sizes)
    need, shape = max(((estimate_bytes(s, sh, m), sh) for sh in s.shapes), key=lambda t: t[0])
    avail, source = device_available_bytes(s.device)
    if need > avail:
        raise UsageError(f"--shapes {shape.name} at --batch-sizes {m} needs about {human_bytes(need)} "
                         f"({need:,} bytes) on {s.device}, more than the {human_bytes(avail)} {source}",
                         fix="give smaller --shapes or --batch-sizes")


def run_bench(s: BenchSettings, step: Callable[[str], None] | None = None) -> BenchReport:
    """Run the whole sweep; `step(description)` is called once per (shape, M) unit of work."""
    check_memory(s)
    dev = s.device
    dtype = ACT_DTYPES[s.dtype]
    torch.manual_seed(s.seed)
    bw = roofline.copy_bandwidth(dev)
    peak = roofline.matmul_peak(dev, dtype)
    info = _device_info(dev)
    info.update(copy_bandwidth_gbs=bw / 1e9, matmul_peak_tflops=peak / 1e12,
                matmul_peak_dtype=s.dtype if dev.type == "cuda" else "fp32")

    registry = all_kernels()
    names = s.kernels if s.kernels else sorted(registry)
    kern_info: dict = {}
    chosen = []
    for name in names:
        k = get_kernel(name)
        why = k.available(dev)
        kern_info[name] = {"status": "unavailable" if why else "available", "reason": why or "",
                           "summary": k.summary}
        if why is None:
            chosen.append(k)
        elif s.kernels:  # asked for by name: keep it, its rows say why it did not run
            chosen.append(k)

    rows: list[Row] = []
    for shape in s.shapes:
        seed = s.seed + shape.K * 7 + shape.N
        if s.format == "fp8":
            plain = random_scaled(shape.N, shape.K, strategy=s.strategy, dtype=dtype, device=dev, seed=seed)
            layer = ScaledLayer(plain)
        else:
            plain = random_plain(shape.N, shape.K, bits=s.bits, group_size=s.group_size, dtype=dtype,
                                 act_order=s.act_order, device=dev, seed=seed)
            layer = PackedLayer.from_plain(plain) if dev.type == "cpu" else pack_gptq_v2(plain)
        w64 = dequantize_canonical(plain, torch.float64)  # [N, K] oracle weight
        w16 = dequantize_canonical(plain, dtype)  # what a 16-bit model holds
        del plain
        per_copy = layer.nbytes() + max(s.batch_sizes) * shape.K * 2
        n_copies = rotation_count(dev, per_copy, cap=64 if dev.type == "cuda" else 4)
        dense_copies = rotation_count(dev, w16.numel() * w16.element_size(), cap=64 if dev.type == "cuda" else 4)
        w16s = [w16] + [w16.clone() for _ in range(dense_copies - 1)]

        states: dict[str, list | str] = {}
        for k in chosen:
            why = k.check(layer, dtype, dev)
            if why:
                states[k.id] = "; ".join(why)
                continue
            layers = [layer] + [layer.clone() for _ in range(n_copies - 1)]
            states[k.id] = [k.prepare(lay) for lay in layers]

        for m in s.batch_sizes:
            if step:
                step(f"{shape.name} M={m}")
            gen = torch.Generator(device=dev).manual_seed(s.seed + m)
            xs = [torch.randn((m, shape.K), generator=gen, device=dev, dtype=torch.float32).to(dtype)
                  for _ in range(max(n_copies, dense_copies))]
            y64 = xs[0].to(torch.float64) @ w64.t()
            base_err = rel_err(F.linear(xs[0], w16), y64)
            flop = 2.0 * m * shape.N * shape.K
            io_bytes = (m * shape.K + m * shape.N) * 2
            dense_bytes = w16.numel() * 2 + io_bytes
            # An overflowing dense product (inf) is no baseline: every kernel would be within k x inf of it.
            overflow = "" if math.isfinite(base_err) else (f"the dense {s.dtype} product is not finite (the "
                                                           f"layer's outputs overflow {s.dtype})")
            if overflow:
                rows.append(Row(shape.name, shape.K, shape.N, m, DENSE, "failed", reason=overflow,
                                path=f"torch F.linear {s.dtype}"))
            else:
                t_dense = time_calls([(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, w16s)], dev,
                                     graphs=s.graphs, max_seconds=s.max_seconds)
                dense_row = Row(shape.name, shape.K, shape.N, m, DENSE, "ok", path=f"torch F.linear {s.dtype}",
                                rel_err=base_err, baseline_rel_err=base_err, median_us=t_dense.median_s * 1e6,
                                bytes=dense_bytes, rotation=len(w16s), graphs=t_dense.graphs)
                _rates(dense_row, flop, dense_bytes, t_dense.median_s, bw, t_dense.median_s)
                rows.append(dense_row)
            for k in chosen:
                st = states.get(k.id)
                if isinstance(st, str) or st is None:
                    reason = kern_info[k.id]["reason"] or st or "not prepared"
                    rows.append(Row(shape.name, shape.K, shape.N, m, k.id, "refused", reason=reason))
                    continue
                if overflow:
                    rows.append(Row(shape.name, shape.K, shape.N, m, k.id, "failed", path=k.describe(st[0], m),
                                    reason=f"not checked: {overflow}"))
                    continue
                row = Row(shape.name, shape.K, shape.N, m, k.id, "ok", path=k.describe(st[0], m),
                          baseline_rel_err=base_err)
                try:
                    out = torch.full((m, shape.N), float("nan"), dtype=dtype, device=dev)
                    y = k.forward(xs[0], st[0], out=out)
                    err = rel_err(y, y64)
                except Exception as e:  # noqa: BLE001 - a crashing kernel is a result to report
                    row.status, row.reason = "failed", f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    continue
                row.rel_err = err
                factor = k.error_factor(dtype)
                if not err <= max(factor * base_err, ERR_FLOOR):
                    row.status = "failed"
                    row.reason = (f"relative error {err:.3g} vs float64 oracle exceeds {factor:g} x the "
                                  f"dense {s.dtype} baseline's {base_err:.3g}")
                    rows.append(row)
                    continue
                lay = st[0].layer if hasattr(st[0], "layer") else layer
                q_bytes = lay.nbytes() + io_bytes
                t = time_calls([(lambda x=x, st_=st_, k=k: k.forward(x, st_)) for x, st_ in zip(xs, st)], dev,
                               graphs=s.graphs, max_seconds=s.max_seconds)
                row.median_us = t.median_s * 1e6
                row.bytes, row.rotation, row.graphs = q_bytes, len(st), t.graphs
                _rates(row, flop, q_bytes, t.median_s, bw, t_dense.median_s)
                rows.append(row)
            del xs
        del states, w16s, w64, w16, layer
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    be = roofline.b_eff(s.bits, s.weight_group, s.shapes[0].K)
    roof = {"formula": "M* = P * b_eff / (16 * BW)", "b_eff": be, "peak_flops": peak, "bandwidth": bw,
            "m_star_theory": roofline.m_star(peak, bw, be), "dense_ridge_theory": roofline.dense_ridge(peak, bw),
            "ideal_speedup_m1": 16.0 / be}
    report = BenchReport(s, info, roof, kern_info, rows)
    report.summary = summarize(report)
    apply_anchor(report, s.anchor, DENSE)
    return report


def _rates(row: Row, flop: float, nbytes: int, t: float, bw: float, t_dense: float) -> None:
    row.tflops = flop / t / 1e12
    row.gbs = nbytes / t / 1e9
    row.bw_fraction = nbytes / t / bw
    row.speedup_vs_dense = t_dense / t


def summarize(report: BenchReport) -> dict:
    """Per kernel and M: totals over all shapes (sum of times, bytes), and the measured M* per kernel.

    total_speedup_vs_dense = sum(dense times) / sum(kernel times) over the shapes where both ran: the
    speedup of a whole decoder layer's linear layers. A kernel refused or failed on some shapes sums the
    others: `shapes` of `shapes_total`, the rest named in `shapes_missing`, and its speedup divides dense's time
    on the same shapes. Its measured M* comes from the shapes it ran at every M (`m_star_shapes` of them), so
    a shape missing at one M does not bend the curve.
    """
    out: dict = {"per_m": {}, "m_star_measured": {}, "m_star_shapes": {}}
    by_key: dict[tuple[str, int], list[Row]] = {}
    for r in report.rows:
        by_key.setdefault((r.kernel, r.M), []).append(r)
    dense = {(r.shape, r.M): r for r in report.rows if r.kernel == DENSE}
    layer = {m: [sh for sh, m_ in dense if m_ == m] for m in {m_ for _, m_ in dense}}  # the shapes dense ran, per M
    bw = report.roofline["bandwidth"]
    ran: dict[str, dict[int, dict[str, float]]] = {}  # kernel -> M -> shape -> time
    for (kname, m), rs in sorted(by_key.items()):
        ok = [r for r in rs if r.status == "ok" and r.median_us]
        if not ok:
            continue
        t = sum(r.median_us for r in ok)
        td = sum(dense[(r.shape, m)].median_us for r in ok)
        b = sum(r.bytes for r in ok)
        done = {r.shape for r in ok}
        entry = {"shapes": len(ok), "shapes_total": len(layer.get(m, ())),
                 "shapes_missing": [sh for sh in layer.get(m, ()) if sh not in done],
                 "total_us": t, "total_speedup_vs_dense": td / t,
                 "total_gbs": b / (t * 1e-6) / 1e9, "total_bw_fraction": b / (t * 1e-6) / bw,
                 "min_speedup_vs_dense": min(r.speedup_vs_dense for r in ok),
                 "min_bw_fraction": min(r.bw_fraction for r in ok),
                 "max_bw_fraction": max(r.bw_fraction for r in ok)}
        out["per_m"].setdefault(kname, {})[str(m)] = entry
        ran.setdefault(kname, {})[m] = {r.shape: r.median_us for r in ok}
    for kname, per_m in ran.items():
        common = set.intersection(*(set(times) for times in per_m.values()))
        times = {m: sum(ts[sh] for sh in common) for m, ts in per_m.items()}
        out["m_star_measured"][kname] = roofline.measured_m_star(times) if common else None
        out["m_star_shapes"][kname] = len(common)
    return out
