"""`qtool inspect`: what is this checkpoint? (safetensors or GGUF, header-only unless --deep)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import ConfigOpt, JsonOpt, QuietOpt, apply_config, emit_json, progress, stdout_console

EPILOG = """Examples:

  qtool inspect model-gptq/

  qtool inspect model.safetensors.index.json --json

  qtool inspect llama-7b-Q4_K_M.gguf --tensors

  qtool inspect model-00001-of-00003.gguf

  qtool inspect model-gptq/ --deep --strict
"""


@app.command("inspect", help="Describe a quantized checkpoint (.safetensors file, directory, index.json, .gguf or "
                             "split GGUF): format per module, bits, group size, sym, act-order, bytes, "
                             "bits/weight, and anomalies. Reads headers only unless --deep.", epilog=EPILOG)
def inspect_cmd(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Checkpoint: .safetensors, directory, *.index.json or .gguf.",
                                         show_default=False)],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor (name, dtype, shape, bytes, "
                                                            "file).")] = False,
    deep: Annotated[bool, typer.Option("--deep", help="Read tensor data: NaN/Inf/zero scales, code and zero "
                                                      "ranges, g_idx, GPTQ v1/v2 zeros, weight statistics.")]
    = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when any anomaly has severity 'error'.")]
    = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, inspect_cmd)
    from qtool.inspect import inspect_path
    from qtool.inspect.report import renderables

    if v["deep"]:
        with progress(v["quiet"] or v["json_"]) as bar:
            task = bar.add_task("deep check", total=None)
            report = inspect_path(v["path"], deep=True,
                                  on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    else:
        report = inspect_path(v["path"])
    if v["json_"]:
        emit_json(report.to_dict(tensors=v["tensors"]))
    elif not v["quiet"]:
        console = stdout_console()
        for r in renderables(report, show_tensors=v["tensors"]):
            console.print(r)
            console.print()
    return 1 if v["strict"] and report.has_errors() else 0
