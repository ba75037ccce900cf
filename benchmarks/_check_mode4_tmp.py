import sys; sys.path.insert(0, "tests")
from kernel_cases import run_cases
from test_kernels_gpu import _MODES, _LAYERS
bad = 0; n = 0
for dt in ("fp16", "bf16"):
    for m in (1, 5, 16, 100):
        cases = [(m, k, nn, g, a, s, dt, c) for k, nn, g, a, s in _LAYERS for c in _MODES if c and c.get("mode") == 4]
        for r, c in zip(run_cases("cuda", cases), cases):
            n += 1
            if not (r["finite"] and r["err"] <= 4 * r["base"]):
                bad += 1; print("BAD", c, r)
print(f"mode4 check: {n} cases, {bad} bad")
