"""`qtool select CHECKPOINT` end to end through the CLI (issue #26): real INT8 W8A8, W4A8 and FP8 files are
detected through inspect and planned per engine and device, and the JSON says which kernel and why.

The checkpoints: compressed-tensors' own INT8 / FP8 / W4A8 files (tests/fixtures/ct-float, ct-w4a8: written by
compressed-tensors 0.20, PROVENANCE.md), and what `qtool pack --to ct_int8 / ct_fp8 / fp8` writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import qtool.cli.main  # noqa: F401  (registers the commands)
from qtool.cli.app import app
from qtool.formats import get_format
from qtool.formats.plain import dequantize
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES, write_llama

runner = CliRunner()
W4A8 = FIXTURES / "ct-w4a8" / "compressed-tensors-w4afp8"
CT_INT8 = FIXTURES / "ct-float" / "compressed-tensors-int8"
CT_FP8 = FIXTURES / "ct-float" / "compressed-tensors-fp8"


def select(path, *args) -> tuple[int, dict]:
    """Exit status (the command's return value: 0 every layer has a kernel, 1 some has none) and JSON."""
    r = runner.invoke(app, ["select", str(path), "--json", *map(str, args)], standalone_mode=False)
    assert r.exception is None, r.output
    return r.return_value or 0, json.loads(r.stdout)


def by_name(d: dict) -> dict[str, dict]:
    return {x["name"].rsplit(".", 1)[-1]: x for x in d["layers"]}


def cand(layer: dict, kernel: str) -> dict:
    return next(c for c in layer["candidates"] if c["kernel"] == kernel)


# --- W4A8 ------------------------------------------------------------------------------------------------

def test_w4a8_fixture_is_pack_quantized_and_decodes_bit_exactly():
    # the layout is compressed-tensors' pack-quantized: qtool's reader gives compressed-tensors' own decode
    model, ref = load_file(W4A8 / "model.safetensors"), load_file(W4A8 / "reference.safetensors")
    ct = get_format("ct")
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        t = {k.rsplit(".", 1)[1]: v for k, v in model.items() if k.startswith(mod + ".")}
        w = dequantize(ct.unpack(t, QuantScheme(bits=4, group_size=128, sym=True, extra={"version": "0.20.0"})))
        r = ref[mod + ".weight"]
        assert torch.equal(w.to(r.dtype), r) and torch.equal(w.float(), r.float()), mod


def test_w4a8_checkpoint_on_hopper_runs_cutlass_w4a8():
    code, d = select(W4A8, "--device", "h100", "--engine", "vllm")
    assert code == 0
    layers = by_name(d)
    assert set(layers) == {"q_proj", "down_proj"}
    for x in layers.values():
        # inspect reads the config group's FP8 input activations: a W4A8 layer, not a W4A16 one
        assert (x["format"], x["bits"], x["group_size"], x["act_dtype"]) == ("w4a8", 4, 128, "float8_e4m3fn")
        assert x["chosen"] == "CutlassW4A8LinearKernel"
        assert [c["kernel"] for c in x["candidates"][:3]] == [
            "CompressedTensorsW4A8Fp8", "is_fp8_w4a8_sm90", "CutlassW4A8LinearKernel"]
        # the W4A16 kernels see signed int4 codes and FP8 activations, and say so
        assert "weight type int4 not in" in cand(x, "MacheteLinearKernel")["reason"]
        assert "activation dtype float8_e4m3fn not in" in cand(x, "MarlinLinearKernel")["reason"]
    assert any("input_activations" in n for n in d["notes"])
    # an explicit --dtype is a what-if that wins over the config: seed 002's "CutlassW4A8LinearKernel declines
    # (activations are bf16, not fp8)", with the way back in its hint
    _, d = select(W4A8, "--device", "h100", "--engine", "vllm", "--dtype", "bf16")
    for x in d["layers"]:
        assert x["format"] == "w4a8" and x["act_dtype"] == "bfloat16"
        cutlass = cand(x, "CutlassW4A8LinearKernel")
        assert cutlass["reason"].endswith("activation dtype bfloat16 not in [float8_e4m3fn]")
        assert "--dtype fp8" in cutlass["hint"]


@pytest.mark.parametrize("device", ["b200", "a100", "rtx5090"])
def test_w4a8_checkpoint_off_hopper_has_no_scheme(device):
    code, d = select(W4A8, "--device", device, "--engine", "vllm")
    assert code == 1
    for x in d["layers"]:
        assert x["chosen"] is None
        gate = cand(x, "is_fp8_w4a8_sm90")
        assert not gate["ok"] and "!= 9.0 (exact targets only)" in gate["reason"]
        assert "h100" in gate["hint"]
        assert "refused by is_fp8_w4a8_sm90 at config time, before any kernel is tried" in x["notes"]


def test_w4a8_checkpoint_under_sglang_names_what_is_missing():
    code, d = select(W4A8, "--device", "h100", "--engine", "sglang")
    assert code == 1
    for x in d["layers"]:
        assert x["chosen"] is None and len(x["candidates"]) == 1
        assert "W4A8 FP8 scheme is MoE-only" in x["candidates"][0]["reason"]


# --- INT8 W8A8 -------------------------------------------------------------------------------------------

def test_compressed_tensors_int8_file_per_engine_and_device():
    # q_proj: channel, symmetric; k_proj: channel, asymmetric weights; v_proj: per-tensor, static activations
    code, d = select(CT_INT8, "--device", "a100", "--engine", "vllm", "--dtype", "bf16")
    assert code == 1  # k_proj has no kernel
    x = by_name(d)
    assert {n: (v["format"], v["scale"]) for n, v in x.items()} == {
        "q_proj": ("ct_int8", "channel"), "k_proj": ("ct_int8", "channel"), "v_proj": ("ct_int8", "tensor")}
    assert x["q_proj"]["chosen"] == x["v_proj"]["chosen"] == "CutlassInt8ScaledMMLinearKernel"
    assert "activations bfloat16 -> int8" in cand(x["q_proj"], "CompressedTensorsW8A8Int8")["reason"]
    assert x["k_proj"]["chosen"] is None
    assert "sym=False not supported" in cand(x["k_proj"], "CutlassInt8ScaledMMLinearKernel")["reason"]
    for device, kernel in (("cpu-avx512-bf16", "CPUInt8ScaledMMLinearKernel"),
                           ("mi300x", "AiterInt8ScaledMMLinearKernel")):
        _, d = select(CT_INT8, "--device", device, "--engine", "vllm")
        assert by_name(d)["q_proj"]["chosen"] == kernel, device
    # SGLang loads compressed-tensors INT8, but no SGLang INT8 kernel is declared: it says that, not "unknown"
    _, d = select(CT_INT8, "--device", "a100", "--engine", "sglang")
    reason = by_name(d)["q_proj"]["candidates"][0]["reason"]
    assert "SGLang loads this format" in reason and "not declared" in reason


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A small dense model, and what `qtool pack --to fp8 / ct_fp8 / ct_int8` writes from it."""
    root = tmp_path_factory.mktemp("sel")
    dense = root / "dense"
    dense.mkdir()
    g = torch.Generator().manual_seed(0)
    t = {"lm_head.weight": torch.randn(64, 256, generator=g).bfloat16()}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.o_proj.weight"] = torch.randn(256, 256, generator=g).bfloat16()
        t[p + "mlp.down_proj.weight"] = torch.randn(256, 512, generator=g).bfloat16()
    write_llama(dense, t, "bfloat16")
    out = {}
    for to in ("fp8", "ct_fp8", "ct_int8"):
        r = runner.invoke(app, ["pack", str(dense), "-o", str(root / to), "--to", to, "-q"])
        assert r.exit_code == 0, r.output
        out[to] = root / to
    return out


def test_qtool_written_int8_checkpoint(packed):
    code, d = select(packed["ct_int8"], "--device", "h100", "--engine", "vllm", "--tp", "2")
    assert code == 0
    x = by_name(d)
    assert x["down_proj"]["count"] == 2 and x["down_proj"]["in_features_per_partition"] == 256
    assert {v["format"] for v in x.values()} == {"ct_int8"}
    assert {v["chosen"] for v in x.values()} == {"CutlassInt8ScaledMMLinearKernel"}
    assert any("1 dense module(s) not quantized: skipped" in n for n in d["notes"])


# --- FP8 -------------------------------------------------------------------------------------------------

def test_qtool_written_fp8_block_and_channel_checkpoints(packed):
    # HF fp8: 128x128 blocks; vLLM on an H200 dispatches by M
    code, d = select(packed["fp8"], "--device", "h200", "--engine", "vllm", "--m", "1,64")
    assert code == 0
    for x in d["layers"]:
        assert (x["format"], x["scale"], x["block"]) == ("fp8", "block", [128, 128])
        assert x["per_m"] == {"1": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
                              "64": "DeepGemmFp8BlockScaledMMKernel"}
    # the same file on an A100: no FP8 tensor cores, the Marlin fallback, said in the layer notes
    _, d = select(packed["fp8"], "--device", "a100", "--engine", "vllm")
    for x in d["layers"]:
        assert x["chosen"] == "MarlinFP8ScaledMMLinearKernel"
        assert any("weight-only FP8 (W8A16) through Marlin" in n for n in x["notes"])
    # compressed-tensors FP8 per channel: the CUTLASS epilogue kernel
    _, d = select(packed["ct_fp8"], "--device", "h100", "--engine", "vllm")
    assert {(x["format"], x["scale"], x["chosen"]) for x in d["layers"]} == {
        ("ct_fp8", "channel", "CutlassFP8ScaledMMLinearKernel")}


def test_compressed_tensors_fp8_file_tensor_channel_block_group():
    code, d = select(CT_FP8, "--device", "h100", "--engine", "vllm")
    assert code == 1
    x = by_name(d)
    assert {n: v["scale"] for n, v in x.items()} == {
        "q_proj": "tensor", "k_proj": "channel", "v_proj": "block", "o_proj": "group"}
    assert x["q_proj"]["chosen"] == x["k_proj"]["chosen"] == "CutlassFP8ScaledMMLinearKernel"
    # v_proj: 128x128 blocks over K = 136, which no blockwise kernel takes (K is not whole blocks)
    assert x["v_proj"]["chosen"] is None
    assert "K 136 % group_size 128 != 0" in cand(x["v_proj"], "CutlassFp8BlockScaledMMKernel")["reason"]
    # o_proj: FP8 with group scales is no vLLM FP8 scheme (tensor / channel / block only)
    assert "group scales: no kernel list declared" in x["o_proj"]["candidates"][0]["reason"]
    # SGLang: Marlin first (refused on the H100), then the block layer's FP8 order; per-tensor / per-channel
    # layers go to apply_fp8_linear; group scales have no list
    _, d = select(CT_FP8, "--device", "h100", "--engine", "sglang")
    x = by_name(d)
    assert [c["kernel"] for c in x["v_proj"]["candidates"]][1:3] == ["apply_fp8_marlin_linear",
                                                                    "deepgemm_w8a8_block_fp8_linear"]
    assert x["q_proj"]["chosen"] == x["k_proj"]["chosen"] == "apply_fp8_linear"
    assert "group scales: no kernel list declared for them" in x["o_proj"]["candidates"][0]["reason"]


# --- bitsandbytes NF4 and bare MXFP8 layers ---------------------------------------------------------------

def test_bitsandbytes_nf4_checkpoint_loads_under_sglang_not_vllm(tmp_path):
    mod, o, i = "model.layers.0.mlp.down_proj", 256, 512
    blob = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [o, i]}).encode()
    save_file({f"{mod}.weight": torch.zeros(o * i // 2, 1, dtype=torch.uint8),
               f"{mod}.weight.absmax": torch.ones(o * i // 64),
               f"{mod}.weight.quant_map": torch.linspace(-1, 1, 16),
               f"{mod}.weight.quant_state.bitsandbytes__nf4": torch.tensor(list(blob), dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}))
    code, d = select(tmp_path, "--device", "h100", "--engine", "sglang")
    (x,) = d["layers"]
    assert code == 0 and (x["format"], x["in_features"], x["out_features"]) == ("bnb", 512, 256)
    assert x["chosen"] == "BitsAndBytesLinearMethod"
    code, d = select(tmp_path, "--device", "h100", "--engine", "vllm")
    assert code == 1 and "SGLang loads them" in d["layers"][0]["candidates"][0]["hint"]


def test_a_quantized_module_no_kernel_can_be_chosen_for_fails_the_plan_and_is_named(tmp_path):
    """Beside a bitsandbytes module with its quant state, one without it (no [out, in] shape recorded): the
    plan left it out with an unnamed count and exited 0, as if every quantized layer had a kernel."""
    o, i = 256, 512
    blob = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [o, i]}).encode()
    tensors = {}
    for mod in ("model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"):
        tensors |= {f"{mod}.weight": torch.zeros(o * i // 2, 1, dtype=torch.uint8),
                    f"{mod}.weight.absmax": torch.ones(o * i // 64), f"{mod}.weight.quant_map": torch.linspace(-1, 1, 16)}
    tensors["model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__nf4"] = torch.tensor(list(blob),
                                                                                                dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}))
    code, d = select(tmp_path, "--device", "h100", "--engine", "sglang")
    (x,) = d["layers"]
    assert x["name"] == "model.layers.#.mlp.down_proj" and x["chosen"] == "BitsAndBytesLinearMethod"
    assert code == 1 and d["unplanned"] == ["model.layers.#.mlp.up_proj"]
    assert any("shape the checkpoint does not record" in n and "(model.layers.#.mlp.up_proj;" in n for n in d["notes"])
    # validate's contract plans through the same groups: the module is a failure there too, named
    from qtool.validate import ValidateOptions, validate_path

    rep = validate_path(tmp_path, ValidateOptions(checks=("contract",), engines=("sglang",), targets=("h100",)))
    bad = [c for c in rep.checks if c.status == "fail"]
    assert [c.module for c in bad] == ["model.layers.#.mlp.up_proj"] and "no kernel can be chosen" in bad[0].detail


def test_notes_name_the_modules_they_leave_out():
    from types import SimpleNamespace

    from qtool.select.plan import path_groups

    q4 = QuantScheme("gptq", 4, 128, sym=True, desc_act=False)
    mods = [SimpleNamespace(name=f"model.layers.{n}.mlp.down_proj", in_features=512, out_features=256, scheme=q4)
            for n in range(2)]
    mods += [SimpleNamespace(name=name, in_features=512, out_features=1000, scheme=QuantScheme("dense"))
             for name in ("lm_head", "model.embed_tokens")]
    mods += [SimpleNamespace(name=f"model.layers.{n}.extra_{n}", in_features=None, out_features=None,
                             scheme=QuantScheme("gptq", 4, 128)) for n in range(10)]
    groups, notes, unplanned = path_groups(None, "bf16", modules=mods)
    assert [g.pattern for g in groups] == ["model.layers.#.mlp.down_proj"]
    assert "2 dense module(s) not quantized: skipped (lm_head, model.embed_tokens)" in notes
    # a dense checkpoint: no module is quantized (it read "every quantized module is dense")
    assert path_groups(None, modules=mods[2:4])[1][-1] == "no selectable layer: no module is quantized"
    # ten patterns: the first eight by name, then a count
    assert unplanned == sorted(f"model.layers.#.extra_{n}" for n in range(10))
    shapeless = next(n for n in notes if "does not record" in n)
    assert f"({', '.join(unplanned[:8])}, and 2 more;" in shapeless
    # vLLM runs a layer's experts as one FusedMoE module: the expert linears it leaves out are named too
    from qtool.kernels.devices import profile
    from qtool.select.plan import plan_select

    experts = [SimpleNamespace(name=f"model.layers.0.mlp.experts.{e}.down_proj", in_features=512, out_features=256,
                               scheme=q4) for e in range(4)]
    groups, _, _ = path_groups(None, "bf16", modules=mods[:2] + experts)
    rep = plan_select(groups, profile("h100"), "vllm")
    assert any(n.startswith("4 mixture-of-experts expert layers not planned: ")
               and n.endswith("(model.layers.#.mlp.experts.#.down_proj)") for n in rep.notes), rep.notes


def test_bare_mxfp8_layer():
    r = runner.invoke(app, ["select", "--layer", "4096,4096", "--format", "mxfp8", "--device", "b200",
                            "--engine", "vllm", "--json"])
    assert r.exit_code == 0, r.output
    (x,) = json.loads(r.stdout)["layers"]
    assert (x["bits"], x["group_size"], x["chosen"]) == (8, 32, "FlashInferCutlassMxfp8LinearKernel")


def test_int_weights_with_int8_activations_are_not_planned_as_w4a16():
    # a compressed-tensors group with int8 input activations: vLLM gives it a WNA8 int scheme, never the WNA16
    # list (where Conch or Humming, which declare no activation dtype, would wrongly pass)
    from types import SimpleNamespace

    from qtool.kernels.devices import profile
    from qtool.select.plan import path_groups, plan_select

    mods = [SimpleNamespace(name="model.layers.0.mlp.down_proj", in_features=4096, out_features=4096,
                            scheme=QuantScheme("ct", 4, 128, sym=True, desc_act=False,
                                               extra={"activations": "int8"}),
                            detail="pack-quantized (dense)")]
    groups, notes, _ = path_groups(None, modules=mods)
    (g,) = groups
    assert (g.layer.format, g.layer.act_dtype) == ("wna8_int8", "int8")
    assert any("wna8_int8: int8 activations" in n for n in notes)
    for engine in ("vllm", "sglang"):
        sel = plan_select(groups, profile("h100"), engine).layers[0].selection
        assert sel.chosen is None and [c.kind for c in sel.candidates] == ["method"], engine
        assert "not declared" in sel.candidates[0].reason
