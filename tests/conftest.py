"""Shared fixtures, the suite's markers, its Hypothesis profile and its schedule.

- No skips: under ACTSTORE_NO_SKIP=1 (the test command, CI) a skipped test fails.
- Markers (registered in pyproject.toml, checked by --strict-markers): `torch` and `dev` say
  what a test needs beyond the core install; every other test is marked `core` here, and the
  core job (scripts/test_core.sh: no torch, the newest zarr) runs `-m core`. A module that
  imports one of TORCH_IMPORTS (DEV_IMPORTS) at its top, itself or through a helper module of
  tests/, has its tests marked `torch` (`dev`), as has every test using the S3 server; the
  rest is marked by hand (`pytestmark = pytest.mark.torch` when a test reaches torch through
  the CLI or a subprocess). Where torch is not installed such modules are not imported.
  `slow` is marked by hand on heavy tests and here on every test recorded at SLOW_SECONDS or
  more; `scripts/test.sh --fast` leaves them out.
- Hypothesis: one profile, `short` (the default: 100 examples a test, no deadline) or `long`
  (ACTSTORE_HYPOTHESIS=long: 1,000).
- Schedule (pytest-xdist `--dist loadgroup`, scripts/test.sh, with the scheduler made here):
  a module that shares a module-scoped fixture runs in one process (its fixture is made
  once); every other test goes to whichever process is free. Longest first, by the durations
  recorded in tests/durations.json (refresh: ACTSTORE_RECORD_DURATIONS=1 bash scripts/test.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

# One compute thread a process (torch's intra-op pool, OpenBLAS, MKL), set before numpy or
# torch starts its pool, inherited by the forkserver, forked scripts and subprocesses: the
# suite runs more processes than the machine has cores, where a second thread per process
# buys no speed and its spin-waits (OpenMP's, at every small op) burn CPU: a tiny training
# loop took 7 times the CPU seconds with two threads. A run that sets the variable keeps its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from hypothesis import settings
from needs import module_needs, shares_module_fixture

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "durations.json"
SERVER_FIXTURES = {
    "s3_endpoint",
    "s3_url",
    "az_endpoint",
    "az_url",
    "gs_endpoint",
    "gs_url",
}  # the dev install's servers
# A test recorded at this many seconds or more (tests/durations.json: a full run, 3 processes
# on 2 cores) is marked slow, as are the heavy tests marked by hand: `scripts/test.sh --fast`
# leaves them out (the quick check of every module, a minute or so of tests).
SLOW_SECONDS = 1.0

# The one Hypothesis profile: a test sets no budget of its own, or a smaller one through
# factory.examples(n), which scales with the profile.
settings.register_profile("short", max_examples=100, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=1000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("ACTSTORE_HYPOTHESIS", "short"))


def pytest_configure(config):
    """DataLoader workers of stores in object storage start by forkserver (obstore does not
    survive fork): the server is one fresh interpreter per test process, and each worker forks
    from it. Preloading torch and the loaders there makes a worker a fork, not a fresh import
    of torch (seconds each); the victim and racer scripts (tests/forked.py) fork from it with
    actstore imported. Modules missing here (the core job: no torch) are skipped by
    multiprocessing itself."""
    import multiprocessing
    import sys

    if "torch" in sys.modules:  # imported before this file (a plugin): its pool as the variable says
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    multiprocessing.set_forkserver_preload(["actstore", "torch", "actstore.loaders.tokens", "actstore.loaders.pairs"])


def pytest_ignore_collect(collection_path, config):
    """Without torch (the core job) a module whose imports need torch or the dev install is not
    imported: its tests are not core, and the import would fail."""
    p = Path(collection_path)
    if p.suffix == ".py" and p.name.startswith("test_") and importlib.util.find_spec("torch") is None:
        return bool(module_needs(p)) or None
    return None


def pytest_collection_modifyitems(config, items):
    """The markers core/torch/dev, slow by recorded time, and the longest-first order of the
    processes' work units."""
    for item in items:
        needs = module_needs(Path(item.fspath))
        if SERVER_FIXTURES & set(item.fixturenames):
            needs.add("dev")
        for mark in sorted(needs):
            item.add_marker(mark)
        if not any(item.get_closest_marker(m) for m in ("torch", "dev", "soak")):  # the soak job runs its own
            item.add_marker("core")
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    for item in items:  # `slow` by hand, or by its recorded time (--fast: the quick tests)
        if recorded.get(item.nodeid, 0.0) >= SLOW_SECONDS and not item.get_closest_marker("slow"):
            item.add_marker("slow")
    default = 0.2  # a test not yet recorded
    cost: dict[str, float] = {}
    for item in items:
        cost[_unit(item.nodeid)] = cost.get(_unit(item.nodeid), 0.0) + recorded.get(item.nodeid, default)
    items.sort(key=lambda item: -cost[_unit(item.nodeid)])  # stable: a module's tests keep their order


