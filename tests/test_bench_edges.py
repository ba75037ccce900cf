"""`qtool bench` at its edges: a malformed anchor CSV, two reports naming one file, and layer sums over part of
the shapes (a kernel refused or failed on some of them)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from qtool.bench import roofline
from qtool.bench.anchor import apply_anchor, load_anchor
from qtool.bench.report import render_tables, to_markdown
from qtool.bench.run import DENSE, BenchReport, BenchSettings, Row, summarize
from qtool.bench.shapes import Shape
from qtool.errors import InputError

BASE = ["--device", "cpu", "--shapes", "256x128", "--batch-sizes", "1", "--seconds", "0.01", "-q",
        "--kernels", "torch-ref"]
HEAD = "model,shape,count_in_layer,K,N,M,fp16_us,marlin_orig_us,marlin_orig_x_fp16\n"


@pytest.fixture
def no_sweep(monkeypatch):
    """run_bench fails the test: what is refused must be refused before the sweep."""
    import qtool.bench.run as run_mod

    monkeypatch.setattr(run_mod, "run_bench", lambda *a, **k: pytest.fail("the sweep ran"))


# --- the anchor CSV ---------------------------------------------------------------------------------------------

def test_anchor_field_over_the_csv_limit_is_an_input_error_before_the_sweep(tmp_path, bench_cli, no_sweep):
    big = tmp_path / "big.csv"
    big.write_text(HEAD + "m,s,1,256,128,1," + "7" * 200_000 + ",1.0,1.0\n", encoding="utf-8")
    code, out, err = bench_cli(*BASE, "--anchor", str(big))
    assert code == 2, err
    assert "internal error" not in err and "Traceback" not in err
    assert err.count("\n") == 1 and str(big) in err
    assert "line 2 is not valid CSV (field larger than field limit" in err


@pytest.mark.parametrize("body, why", [
    ("m,s,1,256,128,1,2.0,1.0,2.0\nm,s,1,256,128,4,\"2.0,1.0,2.0\n", r"line 3 is not valid CSV \(unexpected end"),
    ("m,s,1,256,128,1,\"2.0\"x,1.0,2.0\n", r"line 2 is not valid CSV \(',' expected after '\"'\)"),
    # a blank line is a line: the bad row is the file's third
    ("\nm,s,1,256,128,x,2.0,1.0,2.0\n", "line 3: K, N, M must be integers"),
])
def test_anchor_bad_quoting_names_the_line(tmp_path, body, why):
    p = tmp_path / "a.csv"
    p.write_text(HEAD + body, encoding="utf-8")
    with pytest.raises(InputError, match=why):
        load_anchor(p)


def test_anchor_header_field_over_the_limit_and_a_spreadsheet_bom(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("K,N,M,fp16_us," + "x" * 200_000 + "_us\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 1 is not valid CSV"):
        load_anchor(p)
    p.write_bytes(b"\xef\xbb\xbf" + HEAD.encode() + b"m,s,1,256,128,1,2.0,1.0,2.0\n")
    a = load_anchor(p)
    assert a.name == "marlin_orig" and a.speedup(256, 128, 1) == pytest.approx(2.0)


# --- two reports, one file ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("first, second, said", [
    (("--json", "same.out"), ("--markdown", "same.out"), "--json and --markdown name the same file (same.out)"),
    (("--json", "x.png"), ("--plot", "./x.png"), "--json and --plot name the same file (x.png)"),
    (("--markdown", "out"), ("--json", "out/r.json"), "out would be both a report file and the directory"),
])
def test_two_reports_naming_one_file_are_refused_before_the_sweep(tmp_path, monkeypatch, bench_cli, no_sweep,
                                                                 first, second, said):
    monkeypatch.chdir(tmp_path)
    code, out, err = bench_cli(*BASE, *first, *second)
    assert code == 2 and said in err, err
    assert "--force" not in err and "destination exists" not in err
    assert list(tmp_path.iterdir()) == []


def test_two_reports_through_a_link_are_one_file(tmp_path, bench_cli, no_sweep):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    code, out, err = bench_cli(*BASE, "--json", str(tmp_path / "link" / "r"), "--markdown", str(tmp_path / "real" / "r"))
    assert code == 2 and "--json and --markdown name the same file" in err and str(tmp_path / "real" / "r") in err
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.skipif(not os.path.exists(os.devnull) or os.devnull == "nul", reason="needs a null device")
def test_two_reports_to_the_null_device_are_written_in_place(bench_cli):
    code, out, err = bench_cli(*BASE, "--json", os.devnull, "--markdown", os.devnull)
    assert code == 0, err


# --- layer sums over part of the shapes --------------------------------------------------------------------------

def partial_report() -> BenchReport:
    """Shapes a and b at M = 1 and 32, dense 10 us each. Kernel k is refused on b: 5 us on a at M = 1 (2x dense
    there, though 4x dense's whole layer), 20 us at M = 32. Kernel j runs both at M = 1 (5 us each) and fails
    on b at M = 32 (a: 40 us)."""
    s = BenchSettings(device=torch.device("cpu"), shapes=[Shape("a", 512, 256), Shape("b", 256, 512)],
                      batch_sizes=[1, 32])
    info = {"name": "test", "type": "cpu", "torch": "x", "triton": None, "copy_bandwidth_gbs": 1.0,
            "matmul_peak_tflops": 1.0}
    report = BenchReport(s, info, {"bandwidth": 1e12, "m_star_theory": 1.0, "b_eff": 4.25}, {})
    times = {("k", "a", 1): 5.0, ("k", "a", 32): 20.0, ("j", "a", 1): 5.0, ("j", "b", 1): 5.0, ("j", "a", 32): 40.0}
    for sh in s.shapes:
        for m in s.batch_sizes:
            report.rows.append(Row(sh.name, sh.K, sh.N, m, DENSE, "ok", median_us=10.0, bytes=1000,
                                   speedup_vs_dense=1.0, bw_fraction=0.1))
            for k in ("k", "j"):
                t = times.get((k, sh.name, m))
                if t is None:
                    report.rows.append(Row(sh.name, sh.K, sh.N, m, k, "refused" if k == "k" else "failed",
                                           reason="no"))
                else:
                    report.rows.append(Row(sh.name, sh.K, sh.N, m, k, "ok", median_us=t, bytes=500,
                                           speedup_vs_dense=10.0 / t, bw_fraction=0.1))
    report.summary = summarize(report)
    return report


def test_partial_layer_sum_is_said_and_compared_over_its_own_shapes(tmp_path):
    report = partial_report()
    per_m = report.summary["per_m"]
    e = per_m["k"]["1"]
    assert (e["shapes"], e["shapes_total"], e["shapes_missing"]) == (1, 2, ["b"])
    assert e["total_us"] == 5.0 and e["total_speedup_vs_dense"] == pytest.approx(2.0)  # dense on a alone
    assert per_m["j"]["1"]["shapes_missing"] == [] and per_m["j"]["32"]["shapes_missing"] == ["b"]
    assert per_m[DENSE]["1"]["shapes"] == per_m[DENSE]["1"]["shapes_total"] == 2
    # j's M* from shape a, the one it ran at every M, not from 10 us at M = 1 against 40 us at M = 32
    assert report.summary["m_star_shapes"] == {DENSE: 2, "j": 1, "k": 1}
    assert report.summary["m_star_measured"]["j"] == pytest.approx(roofline.measured_m_star({1: 5.0, 32: 40.0}))
    # the anchor's layer figure is over the same shapes as the kernel's
    csv = tmp_path / "ref.csv"
    csv.write_text("K,N,M,fp16_us,ref_us\n512,256,1,10,2\n256,512,1,10,10\n512,256,32,10,10\n256,512,32,10,10\n",
                   encoding="utf-8")
    apply_anchor(report, load_anchor(csv))
    assert per_m["k"]["1"]["anchor_x_dense"] == pytest.approx(5.0)
    flags = {(f["kernel"], f["M"], f["scope"]): f["why"] for f in report.summary["flags"]}
    assert flags[("k", 32, "layer")].startswith("over 1 of 2 shapes: below dense (0.50x); below ref")
    assert flags[("k", 1, "layer")].startswith("over 1 of 2 shapes: below ref (2.00x against 5.00x")
    assert flags[("j", 32, "layer")].startswith("over 1 of 2 shapes: below dense (0.25x)")
    assert ("j", 1, "layer") not in flags  # 2x dense over the whole layer, above the anchor's 1.67x

    from qtool.bench.report import partial_lines

    lines = partial_lines(report)
    assert len(lines) == 3
    assert lines[0].startswith("j at M = 32: the layer sum covers 1 of 2 shapes (refused or failed on b); its x "
                               "dense, % copy BW and anchor ratio are for those shapes alone")
    assert lines[1] == "j: M* measured over the 1 shape(s) it ran at every M"
    assert lines[2].startswith("k at M = 1, 32: the layer sum covers 1 of 2 shapes (refused or failed on b)")
    md = to_markdown(report)
    assert "| kernel | M | shapes | total us |" in md
    assert "| k | 1 | 1 of 2 | 5.0 | 2.00 |" in md and "| j | 1 | 2 | 10.0 | 2.00 |" in md
    assert "Partial sums:" in md and "- k at M = 1, 32\\: the layer sum covers 1 of 2 shapes" in md
    from rich.console import Console

    console = Console(record=True, width=300, color_system=None)
    render_tables(report, console)
    text = console.export_text()
    assert re.search(r"│ k +│ +1 │ 1 of 2 │ +5\.0 │ +2\.00 │", text), text
    assert "partial: j: M* measured over the 1 shape(s) it ran at every M" in text
    assert "partial: k at M = 1, 32: the layer sum covers 1 of 2 shapes" in text


def test_cli_layer_sum_of_a_kernel_refused_on_one_shape(tmp_path, bench_cli):
    """torch-int4-cpu refuses a K that the group size does not divide: its sum covers one shape of two."""
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    code, out, err = bench_cli("--device", "cpu", "--shapes", "256x128,200x128", "--group-size", "64", "--batch-sizes",
                             "1", "--seconds", "0.01", "--kernels", "torch-int4-cpu", "--markdown", str(md),
                             "--json", str(js))
    assert code == 0, err[-2000:]
    d = json.loads(js.read_text())
    ran = {r["shape"]: r["status"] for r in d["results"] if r["kernel"] == "torch-int4-cpu"}
    if ran != {"256x128": "ok", "200x128": "refused"}:
        pytest.skip(f"torch-int4-cpu here: {ran}")
    e = d["summary"]["per_m"]["torch-int4-cpu"]["1"]
    assert (e["shapes"], e["shapes_total"], e["shapes_missing"]) == (1, 2, ["200x128"])
    dense = {r["shape"]: r["median_us"] for r in d["results"] if r["kernel"] == DENSE}
    assert e["total_speedup_vs_dense"] == pytest.approx(dense["256x128"] / e["total_us"])
    text = md.read_text()
    assert re.search(r"^\| torch-int4-cpu \| 1 \| 1 of 2 \| ", text, re.M), text
    assert re.search(r"^\| dense \| 1 \| 2 \| ", text, re.M)
    assert "Partial sums:" in text and "covers 1 of 2 shapes (refused or failed on 200x128)" in text
    assert re.search(r"partial: torch-int4-cpu at M = 1: the layer sum\s+covers\s+1\s+of\s+2", out), out
