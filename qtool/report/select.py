"""The `qtool select` report: per layer pattern, the kernel chosen and every candidate's verdict.

JSON (`SelectReport.to_dict()`, the --json schema):

    {"engine": "vllm", "device": "h100", "tp": 2, "m": [1, 16, 64],
     "device_profile": {...}, "disabled": [...], "notes": [...],
     "unplanned": [...],                                   # quantized modules no kernel can be chosen for
     "layers": [{"name": "model.layers.#.mlp.down_proj", "count": 80, "parallel": "row",
                 "format": "gptq", "bits": 4, "group_size": 128, "sym": true, "desc_act": false,
                 "act_dtype": "bfloat16",
                 "in_features": 28672, "out_features": 8192,
                 "in_features_per_partition": 14336, "out_features_per_partition": 8192,
                 "chosen": "MacheteLinearKernel",
                 "scale": "group", "block": null,             # weight-scale granularity, [rows, cols] if block
                 "per_m": {"1": "...", "16": "...", "64": "..."},   # the kernel a call of M rows runs (--m)
                 "candidates": [{"kernel": ..., "ok": ..., "reason": ..., "hint": ...}, ...],
                 "notes": [...]}]}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LayerRow:
    """One distinct layer pattern and its verdict (`selection` is a qtool.kernels.select.Selection)."""

    name: str
    count: int
    selection: Any

    def to_dict(self) -> dict:
        s = self.selection
        L = s.layer
        return {
            "name": self.name, "count": self.count, "parallel": L.parallel,
            "format": L.format, "bits": L.bits, "group_size": L.group_size, "sym": L.sym,
            "desc_act": L.desc_act, "act_dtype": L.act_dtype,
            "in_features": L.in_features, "out_features": L.out_features,
            "in_features_per_partition": s.in_features_per_partition,
            "out_features_per_partition": s.out_features_per_partition,
            "chosen": s.chosen,
            "scale": L.scale_kind, "block": list(L.block) if L.block else None,
            "per_m": {str(m): k for m, k in s.per_m},
            "candidates": [c.to_dict() for c in s.candidates],
            "notes": list(s.notes),
        }


def layer_row(name: str, count: int, selection: Any) -> LayerRow:
    return LayerRow(name, count, selection)


@dataclass
class SelectReport:
    engine: str
    device: Any                      # qtool.kernels.devices.Device
    tp: int
    layers: list[LayerRow]
    source: str | None = None        # checkpoint path or model name
    disabled: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ms: list[int] = field(default_factory=list)   # batch rows resolved per call (--m)
    unplanned: list[str] = field(default_factory=list)   # quantized module patterns no kernel can be chosen for

    @property
    def all_chosen(self) -> bool:
        """Every layer has a kernel (and there is a layer: a checkpoint with none selectable is a failure, and
        so is one whose quantized modules are not all planned)."""
        return bool(self.layers) and not self.unplanned and all(
            r.selection.chosen is not None and all(k is not None for _, k in r.selection.per_m) for r in self.layers)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "engine": self.engine,
            "device": self.device.name,
            "tp": self.tp,
            "source": self.source,
            "device_profile": self.device.to_dict(),
            "disabled": list(self.disabled),
            "m": list(self.ms),
            "notes": list(self.notes),
            "unplanned": list(self.unplanned),
            "layers": [r.to_dict() for r in self.layers],
        }


def render(report: SelectReport, console) -> None:
    """Summary table (one row per layer pattern), then each pattern's candidates in walk order."""
    from rich.table import Table

    from qtool.report.text import sanitize

    dev = report.device
    cc = f" CC {dev.cc_str}" if dev.cc_str else ""
    flags = ""
    if dev.platform == "cpu":
        shown = sorted(f for f in dev.cpu_flags if f.startswith(("avx512", "amx", "avx2")))
        flags = f" ({sanitize(', '.join(shown))})" if shown else ""
    head = (f"[bold]{sanitize(report.engine)}[/] on [bold]{sanitize(dev.name)}[/] ({dev.platform}{cc}{flags}"
            f"{', live' if dev.live else ''}), TP={report.tp}")
    if report.source:
        head += f"  source: {sanitize(report.source)}"
    console.print(head)
    if report.disabled:
        console.print(f"disabled: {sanitize(', '.join(report.disabled))}")

    summary = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("layer", "x", "quant", "K x N", "per rank", "chosen"):
        summary.add_column(col, no_wrap=col != "layer")
    for r in report.layers:
        s, L = r.selection, r.selection.layer
        quant = f"{L.format} {L.bits}b {_scale(L)}{'' if L.sym else ' asym'}{' act' if L.desc_act else ''}"
        chosen = f"[green]{s.chosen}[/]" if s.chosen else "[red]none[/]"
        summary.add_row(sanitize(r.name), str(r.count), sanitize(quant), f"{L.in_features}x{L.out_features}",
                        f"{s.in_features_per_partition}x{s.out_features_per_partition}", chosen)
    console.print(summary)

    # Patterns whose candidates got identical verdicts share one table (most layers of a model do).
    shared: dict[tuple, list[LayerRow]] = {}
    for r in report.layers:
        key = tuple((c.kernel, c.ok, c.reason, c.hint) for c in r.selection.candidates) + (r.selection.notes,)
        shared.setdefault(key, []).append(r)
    for rows in shared.values():
        console.print()
        for r in rows:
            s = r.selection
            console.print(f"[bold]{sanitize(r.name)}[/]  K={s.layer.in_features} N={s.layer.out_features} "
                          f"({_par(s.layer.parallel)}) -> K_part={s.in_features_per_partition} "
                          f"N_part={s.out_features_per_partition}, act {s.layer.act_dtype}")
        s = rows[0].selection
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        t.add_column("", no_wrap=True)
        t.add_column("kernel", no_wrap=True)
        t.add_column("reason")
        t.add_column("hint")
        for c in s.candidates:
            mark = "[green]>>[/]" if c.kernel == s.chosen else ("[green]ok[/]" if c.ok else "[red]--[/]")
            why = c.reason.split(": ", 1)[1] if ": " in c.reason else c.reason
            label = c.kernel if c.priority is None else f"{c.kernel} ({c.priority})"
            t.add_row(mark, sanitize(label), sanitize(why), sanitize(c.hint or ""))
        console.print(t)
        if s.per_m:
            calls = "; ".join(f"M={m}: " + (sanitize(k) if k else "[red]none[/]") for m, k in s.per_m)
            console.print(f"  per call: {calls}")
        for n in s.notes:
            console.print(f"  note: {sanitize(n)}")
    for n in report.notes:
        console.print(f"note: {sanitize(n)}")


def _scale(L: Any) -> str:
    kind = L.scale_kind
    if kind == "block":
        return "block " + ("x".join(map(str, L.block)) if L.block else "?")
    if kind == "group":
        return f"g{L.group_size}"
    return f"per-{kind}"


def _par(parallel: str) -> str:
    return "replicated" if parallel == "replicated" else f"{parallel}-parallel"
