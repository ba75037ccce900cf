"""`torch-ref`: dequantize the layer to a dense weight in the activation dtype, then matmul.

It reads every canonical form qtool decodes to: the GPTQ v2 words of every integer format at 2..8 bits
(3/5/6/7-bit codes straddle int32 words in the continuous stream; base.unpack_gptq reads them), any N, and
every float/int8 layout through `ScaledPlain`'s dequantize (FP8 E4M3/E5M2, INT8 with or without zeros,
NVFP4/MXFP4 E2M1 with E4M3/E8M0 scales and a global scale), so bench, validate and the kernel tests can check
every pack.

Runs on every device torch runs on; the baseline every other kernel is compared with and the fallback
when none fits. Each call rebuilds the dense weight W^T [K, N] (it is not kept between calls), so its time
includes writing and re-reading a 16-bit weight: the cost a fused kernel avoids.
"""

from __future__ import annotations

import torch

from qtool.kernels.base import ELEMENT_BITS, LAYER_BITS, Kernel, Layer, dequantize_layer, register


@register
class TorchRef(Kernel):
    id = "torch-ref"
    summary = "dequantize to fp16/bf16 then torch.matmul; any device, every format (bits 2..8, fp8, int8, fp4)"
    devices = ("cpu", "cuda")
    bits = LAYER_BITS
    elements = tuple(ELEMENT_BITS)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def prepare(self, layer: Layer) -> Layer:
        return layer

    def forward(self, x: torch.Tensor, state: Layer, out: torch.Tensor | None = None) -> torch.Tensor:
        w = dequantize_layer(state, x.dtype)  # [K, N]
        if out is None:
            return x @ w
        return torch.matmul(x, w, out=out)

    def describe(self, state: Layer, m: int) -> str:
        return "dequantize + matmul"
