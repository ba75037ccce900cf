"""`qtool bench` on the CPU: the documented JSON, oracle checks before timing, refusals, the roofline."""

from __future__ import annotations

import json

import pytest

from qtool.bench import roofline
from qtool.bench.shapes import parse_shapes
from qtool.errors import UsageError

FAST = ["--device", "cpu", "--shapes", "256x96,192x128", "--group-size", "64", "--batch-sizes", "1", "3",
        "--seconds", "0.02"]


class Result:
    def __init__(self, code, out, err):
        self.returncode, self.stdout, self.stderr = code, out, err


@pytest.fixture
def run_cli(bench_cli):
    """`qtool bench ARGS` (conftest's bench_cli) as a Result, which must exit 0 unless check=False."""
    def run(*args, check=True):
        r = Result(*bench_cli(*args))
        if check:
            assert r.returncode == 0, r.stderr[-2000:]
        return r

    return run


def test_seed_crossover_numbers():
    # seed 002: H100 SXM, P = 989.4 TFLOP/s, BW = 3.35 TB/s -> 76 at 4.125 bits, 74 at a flat 4 bits
    assert roofline.m_star(989.4e12, 3.35e12, roofline.b_eff(4, 128, 4096)) == pytest.approx(76.1, abs=0.1)
    assert roofline.m_star(989.4e12, 3.35e12, 4.0) == pytest.approx(73.8, abs=0.1)
    assert roofline.m_star(989.4e12, 3.35e12, 8.0) == pytest.approx(147.7, abs=0.1)  # W8A16 ~148
    assert roofline.b_eff(4, -1, 4096) == pytest.approx(4 + 16 / 4096)
    # memory asymptote 10 us, 1 us per row at the top -> the two meet at M = 10
    assert roofline.measured_m_star({1: 10.0, 16: 10.5, 256: 256.0}) == pytest.approx(10.0)
    assert roofline.measured_m_star({1: 10.0}) is None
    assert roofline.roofline_speedup(1, 8192, 8192, 4.125, 1e15, 4e12) == pytest.approx(16 / 4.125, rel=0.01)
    assert roofline.roofline_speedup(4096, 8192, 8192, 4.125, 1e15, 4e12) == pytest.approx(1.0)


def test_shapes_parse_models_and_lists():
    s70 = parse_shapes("llama-3-70b", "cuda")
    assert [(s.name, s.K, s.N) for s in s70][:2] == [("q_proj", 8192, 8192), ("k_proj", 8192, 1024)]
    assert ("down_proj", 28672, 8192) == (s70[-1].name, s70[-1].K, s70[-1].N)
    assert [(s.K, s.N) for s in parse_shapes("4096x14336, 14336x4096", "cuda")] == [(4096, 14336), (14336, 4096)]
    with pytest.raises(UsageError, match="unknown model or shape"):
        parse_shapes("llama-9", "cpu")


