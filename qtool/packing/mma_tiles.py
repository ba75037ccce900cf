"""The "mma tile" layout of 4-bit weights read by the `cuda-w4a16` kernels (csrc/w4a16.cu).

Built once per layer (what an engine does at load time), from codes and group metadata; pure torch, any
device. Facts it rests on (PTX ISA, mma.m16n8k16 and wgmma.m64nNk16 with A in registers): in a warp, lane
l = 4g + t holds A-fragment registers a0 = (row g, k 2t, 2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8,
2t+9), a3 = (row g+8, k 2t+8, 2t+9) of a 16 x 16 tile; a wgmma warpgroup's warp w holds rows 16w..16w+15 the
same way. The weight is the A operand (rows = output features n), so one word per lane per k16 step carries
exactly its 8 fragment values, and a 16-byte load carries four steps (one 64-k block).

    qweight  int32 [N16, KB, 32, 4]   N16 = ceil(N/16), KB = ceil(K/64); [tile, block, lane, step]: tile-major,
                                     so a warp walking one tile's K (or the stream-K kernel walking tile after
                                     tile) reads one contiguous run of memory
    scales   int32 [N16, G, 8]        low/high 16 bits: scale of rows 16 tile + g and 16 tile + g + 8
    zeros    int32 [N16, G, 4]        16 zero points per tile, nibble r of words 0-1 = row 16 tile + r; 2-3 zero
                                     (padding: the kernel copies metadata in 16-byte pieces)
                                     Tile-major too: a warp walking a tile's K reads its groups' records in
                                     order, one contiguous run (group-major records scattered those reads
                                     over the whole table, bench.md fifth pass)
    gtab     int32 [KB * 4]           group of each 16-k step (valid when group_size % 16 == 0); kernels with one
                                     group per 64-k block find it by a shift instead

Nibble j of a word (bits 4j..4j+3), for lane (g, t), block kb, step s, k0 = 64 kb + 16 s:
    j = 4e + 2h + r  ->  (row 16 tile + g + 8r, k = k0 + 2t + e + 8h)
which is what the LOP3 extraction in the kernel expects: masks 0x000F000F / 0x00F000F0 on the word and on the
word >> 8 give (a0, a1, a2, a3) for fp16; (w >> 4i) & 0x000F000F gives a_i for bf16.
Rows past N and k past K are zero codes (with zero scales past N); the kernel never reads x past K.
"""

from __future__ import annotations

from qtool.lazy import lazy_module

torch = lazy_module("torch")

TILE_N = 16
BLOCK_K = 64


def padded(n: int, k: int) -> tuple[int, int]:
    """(N16, KB) for an [N, K] weight."""
    return -(-n // TILE_N), -(-k // BLOCK_K)


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [K, N] (values 0..15) -> int32 qweight [N16, KB, 32, 4] (the layout above)."""
    k, n = codes.shape
    n16, kb = padded(n, k)
    c = torch.zeros((kb * BLOCK_K, n16 * TILE_N), dtype=torch.int64, device=codes.device)
    c[:k, :n] = codes.to(torch.int64)
    # k = 64 kb + 16 s + 8 h + 2 t + e ; n = 16 tile + 8 r + g
    c = c.view(kb, 4, 2, 4, 2, n16, 2, 8)  # kb, s, h, t, e, tile, r, g
    c = c.permute(5, 0, 7, 3, 1, 4, 2, 6)  # tile, kb, g, t, s, e, h, r  -> nibble j = 4e + 2h + r
    c = c.reshape(n16, kb, 32, 4, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * 4
    words = (c << shifts).sum(-1)
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32).contiguous()


def untile_codes(qweight: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The inverse of tile_codes: int32 [N16, KB, 32, 4] -> uint8 codes [K, N]."""
    n16, kb = qweight.shape[0], qweight.shape[1]
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int64) * 4
    nib = (qweight.to(torch.int64).unsqueeze(-1) >> shifts) & 15  # kb, tile, lane, s, j
    nib = nib.view(n16, kb, 8, 4, 4, 2, 2, 2)  # tile, kb, g, t, s, e, h, r
    c = nib.permute(1, 4, 6, 3, 5, 0, 7, 2)  # kb, s, h, t, e, tile, r, g
    return c.reshape(kb * BLOCK_K, n16 * TILE_N)[:k, :n].to(torch.uint8).contiguous()


def tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """16-bit scales [G, N] (fp16 or bf16) -> int32 [N16, G, 8] (pairs of rows g, g + 8 per lane group)."""
    g, n = scales.shape
    n16 = -(-n // TILE_N)
    s = torch.zeros((g, n16 * TILE_N), dtype=scales.dtype, device=scales.device)
    s[:, :n] = scales
    s = s.view(torch.int16).view(g, n16, 2, 8).permute(1, 0, 3, 2).contiguous()  # tile, G, g, r
    return s.view(torch.int32).view(n16, g, 8)


def tile_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """Zero points [G, N] (0..15) -> int32 [N16, G, 4]: 16 nibbles per tile, row r at bits 4r of words 0-1."""
    g, n = zeros.shape
    n16 = -(-n // TILE_N)
    z = torch.zeros((g, n16 * TILE_N), dtype=torch.int64, device=zeros.device)
    z[:, :n] = zeros.to(torch.int64)
    z = z.view(g, n16, 2, 8)
    shifts = torch.arange(8, device=zeros.device, dtype=torch.int64) * 4
    words = (z << shifts).sum(-1)
    words = torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)
    return torch.cat([words, torch.zeros_like(words)], dim=-1).transpose(0, 1).contiguous()


def step_groups(k: int, group_size: int, n_groups: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """int32 [KB * 4]: the group of each 16-k step, clamped to the last group (the padding past K is multiplied
    by zero x), or None where a step would straddle two groups."""
    eff = k if group_size == -1 else group_size
    if n_groups > 1 and eff % 16:
        return None
    steps = torch.arange(-(-k // BLOCK_K) * 4, device=device)
    return (steps * 16 // eff).clamp_max(n_groups - 1).to(torch.int32)
