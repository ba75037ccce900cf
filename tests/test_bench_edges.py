"""`qtool bench` at its edges: a malformed anchor CSV, two reports naming one file, and layer sums over part of
the shapes (a kernel refused or failed on some of them)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

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


def test_anchor_header_field_over_the_limit_and_a_spreadsheet_bom(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("K,N,M,fp16_us," + "x" * 200_000 + "_us\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 1 is not valid CSV"):
        load_anchor(p)
    p.write_bytes(b"\xef\xbb\xbf" + HEAD.encode() + b"m,s,1,256,128,1,2.0,1.0,2.0\n")
    a = load_anchor(p)
    assert a.name == "marlin_orig" and a.speedup(256, 128, 1) == pytest.approx(2.0)
    # CRLF line ends from the same spreadsheet
    p.write_bytes(b"\xef\xbb\xbf" + HEAD.encode().replace(b"\n", b"\r\n") + b"m,s,1,256,128,1,2.0,1.0,2.0\r\n")
    assert load_anchor(p).speedup(256, 128, 1) == pytest.approx(2.0)


@pytest.mark.parametrize("body, why", [
    ("m,s,1,256,128,1,2.0,1.0,2.0\nm,s,1,256,128,4,\"2.0,1.0,2.0\n", r"line 3 is not valid CSV \(unexpected end"),
    ("m,s,1,256,128,1,\"2.0\"x,1.0,2.0\n", r"line 2 is not valid CSV \(',' expected after '\"'\)"),
    # a blank line is a line: the bad row is the file's third
    ("\nm,s,1,256,128,x,2.0,1.0,2.0\n", "line 3: K, N, M must be integers"),
    # one layer's row twice (a pasted repeat, a rerun) would be averaged in as if another layer shared the shape
    ("m,s,1,256,128,1,2.0,1.0,2.0\nm,s,1,256,128,1,3.0,1.0,3.0\n",
     "line 3 repeats line 2's model, shape, K, N and M"),
    # int() and float() read "1_0" as 10 and other scripts' digits as digits: not what the file shows
    ("m,s,1,256,128,1_0,2.0,1.0,2.0\n", "line 2: K, N, M must be integers"),
    ("m,s,1,256,128,\u0661,2.0,1.0,2.0\n", "line 2: K, N, M must be integers"),
    ("m,s,1,256,128,1,2_0.0,1.0,2.0\n", "line 2: K, N, M must be integers and fp16_us, marlin_orig_us numbers"),
    # an M no kernel takes, and one int() refuses to read (over 4300 digits): the range, not an internal error
    ("m,s,1,256,128,99999999999999999999,2.0,1.0,2.0\n", "line 2: sizes and times must be positive and finite "
     r"\(K, N, M from 1 to 2147483647"),
    ("m,s,1,256,128," + "9" * 5000 + ",2.0,1.0,2.0\n", "line 2: sizes and times must be positive and finite"),
    # each finite, but two of them summed over a layer are inf
    ("m,s,1,256,128,1,1e308,1e300,1e8\n", "line 2: sizes and times must be positive and finite"),
    ("m,s,1,256,128,1,2.0,nan,2.0\n", "line 2: sizes and times must be positive and finite"),
    ("m,s,1,256,128,1,-2.0,1.0,2.0\n", "line 2: sizes and times must be positive and finite"),
])
def test_anchor_rows_refused_name_the_line(tmp_path, body, why):
    p = tmp_path / "a.csv"
    p.write_text(HEAD + body, encoding="utf-8")
    with pytest.raises(InputError, match=why):
        load_anchor(p)


def test_anchor_repeats_without_model_columns_and_a_nameless_kernel(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("K,N,M,fp16_us,ref_us\n256,128,1,2.0,1.0\n256,128,1,2.0,1.0\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 3 repeats line 2's K, N and M .*add model and shape columns"):
        load_anchor(p)
    # different layers of one K x N (gate and up) are averaged, as the module says
    p.write_text(HEAD + "m,gate,1,256,128,1,2.0,1.0,2.0\nm,up,1,256,128,1,4.0,1.0,4.0\n", encoding="utf-8")
    assert load_anchor(p).speedup(256, 128, 1) == pytest.approx(3.0)
    # the flags would say "below  (" with no name
    p.write_text("K,N,M,fp16_us,_us\n256,128,1,2.0,1.0\n", encoding="utf-8")
    with pytest.raises(InputError, match="'_us' names no kernel"):
        load_anchor(p)


def test_anchor_from_a_pipe_is_read_and_bounded(tmp_path):
    """--anchor <(...) is a pipe, not "no such file"; what is read of any file stops one byte past the limit
    (stat() gives a pipe's size as 0, so the size check let an endless one be read whole)."""
    import threading

    from qtool.bench import anchor

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text(HEAD + "m,s,1,256,128,1,2.0,1.0,2.0\n"), daemon=True)
    writer.start()
    try:
        assert load_anchor(pipe).speedup(256, 128, 1) == pytest.approx(2.0)
    finally:
        writer.join(5)
    with pytest.raises(InputError, match=f"more than a figures table \\({anchor.MAX_BYTES:,} bytes\\)"):
        load_anchor(Path("/dev/zero"))
    big = tmp_path / "big.csv"
    big.write_text(HEAD + "\n" * anchor.MAX_BYTES, encoding="utf-8")
    with pytest.raises(InputError, match="more than a figures table"):
        load_anchor(big)


