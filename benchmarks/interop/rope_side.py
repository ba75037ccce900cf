"""The sides of benchmarks/interop/rope_llama3.sh.

    python rope_side.py make DIR            # a tiny random Llama with llama3 RoPE scaling (transformers)
    python rope_side.py llama MODEL.gguf OUT.json     # llama.cpp's logits over TOKENS (llama-cpp-python)
    python rope_side.py compare WORK OUT.json         # transformers on qtool's GGUF -> HF directory, against
                                                      # them (OUT's key "rope_llama3")

The scaling's original context (64) is short and the sequence long (200 tokens), so the factors matter at most
positions; `compare` also runs the same directory with rope_scaling removed from its config.json, which is what
transformers ran before qtool wrote the scaling back."""

import json
import shutil
import sys
from pathlib import Path

from common import llama_logits, save_bpe_tokenizer

TOKENS = [(37 * i * i + 11 * i + 5) % 290 + 3 for i in range(200)]
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def make(out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, rope_scaling=SCALING, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(out)
    save_bpe_tokenizer(out)


def llama(path, out):
    llama_logits(path, TOKENS, out)


def compare(work, out):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    w = Path(work)
    ref = np.array(json.load(open(w / "llama.json"))["logits"])
    plain = w / "back-unscaled"
    shutil.copytree(w / "back", plain)
    cfg = json.loads((plain / "config.json").read_text())
    written = cfg.pop("rope_scaling", None)
    (plain / "config.json").write_text(json.dumps(cfg))
    rec = {"tokens": len(TOKENS), "source_rope_scaling": SCALING, "written_rope_scaling": written,
           "logit_scale": round(float(np.abs(ref).max()), 4)}
    for name, d in (("written", w / "back"), ("without_rope_scaling", plain)):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.no_grad():
            got = model(torch.tensor([TOKENS])).logits[0].numpy()
        err = np.abs(got - ref).max(-1)
        rec[name] = {"max_abs_positions_0_7": round(float(err[:8].max()), 4),
                     "max_abs_positions_64_199": round(float(err[64:].max()), 4),
                     "top1_agrees": int((got.argmax(-1) == ref.argmax(-1)).sum())}
    plan = json.loads((w / "back-plan.json").read_text())
    rec["plan_warnings"] = [x for x in plan["warnings"] if "rope" in x]
    old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}  # run.sh's keys stay
    Path(out).write_text(json.dumps(old | {"rope_llama3": rec}, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    {"make": make, "llama": llama, "compare": compare}[sys.argv[1]](*sys.argv[2:])
