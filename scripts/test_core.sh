#!/usr/bin/env bash
# The core install's tests (`pip install actstore`: no torch, no transformers, none of the
# tools only tests use) on Python 3.12 with the newest zarr (3.2+ needs Python >= 3.12), beside
# the main suite's full dev install on Python 3.11 / zarr 3.1: the writer, reader, finalize,
# verify, statistics, exports and the CLI work without torch, and the store's format holds on
# the newest zarr. One venv, one run for both. Selected by marker, not by file: `-m core`, the
# tests that tests/conftest.py does not mark torch or dev (see the markers in pyproject.toml).
# The mutation tests run a tenth of their 2,200 mutations here (the main suite runs them all).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python /root/.pyenv/versions/3.12*/bin/python; do
  if [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY=$c; break; fi
done
if [ -z "$PY" ]; then
  echo "scripts/test_core.sh: no Python 3.12 on this machine; cannot test zarr >= 3.2" >&2
  exit 1
fi
venv=.venv-core
stamp=$venv/.actstore-setup
want=$(cat pyproject.toml scripts/test_core.sh scripts/install.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x $venv/bin/python ] || "$PY" -m venv $venv
  # shellcheck source=scripts/install.sh
  source scripts/install.sh  # as scripts/setup.sh installs (made beside the main suite)
  venv_install $venv -q "zarr>=3.2" -e . pytest pytest-xdist hypothesis ruff
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--setup-only" ]; then  # (.ci/run makes the venv while the main suite runs)
  exit 0
fi
if $venv/bin/python -c "import torch" 2>/dev/null; then
  echo "scripts/test_core.sh: torch is installed in $venv; remove the folder and rerun" >&2
  exit 1
fi
unset PYTHONDONTWRITEBYTECODE  # bytecode caches written as modules are imported (scripts/test.sh says why)
$venv/bin/python -c "import zarr, sys; print(f'core install: zarr {zarr.__version__} on Python {sys.version.split()[0]}, no torch')"
workers=${ACTSTORE_TEST_WORKERS:-$(python3 -c "import os; print(min(8, max(3, os.cpu_count() or 1)))")}
xdist=()
if [ "$workers" -gt 0 ]; then
  xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
ACTSTORE_NO_SKIP=1 ACTSTORE_MUTATION_SCALE=0.1 $venv/bin/python -m pytest -q -p no:cacheprovider "${xdist[@]}" -m core "$@"
