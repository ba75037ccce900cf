"""`qtool repack --to dense` of an FP8 checkpoint against a plain file copy, and its peak memory (issue 25, goal:
<= 1.5x the time of copying the same bytes, peak RSS <= 1.5 GiB, on a 16 GB checkpoint).

Builds a synthetic DeepSeek-V3-style FP8 checkpoint: per layer the MLA attention projections (q_a, q_b,
kv_a_with_mqa, kv_b, o) and `--experts` routed experts plus one shared expert (gate/up/down), every one an
F8_E4M3 weight with a float32 `weight_scale_inv` per 128x128 block (partial edge blocks where 128 does not
divide, as kv_a_proj_with_mqa's 576 rows); bf16 norms, router weight and embeddings/lm_head, an fp32
e_score_correction_bias; config.json with DeepSeek's `quantization_config` (quant_method fp8, e4m3,
weight_block_size [128, 128], dynamic activations) and torch_dtype bfloat16; shards of about 4 GB with an index.
Layers are added until the checkpoint reaches --size-gb. The codes are random bytes (NaN patterns removed);
a few random blocks are reused across tensors, since only the bytes' count matters for the timing.

Then, once each (`sync` before each timed step, so one step's dirty pages are not written back in the next):

    copy:     `cp -r SRC DST` (copying the input's bytes; DST deleted after)
    dense:    `qtool repack SRC --to dense -o OUT --quiet` in a subprocess (wall, CPU and peak RSS from wait4)
    copy_out: `cp -r OUT OUT2` after SRC is deleted (copying the output's bytes, about twice the input's:
              bf16 is two bytes per fp8 code; OUT2 deleted after)

and checks one module of the output against the fp8 format's own dequantization. The load average is recorded
before each step (the machine is shared). Inputs and outputs are deleted at the end unless --keep.

    .venv/bin/python benchmarks/dense_throughput.py --dir /work/tmp_dense [--size-gb 16] [--experts 8]
        [--json-out benchmarks/results/fp.json --name dense-16gb]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HIDDEN, VOCAB, MOE_INTER, N_ROUTED = 7168, 129280, 2048, 256
ATTN = {  # DeepSeek-V3 MLA: name -> (out_features, in_features)
    "self_attn.q_a_proj": (1536, HIDDEN), "self_attn.q_b_proj": (24576, 1536),
    "self_attn.kv_a_proj_with_mqa": (576, HIDDEN), "self_attn.kv_b_proj": (32768, 512),
    "self_attn.o_proj": (HIDDEN, 16384),
}
EXPERT = {"gate_proj": (MOE_INTER, HIDDEN), "up_proj": (MOE_INTER, HIDDEN), "down_proj": (HIDDEN, MOE_INTER)}
BLOCK = 128
CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": HIDDEN,
          "vocab_size": VOCAB, "moe_intermediate_size": MOE_INTER, "torch_dtype": "bfloat16",
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK]}}


def layer_modules(k: int, experts: int) -> dict[str, tuple[int, int]]:
    p = f"model.layers.{k}."
    out = {p + n: s for n, s in ATTN.items()}
    for e in range(experts):
        out.update({f"{p}mlp.experts.{e}.{n}": s for n, s in EXPERT.items()})
    out.update({f"{p}mlp.shared_experts.{n}": s for n, s in EXPERT.items()})
    return out


def build(dest: Path, size_gb: float, experts: int, vocab: int = VOCAB) -> dict:
    """Write the checkpoint (streaming, one tensor at a time); returns its facts."""
    import torch

    from qtool.io.writer import ShardedWriter

    g = torch.Generator().manual_seed(0)
    pool: dict[tuple[int, int], list] = {}

    def codes(o: int, i: int):
        if (o, i) not in pool:
            pool[(o, i)] = []
        if len(pool[(o, i)]) < 3:
            u = torch.randint(0, 256, (o, i), dtype=torch.uint8, generator=g)
            u[(u & 0x7F) == 0x7F] = 0x7E  # no NaN codes
            pool[(o, i)].append(u.view(torch.float8_e4m3fn))
        return pool[(o, i)][len(pool[(o, i)]) % 3 - 1]

    dest.mkdir(parents=True)
    w = ShardedWriter(dest, 4_000_000_000, {"format": "pt"}, expected_tensors=8000)
    total = fp8 = 0

    def add(name, t):
        nonlocal total
        w.add(name, t)
        total += t.numel() * t.element_size()

    def bf16(*shape):  # random finite bf16 below 2 in magnitude (bit 14 clear: the top exponent bit), fast
        return torch.randint(-(1 << 14), 1 << 14, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)

    add("model.embed_tokens.weight", bf16(vocab, HIDDEN))
    budget = size_gb * 1e9 - 2 * vocab * HIDDEN * 2
    k = 0
    while budget > 0:
        p = f"model.layers.{k}."
        add(p + "input_layernorm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))
        for name, (o, i) in layer_modules(k, experts).items():
            add(name + ".weight", codes(o, i))
            add(name + ".weight_scale_inv", torch.rand(-(-o // BLOCK), -(-i // BLOCK), generator=g) * 1e-3 + 1e-4)
            fp8 += o * i
            budget -= o * i
        add(p + "self_attn.q_a_layernorm.weight", torch.ones(1536, dtype=torch.bfloat16))
        add(p + "self_attn.kv_a_layernorm.weight", torch.ones(512, dtype=torch.bfloat16))
        add(p + "post_attention_layernorm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))
        add(p + "mlp.gate.weight", bf16(N_ROUTED, HIDDEN))
        add(p + "mlp.gate.e_score_correction_bias", torch.zeros(N_ROUTED))
        k += 1
    add("model.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))
    add("lm_head.weight", bf16(vocab, HIDDEN))
    files = w.close()
    (dest / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": k, "n_routed_experts": experts,
                                                           "vocab_size": vocab}))
    (dest / "tokenizer.json").write_text("{}")
    return {"layers": k, "experts_per_layer": experts, "vocab": vocab, "fp8_weights": fp8, "bytes": total,
            "shards": len(files)}


def timed(cmd: list[str]) -> dict:
    """Run cmd; wall seconds, CPU seconds (user + sys) and peak RSS of the process (wait4)."""
    subprocess.run(["sync"], check=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {os.waitstatus_to_exitcode(status)}")
    return {"wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "user_s": round(ru.ru_utime, 2), "sys_s": round(ru.ru_stime, 2),
            "peak_rss_gib": round(ru.ru_maxrss * 1024 / 2**30, 3), "load_1min_before": round(load, 2)}


def check(src: Path, out: Path) -> str:
    """One fp8 module of the output equals the fp8 format's own dequantization, bit for bit."""
    import torch
    from safetensors import safe_open

    from qtool.formats import dequantize, get_format
    from qtool.repack.source import open_source

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    s = open_source(src)
    m = next(x for x in s.modules if x.name == name)
    ref = dequantize(get_format(m.scheme.format).unpack(s.load(m), m.scheme), torch.bfloat16)
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / idx[name + ".weight"]), "pt") as f:
        got = f.get_tensor(name + ".weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), ref.view(torch.int16)), name
    return f"{name}: bit-identical to {m.scheme.format}'s own dequantization to bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="work directory (needs ~3.8x --size-gb free)")
    ap.add_argument("--size-gb", type=float, default=16.0)
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="rows of embed_tokens and lm_head (bf16, copied)")
    ap.add_argument("--keep", action="store_true", help="keep the input and outputs")
    ap.add_argument("--json-out", type=Path, help="merge the run into this JSON object, keyed by --name")
    ap.add_argument("--name", default=None)
    ap.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)  # the build runs in a child process
    a = ap.parse_args()
    if a.build_only:
        print(json.dumps(build(a.build_only, a.size_gb, a.experts, a.vocab)))
        return
    src, cp_dst, out, out2 = a.dir / "fp8-src", a.dir / "fp8-copy", a.dir / "fp8-dense", a.dir / "fp8-dense-copy"
    for d in (src, cp_dst, out, out2):
        shutil.rmtree(d, ignore_errors=True)
    free = shutil.disk_usage(a.dir.parent if not a.dir.exists() else a.dir).free
    need = a.size_gb * 1e9 * 3.8  # the output and its copy at once, and room to spare
    if free < need:
        raise SystemExit(f"{free / 1e9:.0f} GB free under {a.dir}; this run needs about {need / 1e9:.0f} GB")
    # the build runs in a child, so this process stays small: a child's peak RSS as wait4 reports it starts
    # from the size of the process it was forked from
    t0 = time.perf_counter()
    built = subprocess.run([sys.executable, __file__, "--dir", str(a.dir), "--size-gb", str(a.size_gb), "--experts",
                            str(a.experts), "--vocab", str(a.vocab), "--build-only", str(src)], check=True, capture_output=True, text=True)
    facts = json.loads(built.stdout.strip().splitlines()[-1])
    facts["build_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(facts), flush=True)
    try:
        copy = timed(["cp", "-r", str(src), str(cp_dst)])
        shutil.rmtree(cp_dst)
        print("copy", json.dumps(copy), flush=True)
        qtool = str(Path(sys.executable).with_name("qtool"))
        dense = timed([qtool, "repack", str(src), "--to", "dense", "-o", str(out), "--quiet"])
        print("dense", json.dumps(dense), flush=True)
        out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        verdict = check(src, out)
        if not a.keep:
            shutil.rmtree(src)  # room for the output's copy
        copy_out = timed(["cp", "-r", str(out), str(out2)])
        shutil.rmtree(out2)
        print("copy_out", json.dumps(copy_out), flush=True)
    finally:
        if not a.keep:
            for d in (src, cp_dst, out, out2):
                shutil.rmtree(d, ignore_errors=True)
    import torch

    run = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} vCPU, "
           f"{platform.system()} {platform.release()}, torch {torch.__version__} ({torch.get_num_threads()} threads)",
           "command": " ".join(["benchmarks/dense_throughput.py", f"--size-gb {a.size_gb:g}",
                                f"--experts {a.experts}", f"--vocab {a.vocab}"]),
           "checkpoint": facts, "output_bytes": out_bytes, "copy": copy, "dense": dense, "copy_out": copy_out,
           "dense_over_copy_wall": round(dense["wall_s"] / copy["wall_s"], 2),
           "dense_over_copy_cpu": round(dense["cpu_s"] / max(copy["cpu_s"], 1e-9), 2),
           "dense_over_copy_out_wall": round(dense["wall_s"] / copy_out["wall_s"], 2),
           "dense_cpu_s_per_input_gb": round(dense["cpu_s"] / (facts["bytes"] / 1e9), 2), "check": verdict}
    print(json.dumps(run, indent=1))
    if a.json_out:
        data = json.loads(a.json_out.read_text()) if a.json_out.exists() else {}
        data[a.name or f"dense-{a.size_gb:g}gb"] = run
        a.json_out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
