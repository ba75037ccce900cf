"""`qtool eval`: the quality a quantized checkpoint loses against its dense reference."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qtool.cli.app import app
from qtool.cli.common import ConfigOpt, JsonOpt, QuietOpt, apply_config, emit_json, stdout_console
from qtool.report.text import sanitize

EPILOG = """Examples:

  qtool eval minilm-gptq/ --reference all-MiniLM-L6-v2/

  qtool eval smollm2-gptq/ --reference smollm2-dense/ --text wiki.txt --json
"""


@app.command("eval", help="Compare a quantized checkpoint with its dense reference through transformers: "
                          "perplexity (causal LMs), embedding cosine and similarity drift (encoders), and the "
                          "output error of every quantized layer. Needs qtool[calib].", epilog=EPILOG)
def eval_cmd(
    ctx: typer.Context,
    quant: Annotated[Path, typer.Argument(help="Quantized model directory (any layout qtool reads).",
                                          show_default=False)],
    # optional to Click so a job spec's `reference:` can give it; required once the spec is merged
    reference: Annotated[Path | None, typer.Option("--reference", help="The dense model directory it was made "
                                                   "from (required).", show_default=False)] = None,
    text: Annotated[Path | None, typer.Option(
        "--text", help="Evaluation text (UTF-8, or .jsonl with a \"text\" per line). Default: Python "
                       "standard-library docstrings, disjoint from the calibration default.",
        show_default=False)] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when present).",
                                               show_default=False)] = None,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Perplexity window in tokens (causal LMs).")] = 512,
    windows: Annotated[int, typer.Option("--windows", help="Perplexity windows at most: the first N of the text "
                                                           "(causal LMs).")] = 32,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, eval_cmd)
    from qtool.errors import UsageError
    from qtool.evaluate import evaluate

    if v["reference"] is None:
        raise UsageError("missing --reference", fix="name the dense model: --reference DIR, or key 'reference' "
                                                    "in the job spec")
    if v["seqlen"] < 2:
        raise UsageError("--seqlen must be at least 2")
    if v["windows"] < 1:
        raise UsageError("--windows must be at least 1")
    report = evaluate(v["quant"], v["reference"], v["text"], v["device"], v["seqlen"], v["windows"])
    if v["json_"]:
        emit_json(report.to_dict())
    elif not v["quiet"]:
        console = stdout_console()
        for line in report.summary_lines():
            console.print(sanitize(line))
    return 0
