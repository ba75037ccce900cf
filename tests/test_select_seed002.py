"""`qtool select` for the whole of seed 002: the FP8 / INT8 / W4A8 / NVFP4 paths, SGLang, and the six
disagreements with the seeds. Every disagreement test first asserts the seed sentence it enforces is in the
seed (tests/fixtures/seeds), so the rule and its source cannot drift apart."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import UsageError
from qtool.kernels.devices import profile
from qtool.kernels.select import LayerQuant, select_kernel
from qtool.scheme import QuantScheme
from qtool.select.plan import layer_groups, path_groups, plan_select
from tests.conftest import SEEDS, fixture_path

runner = CliRunner()
H100, H200, A100, B200 = (profile(n) for n in ("h100", "h200", "a100", "b200"))
CPU, RTX5090, L40S, MI300X = (profile(n) for n in ("cpu", "rtx5090", "l40s", "mi300x"))


def _seed(name: str) -> str:
    path = next(SEEDS.glob(f"{name}_*.txt"))
    # the seeds wrap nothing mid-sentence, but tabs and repeated spaces are normalised for quoting
    return re.sub(r"[ \t]+", " ", path.read_text(encoding="utf-8"))


SEED000, SEED002 = _seed("000"), _seed("002")


def says(seed: str, sentence: str) -> None:
    assert re.sub(r"[ \t]+", " ", sentence) in seed, f"the seed no longer says: {sentence!r}"


def cand(sel, name):
    return next(c for c in sel.candidates if c.kernel == name)


def layer(K, N, fmt="gptq", parallel="column", **kw) -> LayerQuant:
    q = QuantScheme(format=fmt, bits=kw.pop("bits", None), group_size=kw.pop("group_size", None),
                    sym=kw.pop("sym", True), desc_act=kw.pop("desc_act", False))
    spec = f"{K},{N},{'row' if parallel == 'row' else 'col'}"
    (g,) = layer_groups([spec], q, kw.pop("dtype", None), kw.pop("scale", None), kw.pop("block", None))
    return g.layer if not kw else replace(g.layer, **kw)


# --- worked examples ----------------------------------------------------------------------------------

# DeepSeek-V3's dense MLP: hidden 7168, intermediate 18432, FP8 weights in 128x128 blocks.
DSV3_DOWN = dict(K=18432, N=7168, fmt="fp8", parallel="row", scale="block")


def test_deepseek_v3_fp8_block_on_h200_vllm_by_m():
    says(SEED002, "Keep this backend to 1 <= M < 32, mirroring vLLM's")
    sel = select_kernel(layer(**DSV3_DOWN, dtype="bf16"), H200, "vllm", ms=(1, 16, 64))
    assert sel.layer.block == (128, 128)
    # the model's bf16 activations are quantized to FP8 by the method, which the FP8 kernels then take
    assert "activations bfloat16 -> float8_e4m3fn" in cand(sel, "Fp8Config").reason
    assert dict(sel.per_m) == {1: "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
                               16: "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
                               64: "DeepGemmFp8BlockScaledMMKernel"}
    assert "serves M in [1, 31] per call" in cand(sel, "FlashInferFp8DeepGEMMDynamicBlockScaledKernel").reason
    assert cand(sel, "MarlinFP8ScaledMMLinearKernel").failures == \
        ("CC 9.0 >= 8.9: a fallback for GPUs below 8.9 only",)
    # without DeepGEMM the blockwise CUTLASS sm90 kernel takes every M
    sel = select_kernel(layer(**DSV3_DOWN), H200, "vllm", ms=(1, 16, 64),
                        disabled={"FlashInferFp8DeepGEMMDynamicBlockScaledKernel", "DeepGemmFp8BlockScaledMMKernel"})
    assert {k for _, k in sel.per_m} == {"CutlassFp8BlockScaledMMKernel"}


def test_deepseek_v3_fp8_block_on_h200_sglang_by_m():
    says(SEED002, "DeepGEMM first, everywhere it is available.")
    says(SEED002, "M == 0 hard-fails inside the kernel")
    sel = select_kernel(layer(**DSV3_DOWN), H200, "sglang", ms=(1, 16, 64))
    assert [c.kernel for c in sel.candidates] == [
        "Fp8Config", "apply_fp8_marlin_linear", "deepgemm_w8a8_block_fp8_linear",
        "flashinfer_gemm_w8a8_block_fp8_linear", "cutlass_w8a8_block_fp8_linear", "triton_w8a8_block_fp8_linear"]
    assert {k for _, k in sel.per_m} == {"deepgemm_w8a8_block_fp8_linear"}
    assert cand(sel, "flashinfer_gemm_w8a8_block_fp8_linear").failures == ("CC 9.0 < 10.0",)
    # Blackwell without DeepGEMM: the auto order returns FlashInfer's function, which serves every M (the
    # 1 <= M < 32 guard is the SM90 FlashInfer-DeepGEMM function's)
    sel = select_kernel(layer(**DSV3_DOWN), B200, "sglang", ms=(1, 16, 31, 32, 64),
                        disabled={"deepgemm_w8a8_block_fp8_linear"})
    assert set(dict(sel.per_m).values()) == {"flashinfer_gemm_w8a8_block_fp8_linear"}
    # SM120: DeepGEMM excluded; CUTLASS blockwise runs it when FlashInfer is not there
    says(SEED002, "SM120 explicitly excluded")
    sel = select_kernel(layer(**DSV3_DOWN), RTX5090, "sglang", disabled={"flashinfer_gemm_w8a8_block_fp8_linear"})
    assert "CC 12.0 not in [9.0, 10.0, 10.3]" in cand(sel, "deepgemm_w8a8_block_fp8_linear").reason
    assert sel.chosen == "cutlass_w8a8_block_fp8_linear"


def test_deepseek_v3_block_checkpoint_through_inspect(tmp_path):
    """A DeepSeek-style FP8 file (weight F8_E4M3 + weight_scale_inv, weight_block_size [128, 128]) is read by
    inspect, and select sees a 128x128 block-scaled layer with FP8 activations."""
    import torch
    from safetensors.torch import save_file

    K, N = 512, 256
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(N, K, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(N // 128, K // 128)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    groups, notes, _ = path_groups(tmp_path, "bf16")
    (g,) = groups
    assert (g.layer.format, g.layer.scale_kind, g.layer.block, g.layer.act_dtype) == \
        ("fp8", "block", (128, 128), "bfloat16")
    rep = plan_select(groups, H200, "vllm", ms=(1, 64))
    assert dict(rep.layers[0].selection.per_m) == {1: "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
                                                   64: "DeepGemmFp8BlockScaledMMKernel"}
    r = runner.invoke(app, ["select", str(tmp_path), "--device", "h200", "--engine", "sglang", "--m", "1,16,64",
                            "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["m"] == [1, 16, 64] and d["layers"][0]["per_m"] == {
        "1": "deepgemm_w8a8_block_fp8_linear", "16": "deepgemm_w8a8_block_fp8_linear",
        "64": "deepgemm_w8a8_block_fp8_linear"}
    assert d["layers"][0]["scale"] == "block" and d["layers"][0]["block"] == [128, 128]


def test_fp8_on_a100_falls_back_to_marlin():
    says(SEED002, "FP8 needs no dequantisation in the mainloop, because e4m3 is on the tensor-core menu")
    for scale in ("channel", "tensor", "block"):
        sel = select_kernel(layer(8192, 8192, "fp8", scale=scale), A100, "vllm")
        assert sel.chosen == "MarlinFP8ScaledMMLinearKernel", scale
        assert any("no FP8 tensor cores on this device: weight-only FP8 (W8A16) through Marlin" in n
                   for n in sel.notes)
    sel = select_kernel(layer(8192, 8192, "fp8"), A100, "vllm")
    assert cand(sel, "CutlassFP8ScaledMMLinearKernel").failures == ("CC 8.0 < 8.9",)
    # an L40S (sm89) has FP8 tensor cores: the CUTLASS epilogue path, no Marlin
    sel = select_kernel(layer(8192, 8192, "fp8"), L40S, "vllm")
    assert sel.chosen == "CutlassFP8ScaledMMLinearKernel" and not sel.notes


def test_fp8_per_tensor_and_per_channel_use_the_epilogue_kernels():
    says(SEED002, "ColOrScalarLoad and RowOrScalarLoad are the same code path for per-tensor (a scalar) and "
                  "per-token / per-channel (a vector)")
    for scale in ("tensor", "channel"):
        assert select_kernel(layer(4096, 4096, "fp8", scale=scale), H100, "vllm").chosen == \
            "CutlassFP8ScaledMMLinearKernel"
    # B200: FlashInfer's per-tensor FP8 kernel first, per-channel stays on CUTLASS
    assert select_kernel(layer(4096, 4096, "fp8", scale="tensor"), B200, "vllm").chosen == \
        "FlashInferFP8ScaledMMLinearKernel"
    sel = select_kernel(layer(4096, 4096, "fp8", scale="channel"), B200, "vllm")
    assert sel.chosen == "CutlassFP8ScaledMMLinearKernel"
    assert cand(sel, "FlashInferFP8ScaledMMLinearKernel").failures == ("channel weight scales not in [tensor]",)
    # SGLang (sglang-main fp8.py): a per-channel layer on an FP8 GPU goes to apply_fp8_linear
    assert select_kernel(layer(4096, 4096, "fp8", scale="channel"), H100, "sglang").chosen == "apply_fp8_linear"


def test_int8_w8a8():
    says(SEED002, "A and B must have symmetric quantization (zero point == 0)")
    sel = select_kernel(layer(4096, 4096, "int8"), A100, "vllm")
    assert sel.chosen == "CutlassInt8ScaledMMLinearKernel"
    assert "activations float16 -> int8" in cand(sel, "CompressedTensorsW8A8Int8").reason
    sel = select_kernel(layer(4096, 4096, "int8", sym=False), A100, "vllm")
    assert sel.chosen is None and "sym=False not supported" in cand(sel, "CutlassInt8ScaledMMLinearKernel").reason
    assert select_kernel(layer(4096, 4096, "int8"), CPU, "vllm").chosen == "CPUInt8ScaledMMLinearKernel"
    assert select_kernel(layer(4096, 4096, "int8"), MI300X, "vllm").chosen == "AiterInt8ScaledMMLinearKernel"


def test_w4a8_with_bf16_activations_cutlass_declines():
    says(SEED002, "CutlassW4A8LinearKernel declines (activations are bf16, not fp8).")
    sel = select_kernel(layer(4096, 4096, "w4a8", dtype="bf16"), H100, "vllm")
    cutlass = cand(sel, "CutlassW4A8LinearKernel")
    assert cutlass.failures == ("activation dtype bfloat16 not in [float8_e4m3fn]",)
    assert "needs FP8 (e4m3) activations" in cutlass.hint and "--dtype fp8" in cutlass.hint
    assert sel.chosen != "CutlassW4A8LinearKernel"
    # a W4A8 layer feeds FP8 activations by default: CutlassW4A8 takes it on Hopper
    sel = select_kernel(layer(4096, 4096, "w4a8"), H100, "vllm")
    assert sel.layer.act_dtype == "float8_e4m3fn" and sel.chosen == "CutlassW4A8LinearKernel"
    assert cand(sel, "CompressedTensorsW4A8Fp8").reason.startswith("CompressedTensorsW4A8Fp8: weight type int4")


def test_nvfp4_on_h100_has_no_native_path():
    says(SEED002, "Blackwell's block-scaled tensor op consumes the sub-byte NVFP4 operands natively")
    sel = select_kernel(layer(4096, 4096, "nvfp4"), H100, "vllm")
    assert sel.chosen == "MarlinNvFp4LinearKernel"
    assert cand(sel, "CutlassNvFp4LinearKernel").failures == ("CC 9.0 < 10.0",)
    assert any("no native FP4 path on this device" in n for n in sel.notes)
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--format", "nvfp4", "--device", "h100",
                            "--engine", "vllm"])
    assert r.exit_code == 0 and "no native FP4 path on this device" in r.stdout
    # Blackwell runs it natively, and says nothing about a fallback
    sel = select_kernel(layer(4096, 4096, "nvfp4"), B200, "vllm")
    assert sel.chosen == "FlashInferCutlassNvFp4LinearKernel" and not sel.notes
    # MXFP4: the seeds describe no MXFP4 linear kernel; vllm-main's compressed-tensors W4A16 MXFP4 scheme (the
    # row's source) runs it weight-only through the FP4 Marlin kernel from CC 8.0, and nowhere below
    sel = select_kernel(layer(4096, 4096, "mxfp4"), B200, "vllm")
    assert sel.chosen == "MarlinMxFp4W4A16"
    sel = select_kernel(layer(4096, 4096, "mxfp4"), profile("t4"), "vllm")
    assert sel.chosen is None and cand(sel, "MarlinMxFp4W4A16").failures == ("CC 7.5 < 8.0",)


def test_gguf_q6_k_under_gptqmodel():
    says(SEED000, "Broad logical bit declaration is not a blanket qtype guarantee")
    sel = select_kernel(layer(4096, 4096, "gguf:Q6_K"), H100, "gptqmodel")
    assert (sel.layer.bits, sel.layer.group_size) == (6, 256)
    assert sel.chosen == "GGUFTritonKernel"
    assert select_kernel(layer(4096, 4096, "gguf:Q6_K"), CPU, "gptqmodel").chosen == "GGUFCppKernel"


# --- the six disagreements ------------------------------------------------------------------------------

def test_1_marlin_file_from_awq_versus_from_gptq(tmp_path):
    says(SEED000, "AwqMacheteLinear declares Marlin-format support, but the local model loader requires the "
                  "matching Marlin backend or MLX for a serialized Marlin checkpoint.")
    chosen = {}
    for src, name in (("gptqmodel-gptq-v1-4bit-g128-sym", "gptq"), ("gptqmodel-awq-gemm-4bit-g128", "awq")):
        out = tmp_path / name
        r = runner.invoke(app, ["repack", str(fixture_path(src)), "--to", "marlin", "-o", str(out)])
        assert r.exit_code == 0, r.output
        groups, _, _ = path_groups(out)
        assert {g.layer.format for g in groups} == {"marlin"} and {g.layer.method for g in groups} == {name}
        # shapes large enough for Machete, so only the loader rule can refuse it
        big = [g.layer.__class__(**{**g.layer.__dict__, "in_features": 4096, "out_features": 4096})
               for g in groups[:1]]
        sel = select_kernel(big[0], H100, "gptqmodel")
        machete = cand(sel, "AwqMacheteLinear")
        assert not machete.ok and f"serialized MARLIN checkpoint from {name}: the model loader binds it to" \
            in machete.reason
        chosen[name] = sel.chosen
    assert chosen == {"gptq": "MarlinLinear", "awq": "AwqMarlinLinear"}


def test_2_group_straddling_tp_is_fatal_for_machete_too():
    says(SEED002, "a group straddling a tensor-parallel boundary is fatal, because the rank does not hold a "
                  "whole group")
    sel = select_kernel(layer(4224, 4096, parallel="row", dtype="bf16"), H100, "vllm", tp=2)
    assert sel.in_features_per_partition == 2112  # 16.5 groups of 128
    machete = cand(sel, "MacheteLinearKernel")
    assert machete.failures == ("group_size 128 straddles TP shards: K_part 2112 % 128 != 0 "
                                "(padding cannot fix a split group)",)
    assert machete.hint == "TP=1"
    assert sel.chosen is None
    assert select_kernel(layer(4224, 4096, parallel="row", dtype="bf16"), H100, "vllm", tp=1).chosen == \
        "MacheteLinearKernel"


def test_3_gptqmodel_marlin_validates_packing_divisibility():
    says(SEED000, "Input/output packing divisibility and activation-order alignment are validated even when "
                  "broader declarations permit padding.")
    sel = select_kernel(layer(200, 200, dtype="fp16"), H100, "gptqmodel")
    marlin = cand(sel, "MarlinLinear")
    assert {"K 200 % 16 != 0", "N 200 % 64 != 0"} <= set(marlin.failures)
    assert sel.chosen != "MarlinLinear"
    awq = select_kernel(layer(200, 200, "awq", dtype="fp16", sym=False), H100, "gptqmodel")
    assert {"K 200 % 16 != 0", "N 200 % 64 != 0"} <= set(cand(awq, "AwqMarlinLinear").failures)
    # act-order keeps the strict thread tile
    sel = select_kernel(layer(4096 + 64, 4096, dtype="fp16", desc_act=True, group_size=64), H100, "gptqmodel")
    assert "act-order keeps the strict tile check: K 4160 % 128 != 0" in cand(sel, "MarlinLinear").reason


def test_4_gguf_kernels_declare_the_qtypes_they_run():
    says(SEED000, "GGUFTritonKernel supports its own subset of qtypes")
    # Q4_0 is 4-bit, which GGUFTritonKernel's bits declare, but it is not one of its K-block qtypes
    sel = select_kernel(layer(4096, 4096, "gguf:Q4_0"), H100, "gptqmodel")
    assert cand(sel, "GGUFTritonKernel").failures == ("GGUF qtype Q4_0 not in [Q4_K, Q5_K, Q6_K]",)
    assert cand(sel, "GGUFTritonKernel").hint == "re-quantize to Q4_K / Q5_K / Q6_K"
    assert sel.chosen == "GGUFCudaKernel"
    sel = select_kernel(layer(4096, 4096, "gguf:Q3_K"), H100, "gptqmodel")
    assert "GGUF qtype Q3_K not in" in cand(sel, "GGUFTorchLinear").reason
    assert sel.chosen is None
    # the real GGUF fixture: Q4_0 and Q8_0 run on GGUFCudaKernel; Q4_1 has no GPTQModel kernel
    groups, _, _ = path_groups(fixture_path("gguf-q4_0-q4_1-q8_0"))
    rep = plan_select(groups, H100, "gptqmodel")
    by_fmt = {r.selection.layer.format: r.selection.chosen for r in rep.layers}
    assert by_fmt["gguf:Q4_0"] == "GGUFCudaKernel" and by_fmt["gguf:Q8_0"] == "GGUFCudaKernel"
    assert by_fmt["gguf:Q4_1"] is None and not rep.all_chosen
    # SGLang loads GGUF, and runs Q4_1
    rep = plan_select(groups, H100, "sglang")
    assert {r.selection.chosen for r in rep.layers} == {"GGUFLinearMethod"}


def _bnb_without_state(root):
    from safetensors.numpy import save_file

    out, inp = 64, 128
    save_file({"model.layers.0.mlp.down_proj.weight": np.zeros((out * inp // 2, 1), np.uint8),
               "model.layers.0.mlp.down_proj.weight.absmax": np.ones((out * inp // 64,), np.float32),
               "model.layers.0.mlp.down_proj.weight.quant_map": np.zeros((16,), np.float32)},
              str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_blocksize": 64}}))


def test_5_checkpoint_with_no_selectable_layer_exits_1(tmp_path):
    _bnb_without_state(tmp_path)
    r = runner.invoke(app, ["select", str(tmp_path), "--device", "h100", "--json"], standalone_mode=False)
    assert r.return_value == 1
    d = json.loads(r.stdout)
    assert d["layers"] == []
    assert any("no selectable layer" in n for n in d["notes"])
    assert any("1 bnb module(s) whose bits or [out, in] shape the checkpoint does not record" in n
               for n in d["notes"])


def test_6_unknown_format_is_a_usage_error():
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--format", "bogus", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "unknown --format 'bogus'" in str(r.exception)
    for bad in ("gguf", "gguf:Q9_Z", "fp9"):
        with pytest.raises(UsageError):
            layer_groups(["4096,4096"], QuantScheme(format=bad))
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--dtype", "fp4", "--device", "h100"])
    assert isinstance(r.exception, UsageError) and "fp8 or int8" in str(r.exception)
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--m", "0", "--device", "h100"])
    assert isinstance(r.exception, UsageError)


def test_vllm_refuses_bnb_and_gguf_sglang_loads_them():
    says(SEED002, 'neither "bitsandbytes" nor "gguf" is among them')
    for fmt in ("bnb", "gguf:Q4_K"):
        sel = select_kernel(layer(4096, 4096, fmt, bits=4), H100, "vllm")
        assert sel.chosen is None and [c.kind for c in sel.candidates] == ["method"]
        assert "SGLang loads them" in sel.candidates[0].hint
        assert select_kernel(layer(4096, 4096, fmt, bits=4), H100, "sglang").chosen is not None


def test_bnb_blocks_run_over_the_flattened_weight():
    """bitsandbytes scales blocks of the flattened weight (the last one partial): a K that is no multiple of
    the block size splits no block, so SGLang's bnb method takes the layer."""
    odd = layer(255, 63, "bnb", bits=4)
    assert odd.group_size == 64
    assert select_kernel(odd, H100, "sglang").chosen == "BitsAndBytesLinearMethod"
    gptq = select_kernel(layer(4000, 4096, "gptq", bits=4, group_size=128), H100, "sglang")
    assert any("% group_size 128 != 0" in f for c in gptq.candidates for f in c.failures)  # rows: still checked


