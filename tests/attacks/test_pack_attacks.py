"""`qtool pack` on hostile dense checkpoints, each run as a separate process under the corpus's memory cap.

Cases (issue #27 and the pack items of #22): empty [0, N] / [N, 0] weights, a header claiming a 128 GiB
tensor backed by a sparse file, NaN/inf weights, and finite weights whose group scale overflows fp16.
Every refusal is exit 2 with exactly one `qtool: error:` line naming the file and the tensor; the destination
is not created (or, with --force over an earlier output holding a sentinel, left untouched), and no temporary
leftovers stay beside it;
never exit 3, never a traceback. An empty weight beside real ones is carried through dense, with a warning
naming it, since nothing of it can be quantized and nothing is lost by keeping it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.attacks.runner import Result, run_batch, run_qtool

SENTINEL = "SENTINEL.txt"
SENTINEL_TEXT = "an earlier output that must survive\n"
LINEAR = "model.layers.0.mlp.up_proj.weight"
HUGE = 1 << 18  # [2^18, 2^18] fp16 = 128 GiB


def _dense(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True)
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    return root


def _normal(o: int = 64, i: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(o, i, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def _sparse_huge(root: Path) -> Path:
    """A header claiming one [2^18, 2^18] fp16 linear weight (128 GiB); the file is that long but sparse."""
    root.mkdir(parents=True)
    nbytes = HUGE * HUGE * 2
    head = json.dumps({LINEAR: {"dtype": "F16", "shape": [HUGE, HUGE], "data_offsets": [0, nbytes]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + nbytes)
    return root


def _with(value: float, at: tuple[int, int]) -> torch.Tensor:
    w = _normal()
    w[at] = value
    return w


def _overflowing() -> torch.Tensor:
    w = _normal().to(torch.bfloat16)
    w[5, 40] = 2.0 ** 21  # finite in bf16; its g32 4-bit scale is beyond fp16's 65504
    return w


# name -> (builder of the source, words the one error line must hold besides the source path)
REFUSED = {
    "empty_rows": (lambda r: _dense(r, {LINEAR: torch.zeros(0, 64, dtype=torch.float16)}),
                   [LINEAR, "empty weight", "[0, 64]"]),
    "empty_cols": (lambda r: _dense(r, {LINEAR: torch.zeros(64, 0, dtype=torch.float16)}),
                   [LINEAR, "empty weight", "[64, 0]"]),
    "huge_sparse": (_sparse_huge, [LINEAR, "needs about 384.25 GiB", f"[{HUGE}, {HUGE}]"]),
    "nan_weight": (lambda r: _dense(r, {LINEAR: _with(float("nan"), (9, 33))}), [LINEAR, "holds nan at [9, 33]"]),
    "inf_weight": (lambda r: _dense(r, {LINEAR: _with(float("-inf"), (0, 63))}), [LINEAR, "holds -inf at [0, 63]"]),
    "fp16_scale_overflow": (lambda r: _dense(r, {LINEAR: _overflowing()}),
                            [LINEAR, "max |w| = 2.09715e+06", "row 5, group 1", "--dtype bf16"]),
}


def _problems(res: Result, src: Path, words: list[str], dest: Path, force: bool) -> list[str]:
    out = []
    lines = res.stderr.splitlines()
    if res.timed_out:
        return ["timed out"]
    if res.rc != 2:
        out.append(f"exit {res.rc}, expected 2")
    if len(lines) != 1 or not lines[0].startswith("qtool: error: ") or "internal error" in lines[0]:
        out.append(f"stderr is not one qtool error line: {res.stderr[:500]!r}")
    elif not all(w in lines[0] for w in [str(src), *words]):
        out.append(f"error does not name {[w for w in [str(src), *words] if w not in lines[0]]}: {lines[0]}")
    if force and (sorted(p.name for p in dest.iterdir()) != sorted([SENTINEL, "model.safetensors"])
                  or (dest / SENTINEL).read_text() != SENTINEL_TEXT):
        out.append("destination changed")
    if not force and dest.exists():
        out.append("destination created")
    if [p for p in dest.parent.iterdir() if ".qtool-tmp-" in p.name]:
        out.append("temporary leftovers beside the destination")
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[Result, Path, Path]]:
    root = tmp_path_factory.mktemp("pack-attacks")
    runs = []
    for name, (build, _) in REFUSED.items():
        for force in (False, True):
            src = build(root / f"{name}-{force}-src")
            dest = root / f"{name}-{force}-out"
            if force:  # an earlier output that --force may replace only with a complete new one
                dest.mkdir()
                (dest / SENTINEL).write_text(SENTINEL_TEXT)
                save_file({"x": torch.zeros(1)}, dest / "model.safetensors", metadata={"qtool.version": "0"})
            argv = ["pack", str(src), "-o", str(dest), "--group-size", "32"] + (["--force"] if force else [])
            runs.append((f"{name}-{force}", argv, src, dest))
    results = run_batch([argv for _, argv, _, _ in runs], cwd=root)
    return {key: (res, src, dest) for (key, _, src, dest), res in zip(runs, results, strict=True)}


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_pack_refuses_in_one_line(outcomes, name, force):
    res, src, dest = outcomes[f"{name}-{force}"]
    assert _problems(res, src, REFUSED[name][1], dest, force) == []


def test_huge_sparse_tensor_in_a_fresh_interpreter(tmp_path):
    """The 128 GiB claim through `python -m qtool` itself: refused before any allocation, within the cap."""
    src = _sparse_huge(tmp_path / "src")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / SENTINEL).write_text(SENTINEL_TEXT)
    save_file({"x": torch.zeros(1)}, dest / "model.safetensors", metadata={"qtool.version": "0"})
    res = run_qtool(["pack", str(src), "-o", str(dest), "--force"])
    assert _problems(res, src, REFUSED["huge_sparse"][1], dest, True) == []
    assert res.maxrss_mb < 1024


def test_empty_weight_beside_real_ones_is_kept_with_a_warning(tmp_path):
    src = _dense(tmp_path / "src", {LINEAR: torch.zeros(0, 64, dtype=torch.float16),
                                    "model.layers.0.mlp.down_proj.weight": _normal(),
                                    "model.layers.0.mlp.gate_proj.weight": torch.zeros(64, 0, dtype=torch.float16)})
    dest = tmp_path / "out"
    res, = run_batch([["pack", str(src), "-o", str(dest), "--group-size", "32", "-q"]], cwd=tmp_path)
    assert res.rc == 0, res.stderr
    warnings = res.stderr.splitlines()
    assert warnings == ["warning: model.layers.0.mlp.gate_proj.weight: empty weight [64, 0]: nothing to quantize; "
                        "kept as it is",
                        f"warning: {LINEAR}: empty weight [0, 64]: nothing to quantize; kept as it is"]
    from safetensors import safe_open

    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert f.get_tensor(LINEAR).shape == (0, 64)
        assert f.get_tensor("model.layers.0.mlp.gate_proj.weight").shape == (64, 0)
        assert "model.layers.0.mlp.down_proj.qweight" in f.keys()


def test_huge_dense_tensor_checked_against_free_disk(tmp_path):
    """An 8 TiB embedding (kept dense, so copied byte for byte) in a sparse file: refused before writing, with
    the bytes the output needs and the space free where it goes."""
    import shutil

    n = 1 << 21
    big = n * n * 2
    if shutil.disk_usage(tmp_path).free > big:
        pytest.skip("this filesystem has 8 TiB free: the claim would fit")
    src = tmp_path / "src"
    src.mkdir()
    head = json.dumps({"model.embed_tokens.weight": {"dtype": "F16", "shape": [n, n], "data_offsets": [0, big]},
                       LINEAR: {"dtype": "F16", "shape": [64, 64], "data_offsets": [big, big + 8192]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(src / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + big + 8192)
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / SENTINEL).write_text(SENTINEL_TEXT)
    save_file({"x": torch.zeros(1)}, dest / "model.safetensors", metadata={"qtool.version": "0"})
    res, = run_batch([["pack", str(src), "-o", str(dest), "--group-size", "32", "--force"]], cwd=tmp_path)
    assert _problems(res, dest, ["the output needs about 8192.00 GiB", "free"], dest, True) == []
