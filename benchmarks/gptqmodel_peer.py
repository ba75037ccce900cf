"""The peer: GPTQModel quantizing the same model on the same calibration windows as `qtool pack --method gptq`.

Runs in GPTQModel's own environment (not qtool's, never in CI), with qtool's source on sys.path only to draw
the identical calibration windows (qtool.quant.calib_text's default text, token_windows, seed 0):

    /work/envs/gptqmodel/bin/python benchmarks/gptqmodel_peer.py MODEL_DIR OUT_DIR --bits 4 --group-size 64
    qtool eval OUT_DIR --reference MODEL_DIR --json        # the same evaluator as for qtool's own packs

GPTQModel 7.7 was installed with --no-deps over torch 2.13 CPU (it asks torch >= 2.14.1) plus the packages of
its requirements.txt other than torch. Its settings are its defaults (damp 0.05, true-sequential,
act_group_aware, desc_act off) with bits, group size and sym given. Prints one JSON line: wall seconds, CPU
seconds of the process (the machine is shared, so both, and the load average before and after).
GPTQModel compiles its `pack_block_cpu` extension on first use (over 400 s on 2 cores) and caches it under
~/.cache/gptqmodel/torch_extensions/: run once to warm that cache before a timed run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=256)
    a = ap.parse_args()

    import gptqmodel
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel import __version__ as gm_version

    # GPTQModel 7.7 sizes its CPU pool as (cores + 1) // 2 = 1 on 2 cores, then asks 2 workers of it for
    # loading and stops with "Virtual pool 'model_loader:cpu' requests 2 workers": give its pool both cores
    gptqmodel._default_cpu_workers = lambda: max(2, os.cpu_count() or 1)

    from qtool.quant import calib_text, hf
    from qtool.quant.calib import token_windows

    tok = hf.transformers().AutoTokenizer.from_pretrained(str(a.model), local_files_only=True)
    text = calib_text.stdlib_docstrings(calib_text.CALIB_MODULES)
    windows, _ = token_windows(hf.tokenize(tok, text), a.samples, a.seqlen, specials=hf.specials(tok))
    data = [{"input_ids": w[0].tolist(), "attention_mask": [1] * w.shape[-1]} for w in windows]

    load0 = os.getloadavg()
    t, c = time.time(), time.process_time()
    qc = QuantizeConfig(bits=a.bits, group_size=a.group_size, sym=True)
    model = GPTQModel.load(str(a.model), qc, device="cpu")
    model.quantize(data, batch_size=1, tokenizer=tok)
    quant_wall, quant_cpu = time.time() - t, time.process_time() - c
    model.save(str(a.out))
    row = {"tool": f"GPTQModel {gm_version}", "torch": torch.__version__, "bits": a.bits, "group_size": a.group_size,
           "samples": len(data), "seqlen": a.seqlen, "damp": qc.damp_percent, "desc_act": qc.desc_act,
           "act_group_aware": getattr(qc, "act_group_aware", None), "true_sequential": qc.true_sequential,
           "quantize_wall_s": round(quant_wall, 1), "quantize_cpu_s": round(quant_cpu, 1),
           "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
           "threads": torch.get_num_threads()}
    print(json.dumps(row), flush=True)
    (a.out / "peer.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
