"""What pack and repack carry from the source folder, and the configs they declare, as loaders read them:
a quantized LM head declared (`"lm_head": true`) or refused where AWQ cannot hold it, AWQ's one group size,
special files and stale indexes named rather than dropped or copied, a lone file's folder carried."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from safetensors.torch import save_file

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.errors import UsageError
from tests.test_pack import invoke

H, I, V = 64, 128, 64


def tiny_llama(root, tokenizer: bool = True) -> dict:
    """A two-layer Llama of 64-wide hidden states with an untied 64-row lm_head (a shape every integer layout
    holds), its config.json and a tokenizer file."""
    g = torch.Generator().manual_seed(0)
    w = lambda o, i: (torch.randn(o, i, generator=g) * 0.05).half()  # noqa: E731
    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": torch.ones(H).half(), "lm_head.weight": w(V, H)}
    for k in range(2):
        p = f"model.layers.{k}."
        for n, (o, i) in {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H // 2, H), "self_attn.v_proj": (H // 2, H),
                          "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
                          "mlp.down_proj": (H, I)}.items():
            t[p + n + ".weight"] = w(o, i)
        t[p + "input_layernorm.weight"] = torch.ones(H).half()
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V,
        "tie_word_embeddings": False, "torch_dtype": "float16"}))
    if tokenizer:
        (root / "tokenizer.json").write_text('{"vocab": {}}')
    return t


def qtool(*args):
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    return r


def quant_configs(out) -> list[dict]:
    return [json.loads((out / "config.json").read_text())["quantization_config"],
            json.loads((out / "quantize_config.json").read_text())]


def warnings_of(out) -> list[str]:
    name = "report.json" if (out / "report.json").exists() else "qtool_repack.json"
    return json.loads((out / name).read_text())["warnings"]


def refused(match: str, *args) -> UsageError:
    """The command refuses with a one-line usage error (exit 2) matching `match`, and writes nothing."""
    out = args[args.index("-o") + 1] if "-o" in args else None
    with pytest.raises(UsageError, match=match) as e:
        qtool(*args)
    assert e.value.exit_code == 2 and "\n" not in str(e.value) and e.value.fix
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".qtool-tmp-")]
    return e.value


# --- the LM head -----------------------------------------------------------------------------------------------
def test_a_quantized_lm_head_is_declared_and_repack_keeps_it(tmp_path):
    """vLLM's GPTQ configs and GPTQModel build the LM head packed only under `"lm_head": true`; with false they
    build a dense one and find no `lm_head.weight`. pack says true exactly when it quantizes the LM head, and a
    repack of such a checkpoint to another GPTQ layout says so too."""
    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "dense-head", "--group-size", 32, "-q")
    assert [c["lm_head"] for c in quant_configs(tmp_path / "dense-head")] == [False, False]
    qtool("pack", tmp_path / "src", "-o", tmp_path / "head", "--group-size", 32, "--include", "lm_head|layers", "-q")
    from qtool.io.checkpoint import open_checkpoint

    assert "lm_head.qweight" in open_checkpoint(tmp_path / "head").tensors
    assert [c["lm_head"] for c in quant_configs(tmp_path / "head")] == [True, True]
    qtool("repack", tmp_path / "head", "--to", "gptq_v2", "-o", tmp_path / "v2", "-q")
    assert "lm_head.qweight" in open_checkpoint(tmp_path / "v2").tensors
    assert [c["lm_head"] for c in quant_configs(tmp_path / "v2")] == [True, True]
    qtool("repack", tmp_path / "head", "--to", "marlin", "-o", tmp_path / "m", "-q")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]["lm_head"] is True
    qtool("repack", tmp_path / "dense-head", "--to", "marlin", "-o", tmp_path / "m-dense", "-q")
    assert json.loads((tmp_path / "m-dense" / "config.json").read_text())["quantization_config"]["lm_head"] is False


def test_awq_refuses_a_quantized_lm_head(tmp_path):
    """transformers' AWQ path and AutoAWQ keep the LM head dense and vLLM's AWQConfig builds it unquantized: an
    AWQ output holding it packed would not load, so pack refuses it at plan time and repack before publishing."""
    tiny_llama(tmp_path / "src")
    e = refused("cannot hold a quantized LM head", "pack", tmp_path / "src", "-o", tmp_path / "awq", "--to", "awq",
                "--group-size", 32, "--include", "lm_head|layers")
    assert e.tensor == "lm_head.weight" and e.path == str(tmp_path / "src") and "gptq_v2" in e.fix
    refused("cannot hold a quantized LM head", "pack", tmp_path / "src", "-o", tmp_path / "awq", "--to", "awq",
            "--group-size", 32, "--include", "lm_head|layers", "--dry-run")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "head", "--group-size", 32, "--include", "lm_head|layers", "-q")
    for extra in ((), ("--dry-run",)):  # refused by the plan: a dry run says so too
        e = refused("cannot hold a quantized LM head", "repack", tmp_path / "head", "--to", "awq", "-o",
                    tmp_path / "r-awq", "-q", *extra)
        assert e.tensor == "lm_head.qweight" and e.path == str(tmp_path / "head") and "gptq_v2" in e.fix


# --- AWQ's one group size --------------------------------------------------------------------------------------
def test_awq_refuses_more_than_one_group_size(tmp_path):
    """vLLM's AWQConfig/AWQMarlinConfig, transformers' AWQ path and AutoAWQ read one group_size and no `dynamic`:
    a down_proj at group 64 under a group-32 config would be built for 32. Refused at plan time, naming the
    modules and the fixes."""
    tiny_llama(tmp_path / "src")
    for extra in ((), ("--dry-run",)):
        e = refused("one scheme for every module", "pack", tmp_path / "src", "-o", tmp_path / "awq", "--to",
                    "awq", "--group-size", 32, "--tensor-type", "down_proj=4:64", *extra)
        assert "2 at 4-bit group 64 (model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj)" in e.problem
        assert e.tensor == "model.layers.0.mlp.down_proj.weight" and "--to gptq_v2" in e.fix


def test_awq_config_states_the_group_every_module_has(tmp_path):
    """--tensor-type giving every module group 64 under --group-size 32: the config's group_size is 64, the
    one AWQ loaders build every module with, with no per-module override."""
    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "awq", "--to", "awq", "--group-size", 32, "--tensor-type",
          ".=4:64", "-q")
    for q in quant_configs(tmp_path / "awq"):
        assert q["group_size"] == 64
        assert not [k for k in q.get("dynamic", {}) if k.startswith("+:")]


def test_repack_to_awq_refuses_a_mixed_source_and_regroups_on_request(tmp_path):
    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "mixed", "--to", "gptq_v2", "--asym", "--group-size", 32,
          "--tensor-type", "down_proj=4:64", "-q")
    for extra in ((), ("--dry-run",)):
        e = refused("an awq config holds one scheme", "repack", tmp_path / "mixed", "--to", "awq", "-o",
                    tmp_path / "awq", "-q", *extra)
        assert "model.layers.0.mlp.down_proj" in e.problem and "--group-size 32" in e.fix and "gptq_v2" in e.fix
        assert e.tensor == "model.layers.0.mlp.down_proj.qweight" and e.path == str(tmp_path / "mixed")
    qtool("repack", tmp_path / "mixed", "--to", "awq", "--group-size", 32, "-o", tmp_path / "awq", "-q")
    q = quant_configs(tmp_path / "awq")[0]
    assert q["group_size"] == 32 and not q.get("dynamic")


def test_repack_to_awq_refuses_before_converting_a_module(tmp_path, monkeypatch):
    """The AWQ rules are the plan's: no module is converted (nor a temporary output begun) before the refusal."""
    from qtool.repack.run import ModuleConverter

    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "mixed", "--to", "gptq_v2", "--asym", "--group-size", 32,
          "--tensor-type", "down_proj=4:64", "-q")

    def converted(*_a, **_k):
        raise AssertionError("a module was converted before the refusal")

    monkeypatch.setattr(ModuleConverter, "convert", converted)
    refused("an awq config holds one scheme", "repack", tmp_path / "mixed", "--to", "awq", "-o", tmp_path / "awq",
            "-q")


