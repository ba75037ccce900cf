"""pack / repack / inspect / validate over the float and int8 layouts (fp8, ct_fp8, ct_int8), end to end."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.cli.main import main
from tests.conftest import write_llama


def qtool(*args) -> tuple[int, str]:
    """Exit status and output of the CLI as a user sees them (errors mapped by main)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue()


def tensors(d) -> dict[str, torch.Tensor]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8") / "dense"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(50, 128, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(128).bfloat16(), "lm_head.weight": torch.randn(50, 128, generator=g).bfloat16()}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(192, 128, generator=g).bfloat16()
        t[p + "mlp.down_proj.weight"] = torch.randn(128, 192, generator=g).bfloat16()
        t[p + "mlp.down_proj.bias"] = torch.randn(128, generator=g).bfloat16()
    write_llama(d, t, "bfloat16")
    (d / "tokenizer.json").write_text('{"vocab": {}}')
    return d


@pytest.fixture(scope="module")
def packs(dense):
    out = {}
    for to in ("fp8", "ct_fp8", "ct_int8"):
        code, text = qtool("pack", dense, "-o", dense.parent / to, "--to", to, "-q")
        assert code == 0, text
        out[to] = dense.parent / to
    return out


SHORTS = {"fp8": {"weight", "weight_scale_inv"}, "ct_fp8": {"weight", "weight_scale"},
          "ct_int8": {"weight", "weight_scale"}}


@pytest.mark.parametrize("to", ["fp8", "ct_fp8", "ct_int8"])
def test_pack_writes_the_layout_and_accounts_for_every_tensor(dense, packs, to):
    src, got = tensors(dense), tensors(packs[to])
    linear = [k[: -len(".weight")] for k in src if ".layers." in k and k.endswith("proj.weight")]
    for mod in linear:
        assert {k[len(mod) + 1:] for k in got if k.startswith(mod + ".") and "bias" not in k} == SHORTS[to]
    # every other tensor is there, byte for byte
    for k, v in src.items():
        if k[: -len(".weight")] not in linear:
            assert torch.equal(got[k].view(torch.uint8) if got[k].dim() else got[k], v.view(torch.uint8)), k
    assert (packs[to] / "tokenizer.json").is_file()
    cfg = json.loads((packs[to] / "config.json").read_text())["quantization_config"]
    if to == "fp8":
        assert cfg["weight_block_size"] == [128, 128] and cfg["modules_to_not_convert"] == ["lm_head"]
    else:
        assert cfg["format"] == ("float-quantized" if to == "ct_fp8" else "int-quantized")
        assert cfg["ignore"] == ["lm_head"]
        assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


@pytest.mark.parametrize("to", ["fp8", "ct_fp8", "ct_int8"])
def test_inspect_and_deep_decode_the_packs(packs, to):
    code, text = qtool("inspect", packs[to], "--deep", "--json")
    assert code == 0
    r = json.loads(text[text.index("{"):])
    fmts = {m["format"] for m in r["modules"] if ".layers." in m["name"]}
    assert fmts == {to}
    assert not [a for a in r["anomalies"] if a["severity"] in ("error", "warning")]