def test_anchor_rows_are_bounded_before_they_are_held(tmp_path):
    """16 MiB of short rows is over a million distinct keys (about 700 MB held); the row count is capped."""
    from qtool.bench import anchor

    p = tmp_path / "a.csv"
    p.write_text("K,N,M,fp16_us,ref_us\n" + "".join(f"{k},1,1,2,1\n" for k in range(1, anchor.MAX_ROWS + 2)),
                 encoding="utf-8")
    with pytest.raises(InputError, match=f"more than 100,000 rows \\(line {anchor.MAX_ROWS + 2}\\)"):
        load_anchor(p)


# --- flags that would be read as something else -------------------------------------------------------------------

@pytest.mark.parametrize("args, said", [
    # no report was written, and exit 0 said nothing of it
    (("--json", ""), "--json '' names no file"),
    # the default shapes were benched instead
    (("--shapes", ""), "--shapes is empty"),
    # every kernel ran, as without --kernels
    (("--kernels", ","), "--kernels ',' names no kernel"),
    # silently collapsed into one M; a shape or kernel named twice is refused
    (("--batch-sizes", "16", "16"), "--batch-sizes names 16 twice"),  # after BASE's 1
])
def test_flags_that_name_nothing_or_twice_are_refused(bench_cli, no_sweep, args, said):
    assert BASE[-2] == "--kernels"
    code, out, err = bench_cli(*BASE[:-2], *args)
    assert code == 2 and said in err and err.count("\n") == 1, err


def test_shapes_out_of_range_and_one_model_twice():
    from qtool.bench.shapes import parse_shapes
    from qtool.errors import UsageError

    # int() refuses over 4300 digits: an internal error (exit 3) before
    with pytest.raises(UsageError, match="is out of range"):
        parse_shapes("1" + "0" * 5000 + "x1", "cuda")
    with pytest.raises(UsageError, match="tensor-parallel degree is out of range"):
        parse_shapes("llama-3-8b@tp" + "9" * 5000, "cuda")
    with pytest.raises(UsageError, match="tensor-parallel degree is out of range"):
        parse_shapes("llama-3-8b@tp1000", "cuda")  # was "unknown model"
    # one model under two spellings: the layer sums counted each layer twice
    with pytest.raises(UsageError, match="names 'llama-3-8b:q_proj' twice"):
        parse_shapes("llama-3-8b,llama-3-8b@tp1", "cuda")
    assert parse_shapes("LLAMA-3-8B@tp2,qwen2.5-7b", "cuda")[0].name == "llama-3-8b@tp2:q_proj/tp2"
    # an unknown name is quoted in part: the error stays one readable line
    with pytest.raises(UsageError) as e:
        parse_shapes("x" * 100_000, "cuda")
    assert len(str(e.value)) < 1000


