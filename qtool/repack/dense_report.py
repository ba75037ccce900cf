"""Rendering a `repack --to dense` plan/report: one row per dequantized module, every other tensor's fate by
kind (names listed for casts, carries and drops; --json and qtool_repack.json list every tensor), the values
line for the dtype, warnings, and the outcome."""

from __future__ import annotations

from qtool.repack.report import print_outcome

LISTED = 8  # names shown per fate in the terminal before "and N more"


def _names(names: list[str]) -> str:
    return ", ".join(names[:LISTED]) + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")


def render(report, console) -> None:
    from rich.table import Table

    from qtool.report.text import sanitize

    plan = report.plan
    dt = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}[plan.dtype]
    t = Table(title=f"repack {sanitize(str(plan.job.src))} -> dense {dt}", show_lines=False)
    for h in ("module", "from", "shape", "bits/group", "written as", "values"):
        t.add_column(h, overflow="fold")
    for m in plan.modules:
        t.add_row(sanitize(m.module), m.src_format, "x".join(map(str, m.shape)), f"{m.bits}/{m.group_size}",
                  sanitize(m.name), f"[green]{m.kind}[/green]" if m.kind == "exact" else m.kind)
    from qtool.repack.dense import REORDERED, ROUNDING, TORCH_NAMES

    if plan.modules:
        console.print(t)
        console.print(f"{len(plan.modules)} modules dequantized to {dt}; {ROUNDING[plan.dtype]}")
    else:  # a float GGUF: names, row order, config and tokenizer are the conversion
        console.print(f"no quantized modules: the {plan.container} file's float tensors are written under "
                      "transformers' names")
    by: dict[str, list] = {}
    for x in plan.tensors:
        by.setdefault(x.fate, []).append(x)
    same = [x for x in by.get("copied", []) if x.note != REORDERED]
    moved = [x for x in by.get("copied", []) if x.note == REORDERED]
    if same:
        console.print(f"{len(same)} other tensors copied byte for byte")
    if moved:
        console.print(f"{len(moved)} q/k tensors copied with their {REORDERED}: {sanitize(_names([x.source for x in moved]))}")
    if "cast" in by:
        notes = sorted({x.note for x in by["cast"]})
        console.print(f"{len(by['cast'])} float tensors cast ({sanitize('; '.join(notes))}, as --dtype asked): "
                      f"{sanitize(_names([x.source for x in by['cast']]))}")
    if "carried" in by:
        console.print(f"{len(by['carried'])} tensors its layout does not read carried unchanged (--keep): "
                      f"{sanitize(_names([x.source for x in by['carried']]))}")
    if "dropped" in by:
        whys: dict[str, list[str]] = {}
        for x in by["dropped"]:
            whys.setdefault(x.note, []).append(x.source)
        for why, names in whys.items():
            console.print(f"dropped ({len(names)} tensors, written nowhere; {sanitize(why)}): "
                          f"{sanitize(_names(names))}")
    print_outcome(report, console, f" (config.json: no quantization_config, torch_dtype {TORCH_NAMES[plan.dtype]})")
