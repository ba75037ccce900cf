"""Every GPTQModel-written fixture decodes to its reference bit for bit, and re-packs to the file's bytes.

The fixtures (tests/fixtures/gptqmodel-*) were written by GPTQModel 7.7.0 itself; reference.safetensors
holds GPTQModel's own dequantization. Tensors are read straight through safetensors.safe_open.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qtool.errors import NotRepresentable
from qtool.formats import dequantize, get_format
from qtool.formats.gptq import META_KEY, encode_qzeros, zero_convention_evidence
from qtool.scheme import QuantScheme
from tests.conftest import FIXTURES

GPTQMODEL = sorted(p.name for p in FIXTURES.glob("gptqmodel-*")) if FIXTURES.is_dir() else []
MODULES = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")
PREFIX = "encoder.layer.0."
WORDBORROW = "gptqmodel-gptq-v1-4bit-g128-asym-wordborrow"


def load(folder: str):
    d = FIXTURES / folder
    qc = json.loads((d / "quantize_config.json").read_text())
    fid = "awq" if qc["quant_method"] == "awq" else qc.get("checkpoint_format") or qc["format"]
    mods: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            prefix, short = name.rsplit(".", 1)
            mods.setdefault(prefix, {})[short] = f.get_tensor(name)
    with safe_open(str(d / "reference.safetensors"), "pt") as f:
        ref = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return qc, fid, mods, ref


def params(qc: dict, **kw) -> QuantScheme:
    return QuantScheme(bits=qc["bits"], group_size=qc["group_size"], sym=qc.get("sym"),
                       desc_act=qc.get("desc_act"), **kw)


def test_all_gptqmodel_fixtures_present(fixtures_dir: Path):
    assert GPTQMODEL == [
        "gptqmodel-awq-gemm-4bit-g128", "gptqmodel-gptq-3bit-g128-asym", WORDBORROW,
        "gptqmodel-gptq-v1-4bit-g128-sym", "gptqmodel-gptq-v2-4bit-g128-asym", "gptqmodel-gptq_p-5bit-g64-asym"]


@pytest.mark.parametrize("folder", GPTQMODEL)
def test_decode_bit_exact(folder):
    qc, fid, mods, ref = load(folder)
    fmt = get_format(fid)
    assert sorted(m[len(PREFIX):] for m in mods) == sorted(MODULES)
    for prefix, tensors in mods.items():
        tensors = {k: v for k, v in tensors.items() if k != "bias"}
        plain = fmt.unpack(tensors, params(qc))
        w = dequantize(plain)
        expect = ref[prefix + ".weight"]
        assert w.dtype == expect.dtype == torch.float16 and w.shape == expect.shape
        diff = int((w.view(torch.int16) != expect.view(torch.int16)).sum())
        assert diff == 0, f"{folder} {prefix}: {diff} weights differ from GPTQModel's dequantization"
        assert plain.bits == qc["bits"] and plain.sym == bool(qc.get("sym", not qc.get("zero_point", False)))


@pytest.mark.parametrize("folder", [f for f in GPTQMODEL if f != WORDBORROW])
def test_repack_byte_exact(folder):
    qc, fid, mods, _ = load(folder)
    fmt = get_format(fid)
    for prefix, tensors in mods.items():
        packed = fmt.pack(fmt.unpack(tensors, params(qc)))
        assert set(packed) == set(tensors) - {"bias"}
        for k, v in packed.items():
            assert v.dtype == tensors[k].dtype and torch.equal(v, tensors[k]), f"{folder} {prefix}.{k}"


def test_wordborrow_word_vs_field():
    qc, fid, mods, ref = load(WORDBORROW)
    assert fid == "gptq"
    fmt = get_format("gptq")
    wrong_fields = wrong_rows = 0
    wrong_weights = 0
    for prefix, tensors in mods.items():
        word = fmt.unpack(tensors, params(qc))  # default convention = word
        field = fmt.unpack(tensors, params(qc, convention="field"))
        assert word.meta[META_KEY] == "v1-word" and field.meta[META_KEY] == "v1-field"
        expect = ref[prefix + ".weight"].view(torch.int16)
        assert torch.equal(dequantize(word).view(torch.int16), expect)
        bad = word.zeros != field.zeros                          # [O, n_groups]
        wrong_fields += int(bad.sum())
        wrong_rows += int(bad.any(0).sum())                      # group rows of qzeros touched
        wrong_weights += int((dequantize(field).view(torch.int16) != expect).sum())
        assert torch.equal(word.qweight, field.qweight) and torch.equal(word.scales, field.scales)
    assert (wrong_fields, wrong_rows) == (25, 13)   # fixtures README: 25 zero fields in 13 group rows
    assert wrong_weights > 0


def test_wordborrow_relations():
    """v1 word-borrow file = v2 file with 0x11111111 subtracted per qzeros word; writing v1 is refused."""
    qc, _, mods, _ = load(WORDBORROW)
    _, _, mods2, _ = load("gptqmodel-gptq-v2-4bit-g128-asym")
    v1, v2 = get_format("gptq"), get_format("gptq_v2")
    field_word_diff = 0
    for prefix, tensors in mods.items():
        plain = v1.unpack(tensors, params(qc))
        with pytest.raises(NotRepresentable, match="gptq_v2"):
            v1.pack(plain)
        again = v2.pack(plain)
        for k in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(again[k], mods2[prefix][k]), f"{prefix}.{k}"
        zeros = plain.zeros.t().contiguous()
        assert torch.equal(encode_qzeros(zeros, 4, "v1-word"), tensors["qzeros"])
        field_word_diff += int((encode_qzeros(zeros, 4, "v1-field") != tensors["qzeros"]).sum())
        ev = zero_convention_evidence(tensors["qzeros"], 4, plain.out_features)
        assert ev.verdict is None and ev.word_field_diff == int((plain.zeros != v1.unpack(
            tensors, params(qc, convention="field")).zeros).sum())
    assert field_word_diff == 19   # fixtures README: 19 qzeros words differ from the per-field encoding


def test_same_plain_across_awq_v2_wordborrow():
    """The AWQ, GPTQ-v2 and word-borrow fixtures carry the same codes, scales and zeros."""
    sets = {f: load(f) for f in ("gptqmodel-awq-gemm-4bit-g128", "gptqmodel-gptq-v2-4bit-g128-asym", WORDBORROW)}
    for m in MODULES:
        plains = [get_format(fid).unpack(mods[PREFIX + m], params(qc)) for qc, fid, mods, _ in sets.values()]
        assert plains[0].equal(plains[1]) and plains[1].equal(plains[2])
        awq_again = get_format("awq").pack(plains[1])
        awq_file = sets["gptqmodel-awq-gemm-4bit-g128"][2][PREFIX + m]
        assert all(torch.equal(awq_again[k], awq_file[k]) for k in awq_again)


def test_fixture_zero_extremes_and_evidence():
    """Clipped fixtures carry zeros of 0 and 2^b - 1 (README counts); the sym v1 file reads as v1."""
    counts = {}
    for folder in ("gptqmodel-gptq-v2-4bit-g128-asym", "gptqmodel-gptq-3bit-g128-asym",
                   "gptqmodel-gptq_p-5bit-g64-asym", "gptqmodel-awq-gemm-4bit-g128"):
        qc, fid, mods, _ = load(folder)
        top = (1 << qc["bits"]) - 1
        z0 = zmax = 0
        for tensors in mods.values():
            p = get_format(fid).unpack(tensors, params(qc))
            z0 += int((p.zeros == 0).sum())
            zmax += int((p.zeros == top).sum())
        counts[folder] = (z0, zmax)
    assert counts == {"gptqmodel-gptq-v2-4bit-g128-asym": (31, 19), "gptqmodel-gptq-3bit-g128-asym": (31, 19),
                      "gptqmodel-gptq_p-5bit-g64-asym": (62, 38), "gptqmodel-awq-gemm-4bit-g128": (31, 19)}
    qc, _, mods, _ = load("gptqmodel-gptq-v1-4bit-g128-sym")
    for tensors in mods.values():
        assert set(tensors["qzeros"].view(-1).tolist()) == {0x77777777}
        ev = zero_convention_evidence(tensors["qzeros"], 4, tensors["scales"].shape[1])
        assert ev.verdict == "v1"
        # The same file mislabelled: its v2 re-pack (0x88888888) reads as 9 under v1 rules -> verdict v2.
        v2z = get_format("gptq_v2").pack(get_format("gptq").unpack(tensors, params(qc)))["qzeros"]
        ev2 = zero_convention_evidence(v2z, 4, tensors["scales"].shape[1])
        assert ev2.verdict == "v2" and set(ev2.decoded["v1-word"].view(-1).tolist()) == {9}
