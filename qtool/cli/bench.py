"""`qtool bench`: time the W4A16 and FP8 kernels against dense and the roofline, across batch sizes."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import (
    ConfigOpt,
    QuietOpt,
    apply_config,
    check_choice,
    check_range,
    emit_json,
    json_text,
    progress,
    stderr_console,
    stdout_console,
)
from qtool.report.text import sanitize
from qtool.spec import INT32_MAX

# Code widths the kernels' packed layers read (GPTQ words hold a whole number of codes).
BITS = (2, 3, 4, 5, 6, 7, 8)
# Random layer formats (bench/run.py FORMATS) and the FP8 weight-scale strategies.
FORMATS = ("gptq", "fp8")
STRATEGIES = ("tensor", "channel", "block")
DEVICE = re.compile(r"cpu|cuda(:\d{1,4})?")
MAX_SECONDS = 3600.0

EPILOG = """Examples:

  qtool bench --device cpu

  qtool bench --device cuda:0 --shapes llama-3-70b --batch-sizes 1 16 256 --graphs --json bench.json --plot bench.png

  qtool bench --shapes 4096x14336,14336x4096 --kernels triton-w4a16 --dtype bf16 --json -

  qtool bench --device cuda:0 --shapes llama-3-70b@tp2 --graphs --anchor benchmarks/anchors/marlin-orig-h200.csv

  qtool bench --device cuda:0 --shapes llama-3-8b+fused,llama-3-70b@tp4+fused --dtype bf16 --graphs

  qtool bench --device cuda:0 --bits 8 --format fp8 --dtype bf16 --shapes llama-3-70b --batch-sizes 1 16 64 256 1024 --graphs

  qtool bench --device cuda:0 --bits 8 --format fp8 --strategy block --dtype bf16 --shapes llama-3-70b --graphs
