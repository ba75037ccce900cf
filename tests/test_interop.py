"""Outputs the real loaders open (qtool/io/hf_gguf.py, qtool/repack/interop.py): tiny synthetic BERT and Llama
models go to GGUF and back, read by the gguf package's own reader. The real loaders (llama.cpp, transformers,
sentence-transformers) run in benchmarks/interop/, outside CI."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.formats import dequantize, get_format
from qtool.inspect import inspect_path
from qtool.io.gguf_writer import name_mapper
from qtool.io.hf_gguf import (
    ARCHS,
    PHANTOM,
    blocks_present,
    gguf_to_hf_name,
    inverse_name_map,
    rotary_rows,
)
from qtool.pack import PackJob, run_pack
from qtool.repack.plan import RepackJob
from qtool.repack.run import run_repack

H, LAYERS, VOCAB = 64, 2, 40


def _bert_dir(root: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    t = {"embeddings.word_embeddings.weight": torch.randn(VOCAB, H, generator=g),
         "embeddings.position_embeddings.weight": torch.randn(16, H, generator=g),
         "embeddings.token_type_embeddings.weight": torch.randn(2, H, generator=g),
         "embeddings.LayerNorm.weight": torch.ones(H), "embeddings.LayerNorm.bias": torch.zeros(H),
         "embeddings.position_ids": torch.arange(16).reshape(1, 16),
         "pooler.dense.weight": torch.randn(H, H, generator=g), "pooler.dense.bias": torch.zeros(H)}
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        for n, (o, k) in {"attention.self.query": (H, H), "attention.self.key": (H, H),
                          "attention.self.value": (H, H), "attention.output.dense": (H, H),
                          "intermediate.dense": (2 * H, H), "output.dense": (H, 2 * H)}.items():
            t[p + n + ".weight"] = torch.randn(o, k, generator=g)
            t[p + n + ".bias"] = torch.zeros(o)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = torch.ones(H), torch.zeros(H)
    root.mkdir()
    save_file(t, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": H, "intermediate_size": 2 * H,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "max_position_embeddings": 16,
        "layer_norm_eps": 1e-12, "type_vocab_size": 2, "vocab_size": VOCAB}))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 10)] + \
        [f"##s{i}" for i in range(5)]
    (root / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": i, "content": c, "special": True} for i, c in enumerate(vocab[:5])],
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {w: i for i, w in enumerate(vocab)}}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"cls_token": "[CLS]", "sep_token": "[SEP]",
                                                            "unk_token": "[UNK]", "pad_token": "[PAD]",
                                                            "mask_token": "[MASK]"}))
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": H,
                                                                "pooling_mode_mean_tokens": True}))
    return root


def _llama_dir(root: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    n_head, n_kv, ff = 4, 2, 96
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g), "model.norm.weight": torch.ones(H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for n, (o, k) in {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H // n_head * n_kv, H),
                          "self_attn.v_proj": (H // n_head * n_kv, H), "self_attn.o_proj": (H, H),
                          "mlp.gate_proj": (ff, H), "mlp.up_proj": (ff, H), "mlp.down_proj": (H, ff)}.items():
            t[p + n + ".weight"] = torch.randn(o, k, generator=g)
        t[p + "input_layernorm.weight"] = torch.ones(H)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H)
    root.mkdir()
    save_file(t, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": ff,
        "num_hidden_layers": LAYERS, "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": VOCAB,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": True}))
    chars = [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 4)]
    vocab = {"<s>": 0, "</s>": 1} | {c: i + 2 for i, c in enumerate(chars)} | {"ab": VOCAB - 2, "abc": VOCAB - 1}
    (root / "tokenizer.json").write_text(json.dumps({
        "added_tokens": [{"id": 0, "content": "<s>", "special": True}, {"id": 1, "content": "</s>", "special": True}],
        "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]}}))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": "{{ messages }}"}))
    return root


def _kv(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _gguf_weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(tuple(reversed(
            [int(x) for x in t.shape])))
    return out


@pytest.mark.parametrize("arch,names", [
    ("bert", ["embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.token_type_embeddings",
              "embeddings.LayerNorm", "encoder.layer.1.attention.self.query", "encoder.layer.1.attention.self.key",
              "encoder.layer.1.attention.self.value", "encoder.layer.1.attention.output.dense",
              "encoder.layer.1.attention.output.LayerNorm", "encoder.layer.1.intermediate.dense",
              "encoder.layer.1.output.dense", "encoder.layer.1.output.LayerNorm"]),
    ("llama", ["model.embed_tokens", "model.norm", "lm_head", "model.layers.1.self_attn.q_proj",
               "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
               "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
               "model.layers.1.mlp.down_proj", "model.layers.1.input_layernorm",
               "model.layers.1.post_attention_layernorm"])])
def test_name_maps_invert_each_other(arch, names):
    """Every transformers tensor name of the family goes to its GGUF name (the gguf package's map) and the
    inverted map brings it back."""
    fwd, inv = name_mapper(arch, 2), inverse_name_map(arch, 2)
    for n in names:
        g = fwd(n + ".weight")
        assert g != n + ".weight" and gguf_to_hf_name(inv, g) == n + ".weight", (n, g)


def test_rotary_rows_are_llama_cpps_permutation_and_invert():
    w = torch.arange(48 * 3).reshape(48, 3)
    for heads in (1, 2, 4):
        ref = w.reshape(heads, 2, 48 // heads // 2, 3).swapaxes(1, 2).reshape(48, 3)
        to = w[rotary_rows(48, heads, True)]
        assert torch.equal(to, ref) and torch.equal(to[rotary_rows(48, heads, False)], w)
    with pytest.raises(Exception, match="do not split into 5 heads"):
        rotary_rows(48, 5, True)


def test_bert_pack_keeps_pooler_dense_and_names_the_blocks_and_carries_pooling(tmp_path):
    src = _bert_dir(tmp_path / "bert")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32))
    cfg = json.loads((tmp_path / "g32" / "config.json").read_text())["quantization_config"]
    assert cfg["block_name_to_quantize"] == "encoder.layer"
    assert "pooler.dense.qweight" not in load_file(tmp_path / "g32" / "model.safetensors")
    assert json.loads((tmp_path / "g32" / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    run_pack(PackJob(src, tmp_path / "awq", to="awq", bits=4, group_size=32))
    acfg = json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]
    assert acfg["modules_to_not_convert"] == ["pooler.dense"]
    assert not [a for a in inspect_path(tmp_path / "g32").anomalies if "will not load" in a.message]
    run_repack(RepackJob(tmp_path / "g32", "gptq_v2", tmp_path / "v2"))  # a repacked config names them too
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["quantization_config"][
        "block_name_to_quantize"] == "encoder.layer"


def test_bert_gguf_has_what_llama_cpp_reads(tmp_path):
    src = _bert_dir(tmp_path / "bert")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32))
    r = run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "m.gguf"))
    kv = _kv(tmp_path / "m.gguf")
    assert kv["general.architecture"] == "bert" and kv["tokenizer.ggml.model"] == "bert"
    assert kv["bert.block_count"] == LAYERS and kv["bert.embedding_length"] == H
    assert kv["bert.attention.head_count"] == 4 and kv["bert.context_length"] == 16
    assert kv["bert.attention.causal"] is False and kv["bert.pooling_type"] == int(gguf.PoolingType.MEAN)
    assert kv["tokenizer.ggml.token_type_count"] == 2
    tokens = kv["tokenizer.ggml.tokens"]
    assert tokens[:3] == ["[PAD]", "[UNK]", "[CLS]"] and tokens[5] == PHANTOM + "w0" and tokens[-1] == "s4"
    assert kv["tokenizer.ggml.token_type"][:6] == [3, 3, 3, 3, 3, 1]
    assert kv["tokenizer.ggml.seperator_token_id"] == 3 and kv["tokenizer.ggml.padding_token_id"] == 0
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert "position_embd.weight" in names and "token_types.weight" in names
    assert not any("pooler" in n or "position_ids" in n for n in names)
    assert sum("left out of the GGUF" in w for w in r.plan.warnings) == 3  # position_ids, pooler weight, bias
    assert [a for a in inspect_path(tmp_path / "m.gguf").anomalies if "will not load" in a.message] == []


def test_llama_round_trip_gguf_and_back_is_exact(tmp_path):
    """HF gptq (g32 sym) -> GGUF Q4_0: q/k rows in llama.cpp's order, tokenizer and hyperparameters written;
    -> ct: transformers' names, rows back, config and tokenizer files; -> GGUF again: the same tensor bytes."""
    src = _llama_dir(tmp_path / "llama")
    run_pack(PackJob(src, tmp_path / "g32", to="gptq", bits=4, group_size=32, sym=True))
    r = run_repack(RepackJob(tmp_path / "g32", "q4_0", tmp_path / "a.gguf"))
    assert all(m.kind == "exact" for m in r.plan.modules)
    kv = _kv(tmp_path / "a.gguf")
    assert kv["llama.rope.dimension_count"] == H // 4 and kv["llama.attention.head_count_kv"] == 2
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.merges"] == ["a b", "ab c"]
    assert kv["tokenizer.ggml.bos_token_id"] == 0 and kv["tokenizer.chat_template"] == "{{ messages }}"
    assert kv["tokenizer.ggml.token_type"][:3] == [3, 3, 1]
    ggw = _gguf_weights(tmp_path / "a.gguf")
    packed = load_file(tmp_path / "g32" / "model.safetensors")
    fmt = get_format("gptq")

    def hf_weight(mod):
        from qtool.scheme import QuantScheme

        p = fmt.unpack({s: packed[f"{mod}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")},
                       QuantScheme(bits=4, group_size=32, sym=True))
        return dequantize(p, torch.float32)

    q, k = hf_weight("model.layers.1.self_attn.q_proj"), hf_weight("model.layers.1.self_attn.k_proj")
    assert torch.equal(ggw["blk.1.attn_q.weight"], q[rotary_rows(H, 4, True)])
    assert torch.equal(ggw["blk.1.attn_k.weight"], k[rotary_rows(k.shape[0], 2, True)])
    assert torch.equal(ggw["blk.1.attn_v.weight"], hf_weight("model.layers.1.self_attn.v_proj"))

    r2 = run_repack(RepackJob(tmp_path / "a.gguf", "ct", tmp_path / "ct"))
    assert {m.kind for m in r2.plan.modules} == {"exact"}
    out = tmp_path / "ct"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, H // 4)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    tok = json.loads((out / "tokenizer.json").read_text())
    assert tok["model"]["merges"] == ["a b", "ab c"] and tok["model"]["vocab"]["abc"] == VOCAB - 1
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<s>" and tcfg["chat_template"] == "{{ messages }}"
    ct = load_file(out / "model.safetensors")
    assert "model.layers.1.self_attn.q_proj.weight_packed" in ct
    assert torch.equal(ct["model.embed_tokens.weight"], load_file(src / "model.safetensors")[
        "model.embed_tokens.weight"])  # F32 carried to GGUF and back, as it was

    r3 = run_repack(RepackJob(out, "q4_0", tmp_path / "b.gguf"))
    assert all(m.kind == "exact" for m in r3.plan.modules)
    a, b = gguf.GGUFReader(tmp_path / "a.gguf").tensors, gguf.GGUFReader(tmp_path / "b.gguf").tensors
    assert [t.name for t in a] == [t.name for t in b]
    assert all(np.array_equal(np.array(x.data), np.array(y.data)) for x, y in zip(a, b, strict=True))
    kv2 = _kv(tmp_path / "b.gguf")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.rope.dimension_count",
                "llama.attention.head_count_kv", "tokenizer.ggml.bos_token_id"):
        assert kv2[key] == kv[key], key


def test_inspect_warns_what_loaders_lack(tmp_path):
    src = _bert_dir(tmp_path / "bert")
    run_pack(PackJob(src, tmp_path / "g", to="gptq", bits=4, group_size=32))
    import shutil

    shutil.rmtree(tmp_path / "g" / "1_Pooling")
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    del cfg["model_type"]
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    msgs = [a.message for a in inspect_path(tmp_path / "g").anomalies if a.severity == "warning"]
    assert any(m.startswith("transformers will not load it: config.json has no model_type") for m in msgs)
    assert any("modules.json names '1_Pooling', which is not here" in m for m in msgs)


def test_blocks_present_bounds_the_map():
    assert blocks_present(["a.3.b", "c"]) == 4 and blocks_present(["x"]) == 0
    assert set(ARCHS) >= {"bert", "llama"}
