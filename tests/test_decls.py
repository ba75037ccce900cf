"""Kernel declarations: every seed table row is in configs/kernels/gptqmodel.yaml with the seed's values,
vLLM's walk order is the seed's, the runtime floors match the seed's prose, and bad YAML is refused."""

from __future__ import annotations

import copy
import json
import re

import pytest

from qtool.errors import SpecError
from qtool.kernels.decls import load_engine, parse_engine
from qtool.kernels.devices import load_profiles
from qtool.paths import CONFIG_DIR
from qtool.select.plan import load_models
from tests.conftest import SEEDS

SEED_GPTQMODEL = SEEDS / "000_767c7c45bf4c8a4e.txt"
SEED_VLLM = SEEDS / "002_bd2429a6e019e49a.txt"


def _seed(path):
    if not path.is_file():
        pytest.fail(f"seed {path} missing; tests/fixtures/seeds is part of the repository")
    return path.read_text(encoding="utf-8").splitlines()


def _table(lines: list[str], header_prefix: str) -> list[list[str]]:
    """Rows of the tab-separated table whose header line starts with `header_prefix`."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header_prefix))
    rows = []
    for line in lines[start + 1:]:
        if "\t" not in line:
            break
        rows.append([c.strip() for c in line.split("\t")])
    return rows


def _cells(cell: str, conv=str):
    if cell in ("—", "-"):
        return None
    return tuple(conv(x.strip()) for x in cell.split(","))


def _bool(s: str) -> bool:
    return {"True": True, "False": False}[s]


@pytest.fixture(scope="module")
def gptqmodel():
    return load_engine("gptqmodel")


@pytest.fixture(scope="module")
def seed000():
    return _seed(SEED_GPTQMODEL)


def test_every_contract_row_is_declared_with_seed_values(gptqmodel, seed000):
    rows = _table(seed000, "Class\tFormat: AUTO priority")
    assert len(rows) == 55
    assert {r[0] for r in rows} == set(gptqmodel.names())
    for cls, formats, bits, groups, desc_act, sym, training in rows:
        k = gptqmodel.kernel(cls)
        want_formats = {f.split(":")[0].strip(): int(f.split(":")[1]) for f in formats.split(", ")}
        assert k.formats == want_formats, cls
        assert k.bits == _cells(bits, int), cls
        assert k.group_sizes == _cells(groups, int), cls
        assert k.desc_act == _cells(desc_act, _bool), cls
        assert k.sym == _cells(sym, _bool), cls
        assert k.training == _bool(training), cls


def test_every_operand_row_is_declared_with_seed_values(gptqmodel, seed000):
    rows = _table(seed000, "Class\tActivation dtypes")
    assert len(rows) == 55
    for cls, act, pack, in_div, out_div, padding, sharded in rows:
        k = gptqmodel.kernel(cls)
        assert k.act_dtypes == _cells(act), cls
        assert k.pack_dtypes == _cells(pack), cls
        assert (k.in_divisible, k.out_divisible) == (int(in_div), int(out_div)), cls
        assert k.auto_padding == _bool(padding), cls
        assert k.sharded_load == _bool(sharded), cls


def test_every_backend_row_is_declared_with_seed_values(gptqmodel, seed000):
    rows = _table(seed000, "BACKEND\tClass and qlinear source")
    assert len(rows) == 55
    for backend, cls_src, _relationship, devices in rows:
        cls, src = cls_src.rsplit(" ", 1)
        k = gptqmodel.kernel(cls)
        assert (k.backend, k.file) == (backend, src), cls
        want = ("all",) if devices == "ALL" else tuple(d.strip().lower() for d in devices.split(","))
        assert k.platforms == want, cls


def test_runtime_floors_match_the_seed_prose(gptqmodel, seed000):
    text = "\n".join(seed000)
    assert "capability exactly 9.0, with at least 204800 bytes of opt-in shared memory" in text
    for cls in ("MacheteLinear", "AwqMacheteLinear"):
        k = gptqmodel.kernel(cls)
        assert k.exact_cc == ((9, 0),) and k.min_smem_optin == 204800 and "rocm" in k.reject_platforms
    assert "GPTQ Marlin permits CUDA capability 7.5+, whereas AWQ Marlin's device floor is 8.0. ROCm is rejected" in text
    assert gptqmodel.kernel("MarlinLinear").min_cc == (7, 5)
    assert gptqmodel.kernel("AwqMarlinLinear").min_cc == (8, 0)
    assert all("rocm" in gptqmodel.kernel(c).reject_platforms for c in ("MarlinLinear", "AwqMarlinLinear"))
    assert "sm_100a, sm_103a, sm_110a" in text
    for cls in ("SwordfishLinear", "AwqSwordfishLinear"):
        k = gptqmodel.kernel(cls)
        assert k.exact_cc == ((10, 0), (10, 3), (11, 0)) and not k.sharded_load
        assert "uint8" not in k.weight_types  # zero-point INT8 is rejected
    assert "floor (12, 1)" in text and gptqmodel.kernel("W4ANVFP4Linear").min_cc == (12, 1)
    assert "FP8 hardware floor (8, 9)" in text and gptqmodel.kernel("W4AFP8Linear").min_cc == (8, 9)
    assert "check AVX512-BF16" in text
    for cls in ("TorchCpuAvx512Linear", "TorchCpuAvx512AwqLinear"):
        assert gptqmodel.kernel(cls).cpu_flags == ("avx512_bf16",)
    mlx = [k for k in gptqmodel.kernels if k.backend == "MLX"]
    assert len(mlx) == 14 and all(not k.executable and set(k.formats.values()) == {0} for k in mlx)
    assert gptqmodel.kernel("TorchInt8AwqLinear").retired
    assert not gptqmodel.kernel("TorchQuantEmbeddings").selectable


def test_vllm_cuda_list_is_the_seed_order():
    lines = _seed(SEED_VLLM)
    start = next(i for i, line in enumerate(lines) if "PlatformEnum.CUDA: [" in line)
    order = []
    for line in lines[start + 1:]:
        if line.strip().startswith("]"):
            break
        order.append(line.strip().rstrip(","))
    vllm = load_engine("vllm")
    assert vllm.lists["cuda"] == tuple(order)
    assert order[:4] == ["CutlassW4A8LinearKernel", "MacheteLinearKernel", "AllSparkLinearKernel",
                         "MarlinLinearKernel"]
    # The seed's Machete and Marlin checks.
    text = "\n".join(lines)
    assert "in_features % 64 or out_features % 128" in text
    machete = vllm.kernel("MacheteLinearKernel")
    assert (machete.k_part_multiple, machete.n_part_multiple, machete.exact_cc) == (64, 128, ((9, 0),))
    assert re.search(r"MARLIN_SUPPORTED_GROUP_SIZES = \[-1, 32, 64, 128\]", text)
    assert vllm.kernel("MarlinLinearKernel").group_sizes == (-1, 32, 64, 128)
    assert vllm.kernel("MarlinLinearKernel").group_straddle == "refuse"
    assert "rocm" not in vllm.kernel("MarlinLinearKernel").platforms
    assert "MarlinLinearKernel" not in vllm.lists["rocm"]


def test_qtool_engine_declares_its_three_kernels():
    q = load_engine("qtool")
    assert q.walk == "priority"
    assert set(q.names()) >= {"torch-ref", "torch-int4-cpu", "triton-w4a16"}
    cpu = q.kernel("torch-int4-cpu")
    assert cpu.group_sizes == (-1, 32, 64, 128, 256, 512, 1024) and cpu.n_part_multiple is None
    assert cpu.platforms == ("cpu",)
    tri = q.kernel("triton-w4a16")
    assert tri.min_cc == (8, 0) and tri.bits == (4,) and tri.n_part_multiple == 8 and tri.k_part_multiple == 8
    ref = q.kernel("torch-ref")
    assert ref.bits == (2, 3, 4, 5, 6, 7, 8) and ref.platforms == ("all",)


def test_profiles_and_models_load():
    profiles = load_profiles()
    for name in ("h100", "h200", "a100", "a10", "l40s", "rtx4090", "t4", "mi300x", "b200", "cpu",
                 "cpu-avx512-bf16", "mps"):
        assert name in profiles
    assert profiles["h100"].cc == (9, 0) and profiles["h100"].smem_optin == 232448
    assert profiles["b200"].cc == (10, 0) and profiles["mi300x"].platform == "rocm"
    assert "avx512_bf16" in profiles["cpu-avx512-bf16"].cpu_flags
    assert "avx512_bf16" not in profiles["cpu"].cpu_flags
    models = load_models()["models"]
    assert models["llama-3-70b"]["intermediate_size"] == 28672


def _raw():
    import yaml

    return yaml.safe_load((CONFIG_DIR / "kernels" / "vllm.yaml").read_text())


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["kernels"][1].update(k_part_mutiple=64), "unknown key 'k_part_mutiple'"),
    (lambda d: d["kernels"][1].update(exact_cc=[9.0]), "quoted \"major.minor\""),
    (lambda d: d["kernels"][1].update(group_sizes=["128"]), "group_sizes[0]"),
    (lambda d: d["kernels"][1].update(platforms=["tpu"]), "platforms[0] must be one of"),
    (lambda d: d["lists"]["cuda"].append("NoSuchKernel"), "undeclared kernel 'NoSuchKernel'"),
    (lambda d: d["kernels"].append(copy.deepcopy(d["kernels"][0])), "declared twice"),
    (lambda d: d.pop("walk"), "missing required key 'walk'"),
    (lambda d: d["methods"][0].update(gate="nope"), "undeclared gate 'nope'"),
])
def test_bad_declarations_are_refused_with_the_key(mutate, needle, tmp_path):
    data = _raw()
    mutate(data)
    with pytest.raises(SpecError) as e:
        parse_engine(data, tmp_path / "vllm.yaml")
    assert needle in str(e.value) and "vllm.yaml" in str(e.value)


def test_the_shipped_file_parses_unchanged(tmp_path):
    d = parse_engine(_raw(), tmp_path / "vllm.yaml")
    assert d.kernel("MacheteLinearKernel").exact_cc == ((9, 0),)


# --- seed 002's second world: FP8 / INT8 / W4A8 / NVFP4 and SGLang ----------------------------------------

def _text(path) -> str:
    return "\n".join(_seed(path))


def test_sglang_marlin_carries_the_vendored_constants():
    text = _text(SEED_VLLM)
    m = re.search(r"GPTQ_MARLIN_TILE = (\d+), MIN_THREAD_N = (\d+), MIN_THREAD_K = (\d+), "
                  r"MARLIN_SUPPORTED_GROUP_SIZES = \[([-\d, ]+)\]", text)
    assert m, "seed 002 no longer lists SGLang's Marlin constants"
    _tile, min_n, min_k, groups = m.groups()
    sgl = load_engine("sglang")
    marlin = sgl.kernel("gptq_marlin_gemm")
    assert (marlin.n_part_multiple, marlin.k_part_multiple) == (int(min_n), int(min_k))
    assert marlin.group_sizes == tuple(int(g) for g in groups.split(","))
    assert "There is no Machete in SGLang at this SHA" in text
    assert not any("machete" in n.lower() for n in sgl.names())


def test_sglang_block_fp8_order_is_the_seed_dispatch():
    lines = _seed(SEED_VLLM)
    start = next(i for i, line in enumerate(lines) if "def _dispatch_auto_backend" in line)
    order = []
    for line in lines[start:start + 30]:
        hit = re.match(r"\s+return (\w+)", line)
        if hit:
            order.append(hit.group(1).removesuffix("_with_fallback"))
    assert len(order) == 5
    walks = load_engine("sglang").walks["fp8_block"]
    amd = [n for n in order if n.startswith("aiter")]
    # Fp8LinearMethod.apply takes Marlin before the auto order where it is on (sglang-main fp8.py)
    assert walks["cuda"] == ("apply_fp8_marlin_linear",) + tuple(n for n in order if n not in amd)
    assert walks["rocm"] == tuple(amd) + (order[-1],)
    # "m_supported = 1 <= ... < 32": FlashInfer's 31-row window
    window = re.search(r"m_supported = (\d+) <= .* < (\d+)", "\n".join(lines))
    lo, hi = int(window.group(1)), int(window.group(2))
    assert load_engine("vllm").kernel("FlashInferFp8DeepGEMMDynamicBlockScaledKernel").m_range == (lo, hi - 1)
    # in SGLang the window guards the SM90 FlashInfer-DeepGEMM function, which the auto order does not return;
    # the Blackwell FlashInfer function it returns serves every M
    assert load_engine("sglang").kernel("flashinfer_gemm_w8a8_block_fp8_linear").m_range is None
    # DeepGEMM: SM >= 90, SM120 excluded
    assert "SM ≥ 90 required, SM120 explicitly excluded" in "\n".join(lines)
    for engine, name in (("sglang", "deepgemm_w8a8_block_fp8_linear"), ("vllm", "DeepGemmFp8BlockScaledMMKernel")):
        cc = load_engine(engine).kernel(name).exact_cc
        assert (9, 0) in cc and all(c >= (9, 0) and c[0] != 12 for c in cc)


def test_vllm_fp8_rows_follow_the_seed():
    text = _text(SEED_VLLM)
    vllm = load_engine("vllm")
    # "scaled_mm_blockwise_sm90_fp8.cu, …sm100…, …sm120…": one blockwise dispatch per architecture family
    archs = {int(a) for a in re.findall(r"sm(\d+)", text.split("Block-wise FP8")[1][:300])}
    assert archs == {90, 100, 120}
    assert {c[0] * 10 for c in vllm.kernel("CutlassFp8BlockScaledMMKernel").exact_cc} == archs
    # per-tensor and per-channel scales share one epilogue (ColOrScalarLoad / RowOrScalarLoad)
    assert "the same code path for per-tensor (a scalar) and per-token / per-channel (a vector)" in text
    assert vllm.kernel("CutlassFP8ScaledMMLinearKernel").scales == ("tensor", "channel")
    # "A and B must have symmetric quantization (zero point == 0)"
    assert "A and B must have symmetric quantization (zero point == 0)" in text
    assert vllm.kernel("CutlassInt8ScaledMMLinearKernel").sym == (True,)
    # W4A8: "CutlassW4A8LinearKernel declines (activations are bf16, not fp8)"
    assert "CutlassW4A8LinearKernel declines (activations are bf16, not fp8)" in text
    assert vllm.kernel("CutlassW4A8LinearKernel").act_dtypes == ("float8_e4m3fn",)
    # NVFP4 runs natively only on Blackwell's block-scaled tensor op
    assert "Blackwell's block-scaled tensor op consumes the sub-byte NVFP4 operands natively" in text
    assert vllm.kernel("CutlassNvFp4LinearKernel").min_cc == (10, 0)
    assert vllm.kernel("MarlinNvFp4LinearKernel").fallback
    # bitsandbytes and GGUF: SGLang loads them, vLLM's method list at the pin has neither
    assert 'neither "bitsandbytes" nor "gguf" is among them' in text
    vllm_formats = {f for m in vllm.methods for f in m.formats}
    sgl_formats = {f for m in load_engine("sglang").methods for f in m.formats}
    assert not vllm_formats & {"bnb", "gguf"} and {"bnb", "gguf"} <= sgl_formats
    # a group straddling a TP boundary is fatal in both engines
    assert "a group straddling a tensor-parallel boundary is fatal" in text
    assert vllm.base_checks["group_straddle_fatal"] and load_engine("sglang").base_checks["group_straddle_fatal"]


def test_gguf_rows_declare_qtypes_matching_their_bits(gptqmodel, seed000):
    import gguf

    text = "\n".join(seed000)
    assert "Broad logical bit declaration is not a blanket qtype guarantee" in text
    assert "GGUFTritonKernel\tDeclares logical bits 1/4/5/6 and CUDA" in text
    rows = [k for k in gptqmodel.kernels if k.formats and "GGUF" in k.formats and k.backend != "MLX"]
    assert {k.name for k in rows} == {"GGUFTorchLinear", "GGUFCppKernel", "GGUFCudaKernel", "GGUFTritonKernel"}
    for k in rows:
        assert k.qtypes, k.name
        for q in k.qtypes:
            if q in gguf.GGMLQuantizationType.__members__:
                bits = int(re.match(r"^I?Q(\d)", q).group(1))
                assert bits in k.bits, (k.name, q)
    assert gptqmodel.kernel("GGUFTritonKernel").qtypes == ("Q4_K", "Q5_K", "Q6_K")


def test_serialized_marlin_is_bound_to_its_backend(gptqmodel, seed000):
    text = "\n".join(seed000)
    assert ("the local model loader requires the matching Marlin backend or MLX for a serialized Marlin "
            "checkpoint. The same boundary applies to serialized BitBLAS checkpoints") in text
    assert gptqmodel.serialized["MARLIN"] == {"gptq": ("GPTQ_MARLIN", "MLX"), "awq": ("AWQ_MARLIN", "MLX")}
    backends = {k.backend for k in gptqmodel.kernels}
    assert {b for m in gptqmodel.serialized.values() for bs in m.values() for b in bs} <= backends
    # Marlin's packing and act-order checks stay even though the class declares no divisibility
    assert "Input/output packing divisibility and activation-order alignment are validated" in text
    for name in ("MarlinLinear", "AwqMarlinLinear"):
        k = gptqmodel.kernel(name)
        assert (k.k_part_multiple, k.n_part_multiple) == (16, 64) and k.strict_with_g_idx


def test_device_profiles_cover_the_architectures_the_paths_distinguish():
    profiles = load_profiles()
    archs = {(d.platform, d.arch) for d in profiles.values()}
    for want in (("cuda", "sm_80"), ("cuda", "sm_89"), ("cuda", "sm_90a"), ("cuda", "sm_100a"),
                 ("cuda", "sm_120a"), ("rocm", "gfx942"), ("cpu", None)):
        assert want in archs, want
    assert profiles["rtx5090"].cc == (12, 0) and profiles["l40s"].cc == (8, 9)


def test_rtx5090_peaks_cite_their_source_and_unknown_peaks_stay_null():
    import yaml

    raw = yaml.safe_load((CONFIG_DIR / "devices.yaml").read_text())["devices"]
    assert "RTX Blackwell GPU Architecture whitepaper" in raw["rtx5090"]["source"]
    d = load_profiles()["rtx5090"]
    # dense, FP32 accumulate: FP16/BF16 209.5, FP8 419 (FP4 1676 has no field); 512-bit GDDR7 at 28 Gbps
    assert (d.peak_bf16_tflops, d.peak_fp16_tflops, d.peak_fp8_tflops, d.hbm_gbps) == (209.5, 209.5, 419, 1792)
    # the ratios the whitepaper's table has on every GeForce part since Ada: FP8 = 2 x FP16 (both FP32-acc)
    ada = load_profiles()["rtx4090"]
    assert d.peak_fp8_tflops / d.peak_fp16_tflops == pytest.approx(ada.peak_fp8_tflops / ada.peak_fp16_tflops, 0.01)
    # a profile whose peaks are not published keeps null, and select reports it so rather than a number
    from typer.testing import CliRunner

    import qtool.cli.main  # noqa: F401
    from qtool.cli.app import app

    r = CliRunner().invoke(app, ["select", "--layer", "4096,4096", "--device", "gb10", "--json"])
    assert r.exit_code == 0, r.output
    prof = json.loads(r.stdout)["device_profile"]
    assert (prof["peak_bf16_tflops"], prof["peak_fp16_tflops"], prof["peak_fp8_tflops"]) == (None, None, None)


def test_vllm_main_rows_for_mxfp8_w4a8_and_gpt_oss():
    vllm = load_engine("vllm")
    # _POSSIBLE_MXFP8_KERNELS, in order, each row naming the vllm-main file it was read in
    assert vllm.walks["mxfp8"] == {"cuda": ("FlashInferCutlassMxfp8LinearKernel", "MarlinMxfp8LinearKernel",
                                            "EmulationMxfp8LinearKernel"),
                                   "rocm": ("EmulationMxfp8LinearKernel",)}
    for name in vllm.walks["mxfp8"]["cuda"]:
        k = vllm.kernel(name)
        assert k.source == "vllm-main" and k.file.startswith("mxfp8/") and k.group_sizes == (32,), name
    assert vllm.kernel("FlashInferCutlassMxfp8LinearKernel").min_cc == (10, 0)
    assert vllm.kernel("MarlinMxfp8LinearKernel").min_cc == (7, 5)
    methods = {m.name: m for m in vllm.methods}
    assert methods["CompressedTensorsW8A8Mxfp8"].walk_by_scale == {"group": "mxfp8"}
    # W4A8: the scheme exists on CC 9.0 only (_is_fp8_w4a8_sm90), a gate before any kernel
    assert methods["CompressedTensorsW4A8Fp8"].gate == "is_fp8_w4a8_sm90"
    assert next(g for g in vllm.gates if g.name == "is_fp8_w4a8_sm90").exact_cc == ((9, 0),)
    # gpt-oss: no MXFP4 linear method in vLLM; the refusal names what runs the experts instead
    gptoss = next(m for m in vllm.methods if "gptoss_mxfp4" in m.formats)
    assert gptoss.source == "vllm-main" and "Mxfp4MoEMethod" in gptoss.refuse
    assert "MXFP4 linear layer is not implemented" in gptoss.refuse


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_row_cites_where_it_comes_from(engine):
    """Each vLLM / SGLang row says its source: a sentence of seed 002, quoted (and checked to be there), or
    vllm-main / sglang-main, the upstream tree read after the seed's pin (the row's comment names the file)."""
    text = _text(SEED_VLLM)
    d = load_engine(engine)
    for row in (*d.kernels, *d.gates, *d.methods):
        src = row.source or ""
        if src in ("vllm-main", "sglang-main"):
            continue
        m = re.fullmatch(r'seed 002: "(.+)"', src)
        assert m, f"{engine} row {row.name} cites no source ({src!r})"
        assert m.group(1) in text, f"{engine} row {row.name}: seed 002 does not say {m.group(1)!r}"
