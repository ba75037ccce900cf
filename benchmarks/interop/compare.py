"""Gather the two sides' outputs of benchmarks/interop/run.sh into one record (run with qtool's venv).

    python compare.py WORK_DIR OUT.json

MiniLM: per-sentence cosine of each loader's mean-pooled embedding to the dense model's. SmolLM2: the greedy
text of each step, the logit drift per generated position (teacher-forced on the source GGUF's tokens: max
and mean |logit - source logit|, and whether the top token agrees), and which tensors of the round-tripped
GGUF are bit-identical to the source's."""

import json
import sys
from pathlib import Path

import gguf
import numpy as np


def cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def drift(x, ref):
    x, ref = np.asarray(x), np.asarray(ref)
    d = np.abs(x - ref)
    return {"max_abs": [round(float(v), 4) for v in d.max(-1)], "mean_abs": [round(float(v), 4) for v in d.mean(-1)],
            "top1_agrees": [bool(v) for v in x.argmax(-1) == ref.argmax(-1)]}


def plan_counts(path):
    text = Path(path).read_text()
    d = json.loads(text[text.index("{"):])  # the JSON object; lines printed before it are skipped
    return {"counts": {k: v for k, v in d["counts"].items() if v}, "warnings": d["warnings"][:6],
            "max_rel_error": max((m["rel_error"] or 0 for m in d["modules"]), default=0.0),
            "max_abs_error": max((m["max_error"] or 0 for m in d["modules"]), default=0.0)}


def identical_tensors(a, b):
    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    same = [n for n in ta if n in tb and ta[n].tensor_type == tb[n].tensor_type
            and np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data))]
    types = {}
    for n, t in ta.items():
        types.setdefault(t.tensor_type.name, [0, 0])[0] += 1
        types[t.tensor_type.name][1] += n in same
    return {"tensors": len(ta), "identical": len(same), "by_type": {k: f"{v[1]} of {v[0]}" for k, v in types.items()},
            "types_back": sorted({t.tensor_type.name for t in tb.values()})}


def main(work, out):
    w = Path(work)
    ll = json.loads((w / "minilm-llama.json").read_text())
    hf = json.loads((w / "minilm-hf.json").read_text())
    c_ll = cos(ll["embeddings"], hf["dense_mean_pool"])
    c_tf, c_st = np.array(hf["transformers_ct"]["cosine"]), np.array(hf["sentence_transformers_ct"]["cosine"])
    minilm = {"llama_cpp_q4_0_vs_dense": round(float(c_ll.mean()), 5),
              "transformers_ct_vs_dense": round(float(c_tf.mean()), 5),
              "sentence_transformers_ct_vs_dense": round(float(c_st.mean()), 5),
              "difference_llama_cpp_minus_transformers": round(float(c_ll.mean() - c_tf.mean()), 5),
              "transformers_load": hf["transformers_ct"]["load"],
              "sentence_transformers_modules": hf["sentence_transformers_ct"]["modules"],
              "sentence_transformers_load": hf["sentence_transformers_ct"]["load"],
              "per_sentence": {"llama_cpp": [round(float(v), 5) for v in c_ll],
                               "transformers_ct": [round(float(v), 5) for v in c_tf]}}
    a = json.loads((w / "smol-gguf.json").read_text())
    b = json.loads((w / "smol-ct.json").read_text())
    c = json.loads((w / "smol-back.json").read_text())
    smol = {"source_gguf_llama_cpp": {"text": a["text"], "tokens": a["new_tokens"]},
            "ct_transformers": {"text": b["text"], "tokens": b["new_tokens"], "load": b["load"],
                                "same_tokens_as_source": b["new_tokens"] == a["new_tokens"],
                                "drift_vs_source": drift(b["logits"], a["logits"])},
            "back_gguf_llama_cpp": {"text": c["text"], "tokens": c["new_tokens"],
                                    "same_tokens_as_source": c["new_tokens"] == a["new_tokens"],
                                    "same_tokens_as_ct": c["new_tokens"] == b["new_tokens"],
                                    "drift_vs_source": drift(c["logits_on_ref"], a["logits"]),
                                    "drift_vs_ct": drift(c["logits_on_ref"], b["logits"])},
            "plans": {"gguf_to_ct": plan_counts(w / "smol-ct-plan.json"),
                      "ct_to_gguf": plan_counts(w / "smol-back-plan.json")},
            "round_trip_tensors": identical_tensors(w / "source.gguf", w / "smol-back.gguf")}
    rec = {"minilm": minilm, "smollm2": smol}
    old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}  # other checks' keys (rope_side.py)
    Path(out).write_text(json.dumps(old | rec, indent=1) + "\n")
    print(json.dumps({"minilm": {k: v for k, v in minilm.items() if k != "per_sentence"},
                      "smollm2_texts": [a["text"], b["text"], c["text"]],
                      "round_trip": smol["round_trip_tensors"]}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
