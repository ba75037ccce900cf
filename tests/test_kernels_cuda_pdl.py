"""Programmatic dependent launch in cuda-w4a16's dispatch (CPU): which launches take it, by device, kernel, layer
and the QTOOL_CUDA_PDL switch, and the trigger and L2 flags the launch passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qtool.kernels.cuda import rows
from qtool.kernels.cuda.launch import MMA, SK, WGMMA, Config
from qtool.kernels.cuda.rows import choose

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_choices import state  # noqa: E402


def test_pdl_use_follows_device_config_and_environment(monkeypatch):
    from qtool.kernels.cuda.launch import flags, use_pdl

    hopper, ampere = state(8192, 8192), state(8192, 8192, cc=(8, 0))
    monkeypatch.delenv("QTOOL_CUDA_PDL", raising=False)
    assert use_pdl(Config(kind=SK), hopper) and not use_pdl(Config(kind=SK), ampere)
    assert not use_pdl(Config(kind=SK, pdl=False), hopper) and not use_pdl(Config(kind=SK, pdl=True), ampere)
    assert use_pdl(choose(1, hopper), hopper)
    monkeypatch.setenv("QTOOL_CUDA_PDL", "0")  # the switch turns every programmatic launch off, asked for or not
    assert not use_pdl(Config(kind=SK), hopper) and not use_pdl(Config(kind=SK, pdl=True), hopper)
    plain = {"evict": "none"}
    assert flags(Config(**plain)) == 0 and flags(Config(trigger="start", **plain)) == 1
    # a start trigger only where every SM gets the same CTAs (else the cascade of later grids lands unevenly)
    assert flags(Config(trigger="start", **plain), 264, 132) == 1
    assert flags(Config(trigger="start", **plain), 128, 132) == 0
    # evict-first weight copies: the default, for every kernel (each Stream and the stream-K ring read the bit)
    assert flags(Config()) == 2 and flags(Config(kind=SK, trigger="start"), 264, 132) == 3
    assert all(flags(choose(m, hopper)) & 2 for m in (1, 16, 256))
    with pytest.raises(ValueError, match="evict"):
        Config(evict="all")  # refused where it is made, not at launch
    gate = state(8192, 28672)
    assert not use_pdl(choose(256, hopper), hopper) and not use_pdl(choose(16, gate), gate)
    # the dispatch does not read the switch: the same launches with it as without it, none of them programmatic
    points = [(m, st) for st in (hopper, gate, state(28672, 8192), state(2048, 768))
              for m in (1, 5, 16, 24, 64, 128, 256)]
    off = [choose(m, st) for m, st in points]
    assert not any(use_pdl(c, st) for c, (_, st) in zip(off, points))
    monkeypatch.delenv("QTOOL_CUDA_PDL")
    assert [choose(m, st) for m, st in points] == off
    assert use_pdl(choose(16, hopper), hopper)  # x streamed (q/o)
    assert use_pdl(choose(16, state(28672, 8192)), hopper)  # down too
    assert not use_pdl(Config(kind=MMA, pdl=True), hopper) and use_pdl(Config(kind=WGMMA, pdl=True), hopper)
    with pytest.raises(ValueError, match="trigger"):
        Config(trigger="later")
    assert Config(kind=SK, trigger="start").label().endswith("pdl-start")
    assert "no-pdl" in Config(kind=MMA, pdl=False).label()


def test_wgmma_launches_are_programmatic_on_layers_up_to_the_byte_line(monkeypatch):
    from qtool.kernels.cuda.launch import use_pdl

    monkeypatch.delenv("QTOOL_CUDA_PDL", raising=False)
    # (K, N): the MoE expert, Llama-3-8B's q/o, Qwen2.5-32B's MLP (67.5 MiB) take it; Llama-3-70B's MLP (112 MiB)
    # does not, at any M the wgmma kernel runs
    for k, n in ((2048, 768), (768, 2048), (4096, 4096), (5120, 27648), (27648, 5120)):
        st = state(k, n)
        cs = [c for m in (24, 64, 128, 256) if (c := choose(m, st)).kind == WGMMA]
        assert len(cs) >= 3 and all(use_pdl(c, st) for c in cs), (k, n)
    for k, n in ((8192, 28672), (28672, 8192)):
        st = state(k, n)
        cs = [choose(m, st) for m in (24, 48, 64, 96, 128, 192, 256)]
        assert all(c.kind == WGMMA and not use_pdl(c, st) for c in cs), (k, n)
    assert rows.WG_PDL_MAX_BYTES < 28672 * 8192 // 2 and 27648 * 5120 // 2 <= rows.WG_PDL_MAX_BYTES
    # the tail launch's first part too (Qwen2.5-7B's gate/up at M = 256: a wave unsplit, the rest in a tail)
    gate7 = state(3584, 18944)
    assert choose(256, gate7).tail and use_pdl(choose(256, gate7), gate7)
    # the rule leaves other kernels, an explicit choice and the switch alone
    assert choose(16, state(2048, 768)).kind != WGMMA
    assert rows.wg_programmatic(Config(kind=WGMMA, bn=64, pdl=False), state(2048, 768)).pdl is False
    monkeypatch.setenv("QTOOL_CUDA_PDL", "0")
    assert choose(128, state(2048, 768)).pdl and not use_pdl(choose(128, state(2048, 768)), state(2048, 768))
