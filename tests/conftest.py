"""Shared fixtures. Under ACTSTORE_NO_SKIP=1 (the test command, CI) a skipped test fails."""

from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: D103
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("ACTSTORE_NO_SKIP") == "1" and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"skipped under ACTSTORE_NO_SKIP=1 (no test may skip in CI): {rep.longrepr}"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"
