"""Print `qtool eval` numbers side by side: each argument is an eval --json file or a pack report.json
written with --eval, labelled by its method."""

import json
import sys

rows = []
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    ev = d.get("evaluation", d)
    label = d.get("method", "") if "evaluation" in d else ev.get("quant", path)
    rows.append((label, ev))
keys = [("cos_mean", "mean cosine to dense"), ("cos_min", "min cosine"), ("sim_drift_max", "similarity drift max"),
        ("ppl_dense", "perplexity, dense"), ("ppl_quant", "perplexity, quantized")]
width = max(len(str(label)) for label, _ in rows) + 2
print(f"{'':24}" + "".join(f"{str(label)[-30:]:>{max(width, 12)}}" for label, _ in rows))
for key, text in keys:
    if all(ev.get(key) is not None for _, ev in rows):
        print(f"{text:24}" + "".join(f"{ev[key]:>{max(width, 12)}.4f}" for _, ev in rows))
