"""`qtool repack --to marlin` throughput against a plain file copy, and its peak memory (issue 6, item 4:
<= 1.5x copy time, <= 1 GiB RSS).

Builds a synthetic GPTQ 4-bit g128 symmetric checkpoint with Llama-3-8B linear shapes (32 layers x
q/k/v/o/gate/up/down, random codes, fp16 scales, v1 qzeros 0x77777777, trivial g_idx, RMSNorm weights;
no embeddings or lm_head, so every large tensor is one that must be converted: ~3.6 GB in 4 shards),
then alternates

    copy:   `cp -r SRC DST` (what the conversion is measured against)
    repack: `qtool repack SRC --to marlin -o DST --force --quiet` in a subprocess (peak RSS from wait4)

and reports medians. Without the repack command (or with --emulate), the repack step runs this
script's own streaming loop instead (`emulate`: per-module maps, marlin.from_gptq into reused buffers,
a writer thread feeding qtool.io.writer.ShardedWriter).

    .venv/bin/python benchmarks/repack_throughput.py [--dir /tmp/qtool-bench] [--layers 32] [--repeat 3]
                                                     [--emulate] [--torch-only] [--write benchmarks/results/repack.md]

`sync` runs before every timed step so that one step's dirty pages are not written back during the next.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HIDDEN, INTER, KV, LAYERS = 4096, 14336, 1024, 32
MODULES = {  # name: (out_features N, in_features K)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
BITS, GROUP = 4, 128


# --- synthetic checkpoint -----------------------------------------------------------------------------------
def build(dest: Path, layers: int) -> Path:
    import torch
    from safetensors.torch import save_file

    stamp = dest / "BUILT"
    if stamp.exists() and stamp.read_text() == f"{layers}\n":
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    per_shard = 8
    n_shards = -(-layers // per_shard)
    weight_map = {}
    total = 0
    for s in range(n_shards):
        tensors = {}
        for layer in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            pre = f"model.layers.{layer}."
            for mod, (n, k) in MODULES.items():
                tensors[f"{pre}{mod}.qweight"] = torch.randint(-2**31, 2**31 - 1, (k * BITS // 32, n),
                                                               dtype=torch.int32, generator=gen)
                tensors[f"{pre}{mod}.qzeros"] = torch.full((k // GROUP, n * BITS // 32), 0x77777777,
                                                           dtype=torch.int32)
                tensors[f"{pre}{mod}.scales"] = (torch.rand(k // GROUP, n, generator=gen) / 100).half()
                tensors[f"{pre}{mod}.g_idx"] = (torch.arange(k, dtype=torch.int32) // GROUP)
            tensors[f"{pre}input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
            tensors[f"{pre}post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(dest / name), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
        del tensors
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    qc = {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "pack_dtype": "int32"}
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "torch_dtype": "float16", "quantization_config": qc}, indent=2))
    (dest / "quantize_config.json").write_text(json.dumps(qc, indent=2))
    stamp.write_text(f"{layers}\n")
    return dest


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


# --- emulated repack (the streaming loop `qtool repack` runs), used until the CLI exists ----------------
def emulate(src: Path, out: Path, max_shard: str = "4GB") -> None:
    """GPTQ -> Marlin, tensor by tensor, the way a streaming repack can run it.

    - input: each module's tensors are mapped (MAP_POPULATE: the kernel maps the page-cache pages in one
      call instead of one fault per 4 KiB) and unmapped after use, so no private copy is made and RSS stays
      bounded by one module;
    - conversion: marlin.from_gptq (byte-identical to the composition) into one of three reused output
      buffers (fresh memory would fault on first touch);
    - output: a writer thread drains a short queue into ShardedWriter while the next module converts
      (file writes and the ctypes call both release the GIL) and hands each buffer back when written.
    """
    import torch

    from qtool.formats import marlin as M
    from qtool.io.safetensors_header import read_header
    from qtool.io.writer import ShardedWriter, atomic_output, parse_size
    from qtool.scheme import QuantScheme

    index = json.loads((src / "model.safetensors.index.json").read_text())
    infos = {}
    for f in sorted(set(index["weight_map"].values())):
        infos.update(read_header(src / f)[0])
    # Read-only maps become tensors that nothing here writes to.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    dtypes = {"I32": torch.int32, "F16": torch.float16}
    params = QuantScheme(bits=BITS, group_size=GROUP)
    fds: dict = {}
    page = mmap.ALLOCATIONGRANULARITY
    populate = getattr(mmap, "MAP_POPULATE", 0)

    def read(info):
        fd = fds.get(info.file) or fds.setdefault(info.file, os.open(info.file, os.O_RDONLY))
        base = info.start - info.start % page
        m = mmap.mmap(fd, info.end - base, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ, offset=base)
        t = torch.frombuffer(memoryview(m)[info.start - base:], dtype=dtypes[info.dtype]).view(info.shape)
        return t, m

    modules: dict[str, dict] = {}
    for name, info in infos.items():
        pre, _, short = name.rpartition(".")
        modules.setdefault(pre, {})[short] = info
    biggest = max(i.numel for i in infos.values() if i.name.endswith(".qweight"))
    free: queue.Queue = queue.Queue()
    for _ in range(3):
        free.put(torch.empty(biggest, dtype=torch.int32))
    jobs: queue.Queue = queue.Queue(maxsize=4)
    failure: list = []

    def writer_loop(w):
        try:
            while (item := jobs.get()) is not None:
                kind, name, obj, release = item
                w.add_raw(name, obj) if kind == "raw" else w.add(name, obj)
                if release is not None:
                    free.put(release)
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            failure.append(e)
            while (item := jobs.get()) is not None:
                if item[3] is not None:
                    free.put(item[3])

    # The contract goes into every shard's header, so it is settled from the headers before writing.
    metas = {}
    for pre, parts in modules.items():
        if "qweight" in parts:
            n, k = parts["scales"].shape[1], parts["qweight"].shape[0] * 32 // BITS
            metas[pre] = {M.SOURCE_KEY: "gptq", "bits": BITS, "group_size": GROUP, "act_order": False,
                          "zero_points": False, "shape": [n, k], "padded_shape": list(M.padded_nk(n, k, GROUP))}
    summary = M.summarize(metas)
    with atomic_output(out, force=True) as tmp:
        w = ShardedWriter(tmp, parse_size(max_shard), M.contract(summary))
        thread = threading.Thread(target=writer_loop, args=(w,))
        thread.start()
        try:
            for pre, parts in modules.items():
                if failure:
                    break
                if "qweight" not in parts:
                    for short, info in parts.items():
                        jobs.put(("raw", f"{pre}.{short}", info, None))
                    continue
                tensors, maps = {}, []
                for short, info in parts.items():
                    tensors[short], m = read(info)
                    maps.append(m)
                buf = free.get()
                packed = M.from_gptq(tensors, params, "gptq", out=buf)  # nothing returned points into maps
                del tensors
                for m in maps:
                    m.close()
                for short, t in packed.items():
                    jobs.put(("tensor", f"{pre}.{short}", t, buf if short == "qweight" else None))
        finally:
            jobs.put(None)
            thread.join()
        if failure:
            raise failure[0]
        w.close()
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = M.quantization_config(summary)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for fd in fds.values():
        os.close(fd)


# --- timing -------------------------------------------------------------------------------------------------
def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds (user + sys) of one child, from wait4 (this child
    only). CPU time is what a busy shared machine distorts least."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
    return dt, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # Linux reports ru_maxrss in KiB


def repack_cli_exists() -> bool:
    return (REPO / "qtool" / "cli" / "repack.py").is_file()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/qtool-bench"))
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--emulate", action="store_true", help="time the built-in streaming loop, not the CLI")
    ap.add_argument("--torch-only", action="store_true", help="QTOOL_MARLIN_EXT=0: no C++ extension")
    ap.add_argument("--write", type=Path, help="write the Markdown result to this file")
    ap.add_argument("--max-shard-size", default=None, help="passed to the repack (default: its own, 4GB)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--_emulate", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._emulate:
        emulate(*a._emulate, a.max_shard_size or "4GB")
        return 0

    import torch

    src = build(a.dir / f"llama3-8b-gptq4-g128-L{a.layers}", a.layers)
    size = dir_bytes(src)
    copy_dst, out = a.dir / "copy", a.dir / "marlin"
    env = dict(os.environ, QTOOL_MARLIN_EXT="0" if a.torch_only else os.environ.get("QTOOL_MARLIN_EXT", ""))
    use_cli = repack_cli_exists() and not a.emulate
    if use_cli:
        repack_cmd = [sys.executable, "-m", "qtool", "repack", str(src), "--to", "marlin", "-o", str(out),
                      "--force", "--quiet"]
    else:
        repack_cmd = [sys.executable, str(Path(__file__).resolve()), "--_emulate", str(src), str(out)]
    if a.max_shard_size:
        repack_cmd += ["--max-shard-size", a.max_shard_size]
    if not a.torch_only:  # build the extension once, outside the timed runs
        from qtool.packing import marlin_perm as mp

        mp.use_extension("on")
    copies, repacks, rss, loads, cpu_c, cpu_r = [], [], [], [], [], []
    for _ in range(a.repeat):
        loads.append(os.getloadavg()[0])
        shutil.rmtree(copy_dst, ignore_errors=True)
        os.sync()
        dt, _, cpu = run_measured(["cp", "-r", str(src), str(copy_dst)])
        copies.append(dt)
        cpu_c.append(cpu)
        shutil.rmtree(copy_dst, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        dt, peak, cpu = run_measured(repack_cmd, env)
        repacks.append(dt)
        rss.append(peak)
        cpu_r.append(cpu)
    out_size = dir_bytes(out)
    n_out = len(list(out.glob("*.safetensors")))
    verified = verify_sample(src, out)
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    c, r = statistics.median(copies), statistics.median(repacks)
    gib = 1 << 30
    path = "C++ extension (csrc/marlin_repack.cpp)" if not a.torch_only else "pure torch (QTOOL_MARLIN_EXT=0)"
    lines = [
        "# Repack throughput: GPTQ 4-bit g128 -> Marlin",
        "",
        f"- command: `.venv/bin/python benchmarks/repack_throughput.py --layers {a.layers} --repeat {a.repeat}"
        f"{' --emulate' if a.emulate else ''}{' --torch-only' if a.torch_only else ''}"
        f"{f' --max-shard-size {a.max_shard_size}' if a.max_shard_size else ''}`",
        f"- date: {date.today().isoformat()}; machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.platform()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        f"- checkpoint: Llama-3-8B linear shapes x {a.layers} layers, {size / 1e9:.2f} GB in "
        f"{len(list(src.glob('*.safetensors')))} shards (no embeddings / lm_head); output {out_size / 1e9:.2f} GB "
        f"in {n_out} file(s)",
        f"- repack step: {'`qtool repack --to marlin` (CLI)' if use_cli else 'emulated streaming loop in this script (`emulate`: per-module mmap, marlin.from_gptq into reused buffers, writer thread + ShardedWriter)'}",
        f"- word conversion: {path}",
        f"- check: {verified}",
        f"- 1-minute load average before each run: {', '.join(f'{x:.1f}' for x in loads)} "
        f"(other work on the machine inflates both columns)",
        "",
        "| step | wall runs (s) | median wall (s) | GB/s | median CPU (user+sys, s) |",
        "|---|---|---|---|---|",
        f"| copy (`cp -r`) | {', '.join(f'{x:.2f}' for x in copies)} | {c:.2f} | {size / c / 1e9:.2f} | "
        f"{statistics.median(cpu_c):.2f} |",
        f"| repack --to marlin | {', '.join(f'{x:.2f}' for x in repacks)} | {r:.2f} | {size / r / 1e9:.2f} | "
        f"{statistics.median(cpu_r):.2f} |",
        "",
        f"**repack / copy = {r / c:.2f}x wall** (target <= 1.5x), {statistics.median(cpu_r) / statistics.median(cpu_c):.2f}x "
        f"CPU; **peak RSS {max(rss) / gib:.2f} GiB** (max over runs, target <= 1 GiB).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write:
        a.write.parent.mkdir(parents=True, exist_ok=True)
        a.write.write_text(text)
    return 0


def verify_sample(src: Path, out: Path) -> str:
    """Decode one converted module both ways and compare with the source Plain (exactness, not timing)."""
    import torch

    from qtool.formats import get_format
    from qtool.io.checkpoint import open_checkpoint
    from qtool.scheme import QuantScheme

    s_ck, o_ck = open_checkpoint(src), open_checkpoint(out)
    pre = "model.layers.0.mlp.down_proj"
    params = QuantScheme(bits=BITS, group_size=GROUP)
    a = get_format("gptq").unpack(s_ck.module_tensors(pre), params)
    b = get_format("marlin").unpack(o_ck.module_tensors(pre), params)
    back = get_format("gptq").pack(b)
    same = all(torch.equal(back[k], s_ck.get(f"{pre}.{k}")) for k in back)
    return (f"{pre}: Marlin unpack equals the GPTQ Plain: {a.equal(b)}; converted back to gptq bytes "
            f"identical: {same}; metadata qtool.format = {o_ck.metadata.get('qtool.format')}")


if __name__ == "__main__":
    raise SystemExit(main())
