"""`qtool bench` over the curve: the default M sweep, the model shapes (Qwen, MoE experts, tensor-parallel
shards), `--anchor` (the reference kernel's ratios) and the flags below dense or below the anchor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from qtool.bench.anchor import apply_anchor, load_anchor
from qtool.bench.run import DENSE, BenchReport, BenchSettings, Row, summarize
from qtool.bench.shapes import CPU_BATCH_SIZES, GPU_BATCH_SIZES, Shape, parse_shapes
from qtool.errors import InputError, UsageError

REPO = Path(__file__).resolve().parents[1]
MARLIN = REPO / "benchmarks" / "anchors" / "marlin-orig-h200.csv"
MARLIN_H100 = REPO / "benchmarks" / "anchors" / "marlin-orig-h100.csv"
FAST = ["--device", "cpu", "--shapes", "256x96,192x128", "--group-size", "64", "--batch-sizes", "1", "3",
        "--seconds", "0.02", "--kernels", "torch-ref"]


def kn(spec: str) -> list[tuple[str, int, int]]:
    return [(s.name, s.K, s.N) for s in parse_shapes(spec, "cuda")]


def test_default_sweep_is_the_issue_curve():
    assert GPU_BATCH_SIZES == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert CPU_BATCH_SIZES == (1, 16, 256)


def test_model_shapes_qwen_moe_and_tp_shards():
    # Qwen2.5: hidden 3584 / 5120, MLP 18944 / 27648, GQA (4 / 8 KV heads of 128)
    assert kn("qwen2.5-7b") == [("q_proj", 3584, 3584), ("k_proj", 3584, 512), ("v_proj", 3584, 512),
                                ("o_proj", 3584, 3584), ("gate_proj", 3584, 18944), ("up_proj", 3584, 18944),
                                ("down_proj", 18944, 3584)]
    assert kn("qwen2.5-32b") == [("q_proj", 5120, 5120), ("k_proj", 5120, 1024), ("v_proj", 5120, 1024),
                                 ("o_proj", 5120, 5120), ("gate_proj", 5120, 27648), ("up_proj", 5120, 27648),
                                 ("down_proj", 27648, 5120)]
    # one routed expert of Qwen3-30B-A3B: the small-N layers that dominate MoE decoding
    assert kn("qwen3-30b-a3b-expert") == [("gate_proj", 2048, 768), ("up_proj", 2048, 768),
                                          ("down_proj", 768, 2048)]
    # tensor-parallel shards: column layers split N, row layers split K
    assert kn("llama-3-70b@tp2") == [("q_proj/tp2", 8192, 4096), ("k_proj/tp2", 8192, 512),
                                     ("v_proj/tp2", 8192, 512), ("o_proj/tp2", 4096, 8192),
                                     ("gate_proj/tp2", 8192, 14336), ("up_proj/tp2", 8192, 14336),
                                     ("down_proj/tp2", 14336, 8192)]
    tp4 = kn("llama-3-70b@tp4")
    assert tp4[1] == ("k_proj/tp4", 8192, 256) and tp4[3] == ("o_proj/tp4", 2048, 8192)
    assert tp4[-1] == ("down_proj/tp4", 7168, 8192)
    assert kn("llama-3-8b@tp1") == kn("llama-3-8b")
    with pytest.raises(UsageError, match="does not split 3 ways"):
        parse_shapes("llama-3-70b@tp3", "cuda")
    with pytest.raises(UsageError, match="out of range"):
        parse_shapes("llama-3-70b@tp0", "cuda")
    with pytest.raises(UsageError, match="unknown model or shape"):
        parse_shapes("llama-9@tp2", "cuda")


def test_fused_layers_are_the_gemms_a_serving_engine_launches():
    """MODEL+fused: q/k/v as one qkv_proj and gate/up as one gate_up_proj (configs/models.yaml `fused`, vLLM's
    QKVParallelLinear and MergedColumnParallelLinear), in the first part's place; under tensor parallelism each part
    is sharded first, as the engine shards it."""
    assert kn("llama-3-8b+fused") == [("qkv_proj", 4096, 4096 + 1024 + 1024), ("o_proj", 4096, 4096),
                                      ("gate_up_proj", 4096, 2 * 14336), ("down_proj", 14336, 4096)]
    assert kn("llama-3-70b@tp2+fused") == [("qkv_proj/tp2", 8192, 4096 + 512 + 512), ("o_proj/tp2", 4096, 8192),
                                           ("gate_up_proj/tp2", 8192, 2 * 14336), ("down_proj/tp2", 14336, 8192)]
    assert kn("qwen3-30b-a3b-expert+fused") == [("gate_up_proj", 2048, 1536), ("down_proj", 768, 2048)]
    assert kn("minilm-l6+fused")[0] == ("qkv_proj", 384, 3 * 384)
    # the same weights in fewer GEMMs, for every model and shard
    for spec in ("llama-3-70b", "qwen2.5-7b", "qwen2.5-32b", "llama-3-70b@tp4", "mistral-7b@tp8"):
        assert sum(k * n for _, k, n in kn(spec + "+fused")) == sum(k * n for _, k, n in kn(spec))
        assert len(kn(spec + "+fused")) == len(kn(spec)) - 3
    # a part that does not split: the part is named, not the fused layer
    with pytest.raises(UsageError, match=r"q_proj \(8192x8192\) does not split 3 ways"):
        parse_shapes("llama-3-70b@tp3+fused", "cuda")
    with pytest.raises(UsageError, match="MODEL\\+fused"):
        parse_shapes("llama-3-8b+fuse", "cuda")


def test_tp_shards_split_attention_by_whole_heads():
    """vLLM's QKVParallelLinear: q heads / tp each rank; where there are fewer key/value heads than ranks, each rank
    holds one whole copied head; a degree that splits a head is refused, naming the heads."""
    tp16 = dict((name, (k, n)) for name, k, n in kn("llama-3-70b@tp16"))  # 64 q heads, 8 kv heads of 128
    assert tp16["q_proj/tp16"] == (8192, 512) and tp16["k_proj/tp16"] == tp16["v_proj/tp16"] == (8192, 128)
    assert tp16["o_proj/tp16"] == (512, 8192) and tp16["down_proj/tp16"] == (1792, 8192)
    assert kn("llama-3-70b@tp16+fused")[0] == ("qkv_proj/tp16", 8192, (4 + 1 + 1) * 128)
    assert dict((name, n) for name, _, n in kn("qwen2.5-7b@tp4"))["k_proj/tp4"] == 128  # 4 kv heads, one a rank
    with pytest.raises(UsageError, match="TP 8 does not divide the 28 attention heads"):
        parse_shapes("qwen2.5-7b@tp8", "cuda")
    with pytest.raises(UsageError, match=r"k_proj \(3584x512\) does not split 7 ways: TP 7 does not divide the 4 "
                                         r"key/value heads \(nor is it a multiple of them\)"):
        parse_shapes("qwen2.5-7b@tp7", "cuda")  # 28 q heads split 7 ways, 4 kv heads neither split nor copy


def test_fused_needs_layers_to_fuse(monkeypatch):
    from qtool.bench import shapes

    row = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
           "_layers": [{"name": "a.q_proj", "in": "hidden_size", "out": "q_size"},
                       {"name": "a.k_proj", "in": "hidden_size", "out": "kv_size"},
                       {"name": "m.down_proj", "in": "intermediate_size", "out": "hidden_size", "parallel": "row"}]}
    monkeypatch.setattr(shapes, "_model_table", lambda: {"toy": dict(row, _fused=None)})
    assert kn("toy") == [("q_proj", 64, 64), ("k_proj", 64, 64), ("down_proj", 128, 64)]
    with pytest.raises(UsageError, match="no layers a serving engine fuses"):
        parse_shapes("toy+fused", "cuda")
    bad = [{"name": "odd", "parts": ["a.q_proj", "m.down_proj"]}]
    monkeypatch.setattr(shapes, "_model_table", lambda: {"toy": dict(row, _fused=bad)})
    with pytest.raises(UsageError, match="fused layer 'odd' joins layers of different in-widths"):
        parse_shapes("toy+fused", "cuda")
    typo = [{"name": "a.qkv_proj", "parts": ["a.q_proj", "a.k_proj", "a.v_proj"]}]
    monkeypatch.setattr(shapes, "_model_table", lambda: {"toy": dict(row, _fused=typo)})
    with pytest.raises(UsageError, match="names 'a.v_proj', which is not one of its layers"):
        parse_shapes("toy+fused", "cuda")
    # a rule that names none of the model's layers leaves them as they are; the others still apply
    ok = [{"name": "a.qk_proj", "parts": ["a.q_proj", "a.k_proj"]}, {"name": "absent", "parts": ["x", "y"]}]
    monkeypatch.setattr(shapes, "_model_table", lambda: {"toy": dict(row, _fused=ok)})
    assert kn("toy+fused") == [("qk_proj", 64, 128), ("down_proj", 128, 64)]


def anchor_layer(a, model: str, m: int) -> float:
    """The anchor kernel's speedup over fp16 for the model's layer at M, its shapes counted as the bench sums."""
    shapes = parse_shapes(model, "cuda")
    return sum(a.times[(s.K, s.N, m)][0] for s in shapes) / sum(a.times[(s.K, s.N, m)][1] for s in shapes)


def test_anchor_file_matches_its_own_layer_figures():
    """The repo copy of the Marlin anchor gives back the layer figures its README states (70B: 2.07 at M = 1,
    1.37 at 32, 0.57 at 256), summed over the bench's own shape list."""
    a = load_anchor(MARLIN)
    assert a.name == "marlin_orig"
    assert a.speedup(28672, 8192, 1) == pytest.approx(130.5 / 49.7)
    assert a.speedup(8192, 28672, 1) == pytest.approx((125.1 + 125.8) / (54.9 + 51.2))  # gate and up: the mean
    assert a.speedup(8192, 28672, 3) is None  # 70B has no M = 3

    assert anchor_layer(a, "llama-3-70b", 1) == pytest.approx(2.07, abs=0.006)
    assert anchor_layer(a, "llama-3-70b", 32) == pytest.approx(1.37, abs=0.006)
    assert anchor_layer(a, "llama-3-70b", 256) == pytest.approx(0.57, abs=0.006)
    assert anchor_layer(a, "qwen2.5-32b", 16) == pytest.approx(1.63, abs=0.006)
    assert anchor_layer(a, "qwen3-30b-a3b-expert", 1) == pytest.approx(0.39, abs=0.006)


