"""Marlin tile permutations: tables computed once per bit width, and the moves that apply them.

Marlin (IST-DASLab; vLLM's `gptq_marlin_repack`) stores the weight so that one 32-bit load per warp lane
yields exactly the values the lane's mma.m16n8k16 B fragment needs. For a 16(k) x 8(n) B tile, lane t owns
column t/4 and rows 2*(t%4) + {0, 1, 8, 9}. The layout (FORMATS.md, "Marlin"):

    q [K, N] codes  -> view [K/16, 16, N/16, 16] -> permute (0, 2, 1, 3) -> [K/16, N*16]
                    -> each run of 1024 values re-ordered by `weight_perm(bits)`
                    -> every pf = 32/bits consecutive values packed into one int32, value i at bits [b*i, b*(i+1))

A run of 1024 values is 4 tiles of 16x16, i.e. a 16-row x 64-column block of q, so the whole layout is a
fixed permutation of each [16, 64] block; `block_perm` gives it in block coordinates (row*64 + col).

Scales (and AWQ-Marlin zeros) are permuted along N in runs of 64 (`scale_perm`, grouped) or 32
(`scale_perm_single`, channelwise) because each thread loads the scales of the columns it owns.

Everything here works on little-endian hosts only (int32 words are viewed as bytes).
This module knows bits and permutations, not formats; qtool.formats.marlin uses it.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache, lru_cache

from qtool.errors import FormatError
from qtool.lazy import lazy_module
from qtool.packing.cext import CExtension

torch = lazy_module("torch")

TILE = 16              # Marlin tile edge (GPTQ_MARLIN_TILE)
BLOCK_N = 64           # columns covered by one 1024-entry permutation run (4 tiles of 16)
BLOCK = TILE * BLOCK_N  # 1024 codes per run
BITS = (4, 8)

# Interleave inside one packed word: the kernel's LOP3 dequant reads nibbles <0,4,1,5> then <2,6,3,7>
# (4-bit) or bytes <0,2> then <1,3> (8-bit), so lane values are stored in that order.
INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("qtool.packing.marlin_perm views int32 words as bytes and needs a little-endian host")


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise FormatError(f"Marlin holds 4- or 8-bit codes, not {bits}-bit", fix="use --bits 4 or 8")


# --- tables ----------------------------------------------------------------------------------------------
@cache
def weight_perm(bits: int) -> torch.Tensor:
    """int64 [1024]: entry i = index, inside one 1024-run of the tile-major row, of the value stored i-th.

    The tile-major index of (tile j of the run, row, col) is 256*j + 16*row + col. Lane t (0..31) takes,
    for each of the 4 tiles j, its column c = t//4 and c+8 at rows 2*(t%4) + {0, 1, 8, 9}; every group of
    pf values is then interleaved with INTERLEAVE[bits].
    """
    _check_bits(bits)
    order = []
    for t in range(32):
        col, r = t // 4, t % 4
        lane = [16 * row + col + 8 * half
                for half in (0, 1) for row in (2 * r, 2 * r + 1, 2 * r + 8, 2 * r + 9)]
        for j in range(4):
            order.extend(256 * j + p for p in lane)
    perm = torch.tensor(order, dtype=torch.int64)
    il = torch.tensor(INTERLEAVE[bits], dtype=torch.int64)
    return perm.view(-1, len(il))[:, il].reshape(-1).contiguous()


@cache
def block_perm(bits: int) -> torch.Tensor:
    """int64 [1024]: `weight_perm` re-expressed as row*64 + col inside one [16, 64] block of q [K, N]."""
    p = weight_perm(bits)
    tile, row, col = p // 256, (p // 16) % 16, p % 16
    return (row * BLOCK_N + tile * TILE + col).contiguous()


@cache
def block_perm_inverse(bits: int) -> torch.Tensor:
    """int64 [1024]: inverse of `block_perm` (stored position of each block element)."""
    return torch.argsort(block_perm(bits))


@cache
def scale_perm() -> torch.Tensor:
    """int64 [64]: grouped-scale order, [i + 8*j for i in 0..7 for j in 0..7]."""
    return torch.tensor([i + 8 * j for i in range(8) for j in range(8)], dtype=torch.int64)


@cache
def scale_perm_single() -> torch.Tensor:
    """int64 [32]: channelwise-scale order, [2*i + j for i in 0..3 for j in (0, 1, 8, 9, 16, 17, 24, 25)]."""
    return torch.tensor([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)],
                        dtype=torch.int64)


@cache
def _inverse(name: str) -> torch.Tensor:
    return torch.argsort({"scale": scale_perm, "single": scale_perm_single}[name]())


# --- codes <-> B (general path, from unpacked codes) ------------------------------------------------------
def _check_kn(k: int, n: int, what: str) -> None:
    if k % TILE or n % BLOCK_N:
        raise FormatError(f"{what}: Marlin needs K % 16 == 0 and N % 64 == 0, got K={k}, N={n}",
                          fix="pad the shape (qtool pads automatically when packing)")


def codes_to_b(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes q [K, N] (k-major, as GPTQ stores them) -> int32 B [K/16, N*16*bits/32]."""
    _check_bits(bits)
    k, n = q.shape
    _check_kn(k, n, "codes_to_b")
    blocks = q.reshape(k // TILE, TILE, n // BLOCK_N, BLOCK_N).permute(0, 2, 1, 3).reshape(
        k // TILE, n // BLOCK_N, BLOCK)
    out = blocks.index_select(2, block_perm(bits))  # [K/16, N/64, 1024] in stored order
    if bits == 4:
        out = out[..., 0::2] | (out[..., 1::2] << 4)  # value 2i -> low nibble of byte i
    return out.contiguous().view(torch.int32).reshape(k // TILE, -1)


def b_to_codes(b: torch.Tensor, bits: int, k: int, n: int) -> torch.Tensor:
    """int32 B [K/16, N*16*bits/32] -> uint8 codes q [K, N] (inverse of codes_to_b)."""
    _check_bits(bits)
    _check_kn(k, n, "b_to_codes")
    pf = 32 // bits
    if tuple(b.shape) != (k // TILE, n * TILE // pf):
        raise FormatError(f"Marlin B shape {tuple(b.shape)} does not match K={k}, N={n} at {bits}-bit "
                          f"(expected {(k // TILE, n * TILE // pf)})")
    raw = b.contiguous().view(torch.uint8).reshape(k // TILE, n // BLOCK_N, -1)
    if bits == 4:
        raw = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(k // TILE, n // BLOCK_N, BLOCK)
    blocks = raw.index_select(2, block_perm_inverse(bits))
    return blocks.reshape(k // TILE, n // BLOCK_N, TILE, BLOCK_N).permute(0, 2, 1, 3).reshape(k, n)


# --- scales and zeros ------------------------------------------------------------------------------------
def permute_scales(s: torch.Tensor, channelwise: bool) -> torch.Tensor:
    """scales [n_groups, N] -> same shape, columns permuted in runs of 64 (grouped) or 32 (channelwise)."""
    perm = scale_perm_single() if channelwise else scale_perm()
    return s.reshape(-1, perm.numel()).index_select(1, perm).reshape(s.shape)


def unpermute_scales(s: torch.Tensor, channelwise: bool) -> torch.Tensor:
    """Inverse of permute_scales."""
    inv = _inverse("single" if channelwise else "scale")
    return s.reshape(-1, inv.numel()).index_select(1, inv).reshape(s.shape)


def zeros_to_marlin(z: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 true zeros [n_groups, N] -> int32 [n_groups, N*bits/32] (AWQ-Marlin layout).

    Columns permuted like grouped scales (always `scale_perm`, even for one group), then each run of pf
    values interleaved with INTERLEAVE[bits], then packed along N, value i of a run at bits [b*i, b*(i+1)).
    """
    _check_bits(bits)
    g, n = z.shape
    zp = permute_scales(z, channelwise=False)
    il = torch.tensor(INTERLEAVE[bits], dtype=torch.int64)
    zp = zp.reshape(-1, il.numel()).index_select(1, il).reshape(g, n)
    if bits == 4:
        zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
    return zp.contiguous().view(torch.int32)


def zeros_from_marlin(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [n_groups, N*bits/32] -> uint8 true zeros [n_groups, N] (inverse of zeros_to_marlin)."""
    _check_bits(bits)
    g = words.shape[0]
    if words.shape[1] * 32 // bits != n:
        raise FormatError(f"Marlin qzeros shape {tuple(words.shape)} does not hold {n} {bits}-bit columns")
    raw = words.contiguous().view(torch.uint8)
    if bits == 4:
        raw = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(g, n)
    il_inv = torch.argsort(torch.tensor(INTERLEAVE[bits], dtype=torch.int64))
    zp = raw.reshape(-1, il_inv.numel()).index_select(1, il_inv).reshape(g, n)
    return unpermute_scales(zp, channelwise=False)


# --- GPTQ words <-> B (fast path: bytes move, codes are never unpacked) ----------------------------------
# A Marlin word takes its codes from whole bytes of the GPTQ words: at 8-bit each code is a byte, and at
# 4-bit the two codes of one GPTQ byte (rows 2r, 2r+1 of a column) always land in the same Marlin word,
# at nibbles p and p+4. So B = a byte gather of the GPTQ qweight, followed at 4-bit by one fixed nibble
# shuffle inside each word. Both are cheap word operations on data that never leaves its packed form.
@cache
def _block_byte_index(bits: int) -> torch.Tensor:
    """int64 [16*64*bits/8]: for one 16-row x 64-column block, the GPTQ source byte of each B byte.

    Source bytes are numbered h*256 + col*4 + byte for word row h (16*bits/32 of them), column col.
    At 4-bit the B bytes are numbered before the nibble shuffle (`_unzip_nibbles_`).
    """
    pf = 32 // bits
    bp = block_perm(bits)
    row, col = bp // BLOCK_N, bp % BLOCK_N
    if bits == 8:
        return ((row // pf) * 256 + col * 4 + row % pf).contiguous()
    nib = (row // pf) * 512 + col * 8 + row % pf  # source nibble of each stored value
    words = nib.view(-1, 8)
    lo, hi = words[:, :4], words[:, 4:]  # stored nibble p and p+4 share one source byte
    if not (torch.equal(hi, lo + 1) and bool((lo % 2 == 0).all())):  # pragma: no cover - table invariant
        raise RuntimeError("Marlin 4-bit permutation does not keep GPTQ bytes whole")
    return (lo // 2).reshape(-1).contiguous()


@lru_cache(maxsize=8)
def _row_byte_index(bits: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, inverse) int64 [N*16*bits/8]: `_block_byte_index` spread over one whole row of B.

    One B row (16 rows of q) is gathered from the 16*bits/32 GPTQ word rows it covers, viewed as one
    contiguous byte row of length rows*N*4.
    """
    blk = _block_byte_index(bits)
    word_row, rest = blk // 256, blk % 256  # rest = col*4 + byte inside the block
    m = torch.arange(n // BLOCK_N, dtype=torch.int64).unsqueeze(1)
    idx = (word_row * (n * 4) + m * (BLOCK_N * 4) + rest).reshape(-1)
    return idx, torch.argsort(idx)


def _swap_(x: torch.Tensor, tmp: torch.Tensor, mask: int, shift: int) -> None:
    """In place: exchange the bit fields selected by `mask` with those `shift` bits above them."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_xor_(x).bitwise_and_(mask)
    x.bitwise_xor_(tmp)
    tmp.bitwise_left_shift_(shift)
    x.bitwise_xor_(tmp)


def _unzip_nibbles_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """int32 words in place: nibbles [n0..n7] -> [n0, n2, n4, n6, n1, n3, n5, n7]."""
    _swap_(x, tmp, 0x00F000F0, 4)
    _swap_(x, tmp, 0x0000FF00, 8)


def _zip_nibbles_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """Inverse of _unzip_nibbles_."""
    _swap_(x, tmp, 0x0000FF00, 8)
    _swap_(x, tmp, 0x00F000F0, 4)


# Bytes of B handled per step of the torch path: bounds its temporaries. Measured on 2 cores (4096 x 14336,
# 4-bit): 16 MiB steps run at ~150 MB/s, near the whole-tensor speed; 256 KiB steps at 5 MB/s, because
# torch's per-op overhead then dominates.
_CHUNK_BYTES = 1 << 24


def gptq_to_b(qweight: torch.Tensor, bits: int, perm: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ qweight int32 [K*bits/32, N] (continuous LE stream along K) -> Marlin B int32 [K/16, N*16*bits/32].

    perm: optional int64/int32 [K], act-order row gather (B holds rows q[perm]); with it the rows are
    unpacked and re-packed (a row gather cannot move whole words), so it is the slower path.
    out:  optional contiguous int32 tensor of B's shape to write into (a streaming caller reuses one
          buffer: freshly allocated memory costs a page fault per 4 KiB on first touch).
    Equal, byte for byte, to codes_to_b(unpack_stream(qweight)).
    """
    _check_bits(bits)
    qweight = qweight.cpu()  # a checkpoint tensor; the extension reads host memory
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise FormatError(f"GPTQ qweight must be int32 2-D, got {qweight.dtype} {tuple(qweight.shape)}")
    pf = 32 // bits
    k, n = qweight.shape[0] * pf, qweight.shape[1]
    _check_kn(k, n, "gptq_to_b")
    out = _check_out(out, (k // TILE, n * TILE // pf))
    if perm is not None:
        from qtool.packing.bitstream import unpack_stream

        q = unpack_stream(qweight, bits, k, dim=0).index_select(0, perm.to(torch.int64))
        return out.copy_(codes_to_b(q, bits))
    if (ext := _fast(qweight.numel())) is not None:
        return ext.gptq_to_b(qweight, bits, k, n, out)
    return _gptq_to_b_torch(qweight, bits, out)


def _check_out(out: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.int32)
    if out.dtype != torch.int32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise FormatError(f"out must be a contiguous int32 tensor of shape {shape}, got {out.dtype} "
                          f"{tuple(out.shape)}")
    return out


def _gptq_to_b_torch(qweight: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    pf = 32 // bits
    k, n = qweight.shape[0] * pf, qweight.shape[1]
    idx, _ = _row_byte_index(bits, n)
    src = qweight.contiguous().view(torch.uint8).view(k // TILE, -1)  # one row = 16 rows of q
    out = _check_out(out, (k // TILE, n * TILE // pf))
    out_bytes = out.view(torch.uint8)
    step = max(1, _CHUNK_BYTES // src.shape[1])
    tmp = torch.empty(step, out.shape[1], dtype=torch.int32) if bits == 4 else None
    for r0 in range(0, k // TILE, step):
        r1 = min(r0 + step, k // TILE)
        torch.index_select(src[r0:r1], 1, idx, out=out_bytes[r0:r1])
        if tmp is not None:
            _unzip_nibbles_(out[r0:r1], tmp[: r1 - r0])
    return out


def b_to_gptq(b: torch.Tensor, bits: int, k: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Marlin B int32 [K/16, N*16*bits/32] -> GPTQ qweight int32 [K*bits/32, N] (inverse of gptq_to_b
    without perm; act-order rows are restored by the caller from the codes). out: as in gptq_to_b."""
    _check_bits(bits)
    b = b.cpu()
    pf = 32 // bits
    _check_kn(k, n, "b_to_gptq")
    if tuple(b.shape) != (k // TILE, n * TILE // pf) or b.dtype != torch.int32:
        raise FormatError(f"Marlin B {b.dtype} {tuple(b.shape)} does not match K={k}, N={n} at {bits}-bit "
                          f"(expected int32 {(k // TILE, n * TILE // pf)})")
    out = _check_out(out, (k * bits // 32, n))
    if (ext := _fast(b.numel())) is not None:
        return ext.b_to_gptq(b, bits, k, n, out)
    return _b_to_gptq_torch(b, bits, k, n, out)


def _b_to_gptq_torch(b: torch.Tensor, bits: int, k: int, n: int, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    pf = 32 // bits
    _, inv = _row_byte_index(bits, n)
    out = _check_out(out, (k // pf, n))
    dst = out.view(torch.uint8).view(k // TILE, -1)
    step = max(1, _CHUNK_BYTES // dst.shape[1])
    work = torch.empty(step, b.shape[1], dtype=torch.int32)
    tmp = torch.empty_like(work) if bits == 4 else None
    for r0 in range(0, k // TILE, step):
        r1 = min(r0 + step, k // TILE)
        w = work[: r1 - r0]
        w.copy_(b[r0:r1])
        if tmp is not None:
            _zip_nibbles_(w, tmp[: r1 - r0])
        torch.index_select(w.view(torch.uint8), 1, inv, out=dst[r0:r1])
    return out


# --- optional C++ extension --------------------------------------------------------------------------------
# csrc/marlin_repack.cpp does the same byte moves in one pass: ~1 GB/s against the torch path's ~0.15 GB/s
# on two cores (benchmarks/results/repack.md), which a copy-speed repack needs. It is plain C ABI, built on
# first use by torch.utils.cpp_extension and called through ctypes; any failure falls back to torch, which
# gives identical bytes. QTOOL_MARLIN_EXT=0 turns it off, =1 makes a build failure an error.
_EXT_MIN_WORDS = 1 << 18  # below ~1 MiB the torch path is fast enough and no compiler is needed
_EXT = CExtension("marlin_repack.cpp", abi=1, env="QTOOL_MARLIN_EXT")


class _Ext:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        for name in ("qtool_gptq_to_marlin_4", "qtool_marlin_to_gptq_4",
                     "qtool_gptq_to_marlin_8", "qtool_marlin_to_gptq_8"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]

    def gptq_to_b(self, qweight: torch.Tensor, bits: int, k: int, n: int, out: torch.Tensor) -> torch.Tensor:
        src = qweight.contiguous()
        getattr(self.lib, f"qtool_gptq_to_marlin_{bits}")(src.data_ptr(), out.data_ptr(), k, n,
                                                            torch.get_num_threads())
        return out

    def b_to_gptq(self, b: torch.Tensor, bits: int, k: int, n: int, out: torch.Tensor) -> torch.Tensor:
        src = b.contiguous()
        getattr(self.lib, f"qtool_marlin_to_gptq_{bits}")(src.data_ptr(), out.data_ptr(), k, n,
                                                            torch.get_num_threads())
        return out


def use_extension(mode: str | None) -> bool:
    """Choose the path for gptq_to_b / b_to_gptq: "on" (build now; raise if impossible), "off" (torch
    only), None (default: QTOOL_MARLIN_EXT, else try the extension for large tensors). Returns whether the
    extension is active."""
    _EXT.reset(mode)
    return mode == "on" and _extension(required=True) is not None


def extension_status() -> str:
    """One line for reports: which path converts Marlin words."""
    return _EXT.status()


_wrapped: dict = {}


def _extension(required: bool = False) -> _Ext | None:
    lib = _EXT.library(required)
    if lib is None:
        return None
    if _wrapped.get("lib") is not lib:
        _wrapped.update(lib=lib, ext=_Ext(lib))
    return _wrapped["ext"]


def _fast(numel: int) -> _Ext | None:
    return _extension() if numel >= _EXT_MIN_WORDS or _EXT.mode == "on" else None
