"""`pack --to fp8|ct_fp8|ct_int8` as three stages (qtool.io.prefetch reads the next weight, the quantizer writes
into reused code buffers, the writer thread writes): the output is the one-tensor-at-a-time torch path's, byte
for byte, whatever the order of quantized and copied tensors and whichever weight is the largest; a read error
surfaces for its tensor; the prefetcher hands tensors out in order and refuses another order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import InputError
from qtool.io.checkpoint import open_checkpoint
from qtool.io.prefetch import Prefetcher
from qtool.pack import PackJob, run_pack
from tests.conftest import write_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Weights of several sizes between copied tensors; two large enough (>= 1 M weights) for the C++ loops."""
    d = tmp_path_factory.mktemp("pipe") / "dense"
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    t = {"model.embed_tokens.weight": torch.randn(64, 256, generator=g).bfloat16(),
         "model.layers.0.mlp.up_proj.weight": torch.randn(1024, 1056, generator=g).bfloat16(),
         "model.layers.0.input_layernorm.weight": torch.ones(256).bfloat16(),
         "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256, generator=g).bfloat16(),
         "model.layers.0.mlp.down_proj.weight": torch.randn(1056, 1024, generator=g).bfloat16(),
         "model.layers.1.self_attn.o_proj.weight": torch.randn(200, 256, generator=g).bfloat16()}
    write_llama(d, t, "bfloat16")
    return d


def _files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in ("report.json", "report.md")}


@pytest.mark.parametrize("to,extra", [("fp8", ()), ("fp8", ("tensor",)), ("ct_fp8", ("channel",)), ("ct_int8", ())])
def test_the_staged_pack_writes_the_torch_paths_bytes(model, tmp_path, monkeypatch, to, extra):
    strategy = extra[0] if extra else None
    monkeypatch.delenv("QTOOL_SCALED_QUANT_EXT", raising=False)
    fast = run_pack(PackJob(model, tmp_path / "fast", to=to, bits=8, strategy=strategy))
    monkeypatch.setenv("QTOOL_SCALED_QUANT_EXT", "0")  # every weight through the torch arithmetic
    slow = run_pack(PackJob(model, tmp_path / "slow", to=to, bits=8, strategy=strategy))
    assert _files(tmp_path / "fast") == _files(tmp_path / "slow")
    assert [r.module for r in fast.results] == [r.module for r in slow.results]
    for a, b in zip(fast.results, slow.results, strict=True):
        assert a.rel_error == pytest.approx(b.rel_error, rel=1e-4)


def test_prefetcher_reads_in_order_into_two_buffers(model):
    ck = open_checkpoint(model)
    names = [n for n in ck.tensors if n.endswith("proj.weight")]
    with Prefetcher([ck.tensors[n] for n in names]) as reader:
        seen = []
        for n in names:
            t = reader.get(n)
            assert torch.equal(t, ck.get(n))
            seen.append(t.untyped_storage().data_ptr())
        assert len(set(seen)) == 2  # the buffers are reused, not one per tensor
        with pytest.raises(RuntimeError, match="prefetch order"):
            reader.get(names[0])


def test_a_read_error_names_its_tensor(model, tmp_path):
    src = tmp_path / "cut"
    src.mkdir()
    for f in ("model.safetensors", "config.json"):
        (src / f).write_bytes((model / f).read_bytes())
    ck = open_checkpoint(src)
    last = max(ck.tensors.values(), key=lambda i: i.start)
    with open(src / "model.safetensors", "r+b") as f:  # the file changes after its header was read
        f.truncate(last.start + last.nbytes - 1000)
    with Prefetcher([last]) as reader, pytest.raises(InputError, match="file ends after") as e:
        reader.get(last.name)
    assert e.value.tensor == last.name


def test_a_nan_weight_found_while_reading_is_refused_with_its_place(model, tmp_path):
    src = tmp_path / "nan"
    src.mkdir()
    from safetensors.torch import load_file

    t = load_file(model / "model.safetensors")
    t["model.layers.0.mlp.down_proj.weight"][700, 5] = float("nan")  # a weight the C++ loops take (>= 1 M)
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_bytes((model / "config.json").read_bytes())
    with pytest.raises(InputError, match=r"at \[700, 5\]") as e:
        run_pack(PackJob(src, tmp_path / "out", to="fp8", bits=8))
    assert e.value.tensor == "model.layers.0.mlp.down_proj.weight" and not (tmp_path / "out").exists()
