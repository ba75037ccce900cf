"""What `qtool inspect` found: dataclasses with `to_dict()` (the --json schema) and rich renderings.

JSON schema (README "qtool inspect --json"); keys marked (opt) appear only with the flag named:

    path         str          what was inspected
    container    str          "safetensors" | "gguf"
    format       str          dominant module format ("gptq", "gptq_v2", "awq", "ct", "gguf:Q4_0", "dense", ...)
    modules      list[obj]    one per linear weight: name, format, bits, group_size, sym, desc_act,
                              in_features, out_features, bytes (+ activations "fp8" | "int8" where the
                              config quantizes the module's inputs; + stats {mean, std, absmax} (opt, --deep))
    tensor_count int
    bytes_total  int          sum of tensor data bytes (what the headers declare)
    bpw          float|null   8 * bytes_total / logical parameter count (null when a tensor's size is unknown)
    metadata     obj          GGUF key/values (arrays summarised) or the quantization config
    anomalies    list[obj]    severity ("error" | "warning" | "info"), tensor (str|null), message
    tensors      list[obj]    (opt, --tensors) name, dtype, shape, bytes (null where the header cannot give
                              the size: an unknown GGUF type), file, complete
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qtool.scheme import QuantScheme

MODULE_KEYS = ("name", "format", "bits", "group_size", "sym", "desc_act", "in_features", "out_features", "bytes")
_SCHEME_KEYS = frozenset({"format", "bits", "group_size", "sym", "desc_act"})  # written flat from .scheme
REPORT_KEYS = ("path", "container", "format", "modules", "tensor_count", "bytes_total", "bpw", "metadata",
               "anomalies")


@dataclass(frozen=True)
class Anomaly:
    severity: str
    tensor: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "tensor": self.tensor, "message": self.message}


def merge_notes(notes: list[tuple[str, str, str]]) -> list[Anomaly]:
    """(severity, module, message) -> one anomaly per distinct finding, naming the first module, a count and
    the next few (a finding on 80 layers stays one line)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for sev, mod, msg in notes:
        seen.setdefault((sev, msg), []).append(mod)
    out = []
    for (sev, msg), mods in seen.items():
        more = ""
        if len(mods) > 1:
            also = ", ".join(f"'{m}'" for m in mods[1:4]) + (", ..." if len(mods) > 4 else "")
            more = f" ({len(mods)} modules; also {also})"
        out.append(Anomaly(sev, mods[0], msg + more))
    return out


@dataclass(slots=True)
class ModuleReport:
    """One linear weight: its quantization (`scheme`) and what the header says besides. The attribute names
    are the contract `select` reads.

    scheme's bits / group_size / sym / desc_act and in_features / out_features are None where the header
    cannot tell (e.g. GPTQ sym without a config; --deep fills sym and desc_act from the data); scheme.format
    is always set ("dense" and "unknown" included). bytes = all tensors of the module (packed weight, scales,
    zeros, g_idx, bias). n_weights = logical I*O (bits-per-weight).
    """

    name: str
    scheme: QuantScheme
    in_features: int | None
    out_features: int | None
    bytes: int
    n_weights: int | None = None
    detail: str | None = None
    tensor_names: tuple[str, ...] = ()
    stats: dict[str, float] | None = None

    @property
    def quantized(self) -> bool:
        return self.scheme.format not in ("dense", "unknown")

    @property
    def activations(self) -> str | None:
        """The quantized activations' type the config names ("fp8", "int8"); None for weight-only."""
        return self.scheme.extra.get("activations")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self.scheme if k in _SCHEME_KEYS else self, k) for k in MODULE_KEYS}
        if self.activations is not None:
            d["activations"] = self.activations
        if self.scheme.extra.get("weight_scale"):  # "tensor" | "channel" | "block": group_size -1 is either
            d["weight_scale"] = self.scheme.extra["weight_scale"]
        if self.scheme.extra.get("experts"):  # out_features counts the rows of every expert
            d["experts"] = self.scheme.extra["experts"]
        if self.stats is not None:
            d["stats"] = dict(self.stats)
        return d


@dataclass(frozen=True)
class TensorRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int | None  # None: the size is unknown (a GGUF type id the gguf package does not know)
    file: str
    complete: bool = True
    module: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bytes": self.bytes,
                "file": self.file, "complete": self.complete}


@dataclass
class PatternRow:
    pattern: str
    count: int
    format: str
    shape: str