def test_an_overflowing_dense_baseline_checks_nothing(monkeypatch):
    """A dense product that overflows the dtype gives a baseline error of inf, and every kernel was within
    k x inf of the oracle: ok, with its error unchecked. Its point fails instead, and no number is inf."""
    from types import SimpleNamespace

    from qtool.bench import run
    from qtool.cli.common import json_text

    monkeypatch.setattr(run, "F", SimpleNamespace(
        linear=lambda x, w: torch.full((x.shape[0], w.shape[0]), float("inf"), dtype=x.dtype)))
    s = BenchSettings(device=torch.device("cpu"), shapes=[Shape("a", 256, 128)], batch_sizes=[1],
                      kernels=["torch-ref"], group_size=64, max_seconds=0.01)
    report = run.run_bench(s)
    status = {r.kernel: (r.status, r.reason) for r in report.rows}
    assert status[DENSE] == ("failed", "the dense fp16 product is not finite (the layer's outputs overflow fp16)")
    assert status["torch-ref"] == ("failed", "not checked: " + status[DENSE][1])
    assert report.failed and "inf" not in json_text(report.to_dict())


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


def test_a_link_to_the_null_device_is_written_through(tmp_path, bench_cli):
    """A link to a pipe or device (/dev/stdout in a pipeline) is no file a report could replace."""
    link = tmp_path / "out"
    link.symlink_to(os.devnull)
    code, out, err = bench_cli(*BASE, "--markdown", str(link))
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == os.devnull
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")  # a link to nothing: a new file would replace it
    code, out, err = bench_cli(*BASE, "--markdown", str(tmp_path / "gone"))
    assert code == 2 and "the file exists" in err


def test_a_report_file_that_appears_during_the_run_is_named_in_bench_words(tmp_path):
    """Whether it appears before the report is written (a link to nothing too) or while it is, the error is the
    report's, not atomic_output's advice to pass -o or --force (bench has neither), and the newcomer stays."""
    from qtool.bench.report import write_report
    from qtool.errors import OutputError

    said = "the --json report's file appeared during the run, and a report does not replace a file"
    path = tmp_path / "r.json"
    path.symlink_to(tmp_path / "nothing")
    with pytest.raises(OutputError, match=said):
        write_report("--json", path, lambda p: p.write_text("new"), replace=False)
    assert path.is_symlink() and not path.exists()
    path.unlink()

    def racing(p):
        p.write_text("new")
        path.write_text("theirs")  # another process, between the check and the rename

    with pytest.raises(OutputError, match=said):
        write_report("--json", path, racing, replace=False)
    assert path.read_text() == "theirs" and [x.name for x in tmp_path.iterdir()] == ["r.json"]


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


def test_anchor_gap_says_which_partial_sums_are_still_compared(tmp_path):
    """The anchor lacks b at M = 1. j's sum there covers a and b: not compared. k's covers a alone (k is refused
    on b), so it has its ratio: the gap line must not say every layer sum there goes uncompared."""
    report = partial_report()
    csv = tmp_path / "ref.csv"
    csv.write_text("K,N,M,fp16_us,ref_us\n512,256,1,10,2\n512,256,32,10,10\n256,512,32,10,10\n",
                   encoding="utf-8")
    apply_anchor(report, load_anchor(csv))
    per_m = report.summary["per_m"]
    assert "vs_anchor" not in per_m["j"]["1"] and per_m["k"]["1"]["vs_anchor"] == pytest.approx(2.0 / 5.0)
    from qtool.bench.report import anchor_gap_lines

    assert anchor_gap_lines(report) == [
        "ref.csv has no figures for b (256x512) at M = 1: its rows there and every layer sum that includes it are "
        "not compared with the anchor; these sums over part of the shapes leave it out and are compared over their "
        "own shapes: k at M = 1 (1 of 2 shapes)"]
    from qtool.report.text import md_escape

    assert f"- {md_escape(anchor_gap_lines(report)[0])}" in to_markdown(report)


def test_partial_line_without_an_anchor_speaks_of_no_anchor_ratio():
    from qtool.bench.report import partial_lines

    report = partial_report()
    apply_anchor(report, None)
    lines = [x for x in partial_lines(report) if "covers" in x]
    assert lines and all("anchor" not in x for x in lines), lines
    assert lines[0].endswith("its x dense and % copy BW are for those shapes alone, against dense's times on "
                             "them, not the whole layer's")
