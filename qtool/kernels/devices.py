"""Devices a kernel can be asked about: profiles from `configs/devices.yaml`, or the live machine.

`resolve_device("h100")` returns the H100 profile; `resolve_device("cpu")` reads this machine's CPU flags;
`resolve_device("cuda:1")` reads torch's properties of GPU 1 (a `DeviceError` naming the profiles when torch
sees no such device). A `Device` is plain data, so selection stays a pure function of it.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from qtool.errors import DeviceError
from qtool.kernels.decls import (
    is_cc,
    is_int,
    is_num,
    is_str,
    list_of,
    load_yaml,
    map_of,
    nullable,
    one_of,
    record,
    validate,
)
from qtool.paths import CONFIG_DIR

PROFILE_ROW = record({
    "description": is_str,
    "platform": one_of("cuda", "rocm", "cpu", "mps", "xpu", "npu"),
    "compute_capability": is_cc,
    "arch": is_str,
    "sm_count": is_int,
    "smem_optin_bytes": is_int,
    "memory_gb": is_num,
    "hbm_gbps": nullable(is_num),
    "peak_bf16_tflops": nullable(is_num),
    "peak_fp16_tflops": nullable(is_num),
    "peak_fp8_tflops": nullable(is_num),
    "cpu_flags": list_of(is_str),
    "source": is_str,
}, required=("platform",))

DEVICES_FILE = record({
    "schema": one_of("qtool.devices/v1"),
    "devices": map_of(is_str, PROFILE_ROW),
}, required=("schema", "devices"))

_CUDA_SPEC = re.compile(r"^cuda(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A device as kernel selection sees it.

    cc: compute capability (major, minor) for CUDA/ROCm, else None. smem_optin: largest opt-in shared memory
    per block in bytes. cpu_flags: lower-case /proc/cpuinfo names. live: read from this machine, so the
    software facts (torch ops, packages, torch version, OS) are known; for a profile they are None and the
    checks that need them become notes ("assumes ...").
    """

    name: str
    platform: str
    description: str = ""
    cc: tuple[int, int] | None = None
    arch: str | None = None
    sm_count: int | None = None
    smem_optin: int | None = None
    memory_gb: float | None = None
    hbm_gbps: float | None = None
    peak_bf16_tflops: float | None = None
    peak_fp16_tflops: float | None = None
    peak_fp8_tflops: float | None = None
    cpu_flags: frozenset[str] = frozenset()
    live: bool = False
    os: str | None = None
    torch_version: str | None = None
    torch_ops: frozenset[str] | None = None
    packages: frozenset[str] | None = None

    @property
    def cc_str(self) -> str | None:
        return None if self.cc is None else f"{self.cc[0]}.{self.cc[1]}"

    def to_dict(self) -> dict:
        return {
            "name": self.name, "platform": self.platform, "description": self.description,
            "compute_capability": self.cc_str, "arch": self.arch, "sm_count": self.sm_count,
            "smem_optin_bytes": self.smem_optin, "memory_gb": self.memory_gb, "hbm_gbps": self.hbm_gbps,
            "peak_bf16_tflops": self.peak_bf16_tflops, "peak_fp16_tflops": self.peak_fp16_tflops,
            "peak_fp8_tflops": self.peak_fp8_tflops, "cpu_flags": sorted(self.cpu_flags), "live": self.live,
        }


def _profile(name: str, row: dict) -> Device:
    return Device(
        name=name, platform=row["platform"], description=row.get("description", ""),
        cc=row.get("compute_capability"), arch=row.get("arch"), sm_count=row.get("sm_count"),
        smem_optin=row.get("smem_optin_bytes"), memory_gb=row.get("memory_gb"), hbm_gbps=row.get("hbm_gbps"),
        peak_bf16_tflops=row.get("peak_bf16_tflops"), peak_fp16_tflops=row.get("peak_fp16_tflops"),
        peak_fp8_tflops=row.get("peak_fp8_tflops"), cpu_flags=frozenset(row.get("cpu_flags", ())),
    )


def load_profiles(config_dir: Path | None = None) -> dict[str, Device]:
    """All profiles in `configs/devices.yaml`, validated, by name (cached)."""
    return dict(_profiles_cached(str((config_dir or CONFIG_DIR) / "devices.yaml")))


@lru_cache(maxsize=4)
def _profiles_cached(path: str) -> tuple[tuple[str, Device], ...]:
    p = Path(path)
    data = validate(load_yaml(p), DEVICES_FILE, p)
    return tuple((name, _profile(name, row)) for name, row in data["devices"].items())


def profile(name: str, config_dir: Path | None = None) -> Device:
    """The named profile, never the live machine (tests and planning use this)."""
    profiles = load_profiles(config_dir)
    if name not in profiles:
        raise _unknown(name, profiles)
    return profiles[name]


def resolve_device(spec: str, config_dir: Path | None = None) -> Device:
    """`cpu` and `cuda[:N]` read this machine; any other name is a profile from configs/devices.yaml."""
    spec = spec.strip().lower()
    profiles = load_profiles(config_dir)
    if spec == "cpu":
        return live_cpu(profiles.get("cpu"))
    m = _CUDA_SPEC.match(spec)
    if m:
        return live_cuda(int(m.group(1) or 0), profiles)
    if spec in profiles:
        return profiles[spec]
    raise _unknown(spec, profiles)


