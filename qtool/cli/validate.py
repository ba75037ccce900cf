"""`qtool validate`: one CI gate for a checkpoint and the kernels that read it. Exit 0 pass (a check passed
and none failed), 1 a check failed, 2 bad input, 4 nothing was checked (every selected check was skipped)."""

from __future__ import annotations

import sys
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
    progress,
    stdout_console,
)

CHECK_NAMES = "integrity, roundtrip, contract, reference, kernels, hashes"

EPILOG = f"""Examples:

  qtool validate model-gptq/

  qtool validate model-gptq/ --reference model-dense/ --report ci-artifacts/

  qtool validate model-gptq/ --checks integrity,hashes --json

  qtool validate model-gptq/ --against model-gptq-copy/ --checks hashes

  qtool validate model-gptq/ --device cuda --kernels triton-w4a16,cuda-w4a16 --batch-sizes 1 16 256

  qtool validate model-gptq/ --engine gptqmodel,vllm --target h100,a100

Checks: {CHECK_NAMES} (default: all; reference needs --reference).

Exit status: 0 pass (a check passed and none failed), 1 a check failed, 2 bad input, 4 nothing was \
checked (every selected check was skipped: stderr says why and what to add).
"""

# Every check skipped is neither a pass (nothing was proved) nor a failure of the checkpoint; 3 is taken by
# main()'s internal error, which a CI job must be able to tell apart from an empty run.
EXIT_NOTHING_CHECKED = 4
EXIT = {"pass": 0, "fail": 1, "skip": EXIT_NOTHING_CHECKED}


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(x.strip() for v in values or () for x in v.split(",") if x.strip())


@app.command("validate", help="Prove a checkpoint and the kernels that read it are right: integrity, exact "
                              "round trip, engine contract, error against the dense source, kernels against "
                              "the float64 oracle, content hashes. Exit 1 names each failing module and check.",
             epilog=EPILOG)
def validate_cmd(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Checkpoint: .safetensors, directory, *.index.json or .gguf.",
                                         show_default=False)],
    reference: Annotated[Path | None, typer.Option("--reference", help="The dense checkpoint it was made from.",
                                                   show_default=False)] = None,
    device: Annotated[str | None, typer.Option("--device", help="Where kernels run: cpu, cuda, cuda:N "
                                                                "(default: cuda when present).",
                                               show_default=False)] = None,
    kernels: Annotated[list[str] | None, typer.Option("--kernels", help="Only these kernel ids (comma list).",
                                                      show_default=False)] = None,
    batch_sizes: Annotated[list[int] | None, typer.Option("--batch-sizes", help="M values the kernels run at "
                                                                                 "(default 1 7 32).",
                                                          show_default=False)] = None,
    checks: Annotated[list[str] | None, typer.Option("--checks", help=f"Comma list among: {CHECK_NAMES}.",
                                                     show_default=False)] = None,
    engine: Annotated[list[str] | None, typer.Option("--engine", help="Engines the contract check asks select "
                                                                      "about: gptqmodel, vllm, sglang, qtool "
                                                                      "(comma list; default: each layer by "
                                                                      "gptqmodel or vllm, whichever runs it).",
                                                     show_default=False)] = None,
    target: Annotated[list[str] | None, typer.Option("--target", help="Devices the contract check plans for: "
                                                                      "profiles (h100, a100, ...) or cpu / "
                                                                      "cuda:N (default: --device).",
                                                     show_default=False)] = None,
    against: Annotated[Path | None, typer.Option("--against", help="Another checkpoint: name every tensor "
                                                                   "whose content differs.",
                                                 show_default=False)] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Directory to write report.json and report.md "
                                                                 "into (CI artifacts).", show_default=False)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every check, not only failures.")] = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    v = apply_config(ctx, config, {k: val for k, val in locals().items() if k != "ctx"}, validate_cmd)
    from qtool.report.validate import CHECKS, render, to_markdown
    from qtool.validate import DEFAULT_BATCH_SIZES, ValidateOptions, validate_path

    for m in v["batch_sizes"] or ():
        check_range("--batch-sizes", m, 1, 1 << 20)
    if v["report"] is not None:
        _check_report_dir(v["report"])
    _names_exist(v)
    opt = ValidateOptions(checks=_split(v["checks"]) or CHECKS, reference=v["reference"], device=v["device"],
                          kernels=_split(v["kernels"]) or None,
                          batch_sizes=tuple(v["batch_sizes"] or DEFAULT_BATCH_SIZES),
                          engines=_split(v["engine"]) or (), targets=_split(v["target"]),
                          against=v["against"])
    with progress(v["quiet"] or v["json_"]) as bar:
        task = bar.add_task("validate", total=None)
        result = validate_path(v["path"], opt,
                               on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    if v["json_"]:
        emit_json(result.to_dict())
    elif not v["quiet"]:
        render(result, stdout_console(), verbose=v["verbose"])
    empty = result.nothing_checked()
    if empty:  # on stderr under --json and -q too: the exit status alone does not say why or what to add
        from qtool.report.text import terminal

        sys.stderr.write(f"qtool: {terminal(empty)}\n")
    if v["report"] is not None:  # after the verdict is shown: a report that cannot be written does not hide it
        _write(v["report"], result, to_markdown(result))
    return EXIT[result.status]


def _names_exist(v: dict) -> None:
    """A mistyped engine, target or kernel is a usage error (exit 2), never a failed check of the checkpoint
    (exit 1): a CI job would read that as a broken file."""
    from qtool.errors import UsageError
    from qtool.kernels.base import get_kernel
    from qtool.kernels.decls import ENGINES
    from qtool.kernels.devices import resolve_device

    if "reference" in _split(v["checks"]) and v["reference"] is None:
        raise UsageError("--checks reference compares against the dense model, and no --reference was given",
                         fix="add --reference DENSE, or leave reference out of --checks")
    for e in _split(v["engine"]):
        if e not in ENGINES:
            raise UsageError(f"--engine {e}: unknown engine", fix=f"use one of: {', '.join(ENGINES)}")
    for t in _split(v["target"]):
        resolve_device(t)
    for k in _split(v["kernels"]):
        get_kernel(k)


REPORT_FILES = ("report.json", "report.md")


def _check_report_dir(folder: Path) -> None:
    """Refuse, before any check runs, a --report folder that cannot take both files: it is a file, a parent is a
    file, or one of the files is there already (bench's rule for a report file: it never replaces one, and an
    earlier run's verdict is an artifact too)."""
    from qtool.bench.report import check_report_path
    from qtool.errors import UsageError

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--report {folder}: is not a directory", fix="name a directory (it is created)")
    for name in REPORT_FILES:
        check_report_path("--report", folder / name)


def _write(folder: Path, result, markdown: str) -> None:
    """Both files or neither: report.md that cannot be written takes the report.json just published with it."""
    from qtool.bench.report import write_report
    from qtool.cli.common import json_text

    text = json_text(result.to_dict())
    first = folder / REPORT_FILES[0]
    write_report("--report", first, lambda p: p.write_text(text, encoding="utf-8"), replace=False)
    try:
        write_report("--report", folder / REPORT_FILES[1], lambda p: p.write_text(markdown, encoding="utf-8"),
                     replace=False)
    except BaseException:
        first.unlink(missing_ok=True)
        raise
