"""Shared test fixtures: the foreign-tool checkpoints in ../shared/fixtures, tolerances, temp dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]
# CI lays a copy of shared/ beside the clone; QTOOL_FIXTURES overrides.
FIXTURES = Path(os.environ.get("QTOOL_FIXTURES", REPO.parent / "shared" / "fixtures"))

# Bounded hypothesis: CI has 2 cores and a 10-minute budget for the whole suite.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; set QTOOL_FIXTURES to ../shared/fixtures")
    return FIXTURES


def fixture_path(name: str) -> Path:
    p = FIXTURES / name
    if not p.exists():
        pytest.fail(f"fixture {p} missing; set QTOOL_FIXTURES to ../shared/fixtures")
    return p
