"""`qtool repack` on inputs the common paths do not meet: modules of one checkpoint that differ in scheme
(Marlin's config), configs whose labels the data contradicts, damaged g_idx, expert stacks, requantization
choices, and files beside the weights that an output leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qtool.errors import FormatError, InputError, NotRepresentable
from qtool.formats import get_format
from qtool.formats.gptq import gptqmodel_config
from qtool.inspect import inspect_path
from qtool.repack.dense import DenseJob, run_dense
from qtool.repack.plan import ModulePlan, RepackJob
from qtool.repack.run import Refused, run_repack
from qtool.repack.source import open_source
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES
from tests.test_formats_ct import random_plain

P = "model.layers.0.mlp."


def make_mixed(root: Path, fmt: str, specs: dict, sym_claim: bool | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint of modules {short name: (o, i, bits, group, sym, act_order)} in `fmt`, its config the one
    qtool's GPTQ writers give (majority scheme + `dynamic` overrides); `sym_claim` overwrites the base sym."""
    root.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": torch.randn(10, 8, generator=torch.Generator().manual_seed(0)).half()}
    mods = []
    for k, (name, (o, i, bits, group, sym, act)) in enumerate(specs.items()):
        p = random_plain(k + 1, o, i, bits, group, sym, act)
        t.update({f"{P}{name}.{s}": v for s, v in get_format(fmt).pack(p).items()})
        mods.append((P + name, QuantScheme(fmt, bits, group, sym, act), None))
    save_file(t, root / "model.safetensors", metadata={"format": "pt"})
    qc = gptqmodel_config(get_format(fmt), mods)
    if sym_claim is not None:
        qc["sym"] = sym_claim
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return t


def errors_of(path) -> list[str]:
    return [a.message for a in inspect_path(path).anomalies if a.severity == "error"]


# --- Marlin of modules that differ in scheme -------------------------------------------------------------------------
MIXED = {"up_proj": (128, 256, 4, 128, True, False), "gate_proj": (128, 256, 4, 128, True, False),
         "down_proj": (128, 256, 4, -1, True, False), "q_proj": (128, 256, 8, 64, True, False),
         "k_proj": (128, 256, 4, 32, False, True), "v_proj": (40, 256, 4, 128, True, True)}


def test_marlin_of_mixed_modules_writes_a_config_loaders_and_qtool_read(tmp_path):
    """One integer bits/group_size and one sym/desc_act (the majority), the others as the GPTQ writers'
    per-module `dynamic` overrides; qtool reads the output back exactly."""
    src = make_mixed(tmp_path / "src", "gptq_v2", MIXED)
    rep = run_repack(RepackJob(tmp_path / "src", "marlin", tmp_path / "m"))
    assert rep.plan.counts()["exact"] == len(MIXED)
    qc = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 128, True, False)
    assert qc["dynamic"] == {
        rf"+:^model\.layers\.0\.mlp\.{n}$": over for n, over in (
            ("down_proj", {"group_size": -1}), ("q_proj", {"bits": 8, "group_size": 64}),
            ("k_proj", {"group_size": 32, "sym": False, "desc_act": True}), ("v_proj", {"desc_act": True}))}
    assert json.loads((tmp_path / "m" / "quantize_config.json").read_text()) == qc
    assert errors_of(tmp_path / "m") == []
    source = open_source(tmp_path / "m")
    try:
        got = {m.name[len(P):]: (m.scheme.bits, m.scheme.group_size) for m in source.modules}
    finally:
        source.close()
    assert got == {n: (s[2], s[3]) for n, s in MIXED.items()}
    run_repack(RepackJob(tmp_path / "m", "gptq_v2", tmp_path / "back"))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(src) and all(back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]) for k in src)


def test_marlin_refuses_modules_of_both_gptq_and_awq_families():
    """quant_method is one for the checkpoint: no `dynamic` override turns AWQ-Marlin into GPTQ-Marlin."""
    from qtool.repack.plan import _one_marlin_family

    def mp(name, source):
        p = ModulePlan(name, QuantScheme(source, 4, 128), "marlin", [64, 128])
        p.target_meta = {"marlin.source": source}
        return p

    plans = [mp("a", "gptq_v2"), mp("b", "gptq"), mp("c", "awq")]
    _one_marlin_family(plans)
    assert [p.kind for p in plans] == ["exact", "exact", "impossible"]
    assert "one quant_method" in plans[2].reasons[0]


