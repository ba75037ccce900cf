"""Timing: warm-up, CUDA events (host clock on the CPU), median over samples, rotating buffers.

One *round* calls each of `calls` once; each call owns its own weight copy and input, so consecutive calls
never find their weight in L2 when the copies together exceed it (`rotation_count` sizes that). A sample
times one round (or a CUDA-graph replay of it) and divides by the number of calls; the result is the
median sample.

With graphs=True the round is captured once in a CUDA graph and replayed: that removes the Python launch
cost (about 10-20 us per Triton launch, longer than a 4 MB weight takes to stream on an H200), which is
what a serving engine sees at decode time, where it also replays graphs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_CALLS_PER_ROUND = 24


@dataclass(frozen=True)
class Timing:
    median_s: float
    samples: int
    calls_per_sample: int
    graphs: bool  # whether the timed round was a CUDA-graph replay

    def to_dict(self) -> dict:
        return {"median_us": self.median_s * 1e6, "samples": self.samples,
                "calls_per_sample": self.calls_per_sample, "graphs": self.graphs}


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return 32 << 20


def rotation_count(device: torch.device, bytes_per_copy: int, cap: int = 64) -> int:
    """Copies of (weight + input) so that one round streams >= 3x the L2 (at least 2, at most cap)."""
    want = math.ceil(3 * l2_bytes(device) / max(bytes_per_copy, 1))
    return max(2, min(cap, want))


def time_calls(calls: list[Callable[[], object]], device: torch.device, *, graphs: bool = False,
               min_samples: int = 25, max_seconds: float = 1.0) -> Timing:
    """Median seconds per call over rounds of `calls` (see the module docstring)."""
    reps = max(1, math.ceil(MIN_CALLS_PER_ROUND / len(calls))) if device.type == "cuda" else 1
    round_calls = calls * reps

    def one_round() -> None:
        for c in round_calls:
            c()

    if device.type != "cuda":
        one_round()  # warm-up
        samples: list[float] = []
        t_end = time.perf_counter() + max_seconds
        while len(samples) < 3 or (len(samples) < min_samples and time.perf_counter() < t_end):
            t0 = time.perf_counter()
            one_round()
            samples.append((time.perf_counter() - t0) / len(round_calls))
        samples.sort()
        return Timing(samples[len(samples) // 2], len(samples), len(round_calls), False)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, allocate workspaces, settle clocks
            one_round()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)

    replay = one_round
    used_graph = False
    if graphs:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                one_round()
            g.replay()
            torch.cuda.synchronize(device)
            replay = g.replay
            used_graph = True
        except Exception:  # noqa: BLE001 - a kernel that cannot be captured is timed eagerly instead
            torch.cuda.synchronize(device)
            replay = one_round

    for _ in range(2):
        replay()
    samples = []
    t_end = time.perf_counter() + max_seconds
    while len(samples) < 5 or (len(samples) < min_samples and time.perf_counter() < t_end):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / len(round_calls))
    samples.sort()
    return Timing(samples[len(samples) // 2], len(samples), len(round_calls), used_graph)
