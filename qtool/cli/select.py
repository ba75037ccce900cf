"""`qtool select`: which kernel runs each layer on a device, and why every other kernel refused."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import (
    INT32_MAX,
    ConfigOpt,
    JsonOpt,
    QuietOpt,
    apply_config,
    check_range,
    emit_json,
    stdout_console,
)

# Code widths any format qtool reads stores (Plain holds 2..8-bit codes).
BITS_RANGE = (2, 8)

EPILOG = """Examples:

  qtool select model-gptq/ --device h100

  qtool select model-gptq/ --device cpu --engine qtool

  qtool select --model llama-3-70b --format gptq --bits 4 --group-size 128 --device h100 --engine vllm --tp 2

  qtool select --layer 19110,8192,row --group-size -1 --device h100 --engine vllm --tp 2

  qtool select --model qwen2.5-72b --device h100 --engine vllm --tp 8 --disable MacheteLinearKernel --json

Devices: profiles in configs/devices.yaml (h100, h200, a100, a10, l40s, rtx4090, t4, mi300x, b200, gb10,
cpu-avx512-bf16, mps), or cpu / cuda:N to read this machine. Exit code 1 when some layer has no kernel.
"""


@app.command("select", help="Show which kernel each layer gets on a device, and why every other kernel "
                            "refused (GPTQModel AUTO, vLLM's WNA16 walk, or qtool's own).", epilog=EPILOG)
def select_cmd(
    ctx: typer.Context,
    path: Annotated[Path | None, typer.Argument(help="Checkpoint: .safetensors, .gguf, HF directory or index.",
                                                show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", "-d", help="Profile name, cpu, or cuda:N.")] = "cpu",
    engine: Annotated[str, typer.Option("--engine", help="gptqmodel, vllm or qtool.")] = "gptqmodel",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size (column layers split N, row "
                                                 "layers split K).")] = 1,
    disable: Annotated[list[str] | None, typer.Option(
        "--disable", help="Kernel name to take out of the walk (repeatable; VLLM_DISABLED_KERNELS).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model from configs/models.yaml, e.g. "
                                                              "llama-3-70b.", show_default=False)] = None,
    layer: Annotated[list[str] | None, typer.Option(
        "--layer", help="A bare layer K,N[,row|col] (repeatable).", show_default=False)] = None,
    format: Annotated[str, typer.Option("--format", help="With --model/--layer: gptq, gptq_v2, gptq_p, awq, "
                                                         "marlin, ct.")] = "gptq",
    bits: Annotated[int, typer.Option("--bits", help="With --model/--layer: bits per weight.")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="With --model/--layer: -1 = per channel.")]
    = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="With --model/--layer: zero points or not.")] = True,
    desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="With --model/--layer: "
                                                                             "act-order (g_idx).")] = False,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Activation dtype: fp16, bf16 or fp32 "
                                                              "(default: the model's, fp16 for a "
                                                              "checkpoint).", show_default=False)] = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, select_cmd)
    from qtool.errors import UsageError
    from qtool.kernels.devices import resolve_device
    from qtool.report.select import render
    from qtool.scheme import QuantScheme
    from qtool.select.plan import layer_groups, model_groups, path_groups, plan_select

    check_range("--bits", v["bits"], *BITS_RANGE)
    check_range("--group-size", v["group_size"], 1, INT32_MAX, also=(-1,))
    check_range("--tp", v["tp"], 1, 1 << 16)
    sources = [s for s in ("path", "model", "layer") if v[s]]
    if len(sources) != 1:
        raise UsageError("give exactly one of PATH, --model or --layer" if sources else "nothing to select for",
                         fix="e.g. qtool select model-gptq/ --device h100, or --model llama-3-8b, "
                             "or --layer 4096,14336")
    dev = resolve_device(v["device"])
    q = QuantScheme(format=v["format"], bits=v["bits"], group_size=v["group_size"], sym=v["sym"],
                  desc_act=v["desc_act"])
    notes: list[str] = []
    if v["path"] is not None:
        groups, notes = path_groups(v["path"], v["dtype"])
        source = str(v["path"])
    elif v["model"] is not None:
        groups, source = model_groups(v["model"], q, v["dtype"]), v["model"]
    else:
        groups, source = layer_groups(v["layer"], q, v["dtype"]), None
    report = plan_select(groups, dev, v["engine"], v["tp"], v["disable"] or (), notes, source)
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        render(report, stdout_console())
    return 0 if report.all_chosen else 1
