"""GPTQ planar layout `gptq_p` (GPTQModel's planar pack, FORMATS.md "GPTQ planar").

Same tensor set and shapes as `gptq_v2` (I = in_features, O = out_features, b = bits 2..8):

    qweight  int32 [I*b/32, O]        codes packed along the input rows, planar
    qzeros   int32 [n_groups, O*b/32]  true (v2) zeros packed along the output columns, planar
    scales   fp16/bf16/fp32 [n_groups, O]
    g_idx    int32 [I]

Planar: each code is split into bit planes whose widths divide 32, low plane first (3 -> 2+1, 5 -> 4+1,
6 -> 4+2, 7 -> 4+2+1). Per run of 32 codes, a plane of width w fills w words, word k holding codes
[k*32/w, (k+1)*32/w) at shifts w*j; the b words of a run are adjacent. No field straddles a word. For 2, 4
and 8 bits the words equal the continuous `gptq_v2` stream; for 3, 5, 6, 7 they differ. The packed
dimensions (I and O) must be multiples of 32 for every b.
"""

from __future__ import annotations

from qtool.formats.base import FormatSpec, register
from qtool.formats.gptq import PLANAR_BITS, V2, GptqFamily
from qtool.lazy import lazy_module
from qtool.packing.bitstream import pack_planar, unpack_planar
from qtool.scheme import QuantScheme

torch = lazy_module("torch")


@register
class GptqPlanar(GptqFamily):
    spec = FormatSpec(
        id="gptq_p",
        bits=PLANAR_BITS,
        tensors=("qweight", "qzeros", "scales", "g_idx"),
        required=("qweight", "scales", "qzeros"),
        summary="GPTQ planar (true z): b words per 32 codes split into bit planes (low plane first), "
                "qweight int32 [I*b/32, O], qzeros [ceil(I/G), O*b/32], I and O multiples of 32",
        act_order=True,
        # No plane field straddles a word, so every width needs whole runs of 32 codes on both packed axes.
        in_multiple={b: 32 for b in PLANAR_BITS},
        out_multiple={b: 32 for b in PLANAR_BITS},
    )
    version = 2

    def _pack_codes(self, codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
        return pack_planar(codes, bits, dim=dim)

    def _unpack_codes(self, words: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
        return unpack_planar(words, bits, n, dim=dim)

    def decode_zeros(self, qzeros: torch.Tensor, bits: int, out_features: int, params: QuantScheme):
        """qzeros int32 [R, O*b/32], planar -> (true zero points uint8 [R, O], "v2"): planar files store z."""
        return unpack_planar(qzeros, bits, out_features, dim=1), V2


__all__ = ["GptqPlanar", "PLANAR_BITS"]