def test_pack_and_repack_refuse_awq_by_one_rule(tmp_path):
    """pack and repack state the same AWQ problem (qtool.formats.awq.awq_mismatch), each with its own fixes."""
    tiny_llama(tmp_path / "src")
    p = refused("one scheme", "pack", tmp_path / "src", "-o", tmp_path / "a", "--to", "awq", "--asym",
                "--group-size", 32, "--tensor-type", "down_proj=4:64", "--dry-run")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "mixed", "--to", "gptq_v2", "--asym", "--group-size", 32,
          "--tensor-type", "down_proj=4:64", "-q")
    r = refused("one scheme", "repack", tmp_path / "mixed", "--to", "awq", "-o", tmp_path / "b", "--dry-run")
    assert r.problem == p.problem + "; nothing was written"
    assert "--tensor-type" in p.fix and "--group-size 32" in r.fix


# --- special files, indexes ----------------------------------------------------------------------------------
def _specials(folder) -> None:
    os.mkfifo(folder / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(folder / "sock"))
    s.close()


def test_top_level_fifo_and_socket_are_named(tmp_path):
    """A FIFO or socket at the top of the source folder is not copied and is named, as one in a sub-folder is,
    by pack and by repack."""
    tiny_llama(tmp_path / "src")
    _specials(tmp_path / "src")
    (tmp_path / "src" / "sub").mkdir()
    os.mkfifo(tmp_path / "src" / "sub" / "fifo2")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "out", "--group-size", 32, "-q")
    w = warnings_of(tmp_path / "out")
    for name in ("fifo", "sock", "sub/fifo2"):
        assert f"{name}: not copied: not a regular file" in w, w
        assert not os.path.lexists(tmp_path / "out" / name)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    _specials(tmp_path / "out")
    qtool("repack", tmp_path / "out", "--to", "gptq_v2", "-o", tmp_path / "r", "-q")
    w = warnings_of(tmp_path / "r")
    assert {"fifo: not copied: not a regular file", "sock: not copied: not a regular file"} <= set(w), w


