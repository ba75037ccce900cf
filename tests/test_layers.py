"""Imports point down the layers and never go round in a circle.

cli -> commands -> core -> io / report, read from the source with `ast` (nothing is imported): module-level and
function-level `import`/`from ... import`, and `importlib.import_module` of a literal name or an f-string's
literal prefix. A unit may import itself, a sibling unit of its own layer and any lower layer, except the
pairs FORBIDDEN names. Neither units nor modules may import each other in a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

# Top layer first. A unit is a package or a top-level module of qtool; a module belongs to the longest unit
# that prefixes its dotted name.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("qtool.cli", "qtool.__main__")),
    ("commands", ("qtool.pack", "qtool.repack", "qtool.inspect", "qtool.select", "qtool.bench", "qtool.validate",
                  "qtool.evaluate")),
    ("core", ("qtool.formats", "qtool.packing", "qtool.quant", "qtool.kernels")),
    ("io/report", ("qtool.io", "qtool.report")),
    ("base", ("qtool", "qtool.errors", "qtool.lazy", "qtool.paths", "qtool.spec")),
)
# Sibling imports that are walls all the same (DESIGN.md): (importer unit, imported unit, why).
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("qtool.formats", "qtool.kernels", "formats never know which kernel reads them"),
    ("qtool.packing", "qtool.formats", "packing knows bits and permutations, not formats"),
    ("qtool.io", "qtool.report", "io moves bytes; reports are rendered above it"),
    ("qtool.report", "qtool.io", "reports render results; they read no files"),
)

PACKAGE = Path(__file__).resolve().parents[1] / "qtool"


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (the nearest existing module of the imported name)
    where: str  # file:line


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every .py under root (a package's name is its __init__'s)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _nearest(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic_target(call: ast.Call) -> str | None:
    """The literal module name (or f-string prefix) of importlib.import_module(...), else None."""
    f = call.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")
    if not named or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return None


def import_edges(root: Path) -> list[Edge]:
    modules = module_names(root)
    top = root.name
    edges: set[Edge] = set()
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from pkg import sub` imports the submodule pkg.sub; `from pkg import name` imports pkg.
                names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            elif isinstance(node, ast.Call):
                target = _dynamic_target(node)
                names = [target] if target else []
            for name in names:
                if name == top or name.startswith(top + "."):
                    dst = _nearest(name, modules)
                    if dst and dst != mod:
                        edges.add(Edge(mod, dst, f"{rel}:{node.lineno}"))
    return sorted(edges, key=lambda e: (e.src, e.dst, e.where))


def unit_of(module: str, layers=LAYERS) -> str | None:
    units = [u for _, us in layers for u in us if module == u or module.startswith(u + ".")]
    return max(units, key=len) if units else None


def layer_index(unit: str, layers=LAYERS) -> int:
    return next(i for i, (_, units) in enumerate(layers) if unit in units)


def layer_violations(edges: Iterable[Edge], layers=LAYERS, forbidden=FORBIDDEN) -> list[str]:
    walls = {(a, b): why for a, b, why in forbidden}
    out = []
    for e in edges:
        a, b = unit_of(e.src, layers), unit_of(e.dst, layers)
        if a is None or b is None or a == b:
            continue
        ia, ib = layer_index(a, layers), layer_index(b, layers)
        if ib < ia:
            out.append(f"{e.where}: {e.src} ({layers[ia][0]}) imports {e.dst} ({layers[ib][0]}), a higher layer")
        elif (a, b) in walls:
            out.append(f"{e.where}: {e.src} imports {e.dst}: {walls[a, b]}")
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _graph(pairs: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for a, b in pairs:
        if a != b:
            g.setdefault(a, set()).add(b)
    return g


def _explain(comps: list[list[str]], edges: list[Edge], key) -> list[str]:
    """One shortest cycle through each component's first node, each hop with the file:line that makes it."""
    out = []
    for comp in comps:
        inside = set(comp)
        hops: dict[str, dict[str, str]] = {}
        for e in sorted(edges, key=lambda e: e.where):
            a, b = key(e.src), key(e.dst)
            if a in inside and b in inside and a != b:
                hops.setdefault(a, {}).setdefault(b, e.where)
        start = comp[0]
        paths = {start: [start]}
        queue = [start]
        cycle: list[str] = []
        while queue and not cycle:
            a = queue.pop(0)
            for b in sorted(hops.get(a, {})):
                if b == start:
                    cycle = paths[a] + [start]
                    break
                if b not in paths:
                    paths[b] = paths[a] + [b]
                    queue.append(b)
        steps = [f"{a} -> {b} ({hops[a][b]})" for a, b in zip(cycle, cycle[1:])]
        out.append(f"{{{', '.join(comp)}}}: " + "; ".join(steps))
    return out


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(PACKAGE)


def test_every_module_has_a_layer():
    missing = [m for m in module_names(PACKAGE) if unit_of(m) is None]
    assert not missing, f"modules in no unit of LAYERS (place them in the table): {missing}"


