"""compressed-tensors `int-quantized` (INT8 W8A8), format id "ct_int8" (docs/formats-float.md).

Tensors of one linear module (short names):

    weight             int8 [O, I]
    weight_scale       fp32/bf16/fp16 [O, 1] (channel, the W8A8 preset; tensor [1] and group [O, I/g] read too)
    weight_zero_point  int8, the scale's shape, only for asymmetric weights
    input_scale        [1], only for static per-tensor activations

W = (weight.to(scale dtype) - zero point) * weight_scale, in the scale's dtype (`forward._dequantize`).
Activations: dynamic per-token int8 (the W8A8 preset's `input_activations`) unless an input_scale says
static per-tensor. Same compressor and config shape as ct_fp8 (ct_fp8.py), with `type: "int"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from qtool.formats.base import FormatSpec, register
from qtool.formats.ct_fp8 import CtNaive
from qtool.formats.detection import Claims, Detected, Sig


@register
class CtInt8(CtNaive):
    spec = FormatSpec(
        id="ct_int8",
        aliases=("int-quantized", "w8a8"),
        bits=(8,),
        tensors=("weight", "weight_scale", "weight_zero_point", "input_scale"),
        required=("weight", "weight_scale"),
        summary="compressed-tensors int-quantized (W8A8): weight I8 [O, I] + weight_scale [O, 1] (+ int8 "
                "weight_zero_point when asymmetric)",
        sym=True,
        asym=True,
    )
    ct_type = "int"
    ct_format = "int-quantized"
    element_dtype = "int8"
    elements = ("int8",)
    strategies = ("tensor", "channel", "group")
    zeros = True
    default_block = (1, -1)

    def detect(self, module: str, t: Mapping[str, Sig], claims: Claims) -> Detected | None:
        """An int8 weight beside a weight_scale (bitsandbytes' LLM.int8, asked before, has SCB instead)."""
        w = t.get("weight")
        if w is None or w[0] != "I8" or "weight_scale" not in t or len(w[1]) != 2:
            return None
        o, i = w[1]
        notes: list[tuple[str, str]] = []
        if claims.format not in (None, "ct", "ct_int8"):
            notes.append(("error", f"config says {claims.format} but the tensors are compressed-tensors INT8"))
        per = "tensor" if prod(t["weight_scale"][1]) == 1 else "channel"
        return Detected("ct_int8", 8, -1, "weight_zero_point" not in t, False, i, o, i * o,
                        detail=f"per-{per} scale, int8 weight", notes=notes, weight_scale=per)
