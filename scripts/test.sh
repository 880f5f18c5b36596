#!/usr/bin/env bash
# The test command: sets everything up (the dev install, and beside it chromium and Azurite,
# which only tests use), then runs the whole suite (no test may skip).
# `--fast` (first argument) leaves out the tests marked slow (real models, process races,
# long property runs): the daily check, a few minutes on two cores. CI runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tools install beside the Python packages (both mostly wait on downloads and the disk);
# either failing fails the command.
bash scripts/test_tools.sh &
tools=$!
setup_rc=0
bash scripts/setup.sh dev || setup_rc=$?
tools_rc=0
wait "$tools" || tools_rc=$?
if [ "$setup_rc" -ne 0 ] || [ "$tools_rc" -ne 0 ]; then
  echo "scripts/test.sh: setup failed (scripts/setup.sh: exit $setup_rc, scripts/test_tools.sh: exit $tools_rc)" >&2
  exit 1
fi
# Bytecode caches are written into .venv as modules are first imported, whatever the machine's
# environment says (PYTHONDONTWRITEBYTECODE=1 on ours): without them every test process, forked
# script and subprocess compiles torch's, transformers' and zarr's modules afresh at each import
# (measured: a docs test took 40% more CPU, and a whole `.ci/run` ~2 minutes more). The
# installer does not compile everything up front (75 CPU-s for 28,000 files; a run imports a
# tenth of them).
unset PYTHONDONTWRITEBYTECODE
export ACTSTORE_NO_SKIP=1
args=("$@")
if [ "${1:-}" = "--fast" ]; then
  args=(-m "not slow and not soak" "${@:2}")
fi
# Tests run in parallel processes (pytest-xdist): much of the suite waits on servers,
# subprocesses, retries over a flaky network and the disk, so 3 processes on 2 cores (at least
# 3, at most 8) cut the wall time (4 measured slower: 758 s against 718 s). `--dist loadgroup`:
# the tests of a module with a module-scoped fixture stay in one process (the fixture is made
# once), every other test goes to whichever process is free, longest first by the durations
# recorded in tests/durations.json (tests/conftest.py orders them; --no-loadscope-reorder keeps
# that order). ACTSTORE_TEST_WORKERS=N sets the number, 0 runs in this process (for a debugger).
# Every run prints its 25 slowest tests (pyproject.toml's addopts).
workers=${ACTSTORE_TEST_WORKERS:-$(python3 -c "import os; print(min(8, max(3, os.cpu_count() or 1)))")}
if [ "$workers" -gt 0 ]; then
  args=(-n "$workers" --dist loadgroup --no-loadscope-reorder "${args[@]}")
fi
set +e
.venv/bin/python -m pytest -q "${args[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