def test_h100_anchor_gives_back_its_page_figures():
    """The H100 anchor (benchmarks/marlin_peer.py: every model and M of the default sweep, in the same process as
    cuda-w4a16) gives back the layer figures benchmarks/results/curve.md states for Marlin."""
    a = load_anchor(MARLIN_H100)
    assert a.name == "marlin_orig"
    for model in ("llama-3-70b", "llama-3-8b", "qwen2.5-32b", "qwen2.5-7b", "qwen3-30b-a3b-expert",
                  "llama-3-70b@tp2", "llama-3-70b@tp4"):
        for m in GPU_BATCH_SIZES:
            assert all((s.K, s.N, m) in a.times for s in parse_shapes(model, "cuda")), (model, m)

    assert anchor_layer(a, "llama-3-70b", 1) == pytest.approx(2.53, abs=0.006)
    assert anchor_layer(a, "llama-3-70b", 32) == pytest.approx(1.89, abs=0.006)
    assert anchor_layer(a, "llama-3-70b", 256) == pytest.approx(0.62, abs=0.006)
    assert anchor_layer(a, "qwen2.5-32b", 16) == pytest.approx(2.04, abs=0.006)


def peer_module():
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module("marlin_peer")
    finally:
        sys.path.pop(0)


def test_marlin_peer_goal_table_sums_layers_and_matches_bf16_reports(tmp_path):
    """The peer's report: layer sums count each shape by its occurrences; a bf16 bench report is matched to its
    model by shapes; M = 1 adds both dtypes' fraction of the copy bandwidth."""
    peer = peer_module()
    rows = [dict(model="m", shape="a/b", count_in_layer=2, K=256, N=512, M=m, fp16_us=10.0 * f, marlin_us=5.0 * f,
                 cuda_w4a16_us=4.0 * f) for m, f in ((1, 1.0), (32, 2.0))]
    rows += [dict(model="m", shape="c", count_in_layer=1, K=512, N=256, M=m, fp16_us=20.0, marlin_us=10.0,
                  cuda_w4a16_us=10.0) for m in (1, 32)]
    (tmp_path / "peer.json").write_text(json.dumps({"gpu": "G", "rows": rows}))
    bf16 = {"settings": {"shapes": [{"K": 256, "N": 512}, {"K": 512, "N": 256}, {"K": 256, "N": 512}]},
            "device": {"copy_bandwidth_gbs": 1.0},
            "summary": {"per_m": {"cuda-w4a16": {"1": {"total_speedup_vs_dense": 2.2, "total_bw_fraction": 0.5},
                                                 "32": {"total_speedup_vs_dense": 1.0, "total_bw_fraction": 0.1}}}},
            "results": [{"kernel": "cuda-w4a16", "M": 1, "bytes": 9000}, {"kernel": "cuda-w4a16", "M": 1,
                                                                          "bytes": 9000},
                        {"kernel": "dense", "M": 1, "bytes": 10 ** 9}]}
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    lines = peer.goal_table(rows, "G").splitlines()
    # M = 1: dense 2 x 10 + 20 = 40 us; cuda-w4a16 2 x 4 + 10 = 18; Marlin 2 x 5 + 10 = 20
    assert lines[1].split() == ["m", "M=1", f"{40 / 18:.2f}", "2.00", f"{20 / 18:.2f}"]
    assert lines[2].split() == ["m", "M=32", f"{60 / 26:.2f}", f"{60 / 30:.2f}", f"{30 / 26:.2f}"]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert peer.report(tmp_path, [tmp_path / "bf16.json"]) == 0
    m1, m32 = out.getvalue().splitlines()[1:3]
    # 18000 bytes in 18 us against 1 GB/s of copy bandwidth: 100 %
    assert m1.split("|")[1].split() == ["2.20", f"{2.2 / (40 / 18):.2f}"]
    assert "fp16 100.0%, bf16 50.0% of 1 GB/s" in m1
    assert m32.split("|")[1].split() == ["1.00", f"{1.0 / (60 / 26):.2f}"]
    # a refused output is neither passed nor failed; a failed one (err inf, no time) is counted as checked
    checked = [dict(rows[0], marlin_err=1e-3, cuda_w4a16_err=2e-4, dense_err=3e-4),
               dict(rows[1], marlin_err=None, marlin_us=None, cuda_w4a16_err=float("inf"), cuda_w4a16_us=None,
                    dense_err=2e-4)]
    assert peer.oracle_line(checked, bad=1) == ("oracle: 2 of 3 kernel outputs within their bound (1 refused); "
                                                "error: Marlin 0.001-0.001, cuda-w4a16 0.0002-inf, dense fp16 "
                                                "0.0002-0.0003")
    assert "failed the oracle check or refused" in peer.goal_table(checked, "G").splitlines()[2]