def _unknown(spec: str, profiles: dict[str, Device]) -> DeviceError:
    close = difflib.get_close_matches(spec, list(profiles), n=1, cutoff=0.5)
    guess = f"did you mean '{close[0]}'? " if close else ""
    return DeviceError(f"unknown device '{spec}'",
                       fix=f"{guess}profiles: {', '.join(profiles)}; or cpu / cuda:N for this machine")


def detect_cpu_flags() -> frozenset[str]:
    """Lower-case CPU feature flags of this machine (/proc/cpuinfo on Linux; torch's ISA level elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    try:
        import torch

        cap = torch.backends.cpu.get_cpu_capability().lower()  # e.g. "avx2", "avx512"
        return frozenset({cap})
    except Exception:  # noqa: BLE001 - no flag detection available: report no flags rather than guess
        return frozenset()


def _software() -> dict:
    """What this machine's Python environment provides: torch version and its private int4/int8 ops."""
    import torch

    ops = frozenset(n for n in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu",
                                "_weight_int8pack_mm", "_weight_int4pack_mm", "_scaled_mm", "_scaled_mm_v2")
                    if hasattr(torch.ops.aten, n))
    return {"torch_version": torch.__version__.split("+")[0], "torch_ops": ops,
            "os": sys.platform, "packages": installed_packages()}


def installed_packages() -> frozenset[str]:
    """Import names of the optional kernel packages that are importable here."""
    import importlib.util

    names = ("triton", "bitblas", "bitsandbytes", "conch", "humming", "mlx")
    return frozenset(n for n in names if importlib.util.find_spec(n) is not None)


def live_cpu(base: Device | None = None) -> Device:
    base = base or Device(name="cpu", platform="cpu")
    return replace(base, name="cpu", live=True, cpu_flags=detect_cpu_flags(), **_software())


def live_cuda(index: int, profiles: dict[str, Device] | None = None) -> Device:
    import torch

    names = ", ".join(profiles or ())
    if not torch.cuda.is_available():
        raise DeviceError(f"cuda:{index} requested but torch sees no CUDA/ROCm device here",
                          fix=f"plan for a profile instead: --device h100 (profiles: {names})")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"cuda:{index} requested but torch sees {count} device(s) (cuda:0..cuda:{count - 1})",
                          fix="pick an existing index or a profile name")
    props = torch.cuda.get_device_properties(index)
    rocm = getattr(torch.version, "hip", None) is not None
    smem = getattr(props, "shared_memory_per_block_optin", None)
    # Bandwidth and peaks are not readable through torch: borrow them from the profile whose name the
    # marketing name contains ("NVIDIA H100 80GB HBM3" -> h100), when there is one.
    squashed = props.name.lower().replace(" ", "").replace("-", "")
    twin = next((d for n, d in (profiles or {}).items() if d.platform in ("cuda", "rocm") and n in squashed), None)
    return Device(
        name=f"cuda:{index}", platform="rocm" if rocm else "cuda", description=props.name,
        cc=(props.major, props.minor),
        arch=getattr(props, "gcnArchName", None) if rocm else f"sm_{props.major}{props.minor}",
        sm_count=props.multi_processor_count, smem_optin=smem,
        memory_gb=round(props.total_memory / 1e9, 1), live=True,
        hbm_gbps=twin.hbm_gbps if twin else None,
        peak_bf16_tflops=twin.peak_bf16_tflops if twin else None,
        peak_fp16_tflops=twin.peak_fp16_tflops if twin else None,
        peak_fp8_tflops=twin.peak_fp8_tflops if twin else None,
        **_software(),
    )


def torch_device(spec: str | None) -> torch.device:  # noqa: F821 - torch loads only when a run needs it
    """The torch device a run uses (bench, kernels): 'cpu', 'cuda', 'cuda:N' of this machine, default cuda
    when torch sees one; DeviceError when it is not there. Planning (select) uses `resolve_device`, which
    also takes profile names."""
    import torch

    spec = spec.strip().lower() if spec else spec
    try:
        dev = torch.device(spec or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:  # torch's own message lists every backend it knows; the kernels run on two
        raise DeviceError(f"'{spec}' is not a device name", fix="use --device cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device '{spec}' requested but torch sees no CUDA device",
                              fix="use --device cpu, or run on a machine with a CUDA GPU")
        idx = cuda_index(dev)
        if idx >= torch.cuda.device_count():
            raise DeviceError(f"device '{spec}' requested but only {torch.cuda.device_count()} CUDA device(s)",
                              fix=f"use --device cuda:0..cuda:{torch.cuda.device_count() - 1}")
        dev = torch.device("cuda", idx)
    elif dev.type != "cpu":
        raise DeviceError(f"device '{spec}' is not supported by the kernels", fix="use --device cpu or cuda:N")
    return dev


def device_available_bytes(dev: torch.device) -> tuple[int, str]:  # noqa: F821 - torch loads only when a run needs it
    """(bytes a run may use on `dev`, where that number comes from): free memory on a GPU; on the CPU what the
    host leaves this process (qtool.io.memory)."""
    if dev.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(dev)
        return int(free), f"free on {dev}"
    from qtool.io.memory import available_bytes

    return available_bytes()


def cuda_index(dev: torch.device) -> int:  # noqa: F821 - torch loads only when a run needs it
    """The ordinal of a CUDA device: 'cuda' alone means torch's current device."""
    import torch

    return dev.index if dev.index is not None else torch.cuda.current_device()
