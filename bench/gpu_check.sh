#!/usr/bin/env bash
# One pass of every GPU check, for one call on a fresh machine with one CUDA GPU (the lent H200 in particular), most
# valuable first: the kernel benchmark (buckets of 1 to 400 MiB, GPT-2's gradient list, host cost per call, CUDA
# graph replay), a profile of the DDP step without a hook and with triton_hook (per-bucket host times, the GPU's idle
# gaps in the backward, chrome traces), the GPU-tier tests, the hook at world size 2 and 4 with every rank on the one
# GPU over gloo (every format, flat and two-level, whole and in chunks: the CPU tensors' bits, and a killed peer
# named), the DDP-step benchmark of the MLP, the DDP step of a GPT-2-small-shaped transformer in bf16 autocast under
# each hook, the wire formats' kernels and DDP steps, the autotuner's measure mode at world size 1. The timed benchmarks
# append to bench/RESULTS.md (--append-results; the profile does not).
#
#   bash bench/gpu_check.sh            # at most 540 s, install included (TOTAL below)
#
# Each step runs under the time left (its own limit or less), its exit status is kept, and after every step the
# results so far are copied to $OUT, so a run cut short still brings back whatever finished. A limit is a ceiling
# for a step that usually ends well inside it; together they exceed TOTAL, and the steps a slow run loses to the
# deadline are the last, least valuable ones. At most 8 files come back from the lent machine, so the logs travel as
# one archive: $OUT/gpu_check.tgz (every log, JSON, chrome trace and the autotune profile), $OUT/summary.txt,
# $OUT/RESULTS.md and one JSON per benchmark (JSONS below; the wire-format step run writes into a folder of its own,
# so that its JSON travels in the archive only).
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
# The benchmark JSONs copied to $OUT as files of their own (<name>-<time>.json, one each): with summary.txt,
# RESULTS.md and the archive, 8 files.
JSONS=(kernels ddp_profile ddp_step_gpt2 ddp_step wire_kernels)

# publish: what has finished so far, to $OUT (overwritten after each step).
publish() {
  {
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(cat "$work/gpu.txt" 2>/dev/null)"
    printf '%s\n' "${summary[@]}"
  } >"$work/summary.txt"
  cp "$work/summary.txt" bench/RESULTS.md "$out/"
  local name
  for name in "${JSONS[@]}"; do
    cp "$work/$name"-*.json "$out/" 2>/dev/null
  done
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

step kernels 140 90 python3 -m bench.kernels --sweep --append-results --out-dir "$work"

# Where the hook's extra time in the MLP's step goes: 10 profiled steps per variant and bucket view, a table per
# bucket (host time in the hook, its pack, the collective's call, the unpack; the GPU's idle time meanwhile) and a
# chrome trace each (in the archive only).
step ddp_profile 75 60 python3 -m bench.ddp_step --profile --variants no_hook,triton_hook_bf16 --steps 10 --rounds 1 \
  --out-dir "$work"

per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
# tests/gpu/test_gpu_side_stream.py among them: one NCCL worker process, 20-40 s of the limit. Collection imports
# every tier, the integrations' frameworks too (Transformers, Accelerate, Lightning, as installed there): a module
# that fails to import is reported and fails the step, but the GPU tests still run.
step gpu_tests 140 20 python3 -m pytest -q -m gpu "${per_test[@]}" --continue-on-collection-errors \
  --ignore=tests/gpu/test_gpu_ranks.py tests
# Several ranks on the one GPU (gloo, CUDA tensors): 2 and 4 ranks flat, 2 nodes x 2 two-level, 30 tests from five
# sets of workers (about 25 s on the 2-core CPU machine with device="cpu"; here CUDA contexts and the first kernel
# compiles add to that: 60-100 s expected). A case gloo cannot carry on CUDA tensors in this build skips, saying why.
# Each set of workers stops itself after 90 s (a hang), so no per-test timeout.
step gpu_ranks 150 25 python3 -m pytest -q -rs tests/gpu/test_gpu_ranks.py

step ddp_step 60 16 python3 -m bench.ddp_step --append-results --out-dir "$work"
# A transformer's step (GPT-2 small's shape, batch 8 x 1024 tokens, bf16 autocast) under each hook: after the
# tests and the MLP's step, which more unmeasured claims wait on.
step ddp_gpt2 90 18 python3 -m bench.ddp_step --model gpt2 \
  --variants no_hook,allreduce_hook,bf16_compress_hook,triton_hook_bf16,triton_hook_fp32 --rounds 3 --steps 30 \
  --append-results --out-dir "$work"

# The wire formats: their kernels against the copy ceiling, and a DDP step with each at world size 1 (NCCL's
# all-to-all and all-gather over one rank: the kernels' cost in a step, not a network's).
step wire_kernels 40 12 python3 -m bench.wire_kernels --append-results --out-dir "$work"
step ddp_wire 45 12 python3 -m bench.ddp_step --append-results --out-dir "$work/wire" --rounds 3 \
  --variants no_hook,triton_hook_bf16,triton_hook_bf16_fp32sum,triton_hook_fp8,triton_hook_fp8_no_ef,triton_hook_fp4

# Its own cache folder, so that nothing later is steered by this profile.
XDG_CACHE_HOME="$work/cache" step autotune 40 15 python3 -m ddp_triton.cli autotune --min-bytes 1K --max-bytes 64M \
  --iters 5 --no-progress --out "$work/profile.json"

cat "$work/summary.txt"
exit "$failed"
