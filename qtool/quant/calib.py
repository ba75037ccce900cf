"""Calibrated quantization (GPTQ, AWQ) driven block by block through a transformers model.

The model is loaded on the CPU; its repeated blocks (the longest nn.ModuleList of identical modules holding
linears: BERT's encoder.layer, Llama's model.layers, ...) are found by structure, not by family name. The
inputs of the first block are captured by running the model up to it; then, one block at a time, the block
moves to the device, its linears' inputs are gathered (H = 2xᵀx/n and the mean |x| per channel), the linears
are quantized, their weights replaced by the dequantized ones, and the block's output with quantized weights
becomes the next block's input. The samples' block inputs and outputs stay in host memory and move to the
device one batch per forward, and each Hessian is freed as soon as its last linear is factored, so peak device
memory is one block, one batch's activations and the block's Hessians.
With `forward_dtype` (GPTQ; e.g. bfloat16, which CPUs with AMX or AVX512-BF16 multiply about 4x faster than
float32) the model runs in that dtype while every linear is quantized from its weight as loaded, kept aside;
only the activations that form H, and the next blocks' inputs, carry the lower precision.

Linears that read the same input tensor form a group (q/k/v; gate/up); groups are found by running the block
once with hooks, in execution order; GPTQ quantizes a group as one stacked weight (one Hessian, one
factorization, one column loop). `true_sequential` quantizes group by group, each group's inputs taken
with the groups before it already quantized. AWQ folds a group's scales into the op that produces the
group's input: a module whose output tensor is that input (a norm: weight and bias divided by s) or a linear
of the block whose outputs feed it (rows divided by s). A fold is used only when a trial with random scales
leaves the block's output unchanged (relative change below FOLD_TOL): a post-norm block whose norm output is
also the residual, or an activation between two linears, fails that trial and the group keeps s = 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qtool.errors import InputError, UsageError
from qtool.formats.plain import Plain, dequantize, relative_error
from qtool.quant import gptq as gptq_mod
from qtool.quant.awq import clip_quantize, search_scales
from qtool.quant.experts import fused_experts

FOLD_TOL = 1e-4
BATCH_TOKENS = 4096


@dataclass(frozen=True)
class CalibSettings:
    method: str  # "gptq" | "awq"
    sym: bool
    scale_dtype: torch.dtype = torch.float16
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = False
    damp: float = gptq_mod.DAMP
    device: str = "cpu"
    clip: bool = gptq_mod.MSE  # gptq: each group's scale from a clip search (gptq.py)
    group_aware: bool = False  # gptq --act-order: natural groups kept whole (gptq.py), no g_idx
    # gptq: dtype the model's forward runs in (None: as loaded); the weights are quantized from their values
    # as loaded either way
    forward_dtype: torch.dtype | None = None


@dataclass
class LayerResult:
    module: str  # the model's module name; calibrate_checkpoint's results carry the checkpoint's
    plain: Plain
    loss: float | None  # output relative error on the calibration inputs, tr(ΔW H ΔWᵀ)/tr(W H Wᵀ); None: no inputs
    rtn_loss: float | None  # the same for plain RTN of the same (scaled) weight
    rel_error: float  # ‖W − Ŵ‖/‖W‖ against the weight that was quantized (AWQ: the scaled one)
    note: str = ""
    deq: torch.Tensor | None = field(default=None, repr=False)  # dequantized weight on the device, when at hand


@dataclass
class CalibResult:
    layers: dict[str, LayerResult] = field(default_factory=dict)
    # parameters changed by folding AWQ scales that are not replaced by a quantized layer: name -> tensor
    dense_updates: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    blocks: str = ""
    n_samples: int = 0
    seqlen: int = 0


class _Stop(Exception):
    """Raised by a hook to end a forward pass once what it needed is captured."""


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """(name, ModuleList) of the model's repeated blocks: the ModuleList of same-class children holding the
    most nn.Linear layers."""
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(k) for k in mod}
        if len(kinds) != 1:
            continue
        n = sum(isinstance(x, torch.nn.Linear) for k in mod for x in k.modules())
        if n and (best is None or n > best[0]):
            best = (n, name, mod)
    if best is None:
        raise UsageError("the model has no repeated blocks of linear layers to calibrate",
                         fix="use --method rtn or mse for this model")
    return best[1], best[2]


def token_windows(ids: torch.Tensor, n: int, seqlen: int, seed: int = 0,
                  specials: tuple[list[int], list[int]] = ([], [])) -> tuple[list[torch.Tensor], str]:
    """n windows of seqlen tokens from ids int64 [T] at random offsets (seeded), each wrapped in the special
    tokens the model sees in use (specials = (before, after), e.g. BERT's [CLS] ... [SEP]); fewer tokens when
    the text is short, with a note saying so."""
    head, tail = specials
    body = max(1, seqlen - len(head) - len(tail))
    T = int(ids.numel())
    if T == 0:
        raise InputError("the calibration text has no tokens", fix="give a longer --calib file")

    def wrap(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor(head, dtype=torch.int64), w, torch.tensor(tail, dtype=torch.int64)])[None]

    if T < body:
        return [wrap(ids)], f"the calibration text has {T} tokens, fewer than --calib-seqlen {seqlen}: one " \
                            f"sample of {T} tokens used"
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, T - body + 1, (n,), generator=g).tolist()
    note = ""
    if n * body > T:  # random windows of a short text overlap: the samples are not n * body distinct tokens
        note = (f"the calibration text has {T} tokens, fewer than the {n} x {body} asked for: the windows "
                f"overlap ({len(set(starts))} distinct starts), so tokens repeat; give a longer --calib text for "
                "more distinct data")
    return [wrap(ids[s:s + body]) for s in starts], note


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _with_hidden(args: tuple, kwargs: dict, h: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def batches(samples: list[torch.Tensor], tokens: int = BATCH_TOKENS) -> list[torch.Tensor]:
    """Consecutive samples [1, L] of equal length stacked into batches [b, L] of at most `tokens` tokens (one
    sample at least): the block's forward runs on a few large matmuls instead of many small ones."""
    out: list[list[torch.Tensor]] = []
    for x in samples:
        last = out[-1] if out else None
        if last and last[0].shape == x.shape and (len(last) + 1) * x.shape[-1] <= tokens:
            last.append(x)
        else:
            out.append([x])
    return [torch.cat(b, 0) for b in out]


def capture_block_inputs(model, blocks, samples: list[torch.Tensor], device: str) -> list[tuple[tuple, dict]]:
    """(args, kwargs) each batch's forward passes to the first block, kept in host memory: each forward
    moves its batch to the block's device (`_call`), so the device holds one batch's activations, not every
    sample's (128 x 2048 tokens of Llama-3-8B's hidden states are 2 GiB, twice: a block's inputs and
    outputs). The forward up to the first block (embeddings, position encodings) runs where the model's
    parameters outside the blocks are, normally the CPU: it is cheap, and `device` then holds no embedding
    or output head."""
    got: list[tuple[tuple, dict]] = []

    def pre(_mod, args, kwargs):
        got.append((_to(args, "cpu"), _to({k: v for k, v in kwargs.items()}, "cpu")))
        raise _Stop

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    where = emb.weight.device if emb is not None and getattr(emb, "weight", None) is not None else device
    h = blocks[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for ids in samples:
            try:
                model(input_ids=ids.to(where))
            except _Stop:
                pass
    finally:
        h.remove()
    if len(got) != len(samples):
        raise UsageError("the model's forward did not reach its first block", fix="use --method rtn or mse")
    return got


def _call(block, args: tuple, kwargs: dict):
    """The block's forward on one batch kept in host memory, moved to where the block is."""
    dev = next(block.parameters()).device
    return block(*_to(args, dev), **_to(kwargs, dev))


def _run(block, inputs) -> list[torch.Tensor]:
    """The block's output on every batch, back in host memory."""
    return [_first(_call(block, a, k)).to("cpu") for a, k in inputs]


@dataclass
class _Linear:
    name: str  # full module name in the model
    mod: torch.nn.Linear
    bits: int
    group_size: int
    master: torch.Tensor | None = None  # the weight as loaded, when the forward runs in another dtype
    reached: bool = True  # by the forward that ordered the block's linears (_groups)

    def weight(self) -> torch.Tensor:
        return (self.mod.weight.detach() if self.master is None else self.master).float()


def _groups(block, linears: dict[int, _Linear], sample) -> tuple[list[list[_Linear]], dict[int, str | None]]:
    """Linears grouped by the input tensor they read, in execution order, and for each group (keyed by the
    id of its first linear's module) the block-relative name of the module whose output is that input."""
    order: list[tuple[int, torch.Tensor]] = []
    produced: dict[int, str] = {}
    hooks = []
    names = {id(m): n for n, m in block.named_modules()}

    def on_linear(mod, args):
        if id(mod) in linears:
            order.append((id(mod), args[0]))

    def on_output(mod, args, out):
        if isinstance(out, torch.Tensor):
            produced.setdefault(id(out), names[id(mod)])
            keep.append(out)

    keep: list[torch.Tensor] = []
    for _, m in block.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(on_linear))
        if m is not block:
            hooks.append(m.register_forward_hook(on_output))
    try:
        _call(block, *sample)
    finally:
        for h in hooks:
            h.remove()
    groups: list[list[_Linear]] = []
    producer: dict[int, str | None] = {}
    seen: dict[int, list[_Linear]] = {}
    done: set[int] = set()
    for mid, x in order:
        if mid in done:
            continue
        done.add(mid)
        g = seen.get(id(x))
        if g is None:
            g = seen[id(x)] = []
            groups.append(g)
            producer[mid] = produced.get(id(x))
        g.append(linears[mid])
    # never run: linears the sample's forward did not reach still get quantized, each on its own
    for mid, lin in linears.items():
        if mid not in done:
            lin.reached = False
            groups.append([lin])
            producer[mid] = None
    return groups, producer


def _gather(block, groups: list[list[_Linear]], inputs, device, track_mean: bool = False
            ) -> dict[int, gptq_mod.Hessian]:
    """Run the block on every batch, accumulating one Hessian (and with track_mean the mean |x|) per group of
    linears that read the same input; {id(linear module): its group's Hessian}. Each forward stops once the
    last group has its input: with true_sequential the first steps then cost a fraction of a block."""
    stats: dict[int, gptq_mod.Hessian] = {}
    hooks = []
    # a linear the ordering forward did not reach (an expert no token of that sample was routed to) has no
    # known place in the order: it may run before others, so every forward then runs to the end
    ordered = all(lin.reached for g in groups for lin in g)
    last = groups[-1][0].mod if groups and ordered else None
    names = {id(lin.mod): lin.name for g in groups for lin in g}

    def hook(mod, args):
        x = args[0].detach()
        if not bool(torch.isfinite(x).all()):  # a Hessian of them would only fail later, blaming the samples
            raise InputError(f"the inputs of '{names[id(mod)]}' hold NaN/Inf on the calibration samples (an "
                             f"overflow in {str(x.dtype).removeprefix('torch.')})", tensor=names[id(mod)],
                             fix="--calib-dtype fp32 (or bf16), or check the source weights")
        stats[id(mod)].add(x)
        if mod is last:  # groups are in execution order: the rest of the block's forward is not needed
            raise _Stop

    for g in groups:
        H = gptq_mod.Hessian(g[0].mod.in_features, device, track_mean)
        for lin in g:
            stats[id(lin.mod)] = H
        hooks.append(g[0].mod.register_forward_pre_hook(hook))
    try:
        for a, k in inputs:
            try:
                _call(block, a, k)
            except _Stop:
                pass
    finally:
        for h in hooks:
            h.remove()
    return stats


def _set_weight(lin: _Linear, plain: Plain, deq: torch.Tensor | None = None) -> None:
    """Put the dequantized weights in the model; `deq` (float32, equal to dequantize(plain)) saves
    recomputing them on the CPU."""
    w = dequantize(plain, torch.float32) if deq is None else deq
    lin.mod.weight.data.copy_(w.to(lin.mod.weight.device, lin.mod.weight.dtype))


def _relative_error(W: torch.Tensor, deq: torch.Tensor) -> float:
    """‖W − Ŵ‖/‖W‖ in float64 where the tensors are."""
    W = W.double()
    return float((W - deq.double()).norm() / W.norm().clamp(min=1e-300))


def _rtn_loss(W: torch.Tensor, H: torch.Tensor, lin: _Linear, s: CalibSettings) -> float:
    """The report's RTN reference for a layer's loss, measured as GPTQ measures its own: float32 products,
    summed in float64 (a float64 product would cost more than the layer's GPTQ on the CPU)."""
    from qtool.quant.awq import fake_quant

    def err(d: torch.Tensor) -> float:
        return float(torch.sum((d @ H) * d, dtype=torch.float64))

    G = W.shape[1] if lin.group_size == -1 else lin.group_size
    den = err(W)
    return err(fake_quant(W, lin.bits, G, s.sym, s.scale_dtype) - W) / den if den > 0 else 0.0


def _quantize_gptq(lin: _Linear, H: gptq_mod.Hessian, s: CalibSettings, last: bool = False) -> LayerResult:
    """GPTQ of one linear from its group's Hessian; `last`: no other linear needs H, so GPTQ takes it over
    (Hessian.take) and can free it while it works."""
    W = lin.weight().to(H.H.device)
    if H.n == 0:
        # the calibration forward never reached this linear: no data to calibrate on, so plain RTN
        from qtool.quant import quantize

        plain = quantize(W.cpu(), lin.bits, lin.group_size, s.sym, "rtn", s.scale_dtype, name=lin.name)
        return LayerResult(lin.name, plain, None, None, relative_error(W.cpu(), plain),
                           "not reached by the calibration forward: quantized with RTN")
    rtn_loss = _rtn_loss(W, H.H, lin, s)
    r = gptq_mod.gptq_quantize(W, H.take() if last else H.H, lin.bits, lin.group_size, s.sym, s.scale_dtype,
                               act_order=s.act_order, static_groups=s.static_groups, damp=s.damp, name=lin.name,
                               clip=s.clip, group_aware=s.group_aware, consume=last)
    note = f"dampening raised to {r.damp:g}" if r.damp != s.damp else ""
    return LayerResult(lin.name, r.plain, r.loss, rtn_loss, _relative_error(W, r.deq), note, deq=r.deq)


def _quantize_gptq_group(group: list[_Linear], H: gptq_mod.Hessian, s: CalibSettings) -> list[LayerResult]:
    """GPTQ of linears that read one input (q/k/v, gate/up) as one stacked weight: GPTQ treats rows
    independently given H and the column order, so this is each linear's GPTQ, with one factorization of
    H and one column loop for the group instead of one per linear. Rows are split back per linear, each
    with its own loss."""
    W_all = torch.cat([lin.weight().to(H.H.device) for lin in group])
    bounds = [0]
    for lin in group:
        bounds.append(bounds[-1] + lin.mod.out_features)
    Ws = [W_all[a:b] for a, b in zip(bounds, bounds[1:])]  # views: one copy of the stacked weight
    rtn = [_rtn_loss(W, H.H, lin, s) for W, lin in zip(Ws, group)]
    first = group[0]
    r = gptq_mod.gptq_quantize(W_all, H.take(), first.bits, first.group_size, s.sym, s.scale_dtype,
                               act_order=s.act_order, static_groups=s.static_groups, damp=s.damp,
                               name=", ".join(lin.name for lin in group), clip=s.clip, group_aware=s.group_aware,
                               consume=True)
    note = f"dampening raised to {r.damp:g}" if r.damp != s.damp else ""
    out, a = [], 0
    p = r.plain
    for W, lin, rl in zip(Ws, group, rtn):
        b = a + W.shape[0]
        plain = Plain(p.qweight[a:b], p.scales[a:b], None if p.zeros is None else p.zeros[a:b], p.g_idx, p.bits,
                      p.group_size, meta=dict(p.meta))
        den = float(r.row_den[a:b].sum())
        loss = float(r.row_num[a:b].sum()) / den if den > 0 else 0.0
        deq = r.deq[a:b]
        out.append(LayerResult(lin.name, plain, loss, rl, _relative_error(W, deq), note, deq=deq))
        a = b
    return out


def _fold_candidates(block, group: list[_Linear], producer: str | None, order: list[_Linear]):
    """Ops that may absorb 1/s for this group's input: the producing module when it is a norm-like module
    (a 1-D weight of in_features) or a linear; else linears of the block run before the group whose
    out_features equal in_features, nearest first."""
    n_in = group[0].mod.in_features
    mods = dict(block.named_modules())
    out = []
    if producer is not None:
        m = mods[producer]
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) or (isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() == n_in):
            out.append(producer)
    first = order.index(group[0])
    names = {id(m): n for n, m in block.named_modules()}
    for lin in reversed(order[:first]):
        if lin.mod.out_features == n_in and names[id(lin.mod)] not in out:
            out.append(names[id(lin.mod)])
    return out


