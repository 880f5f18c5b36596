#!/usr/bin/env bash
# The main job end to end: set up, write a store, finalize, describe it, read it back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${1:-out/demo-store}
rm -rf "$out"
.venv/bin/python examples/quickstart.py "$out"
.venv/bin/actstore info "$out"