def test_cpu_bench_json_plot_and_checks(tmp_path, run_cli):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    run_cli(*FAST, "--json", str(out), "--plot", str(png), "-q")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads(out.read_text())
    assert d["schema"] == "qtool.bench/1"
    assert d["settings"]["batch_sizes"] == [1, 3] and d["settings"]["dtype"] == "fp16"
    dev = d["device"]
    assert dev["type"] == "cpu" and dev["copy_bandwidth_gbs"] > 0 and dev["matmul_peak_tflops"] > 0
    roof = d["roofline"]
    assert roof["b_eff"] == pytest.approx(4 + 16 / 64)
    assert roof["m_star_theory"] == pytest.approx(roof["peak_flops"] * roof["b_eff"] / (16 * roof["bandwidth"]))
    rows = d["results"]
    kernels = {r["kernel"] for r in rows}
    assert {"dense", "torch-ref", "torch-int4-cpu"} <= kernels
    assert "triton-w4a16" not in kernels  # unavailable on the CPU without the interpreter: not run by default
    assert d["kernels"]["triton-w4a16"]["status"] == "unavailable"
    assert len(rows) == 2 * 2 * len(kernels)  # shapes x M x kernels
    dense = {(r["shape"], r["M"]): r for r in rows if r["kernel"] == "dense"}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] <= 4 * r["baseline_rel_err"] + 1e-6
        assert r["median_us"] > 0 and r["gbs"] > 0 and r["tflops"] > 0
        flop = 2 * r["M"] * r["N"] * r["K"]
        assert r["tflops"] == pytest.approx(flop / (r["median_us"] * 1e-6) / 1e12, rel=1e-6)
        assert r["bw_fraction"] == pytest.approx(r["gbs"] / dev["copy_bandwidth_gbs"], rel=1e-6)
        assert r["speedup_vs_dense"] == pytest.approx(dense[(r["shape"], r["M"])]["median_us"] / r["median_us"],
                                                      rel=1e-6)
        if r["kernel"] == "dense":
            assert r["bytes"] == r["N"] * r["K"] * 2 + 2 * r["M"] * (r["K"] + r["N"])
        else:  # packed: qweight + qzeros + scales, activations in, output out
            g = r["K"] // 64
            assert r["bytes"] == r["K"] * r["N"] // 2 + g * r["N"] // 2 + g * r["N"] * 2 + 2 * r["M"] * (r["K"] + r["N"])
    per_m = d["summary"]["per_m"]
    for k in kernels:
        for m in ("1", "3"):
            e = per_m[k][m]
            ok = [r for r in rows if r["kernel"] == k and r["M"] == int(m)]
            assert e["total_us"] == pytest.approx(sum(r["median_us"] for r in ok))
            td = sum(dense[(r["shape"], r["M"])]["median_us"] for r in ok)
            assert e["total_speedup_vs_dense"] == pytest.approx(td / e["total_us"])
        assert d["summary"]["m_star_measured"][k] == pytest.approx(
            roofline.measured_m_star({m: per_m[k][str(m)]["total_us"] for m in (1, 3)}))


def test_requested_kernel_that_cannot_run_is_reported(run_cli):
    r = run_cli("--device", "cpu", "--shapes", "256x96", "--group-size", "64", "--batch-sizes", "2", "--seconds",
                "0.02", "--kernels", "triton-w4a16,torch-ref", "--json", "-")
    d = json.loads(r.stdout)
    refused = [x for x in d["results"] if x["kernel"] == "triton-w4a16"]
    assert refused and all(x["status"] == "refused" and "TRITON_INTERPRET" in x["reason"] for x in refused)
    assert all(x["status"] == "ok" for x in d["results"] if x["kernel"] == "torch-ref")


def test_bench_usage_errors(run_cli):
    r = run_cli("--device", "cpu", "--dtype", "fp32", check=False)
    assert r.returncode == 2 and "fp16 or bf16" in r.stderr
    r = run_cli("--device", "cpu", "--kernels", "nope", check=False)
    assert r.returncode == 2 and "unknown kernel" in r.stderr
    r = run_cli("--device", "cpu", "--shapes", "12y4", check=False)
    assert r.returncode == 2 and "unknown model or shape" in r.stderr


def test_memory_check_refuses_before_allocating(monkeypatch):
    import torch

    from qtool.bench import run

    cpu = torch.device("cpu")
    small = run.BenchSettings(device=cpu, shapes=parse_shapes(None, "cpu"), batch_sizes=[1, 16, 256])
    run.check_memory(small)  # the default CPU sweep fits any machine that runs the tests
    assert run.estimate_bytes(small, small.shapes[0], 256) < 64 << 20
    huge = run.BenchSettings(device=cpu, shapes=parse_shapes("65536x65536", "cpu"), batch_sizes=[1])
    need = run.estimate_bytes(huge, huge.shapes[0], 1)
    assert need > 65536 * 65536 * 32  # at least the float32 build and float64 oracle of the weight
    monkeypatch.setattr(run, "device_available_bytes", lambda dev: (need - 1, "test limit"))
    with pytest.raises(UsageError, match=r"--shapes 65536x65536 at --batch-sizes 1 needs about .* test limit"):
        run.check_memory(huge)
    monkeypatch.setattr(run, "device_available_bytes", lambda dev: (need, "test limit"))
    run.check_memory(huge)
    # run_bench itself refuses, before it builds anything
    monkeypatch.setattr(run, "device_available_bytes", lambda dev: (1 << 20, "test limit"))
    monkeypatch.setattr(run, "random_plain", lambda *a, **k: pytest.fail("built a layer"))
    with pytest.raises(UsageError, match="needs about"):
        run.run_bench(small)



