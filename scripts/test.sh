#!/usr/bin/env bash
# The test command: sets everything up, then runs the whole suite (no test may skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export ACTSTORE_NO_SKIP=1
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
