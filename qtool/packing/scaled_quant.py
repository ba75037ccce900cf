"""Block maxima and E4M3 / INT8 codes of a dense weight in C++ (csrc/scaled_quant.cpp), for the absmax quantizer
of float codes (qtool.quant.scaled.quantize_scaled), which calls these first and keeps its torch arithmetic
where they return None.

The torch arithmetic is about nine passes over memory per chunk of rows and torch's scalar float8 cast; the
C++ loops read each weight twice (once for the block maxima, once for the codes and the error sums) as bf16 or
fp32 and give the same codes (tests compare them bit for bit). The scales stay with the caller: it turns the
maxima into stored scales with its own torch code and hands each block's scale and fp32 reciprocal in. Built on
first use like csrc/e4m3_dequant.cpp; QTOOL_SCALED_QUANT_EXT=0 turns it off, =1 makes a build failure an error.
"""

from __future__ import annotations

import ctypes

from qtool.lazy import lazy_module
from qtool.packing.cext import CExtension

torch = lazy_module("torch")  # packing loads without torch (qtool/lazy.py)

MIN_WEIGHTS = 1 << 20  # below ~1 M weights torch is fast enough and no compiler is needed
ELEMENTS = {"e4m3": 0, "int8": 1}
_EXT = CExtension("scaled_quant.cpp", abi=2, env="QTOOL_SCALED_QUANT_EXT")
ISAS = {2: "AVX-512", 1: "AVX2", 0: "portable C++"}


def applies(weight: torch.Tensor, element: str) -> bool:
    """Whether the C++ loops take this weight (then `row_amax` and `quantize` return no None, unless the
    library cannot be built)."""
    return (element in ELEMENTS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (weight.numel() >= MIN_WEIGHTS or _EXT.mode == "on") and _EXT.mode != "off")


def _source(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(contiguous fp32 or bf16 rows, dtype code): fp16 rows are widened to fp32 (exact) by the caller's chunk."""
    if w.dtype == torch.float16:
        w = w.float()
    return w.contiguous(), 1 if w.dtype == torch.bfloat16 else 0


def row_amax(w: torch.Tensor, group: int, threads: int | None = None, level: int = -1, bo: int = 1
             ) -> tuple[torch.Tensor, int] | None:
    """(max |w| over each block of `bo` rows and `group` columns, float32 [ceil(R / bo), ceil(C / group)]; how
    many rows hold a NaN or infinite weight), or None where the library is unavailable. threads: OpenMP threads
    (None: torch's count); level: the loops to run (ISAS; -1 the best this CPU has)."""
    lib = _library()
    if lib is None:
        return None
    src, code = _source(w)
    rows, cols = src.shape
    out = torch.empty(-(-rows // bo), -(-cols // group), dtype=torch.float32)
    bad = lib.qtool_row_amax(src.data_ptr(), code, rows, cols, bo, group, out.data_ptr(), _threads(threads), level)
    return out, int(bad)


def quantize(w: torch.Tensor, element: str, bo: int, group: int, scales: torch.Tensor, recips: torch.Tensor,
             codes: torch.Tensor, threads: int | None = None, level: int = -1) -> tuple[float, float] | None:
    """codes[r, c] = the element code of w[r, c] * recips[r // bo, c // group], clamped and rounded to nearest
    even (written into `codes`, uint8 view of [R, C]); returns (sum ((code - w * recip) * scale)^2, sum w^2), or
    None where the library is unavailable. scales, recips: float32 [ceil(R / bo), ceil(C / group)]."""
    lib = _library()
    if lib is None:
        return None
    src, code = _source(w)
    rows, cols = src.shape
    s, r = scales.contiguous(), recips.contiguous()
    if codes.dtype != torch.uint8 or not codes.is_contiguous() or tuple(codes.shape) != (rows, cols):
        raise ValueError("codes must be a contiguous uint8 [rows, cols] view")
    sums = (ctypes.c_double * 2)(0.0, 0.0)
    lib.qtool_scaled_quant(src.data_ptr(), code, rows, cols, bo, group, s.data_ptr(), r.data_ptr(),
                           ELEMENTS[element], codes.data_ptr(), sums, _threads(threads), level)
    return float(sums[0]), float(sums[1])


def isa() -> int | None:
    """The best loops this CPU runs (a key of ISAS), or None where the library is unavailable."""
    lib = _library()
    return None if lib is None else int(lib.qtool_scaled_quant_isa())


def status() -> str:
    """One line for reports: which path quantizes E4M3 / INT8 codes."""
    level = isa() if _EXT.lib is not None else None
    return _EXT.status() + (f", {ISAS[level]} loops" if level is not None else "")


def _threads(threads: int | None) -> int:
    return max(1, torch.get_num_threads() if threads is None else threads)


def _library():
    lib = _EXT.library()
    if lib is not None and not hasattr(lib, "_qtool_typed"):
        lib.qtool_row_amax.restype = ctypes.c_int64
        lib.qtool_row_amax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.qtool_scaled_quant_isa.restype = ctypes.c_int
        lib.qtool_scaled_quant.restype = None
        lib.qtool_scaled_quant.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_double),
                                           ctypes.c_int, ctypes.c_int]
        lib._qtool_typed = True
    return lib
