"""`select` on NVFP4 / MXFP4 checkpoints: the layers come from inspect's detection (issue #26), and the kernel
rows they meet are the ones the declarations cite."""

from __future__ import annotations

import pytest

from qtool.kernels.devices import profile
from qtool.select.plan import path_groups, plan_select
from tests.conftest import FIXTURES

FP4 = FIXTURES / "fp4"


@pytest.mark.parametrize("folder,fmt,group,h100,b200", [
    ("ct-nvfp4", "nvfp4", 16, "MarlinNvFp4LinearKernel", "FlashInferCutlassNvFp4LinearKernel"),
    ("modelopt-nvfp4", "modelopt_nvfp4", 16, "MarlinNvFp4LinearKernel", "FlashInferCutlassNvFp4LinearKernel"),
    ("ct-mxfp4", "mxfp4", 32, "MarlinMxFp4W4A16", "MarlinMxFp4W4A16"),
])
def test_checkpoints_select_through_inspect(folder, fmt, group, h100, b200):
    groups, _, _ = path_groups(FP4 / folder, "bf16")
    assert {(g.layer.format, g.layer.group_size) for g in groups} == {(fmt, group)}
    assert {r.selection.chosen for r in plan_select(groups, profile("h100"), "vllm").layers} == {h100}
    assert {r.selection.chosen for r in plan_select(groups, profile("b200"), "vllm").layers} == {b200}


@pytest.mark.parametrize("device,chosen", [
    ("b200", "FlashInferCutlassMxfp8LinearKernel"),   # W8A8 MXFP8 on Blackwell (FlashInfer mm_mxfp8)
    ("h100", "MarlinMxfp8LinearKernel"),              # no MXFP8 tensor op below CC 10.0: weight-only Marlin
    ("t4", "MarlinMxfp8LinearKernel"),                # is_fp8_marlin_supported: CC 7.5 (fp16: no bf16 there)
    ("mi300x", "EmulationMxfp8LinearKernel"),         # ROCm's list is the emulation alone
])
def test_mxfp8_follows_vllm_mains_kernel_list(device, chosen):
    groups, _, _ = path_groups(FP4 / "ct-mxfp8", "fp16" if device == "t4" else "bf16")
    assert {(g.layer.format, g.layer.bits, g.layer.group_size) for g in groups} == {("mxfp8", 8, 32)}
    rows = plan_select(groups, profile(device), "vllm").layers
    assert {r.selection.chosen for r in rows} == {chosen}
    sel = rows[0].selection
    assert sel.candidates[0].kernel == "CompressedTensorsW8A8Mxfp8" and sel.candidates[0].ok
    walked = [c.kernel for c in sel.candidates[1:]]
    assert walked == (["EmulationMxfp8LinearKernel"] if device == "mi300x" else
                      ["FlashInferCutlassMxfp8LinearKernel", "MarlinMxfp8LinearKernel", "EmulationMxfp8LinearKernel"])
    if device == "h100":
        fi = next(c for c in sel.candidates if c.kernel == "FlashInferCutlassMxfp8LinearKernel")
        assert fi.failures == ("CC 9.0 < 10.0",)
        assert any("weight-only MXFP8 (W8A16) through Marlin" in n for n in sel.notes)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "gptqmodel", "qtool"])
def test_gptoss_expert_stacks_are_not_planned_as_linear_layers(engine):
    # [E, O, I/32, 16] stacks are fused-MoE weights: no engine's linear kernel (nor qtool's torch-ref, which reads
    # 2-D weights) runs them; inspect gives their true shape and select leaves them out with a note
    from qtool.inspect.core import inspect_path

    (m,) = inspect_path(FP4 / "gptoss-mxfp4").modules
    assert (m.scheme.extra["experts"], m.out_features, m.in_features) == (2, 64, 384)
    groups, notes, _ = path_groups(FP4 / "gptoss-mxfp4", "bf16")
    assert groups == [] and any("1 gptoss_mxfp4 mixture-of-experts stack(s) not planned" in n for n in notes)
    assert notes[-1] == "no selectable layer: every quantized module is a mixture-of-experts stack"
    assert plan_select(groups, profile("b200"), engine).layers == []


@pytest.mark.parametrize("engine,needle", [
    ("vllm", "vLLM's Mxfp4Config has no MXFP4 linear method"),
    ("sglang", "SGLang's Mxfp4Config has no MXFP4 linear path"),
])
def test_a_2d_gptoss_layer_is_refused_with_the_true_reason(engine, needle):
    # gpt-oss's config quantizes MoE experts only: a linear layer in its layout meets a method that has no
    # linear path, refused at config time, and no kernel is listed as if it could run it
    from qtool.kernels.select import LayerQuant, select_kernel
    from qtool.scheme import QuantScheme

    q = QuantScheme(format="gptoss_mxfp4", bits=4, group_size=32, sym=True, desc_act=False)
    sel = select_kernel(LayerQuant(name="l", in_features=2048, out_features=1024, scheme=q, act_dtype="bfloat16"),
                        profile("b200"), engine)
    assert sel.chosen is None and [c.kind for c in sel.candidates] == ["method"]
    assert needle in sel.candidates[0].reason
    assert any(n.startswith("refused by ") and n.endswith(" at config time, before any kernel is tried")
               for n in sel.notes)
