"""The llama.cpp side of the interop checks (run in /work/envs/llama: llama-cpp-python built from source).

    python llama_side.py embed MODEL.gguf OUT.json            # mean-pooled embeddings of the sentences
    python llama_side.py generate MODEL.gguf OUT.json [REF]   # greedy continuation; logits per step, and
                                                              # teacher-forced on REF's tokens when given
"""

import json
import sys

import llama_cpp.llama_cpp as C
import numpy as np
from common import N_NEW, PROMPT, SENTENCES
from llama_cpp import Llama

# The llama-cpp-python 0.3.36 build here was compiled with AMX; its AMX weight buffers crash on this VM
# (SIGSEGV in ggml_backend_amx_mul_mat, on any model whose weights it repacks). Weights stay in plain CPU
# buffers, as llama.cpp's --no-extra-bufts does; the Llama class has no argument for it, so its default
# parameters are patched.
_defaults = C.llama_model_default_params


def _plain_buffers():
    p = _defaults()
    p.use_extra_bufts = False
    return p


C.llama_model_default_params = _plain_buffers


def embed(path, out):
    m = Llama(model_path=path, embedding=True, verbose=False, n_ctx=512, n_batch=512, n_ubatch=512)
    e = [m.embed(s, normalize=False) for s in SENTENCES]
    json.dump({"embeddings": e}, open(out, "w"))
    print(f"llama.cpp embeddings: {len(e)} x {len(e[0])}")


def logits_for(m, tokens):
    m.reset()
    m.eval(tokens)
    return np.array(m.scores[:len(tokens)])


def generate(path, out, ref=None):
    m = Llama(model_path=path, verbose=False, n_ctx=256, logits_all=True)
    prompt = m.tokenize(PROMPT.encode(), add_bos=False)
    toks = list(prompt)
    for _ in range(N_NEW):  # greedy, one token at a time, from the full logits
        toks.append(int(np.argmax(logits_for(m, toks)[-1])))
    new = toks[len(prompt):]
    res = {"prompt_tokens": prompt, "new_tokens": new,
           "text": m.detokenize(new).decode("utf-8", "replace"),
           "logits": logits_for(m, toks)[len(prompt) - 1:len(prompt) - 1 + N_NEW].tolist()}
    if ref:
        r = json.load(open(ref))
        seq = r["prompt_tokens"] + r["new_tokens"]
        n0 = len(r["prompt_tokens"])
        res["logits_on_ref"] = logits_for(m, seq)[n0 - 1:n0 - 1 + N_NEW].tolist()
    json.dump(res, open(out, "w"))
    print(f"llama.cpp: {res['text']!r}")


if __name__ == "__main__":
    {"embed": embed, "generate": generate}[sys.argv[1]](*sys.argv[2:])
