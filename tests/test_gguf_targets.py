"""GGUF files llama.cpp loads: 1-D tensors in F32 (its norms and bias adds take no F16), RoPE scaling and head
widths carried as its keys and tensor, every tensor named or the file flagged, --tensor-type by GGUF names,
a tokenizer that fits the embedding table, and the record of a module kept out of the conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.errors import InputError
from qtool.io.hf_gguf import hf_config, hf_metadata, rope_factors
from qtool.pack import PackJob, run_pack
from qtool.repack.plan import RepackJob
from qtool.repack.run import run_repack
from tests.test_interop import H, _kv, _llama_dir


def _fp16_llama(root: Path, q_bias: bool = True, **cfg_changes) -> Path:
    """test_interop's tiny Llama in fp16, with a bias on q (unless q_bias=False) and config changes."""
    src = _llama_dir(root)
    t = {k: v.half() if v.is_floating_point() else v for k, v in load_file(src / "model.safetensors").items()}
    g = torch.Generator().manual_seed(3)
    if q_bias:
        t["model.layers.0.self_attn.q_proj.bias"] = torch.randn(H, generator=g).half()
    t["model.layers.0.input_layernorm.weight"] = (torch.rand(H, generator=g) + 0.5).half()
    save_file(t, src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text()) | cfg_changes
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _gguf(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_one_dimensional_tensors_are_f32(tmp_path):
    src = _fp16_llama(tmp_path / "llama")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf"))
    ts = _gguf(tmp_path / "m.gguf")
    ones = {n: t for n, t in ts.items() if len(t.shape) == 1}
    assert {"output_norm.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.bias"} <= set(ones)
    assert {t.tensor_type for t in ones.values()} == {gguf.GGMLQuantizationType.F32}
    dense = load_file(src / "model.safetensors")
    norm = np.array(ones["blk.0.attn_norm.weight"].data)
    assert np.array_equal(norm, dense["model.layers.0.input_layernorm.weight"].float().numpy())  # exact widening


def test_rope_scaling_and_head_width_are_carried(tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    src = _fp16_llama(tmp_path / "l3", rope_scaling=llama3)
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    r = run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "l3.gguf"))
    freqs = _gguf(tmp_path / "l3.gguf")["rope_freqs.weight"]
    want = rope_factors("llama", json.loads((src / "config.json").read_text()))
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(np.array(freqs.data), want)
    assert want[0] == 1.0 and want[-1] == 8.0 and len(want) == H // 4 // 2  # short waves kept, long ones / factor
    assert any(w.startswith("rope_freqs.weight: llama3 RoPE scaling") for w in r.plan.warnings)

    base = {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1}
    kv, warns = hf_metadata("llama", base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 4096},
                                             "head_dim": 64}, None, None)
    got = {k: v[1] for k, v in kv.items()}
    assert got["llama.rope.scaling.type"] == "yarn" and got["llama.rope.scaling.factor"] == 4.0
    assert got["llama.rope.scaling.original_context_length"] == 4096
    assert got["llama.attention.key_length"] == got["llama.attention.value_length"] == 64 and warns == []
    back = hf_config("llama", got, [])
    assert back["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert back["head_dim"] == 64
    kv, warns = hf_metadata("llama", base | {"head_dim": 32}, None, None)  # 128 / 4: llama.cpp's own default
    assert "llama.attention.key_length" not in kv and warns == []
    _, warns = hf_metadata("llama", base | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None, None)
    assert len(warns) == 1 and warns[0].startswith("config.json rope_scaling 'dynamic' (factor 2.0) is not written")
    with pytest.raises(InputError, match="rope_scaling"):
        rope_factors("llama", base | {"rope_scaling": {"rope_type": "llama3", "factor": "x"}})


def test_transformers_5_rope_parameters_are_read(tmp_path):
    """transformers 5 saves the RoPE base and scaling as one `rope_parameters` mapping (no top-level
    rope_theta): the GGUF gets the same base and factors as from the flat keys."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    src = _fp16_llama(tmp_path / "v5", rope_parameters={**llama3, "rope_theta": 500000.0})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_theta", None)
    (src / "config.json").write_text(json.dumps(cfg))
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "v5.gguf"))
    assert _kv(tmp_path / "v5.gguf")["llama.rope.freq_base"] == 500000.0
    flat = {k: v for k, v in cfg.items() if k != "rope_parameters"} | {"rope_theta": 500000.0, "rope_scaling": llama3}
    freqs = np.array(_gguf(tmp_path / "v5.gguf")["rope_freqs.weight"].data)
    assert np.array_equal(freqs, rope_factors("llama", flat)) and freqs.max() == 8.0
    base = {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1}
    _, warns = hf_metadata("llama", base | {"rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                                                "sliding_attention": {"rope_theta": 1e4}}}, None, None)
    assert any("one mapping per attention type" in w for w in warns)


def test_llama3_factors_are_transformers_own():
    """rope_freqs divides each rotary frequency: the frequencies it leaves are transformers' llama3 ones."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**cfg), "cpu")
    plain = 1.0 / 500000.0 ** (np.arange(0, 128, 2, dtype=np.float64) / 128)
    f = rope_factors("llama", cfg)
    assert f.dtype == np.float32 and len(f) == 64 and {f[0], f[-1]} == {np.float32(1.0), np.float32(8.0)}
    np.testing.assert_allclose(plain / f, scaled.double().numpy(), rtol=1e-6)


def test_unmapped_tensors_type_rules_and_kept_modules_are_told(tmp_path):
    src = _fp16_llama(tmp_path / "llama")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(H // 4).half()
    save_file(t, src / "model.safetensors")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    r = run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf", allow_lossy=True,
                             tensor_type=("attn_q=Q8_0",), exclude=("mlp\\.down_proj",)))
    assert any(w.startswith("1 tensors have no llama.cpp name for llama (e.g. 'model.layers.0.self_attn.q_norm.weight')")
               for w in r.plan.warnings), r.plan.warnings
    ts = _gguf(tmp_path / "m.gguf")
    assert ts["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0  # named by its GGUF name
    assert ts["blk.0.attn_k.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    kept = next(m for m in r.plan.modules if m.module == "model.layers.0.mlp.down_proj")
    assert (kept.kind, kept.copy, kept.steps) == ("keep", False, ["dequantize to F16"])
    assert "written as its dequantized weight in F16" in kept.reasons[0]
    assert ts["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F16


def test_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path):
    src = _fp16_llama(tmp_path / "llama")
    t = load_file(src / "model.safetensors")
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:-3].contiguous()
    save_file(t, src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] -= 3
    (src / "config.json").write_text(json.dumps(cfg))
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    with pytest.raises(InputError, match="the tokenizer has 40 tokens but the embedding table 37 rows"):
        run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("orig,warp", [(64, None), (32, None), (64, "bend")])
def test_gguf_rope_freqs_back_to_rope_scaling(tmp_path, orig, warp):
    """A llama3 GGUF's rope_freqs becomes config.json rope_scaling again where that gives back every factor bit
    for bit (64: two frequencies inside the smooth band, enough to fit it), in both writers (dense and
    quantized); otherwise (32: one in the band; or factors no llama3 scaling makes) the tensor keeps its
    GGUF name and the plan says that transformers runs unscaled RoPE."""
    from qtool.repack.dense import DenseJob, plan_dense, run_dense

    src = _fp16_llama(tmp_path / "llama", q_bias=False, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                      "original_max_position_embeddings": orig})
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf"))
    gg = tmp_path / "m.gguf"
    want = np.array(_gguf(gg)["rope_freqs.weight"].data)
    assert _kv(gg)["llama.rope.dimension_count"] == H // 4
    if warp:  # the same file with one factor moved off the llama3 curve, in place
        gg = tmp_path / "bent.gguf"
        shutil.copyfile(tmp_path / "m.gguf", gg)
        t = _gguf(gg)["rope_freqs.weight"]
        with open(gg, "r+b") as f:
            f.seek(t.data_offset + 4)
            f.write((want[1:2] * np.float32(1.01)).astype(np.float32).tobytes())
        assert np.array(_gguf(gg)["rope_freqs.weight"].data)[1] != want[1]
    folded = orig == 64 and not warp
    _, plan = plan_dense(DenseJob(gg, tmp_path / "d", dry_run=True))
    if folded:
        assert any(w.startswith("rope_freqs.weight: llama3 RoPE factors written as config.json rope_scaling")
                   and "bit for bit" in w for w in plan.warnings), plan.warnings
    else:
        assert any(w.startswith("rope_freqs.weight: its per-frequency RoPE factors match no llama3 rope_scaling")
                   for w in plan.warnings), plan.warnings
        assert any("rope_freqs.weight" in w and "no transformers name" in w for w in plan.warnings)
    run_dense(DenseJob(gg, tmp_path / "d"))
    r = run_repack(RepackJob(gg, "gptq", tmp_path / "q", allow_lossy=True))
    assert any(w.startswith("rope_freqs.weight: ") for w in r.plan.warnings)
    for out in (tmp_path / "d", tmp_path / "q"):
        cfg = json.loads((out / "config.json").read_text())
        names = set(load_file(out / "model.safetensors"))
        assert ("rope_freqs.weight" in names) is not folded
        if folded:
            assert cfg["rope_scaling"]["original_max_position_embeddings"] == 64
            got = rope_factors("llama", cfg)
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
        else:
            assert "rope_scaling" not in cfg


