"""`qtool repack`: convert a quantized checkpoint to another layout, exactly where the layouts allow."""

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
from qtool.report.text import sanitize

EPILOG = """Examples:

  qtool repack model-gptq/ --to marlin --dry-run

  qtool repack model-gptq/ --to ct -o model-ct

  qtool repack model-marlin/ --to gptq -o model-gptq-again

  qtool repack model-gptq-g32/ --to q4_0 -o model.gguf

  qtool repack model.gguf --to gptq_v2 --allow-lossy --group-size 128

  qtool repack model-q4_1.gguf --to q4_0 --tensor-type 'token_embd=Q8_0' -o model-q4_0.gguf

  qtool repack model-gptq/ --to dense --dtype bf16 -o model-bf16
"""

TARGETS = format_names() + ", dense (every module dequantized; --dtype)"


@app.command("repack", help="Convert a quantized checkpoint to another layout. Every module is planned first "
                            "(exact / near-exact / lossy / impossible); lossy or impossible modules stop the run "
                            "unless --allow-lossy, and nothing is written.", epilog=EPILOG)
def repack_cmd(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Quantized .safetensors file, HF directory, index.json or .gguf.",
                                        show_default=False)],
    to: Annotated[str, typer.Option("--to", help=f"Target layout: {TARGETS}.", show_default=False)] = "",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output directory (or .gguf file); default "
                                             "<src>-<format> beside the source.", show_default=False)] = None,
    allow_lossy: Annotated[bool, typer.Option("--allow-lossy", help="Requantize modules the target cannot hold "
                                              "exactly (their error is reported).")] = False,
    bits: Annotated[int | None, typer.Option("--bits", help="Target bits (wider is exact; narrower requantizes).",
                                             show_default=False)] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="Target group size (a divisor of the "
                                                   "source's is exact; others requantize).",
                                                   show_default=False)] = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    keep: Annotated[list[str] | None, typer.Option(
        "--keep", help="Regex of tensor names to carry unchanged beside a converted module although its layout "
                       "does not read them (e.g. '\\.rot$'; repeatable).")] = None,
    drop: Annotated[list[str] | None, typer.Option(
        "--drop", help="Regex of tensor names to discard from converted modules whose layout does not read them "
                       "(repeatable; the plan lists each one).")] = None,
    tensor_type: Annotated[list[str] | None, typer.Option(
        "--tensor-type", help="GGUF targets: REGEX=TYPE stores the tensors whose source or GGUF name matches as "
                              "that GGML type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), as llama-quantize's "
                              "flag does; exact only where the values survive (else --allow-lossy). Without it "
                              "a GGUF source's tensors of other types keep their own.")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="--to dense: the dtype of the dequantized weights, bf16, fp16 or fp32 (lossless); float "
                        "tensors outside the modules are cast to it too. Default: the config's torch_dtype (else "
                        "bf16), other tensors copied as they are.", show_default=False)] = None,
    max_shard_size: MaxShardOpt = "4GB",
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, repack_cmd)
    from qtool.errors import UsageError
    from qtool.repack.plan import RepackJob
    from qtool.repack.report import render
    from qtool.repack.run import Refused, run_repack

    if not v["to"]:
        raise UsageError("missing --to", fix=f"choose a target layout: {TARGETS}")
    if v["to"].strip().lower() == "dense":
        return _dense(v)
    if v["dtype"] is not None:
        raise UsageError("--dtype applies to --to dense only", fix="drop --dtype")
    job = RepackJob(src=v["src"], to=v["to"], out=v["out"], allow_lossy=v["allow_lossy"], bits=v["bits"],
                    group_size=v["group_size"], include=tuple(v["include"] or ()), exclude=tuple(v["exclude"] or ()),
                    keep=tuple(v["keep"] or ()), drop=tuple(v["drop"] or ()), tensor_type=tuple(v["tensor_type"] or ()),
                    dry_run=v["dry_run"], force=v["force"], max_shard_size=v["max_shard_size"])
    human = stderr_console() if v["json_"] else stdout_console()
    try:
        with progress(v["quiet"] or v["json_"]) as bar:
            task = bar.add_task("repacking", total=None)

            def tick(name: str, k: int, n: int) -> None:
                bar.update(task, completed=k, total=n, description=f"repacking {sanitize(name[-40:])}")

            report = run_repack(job, tick)
    except Refused as e:
        from qtool.repack.run import RepackReport

        refused = RepackReport(e.plan)
        if v["json_"]:
            emit_json(refused.to_dict() | {"refused": True})
        elif not v["quiet"]:
            render(refused, stderr_console(), refused=True)
        raise
    warn_unshown(v, report.plan.warnings)
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        render(report, human)
    return 0


def _dense(v: dict) -> int:
    """`--to dense`: every module dequantized (qtool.repack.dense)."""
    from qtool.errors import UsageError
    from qtool.repack.dense import DenseJob, run_dense
    from qtool.repack.dense_report import render

    for flag, key in (("--allow-lossy", "allow_lossy"), ("--bits", "bits"), ("--group-size", "group_size"),
                      ("--include", "include"), ("--exclude", "exclude"), ("--tensor-type", "tensor_type")):
        if v[key]:
            raise UsageError(f"{flag} does not apply to --to dense: every module is dequantized",
                             fix=f"drop {flag}")
    job = DenseJob(src=v["src"], out=v["out"], dtype=v["dtype"], keep=tuple(v["keep"] or ()),
                   drop=tuple(v["drop"] or ()), dry_run=v["dry_run"], force=v["force"],
                   max_shard_size=v["max_shard_size"])
    with progress(v["quiet"] or v["json_"]) as bar:
        task = bar.add_task("dequantizing", total=None)

        def tick(name: str, k: int, n: int) -> None:
            bar.update(task, completed=k, total=n, description=f"dequantizing {sanitize(name[-40:])}")

        report = run_dense(job, tick)
    warn_unshown(v, report.plan.warnings)
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        render(report, stdout_console())
    return 0
