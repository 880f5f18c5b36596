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


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port), its environment set; stopped at the end."""
    import s3server

    with s3server.moto_server() as endpoint:
        old = s3server.apply_env(s3server.s3_env(endpoint))
        try:
            yield endpoint
        finally:
            s3server.restore_env(old)


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket on the test S3 server: `s3://<bucket>/store`."""
    import s3server

    return f"s3://{s3server.create_bucket(s3_endpoint)}/store"


@pytest.fixture(scope="module")
def fault_original(tmp_path_factory):
    """(root, every value a reader gives) of a finalized faultlib store of 6 examples
    (segments prompt and response, a text, an int64 field, statistics), built once per module."""
    import actstore
    import faultlib
    from hostile import everything

    root = tmp_path_factory.mktemp("fault") / "store"
    faultlib.write_shard(root, 0, 6)
    actstore.finalize(root)
    return root, everything(root)


@pytest.fixture
def fault_store(fault_original, tmp_path):
    """A fresh copy of fault_original's store, to damage."""
    import faultlib

    return faultlib.copy_store(fault_original[0], tmp_path / "store")