def _shards(folder, index_name: str) -> None:
    """The tiny model split into two shards named by `index_name`, beside its config and tokenizer."""
    t = tiny_llama(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(t)
    a, b = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: t[k] for k in a}, folder / "a.safetensors", metadata={"format": "pt"})
    save_file({k: t[k] for k in b}, folder / "b.safetensors", metadata={"format": "pt"})
    wm = {**{k: "a.safetensors" for k in a}, **{k: "b.safetensors" for k in b}}
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def test_the_index_read_is_never_copied_and_other_indexes_are_named(tmp_path):
    """An index maps tensors to the source's shards, which an output does not hold: the one the checkpoint was
    read through (whatever its name) is replaced by the output's own; any other *.safetensors.index.json is
    not copied either, and named."""
    _shards(tmp_path / "src", "custom.index.json")
    qtool("pack", tmp_path / "src" / "custom.index.json", "-o", tmp_path / "out", "--group-size", 32, "-q")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors", "quantize_config.json", "report.json", "report.md", "tokenizer.json"]
    assert not [w for w in warnings_of(tmp_path / "out") if "index" in w]
    (tmp_path / "src" / "model.safetensors.index.json").write_text(
        (tmp_path / "src" / "custom.index.json").read_text())
    (tmp_path / "src" / "old.safetensors.index.json").write_text('{"weight_map": {}}')
    qtool("pack", tmp_path / "src" / "custom.index.json", "-o", tmp_path / "out2", "--group-size", 32, "-q")
    assert not list((tmp_path / "out2").glob("*.index.json"))
    w = [x for x in warnings_of(tmp_path / "out2") if "index" in x]
    assert sorted(x.split(":")[0] for x in w) == ["model.safetensors.index.json", "old.safetensors.index.json"]
    assert all("not copied: a shard index other than the one read" in x for x in w)
    # read through model.safetensors.index.json (the directory): that one is replaced, old.* is named
    qtool("pack", tmp_path / "src", "-o", tmp_path / "out3", "--group-size", 32, "-q")
    assert not list((tmp_path / "out3").glob("*.safetensors.index.json"))
    assert [x.split(":")[0] for x in warnings_of(tmp_path / "out3") if "index" in x] == ["old.safetensors.index.json"]


