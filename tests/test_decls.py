"""Kernel declarations: every seed table row is in configs/kernels/gptqmodel.yaml with the seed's values,
vLLM's walk order is the seed's, the runtime floors match the seed's prose, and bad YAML is refused."""

from __future__ import annotations

import copy
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