def test_marlin_peer_build_refuses_an_unknown_source(tmp_path, capsys):
    """The build patches Marlin's L2 copy hint out (it faults on Hopper); a source without it is another
    version, refused before nvcc runs."""
    peer = peer_module()
    (tmp_path / "marlin").mkdir()
    (tmp_path / "marlin" / "marlin_cuda_kernel.cu").write_text("// no hint here\n")
    assert peer.build(tmp_path, tmp_path / "lib.so", nvcc="/nonexistent/nvcc") == 2
    assert "copy hint" in capsys.readouterr().err
    assert not (tmp_path / "lib.so").exists()


def fake_report() -> BenchReport:
    """Two shapes at M = 1 and 32; the kernel 2x dense at M = 1, 0.8x at M = 32."""
    s = BenchSettings(device=torch.device("cpu"), shapes=[Shape("a", 512, 256), Shape("b", 256, 512)],
                      batch_sizes=[1, 32])
    report = BenchReport(s, {}, {"bandwidth": 1e12}, {})
    for sh in s.shapes:
        for m, ratio in ((1, 2.0), (32, 0.8)):
            report.rows.append(Row(sh.name, sh.K, sh.N, m, DENSE, "ok", median_us=10.0, bytes=1000,
                                   speedup_vs_dense=1.0, bw_fraction=0.1))
            report.rows.append(Row(sh.name, sh.K, sh.N, m, "k", "ok", median_us=10.0 / ratio, bytes=500,
                                   speedup_vs_dense=ratio, bw_fraction=0.1))
    report.summary = summarize(report)
    return report