@dataclass
class InspectReport:
    """Everything `inspect` says about one checkpoint. `to_dict()` is the --json schema above."""

    path: str
    container: str
    format: str
    modules: list[ModuleReport]
    tensor_count: int
    bytes_total: int
    bpw: float | None
    metadata: dict[str, Any]
    anomalies: list[Anomaly]
    files: list[str] = field(default_factory=list)
    tensors: list[TensorRow] = field(default_factory=list)
    other_bytes_params: tuple[int, int] = (0, 0)      # (bytes, params) of tensors outside modules
    config_source: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # container facts for the summary (GGUF version, ...)
    info_tail: dict[str, Any] = field(default_factory=dict)  # shown after the totals (what the config says)
    type_histogram: list[tuple[str, int, int | None, float | None]] = field(default_factory=list)
    deep: bool = False

    # --- derived ------------------------------------------------------------------------------------
    @property
    def quantized_modules(self) -> list[ModuleReport]:
        return [m for m in self.modules if m.quantized]

    @property
    def quantized_bytes(self) -> int:
        return sum(m.bytes for m in self.quantized_modules)

    @property
    def dense_bytes(self) -> int:
        return self.bytes_total - self.quantized_bytes

    @property
    def unsized_tensors(self) -> list[TensorRow]:
        """Tensors whose byte size the header cannot give; bytes_total and module bytes leave them out."""
        return [t for t in self.tensors if t.bytes is None]

    @property
    def quantized_bpw(self) -> float | None:
        q = [m for m in self.quantized_modules if m.n_weights]
        n = sum(m.n_weights for m in q)
        unsized = {t.module for t in self.unsized_tensors}
        return 8.0 * sum(m.bytes for m in q) / n if n and not any(m.name in unsized for m in q) else None

    def has_errors(self) -> bool:
        return any(a.severity == "error" for a in self.anomalies)

    def summary_value(self, attr: str) -> Any:
        """One scheme field over the quantized modules, "mixed (a, b)" when they differ, None when unknown."""
        vals = {getattr(m.scheme, attr) for m in self.quantized_modules}
        vals.discard(None)
        if not vals:
            return None
        if len(vals) == 1:
            return next(iter(vals))
        return "mixed (" + ", ".join(str(v) for v in sorted(vals, key=str)) + ")"

    def format_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.modules:
            out[m.scheme.format] = out.get(m.scheme.format, 0) + 1
        return out

    def patterns(self) -> list[PatternRow]:
        """Modules and loose tensors grouped by name with layer numbers collapsed, then format and shape."""
        from qtool.inspect.detect import collapse_layers

        rows: dict[tuple[str, str, str], int] = {}
        for m in self.modules:
            shape = f"{m.out_features} x {m.in_features}" if m.in_features and m.out_features else "?"
            if m.scheme.extra.get("experts"):
                e = m.scheme.extra["experts"]
                shape = f"{e} x {m.out_features // e} x {m.in_features} (experts)"
            key = (collapse_layers(m.name), m.scheme.format, shape)
            rows[key] = rows.get(key, 0) + 1
        for t in self.tensors:
            if t.module is None:
                key = (collapse_layers(t.name), t.dtype, " x ".join(map(str, t.shape)) or "scalar")
                rows[key] = rows.get(key, 0) + 1
        return [PatternRow(p, n, f, s) for (p, f, s), n in rows.items()]

    def to_dict(self, tensors: bool = False) -> dict[str, Any]:
        d = {
            "path": self.path,
            "container": self.container,
            "format": self.format,
            "modules": [m.to_dict() for m in self.modules],
            "tensor_count": self.tensor_count,
            "bytes_total": self.bytes_total,
            "bpw": None if self.bpw is None else round(self.bpw, 4),
            "metadata": self.metadata,
            "anomalies": [a.to_dict() for a in self.anomalies],
        }
        if tensors:
            d["tensors"] = [t.to_dict() for t in self.tensors]
        return d


# --- rendering ----------------------------------------------------------------------------------------

_SEV_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
MAX_STATS_ROWS = 60


def _b(v: Any) -> str:
    if v is None:
        return "?"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _whole_rows(report: InspectReport) -> str:
    """What group size -1 means here: one scale per output channel, or one for the whole tensor."""
    kinds = {m.scheme.extra.get("weight_scale") or "channel" for m in report.quantized_modules
             if m.scheme.group_size == -1}
    return " (per tensor)" if kinds == {"tensor"} else " (per channel)" if kinds == {"channel"} else \
        " (per tensor or per channel)"


def _sub_blocks(report: InspectReport) -> str:
    """For GGUF K-quants, that the group is a super-block with finer scales inside (Q4_K: one per 32)."""
    from qtool.io.gguf_reader import K_SUB_BLOCK

    types = {str(m.scheme.format).removeprefix("gguf:") for m in report.quantized_modules}
    if not types or not types <= set(K_SUB_BLOCK):
        return ""
    subs = "/".join(str(n) for n in sorted({K_SUB_BLOCK[t] for t in types}))
    return f" (super-blocks; a sub-block scale per {subs} weights inside)"