# --- the data decides, not the sym label -----------------------------------------------------------------------------
def test_sym_label_over_varying_zeros_is_an_input_error(tmp_path):
    make_mixed(tmp_path / "s", "gptq_v2", {"up_proj": (128, 256, 4, 128, False, False)}, sym_claim=True)
    for to in ("ct", "gptq_v2", "marlin"):  # the copy path too: it would carry the false label on
        with pytest.raises(InputError) as e:
            run_repack(RepackJob(tmp_path / "s", to, tmp_path / to))
        assert e.value.path == str(tmp_path / "s") and e.value.tensor == P + "up_proj.qzeros"
        assert "says sym" in e.value.problem and '"sym": false' in e.value.fix and e.value.exit_code == 2
        assert not (tmp_path / to).exists()


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2", "gptq_p", "awq"])
def test_each_layout_decodes_its_own_zeros_for_the_sym_check(tmp_path, fmt):
    """The sym check reads qzeros alone through the layout's public decode_zeros, the decoding its unpack uses:
    symmetric data passes in every layout that stores zeros, and varying zeros under a sym label are refused."""
    make_mixed(tmp_path / "sym", fmt, {"up_proj": (128, 256, 4, 64, True, False)})
    run_repack(RepackJob(tmp_path / "sym", "ct", tmp_path / "o", dry_run=True))
    p = random_plain(1, 128, 256, 4, 64, False, zero_extremes=False)
    p = p.with_(zeros=p.zeros.clamp(min=1))  # gptq (v1) stores z - 1: a zero of 0 has no encoding
    t = get_format(fmt).pack(p)
    zeros, _conv = get_format(fmt).decode_zeros(t["qzeros"], 4, 128, QuantScheme(fmt, 4, 64, False))
    assert torch.equal(zeros.t(), p.zeros)
    (tmp_path / "asym").mkdir()
    save_file({f"{P}up_proj.{k}": v for k, v in t.items()}, tmp_path / "asym" / "model.safetensors")
    qc = gptqmodel_config(get_format(fmt), [(P + "up_proj", QuantScheme(fmt, 4, 64, True, False), None)])
    (tmp_path / "asym" / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    with pytest.raises(InputError, match="says sym") as e:
        run_repack(RepackJob(tmp_path / "asym", "ct", tmp_path / "o", dry_run=True))
    assert e.value.tensor == P + "up_proj.qzeros"


def test_symmetric_v2_data_labelled_v1_is_named_as_such(tmp_path):
    make_mixed(tmp_path / "s", "gptq_v2", {"up_proj": (128, 256, 4, 128, True, False)})
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = cfg["quantization_config"]["format"] = "gptq"
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError) as e:
        run_repack(RepackJob(tmp_path / "s", "ct", tmp_path / "o"))
    assert "decodes to 9" in e.value.problem and '"checkpoint_format": "gptq_v2"' in e.value.fix


# --- damaged g_idx, unreadable modules -------------------------------------------------------------------------------
ACT = {"a": (96, 256, 4, 32, False, True), "b": (64, 128, 4, -1, True, False)}


@pytest.mark.parametrize("edit,said", [(lambda g: g.index_fill(0, torch.tensor([0]), 99), "span [0, 99]"),
                                       (lambda g: g.float(), "must be int32")])
def test_a_damaged_g_idx_is_an_input_error_at_plan_time(tmp_path, edit, said):
    t = make_mixed(tmp_path / "c", "gptq_v2", ACT)
    t[P + "a.g_idx"] = edit(t[P + "a.g_idx"])
    save_file(t, tmp_path / "c" / "model.safetensors", metadata={"format": "pt"})
    for lossy in (False, True):  # never "lossy": requantizing would read the same broken map
        with pytest.raises(InputError) as e:
            run_repack(RepackJob(tmp_path / "c", "ct", tmp_path / "o", dry_run=True, allow_lossy=lossy))
        assert said in e.value.problem
        assert e.value.path == str(tmp_path / "c") and e.value.tensor == P + "a.g_idx" and e.value.fix


def test_a_format_error_while_planning_names_file_tensor_and_fix(tmp_path, monkeypatch):
    from qtool.repack.plan import unpack_module

    make_mixed(tmp_path / "c", "gptq_v2", ACT)
    source = open_source(tmp_path / "c")
    fmt = get_format("gptq_v2")

    def broken(tensors, params):
        raise FormatError("gptq_v2: 'scales' must be fp16/bf16/fp32", tensor="scales")

    monkeypatch.setattr(fmt, "unpack", broken)
    try:
        with pytest.raises(FormatError) as e:
            unpack_module(source, source.modules[0])
    finally:
        source.close()
    assert e.value.path == str(tmp_path / "c") and e.value.tensor == P + "a.scales" and "inspect --deep" in e.value.fix


