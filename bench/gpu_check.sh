#!/usr/bin/env bash
# One pass of every GPU check, for a machine with one CUDA GPU (the lent H200 in particular): the GPU-tier tests,
# the kernel and DDP-step benchmarks (which append to bench/RESULTS.md), and the autotuner's measure mode at world
# size 1. Each step has its own time limit and its exit status is kept; a summary table comes last, and the script
# fails if any step did.
#
#   bash bench/gpu_check.sh            # at most about 8.5 minutes (the sum of the limits below)
#
# What comes back from the lent machine is at most 8 files from $OUT, so the logs travel as one archive:
# $OUT/gpu_check.tgz (every log, JSON and the profile), $OUT/summary.txt, $OUT/RESULTS.md and the two benchmark JSONs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
work="$(mktemp -d)"
export PYTHONUNBUFFERED=1

summary=()
failed=0

# step NAME SECONDS LINES COMMAND...: run COMMAND under a time limit (killed 10 s after it, if need be), log to
# $work/NAME.log, print the log's last LINES lines, and record the exit status and wall time.
step() {
  local name=$1 limit=$2 lines=$3
  shift 3
  echo "== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  tail -n "$lines" "$work/$name.log"
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMED OUT"
    failed=1
  fi
  summary+=("$(printf '%-10s %-9s rc=%-3s %4d s' "$name" "$verdict" "$rc" $((SECONDS - start)))")
  return "$rc"
}

step install 120 5 python3 -m pip install -q --no-deps --no-build-isolation -e . || {
  cat "$work/install.log"
  exit 1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$work/gpu.txt"

per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120)
step gpu_tests 180 15 python3 -m pytest -q -m gpu "${per_test[@]}" tests

step kernels 200 40 python3 -m bench.kernels --out-dir "$work"
step ddp_step 100 16 python3 -m bench.ddp_step --out-dir "$work"

# Its own cache folder, so that nothing later is steered by this profile.
XDG_CACHE_HOME="$work/cache" step autotune 60 15 python3 -m ddp_triton.cli autotune --min-bytes 1K --max-bytes 64M \
  --iters 5 --no-progress --out "$work/profile.json"

{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(cat "$work/gpu.txt" 2>/dev/null)"
  printf '%s\n' "${summary[@]}"
} | tee "$work/summary.txt"
cp "$work/summary.txt" bench/RESULTS.md "$out/"
cp "$work"/kernels-*.json "$work"/ddp_step-*.json "$out/" 2>/dev/null
tar czf "$out/gpu_check.tgz" -C "$work" .
exit "$failed"