"""


@app.command("bench", help="Check each kernel against a float64 oracle, then time it per shape and batch size: "
                           "TFLOP/s, GB/s, fraction of the measured copy bandwidth, speedup over dense, and the "
                           "theoretical and measured crossover M*.", epilog=EPILOG)
def bench_cmd(
    ctx: typer.Context,
    batch_sizes: Annotated[list[int] | None, typer.Option(
        "--batch-sizes", help="Batch sizes M (several after one flag: --batch-sizes 1 16 256).",
        show_default="1 2 3 4 6 8 12 16 24 32 48 64 96 128 192 256 on a GPU, 1 16 256 on the CPU")] = None,
    shapes: Annotated[str | None, typer.Option(
        "--shapes", help="Models of configs/models.yaml (llama-3-70b, qwen2.5-32b, ...), MODEL@tpN (one GPU's "
                         "shard under N-way tensor parallelism), MODEL+fused (q/k/v and gate/up as the one GEMM "
                         "each a serving engine launches) or KxN, comma-separated (default: llama-3-8b on a GPU, "
                         "two small layers on the CPU).", show_default=False)] = None,
    kernels: Annotated[list[str] | None, typer.Option(
        "--kernels", help="Kernel ids, repeatable or comma-separated (default: all that run here).",
        show_default=False)] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda[:N] (default: cuda if present).",
                                               show_default=False)] = None,
    bits: Annotated[int, typer.Option("--bits", help="Bits per weight of the random test layers.")] = 4,
    format_: Annotated[str, typer.Option(
        "--format", help="Random test layers: gptq (integer codes in GPTQ v2 words) or fp8 (E4M3 codes, fp32 "
                         "absmax scales; needs --bits 8).")] = "gptq",
    strategy: Annotated[str, typer.Option(
        "--strategy", help="FP8 weight scales: tensor, channel or block (128x128).")] = "tensor",
    group_size: Annotated[int, typer.Option("--group-size", help="Group size along K; -1 = one group.")] = 128,
    dtype: Annotated[str, typer.Option("--dtype", help="Activation and scale dtype: fp16 or bf16.")] = "fp16",
    act_order: Annotated[bool, typer.Option("--act-order", help="Random act-order g_idx in the test layers.")]
    = False,
    graphs: Annotated[bool, typer.Option("--graphs", help="Time CUDA-graph replays (no Python launch cost).")]
    = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG: speedup vs M per kernel with the "
                                              "roofline.", metavar="FILE.png", show_default=False)] = None,
    markdown: Annotated[Path | None, typer.Option("--markdown", help="Write the tables as Markdown ('-' = stdout).",
                                                  metavar="FILE.md", show_default=False)] = None,
    seconds: Annotated[float, typer.Option("--seconds", help="Time budget per timed point.")] = 1.0,
    anchor: Annotated[Path | None, typer.Option(
        "--anchor", help="A reference kernel's figures (CSV: K,N,M,fp16_us,<kernel>_us, as benchmarks/anchors/"
                         "marlin-orig-h200.csv): print each kernel's speedup as a ratio to the reference's and "
                         "flag every M below it.", metavar="FILE.csv", show_default=False)] = None,
    config: ConfigOpt = None,
    json_: Annotated[str | None, typer.Option("--json", help="Write the JSON report to FILE ('-' = stdout).",
                                              metavar="FILE", show_default=False)] = None,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, bench_cmd)
    from qtool.errors import UsageError

    # Every number and path from a flag is checked here, before anything is built or timed; run_bench then
    # checks the memory the sweep needs against the device's.
    if v["device"] is not None and not DEVICE.fullmatch(v["device"].strip().lower()):
        raise UsageError(f"--device {v['device']!r} is not a device bench runs on", fix="use cpu, cuda or cuda:N")
    check_choice("--bits", v["bits"], BITS)
    check_choice("--format", v["format_"], FORMATS)
    check_choice("--strategy", v["strategy"], STRATEGIES)
    if v["format_"] == "fp8" and v["bits"] != 8:
        raise UsageError(f"--format fp8 holds 8-bit codes, not --bits {v['bits']}", fix="use --bits 8 --format fp8")
    check_range("--group-size", v["group_size"], 1, INT32_MAX, also=(-1,))
    if v["dtype"] not in ("fp16", "bf16"):
        raise UsageError(f"--dtype {v['dtype']!r} is not fp16 or bf16", fix="use --dtype fp16 or --dtype bf16")
    for m in v["batch_sizes"] or []:
        check_range("--batch-sizes", m, 1, INT32_MAX)
    seen: set[int] = set()
    for m in v["batch_sizes"] or []:  # as a shape or kernel named twice: likely a typo for another M
        if m in seen:
            raise UsageError(f"--batch-sizes names {m} twice", fix="name each batch size once")
        seen.add(m)
    check_range("--seconds", v["seconds"], 1e-3, MAX_SECONDS)
    if v["plot"] is not None and str(v["plot"]) == "-":
        raise UsageError("--plot - : a plot is an image, not text for standard output", fix="name a file, e.g. "
                         "--plot bench.png")
    if v["json_"] == "":  # else no report is written, and nothing says so
        raise UsageError("--json '' names no file", fix="name a file, or '-' for standard output")
    to_stdout = [flag for flag, key in (("--json", "json_"), ("--markdown", "markdown")) if str(v[key]) == "-"]
    if len(to_stdout) > 1:
        raise UsageError("--json - and --markdown - both ask for standard output", fix="write one to a file")
    reports = [(flag, Path(v[key])) for flag, key in (("--json", "json_"), ("--markdown", "markdown"),
                                                      ("--plot", "plot")) if v[key] and str(v[key]) != "-"]
    from qtool.bench.report import check_distinct_reports, check_report_path

    for flag, path in reports:
        check_report_path(flag, path)
    check_distinct_reports(reports)

    from qtool.bench.anchor import load_anchor

    anchor_table = load_anchor(Path(v["anchor"])) if v["anchor"] else None

    from qtool.bench.report import plot as write_plot
    from qtool.bench.report import plot_format, render_tables, to_markdown, write_report
    from qtool.bench.run import BenchSettings, run_bench
    from qtool.bench.shapes import CPU_BATCH_SIZES, GPU_BATCH_SIZES, parse_shapes
    from qtool.kernels.base import all_kernels
    from qtool.kernels.devices import torch_device

    dev = torch_device(v["device"].strip().lower() if v["device"] else None)
    ms = list(v["batch_sizes"] or (GPU_BATCH_SIZES if dev.type == "cuda" else CPU_BATCH_SIZES))
    names = [n.strip() for item in (v["kernels"] or []) for n in item.split(",") if n.strip()]
    known = all_kernels()
    if v["kernels"] and not names:  # else every kernel runs, as if --kernels were not given
        raise UsageError(f"--kernels {','.join(v['kernels'])!r} names no kernel",
                         fix=f"choose from: {', '.join(sorted(known))}, or leave --kernels out for all")
    for n in names:
        if n not in known:
            raise UsageError(f"--kernels: unknown kernel '{n}'", fix=f"choose from: {', '.join(sorted(known))}")
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"--kernels names '{twice}' twice", fix="name each kernel once")
    settings = BenchSettings(device=dev, shapes=parse_shapes(v["shapes"], dev.type), batch_sizes=sorted(set(ms)),
                             kernels=names or None, bits=v["bits"], group_size=v["group_size"], dtype=v["dtype"],
                             graphs=v["graphs"], act_order=v["act_order"], max_seconds=v["seconds"],
                             anchor=anchor_table, format=v["format_"], strategy=v["strategy"])
    with progress(v["quiet"] or bool(to_stdout)) as bar:
        task = bar.add_task("bench", total=len(settings.shapes) * len(settings.batch_sizes))

        def step(desc: str) -> None:
            bar.update(task, advance=1, description=f"bench {sanitize(desc)}")

        report = run_bench(settings, step)
    if v["json_"] and "--json" not in to_stdout:
        text = json_text(report.to_dict())
        write_report("--json", Path(v["json_"]), lambda p: p.write_text(text, encoding="utf-8"), replace=False)
    if v["markdown"] and "--markdown" not in to_stdout:
        md = to_markdown(report)
        write_report("--markdown", Path(v["markdown"]), lambda p: p.write_text(md, encoding="utf-8"), replace=False)
    if v["plot"]:
        fmt = plot_format(Path(v["plot"]))
        write_report("--plot", Path(v["plot"]), lambda p: write_plot(report, p, fmt), replace=False)
    if "--json" in to_stdout:
        emit_json(report.to_dict())
    elif "--markdown" in to_stdout:
        sys.stdout.write(to_markdown(report))
        sys.stdout.flush()
    elif not v["quiet"]:
        render_tables(report, stdout_console())
    if report.failed:
        stderr_console().print("[red]some kernels failed the oracle check (see the table)[/]")
        return 1
    return 0
