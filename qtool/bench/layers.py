"""Random quantized layers for tests and benchmarks: random normal weights, min-max quantized per group.

Built on the target device (a 70B MLP layer has 235 M weights; building it on the host would dominate the
benchmark's run time). On any device other than the CPU, g_idx and zeros are always explicit tensors so
that `dequantize(plain, torch.float64)`, the oracle, runs where the data is.
"""

from __future__ import annotations

import torch

from qtool.formats.plain import Plain


def random_plain(n: int, k: int, *, bits: int = 4, group_size: int = 128, dtype: torch.dtype = torch.float16,
                 act_order: bool = False, sym: bool = False, device: str | torch.device = "cpu",
                 seed: int = 0) -> Plain:
    """A Plain for W[n, k] ~ N(0, 1), quantized min-max per (row, group).

    act_order: g_idx is a random permutation of the trivial map (each group keeps exactly group_size rows,
    as GPTQ's act-order produces). sym: zeros are the midpoint 2^(bits-1) and scales cover max |w|.
    Scales are `dtype`; codes are rounded against the rounded scales, as real packers do.
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn((n, k), generator=gen, device=dev, dtype=torch.float32)
    g = k if group_size == -1 else group_size
    n_groups = -(-k // g)
    g_idx = torch.arange(k, device=dev, dtype=torch.int64) // g
    if act_order:
        perm = torch.randperm(k, generator=gen, device=dev)
        g_idx = g_idx[torch.argsort(perm)]
    index = g_idx.unsqueeze(0).expand(n, k)
    lo = torch.zeros((n, n_groups), device=dev).scatter_reduce(1, index, w, "amin", include_self=False)
    hi = torch.zeros((n, n_groups), device=dev).scatter_reduce(1, index, w, "amax", include_self=False)
    top = (1 << bits) - 1
    if sym:
        mid = 1 << (bits - 1)
        scale = (torch.maximum(lo.abs(), hi.abs()) / (mid - 1)).clamp_min(1e-4).to(dtype)
        zeros = torch.full((n, n_groups), mid, device=dev, dtype=torch.uint8)
    else:
        scale = ((hi - lo) / top).clamp_min(1e-4).to(dtype)
        zeros = torch.round(-lo / scale.float()).clamp(0, top).to(torch.uint8)
    s_full = scale.float().gather(1, index)
    z_full = zeros.float().gather(1, index)
    codes = torch.round(w / s_full + z_full).clamp(0, top).to(torch.uint8)
    explicit = dev.type != "cpu"
    keep_g = g_idx.to(torch.int32) if (act_order or explicit) else None
    keep_z = None if (sym and not explicit) else zeros
    return Plain(codes, scale, keep_z, keep_g, bits, group_size)


def random_scaled(n: int, k: int, *, strategy: str = "tensor", dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu", seed: int = 0, block: int = 128):
    """A ScaledPlain of E4M3 codes for W[n, k] ~ N(0, 1): absmax fp32 scales per tensor, per output channel
    or per `block` x `block` tile (ragged edge tiles allowed), built on `device` (qtool.quant.scaled does the
    same on the host, in bounded chunks, for real checkpoints; a 70B layer would take it seconds per shape).
    """
    from qtool.formats.scaled import ScaledPlain

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn((n, k), generator=gen, device=dev, dtype=torch.float32)
    bo, bi = {"tensor": (n, k), "channel": (1, k), "block": (block, block)}[strategy]
    nr, nc = -(-n // bo), -(-k // bi)
    a = torch.nn.functional.pad(w.abs(), (0, nc * bi - k, 0, nr * bo - n)).view(nr, bo, nc, bi).amax(dim=(1, 3))
    scales = (a.clamp_min(1e-12) / 448.0).to(torch.float32)
    s_full = scales.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    codes = (w / s_full).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    del w, s_full
    blk = {"tensor": (-1, -1), "channel": (1, -1), "block": (block, block)}[strategy]
    return ScaledPlain(codes, "e4m3", scales, "fp32", blk, compute="float32",
                       out_dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32"))
