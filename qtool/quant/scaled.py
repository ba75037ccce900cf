"""Quantizers producing the float/int8 canonical form `ScaledPlain` (qtool.formats.scaled).

    quantize_scaled(weight float [O, I], element "e4m3"|"int8"|..., block (bo, bi), scale_type "fp32"|"bf16"|
                    "fp16", compute, out_dtype, method "rtn"|"mse") -> ScaledPlain

Scales are absmax scales, s = amax(block) / max(element) (the rule of DeepSeek's `act_quant`/`weight_quant`,
transformers' FineGrainedFP8 and compressed-tensors' minmax observer for symmetric schemes), rounded to the
scale type *before* the codes are computed so that dequantize is exactly what the codes mean. A block of
zeros gets s = 1 (its codes are 0, and no scale is 0). Codes are w / s rounded to nearest-even in the element
type, clamped to its finite range first (whether torch's E4M3 cast saturates depends on the build). `mse`
tries shrinking each block's range by RATIOS and keeps, per block, the ratio with the least squared error (1.0 first, so never worse than
rtn); it helps int8, whose steps are uniform, more than E4M3, whose relative precision is the same everywhere.

Rows are worked in chunks of about CHUNK_ELEMENTS weights, whole block rows at a time, so memory stays bounded.
"""

from __future__ import annotations

import torch

from qtool.errors import InputError, NotRepresentable, UsageError
from qtool.formats.scaled import COMPUTE_DTYPES, ELEMENTS, SCALE_TYPES, ScaledPlain, scale_grid

METHODS = ("rtn", "mse")
# 1.0 first (exactly rtn), then shrinking ranges; per-block choice.
RATIOS = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8, 0.75, 0.7)
CHUNK_ELEMENTS = 1 << 20  # float32 work per chunk: 4 MiB, two buffers
NATIVE_CHUNK = 1 << 22  # weights per call of the C++ loops: their codes and maxima stay bounded
# Scale types a dense quantizer here can produce from an absmax (the small-float scale types need a global
# scale or a power-of-two rule: their formats' quantizers own that).
LINEAR_SCALES = ("fp32", "bf16", "fp16")


def _where(name: str | None) -> str:
    return f" for '{name}'" if name else ""


def _codes(x: torch.Tensor, element: str) -> torch.Tensor:
    """float32 values already divided by the scale -> codes in the element's storage dtype (x is consumed):
    clamped to the element's symmetric range, then rounded (int8) or cast (floats), as the final pass does."""
    x.clamp_(-ELEMENTS[element].max, ELEMENTS[element].max)
    if element == "int8":
        return x.round_().to(torch.int8)
    return x.to(getattr(torch, ELEMENTS[element].storage))


