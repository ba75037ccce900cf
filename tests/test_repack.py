"""`qtool repack` core: any-to-any by composition, exactness decided before writing, refusals that write
nothing, direct paths equal to the composition, foreign fixtures converted bit-exactly, GGUF targets read back
by the gguf package."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtool.errors import InputError, NotRepresentable, OutputError, UsageError
from qtool.formats import Plain, dequantize, get_format
from qtool.repack.plan import RepackJob, can_regroup, regroup, widen
from qtool.repack.run import Refused, fast_paths, run_repack
from qtool.repack.source import open_source
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES
from tests.test_formats_ct import random_plain, raw_equal

HF_FORMATS = ("gptq", "gptq_v2", "gptq_p", "awq", "ct", "marlin")


def params(p: Plain) -> QuantScheme:
    return QuantScheme(bits=p.bits, group_size=p.group_size)


def decode_all(path) -> dict[str, Plain]:
    """Every quantized module of a checkpoint read back through qtool's own detection and readers."""
    src = open_source(path)
    try:
        return {m.name: get_format(m.scheme.format).unpack(src.load(m), m.scheme) for m in src.modules}
    finally:
        src.close()


# --- any-to-any on Plains ---------------------------------------------------------------------------------
PLAINS = {
    "sym4-g128": dict(o=128, i=256, bits=4, group_size=128, sym=True),
    "asym4-g64-zero0": dict(o=128, i=256, bits=4, group_size=64, sym=False),
    "sym8-channel": dict(o=64, i=128, bits=8, group_size=-1, sym=True),
    "asym3-g32": dict(o=64, i=128, bits=3, group_size=32, sym=False),
    "sym4-actorder": dict(o=128, i=256, bits=4, group_size=64, sym=True, act_order=True),
}


@pytest.mark.parametrize("case", list(PLAINS))
def test_every_pair_of_formats_converts_exactly_or_refuses(case):
    p = random_plain(11, **PLAINS[case])
    for a in HF_FORMATS:
        fa = get_format(a)
        if fa.check(p):
            continue
        xa = fa.pack(p)
        pa = fa.unpack(xa, params(p))
        assert pa.equal(p), (case, a)
        for b in HF_FORMATS:
            fb = get_format(b)
            why = fb.check(pa)
            if why:
                with pytest.raises(NotRepresentable):
                    fb.pack(pa)
                continue
            pb = fb.unpack(fb.pack(pa), params(p))
            assert pb.equal(p), (case, a, b)
            back = fa.pack(pb.with_(meta=pa.meta))  # and home again, byte for byte (meta: A's bookkeeping)
            assert list(back) == list(xa) and all(torch.equal(back[k], xa[k]) for k in xa), (case, a, b)


@given(seed=st.integers(0, 2**16), a=st.sampled_from(HF_FORMATS), b=st.sampled_from(HF_FORMATS),
       bits=st.sampled_from([2, 3, 4, 8]), group=st.sampled_from([32, 64, 128, -1]), sym=st.booleans(),
       o=st.sampled_from([64, 96, 128]))
def test_random_pairs_round_trip(seed, a, b, bits, group, sym, o):
    p = random_plain(seed, o, 128, bits, group, sym)
    fa, fb = get_format(a), get_format(b)
    if fa.check(p) or fb.check(p):
        return
    xa = fa.pack(p)
    pb = fb.unpack(fb.pack(fa.unpack(xa, params(p))), params(p))
    assert pb.equal(p)
    back = fa.pack(pb.with_(meta=fa.unpack(xa, params(p)).meta))
    assert all(torch.equal(back[k], xa[k]) for k in xa)


def test_gptq_awq_ct_exact_including_zero_0_and_the_v1_refusal():
    p = random_plain(3, 64, 256, 4, 128, sym=False)
    assert int(p.zeros.min()) == 0 and int(p.zeros.max()) == 15
    chain = ["gptq_v2", "awq", "ct", "gptq_v2"]
    x = get_format(chain[0]).pack(p)
    cur = p
    for a, b in zip(chain, chain[1:], strict=False):
        cur = get_format(b).unpack(get_format(b).pack(get_format(a).unpack(get_format(a).pack(cur), params(p))),
                                   params(p))
        assert cur.equal(p)
    assert all(torch.equal(get_format("gptq_v2").pack(cur)[k], x[k]) for k in x)
    why = get_format("gptq").check(p)
    assert any("zero point of 0" in w for w in why)
    with pytest.raises(NotRepresentable, match="gptq_v2"):
        get_format("gptq").pack(p)


# --- exact transformations ---------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**16), bits=st.sampled_from([2, 3, 4]), to_bits=st.sampled_from([4, 5, 8]),
       sym=st.booleans(), group=st.sampled_from([-1, 64, 128]), to_group=st.sampled_from([32, 64]))
def test_widen_and_regroup_keep_every_weight(seed, bits, to_bits, sym, group, to_group):
    p = random_plain(seed, 16, 128, bits, group, sym)
    ref = dequantize(p, torch.float64)
    if to_bits >= bits:
        w = widen(p, to_bits)
        assert w.bits == to_bits and torch.equal(dequantize(w, torch.float64), ref) and w.sym == p.sym
    assert can_regroup(group, 128, to_group, False)
    r = regroup(p, to_group)
    assert r.group_size == to_group and torch.equal(dequantize(r, torch.float64), ref)