def test_flags_below_dense_and_below_anchor(tmp_path):
    csv = tmp_path / "ref.csv"
    csv.write_text("model,shape,count_in_layer,K,N,M,fp16_us,ref_us,ref_x_fp16\n"
                   "x,a,1,512,256,1,10.0,4.0,2.5\nx,b,1,256,512,1,10.0,4.0,2.5\n"
                   "x,a,1,512,256,32,10.0,20.0,0.5\n", encoding="utf-8")  # b has no M = 32
    report = fake_report()
    apply_anchor(report, load_anchor(csv))
    e1 = report.summary["per_m"]["k"]["1"]
    assert e1["anchor_x_dense"] == pytest.approx(2.5) and e1["vs_anchor"] == pytest.approx(0.8)
    assert "anchor_x_dense" not in report.summary["per_m"]["k"]["32"]  # the anchor lacks shape b there
    row = next(r for r in report.rows if r.kernel == "k" and r.M == 32 and r.shape == "a")
    assert row.vs_anchor == pytest.approx(0.8 / 0.5)
    flags = {(f["M"], f["scope"]): f["why"] for f in report.summary["flags"]}
    assert "below ref (2.00x against 2.50x" in flags[(1, "layer")]
    assert flags[(32, "layer")].startswith("below dense (0.80x)")
    assert set(flags) == {(1, "layer"), (32, "layer"), (1, "a"), (1, "b"), (32, "a"), (32, "b")}
    # the comparison the anchor cannot make is named, not left blank
    assert report.summary["anchor"]["uncovered"] == [{"shape": "b", "K": 256, "N": 512, "M": [32]}]
    from qtool.bench.report import anchor_gap_lines
    assert anchor_gap_lines(report) == ["ref.csv has no figures for b (256x512) at M = 32: its rows there and every "
                                        "layer sum that includes it are not compared with the anchor"]
    # without an anchor only the dense flags, and no anchor keys
    plain = fake_report()
    apply_anchor(plain, None)
    assert {(f["M"], f["scope"]) for f in plain.summary["flags"]} == {(32, "layer"), (32, "a"), (32, "b")}
    assert "anchor" not in plain.summary


