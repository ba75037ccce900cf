"""Rendering a PackReport: rich table for the terminal, Markdown for report.md."""

from __future__ import annotations

from qtool.report.common import human_bytes, md_table
from qtool.report.text import md_escape, sanitize

_HEAD = ["module", "shape", "bits", "group", "before", "after", "bpw", "rel. error"]


def _rows(report) -> list[list[str]]:
    return [[r.module, "x".join(map(str, r.shape)), str(r.bits), str(r.group_size), human_bytes(r.bytes_before),
             human_bytes(r.bytes_after), f"{r.bpw:.3f}", f"{r.rel_error:.4%}"] for r in report.results]


def _summary_lines(report) -> list[str]:
    t = report.totals()
    lines = [f"{t['modules_quantized']} modules packed to {report.format} ({report.method}, "
             f"{'sym' if report.sym else 'asym'}, scales {report.dtype}); {t['modules_kept']} 2-D weights kept dense",
             f"quantized weights: {human_bytes(t['quantized_bytes_before'])} -> "
             f"{human_bytes(t['quantized_bytes_after'])} ({t['bpw']:.3f} bits/weight), "
             f"mean relative error {t['rel_error_mean']:.4%}",
             f"checkpoint: {human_bytes(t['bytes_in'])} -> {human_bytes(t['bytes_out'])}"]
    return lines + list(report.notes) + _calibration_lines(report) + _evaluation_lines(report)


def _calibration_lines(report) -> list[str]:
    c = report.calibration
    if not c or not c.get("layers"):
        return []
    layers = [lay for lay in c["layers"] if lay["loss"] is not None]  # None: the forward never reached it
    if not layers:
        return []
    rel = [lay["loss"] ** 0.5 for lay in layers]
    rtn = [lay["rtn_loss"] ** 0.5 for lay in layers]
    return [f"{c['method']} per-layer output error on the calibration data: mean {sum(rel) / len(rel):.4%} "
            f"(RTN of the same weights: {sum(rtn) / len(rtn):.4%}); per layer in report.json/report.md"]


def _root_pct(loss: float | None) -> str:
    return "-" if loss is None else f"{loss ** 0.5:.4%}"


def _evaluation_lines(report) -> list[str]:
    e = report.evaluation
    if not e:
        return []
    if e["kind"] == "causal":
        lines = [f"eval: perplexity over {e['windows']} windows of {e['seqlen']} tokens: dense {e['ppl_dense']:.3f}, "
                 f"quantized {e['ppl_quant']:.3f} ({e['ppl_increase']:+.3f})"]
    else:
        lines = [f"eval: embedding cosine to dense over {e['sentences']} sentences: mean {e['cos_mean']:.4f}, "
                 f"min {e['cos_min']:.4f}; similarity-matrix drift max {e['sim_drift_max']:.4f}"]
    if e["layers"]:
        errs = [lay["rel_error"] for lay in e["layers"]]
        lines.append(f"eval: per-layer output error on the dense model's inputs: mean {sum(errs) / len(errs):.4%}, "
                     f"worst {max(errs):.4%}")
    return lines + [f"eval: {e['text']}"]


def render(report, console) -> None:
    from rich.table import Table

    if report.dry_run:
        t = Table(title=f"pack plan: {sanitize(report.src)} -> {sanitize(report.format)}", show_lines=False)
        for h in ("module", "shape", "action", "bits", "group", "why"):
            t.add_column(h)
        for p in report.plan:
            t.add_row(sanitize(p.module), "x".join(map(str, p.shape)), p.action, str(p.bits or ""),
                      str(p.group_size or ""), sanitize(p.reason))
        console.print(t)
        for note in report.notes:
            console.print(note)
        console.print("dry run: nothing written")
        return
    t = Table(title=f"qtool pack -> {sanitize(report.out)}")
    for h in _HEAD:
        t.add_column(h, justify="left" if h == "module" else "right")
    for row in _rows(report):
        row[0] = sanitize(row[0])
        t.add_row(*row)
    console.print(t)
    kept = [p for p in report.plan if p.action == "keep"]
    for p in kept:
        console.print(f"kept dense: {sanitize(p.module)} ({sanitize(p.reason)})")
    for line in _summary_lines(report):
        console.print(sanitize(line))
    for w in report.warnings:
        console.print(f"warning: {sanitize(w)}")


def to_markdown(report) -> str:
    out = ["# qtool pack report\n", f"- source: {md_escape(report.src)}", f"- output: {md_escape(report.out)}"]
    out += [f"- {md_escape(line)}" for line in _summary_lines(report)]
    out.append("")
    out.append(md_table(_HEAD, _rows(report)))
    kept = [p for p in report.plan if p.action == "keep"]
    if kept:
        out.append("## Kept dense\n")
        out.append(md_table(["module", "shape", "why"], [[p.module, "x".join(map(str, p.shape)), p.reason]
                                                          for p in kept]))
    if report.calibration and report.calibration.get("layers"):
        out.append("## Calibration: per-layer output error (relative, on the calibration inputs)\n")
        out.append(md_table(["module", report.calibration["method"], "RTN", "note"],
                            [[lay["module"], _root_pct(lay["loss"]), _root_pct(lay["rtn_loss"]), lay["note"]]
                             for lay in report.calibration["layers"]]))
    if report.evaluation and report.evaluation["layers"]:
        out.append("## Evaluation: per-layer output error (relative, on the dense model's inputs)\n")
        out.append(md_table(["module", "error"], [[lay["module"], f"{lay['rel_error']:.4%}"]
                                                  for lay in report.evaluation["layers"]]))
    if report.warnings:
        out.append("## Warnings\n")
        out += [f"- {md_escape(w)}" for w in report.warnings]
    return "\n".join(out)