@pytest.mark.parametrize("device,scale,chosen", [
    ("h100", "block", "deepgemm_w8a8_block_fp8_linear"),
    ("h100", "channel", "apply_fp8_linear"),
    ("a100", "block", "apply_fp8_marlin_linear"),     # can_auto_enable_marlin_fp8: 80 <= sm < 89
    ("a100", "tensor", "apply_fp8_marlin_linear"),
    ("t4", "channel", None),                          # Fp8Config.get_min_capability: 80
])
def test_sglang_fp8_takes_marlin_below_cc_8_9(device, scale, chosen):
    sel = select_kernel(layer(4096, 4096, "fp8", scale=scale, dtype="fp16"), profile(device), "sglang")
    assert sel.chosen == chosen
    marlin = cand(sel, "apply_fp8_marlin_linear")
    if device == "h100":
        assert marlin.failures == ("CC 9.0 >= 8.9: a fallback for GPUs below 8.9 only",)
    if device == "t4":
        assert marlin.failures == ("CC 7.5 < 8.0",) and "a100" in marlin.hint
    if chosen == "apply_fp8_marlin_linear":
        assert any("weight-only FP8 (W8A16) through Marlin" in n for n in sel.notes)


def test_sglang_has_no_machete():
    says(SEED002, "There is no Machete in SGLang at this SHA.")
    says(SEED002, "On Hopper, a GPTQ W4A16 checkpoint that vLLM would run through Machete runs through Marlin "
                  "in SGLang.")
    lay = layer(28672, 8192, parallel="row", dtype="bf16")
    assert select_kernel(lay, H100, "vllm", tp=2).chosen == "MacheteLinearKernel"
    assert select_kernel(lay, H100, "sglang", tp=2).chosen == "gptq_marlin_gemm"


