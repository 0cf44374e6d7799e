#!/usr/bin/env bash
# One pass of every GPU check, for a machine with one CUDA GPU (the lent H200 in particular): the GPU-tier tests,
# the kernel and DDP-step benchmarks (which append to bench/RESULTS.md), and the autotuner's measure mode at world
# size 1. Prints the benchmark tables last. Logs and JSON go to $OUT (or bench/out) so they come back.
#
#   bash bench/gpu_check.sh            # about 5 minutes on an H200
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

echo "== GPU tests"
python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log" | tail -15

echo "== autotune, measure mode, world size 1"
# its own cache folder, so that bench.ddp_step below (profile="auto") is not steered by this profile
XDG_CACHE_HOME="$out/cache" timeout 300 ddp-triton autotune --min-bytes 1K --max-bytes 64M --iters 5 --no-progress --out "$out/profile.json" \
  2>&1 | tee "$out/autotune.log" | tail -15

echo "== bench.kernels"
timeout 300 python3 -m bench.kernels --out-dir "$out" 2>&1 | tee "$out/kernels.log" | tail -40
echo "== bench.ddp_step"
timeout 300 python3 -m bench.ddp_step --out-dir "$out" 2>&1 | tee "$out/ddp_step.log" | tail -16
cp bench/RESULTS.md "$out/RESULTS.md"