def _unit(nodeid: str) -> str:
    """What pytest-xdist hands a process at once: a module that shares a module-scoped fixture
    (the fixture is made once), else one test."""
    path = nodeid.split("::", 1)[0]
    return path if shares_module_fixture(TESTS.parent / path) else nodeid


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (scripts/test.sh) hands out _unit's work units in the collection's
    order (longest first; --no-loadscope-reorder keeps it). pytest 9.2 ignores the nodeid
    suffix by which pytest-xdist 3.8 groups `xdist_group` marks, hence this scheduler."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByModuleFixture(config, log)


def pytest_runtest_logreport(report):
    """Sums each test's setup, call and teardown (ACTSTORE_RECORD_DURATIONS=1 keeps them)."""
    if os.environ.get("ACTSTORE_RECORD_DURATIONS") == "1":
        _RECORDED[report.nodeid.split("@")[0]] = _RECORDED.get(report.nodeid.split("@")[0], 0.0) + report.duration


_RECORDED: dict[str, float] = {}


def pytest_sessionfinish(session, exitstatus):
    """Writes tests/durations.json from the controller (not from xdist's workers)."""
    if os.environ.get("ACTSTORE_RECORD_DURATIONS") == "1" and not hasattr(session.config, "workerinput"):
        if _RECORDED:  # merged into the file: a run of some tests keeps the others' figures
            merged = (json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}) | _RECORDED
            rounded = {k: round(v, 2) for k, v in sorted(merged.items()) if v >= 0.05}
            DURATIONS.write_text(json.dumps(rounded, indent=0) + "\n")


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


def _serving(server, env_of):
    """The endpoint of `server` (a context manager yielding it) with env_of(endpoint) set in
    os.environ until the session ends: the session fixtures' one pattern."""
    import s3server

    with server as endpoint:
        old = s3server.apply_env(env_of(endpoint))
        try:
            yield endpoint
        finally:
            s3server.restore_env(old)


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (a free port; one per test process), its environment set."""
    import s3server

    yield from _serving(s3server.moto_server(), s3server.s3_env)


@pytest.fixture(scope="session")
def az_endpoint():
    """Azurite's blob service (one per test process), its environment set."""
    import emulators

    yield from _serving(emulators.azurite(), emulators.az_env)


@pytest.fixture(scope="session")
def gs_endpoint():
    """fake-gcs-server (one per test process), its environment set."""
    import emulators

    yield from _serving(emulators.fake_gcs(), emulators.gcs_env)


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket on the test S3 server: `s3://<bucket>/store`."""
    import s3server

    return f"s3://{s3server.create_bucket(s3_endpoint)}/store"


@pytest.fixture
def az_url(az_endpoint):
    """A fresh container on Azurite: `az://<container>/store`."""
    import uuid

    import emulators

    return f"{emulators.az_container(az_endpoint, f'c{uuid.uuid4().hex[:12]}')}/store"


@pytest.fixture
def gs_url(gs_endpoint):
    """A fresh bucket on fake-gcs-server: `gs://<bucket>/store` (objects are put with emulators.gcs_put)."""
    import uuid

    import emulators

    return f"{emulators.gcs_bucket(gs_endpoint, f'b{uuid.uuid4().hex[:12]}')}/store"


@pytest.fixture(scope="session")
def text_store(tmp_path_factory):
    """(store, tokenizer folder): factory.word_store's two shards of 'sentences' (token 0 is
    <bos>, label 1; dimension 0 fires on 'zebra'), its word-level tokenizer; made once a session."""
    from factory import word_store, word_tokenizer

    root = tmp_path_factory.mktemp("txt")
    tok = word_tokenizer(root / "tok")
    return word_store(root / "store", tok), tok


@pytest.fixture(scope="module")
def fault_original(tmp_path_factory):
    """(root, every value a reader gives) of a finalized faultlib store of 6 examples
    (segments prompt and response, a text, an int64 field, statistics), built once per module."""
    import faultlib
    from hostile import everything

    import actstore

    root = tmp_path_factory.mktemp("fault") / "store"
    faultlib.write_shard(root, 0, 6)
    actstore.finalize(root)
    return root, everything(root)


@pytest.fixture
def fault_store(fault_original, tmp_path):
    """A fresh copy of fault_original's store, to damage."""
    import faultlib

    return faultlib.copy_store(fault_original[0], tmp_path / "store")
