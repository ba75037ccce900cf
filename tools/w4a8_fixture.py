"""Write tests/fixtures/ct-w4a8/ (a compressed-tensors W4A8 checkpoint) with compressed-tensors itself.

Run once with an environment that has compressed-tensors 0.20 (not qtool's; CI reads the stored files):

    /work/envs/hf/bin/python tools/w4a8_fixture.py tests/fixtures/ct-w4a8

qtool does not write W4A8, so the layout comes from compressed-tensors' own preset `W4AFP8` (weights int4
symmetric, group 128, static; input activations FP8 e4m3, dynamic per token): the scheme vLLM's
CompressedTensorsW4A8Fp8 loads. compressed-tensors computes the scales (`calculate_qparams`, minmax), packs the
weight (`PackedQuantizationCompressor.compress`, `pack-quantized`) and unpacks it again (`.decompress`): that is
reference.safetensors. Two modules, each a shape CutlassW4A8's 128-multiples accept (K and N of 256 / 512).

files: compressed-tensors-w4afp8/{config.json, model.safetensors, reference.safetensors}, then SHA256SUMS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from ct_fixtures import write_checkpoint  # the same checkpoint writer (tools/ is the script's folder)

MODULES = (("model.layers.0.self_attn.q_proj", (256, 256)), ("model.layers.0.mlp.down_proj", (256, 512)))
FOLDER = "compressed-tensors-w4afp8"


def weight(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier in one group
    return w.to(torch.bfloat16)


def module(name: str, w: torch.Tensor) -> tuple[QuantizationScheme, dict, dict]:
    scheme = preset_name_to_scheme("W4AFP8", [name])
    g = scheme.weights.group_size
    v = w.unflatten(1, (w.shape[1] // g, g))
    scale, _zp = calculate_qparams(v.amin(-1), v.amax(-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    ref = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    return (scheme, {f"{name}.{k}": v.contiguous() for k, v in packed.items()},
            {f"{name}.weight": ref.contiguous()})


def main(out: Path) -> None:
    sums = write_checkpoint(out, FOLDER, "pack-quantized",
                            [module(name, weight(k + 40, shape)) for k, (name, shape) in enumerate(MODULES)])
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
