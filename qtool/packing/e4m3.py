"""E4M3 codes times fp32 scales in one pass on the CPU (csrc/e4m3_dequant.cpp), for the dequantizer of float
codes (qtool.formats.scaled.dequantize), which calls `dequant` first and keeps its torch arithmetic otherwise.

The torch arithmetic (codes.to(float32) * scale, then one rounding to bf16) is four passes over memory and
torch's scalar float8 conversion; on two cores that dequantized an FP8 checkpoint several times slower than
copying it (benchmarks/results/fp.md). The C++ loop reads each code byte once, looks its value up in a
256-entry table (every E4M3 value is exact in fp32), or where the CPU has AVX-512 forms it from its bits 16
codes at a time (the same values; the table's lookups are gathers there), multiplies by its block's scale in fp32 and rounds once to the output: the same IEEE operations in the
same order, so the same bits (tests compare them). It reads the block scales as stored (no per-row copy) and
counts the NaN codes on the way, so a caller that refuses them needs no second pass. It is built on first use
by torch.utils.cpp_extension (plain C ABI, called through ctypes), like csrc/marlin_repack.cpp; any failure to
build falls back to torch. QTOOL_E4M3_EXT=0 turns it off, =1 makes a build failure an error.
"""

from __future__ import annotations

import ctypes

from qtool.lazy import lazy_module
from qtool.packing.cext import CExtension

torch = lazy_module("torch")  # packing loads without torch (qtool/lazy.py)

_MIN_CODES = 1 << 20  # below ~1 M codes torch is fast enough and no compiler is needed
_EXT = CExtension("e4m3_dequant.cpp", abi=4, env="QTOOL_E4M3_EXT")


def dequant(codes: torch.Tensor, scales: torch.Tensor, group: int, out_dtype: torch.dtype, bo: int = 1,
            first: int = 0) -> torch.Tensor | None:
    """W[r, c] = value(codes[r, c]) * scales[(first + r) // bo, c // group], formed in fp32, rounded once to
    out_dtype.

    codes:  float8_e4m3fn [R, C] on the CPU;  scales: float32 [ceil((first + R) / bo), ceil(C / group)] (the
    block rows of the code rows, as stored); out_dtype: float32 or bfloat16. Returns None where the extension
    does not apply or is unavailable (the caller computes the same bits with torch)."""
    got = dequant_counted(codes, scales, group, out_dtype, bo, first)
    return None if got is None else got[0]


def dequant_counted(codes: torch.Tensor, scales: torch.Tensor, group: int, out_dtype: torch.dtype, bo: int = 1,
                    first: int = 0, threads: int | None = None, level: int = -1,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
    """`dequant` and the number of NaN codes (S.1111.111) it met, or None where it does not apply. threads: the
    loop's threads (None: torch's count); level: 0 the portable loop, else the best this CPU runs (isa());
    out: a contiguous [R, C] tensor of out_dtype to write into (None: a new one)."""
    if (out_dtype not in (torch.float32, torch.bfloat16) or codes.dtype != torch.float8_e4m3fn
            or scales.dtype != torch.float32 or codes.device.type != "cpu" or codes.dim() != 2
            or codes.numel() < _MIN_CODES and _EXT.mode != "on"):
        return None
    rows, cols = codes.shape
    if bo < 1 or not 0 <= first < bo or scales.shape != (-(-(first + rows) // bo), -(-cols // group)):
        return None
    lib = _library()
    if lib is None:
        return None
    q = codes.contiguous().view(torch.uint8)
    s = scales.contiguous()
    if out is None:
        out = torch.empty(rows, cols, dtype=out_dtype)
    elif out.dtype != out_dtype or tuple(out.shape) != (rows, cols) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {out_dtype} [{rows}, {cols}] tensor")
    fn = lib.qtool_e4m3_dequant_bf16 if out_dtype == torch.bfloat16 else lib.qtool_e4m3_dequant_f32
    nans = fn(q.data_ptr(), s.data_ptr(), out.data_ptr(), rows, cols, group, bo, first,
              max(1, torch.get_num_threads() if threads is None else threads), level)
    return out, int(nans)


def isa() -> int | None:
    """1 where the AVX-512 loop runs, 0 the portable one; None where the library is unavailable."""
    lib = _library()
    return None if lib is None else int(lib.qtool_e4m3_dequant_isa())


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
    return _EXT.status()


def _library():
    lib = _EXT.library()
    if lib is not None and not hasattr(lib, "_qtool_typed"):
        for name in ("qtool_e4m3_dequant_f32", "qtool_e4m3_dequant_bf16"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        lib.qtool_e4m3_dequant_isa.restype = ctypes.c_int
        lib.qtool_count_masked.restype = ctypes.c_int64
        lib.qtool_count_masked.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int]
        lib._qtool_typed = True
    return lib
