"""The benchmark records stay a record: every file that README.md, benchmarks/RESULTS.md and the result pages
name exists in the repo, every commit bench.md points to exists, and benchmarks/results stays small.

A reference is (1) a Markdown link target, resolved from the page's folder; (2) a path that starts at one of
the repo's top-level folders (`benchmarks/...`, `qtool/...`, `tests/...`), resolved from the repo root, with
`{a,b}` alternatives expanded and `*` globbed; (3) on the benchmark pages, a bare result-file name
(`bench-*`, `tune-*`, `ncu-*`, `stream-probe-*`), resolved in benchmarks/results. A path after `COMMIT:` (as in
`git show abc1234:benchmarks/...`) names a file in history, not in the tree, and is not checked here.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MAX_RESULT_FILES = 25  # issue 29's limit

LINK = re.compile(r"\]\(([^)\s]+)\)")
ROOTS = "|".join(sorted(re.escape(p.name) for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")))
ROOTED = re.compile(rf"(?<![\w./:~-])((?:{ROOTS})/[\w./*{{}},-]*[\w*}}])")
RESULT_NAME = re.compile(r"(?<![\w./:~-])((?:bench|tune|ncu|stream-probe)-[\w.{},-]*\.(?:json|md|png|txt|csv))\b")
COMMIT = re.compile(r"(?:\(|commits? |, | and | code | reverted )([0-9a-f]{7,40})\b")


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted(RESULTS.glob("*.md"))]


def expand(ref: str) -> list[str]:
    """`a-{x,y}.{json,md}` -> the four names (nested braces are not used in these pages)."""
    parts = re.split(r"\{([^{}]*)\}", ref)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return ["".join(itertools.chain.from_iterable(zip(fixed, combo + ("",)))) for combo in
            itertools.product(*choices)]


def exists(base: Path, ref: str) -> bool:
    if "*" in ref:
        return any(base.glob(ref))
    return (base / ref).exists()


def references(page: Path) -> list[tuple[Path, str]]:
    """(base folder, reference) for every file reference on the page."""
    text = page.read_text(encoding="utf-8")
    refs: list[tuple[Path, str]] = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        refs.append((page.parent, target.split("#")[0]))
    for ref in ROOTED.findall(text):
        refs += [(REPO, r.rstrip(".")) for r in expand(ref)]
    if page.parent in (RESULTS, REPO / "benchmarks"):
        for ref in RESULT_NAME.findall(text):
            refs += [(RESULTS, r) for r in expand(ref)]
    return refs


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_reference_resolves(page: Path) -> None:
    refs = references(page)
    missing = sorted({f"{base.relative_to(REPO) if base != REPO else '.'}/{ref}" for base, ref in refs
                      if not exists(base, ref)})
    assert not missing, f"{page.relative_to(REPO)} names files that are not in the repo: {missing}"


def test_references_are_found() -> None:
    """The extraction sees each kind of reference (so an empty list above means resolved, not unread)."""
    bench = references(RESULTS / "bench.md")
    assert (RESULTS, "bench-llama-3-70b-fp16-cuda.json") in bench  # a link
    assert any(base == REPO and ref.startswith("qtool/kernels/") for base, ref in bench)  # a rooted path
    readme = references(REPO / "README.md")
    assert (REPO, "benchmarks/RESULTS.md") in readme
    assert expand("b-{x,y}.{json,md}") == ["b-x.json", "b-x.md", "b-y.json", "b-y.md"]


def test_unresolved_reference_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [run](gone.json), `benchmarks/no_such_script.py`, git show abc1234:benchmarks/x.txt\n")
    refs = references(page)
    assert (tmp_path, "gone.json") in refs and (REPO, "benchmarks/no_such_script.py") in refs
    assert not any(ref.endswith("x.txt") for _, ref in refs)  # a file in history, not in the tree
    assert not exists(tmp_path, "gone.json") and not exists(REPO, "benchmarks/no_such_script.py")


def test_results_folder_stays_small() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) < MAX_RESULT_FILES, f"benchmarks/results holds {len(files)} files (limit {MAX_RESULT_FILES - 1})"


def test_commits_named_by_bench_page_exist() -> None:
    """bench.md's "what was tried" list points to commits; they must be in this clone's history."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run([git, "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone lacks the history the page points to")
    shas = set(COMMIT.findall((RESULTS / "bench.md").read_text(encoding="utf-8")))
    shas |= set(re.findall(r"git show ([0-9a-f]{7,40}):", (RESULTS / "bench.md").read_text(encoding="utf-8")))
    assert len(shas) >= 10, shas
    missing = [s for s in sorted(shas) if subprocess.run([git, "cat-file", "-e", f"{s}^{{commit}}"], cwd=REPO,
                                                          capture_output=True).returncode != 0]
    assert not missing, f"bench.md names commits this clone does not have: {missing}"


def test_bench_script_reproduces_the_cited_runs() -> None:
    """benchmarks/bench_w4a16.py with its defaults runs the commands whose JSON bench.md cites: each output it
    names is in benchmarks/results, and each JSON's recorded settings are the command's."""
    import importlib.util
    import json

    from qtool.bench.shapes import parse_shapes

    spec = importlib.util.spec_from_file_location("bench_w4a16", REPO / "benchmarks" / "bench_w4a16.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parser().parse_args([])
    cmds = mod.commands(args.out, args.models, args.dtypes, args.batch_sizes, args.kernels)
    cited = {t for t in LINK.findall((RESULTS / "bench.md").read_text(encoding="utf-8")) if t.endswith(".json")}
    runs = set()
    for cmd in cmds:
        opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
        path = Path(opt["--json"])
        assert path.parent == RESULTS and path.exists(), path
        runs.add(path.name)
        settings = json.loads(path.read_text(encoding="utf-8"))["settings"]
        shapes = [{"name": s.name, "K": s.K, "N": s.N} for s in parse_shapes(opt["--shapes"], "cuda")]
        start = cmd.index("--batch-sizes") + 1
        sizes = [int(v) for v in itertools.takewhile(lambda v: not v.startswith("--"), cmd[start:])]
        assert settings["device"] == opt["--device"] and settings["dtype"] == opt["--dtype"]
        assert settings["kernels"] == opt["--kernels"].split(",") and settings["batch_sizes"] == sizes
        assert settings["graphs"] is True and "--graphs" in cmd
        assert settings["shapes"] == shapes
    assert {c for c in cited if c.startswith("bench-")} == runs
