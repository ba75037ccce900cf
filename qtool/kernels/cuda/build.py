"""Build a csrc/*.cu translation unit (and the headers it may include) into a cubin for one GPU architecture, once,
cached by content.

    cubin_for((9, 0)) -> bytes     # csrc/w4a16.cu: nvcc -cubin -gencode arch=compute_90a,code=sm_90a (wgmma kernels)
    cubin_for((8, 0)) -> bytes     # arch=compute_80,code=sm_80 (mma.sync kernels only)
    cubin_for((9, 0), "fp8_gemv.cu")   # the FP8 weight-only GEMV (qtool/kernels/fp8_gemv.py)

The cache key is the SHA-256 of the unit, every csrc/*.cuh header and the nvcc command, so an edited kernel or
header is rebuilt and a stale cubin is never loaded; an edit to one unit leaves the other units' cubins valid. Cache folder: $QTOOL_CUDA_CACHE, else ~/.cache/qtool/cuda. A cubin built elsewhere (same
sources, same key) can be copied into the cache: that is how the benchmarks carry a build to a GPU machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from qtool.errors import DeviceError

CSRC = Path(__file__).resolve().parents[3] / "csrc"
MAIN = "w4a16.cu"  # cuda-w4a16's translation unit; it includes the csrc/*.cuh headers
FLAGS = ("-cubin", "-O3", "-std=c++17", "-lineinfo")


def gencode(cc: tuple[int, int]) -> str:
    """Hopper gets the arch-specific target (wgmma needs sm_90a); others their own SASS."""
    major, minor = cc
    if (major, minor) == (9, 0):
        return "arch=compute_90a,code=sm_90a"
    return f"arch=compute_{major}{minor},code=sm_{major}{minor}"


def find_nvcc() -> str | None:
    for cand in (os.environ.get("QTOOL_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("QTOOL_CUDA_CACHE") or Path.home() / ".cache" / "qtool" / "cuda")


def sources() -> list[str]:
    """Every file a build can read: csrc/*.cu and csrc/*.cuh."""
    return sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh"))


def cache_key(cc: tuple[int, int], unit: str = MAIN) -> str:
    """Hash of `unit`, every header (any unit may include any of them) and the nvcc command."""
    h = hashlib.sha256()
    for name in [unit, *(n for n in sources() if n.endswith(".cuh"))]:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join((*FLAGS, gencode(cc))).encode())
    return h.hexdigest()[:20]


def cubin_path(cc: tuple[int, int], unit: str = MAIN) -> Path:
    return cache_dir() / f"{Path(unit).stem}-{cache_key(cc, unit)}-sm{cc[0]}{cc[1]}.cubin"


def sources_present(unit: str = MAIN) -> bool:
    return CSRC.is_dir() and (CSRC / unit).is_file()


def cubin_for(cc: tuple[int, int], unit: str = MAIN) -> bytes:
    """The cubin of csrc/`unit` for compute capability `cc`, built with nvcc on first use."""
    if not sources_present(unit):
        raise DeviceError(f"{CSRC}/{unit} not found (qtool installed without csrc/)",
                          fix="install qtool from its source tree (pip install -e .)")
    path = cubin_path(cc, unit)
    if path.is_file():
        return path.read_bytes()
    nvcc = find_nvcc()
    if nvcc is None:
        raise DeviceError(f"csrc/{unit} needs nvcc once to build its kernels, and none was found",
                          fix="install the CUDA toolkit (or set QTOOL_NVCC), or choose another kernel with --kernels")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [nvcc, *FLAGS, "-gencode", gencode(cc), "-o", str(out), str(CSRC / unit)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["?"])[-1]
            raise DeviceError(f"nvcc failed building csrc/{unit} for sm_{cc[0]}{cc[1]}: {last}",
                              fix="check the CUDA toolkit version (12.4+ for sm_90a), or choose another kernel with --kernels")
        os.replace(out, path)  # atomic: a concurrent build never sees half a file
    return path.read_bytes()
