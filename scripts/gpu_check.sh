#!/usr/bin/env bash
# The capture's GPU checks and figures, one prepared command for a CUDA machine
# (docs/benchmarks.md, "Capture at the speed of the device"):
#
#   bash scripts/gpu_check.sh --fetch WHEELS     # here (with a package index): the wheels the GPU machine lacks
#   bash scripts/gpu_check.sh WHEELS [OUT]       # there: install them beside the checkout, check, measure
#   bash scripts/gpu_check.sh - [OUT]            # with the current environment (a CPU smoke run: QUICK=1)
#
# The GPU machine (/work/shared/notes/gpu-facts.md) has Python 3.12 and torch but not zarr,
# numcodecs, crc32c, obstore, donfig, google-crc32c, msgspec: they are installed from
# WHEELS with --no-index --no-deps into OUT/site. Then, each step writing its results as
# it goes (a run cut short keeps them): tests/cuda_check.py (the CUDA paths against the
# CPU's), and benchmarks/bench_gpu.py for the SmolLM2-135M and 1.7B shapes to tmpfs and
# to the local disk, and --replay. QUICK=1 shrinks every size for a smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS_PINNED=(zarr==3.4.2 numcodecs==0.17.1 crc32c==2.9.post0 obstore==0.12.1 donfig==0.8.1.post1
  google-crc32c==1.9.0 msgspec==0.22.0)

if [[ "${1:-}" == "--fetch" ]]; then
  dest="${2:?usage: gpu_check.sh --fetch WHEELS}"
  mkdir -p "$dest"
  python3 -m pip download --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dest" "${WHEELS_PINNED[@]}"
  ls -l "$dest"
  exit 0
fi

wheels="${1:?usage: gpu_check.sh WHEELS|- [OUT]}"
out="$(realpath -m "${2:-gpu-results}")"
mkdir -p "$out"
py=python3
pp="$PWD/src"
if [[ "$wheels" != "-" ]]; then
  "$py" -m pip install --quiet --no-index --no-deps --target "$out/site" "$wheels"/*.whl
  pp="$out/site:$pp"
fi
export PYTHONPATH="$pp:$PWD/tests" HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$out/machine.txt"
nproc | tee -a "$out/machine.txt"

if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$py" tests/cuda_check.py 2>&1 | tee "$out/cuda_check.log"
fi

disk="${DISK_DIR:-/tmp}"
quick=${QUICK:-0}
run() {  # bench_gpu.py ARGS: its results file kept per run
  (cd "$out" && "$py" "$OLDPWD/benchmarks/bench_gpu.py" "$@" 2>&1 | tee -a bench_gpu.log)
  mv "$out/bench-results/gpu.json" "$out/gpu-$(date +%s%N).json"
}
if [[ "$quick" == 1 ]]; then
  run --replay --batch-size 2 --seq-len 64 --batches 2 --repeats 1 --dir /dev/shm
  run --shape tiny --layers 0,1,2,-1 --batch-size 2 --seq-len 32 --batches 2 --repeats 1 --model-dtype float32 --stats on --dir /dev/shm
else
  run --shape 135m --batch-size 64 --seq-len 1024 --batches 8 --repeats 3 --stats on,off --dir /dev/shm --dir "$disk"
  run --shape 1.7b --batch-size 16 --seq-len 1024 --batches 8 --repeats 3 --stats on --dir /dev/shm --dir "$disk"
  run --replay --batch-size 16 --seq-len 1024 --batches 16 --repeats 3 --device cpu --dir /dev/shm
fi
echo "results in $out"