def test_regroup_refuses_merging_groups_and_act_order():
    assert not can_regroup(32, 256, 64, False)
    assert not can_regroup(64, 256, 32, True)
    assert not can_regroup(64, 256, -1, False)


# --- direct paths = composition ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(128, 256), (96, 192)])
def test_every_fast_path_equals_the_composition(shape):
    o, i = shape
    paths = fast_paths()
    assert {("gptq", "ct"), ("ct", "gptq_v2"), ("gptq_v2", "marlin"), ("marlin", "gptq")} <= set(paths)
    for (src, dst), fn in paths.items():
        for bits in (4, 8):
            p = random_plain(bits + o, o, i, bits, 64 if i % 64 == 0 else -1, sym=True)
            fs, fd = get_format(src), get_format(dst)
            if fs.check(p):
                continue
            tensors = fs.pack(p)
            lp = QuantScheme(bits=bits, group_size=p.group_size)
            direct = fn(tensors, lp, src, dst)
            composed = fd.pack(fs.unpack(tensors, lp))
            assert direct is not None, (src, dst, bits, shape)
            assert list(direct) == list(composed), (src, dst)
            for k in composed:
                assert direct[k].dtype == composed[k].dtype and torch.equal(direct[k], composed[k]), (src, dst, k)


def test_fast_path_declines_asymmetric_and_act_order():
    p = random_plain(5, 128, 256, 4, 64, sym=False)
    lp = QuantScheme(bits=4, group_size=64)
    for (src, dst), fn in fast_paths().items():
        if get_format(src).check(p):
            continue
        assert fn(get_format(src).pack(p), lp, src, dst) is None, (src, dst)
    q = random_plain(6, 128, 256, 4, 64, sym=True, act_order=True)
    for (src, dst), fn in fast_paths().items():
        if not get_format(src).check(q):
            assert fn(get_format(src).pack(q), lp, src, dst) is None, (src, dst)


# --- checkpoints -------------------------------------------------------------------------------------------------
MODULES = {"model.layers.0.self_attn.q_proj": (128, 256), "model.layers.0.self_attn.o_proj": (256, 128),
           "model.layers.0.mlp.down_proj": (256, 128)}


