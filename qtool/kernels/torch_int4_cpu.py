"""`torch-int4-cpu`: torch's CPU int4 packed matmul (ATen `_weight_int4pack_mm_for_cpu`).

The ATen operator computes w = scale * (q - 2^(b-1)) + offset per group, with q the unsigned 4-bit code.
A GPTQ weight is w = scale * (q - z), so the offset handed to it is (2^(b-1) - z) * scale (seed 000,
"CPU ATen INT4"); passing the raw zero code there changes the math.

Conversions done once in `prepare` (what GPTQModel's TorchAtenLinear does at load time):
- codes are unpacked to int32 [N, K] and handed to `_convert_weight_to_int4pack_for_cpu`;
- the operator knows group sizes 32/64/128/256 only, so a larger group (or -1) is expressed exactly as
  several consecutive groups of the largest of those that divides it, each repeating the scale and offset;
- N is padded to a multiple of 16 with zero-scale columns (the operator's own requirement), and the output
  is sliced back;
- act-order: input rows are sorted by g_idx once, and each call gathers x's columns in that order, which
  works when every group holds exactly group_size rows (what GPTQ's act-order produces).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qtool.kernels.base import Kernel, PackedLayer, register, unpack_gptq

OP_GROUPS = (256, 128, 64, 32)
INNER_K_TILES = 2
N_MULTIPLE = 16


def _ops():
    aten = torch.ops.aten
    conv = getattr(aten, "_convert_weight_to_int4pack_for_cpu", None)
    mm = getattr(aten, "_weight_int4pack_mm_for_cpu", None)
    return conv, mm


@dataclass
class Int4CpuState:
    """packed: uint8 ATen int4pack [N_pad, K/2]; scale_offset: fp32 [K/qgroup, N_pad, 2] (scale, offset);
    perm: int64 [K] input-row order (None when natural); qgroup: the operator's group size."""

    packed: torch.Tensor
    scale_offset: torch.Tensor
    perm: torch.Tensor | None
    qgroup: int
    n: int
    by_dtype: dict = field(default_factory=dict)

    def scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = self.scale_offset.to(dtype).contiguous()
        return self.by_dtype[dtype]


@register
class TorchInt4Cpu(Kernel):
    id = "torch-int4-cpu"
    summary = "torch's CPU int4 packed matmul (ATen int4pack, affine offsets); 4-bit, groups of 32n"
    devices = ("cpu",)
    bits = (4,)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def available(self, device: torch.device) -> str | None:
        why = super().available(device)
        if why:
            return why
        conv, mm = _ops()
        if conv is None or mm is None:
            return (f"torch {torch.__version__} has no _convert_weight_to_int4pack_for_cpu / "
                    f"_weight_int4pack_mm_for_cpu")
        return None

    def check(self, layer: PackedLayer, dtype: torch.dtype, device: torch.device) -> list[str]:
        why = super().check(layer, dtype, device)
        if not isinstance(layer, PackedLayer):  # the base check has refused it: nothing below applies
            return why
        g = layer.effective_group_size
        if _op_group(g) is None:
            why.append(f"{self.id} needs a group size that is a multiple of 32, got {g}")
        if layer.in_features % g:
            why.append(f"{self.id}: group size {g} does not divide K={layer.in_features}")
        if layer.g_idx is not None:
            sorted_g = torch.sort(layer.g_idx.to(torch.int64).cpu()).values
            trivial = torch.arange(layer.in_features, dtype=torch.int64) // g
            if not torch.equal(sorted_g, trivial):
                why.append(f"{self.id}: act-order g_idx does not give every group exactly {g} rows, so "
                           f"sorting the rows cannot make the groups contiguous")
        return why

    def prepare(self, layer: PackedLayer) -> Int4CpuState:
        conv, _ = _ops()
        layer = layer.to("cpu")
        codes, zeros = unpack_gptq(layer)  # [K, N], [G, N]
        k, n = layer.in_features, layer.out_features
        g = layer.group_index()
        perm = None
        if layer.g_idx is not None:
            perm = torch.argsort(g, stable=True)
            codes = codes.index_select(0, perm)
        qgroup = _op_group(layer.effective_group_size)
        # Operator group j covers rows [j*qgroup, (j+1)*qgroup): all in one stored group after sorting.
        src_group = torch.arange(k // qgroup, dtype=torch.int64) * qgroup // layer.effective_group_size
        s = layer.scales.to(torch.float32).index_select(0, src_group)  # [K/qg, N]
        offset = (float(1 << (layer.bits - 1)) - zeros.index_select(0, src_group).to(torch.float32)) * s
        n_pad = -(-n // N_MULTIPLE) * N_MULTIPLE
        w = codes.t().contiguous()  # [N, K]
        if n_pad != n:
            w = torch.cat([w, torch.zeros(n_pad - n, k, dtype=w.dtype)], 0)
            s = torch.cat([s, torch.zeros(s.shape[0], n_pad - n)], 1)
            offset = torch.cat([offset, torch.zeros(offset.shape[0], n_pad - n)], 1)
        packed = conv(w.to(torch.int32).contiguous(), INNER_K_TILES)
        return Int4CpuState(packed, torch.stack([s, offset], -1).contiguous(), perm, qgroup, n)

    def forward(self, x: torch.Tensor, state: Int4CpuState, out: torch.Tensor | None = None) -> torch.Tensor:
        _, mm = _ops()
        if state.perm is not None:
            x = x.index_select(1, state.perm)
        y = mm(x.contiguous(), state.packed, state.qgroup, state.scales_for(x.dtype))
        if y.shape[1] != state.n:
            y = y[:, : state.n]
        if out is None:
            return y.contiguous()
        out.copy_(y)
        return out

    def describe(self, state: Int4CpuState, m: int) -> str:
        return f"aten int4pack, qGroupSize {state.qgroup}" + (", rows sorted by g_idx" if state.perm is not None
                                                              else "")


def _op_group(g: int) -> int | None:
    for q in OP_GROUPS:
        if g % q == 0:
            return q
    return None
