#!/usr/bin/env bash
# The soak trials (pytest marker `soak`): each job over a flaky network 3 to 10 times (until
# each kind of fault fired 3 times in it), exact every time (tests/test_flaky_network.py), and
# 96 SIGKILLs of durable writers at random moments, no torn or mixed block after any
# (tests/test_kill_soak.py). CI (.ci/run) runs them inside the test command's
# session (`bash scripts/test.sh -m "soak or not soak"`); this runs them alone, about 3 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
export ACTSTORE_NO_SKIP=1
workers=${ACTSTORE_TEST_WORKERS:-$(python3 -c "import os; print(min(6, max(3, os.cpu_count() or 1)))")}
xdist=()
if [ "$workers" -gt 0 ]; then
  xdist=(-n "$workers" --dist load)  # the six jobs' trials side by side, each process its own S3 server
fi
.venv/bin/python -m pytest -q "${xdist[@]}" -m soak tests/test_flaky_network.py tests/test_kill_soak.py "$@"