def test_a_quantized_module_llama_cpp_does_not_load_is_left_out(tmp_path):
    """BERT's pooler, quantized on request, has no place in llama.cpp's graph: it is planned dropped and
    absent from the file (not written dequantized, not converted)."""
    from tests.test_interop import _bert_dir

    src = _bert_dir(tmp_path / "bert")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True,
                     include=(r"pooler\.dense", r"encoder\.")))
    r = run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf"))
    pooler = next(m for m in r.plan.modules if m.module == "pooler.dense")
    assert pooler.kind == "dropped" and pooler.reasons[0].startswith("left out of the GGUF")
    assert not any("pooler" in n for n in _gguf(tmp_path / "m.gguf"))


@pytest.mark.parametrize("cfg,want,said", [
    ({"pooling_mode_mean_tokens": True}, "MEAN", None),          # sentence-transformers <= 5
    ({"pooling_mode": "mean"}, "MEAN", None),                    # 6
    ({"pooling_mode": "cls"}, "CLS", None),
    ({"pooling_mode": "max"}, None, "pooling_mode 'max' has no llama.cpp pooling type"),
    ({"pooling_mode_max_tokens": True}, None, "pooling_mode_max_tokens: no llama.cpp pooling type"),
])
def test_pooling_type_from_either_sentence_transformers_config(tmp_path, cfg, want, said):
    from qtool.io.hf_gguf import pooling_type

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    got, warns = pooling_type(tmp_path)
    assert got == want and (warns == [] if said is None else len(warns) == 1 and said in warns[0])


def test_yarn_parameters_go_to_the_gguf_and_back():
    """beta_fast / beta_slow / attention_factor / extrapolation_factor are llama.cpp's yarn_* keys (its
    converter's mapping), and come back into rope_scaling; a YaRN key llama.cpp has none for is said."""
    from qtool.io.hf_gguf import uncarried_keys

    base = {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 8.0,
            "beta_slow": 2.0, "attention_factor": 0.75, "extrapolation_factor": 1.0}
    kv, warns = hf_metadata("llama", base | {"rope_scaling": yarn}, None, None)
    got = {k: v[1] for k, v in kv.items()}
    assert got["llama.rope.scaling.yarn_beta_fast"] == 8.0 and got["llama.rope.scaling.yarn_attn_factor"] == 0.75
    assert warns == [] and uncarried_keys("llama", got) == []
    assert hf_config("llama", got, [])["rope_scaling"] == yarn
    _, warns = hf_metadata("llama", base | {"rope_scaling": yarn | {"mscale": 0.7}}, None, None)
    assert len(warns) == 1 and "yarn mscale: llama.cpp has no key for it" in warns[0]
