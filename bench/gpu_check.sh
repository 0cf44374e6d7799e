#!/usr/bin/env bash
# One pass of every GPU check, for one call on a fresh machine with one CUDA GPU (the lent H200 in particular), most
# valuable first: the kernel benchmark (buckets of 1 to 400 MiB, GPT-2's gradient list, host cost per call, CUDA
# graph replay), the GPU-tier tests, the DDP-step benchmark, the autotuner's measure mode at world size 1. The
# benchmarks append to bench/RESULTS.md.
#
#   bash bench/gpu_check.sh            # at most 540 s, install included (TOTAL below)
#
# Each step runs under the time left (its own limit or less), its exit status is kept, and after every step the
# results so far are copied to $OUT, so a run cut short still brings back whatever finished. At most 8 files come
# back from the lent machine, so the logs travel as one archive: $OUT/gpu_check.tgz (every log, JSON and the
# profile), $OUT/summary.txt, $OUT/RESULTS.md and the two benchmark JSONs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out"
work="$(mktemp -d)"
export PYTHONUNBUFFERED=1
TOTAL=${GPU_CHECK_TOTAL:-540}
deadline=$((SECONDS + TOTAL))
KILL_GRACE=5

summary=()
failed=0

# publish: what has finished so far, to $OUT (overwritten after each step).
publish() {
  {
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(cat "$work/gpu.txt" 2>/dev/null)"
    printf '%s\n' "${summary[@]}"
  } >"$work/summary.txt"
  cp "$work/summary.txt" bench/RESULTS.md "$out/"
  cp "$work"/kernels-*.json "$work"/ddp_step-*.json "$work"/wire_kernels-*.json "$out/" 2>/dev/null
  tar czf "$out/gpu_check.tgz" -C "$work" .
}

# step NAME SECONDS LINES COMMAND...: run COMMAND under min(SECONDS, time left) (killed KILL_GRACE s after it), log
# to $work/NAME.log, print the log's last LINES lines, record the exit status and wall time, and publish.
step() {
  local name=$1 limit=$2 lines=$3
  shift 3
  local left=$((deadline - SECONDS - KILL_GRACE))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    summary+=("$(printf '%-10s %-9s' "$name" "SKIPPED (no time left)")")
    failed=1
    publish
    return 1
  fi
  echo "== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout -k "$KILL_GRACE" "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  tail -n "$lines" "$work/$name.log"
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMED OUT"
    failed=1
  fi
  summary+=("$(printf '%-10s %-9s rc=%-3s %4d s' "$name" "$verdict" "$rc" $((SECONDS - start)))")
  publish
  return "$rc"
}

step install 60 5 python3 -m pip install -q --no-deps --no-build-isolation -e . || {
  cat "$work/install.log"
  exit 1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$work/gpu.txt"

step kernels 210 90 python3 -m bench.kernels --sweep --out-dir "$work"

per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
step gpu_tests 130 20 python3 -m pytest -q -m gpu "${per_test[@]}" tests

step ddp_step 80 16 python3 -m bench.ddp_step --out-dir "$work"

# The wire formats (issue 12): their kernels against the copy ceiling, and a DDP step with each at world size 1
# (NCCL's all-to-all and all-gather over one rank: the kernels' cost in a step, not a network's).
step wire_kernels 40 12 python3 -m bench.wire_kernels --out-dir "$work"
step ddp_wire 60 12 python3 -m bench.ddp_step --out-dir "$work" --rounds 3 \
  --variants no_hook,triton_hook_bf16,triton_hook_bf16_fp32sum,triton_hook_fp8,triton_hook_fp8_no_ef

# Its own cache folder, so that nothing later is steered by this profile.
XDG_CACHE_HOME="$work/cache" step autotune 60 15 python3 -m ddp_triton.cli autotune --min-bytes 1K --max-bytes 64M \
  --iters 5 --no-progress --out "$work/profile.json"

cat "$work/summary.txt"
exit "$failed"