def test_compressed_tensors_int8_and_nvfp4_checkpoints_through_inspect(tmp_path):
    import torch
    from safetensors.torch import save_file

    O, K = 256, 512
    int8 = tmp_path / "int8"
    int8.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(O, K, dtype=torch.int8),
               "model.layers.0.mlp.down_proj.weight_scale": torch.ones(O, 1)}, str(int8 / "model.safetensors"))
    groups, _, _ = path_groups(int8, "bf16")
    assert [(g.layer.format, g.layer.scale_kind) for g in groups] == [("ct_int8", "channel")]
    assert plan_select(groups, A100, "vllm").layers[0].selection.chosen == "CutlassInt8ScaledMMLinearKernel"

    fp4 = tmp_path / "nvfp4"
    fp4.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight_packed": torch.zeros(O, K // 2, dtype=torch.uint8),
               "model.layers.0.mlp.down_proj.weight_scale": torch.zeros(O, K // 16, dtype=torch.float8_e4m3fn),
               "model.layers.0.mlp.down_proj.weight_global_scale": torch.ones(1)}, str(fp4 / "model.safetensors"))
    groups, _, _ = path_groups(fp4, "bf16")
    assert [(g.layer.format, g.layer.group_size) for g in groups] == [("nvfp4", 16)]
    rep = plan_select(groups, H100, "vllm")
    assert rep.layers[0].selection.chosen == "MarlinNvFp4LinearKernel"
    assert plan_select(groups, B200, "vllm").layers[0].selection.chosen == "FlashInferCutlassNvFp4LinearKernel"


def test_gptqmodel_fp8_is_weight_only():
    # GPTQModel's TorchFP8Linear multiplies the model's activations (it quantizes none): an FP8 layer fed bf16
    # is its to run, while vLLM's W8A8 method quantizes those activations for the scaled-mm kernels
    sel = select_kernel(layer(4096, 4096, "fp8", dtype="bf16"), H100, "gptqmodel")
    assert sel.chosen == "TorchFP8Linear"
    assert select_kernel(layer(4096, 4096, "fp8", dtype="bf16"), H100, "vllm").chosen == \
        "CutlassFP8ScaledMMLinearKernel"
