#!/usr/bin/env bash
# The core store's tests on the newest zarr (3.2+ needs Python >= 3.12), beside the main
# suite on Python 3.11 / zarr 3.1. Uses pyenv's python3.12 when `python3.12` is not on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python /root/.pyenv/versions/3.12*/bin/python; do
  if [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY=$c; break; fi
done
if [ -z "$PY" ]; then
  echo "scripts/test_zarr_latest.sh: no Python 3.12 on this machine; cannot test zarr >= 3.2" >&2
  exit 1
fi
stamp=.venv312/.actstore-setup
want=$(cat pyproject.toml scripts/test_zarr_latest.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv312/bin/python ] || "$PY" -m venv .venv312
  .venv312/bin/python -m pip --disable-pip-version-check -q install "zarr>=3.2" -e . pytest pytest-xdist hypothesis \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi
.venv312/bin/python -c "import zarr, sys; print(f'zarr {zarr.__version__} on Python {sys.version.split()[0]}')"
ACTSTORE_NO_SKIP=1 .venv312/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist loadfile \
  tests/test_roundtrip.py tests/test_zarr_compat.py tests/test_processes.py tests/test_index.py tests/test_format_doc.py \
  tests/test_hostile_meta.py tests/test_hostile_files.py tests/test_per_sample_chunks.py tests/test_store_golden.py
