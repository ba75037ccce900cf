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
    groups, _ = path_groups(FP4 / folder, "bf16")
    assert {(g.layer.format, g.layer.group_size) for g in groups} == {(fmt, group)}
    assert {r.selection.chosen for r in plan_select(groups, profile("h100"), "vllm").layers} == {h100}
    assert {r.selection.chosen for r in plan_select(groups, profile("b200"), "vllm").layers} == {b200}


@pytest.mark.parametrize("folder", ["ct-mxfp8", "gptoss-mxfp4"])
def test_undeclared_layouts_are_refused_with_the_reason(folder):
    # no declaration covers MXFP8 linear layers or gpt-oss's MoE expert blocks: select says so, never guesses
    groups, _ = path_groups(FP4 / folder, "bf16")
    for r in plan_select(groups, profile("b200"), "vllm").layers:
        assert r.selection.chosen is None
        assert "is not a checkpoint format vLLM loads" in r.selection.candidates[0].reason