def _block_amax(a: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    """|w| float32 [R, I] -> [ceil(R / bo), ceil(I / bi)] max per block (ragged edges padded with zeros):
    along the contiguous inputs first, then across the block's rows."""
    r, i = a.shape
    nr, nc = -(-r // bo), -(-i // bi)
    if nc * bi != i:
        a = torch.nn.functional.pad(a, (0, nc * bi - i))
    m = a.view(r, nc, bi).amax(-1)
    if bo == 1:
        return m
    if nr * bo != r:
        m = torch.nn.functional.pad(m, (0, 0, 0, nr * bo - r))
    return m.view(nr, bo, nc).amax(1)


def _expand(s: torch.Tensor, r: int, i: int, bo: int, bi: int) -> torch.Tensor:
    """[nr, nc] per-block values -> [r, i] per weight."""
    return s.repeat_interleave(bo, 0)[:r].repeat_interleave(bi, 1)[:, :i]


def _finite_scale(amax: torch.Tensor, top: float, scale_type: str, name: str | None) -> torch.Tensor:
    """_stored_scale, refused with the reason where a block's range needs a scale the type cannot hold."""
    s = _stored_scale(amax, top, scale_type)
    if not torch.isfinite(s).all():
        raise NotRepresentable(f"max |w| = {float(amax.max()):.6g} needs a scale beyond {scale_type}'s range",
                               tensor=name, fix="use --dtype bf16 scales or --exclude this module")
    return s


def _stored_scale(amax: torch.Tensor, top: float, scale_type: str, ratio: float = 1.0) -> torch.Tensor:
    """absmax -> the scale as stored (scale_type dtype), and 1 where the block is all zeros."""
    dtype = getattr(torch, SCALE_TYPES[scale_type].storage)
    s = (amax * ratio / top).to(dtype)
    tiny = torch.finfo(dtype).tiny
    return torch.where(amax == 0, torch.ones((), dtype=dtype), torch.where(s > 0, s, torch.full((), tiny, dtype=dtype)))


def quantize_scaled(weight: torch.Tensor, element: str = "e4m3", block: tuple[int, int] = (128, 128),
                    scale_type: str = "fp32", compute: str = "float32", out_dtype: str = "bfloat16",
                    method: str = "rtn", name: str | None = None, meta: dict | None = None,
                    stats: dict | None = None, codes: torch.Tensor | None = None,
                    threads: int | None = None, maxima: tuple[torch.Tensor, int] | None = None) -> ScaledPlain:
    """Quantize weight [O, I] (fp16/bf16/fp32) into a ScaledPlain (module docstring). name: for errors only.

    stats: when a dict, receives "err2" = sum (W - Ŵ)^2 and "ref2" = sum W^2 (float32 work, float64 sums),
    measured while each chunk is in cache (pack reports sqrt(err2 / ref2) without a second pass).
    codes: a contiguous [O, I] tensor of the element's storage dtype to write the codes into (a caller that
    reuses one saves the page faults of fresh memory), or None for a new one. threads: how many threads the
    C++ loops use (None: torch's count); the torch path uses torch's. maxima: block_maxima(weight, block) made
    beforehand (pack makes it as it reads the weight), so the C++ path reads the weight once more, not twice;
    the torch path ignores it.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise UsageError(f"can only quantize 2-D float weights [out, in], got {weight.dtype} "
                         f"{tuple(weight.shape)}{_where(name)}")
    if method not in METHODS:
        raise UsageError(f"unknown method '{method}' for {element} codes", fix="use --method rtn or mse")
    if element not in ELEMENTS or element == "e2m1":
        raise UsageError(f"quantize_scaled writes e4m3, e5m2 or int8 codes, not '{element}'")
    if scale_type not in LINEAR_SCALES or compute not in COMPUTE_DTYPES:
        raise UsageError(f"scales must be one of {LINEAR_SCALES} computed in one of {COMPUTE_DTYPES}")
    o, i = weight.shape
    bo, bi = (o if block[0] == -1 else block[0]), (i if block[1] == -1 else block[1])
    if bo <= 0 or bi <= 0:
        raise UsageError(f"block {block} must hold positive sizes or -1")
    # a block past the weight's edge is the weight's extent: the same scale grid, and nothing padded to its size
    bo, bi = min(bo, max(o, 1)), min(bi, max(i, 1))
    top = ELEMENTS[element].max
    sdtype = getattr(torch, SCALE_TYPES[scale_type].storage)
    storage = getattr(torch, ELEMENTS[element].storage)
    if codes is None:
        codes = torch.empty(o, i, dtype=storage)
    elif codes.dtype != storage or tuple(codes.shape) != (o, i) or not codes.is_contiguous():
        raise ValueError(f"codes must be a contiguous {storage} [{o}, {i}] tensor")
    scales = torch.empty(scale_grid(o, i, block), dtype=sdtype)
    meta = {"method": method, **(meta or {})}
    if o == 0 or i == 0:
        return ScaledPlain(codes, element, scales.fill_(1), scale_type, tuple(block), compute, out_dtype,
                           meta=meta)
    if method == "rtn" and _quantize_native(weight, element, bo, bi, top, scale_type, codes, scales, stats, name,
                                            threads, maxima):
        return ScaledPlain(codes, element, scales, scale_type, tuple(block), compute, out_dtype, meta=meta)
    tensor_amax = None
    if bo == o and bi == i and o > 1:  # per-tensor: one amax first, then the codes chunk by chunk like per-channel
        tensor_amax = torch.linalg.vector_norm(weight.to("cpu"), float("inf")).to(torch.float32).reshape(1, 1)
        if not torch.isfinite(tensor_amax).all():
            _refuse_nonfinite(weight, 0, o, name)
    step_bo = 1 if tensor_amax is not None else bo
    step = max(step_bo, CHUNK_ELEMENTS // max(i, 1) // step_bo * step_bo)
    rows = min(step, o)
    # reused buffers: fresh memory costs a page fault per 4 KiB on first touch, as much as the work itself
    x_buf = torch.empty(rows, i, dtype=torch.float32)
    a_buf = torch.empty(rows, i, dtype=torch.float32)
    err2 = ref2 = 0.0
    for r0 in range(0, o, step):
        r1 = min(o, r0 + step)
        n = r1 - r0
        x, a = x_buf[:n], a_buf[:n]
        x.copy_(weight[r0:r1])
        if tensor_amax is None:
            amax = _block_amax(torch.abs(x, out=a), bo, bi)
            if not torch.isfinite(amax).all():
                _refuse_nonfinite(weight, r0, r1, name)
        else:
            amax = tensor_amax
        s = _finite_scale(amax, top, scale_type, name)
        if method == "mse":
            s = _search(x, amax, s, top, element, scale_type, bo if tensor_amax is None else n, bi)
        s32 = s.to(torch.float32)
        if stats is not None:
            ref2 += float(torch.linalg.vector_norm(x)) ** 2
        _scale_rows(x, torch.reciprocal(s32), bo if tensor_amax is None else n, bi)
        # |w / s| stays within the element's range when s is amax / max rounded up to at most 2^-8 below
        # (bf16 scales), so the clamp only runs when a scale clips (mse) or rounded far down
        if method == "mse" or float((amax / s32).max()) > top * (1 + 2 ** -7):
            x.clamp_(-top, top)
        # int8 rounds into the spare buffer: x stays the unrounded value the error sums below measure from
        codes[r0:r1].copy_(torch.round(x, out=a) if element == "int8" else x)
        if tensor_amax is None:
            scales[r0 // bo:r0 // bo + s.shape[0]] = s
        else:
            scales.copy_(s)
        if stats is not None:
            # W - Ŵ = (x - code) * s: the rounding error in code units, per block row, times its scale
            err2 += _block_err2(a.copy_(codes[r0:r1]).sub_(x), s32, bo if tensor_amax is None else n, bi)
    if stats is not None:
        stats.update(err2=err2, ref2=ref2)
    return ScaledPlain(codes, element, scales, scale_type, tuple(block), compute, out_dtype, meta=meta)


def block_maxima(rows: torch.Tensor, block: tuple[int, int], shape: tuple[int, int], threads: int | None = None
                 ) -> tuple[torch.Tensor, int] | None:
    """(max |w| per block, float32 [ceil(R / bo), ceil(I / bi)]; how many rows hold a NaN or inf weight) of `rows`,
    whole block rows of a weight of `shape` quantized in `block` (-1: the whole dimension; per tensor: one
    [1, 1] maximum of these rows), by the C++ loops; None where they do not apply. Maxima of consecutive pieces
    of whole block rows, concatenated (per tensor: their maximum), are the weight's."""
    from qtool.packing import scaled_quant as sq

    o, i = shape
    bo, bi = (o if block[0] == -1 else block[0]), (i if block[1] == -1 else block[1])
    if bo == o and bi == i and o > 1:
        got = sq.row_amax(rows, i, threads)
        return None if got is None else (got[0].max().reshape(1, 1), got[1])
    return sq.row_amax(rows, bi, threads, bo=bo)


def block_rows_per_piece(shape: tuple[int, int], block: tuple[int, int], weights: int = NATIVE_CHUNK) -> int:
    """Rows of a piece of about `weights` weights that holds whole block rows (see block_maxima)."""
    o, i = shape
    bo, bi = (o if block[0] == -1 else block[0]), (i if block[1] == -1 else block[1])
    step_bo = 1 if bo == o and bi == i and o > 1 else bo
    return max(step_bo, weights // max(i, 1) // step_bo * step_bo)


def _quantize_native(weight, element, bo, bi, top, scale_type, codes, scales, stats, name, threads=None,
                     maxima=None) -> bool:
    """The rtn codes, scales and error sums of quantize_scaled through the C++ loops (qtool.packing.scaled_quant),
    NATIVE_CHUNK weights of whole block rows at a time; False (nothing written) where they do not apply. The
    scales come from _stored_scale here as on the torch path, so only the block maxima and the codes are made
    in C++, and those are the torch path's bits."""
    from qtool.packing import scaled_quant as sq

    if not sq.applies(weight, element):
        return False
    o, i = weight.shape
    per_tensor = bo == o and bi == i and o > 1
    step = block_rows_per_piece((o, i), (bo, bi))
    tensor_amax = None
    if maxima is not None:
        if maxima[1]:
            _refuse_nonfinite(weight, 0, o, name)
        if per_tensor:
            tensor_amax = maxima[0].reshape(1, 1)
    elif per_tensor:  # one amax over every row first
        parts = []
        for r0 in range(0, o, step):
            got = sq.row_amax(weight[r0:r0 + step], i, threads)
            if got is None:
                return False
            if got[1]:
                _refuse_nonfinite(weight, r0, min(o, r0 + step), name)
            parts.append(got[0].max())
        tensor_amax = torch.stack(parts).max().reshape(1, 1)
    err2 = ref2 = 0.0
    for r0 in range(0, o, step):
        r1 = min(o, r0 + step)
        w = weight[r0:r1]
        if tensor_amax is None and maxima is not None:
            amax = maxima[0][r0 // bo:-(-r1 // bo)]
        elif tensor_amax is None:
            got = sq.row_amax(w, bi, threads, bo=bo)
            if got is None:
                return False
            if got[1]:
                _refuse_nonfinite(weight, r0, r1, name)
            amax = got[0]
        else:
            amax = tensor_amax
        s = _finite_scale(amax, top, scale_type, name)
        s32 = s.to(torch.float32)
        sums = sq.quantize(w, element, r1 - r0 if tensor_amax is not None else bo, bi, s32, torch.reciprocal(s32),
                           codes[r0:r1].view(torch.uint8), threads)
        if sums is None:
            return False
        if tensor_amax is None:
            scales[r0 // bo:r0 // bo + s.shape[0]] = s
        else:
            scales.copy_(s)
        err2 += sums[0]
        ref2 += sums[1]
    if stats is not None:
        stats.update(err2=err2, ref2=ref2)
    return True


def _block_err2(e: torch.Tensor, s32: torch.Tensor, bo: int, bi: int) -> float:
    """sum ((code - w/s) * s)^2 from the code-unit error e [n, I] and the chunk's scales."""
    n, i = e.shape
    nc = s32.shape[1]
    rows = s32 if bo == 1 else s32.repeat_interleave(bo, 0)[:n]
    if nc * bi == i:
        per = torch.linalg.vector_norm(e.view(n, nc, bi), dim=-1)
        return float(((per * rows) ** 2).sum(dtype=torch.float64))
    return float(torch.linalg.vector_norm(e.mul_(rows.repeat_interleave(bi, 1)[:, :i]))) ** 2


def _scale_rows(x: torch.Tensor, per_block: torch.Tensor, bo: int, bi: int) -> None:
    """x [n, I] *= its block's value (per_block [ceil(n / bo), ceil(I / bi)]; n a whole number of block rows
    but for the last chunk), in place."""
    n, i = x.shape
    nc = per_block.shape[1]
    rows = per_block if bo == 1 else per_block.repeat_interleave(bo, 0)[:n]
    if nc * bi == i:
        x.view(n, nc, bi).mul_(rows.unsqueeze(-1))
    else:
        x.mul_(rows.repeat_interleave(bi, 1)[:, :i])


def _search(w, amax, s, top, element, scale_type, bo, bi):
    """Per block, the clip ratio in RATIOS with the least squared error; ties keep the larger ratio."""
    r, i = w.shape
    best_s, best_err = s, None
    for ratio in RATIOS:
        cand = _stored_scale(amax, top, scale_type, ratio) if ratio != 1.0 else s
        c32 = cand.to(torch.float32)
        # the codes as the final pass makes them (w times the scale's reciprocal), so that the error compared
        # is the error stored, and ratio 1.0 reproduces rtn exactly
        x = w.clone()
        _scale_rows(x, torch.reciprocal(c32), bo, bi)
        q = _codes(x, element).to(torch.float32)
        err = (q * _expand(c32, r, i, bo, bi) - w).square_()
        err = _block_amax_sum(err, bo, bi)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, cand, best_s)
    return best_s


def _block_amax_sum(e: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    r, i = e.shape
    nr, nc = -(-r // bo), -(-i // bi)
    if nc * bi != i or nr * bo != r:
        e = torch.nn.functional.pad(e, (0, nc * bi - i, 0, nr * bo - r))
    return e.view(nr, bo, nc, bi).sum(dim=(1, 3))


def _refuse_nonfinite(weight: torch.Tensor, r0: int, r1: int, name: str | None) -> None:
    block = weight[r0:r1].cpu()
    bad = ~torch.isfinite(block.to(torch.float32))
    r, c = (int(v) for v in bad.nonzero()[0])
    raise InputError(f"the weight holds {float(block[r, c])} at [{r0 + r}, {c}] (the first of {int(bad.sum())} "
                     f"NaN/inf values in rows {r0}..{r1 - 1})", tensor=name,
                     fix="fix the source weights or --exclude this module")


__all__ = ["METHODS", "quantize_scaled"]
