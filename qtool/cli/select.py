"""`qtool select`: which kernel runs each layer on a device, and why every other kernel refused."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import (
    ConfigOpt,
    JsonOpt,
    QuietOpt,
    apply_config,
    check_range,
    emit_json,
    stdout_console,
)
from qtool.spec import INT32_MAX

# Code widths --bits takes (Plain holds 2..8-bit codes; a gguf:QTYPE layer takes its bits from the qtype).
BITS_RANGE = (2, 8)

EPILOG = """Examples:

  qtool select model-gptq/ --device h100

  qtool select model-gptq/ --device cpu --engine qtool

  qtool select --model llama-3-70b --format gptq --bits 4 --group-size 128 --device h100 --engine vllm --tp 2

  qtool select --layer 19110,8192,row --group-size -1 --device h100 --engine vllm --tp 2

  qtool select --model qwen2.5-72b --device h100 --engine vllm --tp 8 --disable MacheteLinearKernel --json

  qtool select --layer 7168,18432 --format fp8 --scale block --device h200 --engine sglang --m 1,16,64

  qtool select --layer 4096,4096 --format w4a8 --dtype bf16 --device h100 --engine vllm

Devices: profiles in configs/devices.yaml (h100, h200, a100, a10, l40s, rtx4090, rtx5090, t4, mi300x, b200,
gb10, cpu-avx512-bf16, mps), or cpu / cuda:N to read this machine. Exit code 1 when some layer (or some
--m) has no kernel, or the checkpoint has no selectable layer or a quantized module whose bits or shape it
does not record.
"""


@app.command("select", help="Show which kernel each layer gets on a device, and why every other kernel "
                            "refused (GPTQModel AUTO, vLLM's or SGLang's walks, or qtool's own).", epilog=EPILOG)
def select_cmd(
    ctx: typer.Context,
    path: Annotated[Path | None, typer.Argument(help="Checkpoint: .safetensors, .gguf, HF directory or index.",
                                                show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", "-d", help="Profile name, cpu, or cuda:N.")] = "cpu",
    engine: Annotated[str, typer.Option("--engine", help="gptqmodel, vllm, sglang or qtool.")] = "gptqmodel",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size (column layers split N, row "
                                                 "layers split K).")] = 1,
    disable: Annotated[list[str] | None, typer.Option(
        "--disable", help="Kernel name to take out of the walk (repeatable; VLLM_DISABLED_KERNELS).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model from configs/models.yaml, e.g. "
                                                              "llama-3-70b.", show_default=False)] = None,
    layer: Annotated[list[str] | None, typer.Option(
        "--layer", help="A bare layer K,N[,row|col] (repeatable).", show_default=False)] = None,
    format: Annotated[str, typer.Option("--format", help="With --model/--layer: gptq, gptq_v2, gptq_p, awq, "
                                                         "marlin, ct, fp8, int8, w4a8, nvfp4, mxfp4, "
                                                         "mxfp8, bnb, gguf:QTYPE.")] = "gptq",
    bits: Annotated[int | None, typer.Option("--bits", help="With --model/--layer: bits per weight (default: "
                                                            "the format's, 4 for W4A16).", show_default=False)]
    = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="With --model/--layer: -1 = per "
                                                                        "channel (default: the format's, 128 "
                                                                        "for W4A16).", show_default=False)]
    = None,
    scale: Annotated[str | None, typer.Option("--scale", help="With --model/--layer: weight-scale granularity "
                                                              "tensor, channel, group or block (default: the "
                                                              "format's).", show_default=False)] = None,
    block: Annotated[str | None, typer.Option("--block", help="With --scale block: ROWS,COLS of a scale block "
                                                              "(default 128,128).", show_default=False)] = None,
    m: Annotated[str | None, typer.Option("--m", help="Batch rows per call to resolve, e.g. 1,16,64: the "
                                                      "kernel an M-bucketed backend runs at each.",
                                          show_default=False)] = None,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="With --model/--layer: zero points or not.")] = True,
    desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="With --model/--layer: "
                                                                             "act-order (g_idx).")] = False,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Activation operand: fp16, bf16, fp32, fp8 or "
                                                              "int8 (default: fp8 for w4a8, else the model's, "
                                                              "which an FP8/INT8 method quantizes; for a "
                                                              "checkpoint fp16, or what its config quantizes "
                                                              "the activations to).", show_default=False)] = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, select_cmd)
    from qtool.errors import UsageError
    from qtool.kernels.devices import resolve_device
    from qtool.report.select import render
    from qtool.scheme import QuantScheme
    from qtool.select.plan import (
        SCALES,
        check_format,
        dtype_name,
        layer_groups,
        model_groups,
        parse_ints,
        path_groups,
        plan_select,
    )

    if v["bits"] is not None:
        check_range("--bits", v["bits"], *BITS_RANGE)
    if v["group_size"] is not None:
        check_range("--group-size", v["group_size"], 1, INT32_MAX, also=(-1,))
    check_range("--tp", v["tp"], 1, 1 << 16)
    check_format(v["format"])
    if v["dtype"] is not None:
        dtype_name(v["dtype"])
    if v["scale"] is not None and v["scale"] not in SCALES:
        raise UsageError(f"unknown --scale {v['scale']!r}", fix=f"use one of: {', '.join(SCALES)}")
    blk = parse_ints("--block", v["block"], count=2) if v["block"] is not None else None
    ms = parse_ints("--m", v["m"]) if v["m"] is not None else ()
    sources = [s for s in ("path", "model", "layer") if v[s]]
    if len(sources) != 1:
        raise UsageError("give exactly one of PATH, --model or --layer" if sources else "nothing to select for",
                         fix="e.g. qtool select model-gptq/ --device h100, or --model llama-3-8b, "
                             "or --layer 4096,14336")
    # a checkpoint carries its own quantization: a flag describing another would be dropped, and the plan
    # shown would not be for the layer the user asked about
    described = [flag for flag, given in (("--format", v["format"] != "gptq"), ("--bits", v["bits"] is not None),
                                          ("--group-size", v["group_size"] is not None), ("--asym", not v["sym"]),
                                          ("--desc-act", v["desc_act"]), ("--scale", v["scale"] is not None),
                                          ("--block", blk is not None)) if given]
    if v["path"] is not None and described:
        raise UsageError(f"{', '.join(described)} only apply to --model and --layer: a checkpoint is planned with "
                         "the quantization it holds", fix=f"drop {', '.join(described)}")
    dev = resolve_device(v["device"])
    q = QuantScheme(format=v["format"], bits=v["bits"], group_size=v["group_size"], sym=v["sym"],
                    desc_act=v["desc_act"])
    notes: list[str] = []
    unplanned: list[str] = []
    if v["path"] is not None:
        groups, notes, unplanned = path_groups(v["path"], v["dtype"])
        source = str(v["path"])
    elif v["model"] is not None:
        groups, source = model_groups(v["model"], q, v["dtype"], scale=v["scale"], block=blk), v["model"]
    else:
        groups, source = layer_groups(v["layer"], q, v["dtype"], v["scale"], blk), None
    report = plan_select(groups, dev, v["engine"], v["tp"], v["disable"] or (), notes, source, ms=ms,
                         unplanned=unplanned)
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        render(report, stdout_console())
    return 0 if report.all_chosen else 1