@pytest.mark.parametrize("text, why", [
    ("K,N,M,fp16_us\n1,2,3,4\n", "kernel time columns"),
    ("K,N,fp16_us,ref_us\n1,2,3,4\n", r"lacks column\(s\) M"),
    ("K,N,M,fp16_us,ref_us\n1,2,x,4,5\n", "line 2: K, N, M must be integers"),
    ("K,N,M,fp16_us,ref_us\n1,2,3,4,0\n", "line 2: sizes and times must be positive"),
    ("K,N,M,fp16_us,ref_us\n1,2,3,nan,1\n", "positive and finite"),
    ("K,N,M,fp16_us,ref_us\n", "no rows"),
])
def test_anchor_file_errors(tmp_path, text, why):
    p = tmp_path / "bad.csv"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=why):
        load_anchor(p)
    p.write_bytes(b"K,N\xff\n")
    with pytest.raises(InputError, match="not UTF-8"):
        load_anchor(p)
    with pytest.raises(UsageError, match="no such file"):
        load_anchor(tmp_path / "missing.csv")


def test_cli_anchor_ratio_and_flags(tmp_path, bench_cli):
    csv = tmp_path / "ref.csv"
    # a reference 1000x faster than dense at M = 1: every kernel is flagged below it there
    csv.write_text("K,N,M,fp16_us,fast_us\n256,96,1,1000,1\n192,128,1,1000,1\n", encoding="utf-8")
    out = tmp_path / "b.json"
    md = tmp_path / "b.md"
    code, stdout, err = bench_cli(*FAST, "--anchor", str(csv), "--json", str(out), "--markdown", str(md))
    assert code == 0, err[-2000:]
    assert "fast x dense" in stdout and "/ fast" in stdout
    assert re.search(r"flag: torch-ref M=1 layer sum: [^\n]*below fast \(", stdout)
    d = json.loads(out.read_text())
    assert d["settings"]["anchor"] == str(csv)
    e = d["summary"]["per_m"]["torch-ref"]["1"]
    assert e["anchor_x_dense"] == pytest.approx(1000.0) and e["vs_anchor"] < 1
    assert "vs_anchor" not in d["summary"]["per_m"]["torch-ref"]["3"]
    assert any(f["M"] == 1 and f["scope"] == "layer" for f in d["summary"]["flags"])
    assert "Flags:" in md.read_text() and "/ fast" in md.read_text()
    assert re.search(r"anchor: ref.csv has no figures for 256x96, 192x128 at M = 3:", stdout)
    assert d["summary"]["anchor"]["uncovered"][0]["M"] == [3] and "Anchor:" in md.read_text()
    # a bad anchor is refused before the sweep: one line, exit 2
    bad = tmp_path / "bad.csv"
    bad.write_text("K,N,M\n", encoding="utf-8")
    code, stdout, err = bench_cli(*FAST, "--anchor", str(bad))
    assert code == 2 and "Traceback" not in err and "lacks column(s) fp16_us" in err


