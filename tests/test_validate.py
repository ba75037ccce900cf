"""`qtool validate`: a clean pack passes (exit 0); one deliberately broken checkpoint per check is caught by the
right check (exit 1, naming the module); bad input is exit 2.

The checkpoint under test is a tiny Llama-shaped dense model packed by `qtool pack` (GPTQ v1, 4-bit, g32,
two shards), so the dense source is at hand for the reference check.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.errors import InputError, UsageError
from tests.conftest import fixture_path, write_llama

Q = "model.layers.0.self_attn.q_proj"


def cli(*args):
    """(result, exit status main() would give: the command's return value)."""
    res = CliRunner().invoke(app, [str(a) for a in args], standalone_mode=False)
    if res.exception is not None:
        raise res.exception
    return res, res.return_value or 0


def run_json(*args):
    res, code = cli("validate", *args, "--json")
    return json.loads(res.stdout), code


def fails(report: dict) -> list[tuple[str, str | None]]:
    return [(c["name"], c["module"]) for c in report["checks"] if c["status"] == "fail"]


def make_dense(d: Path, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": torch.randn(50, 128, generator=g).half(),
         "model.norm.weight": torch.ones(128).half()}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(64, 128, generator=g).half()
        t[p + "mlp.down_proj.weight"] = torch.randn(128, 64, generator=g).half()
    write_llama(d, t, "float16")
    return t


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("validate")
    make_dense(root / "dense")
    _, code = cli("pack", root / "dense", "-o", root / "q", "--to", "gptq", "--bits", "4", "--group-size", "32",
                  "--max-shard-size", "20KB", "-q")
    assert code == 0
    assert len(list((root / "q").glob("*.safetensors"))) == 2
    return root / "dense", root / "q"


@pytest.fixture
def copy(packed, tmp_path):
    def make(name: str = "broken") -> Path:
        d = tmp_path / name
        shutil.copytree(packed[1], d)
        return d
    return make


def shard_of(d: Path, tensor: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def edit_tensor(d: Path, tensor: str, fn) -> None:
    f = shard_of(d, tensor)
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    t = load_file(str(f))
    t[tensor] = fn(t[tensor].clone())
    save_file(t, str(f), metadata=meta)


def edit_config(d: Path, **changes) -> None:
    for name in ("config.json", "quantize_config.json"):
        c = json.loads((d / name).read_text())
        c.get("quantization_config", c).update(changes)
        (d / name).write_text(json.dumps(c))


# --- clean --------------------------------------------------------------------------------------------------

def test_clean_checkpoint_passes_every_check(packed, tmp_path):
    dense, q = packed
    rep, code = run_json(q, "--reference", dense, "--report", tmp_path / "ci", "--device", "cpu")
    assert code == 0, fails(rep)
    assert set(rep) >= {"path", "device", "checks", "summary", "hash"}
    assert rep["summary"]["status"] == "pass" and rep["device"] == "cpu"
    names = {c["name"] for c in rep["checks"] if c["status"] == "pass"}
    assert names == {"integrity", "roundtrip", "contract", "reference", "kernels", "hashes"}
    for c in rep["checks"]:
        assert set(c) == {"name", "module", "status", "detail", "numbers"} and c["status"] in ("pass", "skip")
    ran = {c["numbers"]["kernel"] for c in rep["checks"] if c["name"] == "kernels" and c["status"] == "pass"}
    assert {"torch-ref", "torch-int4-cpu"} <= ran  # the CPU kernels run; the CUDA ones are skipped with a reason
    ref = [c for c in rep["checks"] if c["name"] == "reference" and c["module"] == Q][0]["numbers"]
    assert 0 < ref["rel_err"] < ref["rel_bound"] and ref["max_step"] < 0.52  # round to nearest (fp16 scales: a hair over 0.5)
    assert len(rep["hash"]["model"]) == 64 and len(rep["hash"]["tensors"]) == rep["summary"]["tensors"]
    on_disk = json.loads((tmp_path / "ci" / "report.json").read_text())
    assert on_disk["hash"] == rep["hash"] and on_disk["summary"]["status"] == "pass"
    assert (tmp_path / "ci" / "report.md").read_text().startswith("# qtool validate: PASS")


def test_table_output_and_exit_code(packed):
    res, code = cli("validate", packed[1], "--checks", "integrity,hashes")
    assert code == 0 and "PASS" in res.stdout and "integrity" in res.stdout


# --- one broken checkpoint per check ------------------------------------------------------------------------

def test_nan_scale_fails_integrity(copy):
    d = copy()
    edit_tensor(d, f"{Q}.scales", lambda s: s.index_put_((torch.tensor([0]), torch.tensor([1])),
                                                        torch.tensor(float("nan"), dtype=s.dtype)))
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and ("integrity", Q) in fails(rep)
    assert "NaN" in next(c["detail"] for c in rep["checks"] if c["module"] == Q and c["status"] == "fail")


def test_truncated_shard_fails_integrity(copy):
    d = copy()
    f = d / "model-00001-of-00002.safetensors"
    os.truncate(f, f.stat().st_size - 64)
    rep, code = run_json(d, "--checks", "integrity,hashes")
    assert code == 1
    assert any(n == "integrity" and m is None for n, m in fails(rep))  # the file: "truncated: X of Y bytes"
    assert any(n == "integrity" and m is not None for n, m in fails(rep))  # and the module it cut
    assert ("hashes", None) in fails(rep) and rep["hash"]["model"] is None  # no hash of a partial model
    # cut into the header: the shard's tensors are gone, and neither integrity nor hashes pass
    os.truncate(f, 64)
    rep, code = run_json(d, "--checks", "integrity,hashes")
    assert code == 1 and ("hashes", None) in fails(rep)
    assert any("unreadable header" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_wrong_g_idx_fails_integrity(copy):
    d = copy()
    edit_tensor(d, f"{Q}.g_idx", lambda g: torch.where(torch.arange(g.numel()) == 0, torch.tensor(7, dtype=g.dtype), g))
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and fails(rep) == [("integrity", Q)]


def test_mislabelled_v2_config_fails_integrity(copy):
    d = copy()
    edit_config(d, checkpoint_format="gptq_v2")
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and ("integrity", Q) in fails(rep)
    assert any("it is v1" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_bits_disagreeing_with_tensors_fail(copy):
    d = copy()
    edit_config(d, bits=8)
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and any("8-bit" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_configs_that_disagree_fail_integrity(copy):
    d = copy()
    c = json.loads((d / "quantize_config.json").read_text())
    c["desc_act"] = True
    (d / "quantize_config.json").write_text(json.dumps(c))
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and any("quantize_config.json says True" in c["detail"] for c in rep["checks"]
                             if c["status"] == "fail")


def test_orphaned_shard_fails_integrity(copy):
    d = copy()
    shutil.copy(d / "model-00001-of-00002.safetensors", d / "model-00003-of-00003.safetensors")
    rep, code = run_json(d, "--checks", "integrity")
    assert code == 1 and any("orphaned" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_flipped_qweight_bit_fails_reference_and_hashes(packed, copy):
    dense, clean = packed
    d = copy()
    # the top bit of one word: the code of the 8th input row in that column moves by 8 steps
    edit_tensor(d, f"{Q}.qweight", lambda q: q.view(-1).index_put_((torch.tensor([5]),), q.view(-1)[5] ^ (-2**31))
                .view(q.shape))
    rep, code = run_json(d, "--checks", "reference,hashes", "--reference", dense, "--against", clean)
    assert code == 1
    assert ("reference", Q) in fails(rep) and ("hashes", f"{Q}.qweight") in fails(rep)
    assert len(fails(rep)) == 2  # nothing else differs
    clean_rep, _ = run_json(clean, "--checks", "hashes")
    assert rep["hash"]["model"] != clean_rep["hash"]["model"]


def test_swapped_scales_fail_reference(packed, copy):
    d = copy()
    edit_tensor(d, f"{Q}.scales", lambda s: s.flip(1))
    rep, code = run_json(d, "--checks", "reference", "--reference", packed[0])
    assert code == 1 and fails(rep) == [("reference", Q)]


def test_wrong_kernel_fails_kernels(packed, monkeypatch):
    from qtool.kernels.torch_ref import TorchRef

    real = TorchRef.forward
    monkeypatch.setattr(TorchRef, "forward", lambda self, x, state, out=None: real(self, x, state, out) * 1.01)
    rep, code = run_json(packed[1], "--checks", "kernels", "--kernels", "torch-ref")
    assert code == 1
    bad = [c for c in rep["checks"] if c["status"] == "fail"]
    assert bad and all(c["numbers"]["kernel"] == "torch-ref" and "baseline" in c["detail"] for c in bad)


def test_kernel_keeping_a_dense_weight_fails_kernels(packed, monkeypatch):
    from qtool.kernels.base import dequantize_packed
    from qtool.kernels.torch_ref import TorchRef

    def caching(self, x, state, out=None):
        w = state.meta.setdefault("dense", dequantize_packed(state, x.dtype))
        return x @ w

    monkeypatch.setattr(TorchRef, "forward", caching)
    rep, code = run_json(packed[1], "--checks", "kernels", "--kernels", "torch-ref")
    assert code == 1
    assert all("dense copy" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_non_repeatable_kernel_fails(packed, monkeypatch):
    from qtool.kernels.torch_ref import TorchRef

    real = TorchRef.forward
    calls = []

    def drifting(self, x, state, out=None):
        calls.append(1)
        y = real(self, x, state, out)
        return y if len(calls) % 2 else torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(TorchRef, "forward", drifting)
    rep, code = run_json(packed[1], "--checks", "kernels", "--kernels", "torch-ref", "--batch-sizes", "3")
    assert code == 1 and all("second forward" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_round_trip_catches_bytes_the_packer_would_not_write(copy):
    # g_idx widened to int64 decodes to the same groups, but the layout (and the engines' int32 parameter)
    # says int32: only the round trip, which compares bytes and dtypes, sees it
    d = copy()
    edit_tensor(d, f"{Q}.g_idx", lambda g: g.to(torch.int64))
    rep, code = run_json(d, "--checks", "integrity,roundtrip")
    assert code == 1 and fails(rep) == [("roundtrip", Q)]
    assert "g_idx (torch.int64" in next(c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_contract_fails_without_a_quantization_config(copy):
    d = copy()
    (d / "quantize_config.json").unlink()
    c = json.loads((d / "config.json").read_text())
    del c["quantization_config"]
    (d / "config.json").write_text(json.dumps(c))
    rep, code = run_json(d, "--checks", "contract")
    assert code == 1 and any("no quantization config" in x["detail"] for x in rep["checks"] if x["status"] == "fail")


def test_contract_fails_where_no_kernel_takes_a_layer(packed):
    rep, code = run_json(packed[1], "--checks", "contract", "--engine", "vllm", "--target", "mps")
    assert code == 1 and any("no kernel takes" in c["detail"] for c in rep["checks"] if c["status"] == "fail")


def test_contract_without_engine_plans_with_the_engine_that_reads_the_format():
    """No --engine: a compressed-tensors file is planned with vLLM (GPTQModel declares no kernel for it) and
    passes, saying so; named explicitly, GPTQModel fails it with its own reason; a GGUF file is llama.cpp's,
    whose kernels are not declared, so kernel planning is skipped with that reason."""
    ct = fixture_path("compressed-tensors-w4a16-g128")
    rep, code = run_json(ct, "--checks", "contract")
    assert code == 0, fails(rep)
    details = [c["detail"] for c in rep["checks"]]
    assert any("planned with vllm, since gptqmodel reads none" in d for d in details)
    assert any(d.startswith("vllm on cpu: select picks") for d in details)
    rep, code = run_json(ct, "--checks", "contract", "--engine", "gptqmodel")
    assert code == 1 and all("no gptqmodel kernel declares format ct" in c["detail"]
                             for c in rep["checks"] if c["status"] == "fail")
    rep, code = run_json(fixture_path("gguf-q4_0-q4_1-q8_0/gguf-q4_0-q4_1-q8_0.gguf"), "--checks", "contract")
    assert any(c["status"] == "skip" and "llama.cpp" in c["detail"] for c in rep["checks"])


# --- hashes ---------------------------------------------------------------------------------------------------

def test_model_hash_is_the_same_for_any_shard_layout(tmp_path):
    t = make_dense(tmp_path / "one")
    two = tmp_path / "two"
    two.mkdir()
    names = sorted(t)
    a, b = names[: len(names) // 2], names[len(names) // 2:]
    save_file({n: t[n] for n in b}, two / "model-00001-of-00002.safetensors")
    save_file({n: t[n] for n in a}, two / "model-00002-of-00002.safetensors")
    wm = {**{n: "model-00001-of-00002.safetensors" for n in b}, **{n: "model-00002-of-00002.safetensors" for n in a}}
    (two / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    r1, c1 = run_json(tmp_path / "one", "--checks", "hashes")
    r2, c2 = run_json(two, "--checks", "hashes", "--against", tmp_path / "one")
    assert c1 == c2 == 0 and r1["hash"] == r2["hash"]


def test_tensor_hashes_survive_buffer_reuse(tmp_path, monkeypatch):
    """Read buffers are reused once their tensor is checked and hashed: every tensor's digest must still be
    the digest of its own bytes. With no hash backlog allowed, the second layer's tensors reuse the first's
    buffers."""
    from qtool.validate import core
    from qtool.validate.hashing import Hasher

    recycled = []
    take = core._Buffers.take

    def counting_take(self, nbytes):
        before = len(self.free)
        buf = take(self, nbytes)
        recycled.append(len(self.free) < before)
        return buf

    monkeypatch.setattr(core, "PENDING_BYTES", 0)
    monkeypatch.setattr(core._Buffers, "take", counting_take)
    make_dense(tmp_path / "m")
    rep = core.validate_path(tmp_path / "m", core.ValidateOptions(checks=("integrity", "hashes")))
    assert any(recycled)
    h = Hasher(workers=1)
    want = {}
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        for n in f.keys():
            t = f.get_tensor(n)
            dtype = {torch.float16: "F16"}[t.dtype]
            want[n] = h.tensor(dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
    h.close()
    assert rep.tensor_hashes == want
    assert len(set(want.values())) == len(want)


# --- GGUF and bad input ---------------------------------------------------------------------------------------

def test_gguf_integrity_round_trip_and_hashes():
    rep, code = run_json(fixture_path("gguf-q4_0-q4_1-q8_0/gguf-q4_0-q4_1-q8_0.gguf"),
                         "--checks", "integrity,roundtrip,hashes")
    assert code == 0, fails(rep)
    rt = [c for c in rep["checks"] if c["name"] == "roundtrip"]
    assert any(c["status"] == "pass" for c in rt)
    # llama.cpp's Q4_1 offsets are free floats: no integer-zero Plain, so the round trip says why it skips
    assert all("Q4_1" in c["detail"] or "q4_1" in c["detail"] for c in rt if c["status"] == "skip")


def test_bad_input_is_exit_2(tmp_path, packed):
    with pytest.raises(InputError):
        cli("validate", tmp_path / "missing")
    with pytest.raises(UsageError):
        cli("validate", packed[1], "--checks", "integrity,speling")
    with pytest.raises(InputError, match="--reference"):
        cli("validate", packed[1], "--reference", tmp_path / "nowhere")
    (tmp_path / "m.bin").write_bytes(b"\x80\x02")
    with pytest.raises(InputError):
        cli("validate", tmp_path / "m.bin")


@pytest.mark.parametrize("device", ["bogus", "h100", "cuda:7" if torch.cuda.is_available() else "cuda:0"])
def test_a_device_that_is_not_there_is_exit_2_whatever_the_checks(packed, device):
    """Not a failed contract row (exit 1), and not ignored by checks that run no kernel (exit 0)."""
    for checks in ("integrity,contract", "integrity,hashes"):
        with pytest.raises(UsageError, match=f"--device {device}"):
            cli("validate", packed[1], "--checks", checks, "--device", device)


def test_against_compares_content_without_hashes_in_checks(packed, copy):
    same = copy("same")
    rep, code = run_json(packed[1], "--checks", "integrity", "--against", same)
    assert code == 0 and not fails(rep), fails(rep)
    assert any(c["name"] == "hashes" and "every tensor equals" in c["detail"] for c in rep["checks"])
    other = copy("other")
    edit_tensor(other, f"{Q}.scales", lambda s: s * 2)
    rep, code = run_json(packed[1], "--checks", "integrity", "--against", other)
    assert code == 1 and fails(rep) == [("hashes", f"{Q}.scales")]


def test_report_folder_is_checked_before_the_run_and_never_replaces_a_report(packed, tmp_path, monkeypatch):
    import qtool.validate

    ran = []
    real = qtool.validate.validate_path
    monkeypatch.setattr(qtool.validate, "validate_path", lambda *a, **k: ran.append(1) or real(*a, **k))
    ci = tmp_path / "ci"
    _, code = cli("validate", packed[1], "--checks", "integrity", "--report", ci, "-q")
    assert code == 0 and sorted(p.name for p in ci.iterdir()) == ["report.json", "report.md"]
    before = {p.name: p.read_bytes() for p in ci.iterdir()}
    with pytest.raises(UsageError, match="report.json: the file exists, and a report does not replace one"):
        cli("validate", packed[1], "--checks", "contract", "--report", ci)
    assert {p.name: p.read_bytes() for p in ci.iterdir()} == before
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "report.md").write_text("old")
    with pytest.raises(UsageError, match="report.md: the file exists, and a report does not replace one"):
        cli("validate", packed[1], "--checks", "integrity", "--report", stale)
    assert [p.name for p in stale.iterdir()] == ["report.md"] and (stale / "report.md").read_text() == "old"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        cli("validate", packed[1], "--checks", "integrity", "--report", tmp_path / "afile" / "sub")
    assert len(ran) == 1  # only the first run validated anything


def test_report_is_both_files_or_neither(packed, tmp_path, monkeypatch):
    import qtool.bench.report as bench_report
    from qtool.errors import OutputError

    real = bench_report.write_report

    def fail_md(flag, path, fill, replace=True):
        if path.name == "report.md":
            raise OutputError("disk full", path=path)
        real(flag, path, fill, replace)

    monkeypatch.setattr(bench_report, "write_report", fail_md)
    with pytest.raises(OutputError):
        cli("validate", packed[1], "--checks", "integrity", "--report", tmp_path / "ci", "-q")
    assert list((tmp_path / "ci").iterdir()) == []


def test_kernel_check_memory_is_refused_before_any_module_is_read(packed, monkeypatch):
    import qtool.kernels.devices as devices
    import qtool.validate.core as core

    monkeypatch.setattr(devices, "device_available_bytes", lambda dev: (1 << 20, "free (test)"))
    monkeypatch.setattr(core._Run, "_module", lambda self, m: pytest.fail(f"module {m.name} was read"))
    with pytest.raises(UsageError, match=r"--batch-sizes 4096 needs about .* more than the 1\.0 MiB free \(test\)"):
        cli("validate", packed[1], "--checks", "kernels", "--device", "cpu", "--batch-sizes", "4096")


# --- GPU (skipped without CUDA; the coordinator runs these on the H200) ---------------------------------------

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@NEEDS_CUDA
def test_kernels_check_runs_the_gpu_kernels(packed):
    rep, code = run_json(packed[1], "--checks", "kernels", "--device", "cuda", "--batch-sizes", "1",
                         "--batch-sizes", "16", "--batch-sizes", "256")
    assert code == 0, fails(rep)
    assert rep["device"].startswith("cuda")
    ran = {c["numbers"]["kernel"] for c in rep["checks"] if c["status"] == "pass"}
    assert {"torch-ref", "triton-w4a16"} <= ran, rep["checks"]
    skipped = {c["numbers"].get("kernel"): c["detail"] for c in rep["checks"] if c["status"] == "skip"}
    assert "torch-int4-cpu" in skipped  # a CPU kernel, said so, not silently left out
    assert "cuda-w4a16" in ran or "cuda-w4a16" in skipped


@pytest.mark.gpu
@NEEDS_CUDA
def test_wrong_gpu_kernel_fails(packed, monkeypatch):
    from qtool.kernels.triton import TritonW4A16

    real = TritonW4A16.forward
    monkeypatch.setattr(TritonW4A16, "forward", lambda self, x, state, out=None: real(self, x, state, out) * 1.01)
    rep, code = run_json(packed[1], "--checks", "kernels", "--device", "cuda", "--kernels", "triton-w4a16")
    assert code == 1 and all(c["numbers"]["kernel"] == "triton-w4a16" for c in rep["checks"] if c["status"] == "fail")


def test_job_spec_keys_are_the_flags(packed, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("checks: [integrity, hashes]\nbatch-sizes: [1, 3]\n")
    rep, code = run_json(packed[1], "--config", spec)
    assert code == 0 and {c["name"] for c in rep["checks"]} == {"integrity", "hashes"}


def test_kernel_with_no_batch_size_run_does_not_pass():
    """Nothing compared is not a pass (and no NaN 'worst error' reaches the report)."""
    from qtool.validate import kernelcheck
    from tests.test_formats_gptq import random_plain

    plain = random_plain(0, 4, 64, 128, 32, True, False)
    run, _ = kernelcheck.eligible(plain, torch.device("cpu"), ("torch-ref",))
    kernel, layer = run[0]
    status, detail, _ = kernelcheck.run_kernel(kernel, layer, plain, torch.device("cpu"), ())
    assert status == "fail" and "no batch size ran" in detail
    status, detail, numbers = kernelcheck.run_kernel(kernel, layer, plain, torch.device("cpu"), (1, 3))
    assert status == "pass" and numbers["worst_err"] <= numbers["worst_bound"], detail


# --- the reference check checks, or says why not ---------------------------------------------------------------

def test_reference_with_holes_or_changed_copies_fails(packed, tmp_path):
    dense, q = packed
    rep, code = run_json(q, "--checks", "reference", "--reference", dense)
    assert code == 0, fails(rep)
    passed = {(c["module"], c["detail"]) for c in rep["checks"] if c["status"] == "pass"}
    assert {(None, "1 tensor outside the linear modules, equal to the reference's"),
            ("model.embed_tokens.weight", "identical")} <= passed
    # a reference without a module's weight: a failure naming it, never a pass that compared nothing
    holed = tmp_path / "holed"
    t = make_dense(holed)
    del t[f"{Q}.weight"]
    t["model.embed_tokens.weight"][0, 0] += 1  # and an embedding that is not the one the pack copied
    write_llama(holed, t, "float16")
    rep, code = run_json(q, "--checks", "reference", "--reference", holed)
    assert code == 1 and set(fails(rep)) == {("reference", Q), ("reference", "model.embed_tokens.weight")}
    # a quantized checkpoint is no reference
    rep, code = run_json(q, "--checks", "reference", "--reference", q)
    assert code == 1 and len(fails(rep)) == 4


@pytest.mark.parametrize("args", [["--checks", "reference"], ["--engine", "bogus"], ["--target", "bogus"],
                                  ["--kernels", "bogus"], ["--device", "bogus"], ["--device", "mps"]])
def test_mistyped_names_are_usage_errors(packed, args):
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError) as e:
        cli("validate", packed[1], *args)
    assert e.value.exit_code == 2, e.value


def test_asymmetric_zeros_under_a_sym_config_fail(packed, copy):
    """Engines that trust sym: true drop the zero points, those that read them do not: the file is wrong
    whichever checks run (the integrity check's no-decode shortcut included)."""
    d = copy()
    assert json.loads((d / "config.json").read_text())["quantization_config"]["sym"] is True

    def flip(z):
        z[0, 0] ^= 0x1
        return z
    edit_tensor(d, f"{Q}.qzeros", flip)
    for checks in ("integrity", "integrity,contract", "integrity,roundtrip,reference"):
        rep, code = run_json(d, "--checks", checks, *(["--reference", packed[0]] if "reference" in checks else []))
        assert code == 1 and ("integrity", Q) in fails(rep), (checks, fails(rep))
        detail = next(c["detail"] for c in rep["checks"] if c["status"] == "fail" and c["module"] == Q)
        assert detail.count("config says sym but the zero points vary") == 1, detail


def test_contract_skips_a_checkpoint_that_quantizes_only_expert_stacks():
    """gpt-oss quantizes its MoE experts only, as [E, O, I] stacks the engines run through their MoE methods: no
    linear layer to plan is a skip that says why, not a failure of a file vLLM loads."""
    rep, code = run_json(fixture_path("fp4/gptoss-mxfp4"), "--checks", "contract", "--device", "cpu")
    rows = [c for c in rep["checks"] if "no linear layer to plan" in c["detail"]]
    # the contract alone then checks nothing: not a pass (exit 4), and not a failure of the file either
    assert code == 4 and rep["summary"]["status"] == "skip", rep["summary"]
    assert not fails(rep) and [r["status"] for r in rows] == ["skip"], rep["checks"]
    assert "mixture-of-experts stack(s) not planned" in rows[0]["detail"]


def test_a_report_file_that_appears_during_the_run_is_not_replaced(packed, tmp_path, monkeypatch):
    import qtool.validate
    from qtool.errors import OutputError

    ci = tmp_path / "ci"
    real = qtool.validate.validate_path

    def run_then_race(*a, **k):
        out = real(*a, **k)
        ci.mkdir()
        (ci / "report.md").write_text("theirs")
        return out

    monkeypatch.setattr(qtool.validate, "validate_path", run_then_race)
    with pytest.raises(OutputError, match="report's file appeared during the run"):
        cli("validate", packed[1], "--checks", "integrity", "--report", ci, "-q")
    assert [p.name for p in ci.iterdir()] == ["report.md"] and (ci / "report.md").read_text() == "theirs"


# --- nothing checked is no pass ----------------------------------------------------------------------------------

def validate_main(capsys, *args) -> tuple[int, str, str]:
    """(process exit status, stdout, stderr) of `qtool validate ARGS` through main(), as a CI job sees them."""
    from qtool.cli.main import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["validate", *(str(a) for a in args)])
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def test_every_check_skipped_is_exit_4_not_a_pass(packed, tmp_path, capsys):
    """A dense model has nothing the round trip or the kernels can read: every row is a skip. That proves
    nothing, so it is neither a pass (0) nor a failed check (1) but exit 4, with status "skip" and one line on
    stderr saying why and what to add, under --json, on the terminal and in report.md alike."""
    dense = packed[0]
    code, out, err = validate_main(capsys, dense, "--checks", "roundtrip,kernels", "--device", "cpu", "--json",
                                   "--report", tmp_path / "ci")
    rep = json.loads(out)
    assert code == 4, (code, err)
    assert rep["summary"]["status"] == "skip" and rep["summary"]["counts"]["pass"] == 0
    assert rep["summary"]["counts"]["fail"] == 0 and rep["summary"]["counts"]["skip"] > 0
    assert err.count("\n") == 1 and err.startswith("qtool: nothing was checked: every selected check was skipped ("), err
    assert "roundtrip: dense module: nothing quantized" in err and "kernels: dense module: nothing quantized" in err
    assert "fix: add integrity or hashes to --checks" in err
    md = (tmp_path / "ci" / "report.md").read_text()
    assert md.startswith("# qtool validate: SKIP") and "nothing was checked" in md
    assert json.loads((tmp_path / "ci" / "report.json").read_text())["summary"]["status"] == "skip"
    code, out, err = validate_main(capsys, dense, "--checks", "roundtrip,kernels", "--device", "cpu")
    assert code == 4 and "SKIP: 0 passed, 0 failed" in out and "nothing was checked" in err
    code, out, err = validate_main(capsys, dense, "--checks", "roundtrip,kernels", "--device", "cpu", "-q")
    assert code == 4 and out == "" and err.startswith("qtool: nothing was checked")


def test_one_pass_among_skips_is_still_a_pass(packed, capsys):
    """The same skips beside one check that ran (integrity over every tensor) pass, exit 0, and say nothing on
    stderr."""
    code, out, err = validate_main(capsys, packed[0], "--checks", "integrity,roundtrip,kernels", "--device", "cpu",
                                   "--json")
    rep = json.loads(out)
    assert code == 0 and rep["summary"]["status"] == "pass", rep["summary"]
    assert rep["summary"]["checks"]["integrity"]["pass"] > 0 and rep["summary"]["checks"]["kernels"]["pass"] == 0
    assert rep["summary"]["counts"]["skip"] > 0 and err == ""


def test_verdict_needs_a_pass_and_no_failure():
    from qtool.report.validate import NO_REFERENCE, CheckResult, ValidateReport

    def report(*statuses):
        return ValidateReport(path="m", device="cpu", selected=("reference",),
                              checks=[CheckResult("reference", None, s, NO_REFERENCE) for s in statuses])

    assert report().status == "skip" and report("skip", "skip").status == "skip"
    assert report("skip", "pass").status == "pass" and report("pass", "fail", "skip").status == "fail"
    assert report("pass").nothing_checked() is None and report("fail").nothing_checked() is None
    said = report("skip").nothing_checked()
    assert said.startswith(f"nothing was checked: every selected check was skipped (reference: {NO_REFERENCE})")
    assert "fix: give --reference DENSE, or add integrity or hashes to --checks" in said
