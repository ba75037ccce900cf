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


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; unset QTOOL_FIXTURES to use tests/fixtures")
    return FIXTURES


def fixture_path(name: str) -> Path:
    p = FIXTURES / name
    if not p.exists():
        pytest.fail(f"fixture {p} missing; unset QTOOL_FIXTURES to use tests/fixtures")
    return p
