"""Mixture-of-experts models in pack, calibration and eval: routers stay dense; the experts transformers 5 holds
fused in memory are split into one linear per expert, so GPTQ/AWQ calibrate each on the tokens routed to it and
eval compares each; checkpoints that name experts otherwise (Mixtral's w1/w3/w2) map by role and value; a stack
that cannot be split is named, not passed over."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qtool.quant import calib, experts  # noqa: E402
from tests.test_calib import TEXT, _eval, _pack, _save, _tokenizer  # noqa: E402

SAMPLES = ("--calib-samples", "8", "--calib-seqlen", "32", "--group-size", "32")


def _qwen3_moe(tok):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128))


def _mixtral(tok):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    tok = _tokenizer(d)
    torch.manual_seed(0)
    model = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}[request.param](tok)
    return _save(model, tok, d / "model")


def _text(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text(TEXT)
    return p


def _expert_weights(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    return names, sorted(n for n in names if ".experts." in n)


def test_split_experts_run_the_fused_forward(moe):
    from qtool.quant import hf

    model, _, _ = hf.build_model(moe)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32)
    assert experts.fused_experts(model) == {} and len(experts.fused_experts(ref)) == 2
    assert sum(isinstance(m, experts.SplitExperts) for m in model.modules()) == 2
    ids = torch.randint(5, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # every split linear maps to its own checkpoint tensor, and holds its values
    names, stored = _expert_weights(moe)
    params = dict(model.named_parameters())
    m = hf.name_map(list(params), names, model)
    split = experts.split_expert_weights(model)
    assert len(split) == len(stored) == 2 * 8 * 3 and sorted(m[n] for n in split) == stored
    from safetensors import safe_open

    with safe_open(str(moe / "model.safetensors"), "pt") as f:
        for n in split:
            assert torch.equal(params[n].detach(), f.get_tensor(m[n]).float()), n


def test_gptq_calibrates_every_expert_and_keeps_routers_dense(moe, tmp_path):
    text_file = _text(tmp_path)
    out = tmp_path / "gptq"
    _pack(moe, out, "--method", "gptq", "--calib", str(text_file), *SAMPLES)
    rep = json.loads((out / "report.json").read_text())
    names, stored = _expert_weights(moe)
    layers = {lay["module"]: lay for lay in rep["calibration"]["layers"]}
    assert sorted(f"{n}.weight" for n in layers if ".experts." in n) == stored
    reached = [lay for n, lay in layers.items() if ".experts." in n and lay["loss"] is not None]
    assert len(reached) >= len(stored) // 2 and all(lay["loss"] < lay["rtn_loss"] for lay in reached)
    assert not any("RTN" in n for n in rep["notes"]), rep["notes"]
    routers = [p for p in rep["plan"] if p["module"].endswith(".gate")]
    assert len(routers) == 2 and all(p["action"] == "keep" and "router" in p["reason"] for p in routers)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {f"-:^{p['module']}$".replace(".", "\\.") for p in routers} <= set(cfg["dynamic"])
    e = _eval(out, moe, "--text", str(text_file))
    measured = {x["module"] for x in e["layers"]}
    assert {n.removesuffix(".weight") for n in stored} <= measured
    assert abs(e["ppl_quant"] - e["ppl_dense"]) < 0.05 * e["ppl_dense"]


def test_awq_folds_each_experts_scales_inside_the_expert(moe, tmp_path):
    text_file = _text(tmp_path)
    out = tmp_path / "awq"
    _pack(moe, out, "--method", "awq", "--to", "awq", "--calib", str(text_file), *SAMPLES)
    rep = json.loads((out / "report.json").read_text())
    _, stored = _expert_weights(moe)
    assert sum(".experts." in lay["module"] for lay in rep["calibration"]["layers"]) == len(stored)
    folds = [n for n in rep["notes"] if "folded into" in n and ".experts." in n]
    assert folds and all(n.split("scales of ")[1].split(".experts.")[1].split(".")[0]
                         == n.split("folded into ")[1].split(".experts.")[1].split(".")[0] for n in folds)
    e = _eval(out, moe, "--text", str(text_file))
    assert abs(e["ppl_quant"] - e["ppl_dense"]) < 0.05 * e["ppl_dense"]


class _Stacked(torch.nn.Module):
    """Experts in another layout (transposed, with biases): not the default gate/up/down forward."""

    is_transposed, has_bias = True, True

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 64))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 32, 16))
        self.act_fn = torch.nn.SiLU()


class _WrongForwardExperts(torch.nn.Module):
    """The default layout, but a forward that is not the experts' (an interleaved gate/up, say)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, 16))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 32))
        self.act_fn = torch.nn.SiLU()

    def forward(self, x, idx, w):
        return x * 2


def test_stacks_that_cannot_be_split_stay_fused_and_are_named():
    model = torch.nn.ModuleDict({"experts": _Stacked(), "b": _WrongForwardExperts(), "conv": torch.nn.Conv1d(4, 4, 3)})
    assert experts.split_experts(model) == []
    why = experts.fused_experts(model)
    assert sorted(why) == ["b", "experts"]  # a Conv1d's 3-D weight is no expert stack
    why["a"] = why.pop("experts")
    assert "is_transposed=True" in why["a"] and "has_bias=True" in why["a"]
    assert "not the gate/up/down experts forward" in why["b"]


def test_a_linear_the_ordering_pass_missed_does_not_cut_later_forwards_short():
    """The block's linears are ordered by one forward; one that forward did not reach (an expert no token was
    routed to) has no known place, so no later forward may stop at it before the others have their inputs."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rare, self.after = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, use_rare):
            if use_rare:
                x = self.rare(x)
            return self.after(x)

    block = Block()
    lins = {id(m): calib._Linear(n, m, 4, 8) for n, m in block.named_children()}
    x = torch.randn(3, 8)
    inputs = [((x,), {"use_rare": False}), ((x,), {"use_rare": True})]
    groups, _ = calib._groups(block, lins, inputs[0])
    stats = calib._gather(block, groups, inputs, "cpu")
    assert stats[id(block.after)].n == stats[id(block.rare)].n * 2 == 6


def test_an_expert_mapped_to_the_wrong_tensor_is_refused(moe):
    """Each renamed expert weight (Mixtral's w1 = gate, w3 = up) is compared with the file tensor it maps to: a
    mapping that put an expert's gate on its up tensor is refused before anything is quantized."""
    from qtool.errors import InputError
    from qtool.quant import hf

    names, _ = _expert_weights(moe)
    model, _, _ = hf.build_model(moe)
    mapped = hf.name_map([n for n, _ in model.named_parameters()], names, model)
    calib._check_renamed_experts(model, mapped, moe)  # the real mapping passes
    if all(m == c for m, c in mapped.items() if ".experts." in m):
        return  # Qwen3-MoE's names are transformers' own: nothing is renamed, so nothing is compared
    swapped = dict(mapped)
    for m in mapped:
        if m.endswith(".up_proj.weight"):
            gate = m.replace(".up_proj.", ".gate_proj.")
            swapped[m], swapped[gate] = mapped[gate], mapped[m]
    with pytest.raises(InputError, match="does not hold the checkpoint tensor of that expert and role"):
        calib._check_renamed_experts(model, swapped, moe)
