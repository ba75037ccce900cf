"""The few CUDA driver-API calls the `cuda-w4a16` kernels need, through ctypes.

Why the driver API: the kernels are a cubin (compiled by nvcc, build.py) loaded into the context torch
already made current, and launched on torch's current stream, so nothing is compiled against torch's headers
(no host compiler, no ABI coupling to the installed torch) and CUDA-graph capture works as for any launch.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from qtool.errors import DeviceError

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padding to 8 bytes, a 64-byte value union (8-byte aligned)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class CUlaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), for cuLaunchKernelEx."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def ex_config(grid: tuple[int, int, int], block: int, smem: int, stream: int, attrs: ctypes.Array,
              pdl: bool, cluster: tuple[int, int, int]) -> CUlaunchConfig:
    """A cuLaunchKernelEx launch with its attributes written into `attrs` (kept alive by the caller): pdl, the
    kernel may start before the previous kernel in the stream ends (programmatic stream serialization; it
    waits for it with griddepcontrol.wait, csrc/common.cuh pdl_wait); cluster, the thread-block cluster's CTAs
    along x, y, z (none where all are 1)."""
    n = 0
    if pdl:
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value[0] = 1  # programmaticStreamSerializationAllowed (an int at offset 0 of the union)
        n += 1
    if cluster != (1, 1, 1):
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[n].value[0] = cluster[0] | (cluster[1] << 32)  # the union's {x, y, z} unsigned ints
        attrs[n].value[1] = cluster[2]
        n += 1
    return CUlaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, smem, ctypes.c_void_p(stream),
                        ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), n)


class TensorMap(ctypes.Structure):
    """CUtensorMap (cuda.h): 128 opaque bytes, passed to a kernel by value (a __grid_constant__ parameter)."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


# cuda.h enums: CU_TENSOR_MAP_DATA_TYPE_UINT16 (a 2-byte copy: fp16 and bf16 alike) and _UINT32,
# CU_TENSOR_MAP_SWIZZLE_NONE and _128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B and _256B (INTERLEAVE_NONE and
# FLOAT_OOB_FILL_NONE are 0: out-of-bounds reads give 0)
TMAP_UINT16, TMAP_UINT32, TMAP_SWIZZLE_NONE, TMAP_SWIZZLE_128B, TMAP_L2_128B, TMAP_L2_256B = 1, 2, 0, 3, 2, 3


def _tensor_map(dtype: int, ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
                swizzle: int, l2: int) -> TensorMap:
    """cuTensorMapEncodeTiled: dims and box innermost first, the byte strides of every dim but the innermost."""
    buf = (ctypes.c_uint8 * 192)()  # the driver writes the map at a 64-byte aligned address
    at = (ctypes.addressof(buf) + 63) & ~63
    u64, u32, n = ctypes.c_uint64, ctypes.c_uint32, len(dims)
    _check(_lib().cuTensorMapEncodeTiled(ctypes.c_void_p(at), dtype, n, ctypes.c_void_p(ptr), (u64 * n)(*dims),
                                         (u64 * (n - 1))(*strides), (u32 * n)(*box), (u32 * n)(*[1] * n), 0,
                                         swizzle, l2, 0),
           f"cuTensorMapEncodeTiled({'x'.join(map(str, dims))}, box {'x'.join(map(str, box))})")
    out = TensorMap()
    ctypes.memmove(ctypes.addressof(out), at, 128)
    return out


def x_tensor_map(ptr: int, rows: int, cols: int, box_rows: int) -> TensorMap:
    """The tensor map of a row-major 2-byte matrix [rows][cols] at device address ptr (16-byte aligned, cols % 8
    == 0) read in boxes of 64 columns x box_rows rows, swizzled by 128 bytes (csrc/wgmma.cuh, TMA_X)."""
    return _tensor_map(TMAP_UINT16, ptr, (cols, rows), (cols * 2,), (64, box_rows), TMAP_SWIZZLE_128B, TMAP_L2_128B)