def test_expert_stacks_are_refused_by_name_and_exclude_carries_them(tmp_path):
    src = FIXTURES / "fp4" / "gptoss-mxfp4"
    with pytest.raises(Refused) as e:
        run_repack(RepackJob(src, "mxfp4", tmp_path / "o", dry_run=True))
    assert "mixture-of-experts stack" in e.value.problem and "--exclude" in e.value.fix
    assert e.value.path == str(src)
    rep = run_repack(RepackJob(src, "mxfp4", tmp_path / "o", dry_run=True, exclude=("experts",)))
    assert rep.plan.counts()["keep"] == 1
    for drop in ((), ("experts",)):  # --drop used to pass the plan and crash the writer
        with pytest.raises(NotRepresentable) as e:
            run_dense(DenseJob(src, tmp_path / "d", drop=drop))
        assert "mixture-of-experts stack" in e.value.problem and e.value.tensor == "model.layers.0.mlp.experts"


# --- requantization parameters, files left out -----------------------------------------------------------------------
def test_8bit_asymmetric_to_marlin_requantizes_symmetric(tmp_path):
    """Marlin stores zero points for 4-bit only; a symmetric 8-bit requantization fits, and the plan says so."""
    make_mixed(tmp_path / "b8", "gptq_v2", {"up_proj": (64, 128, 8, 32, False, False)})
    with pytest.raises(Refused) as e:
        run_repack(RepackJob(tmp_path / "b8", "marlin", tmp_path / "o"))
    assert "[lossy]" in e.value.problem and "--allow-lossy" in e.value.fix
    rep = run_repack(RepackJob(tmp_path / "b8", "marlin", tmp_path / "o", allow_lossy=True))
    (m,) = rep.plan.modules
    assert (m.kind, m.to_bits, m.to_sym) == ("lossy", 8, True) and "requantized symmetric" in m.reasons[-1]


def test_the_source_quantize_config_json_is_never_carried_silently(tmp_path):
    make_mixed(tmp_path / "q", "gptq_v2", {"up_proj": (64, 128, 4, 32, True, False)})
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    (tmp_path / "q" / "quantize_config.json").write_text(json.dumps(qc))
    note = "quantize_config.json: not copied: it describes the source's"
    for to in ("ct", "dense"):
        rep = run_repack(RepackJob(tmp_path / "q", to, tmp_path / to)) if to != "dense" else \
            run_dense(DenseJob(tmp_path / "q", tmp_path / to))
        assert any(w.startswith(note) for w in rep.plan.warnings), rep.plan.warnings
        assert note in " ".join(json.loads((tmp_path / to / "qtool_repack.json").read_text())["warnings"])
        assert not (tmp_path / to / "quantize_config.json").exists()
    rep = run_repack(RepackJob(tmp_path / "q", "gptq", tmp_path / "v1"))
    assert not any("quantize_config.json" in w for w in rep.plan.warnings)
    assert json.loads((tmp_path / "v1" / "quantize_config.json").read_text())["checkpoint_format"] == "gptq"



# --- requantized scales that underflow ------------------------------------------------------------------------

def test_a_requantized_group_its_fp16_scale_zeroes_is_named(tmp_path):
    """A source with float32 scales of ~1e-7 requantized to 2 bits gets fp16 scales that underflow: every
    weight of those groups dequantizes to 0. The warning names that module with the count the written bytes
    show; the modules beside it stay unnamed."""
    from tests.test_pack import decode
    from tests.test_repack import MODULES, make_checkpoint

    make_checkpoint(tmp_path / "m", "gptq_v2", 4, 128, True)
    t = load_file(str(tmp_path / "m" / "model.safetensors"))
    small = next(iter(MODULES))
    t[f"{small}.scales"] = t[f"{small}.scales"].float() * 1e-6
    save_file(t, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    src = get_format("gptq_v2").unpack({k.rpartition(".")[2]: v for k, v in t.items() if k.startswith(small + ".")},
                                       QuantScheme("gptq_v2", 4, 128, True))
    rep = run_repack(RepackJob(tmp_path / "m", "gptq_v2", tmp_path / "out", allow_lossy=True, bits=2))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    deq = torch.from_numpy(decode("gptq_v2", out, small, 2, 128))
    w = src.qweight.to(torch.float32)  # nonzero where the source weight is: its code is off the midpoint
    o, i = deq.shape
    held = (w != 8).reshape(o, i // 128, 128).any(-1)
    lost = int((held & (deq == 0).reshape(o, i // 128, 128).all(-1)).sum())
    named = [x for x in rep.plan.warnings if "dequantizes to 0" in x]
    assert lost > 0 and named == [x for x in rep.plan.warnings if x.startswith(f"{small}: ")]
    assert named[0].startswith(f"{small}: every nonzero weight of {lost} of {o * i // 128} groups dequantizes to 0")
    assert "--exclude this module" in named[0] and "--dtype" not in named[0]