def make_checkpoint(root: Path, fmt="gptq_v2", bits=4, group=128, sym=True, seed=0, modules=None
                    ) -> dict[str, Plain]:
    """A tiny Llama-shaped quantized checkpoint (dense embeddings, norms, a bias) and its Plains."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(50, 256, generator=g).half(),
         "model.norm.weight": torch.rand(256, generator=g).half()}
    plains = {}
    for k, (name, (o, i)) in enumerate((modules or MODULES).items()):
        p = random_plain(seed + k, o, i, bits, group, sym)
        plains[name] = p
        for short, v in get_format(fmt).pack(p).items():
            t[f"{name}.{short}"] = v
    t["model.layers.0.self_attn.o_proj.bias"] = torch.randn(256, generator=g).half()
    save_file(t, root / "model.safetensors", metadata={"format": "pt"})
    cfg = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 256,
           "quantization_config": get_format(fmt).config_for(bits, group, sym, False)}
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text("{}")
    return plains


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_marlin_round_trip_is_byte_identical_and_dense_tensors_are_copied(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq", 4, 128, True)
    r1 = run_repack(RepackJob(tmp_path / "src", "marlin", tmp_path / "m"))
    assert r1.plan.counts()["exact"] == 3 and all(m.fast for m in r1.plan.modules)
    r2 = run_repack(RepackJob(tmp_path / "m", "gptq", tmp_path / "back"))
    assert r2.plan.counts()["exact"] == 3
    a, b = read_tensors(tmp_path / "src"), read_tensors(tmp_path / "back")
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"]["checkpoint_format"] == "marlin" and cfg["model_type"] == "llama"
    assert (tmp_path / "m" / "tokenizer.json").read_text() == "{}"


@pytest.mark.parametrize("dst", ["ct", "marlin"])
def test_direct_and_composed_runs_write_identical_files(tmp_path, dst):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 64, True)
    run_repack(RepackJob(tmp_path / "src", dst, tmp_path / "fast"))
    slow = run_repack(RepackJob(tmp_path / "src", dst, tmp_path / "slow"), use_fast_paths=False)
    assert not any(m.fast for m in slow.plan.modules)
    assert (tmp_path / "fast" / "model.safetensors").read_bytes() == (tmp_path / "slow" / "model.safetensors").read_bytes()


def test_ct_output_config_and_values(tmp_path):
    plains = make_checkpoint(tmp_path / "src", "awq", 4, 64, False)
    run_repack(RepackJob(tmp_path / "src", "ct", tmp_path / "ct"))
    q = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    (grp,) = q["config_groups"].values()
    assert sorted(grp["targets"]) == sorted(MODULES)
    assert {"num_bits": 4, "group_size": 64, "symmetric": False, "strategy": "group"}.items() <= grp["weights"].items()
    assert not (tmp_path / "ct" / "quantize_config.json").exists()
    got = decode_all(tmp_path / "ct")
    assert all(got[n].equal(p) for n, p in plains.items())


def test_widen_and_regroup_through_the_command(tmp_path):
    plains = make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, False)
    r = run_repack(RepackJob(tmp_path / "src", "ct", tmp_path / "out", bits=8, group_size=32))
    assert {m.kind for m in r.plan.modules} == {"exact"}
    assert all(m.steps == ["widen 4->8 bits", "regroup 128->32"] for m in r.plan.modules)
    got = decode_all(tmp_path / "out")
    for n, p in plains.items():
        assert got[n].bits == 8 and got[n].group_size == 32
        assert torch.equal(dequantize(got[n], torch.float64), dequantize(p, torch.float64))


# --- refusals and --allow-lossy ------------------------------------------------------------------------------
def test_lossy_without_allow_lossy_writes_nothing_and_names_modules(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, False)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Refused) as e:
        run_repack(RepackJob(tmp_path / "src", "gptq", tmp_path / "out"))
    msg = str(e.value)
    assert "3 of 3 modules cannot be converted exactly to gptq" in msg and "zero point of 0" in msg
    assert "model.layers.0.self_attn.q_proj" in msg and "--allow-lossy" in msg and "nothing was written" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temporary left behind
    assert e.value.exit_code == 2


def test_narrower_bits_are_lossy_and_allow_lossy_reports_the_error(tmp_path):
    plains = make_checkpoint(tmp_path / "src", "gptq_v2", 4, 64, True)
    with pytest.raises(Refused, match="narrower"):
        run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "out", bits=2))
    assert not (tmp_path / "out").exists()
    r = run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "out", bits=2, allow_lossy=True))
    got = decode_all(tmp_path / "out")
    for m in r.plan.modules:
        assert m.kind == "lossy" and m.steps == ["requantize"] and got[m.module].bits == 2
        ref = dequantize(plains[m.module], torch.float64)
        new = dequantize(got[m.module], torch.float64)
        assert m.rel_error == pytest.approx(float(torch.linalg.vector_norm(new - ref) / torch.linalg.vector_norm(ref)),
                                            rel=1e-9)
        assert 0 < m.rel_error < 0.7 and m.max_error == pytest.approx(float((new - ref).abs().max()), rel=1e-12)
    rep = json.loads((tmp_path / "out" / "qtool_repack.json").read_text())
    assert rep["counts"]["lossy"] == 3 and rep["written"]


def test_impossible_is_refused_even_with_allow_lossy(tmp_path):
    mods = dict(MODULES) | {"model.layers.0.mlp.up_proj": (64, 40)}  # 40 inputs: no whole 32-input GGUF block
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, -1, True, modules=mods)
    with pytest.raises(Refused) as e:
        run_repack(RepackJob(tmp_path / "src", "q4_0", tmp_path / "o.gguf", allow_lossy=True))
    assert "1 of 4 modules" in str(e.value) and "[impossible]" in str(e.value) and "mlp.up_proj" in str(e.value)
    assert "not a multiple of the 32-input GGUF block" in str(e.value)
    assert not (tmp_path / "o.gguf").exists()


def test_excluded_modules_are_kept_and_existing_destination_is_refused(tmp_path):
    make_checkpoint(tmp_path / "src", "gptq_v2", 4, 128, False)
    r = run_repack(RepackJob(tmp_path / "src", "awq", tmp_path / "out", exclude=("o_proj",)))
    kinds = {m.module: m.kind for m in r.plan.modules}
    assert kinds["model.layers.0.self_attn.o_proj"] == "keep" and list(kinds.values()).count("exact") == 2
    src, out = read_tensors(tmp_path / "src"), read_tensors(tmp_path / "out")
    assert torch.equal(src["model.layers.0.self_attn.o_proj.qweight"], out["model.layers.0.self_attn.o_proj.qweight"])
    with pytest.raises(OutputError, match="destination exists"):
        run_repack(RepackJob(tmp_path / "src", "awq", tmp_path / "out"))
    run_repack(RepackJob(tmp_path / "src", "awq", tmp_path / "out", force=True))


# --- foreign fixtures -------------------------------------------------------------------------------------------
FIXTURE_TARGETS = [
    ("gptqmodel-gptq-v1-4bit-g128-asym-wordborrow", "awq"),
    ("gptqmodel-gptq-v2-4bit-g128-asym", "ct"),
    ("gptqmodel-awq-gemm-4bit-g128", "gptq_v2"),
    ("gptqmodel-awq-gemm-4bit-g128", "marlin"),
    ("compressed-tensors-w4a16-g128-asym", "awq"),
    ("compressed-tensors-w4a16-g128", "gptq"),
    ("gptqmodel-gptq-v1-4bit-g128-sym", "ct"),
    ("gptqmodel-gptq-3bit-g128-asym", "ct"),
    ("gptqmodel-gptq_p-5bit-g64-asym", "ct"),
]


@pytest.mark.parametrize("name,dst", FIXTURE_TARGETS)
def test_fixture_converts_bit_exactly(tmp_path, name, dst):
    r = run_repack(RepackJob(FIXTURES / name, dst, tmp_path / "out"))
    assert {m.kind for m in r.plan.modules} == {"exact"}
    ref = load_file(FIXTURES / name / "reference.safetensors")
    got = decode_all(tmp_path / "out")
    assert len(got) == 6
    for mod, p in got.items():
        assert raw_equal(dequantize(p), ref[mod + ".weight"]), mod


def test_fixture_v1_target_refused_for_zero_0_across_formats(tmp_path):
    for name in ("gptqmodel-awq-gemm-4bit-g128", "compressed-tensors-w4a16-g128-asym"):
        with pytest.raises(Refused, match="zero point of 0"):
            run_repack(RepackJob(FIXTURES / name, "gptq", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# --- GGUF --------------------------------------------------------------------------------------------------------
GGML = {"gguf_q4_0": gguf.GGMLQuantizationType.Q4_0, "gguf_q4_1": gguf.GGMLQuantizationType.Q4_1,
        "gguf_q8_0": gguf.GGMLQuantizationType.Q8_0}
LLAMA_NAMES = {"model.layers.0.self_attn.q_proj": "blk.0.attn_q", "model.layers.0.self_attn.o_proj": "blk.0.attn_output",
               "model.layers.0.mlp.down_proj": "blk.0.ffn_down"}


@pytest.mark.parametrize("bits,sym,dst", [(4, True, "gguf_q4_0"), (8, True, "gguf_q8_0"), (4, False, "gguf_q4_1")])
def test_gptq_to_gguf_is_read_back_by_the_gguf_package(tmp_path, bits, sym, dst):
    plains = make_checkpoint(tmp_path / "src", "gptq_v2", bits, 32, sym)
    r = run_repack(RepackJob(tmp_path / "src", dst, tmp_path / "o.gguf"))
    reader = gguf.GGUFReader(tmp_path / "o.gguf")
    tensors = {t.name: t for t in reader.tensors}
    src = load_file(tmp_path / "src" / "model.safetensors")
    for m in r.plan.modules:
        t = tensors[LLAMA_NAMES[m.module] + ".weight"]
        assert t.tensor_type == GGML[dst]
        got = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).copy())
        want = dequantize(plains[m.module], torch.float32)
        if dst == "gguf_q4_1":
            assert m.kind in ("exact", "near-exact")
            err = float((got.double() - dequantize(plains[m.module], torch.float64)).abs().max())
            assert err == m.max_error
            p = plains[m.module]
            dz = (p.scales.double() * p.zeros.double()).abs().max()
            assert err <= float(dz) * 2.0**-11
        else:
            assert m.kind == "exact" and raw_equal(got, want), m.module
    # dense tensors copied under llama.cpp names, bytes unchanged
    emb = tensors["token_embd.weight"]
    assert np.array_equal(np.array(emb.data), src["model.embed_tokens.weight"].numpy())
    assert np.array_equal(np.array(tensors["blk.0.attn_output.bias"].data),
                          src["model.layers.0.self_attn.o_proj.bias"].numpy())
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.architecture"] == "llama" and kv["llama.block_count"] == 1
    assert kv["general.file_type"] == {"gguf_q4_0": 2, "gguf_q4_1": 3, "gguf_q8_0": 7}[dst]


def test_gguf_fixture_to_gptq(tmp_path):
    src = FIXTURES / "gguf-q4_0-q4_1-q8_0" / "gguf-q4_0-q4_1-q8_0.gguf"
    with pytest.raises(Refused, match=r"Q4_1 offset m is not -d\*z"):
        run_repack(RepackJob(src, "gptq_v2", tmp_path / "out"))
    r = run_repack(RepackJob(src, "gptq_v2", tmp_path / "out", exclude=("attn_output", "ffn_up")))
    assert {m.module: m.kind for m in r.plan.modules if m.kind != "keep"} == {
        "blk.0.attn_q": "exact", "blk.0.attn_k": "exact", "blk.0.attn_v": "exact", "blk.0.ffn_down": "exact"}
    ref = load_file(FIXTURES / "gguf-q4_0-q4_1-q8_0" / "reference.safetensors")
    # Names are transformers' (the gguf package's map for bert, inverted). The excluded modules are copied as
    # raw GGUF block bytes (U8 "weight") that nothing in the output names: inspect reports them as an unknown
    # quantized layout, so the converted ones are decoded directly here.
    from qtool.inspect import inspect_path

    hf = {"encoder.layer.0.attention.self.query": "blk.0.attn_q", "encoder.layer.0.attention.self.key": "blk.0.attn_k",
          "encoder.layer.0.attention.self.value": "blk.0.attn_v", "encoder.layer.0.output.dense": "blk.0.ffn_down",
          "encoder.layer.0.attention.output.dense": "blk.0.attn_output",
          "encoder.layer.0.intermediate.dense": "blk.0.ffn_up"}
    r = inspect_path(tmp_path / "out")
    assert {hf[m.name] for m in r.modules if m.scheme.format == "unknown"} == {"blk.0.attn_output", "blk.0.ffn_up"}
    out = load_file(tmp_path / "out" / "model.safetensors")
    got = {m.name: get_format("gptq_v2").unpack({s: out[f"{m.name}.{s}"] for s in ("qweight", "qzeros", "scales",
                                                                                   "g_idx")},
                                                QuantScheme(bits=m.scheme.bits, group_size=m.scheme.group_size))
           for m in r.modules if m.scheme.format == "gptq_v2"}
    assert {hf[n] for n in got} == {"blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.ffn_down"}
    for mod, p in got.items():
        assert p.group_size == 32 and raw_equal(dequantize(p, torch.float32), ref[hf[mod] + ".weight"]), mod
    assert "encoder.layer.0.attention.self.query.bias" in out and "blk.0.attn_q.bias" not in out
    r = run_repack(RepackJob(src, "gptq_v2", tmp_path / "lossy", allow_lossy=True))
    lossy = [m for m in r.plan.modules if m.kind == "lossy"]
    assert {m.module for m in lossy} == {"blk.0.attn_output", "blk.0.ffn_up"}
    assert all(0 < m.rel_error < 0.2 for m in lossy)


def test_old_padded_ct_source_is_read_by_version_and_written_dense(tmp_path):
    root = tmp_path / "old"
    root.mkdir()
    plains, t = {}, {}
    for k, (name, (o, i)) in enumerate(MODULES.items()):
        p = random_plain(20 + k, o, i, 3, 64, sym=False)
        plains[name] = p
        t |= {f"{name}.{s}": v for s, v in get_format("ct").pack(p, packing="padded").items()}
    save_file(t, root / "model.safetensors")
    words = t["model.layers.0.self_attn.q_proj.weight_packed"].shape[1]
    assert words == -(-256 // 10)  # 10 codes per word, not the dense ceil(256*3/32) = 24
    from qtool.scheme import QuantScheme

    q = get_format("ct").quantization_config([(n, QuantScheme("ct", 3, 64, False, False), None) for n in MODULES])
    q["version"] = "0.17.1"
    (root / "config.json").write_text(json.dumps({"quantization_config": q}))
    assert all(decode_all(root)[n].equal(p) for n, p in plains.items())
    run_repack(RepackJob(root, "ct", tmp_path / "new", group_size=32))
    out = read_tensors(tmp_path / "new")
    assert out["model.layers.0.self_attn.q_proj.weight_packed"].shape[1] == 24
    got = decode_all(tmp_path / "new")
    for n, p in plains.items():
        assert torch.equal(dequantize(got[n], torch.float64), dequantize(p, torch.float64))


def test_gguf_to_gguf_keeps_each_tensors_type_and_tensor_type_overrides(tmp_path):
    """The fixture mixes Q4_0 (3 modules, the file's type), Q4_1 (2) and Q8_0 (1). --to q8_0 converts the Q4_0
    modules and keeps the others in their own type, byte for byte (GGUF files are mixed, as llama-quantize
    leaves them); --tensor-type names the ones to store as another type, lossy here, so only with
    --allow-lossy. Metadata records are carried."""
    src = FIXTURES / "gguf-q4_0-q4_1-q8_0" / "gguf-q4_0-q4_1-q8_0.gguf"
    r = run_repack(RepackJob(src, "q8_0", tmp_path / "o.gguf"))
    assert {m.module: m.kind for m in r.plan.modules} == dict.fromkeys(
        ("blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v", "blk.0.attn_output", "blk.0.ffn_up", "blk.0.ffn_down"),
        "exact")
    reader = gguf.GGUFReader(tmp_path / "o.gguf")
    source = {t.name: t for t in gguf.GGUFReader(src).tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors if t.name.endswith(".weight")}
    assert types == {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q8_0",
                     "blk.0.attn_output.weight": "Q4_1", "blk.0.ffn_up.weight": "Q4_1",
                     "blk.0.ffn_down.weight": "Q8_0"}
    for t in reader.tensors:
        if types.get(t.name) == "Q4_1":
            assert np.array_equal(np.array(t.data), np.array(source[t.name].data)), t.name
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.license"] == "apache-2.0" and kv["general.file_type"] == 7
    ref = load_file(FIXTURES / "gguf-q4_0-q4_1-q8_0" / "reference.safetensors")
    for t in reader.tensors:
        if t.name.endswith(".weight"):
            got = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).copy())
            assert raw_equal(got, ref[t.name]), t.name

    with pytest.raises(Refused, match="--tensor-type Q8_0: the values change"):
        run_repack(RepackJob(src, "q8_0", tmp_path / "x.gguf", tensor_type=("attn_output|ffn_up=Q8_0",)))
    r = run_repack(RepackJob(src, "q8_0", tmp_path / "all8.gguf", allow_lossy=True,
                             tensor_type=("attn_output|ffn_up=Q8_0",)))
    kinds = {m.module: m.kind for m in r.plan.modules}
    assert kinds["blk.0.attn_output"] == kinds["blk.0.ffn_up"] == "lossy" and kinds["blk.0.attn_q"] == "exact"
    assert {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "all8.gguf").tensors
            if t.name.endswith(".weight")} == {"Q8_0"}


def test_tensor_type_keeps_values_exactly_where_they_fit(tmp_path):
    """--tensor-type on a float tensor: an F32 embedding whose values came from Q8_0 blocks goes back to the
    same Q8_0 bytes (exact); F16 of arbitrary F32 values is lossy and refused without --allow-lossy."""
    from qtool.repack.interop import encode_as, parse_tensor_types

    w = torch.randn(8, 64)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    back = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())
    again, exact = encode_as(back, "Q8_0")
    assert exact and np.array_equal(again, raw)
    assert not encode_as(w, "F16")[1] and encode_as(w, "F32")[1]
    with pytest.raises(UsageError, match="Q3_K is not a GGUF type qtool writes"):
        parse_tensor_types(("x=Q3_K",))
    with pytest.raises(UsageError, match="not REGEX=TYPE"):
        parse_tensor_types(("Q8_0",))


def test_streaming_buffers_are_reused_without_mixing_modules(tmp_path, monkeypatch):
    """Modules large enough for the streaming path (mapped reads, qweights >= 1 MiB converted into pooled
    buffers handed back by the writer thread) give the same file as the composed, unpooled run, and the
    back-conversion restores every source byte. The pool really hands buffers out again (6 modules, 3
    buffers)."""
    from qtool.repack import run as rr

    ptrs = []
    take = rr.ScratchPool.take
    monkeypatch.setattr(rr.ScratchPool, "take", lambda self, w: ptrs.append(take(self, w)) or ptrs[-1])
    mods = {f"model.layers.{i}.mlp.{n}": shape for i in range(3)
            for n, shape in (("up_proj", (512, 4096)), ("down_proj", (1024, 2048)))}
    make_checkpoint(tmp_path / "src", "gptq", 4, 128, True, seed=5, modules=mods)
    fast = run_repack(RepackJob(tmp_path / "src", "marlin", tmp_path / "fast"))
    assert all(m.fast for m in fast.plan.modules)
    assert len(ptrs) == 6 and len({t.data_ptr() for t in ptrs}) <= 3
    run_repack(RepackJob(tmp_path / "src", "marlin", tmp_path / "slow"), use_fast_paths=False)
    assert (tmp_path / "fast" / "model.safetensors").read_bytes() == (tmp_path / "slow" / "model.safetensors").read_bytes()
    run_repack(RepackJob(tmp_path / "fast", "gptq", tmp_path / "back"))
    a, b = read_tensors(tmp_path / "src"), read_tensors(tmp_path / "back")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# --- tensors a module's layout does not read (a ParoQuant-like rotation) ------------------------------------
def paro_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint whose q_proj also holds per-channel rotation tensors (`.theta`, `.rot`) that no GPTQ
    reader applies; returns them."""
    make_checkpoint(root, "gptq", 4, 128, True)
    t = load_file(root / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    extra = {"model.layers.0.self_attn.q_proj.theta": torch.randn(128, generator=g).half(),
             "model.layers.0.self_attn.q_proj.rot": torch.randn(4, 32, 32, generator=g).half()}
    save_file(t | extra, root / "model.safetensors", metadata={"format": "pt"})
    return extra


def test_unread_module_tensor_refuses_the_module_naming_it_and_writes_nothing(tmp_path):
    paro_checkpoint(tmp_path / "src")
    with pytest.raises(Refused) as e:
        run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "o"))
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj.rot" in msg and "model.layers.0.self_attn.q_proj.theta" in msg
    assert "--keep" in msg and "--drop" in msg and "\n" not in msg
    assert e.value.exit_code == 2 and not (tmp_path / "o").exists()
    (q,) = [m for m in e.value.plan.modules if m.module.endswith("q_proj")]
    assert q.kind == "impossible"