def tile_tensor_map(ptr: int, tiles: int, records: int, words: int, box_tiles: int) -> TensorMap:
    """The tensor map of a tile-major array [tiles][records][words] of 4-byte words at ptr (16-byte aligned,
    words % 4 == 0) read in boxes of one record of box_tiles adjacent tiles, unswizzled (csrc/wgmma.cuh, TMA_W:
    the weights' 64-k blocks, the scale and zero records)."""
    return _tensor_map(TMAP_UINT32, ptr, (words, records, tiles), (words * 4, records * words * 4),
                       (words, 1, box_tiles), TMAP_SWIZZLE_NONE, TMAP_L2_256B)


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # pragma: no cover - only without a driver, where torch sees no GPU either
        raise DeviceError(f"cannot load the CUDA driver (libcuda.so.1): {e}", fix="install the NVIDIA driver") from e
    vp, u = ctypes.c_void_p, ctypes.c_uint
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(CUlaunchConfig), vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    i = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [vp, i, u, vp, u64p, u64p, u32p, u32p, i, i, i, i]
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(i), vp, ctypes.POINTER(CUlaunchConfig)]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise DeviceError(f"CUDA driver call {what} failed: {(name.value or b'?').decode()} ({rc})",
                          fix="rerun with QTOOL_DEBUG=1 and report it")


class Module:
    """A cubin loaded into the current context of one device."""

    def __init__(self, image: bytes, device: torch.device):
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # makes torch's (primary) context current
            ctx = ctypes.c_void_p()
            _check(_lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                raise DeviceError(f"no current CUDA context on {device}", fix="report it")
            self._mod = ctypes.c_void_p()
            _check(_lib().cuModuleLoadData(ctypes.byref(self._mod), image), "cuModuleLoadData")
        self.device = device
        self._funcs: dict[str, ctypes.c_void_p] = {}
        self._smem: dict[str, int] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        f = self._funcs.get(name)
        if f is None:
            f = ctypes.c_void_p()
            _check(_lib().cuModuleGetFunction(ctypes.byref(f), self._mod, name.encode()),
                   f"cuModuleGetFunction({name})")
            self._funcs[name] = f
        return f

    def _opt_in(self, name: str, f: ctypes.c_void_p, smem: int) -> None:
        if smem > 48 * 1024 and self._smem.get(name, 0) < smem:  # above 48 KB a kernel must opt in
            _check(_lib().cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                   f"cuFuncSetAttribute({name}, {smem} B)")
            self._smem[name] = smem

    def max_active_clusters(self, name: str, block: int, smem: int, cluster: tuple[int, int, int]) -> int:
        """How many thread-block clusters of these dimensions the device holds at once for `name` launched with
        this block and shared memory (cuOccupancyMaxActiveClusters: it counts the SMs of each GPC, which a
        cluster cannot span)."""
        f = self.function(name)
        self._opt_in(name, f, smem)
        attrs = (LaunchAttribute * 2)()
        cfg = ex_config(cluster, block, smem, 0, attrs, False, cluster)
        n = ctypes.c_int()
        with torch.cuda.device(self.device):
            _check(_lib().cuOccupancyMaxActiveClusters(ctypes.byref(n), f, ctypes.byref(cfg)),
                   f"cuOccupancyMaxActiveClusters({name}, {cluster})")
        return n.value

    def launch(self, name: str, grid: tuple[int, int, int], block: int, smem: int, args: list,
               pdl: bool = False, cluster: tuple[int, int, int] = (1, 1, 1)) -> None:
        """Launch `name` on torch's current stream of this module's device; args are ctypes values. pdl: as a
        programmatic dependent launch (sm_90+; the kernel must wait with griddepcontrol.wait before it reads
        what earlier kernels write). cluster: CTAs per thread-block cluster along x, y, z (sm_90+; each a divisor
        of the grid's)."""
        f = self.function(name)
        self._opt_in(name, f, smem)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        if pdl or cluster != (1, 1, 1):
            attrs = (LaunchAttribute * 2)()
            cfg = ex_config(grid, block, smem, stream, attrs, pdl, cluster)
            _check(_lib().cuLaunchKernelEx(ctypes.byref(cfg), f, params, None), f"cuLaunchKernelEx({name})")
            return
        _check(_lib().cuLaunchKernel(f, grid[0], grid[1], grid[2], block, 1, 1, smem, ctypes.c_void_p(stream),
                                     params, None), f"cuLaunchKernel({name})")