# How a norm's weight enters its output: w (most), or 1 + w (Gemma's RMSNorm, which stores the offset from 1). A
# fold divides the factor by s either way; AutoAWQ folds Gemma's norms the same way.
NORM_FORMS = (0.0, 1.0)


def _apply_fold(block, target: str, group: list[_Linear], scale: torch.Tensor, offset: float = 0.0) -> None:
    """Divide `target`'s output by `scale` and multiply the group's inputs columns by it; a norm whose factor
    is `offset + w` gets w' = (offset + w) / s - offset."""
    m = dict(block.named_modules())[target]
    s = scale.to(m.weight.device, m.weight.dtype)
    if isinstance(m, torch.nn.Linear):
        m.weight.data.div_(s.unsqueeze(1))
    elif offset:
        m.weight.data.add_(offset).div_(s).sub_(offset)
    else:
        m.weight.data.div_(s)
    if getattr(m, "bias", None) is not None:
        m.bias.data.div_(s)
    for lin in group:
        lin.mod.weight.data.mul_(s.to(lin.mod.weight.dtype))


def _fold_is_exact(block, target: str, group: list[_Linear], probe, reference: list[torch.Tensor],
                   offset: float = 0.0) -> bool:
    """Fold random scales in [0.5, 2] into target (a norm's factor read as offset + w) and the group; keep
    nothing; True when the block's output on `probe` is unchanged."""
    n_in = group[0].mod.in_features
    g = torch.Generator().manual_seed(1)
    s = torch.exp2(torch.rand(n_in, generator=g) * 2 - 1)
    saved = {n: p.detach().clone() for n, p in block.named_parameters()}
    try:
        _apply_fold(block, target, group, s, offset)
        out = _run(block, probe)
    finally:
        with torch.no_grad():
            for n, p in block.named_parameters():
                p.copy_(saved[n])
    num = sum(float((a.float() - b.float()).norm() ** 2) for a, b in zip(out, reference))
    den = sum(float(b.float().norm() ** 2) for b in reference)
    return math.isfinite(num) and num <= (FOLD_TOL ** 2) * den