def test_cli_markdown_to_stdout_and_no_file_named_dash(tmp_path, bench_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stdout, err = bench_cli(*FAST, "--markdown", "-")
    assert code == 0, err[-2000:]
    assert stdout.startswith("- ") and "| shape | K x N |" in stdout and "\u2501" not in stdout  # no rich table
    for args, msg in ((("--plot", "-"), "a plot is an image"),
                      (("--json", "-", "--markdown", "-"), "both ask for standard output")):
        code, stdout, err = bench_cli(*FAST, *args)
        assert code == 2 and msg in err and stdout == ""
    assert not (tmp_path / "-").exists()


def test_gpu_default_sweep(monkeypatch, bench_cli):
    """On a GPU with no --batch-sizes, the sweep is the whole curve (run_bench replaced: no GPU here)."""
    import qtool.bench.run as run_mod
    import qtool.kernels.devices as devices

    seen = {}

    def fake_run(settings, step=None):
        seen["ms"] = settings.batch_sizes
        raise UsageError("stop here", fix="-")

    monkeypatch.setattr(devices, "torch_device", lambda _name: torch.device("cuda", 0))
    monkeypatch.setattr(run_mod, "run_bench", fake_run)
    code, _out, err = bench_cli("--shapes", "256x96")
    assert code == 2 and "stop here" in err
    assert seen["ms"] == list(GPU_BATCH_SIZES)
