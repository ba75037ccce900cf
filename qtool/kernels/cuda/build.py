"""Build csrc/w4a16.cu (and the headers it includes) into a cubin for one GPU architecture, once, cached by content.

    cubin_for((9, 0)) -> bytes     # nvcc -cubin -gencode arch=compute_90a,code=sm_90a (wgmma kernels included)
    cubin_for((8, 0)) -> bytes     # arch=compute_80,code=sm_80 (mma.sync kernels only)

The cache key is the SHA-256 of every csrc/*.cu and *.cuh file plus the nvcc command, so an edited kernel or
header is rebuilt and a stale cubin is never loaded. Cache folder: $QTOOL_CUDA_CACHE, else ~/.cache/qtool/cuda. A cubin built elsewhere (same
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
MAIN = "w4a16.cu"  # the translation unit; it includes the csrc/*.cuh headers
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
    """Every file the build can include: csrc/*.cu and csrc/*.cuh (all hashed into the cache key)."""
    return sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh"))


def cache_key(cc: tuple[int, int]) -> str:
    h = hashlib.sha256()
    for name in sources():
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join((*FLAGS, gencode(cc))).encode())
    return h.hexdigest()[:20]


def cubin_path(cc: tuple[int, int]) -> Path:
    return cache_dir() / f"w4a16-{cache_key(cc)}-sm{cc[0]}{cc[1]}.cubin"


def sources_present() -> bool:
    return CSRC.is_dir() and (CSRC / MAIN).is_file()


def cubin_for(cc: tuple[int, int]) -> bytes:
    """The cubin for compute capability `cc`, built with nvcc on first use."""
    if not sources_present():
        raise DeviceError(f"{CSRC}/w4a16.cu not found (qtool installed without csrc/)",
                          fix="install qtool from its source tree (pip install -e .)")
    path = cubin_path(cc)
    if path.is_file():
        return path.read_bytes()
    nvcc = find_nvcc()
    if nvcc is None:
        raise DeviceError("cuda-w4a16 needs nvcc once to build its kernels, and none was found",
                          fix="install the CUDA toolkit (or set QTOOL_NVCC), or use --kernels triton-w4a16")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [nvcc, *FLAGS, "-gencode", gencode(cc), "-o", str(out), str(CSRC / MAIN)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["?"])[-1]
            raise DeviceError(f"nvcc failed building csrc/w4a16.cu for sm_{cc[0]}{cc[1]}: {last}",
                              fix="check the CUDA toolkit version (12.4+ for sm_90a), or use --kernels triton-w4a16")
        os.replace(out, path)  # atomic: a concurrent build never sees half a file
    return path.read_bytes()