def _quantize_awq_block(block, block_name: str, groups, producer, inputs, s: CalibSettings,
                        result: CalibResult) -> dict[int, LayerResult]:
    order = [lin for g in groups for lin in g]
    stats = _gather(block, groups, inputs, s.device, track_mean=True)
    probe = inputs[: min(2, len(inputs))]
    reference = _run(block, probe)
    mods = dict(block.named_modules())
    names = {id(m): n for n, m in mods.items()}
    scales: dict[int, torch.Tensor] = {}
    folds: list[tuple[str, list[_Linear], torch.Tensor, float]] = []
    for g in groups:
        first = g[0]
        G = first.mod.in_features if first.group_size == -1 else first.group_size
        if any(lin.bits != first.bits or lin.group_size != first.group_size for lin in g):
            result.notes.append(f"AWQ: {block_name}: {', '.join(names[id(x.mod)] for x in g)} read one input "
                                "but differ in bits/group; no scales for them")
            continue
        forms = [(t, off) for t in _fold_candidates(block, g, producer.get(id(first.mod)), order)
                 for off in ((0.0,) if isinstance(mods[t], torch.nn.Linear) else NORM_FORMS)]
        target, offset = next(((t, off) for t, off in forms if _fold_is_exact(block, t, g, probe, reference, off)),
                              (None, 0.0))
        what = ", ".join(names[id(x.mod)] for x in g)
        if stats[id(first.mod)].n == 0:  # never run: no activations to weigh, and the fold test proves nothing
            continue
        if target is None:
            result.notes.append(f"AWQ: {block_name}: no op before {what} can absorb scales exactly; "
                                "clip search only")
            continue
        H = stats[id(first.mod)]
        sc, _, _ = search_scales([lin.mod.weight.detach().float() for lin in g], H.H, H.x_mean, first.bits, G,
                                 s.sym, s.scale_dtype)
        folds.append((target, g, sc, offset))
    for target, g, sc, offset in folds:
        _apply_fold(block, target, g, sc, offset)
        for lin in g:
            scales[id(lin.mod)] = sc.to(s.device)
        result.notes.append(f"AWQ: {block_name}: scales of {', '.join(names[id(x.mod)] for x in g)} "
                            f"folded into {target}" + (f" (its factor {offset:g} + w)" if offset else ""))
    out: dict[int, LayerResult] = {}
    for lin in order:
        if stats[id(lin.mod)].n == 0:
            from qtool.quant import quantize

            W = lin.mod.weight.detach().float().cpu()
            plain = quantize(W, lin.bits, lin.group_size, s.sym, "rtn", s.scale_dtype, name=lin.name)
            out[id(lin.mod)] = LayerResult(lin.name, plain, None, None, relative_error(W, plain),
                                           "not reached by the calibration forward: quantized with RTN")
            continue
        Hs = stats[id(lin.mod)].H
        sc = scales.get(id(lin.mod))
        if sc is not None:  # the input is now x / s
            Hs = Hs / (sc.unsqueeze(0) * sc.unsqueeze(1))
        W = lin.mod.weight.detach().float()
        plain = clip_quantize(W, Hs, lin.bits, lin.group_size, s.sym, s.scale_dtype)
        from qtool.quant.awq import output_error

        den = output_error(W, Hs)
        loss = output_error(dequantize(plain, torch.float32).to(W.device) - W, Hs) / den if den > 0 else 0.0
        out[id(lin.mod)] = LayerResult(lin.name, plain, loss, _rtn_loss(W, Hs, lin, s),
                                       relative_error(W.cpu(), plain))
    return out