def test_keep_carries_unread_tensors_byte_for_byte(tmp_path):
    extra = paro_checkpoint(tmp_path / "src")
    r = run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "o", keep=(r"\.rot$", r"\.theta$")))
    got = read_tensors(tmp_path / "o")
    assert all(got[n].view(torch.uint8).equal(t.view(torch.uint8)) for n, t in extra.items())
    (q,) = [m for m in r.plan.modules if m.module.endswith("q_proj")]
    assert sorted(q.carried) == sorted(extra) and not r.plan.dropped


def test_drop_discards_and_lists_them_and_the_plan_does_not_say_exact(tmp_path):
    extra = paro_checkpoint(tmp_path / "src")
    r = run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "o", drop=(r"\.(rot|theta)$",)))
    got = read_tensors(tmp_path / "o")
    assert not set(extra) & set(got)
    (q,) = [m for m in r.plan.modules if m.module.endswith("q_proj")]
    assert q.kind == "dropped" and sorted(q.dropped) == sorted(extra)
    d = r.to_dict()
    assert d["dropped_tensors"] == sorted(extra) and d["counts"]["exact"] == 2 and d["counts"]["dropped"] == 1
    # the rest of the module converted exactly all the same
    assert decode_all(tmp_path / "o")[q.module].equal(decode_all(tmp_path / "src")[q.module])