def test_repack_does_not_copy_a_custom_index(tmp_path):
    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "q", "--group-size", 32, "--max-shard-size", "40KB", "-q")
    (tmp_path / "q" / "model.safetensors.index.json").rename(tmp_path / "q" / "custom.index.json")
    qtool("repack", tmp_path / "q" / "custom.index.json", "--to", "gptq_v2", "-o", tmp_path / "r", "-q")
    assert not (tmp_path / "r" / "custom.index.json").exists()
    assert (tmp_path / "r" / "tokenizer.json").is_file()


def test_a_pickle_shard_index_is_never_copied_and_is_named(tmp_path):
    """pytorch_model.bin.index.json maps tensors to pickle shards, which qtool never reads or writes: pack, repack
    and repack --to dense leave it out (an output holding it would point at files it does not have) and say so."""
    tiny_llama(tmp_path / "src")
    index = '{"weight_map": {"lm_head.weight": "pytorch_model-00001-of-00002.bin"}}'
    (tmp_path / "src" / "pytorch_model.bin.index.json").write_text(index)
    said = ("pytorch_model.bin.index.json: not copied: the index of pickle shards, which qtool never reads or "
            "writes (it would name files the output does not hold)")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "q", "--group-size", 32, "-q")
    outs = [tmp_path / "q"]
    (tmp_path / "q" / "pytorch_model.bin.index.json").write_text(index)  # the pack output as the repack source
    for to in ("gptq_v2", "dense"):
        qtool("repack", tmp_path / "q", "--to", to, "-o", tmp_path / to, "-q")
        outs.append(tmp_path / to)
    for out in outs:
        assert said in warnings_of(out), (out, warnings_of(out))
        assert (out / "tokenizer.json").is_file()
    assert not [out for out in outs[1:] if (out / "pytorch_model.bin.index.json").exists()]


# --- a lone file -----------------------------------------------------------------------------------------------
def test_a_lone_file_carries_its_folders_files(tmp_path):
    """dir/model.safetensors reads its config from dir/config.json, and the loaders read the tokenizer beside it:
    the output carries the folder's files as `pack dir` does (so `qtool eval` finds a tokenizer). Sub-folders
    are named, not copied: an output written beside the file lies among them."""
    tiny_llama(tmp_path / "src")
    (tmp_path / "src" / "vocab.txt").write_text("a\n")
    (tmp_path / "src" / "1_Pooling").mkdir()
    (tmp_path / "src" / "1_Pooling" / "config.json").write_text("{}")
    qtool("pack", tmp_path / "src" / "model.safetensors", "-o", tmp_path / "out", "--group-size", 32, "-q")
    for name in ("tokenizer.json", "vocab.txt"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    assert not (tmp_path / "out" / "1_Pooling").exists()
    assert any(w.startswith("1_Pooling/: sub-directory not copied") for w in warnings_of(tmp_path / "out"))


def test_a_lone_file_without_config_names_what_it_leaves(tmp_path):
    tiny_llama(tmp_path / "src")
    (tmp_path / "src" / "config.json").unlink()
    qtool("pack", tmp_path / "src" / "model.safetensors", "-o", tmp_path / "out", "--group-size", 32, "-q")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert any(w.startswith("model.safetensors: no config.json beside it") and "tokenizer.json" in w
               for w in warnings_of(tmp_path / "out"))


def test_repack_beside_a_lone_file_leaves_its_own_output_out(tmp_path):
    """repack's default output of dir/model.safetensors is dir/model-<target>: the run's temporary directory
    and an earlier output there are never copied into the new output."""
    tiny_llama(tmp_path / "src")
    qtool("pack", tmp_path / "src", "-o", tmp_path / "q", "--group-size", 32, "-q")
    for _ in range(2):
        qtool("repack", tmp_path / "q" / "model.safetensors", "--to", "gptq_v2", "--force", "-q")
    out = tmp_path / "q" / "model-gptq_v2"
    assert (out / "tokenizer.json").is_file() and not [p for p in out.iterdir() if p.is_dir()]
    w = warnings_of(out)
    assert not [x for x in w if ".qtool-tmp" in x]
    assert "model-gptq_v2/: sub-directory not copied" in " ".join(w)