def test_cpu_bench_fp8_layers(run_cli):
    """--bits 8 --format fp8: E4M3 layers; the FP8 kernels, asked for by name, are refused on the CPU with the
    reason; torch-ref runs them within its bound; bytes are the codes and scales."""
    for strategy, n_scales in (("tensor", lambda k, n: 1), ("block", lambda k, n: -(-k // 128) * -(-n // 128))):
        r = run_cli("--device", "cpu", "--bits", "8", "--format", "fp8", "--strategy", strategy, "--shapes",
                    "256x160", "--batch-sizes", "1", "4", "--seconds", "0.01", "--kernels",
                    "torch-ref,scaled-mm-fp8,scaled-mm-fp8-block", "--json", "-")
        d = json.loads(r.stdout)
        assert d["settings"]["format"] == "fp8" and d["settings"]["strategy"] == strategy
        assert d["roofline"]["b_eff"] == pytest.approx(8 + 16 / 256)
        ref = [x for x in d["results"] if x["kernel"] == "torch-ref"]
        assert len(ref) == 2 and all(x["status"] == "ok" for x in ref)
        for x in ref:
            assert x["rel_err"] <= 4 * x["baseline_rel_err"]
            assert x["bytes"] == 256 * 160 + 4 * n_scales(256, 160) + 2 * x["M"] * (256 + 160)
        for kid in ("scaled-mm-fp8", "scaled-mm-fp8-block"):
            rows = [x for x in d["results"] if x["kernel"] == kid]
            assert rows and all(x["status"] == "refused" and "runs on cuda, not cpu" in x["reason"] for x in rows)
    r = run_cli("--device", "cpu", "--bits", "4", "--format", "fp8", check=False)
    assert r.returncode == 2 and "--bits 8 --format fp8" in r.stderr
    r = run_cli("--device", "cpu", "--bits", "8", "--format", "fp8", "--strategy", "rows", check=False)
    assert r.returncode == 2 and "--strategy" in r.stderr


def test_bench_refuses_what_would_make_its_numbers_or_files_wrong(tmp_path, run_cli):
    """A shape or kernel named twice (the layer sums paired kernel rows with another shape's dense row, or
    counted a kernel twice), an existing file as a report (a model was replaced), and an anchor whose rows
    carry more fields than its header or whose ratio is not finite: usage errors before the sweep."""
    base = ("--device", "cpu", "--batch-sizes", "1", "--seconds", "0.01", "-q")
    for args, said in ((("--shapes", "256x128,256x128"), "names '256x128' twice"),
                       (("--shapes", "256x128", "--kernels", "torch-ref,torch-ref"), "names 'torch-ref' twice")):
        r = run_cli(*base, *args, check=False)
        assert r.returncode == 2 and said in r.stderr, r.stderr
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00xx")
    r = run_cli(*base, "--shapes", "256x128", "--kernels", "torch-ref", "--json", str(model), check=False)
    assert r.returncode == 2 and "the file exists" in r.stderr and model.read_bytes() == b"GGUF\x03\x00\x00\x00xx"
    head = "model,shape,K,N,M,fp16_us,marlin_orig_us\n"
    for body, said in (("m,s,256,128,1,2.0,1.0,extra\n", "beyond the header"),
                       ("m,s,256,128,1,1e308,1e-308\n", "positive and finite")):
        anchor = tmp_path / "a.csv"
        anchor.write_text(head + body)
        r = run_cli(*base, "--shapes", "256x128", "--anchor", str(anchor), check=False)
        assert r.returncode == 2 and said in r.stderr, r.stderr
    # two models name their layers alike: the names say whose, and every layer sum pairs its own dense rows
    r = run_cli(*base, "--shapes", "llama-3-8b@tp8,qwen2.5-7b@tp4", "--kernels", "torch-ref", "--json", "-",
                "--seconds", "0.002")
    d = json.loads(r.stdout)
    assert d["summary"]["per_m"]["dense"]["1"]["total_speedup_vs_dense"] == 1.0
    assert all(":" in x["shape"] for x in d["results"])
