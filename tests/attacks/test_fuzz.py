"""Property-based fuzzing of the parsers that read untrusted bytes: any exception other than
qtool.errors.QtoolError escaping them is a failure, and so is an accepted input whose parsed result breaks
its own invariants (see fuzz_targets.py). 100 examples per parser here (the one place the suite raises
hypothesis' 40-example profile; 5 parsers x 100 = 500 cases); benchmarks/fuzz_headers.py runs 10,000 per parser.

The explicit @example inputs are the crashers found so far, kept as regressions.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.attacks import fuzz_targets as ft

FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _scratch():
    yield
    ft.cleanup()


def _st(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@FUZZ
@given(ft.safetensors_files())
@example(_st(b'{"t": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', b"\0"))
@example(_st(b'{"t": {"dtype": ["F16"], "shape": [1], "data_offsets": [0, 2]}}', b"\0\0"))
@example(_st(json.dumps({"t": {"dtype": "U8", "shape": [10**4000] * 3, "data_offsets": [0, 1]}}).encode()))
@example(_st(b"[" * 100_000 + b"]" * 100_000))
@example(_st(b'{"__metadata__": [], "t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0"))
def test_read_header_fuzz(blob):
    ft.run_safetensors_header(blob)


@FUZZ
@given(ft.checkpoint_dirs())
@example(({"model.safetensors.index.json": b'{"weight_map": {"a.weight": "a\\u0000b"}}'}, "."))
@example(({"config.json": b'{"quantization_config": {"bits": ' + b"1" * 5000 + b"}}",
           "model.safetensors": ft._small_safetensors(["a.weight"])}, "."))
def test_open_checkpoint_fuzz(spec):
    ft.run_checkpoint(spec)


@FUZZ
@given(ft.quant_configs())
@example({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": True}}}})
@example({"quant_method": ["gptq"], "bits": 4.0})
@example([1, 2])
def test_parse_quant_config_fuzz(raw):
    ft.run_quant_config(raw)


@FUZZ
@given(ft.yaml_specs())
@example(b"bits: !!timestamp nope\n")
@example(b"bits: !!int ''\n")
@example(b"bits: !!bool maybe\n")
@example(b"bits: 2001-13-45\n")
@example(b"bits: !!int nope\n")
@example(b"bits: " + b"9" * 5000 + b"\n")
@example(b"bits: " + b"[" * 1500 + b"]" * 1500 + b"\n")
@example(b"a: &a [x, x]\nb: [*a, *a]\n")
def test_yaml_spec_fuzz(text):
    ft.run_yaml_spec(text)


@FUZZ
@given(ft.gguf_files())
@example(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 2**63) + b"name")
@example(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 9, 2**62))
def test_gguf_header_fuzz(blob):
    ft.run_gguf_header(blob)


# The gguf package's reader is not bounded: on some random files it grows past the machine's memory (an OOM
# kill of the test worker was seen). It runs in a child process under a memory and time cap; a file it cannot
# parse within them counts as one it rejects.
_REFERENCE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
import numpy as np
from gguf import GGUFReader
# the reader slices a memory map, so a value cut off by the end of the file comes back short, not as an error:
# made strict here, so that a truncated file counts as one the reference rejects
_get = GGUFReader._get
def _strict_get(self, offset, dtype, count=1, override_order=None):
    arr = _get(self, offset, dtype, count, override_order)
    if len(arr) < int(count):
        raise ValueError("read past the end of the file")
    return arr
GGUFReader._get = _strict_get
try:
    with np.errstate(all="ignore"):
        r = GGUFReader(sys.argv[1])
        out = {"keys": list(r.fields), "tensors": [[t.name, int(t.tensor_type), [int(d) for d in t.shape],
                                                    int(t.data_offset)] for t in r.tensors]}
except Exception:
    out = None
print(json.dumps(out))
"""


def _reference_gguf(path):
    import subprocess
    import sys

    try:
        res = subprocess.run([sys.executable, "-c", _REFERENCE, str(path)], capture_output=True, text=True,
                             timeout=5)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(res.stdout) if res.returncode == 0 and res.stdout.strip() else None


def test_reference_gguf_reader_runs_in_its_child(tmp_path):
    """The child process parses a file the gguf package wrote, so the comparison below is not silently skipped
    (an import failure or a crash there would read as "the reference rejects" every time)."""
    import gguf
    import numpy as np

    from qtool.io.gguf_reader import read_gguf_header

    w = gguf.GGUFWriter(tmp_path / "ok.gguf", "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = _reference_gguf(tmp_path / "ok.gguf")
    h = read_gguf_header(tmp_path / "ok.gguf")
    assert ref is not None and "llama.block_count" in ref["keys"] and len(ref["tensors"]) == 1
    assert [[t.name, t.type_id, list(t.shape), t.start] for t in h.tensors] == ref["tensors"]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ft.gguf_files().filter(lambda b: len(b) > 24))
def test_gguf_header_agrees_with_gguf_package(blob):
    """Where the gguf package's own reader parses a file without error, qtool's bounded reader finds the same
    metadata keys and the same tensor directory (names, GGML types, dims, offsets)."""
    from qtool.io.gguf_reader import read_gguf_header

    path = ft.scratch() / "agree.gguf"
    path.write_bytes(blob)
    ref = _reference_gguf(path)
    if ref is None:  # the reference rejects (in its own way): nothing to compare
        return
    h = read_gguf_header(path)
    assert h.complete
    assert list(h.kv) == [k for k in ref["keys"] if not k.startswith("GGUF.")]
    assert [[t.name, t.type_id, list(t.shape), t.start] for t in h.tensors] == ref["tensors"]


@FUZZ
@given(st.one_of(st.text(max_size=12), st.integers(-(2**70), 2**70),
                 st.builds(lambda n, u: f"{n}{u}", st.one_of(st.floats(), st.integers(-5, 10**30)),
                           st.sampled_from(["", "B", "KB", "MiB", "GB", "gib", " TB", "XB"]))))
@example("inf")
@example("nan")
@example("0.1B")
@example("9" * 5000)
def test_parse_size_fuzz(text):
    """--max-shard-size (flag or job spec): a positive byte count, or an OutputError; never inf/nan/0."""
    from qtool.errors import OutputError
    from qtool.io.writer import parse_size

    try:
        n = parse_size(text)
    except OutputError:
        return
    assert isinstance(n, int) and n >= 1
