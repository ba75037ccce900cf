"""`torch-ref`: dequantize the GPTQ v2 tensors to a dense weight in the activation dtype, then matmul.

It reads every width qtool writes, 2..8 bits (3/5/6/7-bit codes straddle int32 words in the continuous
stream; base.unpack_gptq reads them), and any N, so bench and the kernel tests can check every pack.

Runs on every device torch runs on; the baseline every other kernel is compared with and the fallback
when none fits. Each call rebuilds the dense weight W^T [K, N] (it is not kept between calls), so its time
includes writing and re-reading a 16-bit weight: the cost a fused kernel avoids.
"""

from __future__ import annotations

import torch

from qtool.kernels.base import LAYER_BITS, Kernel, PackedLayer, dequantize_packed, register


@register
class TorchRef(Kernel):
    id = "torch-ref"
    summary = "dequantize to fp16/bf16 then torch.matmul; any device, bits 2..8, any N, act-order"
    devices = ("cpu", "cuda")
    bits = LAYER_BITS
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def prepare(self, layer: PackedLayer) -> PackedLayer:
        return layer

    def forward(self, x: torch.Tensor, state: PackedLayer, out: torch.Tensor | None = None) -> torch.Tensor:
        w = dequantize_packed(state, x.dtype)  # [K, N]
        if out is None:
            return x @ w
        return torch.matmul(x, w, out=out)

    def describe(self, state: PackedLayer, m: int) -> str:
        return "dequantize + matmul"
