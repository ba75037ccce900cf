"""E4M3 codes times fp32 scales in one pass on the CPU (csrc/e4m3_dequant.cpp), for the dequantizer of float
codes (qtool.formats.scaled.dequantize), which calls `dequant` first and keeps its torch arithmetic otherwise.

The torch arithmetic (codes.to(float32) * scale, then one rounding to bf16) is four passes over memory and
torch's scalar float8 conversion; on two cores that dequantized an FP8 checkpoint several times slower than
copying it (benchmarks/results/fp.md). The C++ loop reads each code byte once, looks its value up in a
256-entry table (every E4M3 value is exact in fp32), multiplies by its scale in fp32 and rounds once to the
output: the same IEEE operations in the same order, so the same bits (tests compare them). It is built on
first use by torch.utils.cpp_extension (plain C ABI, called through ctypes), like csrc/marlin_repack.cpp;
any failure to build falls back to torch. QTOOL_E4M3_EXT=0 turns it off, =1 makes a build failure an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

from qtool.lazy import lazy_module

torch = lazy_module("torch")  # packing loads without torch (qtool/lazy.py)

_CSRC = Path(__file__).resolve().parents[2] / "csrc" / "e4m3_dequant.cpp"
_MIN_CODES = 1 << 20  # below ~1 M codes torch is fast enough and no compiler is needed
_ABI = 2
_CFLAGS = ("-O3", "-fopenmp")
_state: dict = {"lib": None, "tried": False, "error": None}


def dequant(codes: torch.Tensor, scales: torch.Tensor, group: int, out_dtype: torch.dtype) -> torch.Tensor | None:
    """W[r, c] = value(codes[r, c]) * scales[r, c // group], formed in fp32, rounded once to out_dtype.

    codes:  float8_e4m3fn [R, C] on the CPU;  scales: float32 [R, ceil(C / group)];  out_dtype: float32 or
    bfloat16. Returns None where the extension does not apply or is unavailable (the caller computes the
    same bits with torch)."""
    if (out_dtype not in (torch.float32, torch.bfloat16) or codes.dtype != torch.float8_e4m3fn
            or scales.dtype != torch.float32 or codes.device.type != "cpu" or codes.dim() != 2
            or codes.numel() < _MIN_CODES and os.environ.get("QTOOL_E4M3_EXT") != "1"):
        return None
    rows, cols = codes.shape
    if scales.shape != (rows, -(-cols // group)):
        return None
    lib = _library()
    if lib is None:
        return None
    q = codes.contiguous().view(torch.uint8)
    s = scales.contiguous()
    out = torch.empty(rows, cols, dtype=out_dtype)
    fn = lib.qtool_e4m3_dequant_bf16 if out_dtype == torch.bfloat16 else lib.qtool_e4m3_dequant_f32
    fn(q.data_ptr(), s.data_ptr(), out.data_ptr(), rows, cols, group, torch.get_num_threads())
    return out


def count_masked(codes: torch.Tensor, mask: int, value: int) -> int | None:
    """How many code bytes b have (b & mask) == value (the NaN check of float codes), in one pass; None
    where the extension is unavailable (the caller counts with numpy)."""
    if codes.device.type != "cpu" or codes.element_size() != 1 or codes.numel() < _MIN_CODES:
        return None
    lib = _library()
    if lib is None:
        return None
    q = codes.contiguous()
    return int(lib.qtool_count_masked(q.data_ptr(), q.numel(), mask, value, torch.get_num_threads()))


def status() -> str:
    """One line for reports: which path dequantizes E4M3 codes."""
    if _state["lib"] is not None:
        return f"C++ ({_CSRC.name})"
    return f"torch (extension unavailable: {_state['error']})" if _state["error"] else "torch"


def _library():
    mode = os.environ.get("QTOOL_E4M3_EXT", "")
    if mode == "0":
        return None
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["lib"] = _build()
        except Exception as e:  # noqa: BLE001 - the torch path gives the same bits
            _state["error"] = " ".join(str(e).split())[:200]
            if mode == "1":
                raise RuntimeError(f"cannot build {_CSRC}: {_state['error']}") from e
    return _state["lib"]


def _build():
    if not _CSRC.is_file():
        raise FileNotFoundError(f"{_CSRC} not found (installed without csrc/)")
    key = hashlib.sha256(_CSRC.read_bytes() + repr((_CFLAGS, torch.__version__)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("QTOOL_CACHE") or Path.home() / ".cache" / "qtool")
    build = root / "ext" / f"e4m3_dequant-{key}"
    lib_path = build / "qtool_e4m3_dequant.so"
    lib = None
    if lib_path.is_file():
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError:
            lib = None  # half-written by a concurrent build: build (cpp_extension locks) and retry
    if lib is None:
        import contextlib
        import io

        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):  # compiler chatter; the core never prints
            path = cpp_extension.load(name="qtool_e4m3_dequant", sources=[str(_CSRC)],
                                      extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                                      build_directory=str(build), is_python_module=False, verbose=False)
        lib = ctypes.CDLL(path)
    lib.qtool_e4m3_dequant_abi.restype = ctypes.c_int
    if lib.qtool_e4m3_dequant_abi() != _ABI:
        raise RuntimeError(f"stale build of {_CSRC.name}")
    for name in ("qtool_e4m3_dequant_f32", "qtool_e4m3_dequant_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int]
    lib.qtool_count_masked.restype = ctypes.c_int64
    lib.qtool_count_masked.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib
