"""The transformers / sentence-transformers side of the interop checks (run in /work/envs/hf).

    python hf_side.py minilm DENSE_DIR CT_DIR OUT.json     # embeddings: dense vs qtool's ct pack
    python hf_side.py smol CT_DIR TOKENS.json OUT.json     # SmolLM2 from GGUF -> ct: greedy text, logits

The ct pack is read through compressed-tensors: as stored (run_compressed) where transformers accepts it, else
decompressed on load (`dequantize=True`); which one is recorded."""

import json
import sys

import torch
from common import N_NEW, PROMPT, SENTENCES


def mean_pool(model, tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1)


def load(cls, path, **kw):
    from transformers import CompressedTensorsConfig

    try:
        return cls.from_pretrained(path, dtype=torch.float32, **kw), "compressed"
    except Exception as e:  # noqa: BLE001 - recorded: which path the loader took and why
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        m = cls.from_pretrained(path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(
            run_compressed=False), **kw)
        return m, f"decompressed on load (run_compressed failed: {why})"


def minilm(dense_dir, ct_dir, out):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense_dir)
    dense = AutoModel.from_pretrained(dense_dir, dtype=torch.float32)
    ref = mean_pool(dense, tok, SENTENCES)
    q, how = load(AutoModel, ct_dir)
    got = mean_pool(q, AutoTokenizer.from_pretrained(ct_dir), SENTENCES)
    cos_tf = torch.nn.functional.cosine_similarity(ref, got).tolist()
    st_dense = SentenceTransformer(dense_dir, device="cpu").encode(SENTENCES, convert_to_tensor=True)
    from transformers import CompressedTensorsConfig

    st = SentenceTransformer(ct_dir, device="cpu")
    try:
        st_q, st_how = st.encode(SENTENCES, convert_to_tensor=True), "compressed"
    except Exception as e:  # noqa: BLE001 - recorded, then the same files decompressed on load
        st_how = f"decompressed on load (compressed forward failed: {type(e).__name__}: {str(e)[:120]})"
        st = SentenceTransformer(ct_dir, device="cpu", model_kwargs={
            "quantization_config": CompressedTensorsConfig(run_compressed=False)})
        st_q = st.encode(SENTENCES, convert_to_tensor=True)
    cos_st = torch.nn.functional.cosine_similarity(st_dense, st_q).tolist()
    res = {"dense_mean_pool": ref.tolist(), "transformers_ct": {"load": how, "cosine": cos_tf},
           "sentence_transformers_ct": {"modules": [type(m).__name__ for m in st], "load": st_how,
                                        "cosine": cos_st},
           "sentence_transformers_dense_vs_mean_pool": torch.nn.functional.cosine_similarity(
               st_dense, ref).tolist()}
    json.dump(res, open(out, "w"))
    print(f"transformers+ct ({how[:40]}): mean cosine {sum(cos_tf) / len(cos_tf):.5f}; "
          f"sentence-transformers: mean cosine {sum(cos_st) / len(cos_st):.5f} ({len(st)} modules)")


def smol(ct_dir, tokens_json, out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ct_dir)
    model, how = load(AutoModelForCausalLM, ct_dir)
    ref = json.load(open(tokens_json))  # llama.cpp's prompt tokens and greedy continuation of the source GGUF
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        seq = torch.tensor([ref["prompt_tokens"] + ref["new_tokens"]])
        logits = model(seq).logits[0]  # teacher-forced on the source GGUF's sequence
    n0 = len(ref["prompt_tokens"])
    res = {"load": how, "prompt_tokens": ids[0].tolist(), "new_tokens": gen[0, ids.shape[1]:].tolist(),
           "text": tok.decode(gen[0, ids.shape[1]:]),
           "logits": logits[n0 - 1:n0 - 1 + N_NEW].tolist()}
    json.dump(res, open(out, "w"))
    print(f"transformers ({how[:40]}): {res['text']!r}")


if __name__ == "__main__":
    {"minilm": minilm, "smol": smol}[sys.argv[1]](*sys.argv[2:])
