"""Mixture-of-experts checkpoints without a model forward: routers stay dense in pack, 3-D expert stacks are
copied dense with a warning, and validate holds a layer's experts to one scheme and its router to dense, as
vLLM's and SGLang's fused MoE layers need."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from qtool.pack import PackJob, run_pack
from tests.conftest import write_llama
from tests.test_validate import fails, run_json


def test_routers_stay_dense_by_structure(tmp_path):
    from qtool.inspect.detect import moe_routers

    names = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
             "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
             "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w1.weight",
             "model.layers.2.mlp.router.weight", "model.layers.2.mlp.experts.gate_up_proj_blocks",
             "transformer.blocks.0.ffn.router.layer.weight", "transformer.blocks.0.ffn.experts.mlp.w1",
             # a gate with no experts beside it is an ordinary linear
             "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.up.weight",
             "model.layers.4.mlp.shared_expert_gate.weight"]
    assert moe_routers(names) == {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                                  "model.layers.1.block_sparse_moe.gate", "model.layers.2.mlp.router",
                                  "transformer.blocks.0.ffn.router.layer"}


def test_three_dimensional_expert_stacks_are_copied_dense_with_a_warning(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).half(),
         "model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g).half(),
         "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 128, generator=g).half(),
         "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 64, generator=g).half()}
    (tmp_path / "src").mkdir()
    write_llama(tmp_path / "src", t, "float16")
    rep = run_pack(PackJob(tmp_path / "src", tmp_path / "out", "gptq", group_size=32))
    warn = [w for w in rep.warnings if "3 or more dimensions" in w]
    assert len(warn) == 1 and warn[0].startswith("2 float tensor(s)") and "(92% of the bytes)" in warn[0], rep.warnings
    assert [p.module for p in rep.plan if p.action == "quantize"] == ["model.layers.0.self_attn.q_proj"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        for n in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.router.weight"):
            assert torch.equal(f.get_tensor(n), t[n])


MIXTRAL_ROLES = (("w1", (32, 64)), ("w3", (32, 64)), ("w2", (64, 32)))


def _moe_checkpoint(d, seed=0, roles=MIXTRAL_ROLES, router="block_sparse_moe.gate", block="block_sparse_moe"):
    """Two layers of attention and 8 experts with a router, as Mixtral (or, with other names, Qwen-MoE) stores
    them."""
    g = torch.Generator().manual_seed(seed)
    d.mkdir()
    t = {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g).half()
        t[p + router + ".weight"] = torch.randn(8, 64, generator=g).half()
        for e in range(8):
            for role, shape in roles:
                t[p + f"{block}.experts.{e}.{role}.weight"] = torch.randn(*shape, generator=g).half()
    write_llama(d, t, "float16")
    return t


def test_validate_holds_each_moe_layer_to_one_scheme_and_a_dense_router(tmp_path):
    _moe_checkpoint(tmp_path / "src")
    run_pack(PackJob(tmp_path / "src", tmp_path / "ok", "gptq", group_size=32))
    rep, code = run_json(tmp_path / "ok")
    assert code == 0 and fails(rep) == []
    assert any(c["name"] == "contract" and "2 mixture-of-experts layers: one scheme each; 2 routers, dense" in c["detail"]
               for c in rep["checks"])
    # one expert at 8 bits, the routers packed too: neither loads in vLLM's fused MoE layer
    run_pack(PackJob(tmp_path / "src", tmp_path / "bad", "gptq", group_size=32, tensor_types=[r"experts\.3\.=8"],
                     include=[r"layers\.0\.", r"layers\.1\.(?!block_sparse_moe\.gate)"]))
    rep, code = run_json(tmp_path / "bad")
    assert code == 1 and sorted(fails(rep)) == [
        ("contract", "model.layers.0.block_sparse_moe"), ("contract", "model.layers.0.block_sparse_moe.gate"),
        ("contract", "model.layers.1.block_sparse_moe")]
    detail = {c["module"]: c["detail"] for c in rep["checks"] if c["status"] == "fail"}
    assert "21 gptq 4-bit g32 sym, 3 gptq 8-bit g32 sym" in detail["model.layers.0.block_sparse_moe"]
    assert "router stored quantized" in detail["model.layers.0.block_sparse_moe.gate"]


def test_select_leaves_experts_to_the_engines_fused_moe_layer(tmp_path):
    """vLLM and SGLang run a layer's experts as one FusedMoE module through the method's MoE variant, not
    through the linear kernels select declares; GPTQModel runs each expert as a linear module."""
    from qtool.kernels.devices import resolve_device
    from qtool.select.plan import path_groups, plan_select

    _moe_checkpoint(tmp_path / "src")
    run_pack(PackJob(tmp_path / "src", tmp_path / "q", "gptq", group_size=32))
    groups, _, _ = path_groups(tmp_path / "q")
    h100 = resolve_device("h100")
    for engine in ("vllm", "sglang"):
        sel = plan_select(groups, h100, engine)
        assert not any(".experts." in row.name for row in sel.layers) and sel.layers
        assert any(n.startswith("48 mixture-of-experts expert layers not planned: ") and "FusedMoE" in n
                   for n in sel.notes), sel.notes
    sel = plan_select(groups, h100, "gptqmodel")
    assert sum(row.count for row in sel.layers if ".experts." in row.name) == 48
    # experts only, in a layout vLLM reads: nothing for its linear kernels to plan, and validate says so
    run_pack(PackJob(tmp_path / "src", tmp_path / "i8", "ct_int8", bits=8, include=[r"\.experts\."]))
    rep, code = run_json(tmp_path / "i8", "--engine", "vllm", "--target", "h100")
    skips = [c["detail"] for c in rep["checks"] if c["name"] == "contract" and c["status"] == "skip"]
    assert code == 0 and any("no linear layer to plan" in d for d in skips), rep["checks"]


def _qwen_moe_gptq8(tmp_path):
    """A Qwen3-MoE checkpoint (_moe_checkpoint with Qwen's names and config) in src, its 8-bit g32 GPTQ pack in q;
    the dense tensors."""
    t = _moe_checkpoint(tmp_path / "src", roles=(("gate_proj", (32, 64)), ("up_proj", (32, 64)),
                                                 ("down_proj", (64, 32))), router="mlp.gate", block="mlp")
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
           "num_experts_per_tok": 2, "torch_dtype": "float16"}
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    run_pack(PackJob(tmp_path / "src", tmp_path / "q", "gptq", bits=8, group_size=32))
    return t


def test_hf_experts_become_llama_cpp_expert_stacks_in_gguf(tmp_path):
    """A GPTQ pack's per-expert modules go to GGUF as llama.cpp holds them: one [E, O, I] tensor per layer and
    projection, named by the gguf package's map, the experts' blocks in expert order (8-bit g32 -> Q8_0 is
    exact, so every expert decodes to its own dequantized GPTQ weight), with the expert counts in the
    metadata. llama.cpp itself runs such files: benchmarks/results/interop.md."""
    import gguf
    import numpy as np

    from qtool.formats import dequantize, get_format
    from qtool.repack.run import RepackJob, run_repack
    from qtool.repack.source import open_source

    t = _qwen_moe_gptq8(tmp_path)
    rep = run_repack(RepackJob(tmp_path / "q", "q8_0", tmp_path / "m.gguf"))
    assert any("48 expert modules written as 6 [experts, out, in] stacks" in w for w in rep.plan.warnings)
    assert not any("no llama.cpp name" in w for w in rep.plan.warnings)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {x.name: x for x in r.tensors}
    assert not any("experts" in n for n in tensors)
    kv = {k: r.fields[k].parts[-1].tolist() for k in r.fields if "expert" in k}
    assert kv == {"qwen3moe.expert_count": [8], "qwen3moe.expert_used_count": [2],
                  "qwen3moe.expert_feed_forward_length": [32]}
    src = open_source(tmp_path / "q")
    mods = {m.name: m for m in src.modules}
    for layer in range(2):
        for role, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                            ("down_proj", "ffn_down_exps")):
            x = tensors[f"blk.{layer}.{gname}.weight"]
            o, i = t[f"model.layers.{layer}.mlp.experts.0.{role}.weight"].shape
            assert [int(d) for d in x.shape] == [i, o, 8] and x.tensor_type == gguf.GGMLQuantizationType.Q8_0
            got = gguf.quants.dequantize(np.array(x.data), x.tensor_type).reshape(8, o, i)
            for e in range(8):
                m = mods[f"model.layers.{layer}.mlp.experts.{e}.{role}"]
                want = dequantize(get_format(m.scheme.format).unpack(src.load(m), m.scheme), torch.float32)
                assert np.array_equal(got[e], want.numpy()), (layer, role, e)
    src.close()


def test_experts_kept_out_of_a_gguf_conversion_are_named_once_per_stack(tmp_path):
    """--exclude on the experts: each [E, O, I] stack is written dequantized, and the plan says so once a stack
    (naming how many of its experts), not once for each of its experts."""
    from qtool.repack.run import RepackJob, run_repack

    _qwen_moe_gptq8(tmp_path)
    rep = run_repack(RepackJob(tmp_path / "q", "q8_0", tmp_path / "m.gguf", exclude=(r"\.experts\.",)))
    kept = [w for w in rep.plan.warnings if "kept out of the conversion" in w]
    assert len(kept) == 6, kept
    assert all(".experts.0." not in w and "8 of 8 experts" in w and w.endswith("dequantized as F16")
               for w in kept), kept
    assert any("48 expert modules written as 6 [experts, out, in] stacks" in w for w in rep.plan.warnings)