def test_unread_tensors_of_an_unchanged_module_are_carried(tmp_path):
    extra = paro_checkpoint(tmp_path / "src")
    run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "o", exclude=("q_proj",)))
    got = read_tensors(tmp_path / "o")
    assert all(got[n].equal(t) for n, t in extra.items())


def test_keep_and_drop_on_the_same_tensor_is_a_usage_error(tmp_path):
    paro_checkpoint(tmp_path / "src")
    with pytest.raises(UsageError, match="both --keep and --drop"):
        run_repack(RepackJob(tmp_path / "src", "gptq_v2", tmp_path / "o", keep=("rot",), drop=(r"\.rot",),
                             dry_run=True))


@pytest.mark.parametrize("flag", ["include", "exclude", "keep", "drop"])
def test_regex_flags_are_bounded_in_length(tmp_path, flag):
    with pytest.raises(UsageError, match="at most 1000"):
        RepackJob(tmp_path, "gptq", **{flag: ("a" * 1001,)}).validate()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", HF_FORMATS)
def test_each_format_reads_only_the_names_repack_counts_as_read(fmt, act_order):
    """The reads-set that decides what is unread must cover every name the format's unpack looks at."""
    from qtool.formats import all_formats
    from qtool.repack.source import _reads

    seen = set()

    class Watch(dict):
        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

    f = get_format(fmt)
    if act_order and not f.spec.act_order:
        pytest.skip(f"{fmt} stores no act-order")
    p = random_plain(3, 128, 256, 4, 64, fmt == "gptq", act_order=act_order)
    f.unpack(Watch(f.pack(p)), params(p))
    assert seen and seen <= _reads(all_formats()[fmt], fmt), (fmt, seen)


