"""The Triton W4A16 kernel under the Triton interpreter on the CPU, at tiny sizes, against the oracle.

TRITON_INTERPRET=1 must be set before triton is first imported, and other tests in this process may have
imported it already, so the cases run in a subprocess (tests/kernel_cases.py). Every launch mode is
covered: the FMA row kernel (mode 0), x @ W on the dot unit (mode 1), the swapped W^T x^T (mode 2),
split-K with atomics, the PTX-dequant kernels (modes 3 and 4, through their Triton-ops twins), act-order, an N
that is not a multiple of 64, K = group x odd, and both dequantize + GEMM paths. bf16 goes through mode 0 and the dequant path only: the interpreter computes a bf16 tl.dot on
the raw uint16 storage (triton 3.9), so bf16 dots are covered by the GPU test instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ERR_FACTOR = 4.0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_w4a16_interpreter_cases():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(HERE / "kernel_cases.py")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    from kernel_cases import INTERP_CASES  # noqa: E402 - after the subprocess, for the case table only

    assert len(results) == len(INTERP_CASES)
    for res in results:
        assert res["refusals"] == [], res
        assert res["finite"], f"case {res['case']} ({res['label']}) left NaN in the output"
        assert res["out_is_result"], res
        # bf16 in the interpreter rounds fp32 -> bf16 by truncation, hence the same factor, not tighter
        assert res["err"] <= ERR_FACTOR * res["base"], res


sys.path.insert(0, str(HERE))
