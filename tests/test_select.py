"""Kernel selection: the seeds' worked examples, capability-exact checks, full refusal reports, hints."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qtool.errors import DeviceError, UsageError
from qtool.kernels.decls import load_engine
from qtool.kernels.devices import Device, profile, resolve_device
from qtool.kernels.select import LayerQuant, marlin_padded_nk, select_kernel
from qtool.scheme import QuantScheme
from qtool.select.plan import DEFAULT_SCHEME, layer_groups, model_groups, path_groups, plan_select
from tests.conftest import fixture_path

H100, H200, A100, B200 = (profile(n) for n in ("h100", "h200", "a100", "b200"))
MI300X, CPU, CPU512, GB10 = (profile(n) for n in ("mi300x", "cpu", "cpu-avx512-bf16", "gb10"))


def gptq(K, N, parallel="column", **kw) -> LayerQuant:
    q = {"format": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    q.update((k, kw.pop(k)) for k in list(kw) if k in q)
    base = dict(name="layer", in_features=K, out_features=N, scheme=QuantScheme(**q), act_dtype="bfloat16",
                parallel=parallel)
    base.update(kw)
    return LayerQuant(**base)


def cand(sel, name):
    return next(c for c in sel.candidates if c.kernel == name)


# --- the seed's worked example (002: Llama-3-70B GPTQ 4-bit g128, no act-order, TP=2, H100) -------------

def test_llama3_70b_tp2_h100_down_proj_gets_machete_under_vllm():
    rep = plan_select(model_groups("llama-3-70b", DEFAULT_SCHEME), H100, "vllm", tp=2)
    down = next(r.selection for r in rep.layers if r.name.endswith("mlp.down_proj"))
    assert (down.layer.in_features, down.layer.out_features) == (28672, 8192)
    assert (down.in_features_per_partition, down.out_features_per_partition) == (14336, 8192)
    assert down.chosen == "MacheteLinearKernel"
    kinds = [c.kernel for c in down.candidates]
    # the walk: config method, config-time Marlin gate, then the CUDA list in the seed's order
    assert kinds[:4] == ["AutoGPTQConfig", "verify_marlin_supported", "CutlassW4A8LinearKernel",
                         "MacheteLinearKernel"]
    cutlass = cand(down, "CutlassW4A8LinearKernel")
    assert not cutlass.ok and "activation dtype bfloat16 not in [float8_e4m3fn]" in cutlass.reason
    assert cand(down, "AutoGPTQConfig").reason.startswith("AutoGPTQConfig: weight type uint4b8")
    # every layer of the model gets Machete at TP=2, and the fused QKV carries the summed N
    assert {r.selection.chosen for r in rep.layers} == {"MacheteLinearKernel"}
    qkv = next(r.selection for r in rep.layers if r.name.endswith("qkv_proj"))
    assert qkv.layer.out_features == (64 + 2 * 8) * 128 and qkv.out_features_per_partition == 5120


def test_k_part_not_multiple_of_64_falls_to_marlin_with_padding_note():
    # Row-parallel K=19110 at TP=2 -> K_part 9555 (channelwise, so no group straddles the shard).
    sel = select_kernel(gptq(19110, 8192, "row", group_size=-1), H100, "vllm", tp=2)
    assert sel.in_features_per_partition == 9555
    machete = cand(sel, "MacheteLinearKernel")
    assert machete.reason == "MacheteLinearKernel: K_part 9555 % 64 != 0"
    assert machete.hint.startswith("pad K_part 9555 -> 9600 (multiple of 64)")
    assert sel.chosen == "MarlinLinearKernel"
    marlin = cand(sel, "MarlinLinearKernel")
    assert marlin.ok and "pads N_partxK_part" not in marlin.reason
    assert "pads NxK_part 8192x9555 -> 8192x9600" in marlin.reason
    # the pad hint is true: a K that is a multiple of 64 per rank gets Machete back
    assert select_kernel(gptq(19200, 8192, "row", group_size=-1), H100, "vllm", tp=2).chosen == \
        "MacheteLinearKernel"


def test_runtime_refusal_never_masks_the_shape_refusal():
    sel = select_kernel(gptq(19110, 8192, "row", group_size=-1), A100, "vllm", tp=2)
    machete = cand(sel, "MacheteLinearKernel")
    assert machete.reason == "MacheteLinearKernel: K_part 9555 % 64 != 0; CC 8.0 != 9.0 (exact targets only)"
    assert machete.failures == ("K_part 9555 % 64 != 0", "CC 8.0 != 9.0 (exact targets only)")


def test_group_straddling_tp_shards_is_fatal_for_marlin():
    # Qwen2.5-72B down_proj at TP=8: K_part = 29568 / 8 = 3696 = 28.875 groups of 128.
    rep = plan_select(model_groups("qwen2.5-72b", DEFAULT_SCHEME), H100, "vllm", tp=8)
    down = next(r.selection for r in rep.layers if r.name.endswith("down_proj"))
    assert down.in_features_per_partition == 3696
    assert any("groups straddle TP shards: K_part 3696 % group_size 128 = 112" in n for n in down.notes)
    assert "K_part 3696 % 64 != 0" in cand(down, "MacheteLinearKernel").reason
    marlin = cand(down, "MarlinLinearKernel")
    assert "straddles TP shards" in marlin.reason and marlin.hint == "TP=1"
    # TP=2 would clear Machete's K_part % 64 but not the straddle (14784 % 128 = 64): TP=1 only
    assert cand(down, "MacheteLinearKernel").hint.endswith("TP=1")
    assert down.chosen is None


# --- GPTQModel AUTO -------------------------------------------------------------------------------------

def test_gptqmodel_auto_on_cpu_with_group_2048_reports_every_refusal():
    sel = select_kernel(gptq(4096, 4096, group_size=2048, act_dtype="float16"), CPU, "gptqmodel")
    assert sel.chosen is None
    decls = load_engine("gptqmodel")
    declaring = [k.name for k in decls.kernels if k.selectable and "GPTQ" in (k.formats or {})]
    assert sorted(c.kernel for c in sel.candidates) == sorted(declaring)
    assert len(sel.candidates) == 14
    # AUTO order: priority descending, explicit-only (0) last
    prios = [c.priority for c in sel.candidates]
    assert prios == sorted(prios, reverse=True) and prios[0] == 120 and prios[-1] == 0
    for c in sel.candidates:
        assert not c.ok and "group_size 2048 not in" in c.reason, c.reason
    aten = cand(sel, "TorchAtenLinear")
    assert aten.reason == "TorchAtenLinear: group_size 2048 not in [32, 64, 128, 256]"
    assert aten.hint == "re-quantize with group_size 128"
    # the CUDA kernels report their platform refusal as well as the group one
    assert cand(sel, "MacheteLinear").failures == ("group_size 2048 not in [-1, 64, 128]",
                                                   "platform cpu not in [cuda]")


def test_gptqmodel_auto_on_h100_prefers_machete_then_marlin():
    sel = select_kernel(gptq(4096, 14336), H100, "gptqmodel")
    assert sel.chosen == "MacheteLinear"
    assert cand(sel, "SwordfishLinear").reason == \
        "SwordfishLinear: CC 9.0 not in [10.0, 10.3, 11.0] (exact targets only)"
    # not enough opt-in shared memory for Machete on an otherwise-Hopper device
    small = replace(H100, name="hopper-small-smem", smem_optin=101376)
    sel = select_kernel(gptq(4096, 14336), small, "gptqmodel")
    assert sel.chosen == "MarlinLinear"
    assert "opt-in shared memory 101376 B < 204800 B" in cand(sel, "MacheteLinear").reason


def test_machete_is_capability_exact_9_0_not_blackwell():
    for dev in (H100, H200):
        assert select_kernel(gptq(4096, 4096), dev, "vllm").chosen == "MacheteLinearKernel"
        assert select_kernel(gptq(4096, 4096), dev, "gptqmodel").chosen == "MacheteLinear"
    sel = select_kernel(gptq(4096, 4096), B200, "vllm")
    assert sel.chosen == "MarlinLinearKernel"
    assert cand(sel, "MacheteLinearKernel").reason == \
        "MacheteLinearKernel: CC 10.0 != 9.0 (exact targets only)"
    assert cand(sel, "MacheteLinearKernel").hint == "runs on h100, h200"
    sel = select_kernel(gptq(4096, 4096), B200, "gptqmodel")
    assert sel.chosen == "SwordfishLinear"
    assert "CC 10.0 != 9.0" in cand(sel, "MacheteLinear").reason
    # Swordfish's Blackwell targets are not W4A NVFP4's 12.1 floor, and sharding is off for Swordfish
    assert "CC 12.1 not in [10.0, 10.3, 11.0]" in cand(select_kernel(gptq(4096, 4096), GB10, "gptqmodel"),
                                                       "SwordfishLinear").reason
    sel = select_kernel(gptq(4096, 4096), B200, "gptqmodel", tp=2)
    assert "sharded load disabled (SUPPORTS_SHARDED_LOAD=False) but tp=2" in cand(sel, "SwordfishLinear").reason
    nvfp4 = cand(select_kernel(gptq(4096, 4096), GB10, "gptqmodel"), "W4ANVFP4Linear")
    assert nvfp4.failures == ("priority 0 for GPTQ: explicit selection only, never AUTO",)


@st.composite
def rocm_layers(draw):
    fmt = draw(st.sampled_from(["gptq", "gptq_v2", "awq", "marlin", "ct"]))
    scheme = QuantScheme(fmt, draw(st.sampled_from([4, 8])), draw(st.sampled_from([-1, 32, 64, 128])),
                         draw(st.booleans()), draw(st.booleans()))
    return LayerQuant(name="l", in_features=draw(st.sampled_from([4096, 8192, 11008, 14336, 9555])),
                      out_features=draw(st.sampled_from([4096, 1024, 28672, 8200])), scheme=scheme,
                      act_dtype=draw(st.sampled_from(["float16", "bfloat16"])),
                      parallel=draw(st.sampled_from(["row", "column"])))


@given(layer=rocm_layers(), engine=st.sampled_from(["gptqmodel", "vllm"]), tp=st.sampled_from([1, 2, 4]))
def test_rocm_never_gets_marlin(layer, engine, tp):
    sel = select_kernel(layer, MI300X, engine, tp=tp)
    assert sel.chosen is None or "Marlin" not in sel.chosen
    for c in sel.candidates:
        if "Marlin" in c.kernel and "Mlx" not in c.kernel:
            assert not c.ok and ("rejects platform rocm" in c.reason or "platform rocm not in" in c.reason)


def test_rocm_under_vllm_walks_its_own_list():
    sel = select_kernel(gptq(4096, 4096), MI300X, "vllm")
    assert [c.kernel for c in sel.candidates if c.kind == "kernel"] == \
        ["TritonW4A16LinearKernel", "ConchLinearKernel", "ExllamaLinearKernel"]
    assert sel.chosen == "TritonW4A16LinearKernel"


# --- other formats --------------------------------------------------------------------------------------

def test_three_bit_gptq():
    layer = gptq(4096, 4096, bits=3, act_dtype="float16")
    sel = select_kernel(layer, H100, "gptqmodel")
    assert sel.chosen == "TorchLinear"
    assert cand(sel, "MacheteLinear").reason == "MacheteLinear: bits 3 not in [4, 8]"
    assert cand(sel, "MacheteLinear").hint == "re-quantize to 4-bit"
    assert cand(sel, "TritonV2Linear").reason == "TritonV2Linear: bits 3 not in [2, 4, 8]"
    # vLLM refuses at config time (no uint3b4 in AutoGPTQConfig / Marlin's grid)
    sel = select_kernel(layer, H100, "vllm")
    assert sel.chosen is None
    assert cand(sel, "AutoGPTQConfig").reason == "AutoGPTQConfig: bits 3 not in [4, 8]"
    assert "weight type uint3b4 not in [uint4b8, uint8b128]" in cand(sel, "verify_marlin_supported").reason
    assert "refused by AutoGPTQConfig at config time, before any kernel is tried" in sel.notes


def test_vllm_refuses_bfloat16_below_cc_8_when_it_starts():
    """vLLM's CUDA platform refuses a bfloat16 model on CC < 8.0 before any layer is read; Marlin's own rows
    (CC 7.5) would pass, so the plan must not name one."""
    t4 = profile("t4")
    bf16 = gptq(4096, 4096)
    sel = select_kernel(bf16, t4, "vllm")
    assert sel.chosen is None
    gate = cand(sel, "check_if_supports_dtype")
    assert gate.failures == ("bfloat16 needs CC >= 8.0, the device has CC 7.5",)
    assert gate.hint == "run with --dtype fp16"
    assert sel.candidates[0] is gate and cand(sel, "MarlinLinearKernel").ok
    assert "refused by check_if_supports_dtype when the engine starts, before any kernel is tried" in sel.notes
    assert select_kernel(replace(bf16, act_dtype="float16"), t4, "vllm").chosen == "MarlinLinearKernel"
    on_a100 = select_kernel(bf16, A100, "vllm")
    assert on_a100.chosen == "MarlinLinearKernel"
    assert "check_if_supports_dtype" not in [c.kernel for c in on_a100.candidates]  # listed where it refuses


def test_three_bit_fixture_through_inspect():
    groups, notes, _ = path_groups(fixture_path("gptqmodel-gptq-3bit-g128-asym"))
    assert {g.layer.format for g in groups} == {"gptq_v2"} and {g.layer.bits for g in groups} == {3}
    rep = plan_select(groups, H100, "gptqmodel")
    assert {r.selection.chosen for r in rep.layers} == {"TorchLinear"}
    rep = plan_select(groups, H100, "vllm")
    assert {r.selection.chosen for r in rep.layers} == {None}


def test_gptq_p_planar():
    groups, _, _ = path_groups(fixture_path("gptqmodel-gptq_p-5bit-g64-asym"))
    rep = plan_select(groups, CPU, "gptqmodel")
    for r in rep.layers:
        s = r.selection
        assert s.chosen == "TorchLinear"
        assert [c.kernel for c in s.candidates] == ["TorchLinear", "MlxQuantLinear"]
    sel = select_kernel(gptq(4096, 4096, format="gptq_p", bits=5, group_size=64, sym=False), H100, "vllm")
    assert sel.chosen is None
    assert "format gptq_p is not a checkpoint format vLLM loads" in cand(sel, "vLLM method").reason
    # 4-bit planar is bit-identical to continuous packing: the hint says so
    sel = select_kernel(gptq(4096, 4096, format="gptq_p"), H100, "vllm")
    assert "bit-identical to gptq" in cand(sel, "vLLM method").hint


def test_awq_on_cpu():
    awq = gptq(4096, 4096, format="awq", sym=False, act_dtype="float16")
    sel = select_kernel(awq, CPU, "gptqmodel")
    assert sel.chosen == "TorchAtenAwqLinear"
    avx = cand(sel, "TorchCpuAvx512AwqLinear")
    assert avx.failures == ("activation dtype float16 not in [bfloat16]", "CPU lacks avx512_bf16")
    assert avx.hint == "runs on cpu-avx512-bf16; run with --dtype bf16"
    assert cand(sel, "AwqGEMMLinear").reason == "AwqGEMMLinear: platform cpu not in [cuda]"
    # on an AVX512-BF16 CPU with bf16 activations the native kernel wins; fp16 still falls to ATen
    assert select_kernel(replace(awq, act_dtype="bfloat16"), CPU512, "gptqmodel").chosen == "TorchCpuAvx512AwqLinear"
    assert select_kernel(awq, CPU512, "gptqmodel").chosen == "TorchAtenAwqLinear"
    # the real AWQ fixture, through inspect
    groups, _, _ = path_groups(fixture_path("gptqmodel-awq-gemm-4bit-g128"))
    rep = plan_select(groups, CPU, "gptqmodel")
    assert {r.selection.chosen for r in rep.layers} == {"TorchAtenAwqLinear"}
    # vLLM: AWQ's zero points give uint4, which Machete takes with zero points
    sel = select_kernel(replace(awq, act_dtype="bfloat16"), H100, "vllm")
    assert sel.chosen == "MacheteLinearKernel"
    assert "weight type uint4 with zero points not in [uint4b8, uint8b128]" in \
        cand(sel, "ExllamaLinearKernel").reason


def test_qtool_engine():
    assert select_kernel(gptq(4096, 4096), CPU, "qtool").chosen == "torch-int4-cpu"
    sel = select_kernel(gptq(4096, 4096), H100, "qtool")
    assert sel.chosen == "cuda-w4a16" and cand(sel, "triton-w4a16").ok
    sel = select_kernel(gptq(4096, 4104, group_size=48), CPU, "qtool")
    assert sel.chosen == "torch-ref"
    assert cand(sel, "torch-int4-cpu").failures == ("group_size 48 not in [-1, 32, 64, 128, 256, 512, 1024]",
                                                    "K 4096 % group_size 48 != 0")


def test_disable_and_act_order():
    sel = select_kernel(gptq(4096, 4096), H100, "vllm", disabled={"MacheteLinearKernel"})
    assert sel.chosen == "MarlinLinearKernel"
    m = cand(sel, "MacheteLinearKernel")
    assert m.reason == "MacheteLinearKernel: disabled by --disable" and m.hint == "drop --disable MacheteLinearKernel"
    # act-order with K split across ranks: Machete refuses, Marlin keeps the strict tile check
    sel = select_kernel(gptq(14336, 4096, "row", desc_act=True), H100, "vllm", tp=2)
    assert "act-order (g_idx) with K split across 2 ranks" in cand(sel, "MacheteLinearKernel").reason
    assert sel.chosen == "MarlinLinearKernel"
    sel = select_kernel(gptq(14336 + 64 * 2, 4096, "row", desc_act=True, group_size=64), H100, "vllm", tp=2)
    assert "act-order keeps the strict tile check: K_part 7232 % 128 != 0" in cand(sel, "MarlinLinearKernel").reason


def test_unknown_disable_and_device_are_usage_errors():
    with pytest.raises(UsageError, match="did you mean 'MacheteLinearKernel'"):
        plan_select(layer_groups(["4096,4096"], DEFAULT_SCHEME), H100, "vllm", disabled=["MacheteLinearKernal"])
    with pytest.raises(DeviceError, match="did you mean 'h100'"):
        resolve_device("h10")


def test_absent_cuda_device_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(DeviceError) as e:
        resolve_device("cuda:0")
    assert "torch sees no CUDA/ROCm device" in str(e.value) and "h100" in str(e.value)


def test_live_cpu_reads_flags(monkeypatch):
    import qtool.kernels.devices as devices

    monkeypatch.setattr(devices, "detect_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    dev = resolve_device("cpu")
    assert dev.live and dev.platform == "cpu" and "avx512_bf16" in dev.cpu_flags and dev.torch_ops is not None
    sel = select_kernel(gptq(4096, 4096), dev, "gptqmodel")
    assert sel.chosen == "TorchCpuAvx512Linear"
    assert not any(n.startswith("assumes torch") for n in cand(sel, "TorchAtenLinear").notes)


@given(n=st.integers(1, 20000), k=st.integers(1, 20000), g=st.sampled_from([-1, 32, 64, 128]))
def test_marlin_padding_is_the_smallest_tile_family_fit(n, k, g):
    pn, pk = marlin_padded_nk(n, k, g)
    grp = g if g > 0 else 1
    assert pn >= n and pk >= k and pk % grp == 0
    assert (pn % 64 == 0 and pk % 128 == 0) or (pn % 128 == 0 and pk % 64 == 0)
    # brute force over the two families' smallest fits
    fits = [(math.ceil(n / a) * a, math.ceil(k / math.lcm(b, grp)) * math.lcm(b, grp)) for a, b in
            ((64, 128), (128, 64))]
    assert pn * pk == min(x * y for x, y in fits)


def test_device_is_plain_data():
    d = Device(name="x", platform="cuda", cc=(9, 0), smem_optin=232448)
    assert select_kernel(gptq(4096, 4096), d, "vllm").chosen == "MacheteLinearKernel"


@pytest.mark.gpu
def test_live_cuda_device_matches_torch():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = resolve_device("cuda:0")
    props = torch.cuda.get_device_properties(0)
    assert dev.live and dev.cc == (props.major, props.minor) and dev.sm_count == props.multi_processor_count
    assert dev.smem_optin and dev.smem_optin >= 48 * 1024
    sel = select_kernel(gptq(28672, 8192, "row"), dev, "vllm", tp=2)
    if dev.platform == "cuda" and dev.cc == (9, 0):
        assert sel.chosen == "MacheteLinearKernel"
        assert select_kernel(gptq(4096, 4096), dev, "gptqmodel").chosen == "MacheteLinear"
    elif dev.platform == "rocm":
        assert sel.chosen is None or "Marlin" not in sel.chosen


def test_live_cuda_reads_torch_properties(monkeypatch):
    import torch

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                            shared_memory_per_block_optin=232448, total_memory=85_000_000_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.version, "hip", None)
    dev = resolve_device("cuda:0")
    assert (dev.platform, dev.cc, dev.smem_optin, dev.sm_count) == ("cuda", (9, 0), 232448, 132)
    assert dev.hbm_gbps == 3350 and dev.live  # bandwidth borrowed from the h100 profile
    assert select_kernel(gptq(28672, 8192, "row"), dev, "vllm", tp=2).chosen == "MacheteLinearKernel"
    with pytest.raises(DeviceError, match=r"torch sees 1 device\(s\)"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("name, gbps, two_tiles", [("NVIDIA H100 80GB HBM3", 3350, False), ("NVIDIA H200", 4800, True),
                                                  ("NVIDIA Hopper Engineering Sample", 0, False)])
def test_cuda_w4a16_takes_the_bandwidth_of_the_cards_profile(monkeypatch, name, gbps, two_tiles):
    """cuda-w4a16's layer state carries the memory bandwidth of the profile the card's name matches (0 for none),
    and the M 9-16 dispatch reads it: two-tile units on Llama-3-70B's down_proj (seven K groups) only on the H200."""
    import torch

    from qtool.kernels import cuda
    from qtool.kernels.cuda.rows import choose

    props = SimpleNamespace(name=name, major=9, minor=0, multi_processor_count=132,
                            shared_memory_per_block_optin=232448, total_memory=85_000_000_000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda.hbm_gbps.cache_clear()
    try:
        assert cuda.hbm_gbps(0) == gbps
    finally:
        cuda.hbm_gbps.cache_clear()
    down = SimpleNamespace(K=28672, N=8192, n_sm=132, cc=(9, 0), gshift_blk=7, cluster_slots=(), hbm_gbps=gbps)
    assert (choose(16, down).t == 2) is two_tiles


def test_declared_windows_and_numbers_are_checked(tmp_path):
    """m_range / cc_range are read as [0]..[-1]: a reversed pair silently served no M; a .nan bandwidth reached
    --json as NaN, which is no JSON."""
    import yaml

    from qtool.errors import SpecError
    from qtool.kernels.decls import parse_engine, validate
    from qtool.kernels.devices import DEVICES_FILE
    from qtool.paths import CONFIG_DIR

    raw = yaml.safe_load((CONFIG_DIR / "kernels" / "vllm.yaml").read_text())
    row = next(k for k in raw["kernels"] if "m_range" in k)
    for bad in ([31, 1], [1], [1, 16, 31]):
        row["m_range"] = bad
        with pytest.raises(SpecError, match=r"m_range must be \[lo, hi\] with lo <= hi"):
            parse_engine(raw, tmp_path / "vllm.yaml")
    row["m_range"] = [1, 31]
    next(k for k in raw["kernels"] if "cc_range" in k)["cc_range"] = ["8.9", "8.0"]
    with pytest.raises(SpecError, match="cc_range must be"):
        parse_engine(raw, tmp_path / "vllm.yaml")
    devices = yaml.safe_load((CONFIG_DIR / "devices.yaml").read_text())
    for value in (float("nan"), float("inf")):
        devices["devices"]["h100"]["hbm_gbps"] = value
        with pytest.raises(SpecError, match="hbm_gbps must be a finite number"):
            validate(devices, DEVICES_FILE, tmp_path / "devices.yaml")