def test_pack_flags_and_refusals(dense, tmp_path):
    code, _ = qtool("pack", dense, "-o", tmp_path / "b", "--to", "fp8", "--block", "64x32", "--method", "mse", "-q")
    assert code == 0
    s = tensors(tmp_path / "b")["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert s.shape == (2, 6)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["weight_block_size"] == \
        [64, 32]
    code, _ = qtool("pack", dense, "-o", tmp_path / "t", "--to", "ct_fp8", "--strategy", "tensor", "-q")
    assert code == 0 and tensors(tmp_path / "t")["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)
    code, _ = qtool("pack", dense, "-o", tmp_path / "g", "--to", "ct_fp8", "--strategy", "group", "--group-size",
                    "64", "-q")
    assert code == 0 and tensors(tmp_path / "g")["model.layers.0.mlp.down_proj.weight_scale"].shape == (128, 3)
    for args, says in [
        (["--to", "fp8", "--strategy", "channel"], "fp8 stores tensor or block scales, not --strategy channel"),
        (["--to", "fp8", "--bits", "4"], "8-bit codes"),
        (["--to", "fp8", "--block", "128"], "not ROWSxCOLS"),
        (["--to", "ct_fp8", "--strategy", "group"], "--group-size"),
        (["--to", "ct_int8", "--strategy", "block"], "not --strategy block"),
        (["--to", "ct_fp8", "--method", "gptq"], "rtn or mse"),
        (["--to", "gptq", "--strategy", "block"], "--strategy/--block apply to"),
    ]:
        code, text = qtool("pack", dense, "-o", tmp_path / "x", *args)
        assert code == 2 and says in text, (args, text)
        assert "Traceback" not in text and not (tmp_path / "x").exists()


def test_repack_hf_block_to_ct_and_back_is_bit_identical(packs, tmp_path):
    code, text = qtool("repack", packs["fp8"], "--to", "ct_fp8", "-o", tmp_path / "ct", "--json")
    assert code == 0, text
    plan = json.loads(text[text.index("{"):])
    assert plan["counts"]["exact"] == 4 and plan["counts"]["lossy"] == 0
    code, _ = qtool("repack", tmp_path / "ct", "--to", "fp8", "-o", tmp_path / "back", "-q")
    assert code == 0
    a, c, b = tensors(packs["fp8"]), tensors(tmp_path / "ct"), tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    mod = "model.layers.0.mlp.down_proj"
    assert torch.equal(a[f"{mod}.weight_scale_inv"], c[f"{mod}.weight_scale"])
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    g = cfg["config_groups"]["group_0"]
    assert g["weights"]["block_structure"] == [128, 128] and g["input_activations"]["strategy"] == "group"


def test_repack_refuses_what_the_target_cannot_hold_and_requantizes_on_request(packs, tmp_path):
    code, text = qtool("repack", packs["ct_fp8"], "--to", "fp8", "-o", tmp_path / "r")
    assert code == 2 and "fp8 stores tensor or block scales, not channel ones" in text and "--allow-lossy" in text
    assert not (tmp_path / "r").exists()
    code, text = qtool("repack", packs["ct_fp8"], "--to", "fp8", "-o", tmp_path / "r", "--allow-lossy", "--json")
    assert code == 0
    mods = json.loads(text[text.index("{"):])["modules"]
    assert all(m["kind"] == "lossy" and 0 < m["rel_error"] < 0.05 for m in mods)
    assert "weight_scale_inv" in " ".join(tensors(tmp_path / "r"))
    code, text = qtool("repack", packs["fp8"], "--to", "gptq", "-o", tmp_path / "g", "--allow-lossy", "-q")
    assert code == 0, text


def test_inspect_deep_reports_nan_codes_and_bad_scales(packs, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(packs["fp8"], d)
    t = tensors(d)
    mod = "model.layers.0.mlp.down_proj"
    w = t[f"{mod}.weight"].view(torch.uint8).clone()
    w[0, 0], w[1, 1] = 0x7F, 0xFF
    t[f"{mod}.weight"] = w.view(torch.float8_e4m3fn)
    s = t["model.layers.1.mlp.down_proj.weight_scale_inv"].clone()
    s[0, 0] = 0.0
    t["model.layers.1.mlp.down_proj.weight_scale_inv"] = s
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    code, text = qtool("inspect", d, "--deep", "--json")
    r = json.loads(text[text.index("{"):])
    found = {(a["severity"], a["message"]) for a in r["anomalies"]}
    assert any(s == "error" and m.startswith("2 e4m3 weight code(s) hold NaN bit patterns (0x7F/0xFF)")
               for s, m in found)
    assert any(s == "warning" and "scale(s) are zero" in m for s, m in found)
    code, text = qtool("repack", d, "--to", "ct_fp8", "-o", tmp_path / "out")
    assert code == 2 and "NaN" in text and not (tmp_path / "out").exists()


def test_validate_checks_round_trip_and_reference(dense, packs):
    code, text = qtool("validate", packs["fp8"], "--reference", dense, "--json")
    r = json.loads(text[text.index("{"):])
    by = {(c["name"], c["module"]): c for c in r["checks"]}
    mod = "model.layers.0.mlp.down_proj"
    assert by[("roundtrip", mod)]["status"] == "pass"
    assert by[("reference", mod)]["status"] == "pass"
    # torch-ref runs the float codes on the CPU and is judged against the float64 oracle
    assert by[("kernels", mod)]["status"] == "pass"


def test_per_tensor_fp8_says_which_loaders_read_it(dense, tmp_path):
    """quant_method fp8 per tensor is vLLM's layout (weight_scale), which transformers 5 misreads as blocks of
    weight_scale_inv: pack and repack say so, and name the layout both read."""
    from qtool.formats.fp8 import PER_TENSOR_NOTE
    from qtool.pack import PackJob, run_pack
    from qtool.repack.plan import RepackJob
    from qtool.repack.run import run_repack

    r = run_pack(PackJob(dense, tmp_path / "t", to="fp8", bits=8, strategy="tensor"))
    assert PER_TENSOR_NOTE in r.warnings and "--to ct_fp8 --strategy tensor" in PER_TENSOR_NOTE
    assert PER_TENSOR_NOTE not in run_pack(PackJob(dense, tmp_path / "b", to="fp8", bits=8)).warnings  # blocks
    run_pack(PackJob(dense, tmp_path / "ct", to="ct_fp8", bits=8, strategy="tensor"))
    assert PER_TENSOR_NOTE in run_repack(RepackJob(tmp_path / "ct", "fp8", tmp_path / "back")).plan.warnings
