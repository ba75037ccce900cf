"""Sub-byte codes <-> int32 words.

Two layouts, both little-endian in the bit stream (FORMATS.md):
- continuous: code j of each run of 32 codes occupies stream bits [j*b, (j+1)*b) of the run's b words,
  so for b = 3, 5, 6, 7 some codes straddle two words;
- planar: each code is split into planes of widths that divide 32 (low plane first); per run of 32
  codes, each plane of width w fills w words, word k holding codes [k*32/w, (k+1)*32/w) at shifts w*j.

All functions pack along `dim` (default: last). Codes are uint8 holding values < 2^b; words are int32
(bit pattern, i.e. two's-complement view of the uint32 word).
"""

from __future__ import annotations

from qtool.errors import FormatError
from qtool.lazy import lazy_module

torch = lazy_module("torch")

# Plane widths, low plane first (FORMATS.md "GPTQ planar").
PLANES: dict[int, tuple[int, ...]] = {
    1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1), 8: (8,),
}

_U32 = 1 << 32


def to_int32(words64: torch.Tensor) -> torch.Tensor:
    """int64 holding values in [0, 2^32) -> int32 with the same bit pattern."""
    return torch.where(words64 >= (1 << 31), words64 - _U32, words64).to(torch.int32)


def to_uint32(words32: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns -> int64 values in [0, 2^32)."""
    return words32.to(torch.int64) & 0xFFFFFFFF


def _check_len(n: int, run: int, what: str) -> None:
    if n % run:
        raise FormatError(f"{what}: packed dimension {n} is not a multiple of {run}",
                          fix=f"pad the dimension to a multiple of {run}")


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if 32 % bits == 0:
        pf = 32 // bits
        _check_len(n, pf, f"{bits}-bit packing")
        c = codes.reshape(*lead, n // pf, pf).to(torch.int64)
        shifts = torch.arange(pf, dtype=torch.int64) * bits
        return to_int32((c << shifts).sum(-1))
    _check_len(n, 32, f"{bits}-bit packing")
    # General width: expand to a bit stream, then regroup 32 stream bits per word.
    c = codes.reshape(*lead, n // 32, 32, 1).to(torch.int64)
    bit = (c >> torch.arange(bits, dtype=torch.int64)) & 1  # [..., runs, 32, bits]
    stream = bit.reshape(*lead, n // 32, bits, 32)  # [..., runs, words, 32 bits]
    words = (stream << torch.arange(32, dtype=torch.int64)).sum(-1)
    return to_int32(words.reshape(*lead, (n // 32) * bits))


def _unpack_last(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Widths dividing 32 (a field never straddles a word), along the last dim."""
    lead = words.shape[:-1]
    pf = 32 // bits
    if words.shape[-1] * pf < n:
        raise FormatError(f"{words.shape[-1]} words hold {words.shape[-1] * pf} {bits}-bit codes, need {n}")
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    c = (to_uint32(words).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*lead, -1)[..., :n].to(torch.uint8)


def _unpack_runs(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 words [runs*bits, C] (bits not dividing 32) -> uint8 codes [n = runs*32, C], on the words'
    device. Code j of a run starts at stream bit j*bits: word j*bits // 32, shift j*bits % 32, continued in
    the next word when it straddles; each word is paired with its successor in int64, so one shift reads
    either case (memory: a few int64 copies of the words, not one per bit)."""
    _check_len(n, 32, f"{bits}-bit unpacking")
    if words.shape[0] * 32 != n * bits:
        raise FormatError(f"{words.shape[0]} words hold {words.shape[0] * 32 // bits} {bits}-bit codes, need {n}")
    runs = n // 32
    w = to_uint32(words).reshape(runs, bits, -1)
    nxt = torch.cat([w[:, 1:], torch.zeros_like(w[:, :1])], 1)
    pairs = w | (nxt << 32)  # [runs, bits, C]: 64 stream bits from each word on
    start = torch.arange(32, device=words.device, dtype=torch.int64) * bits
    codes = (pairs.index_select(1, start // 32) >> (start % 32)[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(n, -1).to(torch.uint8)


def _pack_dim(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Fast path for widths dividing 32: OR shifted int32 slices in place, along `dim`, without transposing.
    (ATen shifts signed integers through their unsigned type, so bit 31 is set without overflow.)"""
    pf = 32 // bits
    d = dim % codes.dim()
    n = codes.shape[d]
    _check_len(n, pf, f"{bits}-bit packing")
    c = codes.contiguous().reshape(*codes.shape[:d], n // pf, pf, *codes.shape[d + 1:])
    acc = c.select(d + 1, 0).to(torch.int32)
    for j in range(1, pf):
        acc |= c.select(d + 1, j).to(torch.int32) << (bits * j)
    return acc.contiguous()


def _unpack_dim(words: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    pf = 32 // bits
    d = dim % words.dim()
    nw = words.shape[d]
    if nw * pf < n:
        raise FormatError(f"{nw} words hold {nw * pf} {bits}-bit codes, need {n}")
    mask = (1 << bits) - 1
    parts = [((words >> (bits * j)) & mask).to(torch.uint8) for j in range(pf)]
    c = torch.stack(parts, dim=d + 1).reshape(*words.shape[:d], nw * pf, *words.shape[d + 1:])
    return c.narrow(d, 0, n).contiguous()


def pack_stream(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """uint8 codes [..., n, ...] -> int32 words [..., n*bits/32, ...] (continuous little-endian stream)."""
    if 32 % bits == 0:
        return _pack_dim(codes, bits, dim)
    c = codes.movedim(dim, -1)
    return _pack_last(c, bits).movedim(-1, dim).contiguous()


def unpack_stream(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """int32 words -> uint8 codes, the first n along `dim` (inverse of pack_stream)."""
    if 32 % bits == 0:
        return _unpack_dim(words, bits, n, dim)
    w = words.movedim(dim, 0)
    codes = _unpack_runs(w.reshape(w.shape[0], -1), bits, n)
    return codes.reshape(n, *w.shape[1:]).movedim(0, dim).contiguous()


def pack_planar(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """uint8 codes -> int32 words in planar layout (b words per 32 codes, planes low first)."""
    c = codes.movedim(dim, -1)
    n = c.shape[-1]
    _check_len(n, 32, f"{bits}-bit planar packing")
    lead = c.shape[:-1]
    parts, shift = [], 0
    for width in PLANES[bits]:
        plane = (c >> shift) & ((1 << width) - 1)
        parts.append(_pack_last(plane, width).reshape(*lead, n // 32, width))
        shift += width
    out = torch.cat(parts, dim=-1).reshape(*lead, (n // 32) * bits)
    return out.movedim(-1, dim).contiguous()


def unpack_planar(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """int32 planar words -> uint8 codes, n along `dim`."""
    w = words.movedim(dim, -1)
    _check_len(n, 32, f"{bits}-bit planar unpacking")
    lead = w.shape[:-1]
    if w.shape[-1] * 32 != n * bits:
        raise FormatError(f"{w.shape[-1]} planar words hold {w.shape[-1] * 32 // bits} {bits}-bit codes, need {n}")
    runs = w.reshape(*lead, n // 32, bits)
    out = torch.zeros(*lead, n // 32, 32, dtype=torch.int64)
    col, shift = 0, 0
    for width in PLANES[bits]:
        plane = _unpack_last(runs[..., col:col + width].contiguous(), width, 32).to(torch.int64)
        out |= plane << shift
        col += width
        shift += width
    return out.reshape(*lead, n).to(torch.uint8).movedim(-1, dim).contiguous()
