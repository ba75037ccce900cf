"""Relative weight error of a dense checkpoint against the model it came from (used by `make demo`).

    python scripts/weight_error.py REFERENCE DENSE [--pack-report PACK_DIR]

For every tensor of REFERENCE: ||W_dense - W_ref|| / ||W_ref|| in float64 (0 for the tensors carried
unchanged); prints the three largest and the mean. With --pack-report, each error must equal the one
`qtool pack` reported for that module (PACK_DIR/report.json) to 1e-5 relative: the dense weights are what the
packed codes decode to (pack measures against the float64 decode; an fp32 file rounds each weight once, 2^-24). Exit 1 on a missing tensor, a shape change, a NaN or a disagreement.
"""

import json
import math
import sys

import torch

from qtool.io.checkpoint import open_checkpoint

args = sys.argv[1:]
pack = None
if "--pack-report" in args:
    k = args.index("--pack-report")
    pack = json.loads(open(f"{args[k + 1]}/report.json").read())
    del args[k:k + 2]
ref, out = open_checkpoint(args[0]), open_checkpoint(args[1])
reported = {t["module"]: t["rel_error"] for t in pack["tensors"]} if pack else {}
errors, same, bad = {}, 0, []
for name, info in ref.tensors.items():
    if name not in out.tensors or list(out.tensors[name].shape) != list(info.shape):
        bad.append(f"{name}: missing or reshaped")
        continue
    a, b = ref.get(name).to(torch.float64), out.get(name).to(torch.float64)
    if torch.equal(a, b):
        same += 1
        continue
    e = float(torch.linalg.vector_norm(b - a) / torch.linalg.vector_norm(a))
    if math.isnan(e):
        bad.append(f"{name}: NaN")
    errors[name] = e
    want = reported.get(name.removesuffix(".weight"))
    if pack and (want is None or abs(e - want) > 1e-5 * max(want, 1e-30)):
        bad.append(f"{name}: {e:.6%} here, pack reported {want}")
for name, e in sorted(errors.items(), key=lambda x: -x[1])[:3]:
    print(f"{name:45s} {e:9.4%}")
mean = sum(errors.values()) / max(len(errors), 1)
print(f"{len(errors)} weights changed (largest above; unweighted mean relative error {mean:.4%}), "
      f"{same} tensors identical"
      + (", each error equal to the one pack reported" if pack and not bad else ""))
for b in bad:
    print("problem:", b)
sys.exit(1 if bad else 0)