def test_imports_point_down(edges):
    bad = layer_violations(edges)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_cycles_between_units(edges):
    comps = cycles(_graph((unit_of(e.src), unit_of(e.dst)) for e in edges))
    bad = _explain(comps, edges, unit_of)
    assert not bad, "units importing each other in a cycle:\n" + "\n".join(bad)


def test_no_cycles_between_modules(edges):
    comps = cycles(_graph((e.src, e.dst) for e in edges))
    bad = _explain(comps, edges, lambda m: m)
    assert not bad, "modules importing each other in a cycle:\n" + "\n".join(bad)


def test_the_checker_finds_upward_imports_walls_and_cycles(tmp_path):
    """A small package with one of each fault: the checks above can fail."""
    pkg = tmp_path / "qtool"
    files = {
        "__init__.py": "",
        "cli/__init__.py": "from qtool.cli import app\n",
        "cli/app.py": "import importlib\nimportlib.import_module(f'qtool.cmd.{1}')\n",
        "cmd/__init__.py": "from .run import go\n",
        "cmd/run.py": "def go():\n    from qtool.core.fmt import f\n    return f\n",
        "core/__init__.py": "",
        "core/fmt.py": "from qtool.core import kern\nfrom qtool.low.rep import r\n",
        "core/kern.py": "from . import fmt\n",
        "low/__init__.py": "",
        "low/rep.py": "def r():\n    from qtool.cli import app  # upward\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    layers = (("cli", ("qtool.cli",)), ("cmd", ("qtool.cmd",)), ("core", ("qtool.core",)),
              ("low", ("qtool.low", "qtool")))
    got = import_edges(pkg)
    assert {(e.src, e.dst) for e in got} == {
        ("qtool.cli", "qtool.cli.app"), ("qtool.cli.app", "qtool.cmd"), ("qtool.cmd", "qtool.cmd.run"),
        ("qtool.cmd.run", "qtool.core.fmt"), ("qtool.core.fmt", "qtool.core.kern"),
        ("qtool.core.fmt", "qtool.low.rep"), ("qtool.core.kern", "qtool.core.fmt"),
        ("qtool.low.rep", "qtool.cli.app")}
    assert layer_violations(got, layers, ()) == [
        "qtool/low/rep.py:2: qtool.low.rep (low) imports qtool.cli.app (cli), a higher layer"]
    walls = (("qtool.cmd", "qtool.core", "test wall"),)
    layers_flat = (("all", ("qtool.cli", "qtool.cmd", "qtool.core", "qtool.low", "qtool")),)
    assert layer_violations(got, layers_flat, walls) == [
        "qtool/cmd/run.py:2: qtool.cmd.run imports qtool.core.fmt: test wall"]
    assert cycles(_graph((e.src, e.dst) for e in got)) == [
        ["qtool.cli.app", "qtool.cmd", "qtool.cmd.run", "qtool.core.fmt", "qtool.core.kern", "qtool.low.rep"]]
    assert cycles(_graph((unit_of(e.src, layers), unit_of(e.dst, layers)) for e in got)) == [
        ["qtool.cli", "qtool.cmd", "qtool.core", "qtool.low"]]
    fixed = [e for e in got if e.src != "qtool.low.rep"]
    assert cycles(_graph((e.src, e.dst) for e in fixed)) == [["qtool.core.fmt", "qtool.core.kern"]]


def test_format_registry_is_full_through_base_alone():
    """get_format imports nothing itself: importing qtool.formats.base runs the package's __init__, which
    registers every layout module. In a fresh interpreter the registry seen through base alone equals the one
    after every module of qtool/formats is imported."""
    layouts = [m for m in module_names(PACKAGE) if m.startswith("qtool.formats.")]
    code = ("import importlib, sys\n"
            "from qtool.formats.base import all_formats\n"
            "first = sorted(all_formats())\n"
            f"for m in {layouts!r}: importlib.import_module(m)\n"
            "print(first == sorted(all_formats()), len(first), ' '.join(first))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, timeout=120).stdout.split()
    assert out[0] == "True" and int(out[1]) > 0, out


@pytest.mark.parametrize("module", ["qtool.formats", "qtool.inspect", "qtool.formats.detection"])
def test_header_only_layers_import_no_torch(module):
    """inspect, select and the CLI's format list read headers and format rows only: importing the formats
    (their rows, detectors and config writers) and inspect must not load torch (torch is bound lazily)."""
    code = (f"import sys, {module}\n"
            "from qtool.formats.base import all_formats\n"
            "assert all_formats()\n"
            "print([m for m in ('torch', 'triton', 'numpy') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, timeout=120).stdout
    assert out.strip() == "[]", out


def test_lazy_module_loads_on_first_use():
    code = ("import sys\n"
            "from qtool.lazy import lazy_module\n"
            "m = lazy_module('json')\n"
            "sys.modules.pop('json', None)\n"
            "before = 'json' in sys.modules\n"
            "print(before, m.dumps([1]), 'json' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout.split()
    assert out == ["False", "[1]", "True"], out
