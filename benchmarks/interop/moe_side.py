"""The sides of benchmarks/interop/moe_gguf.sh: mixture-of-experts models through GGUF.

    python moe_side.py make DIR ARCH             # a tiny random Qwen3-MoE (qwen3moe), Qwen2-MoE with a shared
                                                 # expert (qwen2moe) or Mixtral (mixtral), with a
                                                 # byte-level BPE tokenizer llama.cpp reads (transformers)
    python moe_side.py llama MODEL.gguf OUT.json # llama.cpp's logits over TOKENS (llama-cpp-python)
    python moe_side.py compare DENSE_DIR LLAMA.json OUT.json KEY
                                                 # transformers on the dense directory qtool writes back from the
                                                 # same pack, against llama.cpp's logits (OUT's key KEY)

The GGUF is the 8-bit g32 GPTQ pack converted to Q8_0 (exact), and the dense directory is that pack
dequantized (exact): both engines run the same weights, so the logits differ by arithmetic only. The experts
are the layout under test: each layer's experts become one [E, O, I] tensor in llama.cpp."""

import json
import sys
from pathlib import Path

from common import llama_logits, save_bpe_tokenizer

TOKENS = [(37 * i * i + 11 * i + 5) % 290 + 3 for i in range(64)]


def make(out, arch):
    import torch
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    shared = dict(vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    if arch == "qwen3moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                                   head_dim=32, norm_topk_prob=True, **shared))
    elif arch == "qwen2moe":  # a shared expert beside the routed ones, with its own sigmoid gate
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                                   shared_expert_intermediate_size=128, **shared))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=8, **shared))
    with torch.no_grad():
        for n, p in model.named_parameters():
            # routers 20x wider than the rest: a token's top-2 experts are then clear of the third, so llama.cpp's
            # 8-bit activations pick the experts transformers does (a near-tie flipped costs a whole expert)
            p.normal_(0, 1.0 if n.endswith("gate.weight") else 0.05) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(out)
    save_bpe_tokenizer(out)


def llama(path, out):
    llama_logits(path, TOKENS, out)


def compare(dense, llama_json, out, key):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    ref = np.array(json.load(open(llama_json))["logits"])
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor([TOKENS])).logits[0].numpy()
    err = np.abs(got - ref).max(-1)
    rec = {"tokens": len(TOKENS), "logit_scale": round(float(np.abs(ref).max()), 4),
           "max_abs_logit_difference": round(float(err.max()), 5),
           "median_of_positions": round(float(np.median(err)), 5),
           "top1_agrees": int((got.argmax(-1) == ref.argmax(-1)).sum())}
    old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}  # the other scripts' keys stay
    Path(out).write_text(json.dumps(old | {key: rec}, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    {"make": make, "llama": llama, "compare": compare}[sys.argv[1]](*sys.argv[2:])