def renderables(report: InspectReport, show_tensors: bool = False) -> list:
    """Rich renderables for the terminal: summary, [GGUF type histogram], pattern table, [deep stats],
    [tensors], anomalies. Every string read from the file goes through `sanitize`."""
    from rich.table import Table
    from rich.text import Text

    from qtool.report.common import human_bytes
    from qtool.report.text import sanitize

    out: list = []
    s = Table(title=f"qtool inspect: {sanitize(report.path)}", show_header=False, title_justify="left",
              box=None, padding=(0, 2))
    s.add_column("key", style="bold")
    s.add_column("value")
    nfiles = len(report.files)
    s.add_row("container", f"{report.container} ({nfiles} file{'s' if nfiles != 1 else ''})")
    for k, v in report.info.items():
        s.add_row(k, sanitize(str(v)))
    counts = report.format_counts()
    fmt = report.format
    if len([f for f in counts if f not in ("dense",)]) > 1:
        fmt += "  [" + ", ".join(f"{sanitize(f)}: {n}" for f, n in sorted(counts.items(), key=lambda x: -x[1])) + "]"
    s.add_row("format", sanitize(fmt))
    if report.quantized_modules:
        s.add_row("bits", _b(report.summary_value("bits")))
        g = report.summary_value("group_size")
        s.add_row("group size", _b(g) + (_whole_rows(report) if g == -1 else _sub_blocks(report)))
        s.add_row("sym", _b(report.summary_value("sym")))
        s.add_row("act-order", _b(report.summary_value("desc_act")))
        acts = {m.activations or "16-bit" for m in report.quantized_modules}
        if acts != {"16-bit"}:  # weight-only checkpoints need no row
            s.add_row("activations", " / ".join(sorted(acts)) + " (the config's input_activations)")
    nq = len(report.quantized_modules)
    nu = sum(1 for m in report.modules if m.scheme.format == "unknown")
    unknown = f", {nu} unknown quantized layout" if nu else ""
    s.add_row("modules", f"{len(report.modules)} ({nq} quantized{unknown}, {len(report.modules) - nq - nu} dense)")
    s.add_row("tensors", str(report.tensor_count))
    ub = sum(m.bytes for m in report.modules if m.scheme.format == "unknown")
    unsized = len(report.unsized_tensors)
    s.add_row("bytes", f"{report.bytes_total:,} ({human_bytes(report.bytes_total)}): quantized "
                       f"{human_bytes(report.quantized_bytes)}"
                       + (f", unknown layout {human_bytes(ub)}" if nu else "")
                       + f", dense {human_bytes(report.dense_bytes - ub)}"
                       + (f"; {unsized} tensor{'s' if unsized != 1 else ''} of unknown size not counted" if unsized
                          else ""))
    bpw = "?" if report.bpw is None else f"{report.bpw:.3f}"
    if report.quantized_bpw is not None:
        bpw += f" (quantized modules {report.quantized_bpw:.3f})"
    s.add_row("bits/weight", bpw)
    for k, v in report.info_tail.items():
        s.add_row(k, sanitize(str(v)))
    if report.container == "safetensors" and not report.info_tail:
        s.add_row("config", "none")
    out.append(s)

    if report.type_histogram:
        h = Table(title="tensor types", title_justify="left")
        for c in ("type", "tensors", "bytes", "bits/weight"):
            h.add_column(c, justify="left" if c == "type" else "right")
        for name, n, nbytes, bpw_t in report.type_histogram:
            h.add_row(sanitize(name), str(n), "?" if nbytes is None else human_bytes(nbytes),
                      "?" if bpw_t is None else f"{bpw_t:.3f}")
        out.append(h)

    p = Table(title="tensor-name patterns (# = layer number)", title_justify="left")
    p.add_column("pattern")
    p.add_column("count", justify="right")
    p.add_column("format")
    p.add_column("shape (out x in)")
    for r in report.patterns():
        p.add_row(sanitize(r.pattern), str(r.count), sanitize(r.format), r.shape)
    out.append(p)

    stats = [m for m in report.modules if m.stats]
    if stats:
        d = Table(title="dequantized weight statistics (--deep)", title_justify="left")
        for c in ("module", "format", "mean", "std", "absmax"):
            d.add_column(c, justify="left" if c in ("module", "format") else "right")
        for m in stats[:MAX_STATS_ROWS]:
            d.add_row(sanitize(m.name), sanitize(m.scheme.format), f"{m.stats['mean']:.4g}", f"{m.stats['std']:.4g}",
                      f"{m.stats['absmax']:.4g}")
        if len(stats) > MAX_STATS_ROWS:
            d.add_row(f"... {len(stats) - MAX_STATS_ROWS} more (see --json)", "", "", "", "")
        out.append(d)

    if show_tensors:
        t = Table(title="tensors", title_justify="left")
        for c in ("name", "dtype", "shape", "bytes", "file"):
            t.add_column(c, justify="right" if c == "bytes" else "left")
        for r in report.tensors:
            t.add_row(sanitize(r.name) + ("" if r.complete else " [red](incomplete)[/red]"), sanitize(r.dtype),
                      "[" + ", ".join(map(str, r.shape)) + "]", "?" if r.bytes is None else f"{r.bytes:,}",
                      sanitize(r.file))
        out.append(t)

    if report.anomalies:
        a = Table(title="anomalies", title_justify="left")
        a.add_column("severity")
        a.add_column("tensor")
        a.add_column("message")
        for an in report.anomalies:
            a.add_row(Text(an.severity, style=_SEV_STYLE.get(an.severity, "")), sanitize(an.tensor or "-"),
                      sanitize(an.message))
        out.append(a)
    else:
        out.append(Text("no anomalies", style="green"))
    return out
