"""GPTQ time and peak GPU memory on a Llama-3-8B-shaped decoder (random weights), through qtool's calibration
driver (`qtool.quant.calib.calibrate`, what `qtool pack --method gptq` runs).

    python benchmarks/calib_h200.py --out results.json [--samples 128 --seqlen 256] [--act-order]

The model is LlamaConfig with Llama-3-8B's shapes (hidden 4096, MLP 14336, 32 blocks, 32 heads, 8 KV heads,
vocabulary 128256), built on the meta device and filled with N(0, 0.02) weights in bf16 (no download, no
slow CPU initialisation). It stays on the CPU; calibrate moves one block at a time to the GPU. Calibration
tokens are uniform random ids (seed 0): time and memory do not depend on the text. Reports wall time of the
whole calibration, the time per block, torch's peak allocated GPU memory and one block's bytes, so the goals
(<= 5 minutes, peak <= one block + 4 GB) can be checked.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time


def build(dtype, device: str, tiny: bool = False):
    import torch
    import transformers

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    if tiny:  # a smoke test of this script on the CPU
        shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
    cfg = transformers.LlamaConfig(**shape,
                                   max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaModel(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:  # drawn on the GPU: seconds instead of minutes on the CPU
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype))
    # non-persistent buffers (RoPE frequencies) are garbage after to_empty: rebuild that module on the CPU
    model.rotary_emb = type(model.rotary_emb)(config=cfg)
    model.eval()
    return model, cfg


def main() -> None:
    import torch

    from qtool.quant.calib import CalibSettings, calibrate, find_blocks

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2 small blocks: a smoke test of the script")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    t0 = time.time()
    model, cfg = build(torch.bfloat16 if cuda else torch.float32, a.device, a.tiny)
    build_s = time.time() - t0
    name, blocks = find_blocks(model)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    targets = {f"{name}.{b}.{n}": (a.bits, a.group_size) for b in range(len(blocks))
               for n, m in blocks[b].named_modules() if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, cfg.vocab_size, (1, a.seqlen), generator=g) for _ in range(a.samples)]
    s = CalibSettings("gptq", sym=True, act_order=a.act_order, device=a.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak_now = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    marks: list[float] = []

    def on_block(b, n):
        sync()
        marks.append(time.time())
        print(f"block {b}/{n} at {marks[-1] - marks[0]:.1f} s, peak {peak_now() / 2**30:.2f} GiB", flush=True)
        if b < n:  # a partial record, so a run stopped by a time limit still says what it measured
            with open(a.out, "w") as f:
                json.dump({**head, "complete": False, "blocks_done": b, "elapsed_s": round(marks[-1] - marks[0], 1),
                           "peak_gpu_gib_so_far": round((peak_now() - base) / 2**30, 3)}, f, indent=1)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    block_bytes_ = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    head = {"samples": a.samples, "seqlen": a.seqlen, "act_order": a.act_order, "block_gib": round(block_bytes_ / 2**30, 3),
            "build_s": round(build_s, 1)}
    t = time.time()
    res = calibrate(model, samples, targets, s, on_block)
    sync()
    wall = time.time() - t
    peak = peak_now() - base
    losses = [lr.loss for lr in res.layers.values()]
    per_block = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if cuda else "none (cpu)"
    out = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
           "model": "tiny Llama (smoke test)" if a.tiny else "Llama-3-8B shapes, random N(0, 0.02) bf16 weights", "blocks": len(blocks),
           "linears": len(res.layers), "samples": a.samples, "seqlen": a.seqlen, "bits": a.bits,
           "group_size": a.group_size, "act_order": a.act_order, "build_s": round(build_s, 1),
           "calibrate_wall_s": round(wall, 1), "per_block_s": [round(x, 2) for x in per_block],
           "peak_gpu_bytes": peak, "peak_gpu_gib": round(peak / 2**30, 3), "block_bytes": block_bytes,
           "block_gib": round(block_bytes / 2**30, 3),
           "peak_minus_block_gib": round((peak - block_bytes) / 2**30, 3),
           "loss_mean": sum(losses) / len(losses), "loss_max": max(losses), "complete": True,
           "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else 0}
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
