"""Mixture-of-experts weights as one linear per expert, for calibration and evaluation.

transformers 5 holds a MoE layer's experts fused in memory: one `gate_up_proj` [E, 2I, H] and one `down_proj`
[E, H, I] parameter, filled at load from the per-expert tensors the checkpoint stores
(`experts.{e}.gate_proj|up_proj|down_proj`, Mixtral's `w1|w3|w2`). Calibration needs each expert's own
inputs (the tokens routed to it) and eval needs to put each expert's dequantized weight in, so such a module is
replaced by `SplitExperts`: the same forward over `nn.Linear`s named as the checkpoint names them. A class is
split only when its layout is the default one (`use_experts_implementation` without options: concatenated
[gate; up], not transposed, no bias, no post-expert norm) and a trial on random routed tokens gives the fused
forward's output; any other experts module stays fused, and `fused_experts` says which and why.
"""

from __future__ import annotations

import torch

from qtool.io.checkpoint import EXPERT_MODULE

# (role in SplitExperts, the names checkpoints give it)
ROLES = (("gate_proj", ("gate_proj", "w1")), ("up_proj", ("up_proj", "w3")), ("down_proj", ("down_proj", "w2")))
TRIAL_RTOL = 1e-5


class _Expert(torch.nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            setattr(self, name, lin)


class SplitExperts(torch.nn.ModuleList):
    """The experts of one layer as `[e].gate_proj/up_proj/down_proj` linears; forward(hidden [T, H],
    top_k_index [T, k], top_k_weights [T, k]) as the fused module's: Σ over the token's experts of
    weight · down(act(gate(x)) · up(x)). gate and up read the same tensor, so calibration groups them."""

    def __init__(self, experts, act_fn):
        super().__init__(experts)
        self.act_fn = act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < len(self):  # an index past the experts marks a dropped slot
                continue
            token, slot = torch.where(top_k_index == e)
            x = hidden_states[token]
            ex = self[e]
            y = ex.down_proj(self.act_fn(ex.gate_proj(x)) * ex.up_proj(x)) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _default_layout(mod) -> str | None:
    """Why `mod` (a module with 3-D expert parameters) cannot be split, or None when it can."""
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == down.dim() == 3):
        return "no gate_up_proj/down_proj expert stacks"
    flags = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
             "has_post_expert_norm": False}
    off = [k for k, v in flags.items() if getattr(mod, k, v) != v]
    if off:
        return "layout " + ", ".join(f"{k}={getattr(mod, k)}" for k in off)
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(down.shape) != (E, H, two_i // 2) or not hasattr(mod, "act_fn"):
        return f"stacks {tuple(gu.shape)} and {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
    return None


def _split(mod) -> SplitExperts:
    gu, down = mod.gate_up_proj.detach(), mod.down_proj.detach()
    i = gu.shape[1] // 2
    return SplitExperts([_Expert(gu[e, :i], gu[e, i:], down[e]) for e in range(gu.shape[0])], mod.act_fn)


def _same_forward(mod, split: SplitExperts) -> bool:
    """The split module's output equals the fused one's on random tokens routed to every expert."""
    E, _, H = mod.gate_up_proj.shape
    w = mod.gate_up_proj
    g = torch.Generator().manual_seed(0)
    T, k = 2 * E, min(2, E)
    x = torch.randn(T, H, generator=g).to(w.device, w.dtype)
    idx = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E][:k], 1).to(w.device)
    wt = torch.rand(T, k, generator=g).to(w.device, w.dtype)
    with torch.no_grad():
        a, b = mod(x, idx, wt), split(x, idx, wt)
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    # another association of the same sums (the fused module may run grouped GEMMs) differs by rounding in
    # the dtype; a forward that is not this one (an interleaved gate/up, another activation) differs by O(1)
    tol = max(TRIAL_RTOL, 16 * torch.finfo(w.dtype).eps)
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * float(a.abs().max())))


def split_experts(model) -> list[str]:
    """Replace every fused experts module of `model` that has the default layout by a SplitExperts (in place;
    its linears share the fused parameters' memory). Returns the module names split."""
    checked: dict[type, bool] = {}
    done = []
    for name, mod in list(model.named_modules()):
        if not _is_fused(name, mod) or _default_layout(mod) is not None:
            continue
        split = _split(mod)
        if type(mod) not in checked:
            checked[type(mod)] = _same_forward(mod, split)
        if not checked[type(mod)]:
            mod._qtool_unsplit = "its forward is not the gate/up/down experts forward"
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, split)
        done.append(name)
    return done


def _is_fused(name: str, mod) -> bool:
    """An experts module (named `experts`, or of an `...Experts` class) holding 3-D parameters; a Conv1d's
    3-D weight is none."""
    named = name.rpartition(".")[2] == "experts" or "Experts" in type(mod).__name__
    return named and any(p.dim() == 3 for p in mod.parameters(recurse=False))


def fused_experts(model) -> dict[str, str]:
    """{module name: why it stays fused} for the expert stacks `split_experts` left."""
    out = {}
    for name, mod in model.named_modules():
        if _is_fused(name, mod):
            out[name] = getattr(mod, "_qtool_unsplit", None) or _default_layout(mod) or "not split"
    return out


def split_expert_weights(model) -> set[str]:
    """The parameter names of the linears in `model`'s SplitExperts."""
    return {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, SplitExperts)
            for p, _ in m.named_parameters()}


_CANONICAL_ROLE = {name: role for role, names in ROLES for name in names}


def canonical_expert(name: str) -> str | None:
    """An expert weight's name with what checkpoints and transformers name differently taken out: the module
    holding the experts (Mixtral's `block_sparse_moe` is `mlp` in memory) and the role's name (`w1` is
    `gate_proj`): `model.layers.0.experts.3.gate_proj.weight`. None for any other name. hf.name_map matches
    these forms as it matches plain names."""
    m = EXPERT_MODULE.match(name.removesuffix(".weight")) if name.endswith(".weight") else None
    block, dot, _ = m["parent"].rpartition(".") if m else ("", "", "")
    role = _CANONICAL_ROLE.get(m["role"]) if dot else None
    return None if role is None else f"{block}.experts.{m['e']}.{role}.weight"
