"""Shared test fixtures: the foreign-tool checkpoints in tests/fixtures (PROVENANCE.md there), hypothesis
profiles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]
# The fixtures live in the repository, so a clone tests itself anywhere; QTOOL_FIXTURES points elsewhere.
FIXTURES_HOME = REPO / "tests" / "fixtures"
FIXTURES = Path(os.environ.get("QTOOL_FIXTURES", FIXTURES_HOME))
SEEDS = FIXTURES_HOME / "seeds"  # the seed documents test_decls parses

# Bounded hypothesis: CI has 2 cores and a 10-minute budget for the whole suite.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def bench_cli(capsys):
    """`qtool bench ARGS` in this process, through main() (so variadic flags and error lines are real):
    (exit code, stdout, stderr)."""
    from qtool.cli.main import main

    def run(*args):
        capsys.readouterr()
        try:
            main(["bench", *args])
            code = 0
        except SystemExit as e:
            code = e.code or 0
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    return run


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; unset QTOOL_FIXTURES to use tests/fixtures")
    return FIXTURES


def write_llama(d: Path, tensors: dict, torch_dtype: str) -> Path:
    """A dense Llama-style checkpoint the commands read: d/model.safetensors and a minimal config.json."""
    import json

    from safetensors.torch import save_file

    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": torch_dtype}))
    return d


def require_extension(monkeypatch, env: str, module) -> None:
    """Force a C++ extension on (small tensors too, a build failure an error); skip where it cannot be built
    (no compiler: the torch path is then the only one)."""
    monkeypatch.setenv(env, "1")
    try:
        module._library()
    except RuntimeError as e:
        pytest.skip(f"C++ extension unavailable: {e}")
    assert module.status().startswith("C++")


def fixture_path(name: str) -> Path:
    p = FIXTURES / name
    if not p.exists():
        pytest.fail(f"fixture {p} missing; unset QTOOL_FIXTURES to use tests/fixtures")
    return p