def calibrate(model, samples: list[torch.Tensor], targets: dict[str, tuple[int, int]], s: CalibSettings,
              on_block: Callable[[int, int], None] | None = None) -> CalibResult:
    """Quantize the linears named in `targets` ({model module name: (bits, group_size)}) of `model` block by
    block (see the module docstring); returns their Plains, per-layer losses and the dense parameters that
    AWQ folding changed ({model parameter name: tensor}). Linears outside the blocks are left to the caller.
    """
    if s.method not in ("gptq", "awq"):
        raise UsageError(f"unknown calibration method '{s.method}'", fix="use gptq or awq")
    if s.forward_dtype is not None and s.method != "gptq":
        raise UsageError("a calibration forward dtype applies to gptq only (AWQ folds scales into the model)",
                         fix="drop --calib-dtype")
    block_name, blocks = find_blocks(model)
    masters: dict[str, torch.Tensor] = {}
    if s.forward_dtype is not None and s.forward_dtype != next(model.parameters()).dtype:
        mods = dict(model.named_modules())
        masters = {n: mods[n].weight.detach().clone() for n in targets if n in mods}
        model.to(s.forward_dtype)
    result = CalibResult(blocks=block_name, n_samples=len(samples), seqlen=int(samples[0].shape[-1]))
    model.eval()
    if getattr(getattr(model, "config", None), "use_cache", False):
        # a KV cache captured with the first block's inputs would grow with every forward of every block
        # (and its past keys would leak between batches)
        model.config.use_cache = False
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(block_name + ".")} \
        if s.method == "awq" else {}
    with torch.no_grad():
        inputs = capture_block_inputs(model, blocks, batches(samples), s.device)
        for b, block in enumerate(blocks):
            if on_block:
                on_block(b, len(blocks))
            prefix = f"{block_name}.{b}"
            block.to(s.device)
            lins = {}
            for n, m in block.named_modules():
                full = f"{prefix}.{n}"
                if isinstance(m, torch.nn.Linear) and full in targets:
                    bits, group = targets[full]
                    lins[id(m)] = _Linear(full, m, bits, group, masters.pop(full, None))
            if lins:
                groups, producer = _groups(block, lins, inputs[0])
                if s.method == "gptq":
                    done = _gptq_block(block, groups, inputs, s)
                else:
                    done = _quantize_awq_block(block, prefix, groups, producer, inputs, s, result)
                for mid, lr in done.items():
                    if s.method == "awq":  # GPTQ put its weights in as it went
                        _set_weight(lins[mid], lr.plain)
                    result.layers[lr.module] = lr
            outs = _run(block, inputs)
            for o in outs:
                if not bool(torch.isfinite(o).all()):
                    raise InputError(f"block {prefix} gives non-finite outputs on the calibration samples",
                                     tensor=prefix, fix="check the source weights, or use --method rtn")
            inputs = [_with_hidden(a, k, o) for (a, k), o in zip(inputs, outs)]
            block.to("cpu")
    if on_block:
        on_block(len(blocks), len(blocks))
    quantized = {f"{lr.module}.weight" for lr in result.layers.values()}
    for n, p in model.named_parameters():
        if n in before and n not in quantized and not torch.equal(before[n], p.detach().cpu()):
            result.dense_updates[n] = p.detach().cpu().clone()
    return result


