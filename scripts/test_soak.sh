#!/usr/bin/env bash
# The soak trials (pytest marker `soak`): each job over a flaky network 10 times, exact every
# time (tests/test_flaky_network.py). CI runs it after the test command; about 6 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
export ACTSTORE_NO_SKIP=1
.venv/bin/python -m pytest -q -m soak tests/test_flaky_network.py "$@"
