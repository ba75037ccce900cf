"""`qtool pack`: quantize a dense safetensors model into a packed layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import (
    ConfigOpt,
    DryRunOpt,
    ExcludeOpt,
    ForceOpt,
    IncludeOpt,
    JsonOpt,
    MaxShardOpt,
    QuietOpt,
    apply_config,
    emit_json,
    progress,
    stderr_console,
    stdout_console,
    warn_unshown,
)
from qtool.formats.base import format_names
from qtool.pack import PACK_FORMATS
from qtool.report.text import sanitize

EPILOG = """Examples:

  qtool pack model/ -o model-gptq --to gptq --bits 4 --group-size 128

  qtool pack model.safetensors -o out --to gptq_p --bits 3 --asym --method mse

  qtool pack model/ -o out --to gptq --tensor-type 'mlp\\.down_proj=8:64' --exclude 'layers\\.0\\.'

  qtool pack model/ -o out --config configs/jobs/pack-gptq-4bit.yaml

  qtool pack model/ -o out --method gptq --act-order --calib text.txt --eval

  qtool pack model/ -o model-fp8 --to fp8 --block 128x128

  qtool pack model/ -o model-w8a8 --to ct_int8 --method mse

  qtool pack model/ -o model-nvfp4 --to nvfp4
"""


@app.command("pack", help="Quantize the linear weights of a dense safetensors model into a packed layout "
                          f"({format_names(PACK_FORMATS, aliases=False)}).", epilog=EPILOG)
def pack_cmd(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Dense .safetensors file, HF directory or index.json.",
                                        show_default=False)],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output directory.", show_default=False)] = None,
    to: Annotated[str, typer.Option("--to", help=f"Target layout: {format_names(PACK_FORMATS, aliases=False)}.")] = "gptq",
    bits: Annotated[int | None, typer.Option("--bits", help="Bits per weight, 2..8 (default 4; fp8, ct_fp8, mxfp8 and "
                                                           "ct_int8 are 8-bit).", show_default=False)] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="Group size along in_features; -1 = per "
                                                                      "channel (default 128).", show_default=False)]
    = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", help="fp8/ct_fp8/ct_int8 scales: tensor, channel, group (with --group-size) or block. Default: "
                           "block for fp8, channel for ct_fp8 and ct_int8.", show_default=False)] = None,
    block: Annotated[str | None, typer.Option("--block", help="--strategy block: ROWSxCOLS per scale (default "
                                                              "128x128).", show_default=False)] = None,
    sym: Annotated[bool | None, typer.Option(
        "--sym/--asym", help="Symmetric (zero 2^(b-1)) or asymmetric zeros. Default: symmetric for the GPTQ "
                             "layouts, asymmetric for awq (AWQ's zero-point convention).", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help="rtn (min-max), mse (clip search), or the calibrated gptq "
                                                         "and awq (run the model; need qtool[calib]).")] = "rtn",
    calib: Annotated[Path | None, typer.Option(
        "--calib", help="gptq/awq calibration text (UTF-8, or .jsonl with a \"text\" per line). Default: Python "
                        "standard-library docstrings (offline).", show_default=False)] = None,
    calib_samples: Annotated[int, typer.Option("--calib-samples", help="Calibration windows (at random offsets, --calib-seed).")]
    = 128,
    calib_seqlen: Annotated[int, typer.Option("--calib-seqlen", help="Tokens per calibration window.")] = 256,
    calib_seed: Annotated[int, typer.Option("--calib-seed", help="Seed of the calibration windows' offsets.")] = 0,
    act_order: Annotated[bool, typer.Option("--act-order", help="gptq: columns by decreasing activation energy "
                                                               "(desc_act, writes g_idx).")] = False,
    static_groups: Annotated[bool, typer.Option("--static-groups", help="gptq --act-order with groups fixed "
                                                                       "beforehand (no g_idx needed).")] = False,
    true_sequential: Annotated[bool, typer.Option("--true-sequential", help="gptq: quantize a block's linears "
                                                                           "in order, each seeing the ones before "
                                                                           "quantized.")] = False,
    damp: Annotated[float | None, typer.Option("--damp", help="gptq: dampening, the fraction of the mean Hessian "
                                                              "diagonal added to it (default 0.1).",
                                               show_default=False)] = None,
    mse: Annotated[bool | None, typer.Option(
        "--mse/--no-mse", help="gptq: each group's scale from a clip search (least squared error, as --method mse) "
                               "on the weights as GPTQ has updated them, instead of their min-max range "
                               "(GPTQModel's mse, llm-compressor's mse observer). Default: on.",
        show_default=False)] = None,
    calib_dtype: Annotated[str | None, typer.Option(
        "--calib-dtype", help="gptq: dtype of the calibration forward, bf16, fp16 or fp32 (default: fp32 on the CPU, "
                              "the model's on CUDA). bf16 runs about 4x faster on CPUs with AMX/AVX512-BF16; the "
                              "weights are quantized from their stored values either way.", show_default=False)]
    = None,
    device: Annotated[str | None, typer.Option("--device", help="gptq/awq/--eval device (default: cuda when "
                                                                "present, else cpu).", show_default=False)] = None,
    eval_: Annotated[bool, typer.Option("--eval", help="After packing, compare with the source (qtool eval) and "
                                                       "add the numbers to report.md.")] = False,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    tensor_type: Annotated[list[str] | None, typer.Option(
        "--tensor-type", help="REGEX=BITS[:GROUP] per-module override.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Scale dtype: fp16 or bf16.")] = "fp16",
    max_shard_size: MaxShardOpt = "4GB",
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, pack_cmd)
    from qtool.errors import UsageError
    from qtool.pack import PackJob, run_pack
    from qtool.report.pack import render

    if v["out"] is None and not v["dry_run"]:
        raise UsageError("missing -o/--out", fix="name the output directory, e.g. -o model-gptq")
    from qtool.pack import SCALED_BITS, SCALED_PACK

    scaled = v["to"] in SCALED_PACK
    bits = v["bits"] if v["bits"] is not None else SCALED_BITS.get(v["to"], 8) if scaled else 4
    group = v["group_size"] if v["group_size"] is not None or scaled else 128
    job = PackJob(src=v["src"], out=v["out"] or Path("-"), to=v["to"], bits=bits, group_size=group,
                  strategy=v["strategy"], block=v["block"],
                  sym=v["sym"], method=v["method"], include=tuple(v["include"] or ()),
                  exclude=tuple(v["exclude"] or ()), tensor_types=tuple(v["tensor_type"] or ()), dtype=v["dtype"],
                  max_shard_size=v["max_shard_size"], force=v["force"], dry_run=v["dry_run"], calib=v["calib"],
                  calib_samples=v["calib_samples"], calib_seqlen=v["calib_seqlen"], calib_seed=v["calib_seed"],
                  mse=v["mse"], act_order=v["act_order"],
                  static_groups=v["static_groups"], true_sequential=v["true_sequential"], damp=v["damp"], calib_dtype=v["calib_dtype"],
                  device=v["device"],
                  eval=v["eval_"])
    human = stderr_console() if v["json_"] else stdout_console()
    with progress(v["quiet"] or v["json_"]) as bar:
        task = bar.add_task("packing", total=None)

        def tick(name: str, k: int, n: int) -> None:
            bar.update(task, completed=k, total=n, description=f"packing {sanitize(name[-40:])}")

        report = run_pack(job, tick)
    warn_unshown(v, report.warnings)
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        render(report, human)
    return 0