def _gptq_block(block, groups, inputs, s: CalibSettings) -> dict[int, LayerResult]:
    """GPTQ every linear of the block: from the block's inputs all at once, or with true_sequential group by
    group, each group's inputs taken with the groups before it already quantized. A group's Hessian is
    dropped once its linears are done, so at most one block's Hessians are alive."""
    out: dict[int, LayerResult] = {}
    steps = [[g] for g in groups] if s.true_sequential else [groups]
    for step in steps:
        stats = _gather(block, step, inputs, s.device)
        for g in step:
            H = stats[id(g[0].mod)]
            same = all((lin.bits, lin.group_size) == (g[0].bits, g[0].group_size) for lin in g)
            done = _quantize_gptq_group(g, H, s) if len(g) > 1 and same and H.n > 0 else \
                [_quantize_gptq(lin, H, s, last=k == len(g) - 1) for k, lin in enumerate(g)]
            for lin, lr in zip(g, done):
                out[id(lin.mod)] = lr
                # the inputs are gathered already, so the weights can change now; the next step's (true-
                # sequential) forward sees them quantized
                _set_weight(lin, lr.plain, lr.deq)
                lr.deq = None
            del H
            for lin in g:
                del stats[id(lin.mod)]
    return out


def _check_renamed_experts(model, names: dict[str, str], src) -> None:
    """A split expert found under another name in the checkpoint (experts.canonical_expert: Mixtral's w1/w3/w2)
    must hold that tensor's values: the role names are qtool's reading of the layout, so each is compared."""
    from qtool.io.checkpoint import open_checkpoint
    from qtool.quant.experts import split_expert_weights

    split = split_expert_weights(model)
    renamed = {m: c for m, c in names.items() if m != c and m in split}
    if not renamed:
        return
    params = dict(model.named_parameters())
    with open_checkpoint(src) as ck:
        for m, c in renamed.items():
            if not torch.equal(params[m].detach().cpu(), ck.get(c).to(params[m].dtype)):
                raise InputError(f"the model's expert weight '{m}' does not hold the checkpoint tensor of that "
                                 "expert and role", path=src, tensor=c,
                                 fix="calibrate with --method rtn, or report the architecture")


