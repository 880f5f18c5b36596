#!/usr/bin/env bash
# The test command: sets everything up (the dev install, then chromium and Azurite, which
# only tests use), then runs the whole suite (no test may skip).
# `--fast` (first argument) leaves out the tests marked slow (real models, process races,
# long property runs): the daily check, a few minutes on two cores. CI runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
bash scripts/test_tools.sh
export ACTSTORE_NO_SKIP=1
args=("$@")
if [ "${1:-}" = "--fast" ]; then
  args=(-m "not slow" "${@:2}")
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