# --- GGUF -> GGUF: metadata carried by its bytes, big-endian sources converted --------------------------------
def every_kind_of_metadata() -> list[bytes]:
    """Records of every GGUF value type: scalars, strings, arrays of numbers / strings / bools (short ones
    inline, long ones summarised by the reader), an empty array and a nested one."""
    import struct as s

    from tests.attacks.generate_corpus import ARRAY, STRING, gstr, kv_str, kv_u32, u32, u64

    def kv(key, vtype, payload):
        return gstr(key) + u32(vtype) + payload

    codes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    vals = {0: 200, 1: -5, 2: 60000, 3: -300, 4: 4_000_000_000, 5: -7, 6: 0.1, 7: True, 10: 2**60, 11: -2**60,
            12: 1e-300}
    recs = [kv_str("general.architecture", "llama"), kv_str("general.name", "round trip"),
            kv_u32("general.file_type", 2)]
    recs += [kv(f"test.scalar.{t}", t, s.pack("<" + c, vals[t])) for t, c in codes.items()]
    tokens = [f"tok{i}\u00e9" for i in range(300)]
    recs.append(kv("tokenizer.ggml.tokens", ARRAY, u32(STRING) + u64(len(tokens)) + b"".join(map(gstr, tokens))))
    recs.append(kv("test.short_strings", ARRAY, u32(STRING) + u64(2) + gstr("a") + gstr("")))
    recs.append(kv("tokenizer.ggml.scores", ARRAY, u32(6) + u64(300) + s.pack("<300f", *range(300))))
    recs.append(kv("test.i64s", ARRAY, u32(11) + u64(3) + s.pack("<3q", -1, 0, 2**62)))
    recs.append(kv("test.bools", ARRAY, u32(7) + u64(3) + bytes([1, 0, 1])))
    recs.append(kv("test.empty", ARRAY, u32(4) + u64(0)))
    recs.append(kv("test.nested", ARRAY, u32(ARRAY) + u64(2) + u32(5) + u64(1) + s.pack("<i", 3)
                   + u32(STRING) + u64(1) + gstr("x")))
    recs.append(kv("test.string", STRING, gstr("line\u2028two")))
    recs.append(kv_u32("general.quantization_version", 2))
    return recs


