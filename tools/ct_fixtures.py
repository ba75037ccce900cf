"""Write the compressed-tensors FP8 / INT8 fixtures of tests/fixtures/ct-float/ with compressed-tensors itself.

Run once with an environment that has compressed-tensors 0.20 (not qtool's; CI reads the stored files):

    /work/envs/hf/bin/python tools/ct_fixtures.py tests/fixtures/ct-float

For each scheme, compressed-tensors computes the scales (`calculate_qparams`, its minmax rule), compresses
the weight with its own compressor (`FloatQuantizationCompressor` / `IntQuantizationCompressor`.compress)
and decompresses it again (`.decompress`): that output is the reference qtool's decode must equal bit for
bit. Two checkpoints, one per compression format, each module a config group of its own:

    compressed-tensors-fp8/   float-quantized: tensor (static activations, input_scale), channel (FP8_DYNAMIC),
                              block 128x128 on a ragged 130x136 weight (FP8_BLOCK), group 34
    compressed-tensors-int8/  int-quantized: channel (W8A8), channel asymmetric, tensor
files: config.json (QuantizationConfig.to_dict, with the version), model.safetensors (the compressed module
tensors), reference.safetensors ({module}.weight = the decompressed weight). Then SHA256SUMS for both.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.compressors.naive_quantized.base import (
    FloatQuantizationCompressor,
    IntQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

SHAPE = (130, 136)


def weight(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*SHAPE, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier, so per-tensor and per-channel scales differ
    return w.to(dtype)


def ranges(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-strategy min and max, shaped as compressed-tensors' observers shape them."""
    s = getattr(args.strategy, "value", args.strategy)
    if s == "tensor":
        return w.amin(), w.amax()
    if s == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s == "group":
        g = args.group_size
        v = w.unflatten(1, (w.shape[1] // g, g))
        return v.amin(-1), v.amax(-1)
    bo, bi = args.block_structure
    o, i = w.shape
    nr, nc = -(-o // bo), -(-i // bi)
    pad = torch.nn.functional.pad(w.float(), (0, nc * bi - i, 0, nr * bo - o)).to(w.dtype)
    v = pad.view(nr, bo, nc, bi)
    return v.amin(dim=(1, 3)), v.amax(dim=(1, 3))


def module(name, w, wargs, iargs, compressor, seed):
    scale, zp = calculate_qparams(*ranges(w, wargs), wargs)
    sd = {"weight": w, "weight_scale": scale}
    if not wargs.symmetric:
        sd["weight_zero_point"] = zp.to(torch.int8)
    scheme = QuantizationScheme(targets=[name], weights=wargs, input_activations=iargs)
    packed = compressor.compress(dict(sd), scheme)
    if iargs is not None and not iargs.dynamic:
        x = torch.randn(8, SHAPE[1], generator=torch.Generator().manual_seed(seed + 1)).to(w.dtype)
        packed["input_scale"], _ = calculate_qparams(x.amin(), x.amax(), iargs)
    ref = compressor.decompress({k: v for k, v in packed.items() if k != "input_scale"}, scheme)["weight"]
    return scheme, {f"{name}.{k}": v.contiguous() for k, v in packed.items()}, {f"{name}.weight": ref.contiguous()}


def fp8(strategy, **kw) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False, **kw)


def int8(strategy, symmetric=True, **kw) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy=strategy, dynamic=False, **kw)


def act(type_, strategy, dynamic, **kw) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type=type_, symmetric=True, strategy=strategy, dynamic=dynamic, **kw)


CHECKPOINTS = {
    "compressed-tensors-fp8": ("float-quantized", FloatQuantizationCompressor, [
        ("layers.0.q_proj", fp8("tensor"), act("float", "tensor", False), torch.bfloat16),
        ("layers.0.k_proj", fp8("channel"), act("float", "token", True), torch.bfloat16),
        ("layers.0.v_proj", fp8("block", block_structure=[128, 128]), act("float", "group", True, group_size=128),
         torch.float32),
        ("layers.0.o_proj", fp8("group", group_size=34), act("float", "token", True), torch.float16),
    ]),
    "compressed-tensors-int8": ("int-quantized", IntQuantizationCompressor, [
        ("layers.0.q_proj", int8("channel"), act("int", "token", True), torch.bfloat16),
        ("layers.0.k_proj", int8("channel", symmetric=False), act("int", "token", True), torch.bfloat16),
        ("layers.0.v_proj", int8("tensor"), act("int", "tensor", False), torch.float32),
    ]),
}


def write_checkpoint(out: Path, folder: str, fmt: str, modules: list[tuple[QuantizationScheme, dict, dict]]
                     ) -> list[str]:
    """out/folder/{config.json, model.safetensors, reference.safetensors} from (scheme, compressed tensors,
    reference weight) per module, each module a config group of its own; the files' SHA256SUMS lines."""
    d = out / folder
    d.mkdir(parents=True, exist_ok=True)
    groups, tensors, refs = {}, {}, {}
    for k, (scheme, t, r) in enumerate(modules):
        scheme.format = fmt
        groups[f"group_{k}"] = scheme
        tensors.update(t)
        refs.update(r)
    cfg = QuantizationConfig(config_groups=groups, format=fmt, quantization_status="compressed").to_dict()
    cfg["quant_method"] = "compressed-tensors"
    cfg["version"] = compressed_tensors.__version__
    config = {"architectures": ["QtoolFixture"], "model_type": "qtool-fixture", "torch_dtype": "bfloat16",
              "quantization_config": cfg}
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    meta = {"writer": f"compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}"}
    save_file(tensors, d / "model.safetensors", metadata=meta)
    save_file(refs, d / "reference.safetensors", metadata=meta)
    return [f"{hashlib.sha256((d / f).read_bytes()).hexdigest()}  ./{folder}/{f}"
            for f in ("config.json", "model.safetensors", "reference.safetensors")]


def main(out: Path) -> None:
    sums = []
    for folder, (fmt, compressor, mods) in CHECKPOINTS.items():
        sums += write_checkpoint(out, folder, fmt, [
            module(name, weight(k + 10 * len(folder), dtype), wargs, iargs, compressor, k)
            for k, (name, wargs, iargs, dtype) in enumerate(mods)])
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