def check_activation_memory(src, n_samples: int, seqlen: int) -> None:
    """Refuse, before the model is loaded, windows whose block inputs and outputs (kept in host memory, fp32)
    would not fit: n_samples x seqlen (at most the model's positions) x hidden_size x 4 bytes, twice."""
    from qtool.io.checkpoint import model_config
    from qtool.io.memory import available_bytes

    cfg = model_config(src)  # {} for a config that is not readable: loading the model names what is wrong
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    hidden = cfg.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        return
    positions = cfg.get("max_position_embeddings")
    tokens = n_samples * (min(seqlen, positions) if isinstance(positions, int) and positions > 1 else seqlen)
    need, (have, what) = 2 * tokens * hidden * 4, available_bytes()
    if need > have:
        raise UsageError(f"{n_samples} calibration windows of {tokens // n_samples} tokens hold about "
                         f"{need / 2**30:.1f} GiB of activations (hidden size {hidden}), more than the "
                         f"{have / 2**30:.1f} GiB {what}", fix="give fewer --calib-samples or a shorter --calib-seqlen")


def calibrate_checkpoint(src, tensor_names, targets: dict[str, tuple[int, int]], s: CalibSettings,
                         text_file=None, n_samples: int = 128, seqlen: int = 256,
                         on_block: Callable[[int, int], None] | None = None, seed: int = 0
                         ) -> tuple[CalibResult, dict]:
    """Calibrate the model directory `src` for the checkpoint weights in `targets` ({tensor name:
    (bits, group_size)}). Returns the result keyed by checkpoint names (layers by weight name, dense updates
    by tensor name) and a summary of the data and settings for the report."""
    from qtool.quant import calib_text, hf

    check_activation_memory(src, n_samples, seqlen)
    model, tok, causal = hf.build_model(src, "cpu")
    if text_file is None:
        text, source = calib_text.stdlib_docstrings(calib_text.CALIB_MODULES), calib_text.DEFAULT_CALIB
    else:
        text, source = calib_text.read_text(text_file), str(text_file)
    limit = hf.max_positions(model)
    L = min(seqlen, limit) if limit else seqlen
    samples, short = token_windows(hf.tokenize(tok, text), n_samples, L, seed, specials=hf.specials(tok))
    names = hf.name_map([n for n, _ in model.named_parameters()], tensor_names, model)
    _check_renamed_experts(model, names, src)
    back = {c: m for m, c in names.items()}
    model_targets = {}
    for w, bg in targets.items():
        m = back.get(w)
        if m is not None and m.endswith(".weight"):
            model_targets[m[: -len(".weight")]] = bg
    res = calibrate(model, samples, model_targets, s, on_block)
    out = CalibResult(notes=list(res.notes), blocks=res.blocks, n_samples=res.n_samples, seqlen=res.seqlen)
    fused = fused_experts(model)
    if fused:
        name, why = next(iter(fused.items()))
        out.notes.append(f"{len(fused)} mixture-of-experts stack(s) held fused by transformers are not calibrated "
                         f"(the first '{name}': {why})")
    for mod, lr in res.layers.items():
        weight = names[f"{mod}.weight"]
        lr.module = weight[: -len(".weight")]
        out.layers[weight] = lr
    for n, t in res.dense_updates.items():
        if n not in names:
            raise InputError(f"AWQ changed the model parameter '{n}', which has no tensor in the checkpoint",
                             path=src, fix="use --method gptq for this model")
        out.dense_updates[names[n]] = t
    if short:
        out.notes.append(short)
    if L < seqlen:
        out.notes.append(f"--calib-seqlen {seqlen} is beyond the model's {limit} positions: {L} used")
    summary = {"method": s.method, "text": source, "default_text": text_file is None, "samples": len(samples),
               "seqlen": int(samples[0].shape[-1]), "seed": seed, "blocks": res.blocks, "device": s.device,
               "act_order": s.act_order, "static_groups": s.static_groups, "true_sequential": s.true_sequential,
               "damp": s.damp, "mse": s.clip if s.method == "gptq" else None, "causal": causal,
               "forward_dtype": None if s.forward_dtype is None else str(s.forward_dtype).removeprefix("torch."),
               "layers": [{"module": lr.module, "loss": lr.loss, "rtn_loss": lr.rtn_loss, "note": lr.note}
                          for lr in res.layers.values()]}
    return out, summary