def test_gguf_to_gguf_metadata_round_trips_byte_for_byte(tmp_path):
    from qtool.io.gguf_reader import read_gguf_header
    from tests.attacks.generate_corpus import T_Q4_0, gguf_bytes, q4_0_rows, tensor_info

    src = tmp_path / "m.gguf"
    src.write_bytes(gguf_bytes(every_kind_of_metadata(), [tensor_info("blk.0.attn_q.weight", (64, 32), T_Q4_0, 0)],
                               q4_0_rows(32, 64, 1)))
    r = run_repack(RepackJob(src, "q8_0", tmp_path / "o.gguf"))
    assert r.plan.counts()["exact"] == 1
    a, b = read_gguf_header(src), read_gguf_header(tmp_path / "o.gguf")
    assert not b.problems and list(a.kv_spans) == list(b.kv_spans)  # same keys, same order
    ra, rb = src.read_bytes(), (tmp_path / "o.gguf").read_bytes()
    for key, (s0, e0) in a.kv_spans.items():
        s1, e1 = b.kv_spans[key]
        if key == "general.file_type":
            assert b.kv[key] == 7 and b.kv_types[key] == "UINT32"
        else:
            assert ra[s0:e0] == rb[s1:e1], key
    # and the gguf package reads the same values from both
    fa, fb = gguf.GGUFReader(src).fields, gguf.GGUFReader(tmp_path / "o.gguf").fields
    for key in a.kv_spans:
        if key != "general.file_type":
            assert fa[key].types == fb[key].types and fa[key].contents() == fb[key].contents(), key


