"""`qtool eval`: what a quantized checkpoint costs in model quality, measured against its dense reference.

Both models run through transformers on the same text. The quantized one is the reference's architecture
with every tensor taken from the quantized checkpoint: each packed module dequantized by qtool's own
`dequantize` (the oracle every kernel is judged against), every other tensor as stored (so AWQ's folded
norms are the ones used).

- causal LMs: perplexity of both over the first `windows` non-overlapping windows of `seqlen` tokens
  (default 32 x 512 = 16k tokens, the size of issue #30's anchor measurement), and the increase. Windows run
  stacked, BATCH_TOKENS per forward, so the CPU multiplies a few large matrices instead of many small ones;
- encoders: mean-pooled sentence embeddings of the text's paragraphs (blank-line separated, the first
  MAX_SENTENCES of four words or more, 256 tokens at most), their cosine to the
  dense ones (mean, min) and the largest change of the pairwise cosine-similarity matrix;
- both: per-layer output error, ‖x Ŵᵀ − x Wᵀ‖/‖x Wᵀ‖ for each quantized linear on the dense model's own
  inputs x (each layer alone, not the drift accumulated through the model). For causal LMs it is measured
  on the first batch of windows only (BATCH_TOKENS tokens): it is a per-layer ratio, well estimated from a
  few thousand tokens, and measuring it costs a second product per linear. When the checkpoint's dense
  tensors differ from the reference's (AWQ folded its scales into them) a layer's inputs are rescaled, so
  per-layer errors are not defined; the report says so and gives the whole-model numbers.
A NaN or inf anywhere is an error, never a number in the report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qtool.errors import InputError

MAX_SENTENCES = 64
DEFAULT_SEQLEN = 512
DEFAULT_WINDOWS = 32
BATCH_TOKENS = 2048


@dataclass
class LayerError:
    module: str
    rel_error: float


@dataclass
class EvalReport:
    quant: str
    reference: str
    kind: str  # "causal" | "encoder"
    text: str
    device: str
    tokens: int = 0
    windows: int = 0
    seqlen: int = 0
    layer_tokens: int = 0  # tokens the per-layer errors were measured on
    ppl_dense: float | None = None
    ppl_quant: float | None = None
    sentences: int = 0
    cos_mean: float | None = None
    cos_min: float | None = None
    sim_drift_max: float | None = None
    layers: list[LayerError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ppl_increase(self) -> float | None:
        if self.ppl_dense is None or self.ppl_quant is None:
            return None
        return self.ppl_quant - self.ppl_dense

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ppl_increase"] = self.ppl_increase
        return d

    def summary_lines(self) -> list[str]:
        lines = [f"eval on {self.text}"]
        if self.kind == "causal":
            lines.append(f"perplexity over {self.windows} windows of {self.seqlen} tokens: dense "
                         f"{self.ppl_dense:.3f}, quantized {self.ppl_quant:.3f} ({self.ppl_increase:+.3f})")
        else:
            lines.append(f"embedding cosine to dense over {self.sentences} sentences: mean {self.cos_mean:.4f}, "
                         f"min {self.cos_min:.4f}; similarity-matrix drift max {self.sim_drift_max:.4f}")
        if self.layers:
            worst = max(self.layers, key=lambda e: e.rel_error)
            mean = sum(e.rel_error for e in self.layers) / len(self.layers)
            on = f" on the first {self.layer_tokens} tokens" if self.kind == "causal" else ""
            lines.append(f"per-layer output error over {len(self.layers)} layers{on}: mean {mean:.4%}, worst "
                         f"{worst.rel_error:.4%} ({worst.module})")
        return lines + self.notes


def quantized_weights(path: Path) -> tuple[dict, set[str], bool]:
    """({tensor name: float tensor} of the dense equivalent of a quantized checkpoint, names of the weights
    that were quantized, whether AWQ calibration made it): packed modules dequantized, every other tensor as
    stored. AWQ folds each layer's input scales into the op before it, a norm or another quantized linear (the
    method qtool records; AutoAWQ files always fold)."""
    import torch

    from qtool.formats import get_format
    from qtool.formats.plain import dequantize
    from qtool.repack.source import open_source

    src = open_source(path)
    if src.container != "safetensors":
        raise InputError("eval reads safetensors checkpoints", path=path, fix="repack the GGUF to gptq first")
    if not src.modules:
        raise InputError("the checkpoint has no quantized modules", path=path,
                         fix="give the quantized model as QUANT and the dense one as --reference")
    out: dict[str, torch.Tensor] = {}
    quantized = set()
    try:
        for m in src.modules:
            fmt = get_format(m.scheme.format)
            plain = fmt.unpack(src.load(m), m.scheme)
            out[f"{m.name}.weight"] = dequantize(plain, torch.float32)
            quantized.add(f"{m.name}.weight")
        for name in src.passthrough:
            out[name] = src.get(name)
    finally:
        src.close()
    method = src.metadata.get("qtool.method")
    if method is None:
        method = str((src.quant_config or {}).get("quant_method", "")).lower()
    awq = method == "awq"
    return out, quantized, awq


def _finite(x: float, what: str, path) -> float:
    if not math.isfinite(x):
        raise InputError(f"{what} is {x} (not a number)", path=path,
                         fix="the quantized weights or the text produce non-finite values; check both")
    return x


def evaluate(quant: str | Path, reference: str | Path, text_file: str | Path | None = None,
             device: str | None = None, seqlen: int = DEFAULT_SEQLEN, windows: int = DEFAULT_WINDOWS,
             dense_memo: dict | None = None) -> EvalReport:
    """`dense_memo` (a dict the caller keeps) holds the dense model's per-window losses across calls, so
    comparing several packs of one reference on one text runs the dense model once."""
    import torch

    from qtool.quant import calib_text, hf

    dev = hf.default_device(device)
    if text_file is None:
        text, source = calib_text.stdlib_docstrings(calib_text.EVAL_MODULES), calib_text.DEFAULT_EVAL
    else:
        text, source = calib_text.read_text(text_file), str(text_file)
    dense, tok, causal = hf.build_model(reference, dev)
    qw, quantized, awq = quantized_weights(Path(quant))
    names = hf.name_map([n for n, _ in dense.named_parameters()] + [n for n, _ in dense.named_buffers()], qw, dense)
    weights = {m: qw[c] for m, c in names.items()}
    qmodel, _, _ = hf.build_model(reference, dev, weights=weights)
    dense.to(dev)
    qmodel.to(dev)
    rep = EvalReport(str(quant), str(reference), "causal" if causal else "encoder", source, dev)
    q_modules = {m[: -len(".weight")]: c for m, c in names.items() if c in quantized}
    if len(q_modules) != len(quantized):
        lost = sorted(quantized - set(q_modules.values()))
        raise InputError(f"{len(lost)} quantized module(s) have no counterpart in the reference model, the first "
                         f"'{lost[0]}'", path=quant, fix="check that --reference is the model that was packed")
    dense_params = dict(dense.named_parameters())
    changed = sorted(m for m, c in names.items() if c not in quantized and m in dense_params
                     and not torch.equal(dense_params[m].detach().float().cpu(), qw[c].float()))
    if awq:
        # AWQ folds scales into norms and linears, quantized ones too: the layers then see rescaled inputs, so
        # a layer's output can only be compared through the whole model
        rep.notes.append("per-layer errors not measured: AWQ folded its scales into the ops before the layers "
                         "(norms, linears); whole-model numbers only")
        q_modules_measured = {}
    elif changed:
        # a method that folds scales (SmoothQuant), or a reference other than the model that was packed
        rep.notes.append(f"per-layer errors not measured: {len(changed)} dense tensors differ from the "
                         f"reference (e.g. '{changed[0]}': scales folded into them, or another reference); "
                         "whole-model numbers only")
        q_modules_measured = {}
    else:
        q_modules_measured = q_modules
    errs = {m: [0.0, 0.0] for m in q_modules_measured}
    qmods = dict(qmodel.named_modules())
    hooks = []

    def layer_hook(name):
        def hook(mod, args, out):
            y_q = torch.nn.functional.linear(args[0], qmods[name].weight, mod.bias)
            errs[name][0] += float((y_q.float() - out.float()).pow(2).sum())
            errs[name][1] += float(out.float().pow(2).sum())
        return hook

    for n, m in dense.named_modules():
        if n in q_modules_measured:
            hooks.append(m.register_forward_hook(layer_hook(n)))
    with torch.inference_mode():
        try:
            if causal:
                memo = None
                if dense_memo is not None:
                    memo = dense_memo.setdefault((str(Path(reference).resolve()), source, seqlen, windows), {})
                _perplexity(rep, dense, qmodel, tok, text, seqlen, windows, dev, hf, hooks, memo)
            else:
                _embeddings(rep, dense, qmodel, tok, text, dev)
        finally:
            for h in hooks:
                h.remove()
    for m, (num, den) in errs.items():
        rep.layers.append(LayerError(q_modules[m][: -len(".weight")],
                                     _finite((num / den) ** 0.5 if den > 0 else 0.0, f"the output error of {m}",
                                             quant)))
    return rep


def _perplexity(rep: EvalReport, dense, qmodel, tok, text: str, seqlen: int, windows: int, dev: str, hf,
                hooks: list, memo: dict | None) -> None:
    """Perplexity of both models over the first `windows` windows, stacked BATCH_TOKENS per forward. The
    per-layer hooks (on the dense model) see the first batch only, then are removed; `memo` ({batch index:
    dense summed loss}) skips the dense forward of batches already measured, except the first while hooks
    need it."""
    import torch

    ids = hf.tokenize(tok, text)
    limit = hf.max_positions(dense)
    L = min(seqlen, limit) if limit else seqlen
    n = min(int(ids.numel()) // L, windows)
    if n == 0:
        raise InputError(f"the text has {int(ids.numel())} tokens, fewer than one window of {L}",
                         fix="give a longer --text")
    per = max(1, BATCH_TOKENS // L)
    nll = {"d": 0.0, "q": 0.0}

    def batch_nll(model, x) -> float:
        logits = model(input_ids=x).logits[:, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                       reduction="sum"))

    for b, k in enumerate(range(0, n, per)):
        x = ids[k * L:min(n, k + per) * L].view(-1, L).to(dev)
        if memo is not None and b in memo and not hooks:
            nll["d"] += memo[b]
        else:
            d = batch_nll(dense, x)
            if memo is not None:
                memo[b] = d
            nll["d"] += d
        nll["q"] += batch_nll(qmodel, x)
        if hooks:
            rep.layer_tokens = int(x.numel())
            for h in hooks:
                h.remove()
            hooks.clear()
    count = n * (L - 1)
    rep.tokens, rep.windows, rep.seqlen = n * L, n, L
    rep.ppl_dense = _finite(math.exp(nll["d"] / count), "the dense perplexity", rep.reference)
    rep.ppl_quant = _finite(math.exp(nll["q"] / count), "the quantized perplexity", rep.quant)


def _embed(model, tok, sentences: list[str], dev: str):
    """float32 [n, hidden] unit-norm mean-pooled embeddings, one sentence at a time: no padding, so the
    per-layer errors measured meanwhile see real tokens only."""
    import torch

    out = []
    # at most 256 tokens, and never past the positions the model has (a small encoder has 128)
    limit = min(256, getattr(model.config, "max_position_embeddings", None) or 256)
    for s in sentences:
        enc = tok(s, truncation=True, max_length=limit, return_tensors="pt").to(dev)
        out.append(model(**enc).last_hidden_state.float()[0].mean(0))
    return torch.nn.functional.normalize(torch.stack(out), dim=-1)


def _embeddings(rep: EvalReport, dense, qmodel, tok, text: str, dev: str) -> None:
    paragraphs = (" ".join(p.split()) for p in text.split("\n\n"))
    sentences = [p for p in paragraphs if len(p.split()) >= 4][:MAX_SENTENCES]
    if len(sentences) < 2:
        raise InputError("the text has fewer than two paragraphs of four words or more", fix="give a longer --text")
    ed, eq = _embed(dense, tok, sentences, dev), _embed(qmodel, tok, sentences, dev)
    cos = (ed * eq).sum(-1)
    drift = (ed @ ed.T - eq @ eq.T).abs()
    rep.sentences = len(sentences)
    rep.cos_mean = _finite(float(cos.mean()), "the mean embedding cosine", rep.quant)
    rep.cos_min = _finite(float(cos.min()), "the min embedding cosine", rep.quant)
    rep.sim_drift_max = _finite(float(drift.max()), "the similarity drift", rep.quant)