def _endian_pair(tmp_path, types) -> tuple[Path, Path, dict]:
    """The same model written little- and big-endian by the gguf package's writer (it swaps float arrays and
    metadata; the fp16 scalars of Q4_0/Q8_0/Q4_1 blocks are swapped here, as llama.cpp's converter does)."""
    from qtool.io.gguf_reader import SWAPPABLE, to_little_endian

    rng = np.random.default_rng(3)
    tensors = {}
    for k, qt in enumerate(types):
        x = rng.standard_normal((8, 64)).astype(np.float32)
        name = f"blk.0.{('ffn_gate', 'ffn_up', 'ffn_down')[k]}.weight"
        tensors[name] = (qt, x if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
                         else gguf.quants.quantize(x, qt))
    tensors["output_norm.weight"] = (gguf.GGMLQuantizationType.F32, rng.standard_normal(64).astype(np.float32))
    tensors["blk.0.attn_norm.weight"] = (gguf.GGMLQuantizationType.F16, rng.standard_normal(64).astype(np.float16))
    out = []
    for endian in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"{endian.name.lower()}.gguf"
        w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
        w.add_name("endian")
        w.add_block_count(1)
        w.add_token_list([f"t{i}" for i in range(100)])
        w.add_token_scores([float(i) for i in range(100)])
        for name, (qt, data) in tensors.items():
            if data.dtype == np.uint8:
                if endian == gguf.GGUFEndian.BIG and qt.name in SWAPPABLE:  # an involution: it also makes big
                    data = to_little_endian(data.reshape(-1), qt.name).reshape(data.shape)
                w.add_tensor(name, data, raw_dtype=qt)
            else:
                w.add_tensor(name, data.copy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out.append(path)
    return out[0], out[1], tensors


def test_big_endian_gguf_converts_to_the_same_file_as_its_little_endian_twin(tmp_path):
    Q = gguf.GGMLQuantizationType
    little, big, tensors = _endian_pair(tmp_path, [Q.Q4_0, Q.Q8_0, Q.Q4_1])
    from qtool.io.gguf_reader import read_gguf_header

    assert read_gguf_header(big).byte_order == "big"
    for p in (little, big):
        run_repack(RepackJob(p, "q8_0", tmp_path / f"{p.stem}-o.gguf", allow_lossy=True))
    assert (tmp_path / "little-o.gguf").read_bytes() == (tmp_path / "big-o.gguf").read_bytes()
    r = gguf.GGUFReader(tmp_path / "big-o.gguf")
    got = {t.name: np.array(t.data) for t in r.tensors}
    assert np.array_equal(got["output_norm.weight"], tensors["output_norm.weight"][1])
    assert np.array_equal(got["blk.0.attn_norm.weight"], tensors["blk.0.attn_norm.weight"][1])
    q8 = got["blk.0.ffn_up.weight"]  # Q8_0 -> Q8_0 copies the blocks: the source's values, little-endian
    assert np.array_equal(gguf.quants.dequantize(q8, Q.Q8_0),
                          gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"][1], Q.Q8_0))
    assert r.fields["tokenizer.ggml.scores"].contents() == [float(i) for i in range(100)]
    # and into a safetensors layout: the same Plains from either byte order
    run_repack(RepackJob(little, "gptq_v2", tmp_path / "l-hf", allow_lossy=True, exclude=("ffn_down",)))
    run_repack(RepackJob(big, "gptq_v2", tmp_path / "b-hf", allow_lossy=True, exclude=("ffn_down",)))
    assert (tmp_path / "l-hf" / "model.safetensors").read_bytes() == (tmp_path / "b-hf" / "model.safetensors"
                                                                       ).read_bytes()


def test_big_endian_block_type_qtool_cannot_swap_is_refused(tmp_path):
    Q = gguf.GGMLQuantizationType
    _, big, _ = _endian_pair(tmp_path, [Q.Q4_0, Q.Q5_0])
    with pytest.raises(InputError, match="big-endian GGUF tensor of type Q5_0"):
        run_repack(RepackJob(big, "q8_0", tmp_path / "o.gguf", allow_lossy=True))
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("target", ["q8_0", "q4_0"])  # copied as it is, and converted
def test_gguf_to_gguf_keeps_three_dimensional_expert_stacks(tmp_path, target):
    """A mixture-of-experts stack [E, O, I] is converted by its rows, and written with its own dims: llama.cpp
    checks them (a flat [E * O, I] is refused)."""
    Q = gguf.GGMLQuantizationType
    x = np.random.default_rng(0).standard_normal((4 * 32, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(x, Q.Q8_0).reshape(4, 32, -1)
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_gate_exps.weight", blocks, raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    run_repack(RepackJob(tmp_path / "moe.gguf", target, tmp_path / "o.gguf", allow_lossy=True))
    (t,) = [t for t in gguf.GGUFReader(tmp_path / "o.gguf").tensors if t.name == "blk.0.ffn_gate_exps.weight"]
    assert [int(d) for d in t.shape] == [64, 32, 4] and t.tensor_type == Q[target.upper()]
    got = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(4 * 32, 64)
    want = gguf.quants.dequantize(blocks.reshape(4 * 32, -1), Q.Q8_0)
    if target == "q8_0":
        assert np.array_equal(got, want)
    else:  # requantized row by row, each row where it was
        assert min(np.corrcoef(g, v)[0, 1] for g, v in zip(got, want, strict=True)) > 0.95
    from qtool.inspect import inspect_path

    r = inspect_path(tmp_path / "moe.gguf")
    (m,) = [m for m in r.modules if "exps" in m.name]
    assert m.to_dict()["experts"] == 4 and (m.out_features, m.in_features) == (128, 64)
    assert any(p.shape == "4 x 32 x 64 (experts)" for p in r.patterns())
    from qtool.select.plan import path_groups

    groups, notes, _ = path_groups(tmp_path / "moe.gguf")  # a fused-MoE weight is no linear layer to plan
    assert groups == [] and any("1 gguf:Q8_0 mixture-of-experts stack(s) not planned" in n for n in notes)


def test_inspect_deep_reads_big_endian_gguf_data(tmp_path):
    """--deep decodes big-endian data after swapping its scalars: the same findings and statistics as the
    little-endian twin (it read them as little-endian: NaN scales, absmax 5e5)."""
    from qtool.inspect import inspect_path

    Q = gguf.GGMLQuantizationType
    little, big, _ = _endian_pair(tmp_path, [Q.Q4_0, Q.Q8_0, Q.Q4_1])
    a, b = (inspect_path(p, deep=True) for p in (little, big))
    assert [x.to_dict() for x in a.anomalies] == [x.to_dict() for x in b.anomalies]
    assert not [x for x in b.anomalies if x.severity == "error"]
    assert [m.stats for m in a.modules] == [m.stats for m in b.modules] and a.modules[0].stats
    (tmp_path / "q5").mkdir()
    _, big5, _ = _endian_pair(tmp_path / "q5", [Q.Q4_0, Q.Q5_0])
    said = [x.message for x in inspect_path(big5, deep=True).anomalies]
    assert any("deep check unavailable for big-endian gguf:Q5_0" in m for m in said), said
