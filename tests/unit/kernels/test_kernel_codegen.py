"""What the conversion kernels compile to for a Hopper GPU (sm_90), checked without one.

Tier: no device. Triton compiles to PTX and runs its bundled ptxas without a GPU, so the code a GPU would run is
built here even though it cannot run. ``python -m bench.codegen --json`` compiles every launch the library makes
(buckets through the contiguous kernel, GPT-2's 148 gradients through the work-list kernel, pack and unpack, with
and without stats) and describes each; it runs in a subprocess because this session imports the kernels in
interpreter mode. Checked, on every Triton version CI installs:

- a full, aligned block moves every element in 16-byte accesses (the difference between ~4 TB/s and a fraction);
- in the work-list kernel, every other path (partial blocks, and full blocks at offsets that are not multiples of
  16 elements) accesses global memory no wider than one element: offsets there are arbitrary, so a wider access
  faults on a GPU. (Once, a ``multiple_of`` hint on offsets loaded from the work table vectorised that path too;
  the earlier check here only asked for a 16-byte access anywhere and passed.)
- narrowing to bfloat16/float16 is the hardware's ``cvt.rn``;
- no variant spills, and each stays within 32 registers per thread unless listed, with its reason, below.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

# 32 registers per thread is what full occupancy allows on sm_90 (64K registers for 2048 threads per SM). Variants
# above it, with the most each Triton version compiled them to (python -m bench.codegen; "default": 3.6 and 3.9)
# and why. Each entry costs occupancy: a new one, or a higher number, is a decision to make, not a number to bump.
REGISTER_EXCEPTIONS = {
    # BLOCK 4096 over 128 threads: all eight 16-byte loads (32 float32 values) are in flight before the first store,
    # and nothing narrows the values to share registers (to bfloat16 the same launch takes 31).
    "bucket 25M pack fp32->fp32": {"3.0": 44, "default": 50},
    # The stats (sum of squares and non-finite count, reduced over the block) cost 16-18 registers over the same
    # unpack without them (30-32). Triton 3.8 (torch 2.14's) allocates 55 and 54 for the same code, without spills:
    # 9 blocks of 128 threads per SM instead of 10, still above Triton 3.0's 8.
    "gpt2 unpack bf16->fp32 +stats": {"3.0": 64, "3.8": 56, "default": 48},
    "gpt2 unpack fp16->fp32 +stats": {"3.0": 64, "3.8": 56, "default": 48},
    # Triton 3.0 only: the same kernel takes 31 from Triton 3.6 on.
    "bucket 25M pack fp32->bf16": {"3.0": 40},
    "bucket 25M pack fp32->fp16": {"3.0": 34},
}
REGISTERS_FOR_FULL_OCCUPANCY = 32


@pytest.fixture(scope="module")
def reports():
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-m", "bench.codegen", "--json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def _work_list(reports):
    return [r for r in reports if r["kernel"] == "_worklist_convert_kernel"]


def test_every_launch_is_compiled_and_analysed(reports):
    kernels = {r["kernel"] for r in reports}
    assert kernels == {"_contiguous_convert_kernel", "_worklist_convert_kernel"}, kernels
    for r in reports:  # without a full-block path the checks below would look at nothing
        assert r["full_block"]["stores"] and r["ptx_per_element"], f"{r['name']}: no full-block path found"


def test_full_blocks_move_every_element_in_16_byte_accesses(reports):
    failures = []
    for r in reports:
        per_thread = r["elements_per_thread"]
        loads, stores = r["full_block"]["loads"].get("128", 0), r["full_block"]["stores"].get("128", 0)
        if loads * 128 != per_thread * r["src_bits"] or stores * 128 != per_thread * r["dst_bits"]:
            failures.append(f"{r['name']}: full block loads {r['full_block']['loads']}, stores "
                            f"{r['full_block']['stores']} (bits x count) for {per_thread:g} elements per thread")
    assert not failures, "\n".join(failures)


def test_misaligned_and_partial_blocks_access_one_element_at_a_time(reports):
    failures = []
    for r in _work_list(reports):
        other = r["other_paths"]
        if not other["load_widths"] or not other["store_widths"]:
            failures.append(f"{r['name']}: no separate masked path found: {other}")
        elif max(other["load_widths"]) > r["src_bits"] or max(other["store_widths"]) > r["dst_bits"]:
            failures.append(f"{r['name']}: off the aligned full-block path, loads of {other['load_widths']} bits "
                            f"(elements: {r['src_bits']}) and stores of {other['store_widths']} bits "
                            f"(elements: {r['dst_bits']})")
    assert not failures, "\n".join(failures)


def test_narrowing_uses_the_hardware_conversion(reports):
    narrowing = [r for r in reports if r["dst_bits"] == 16]
    assert narrowing
    missing = [r["name"] for r in narrowing if not r["hw_convert"]]
    assert not missing, f"no cvt.rn.bf16/cvt.rn.f16 in {missing}"


def _register_ceiling(name: str, triton_version: str) -> int:
    ceilings = REGISTER_EXCEPTIONS.get(name, {})
    minor = ".".join(triton_version.split(".")[:2])
    return ceilings.get(minor, ceilings.get("default", REGISTERS_FOR_FULL_OCCUPANCY))


def test_no_spills_and_registers_within_bounds(reports):
    failures = []
    for r in reports:
        ceiling = _register_ceiling(r["name"], r["triton"])
        if r["registers"] is None or r["registers"] > ceiling:
            failures.append(f"{r['name']}: {r['registers']} registers (at most {ceiling})")
        if r["spill_bytes"] != 0 or r["stack_bytes"] != 0:
            failures.append(f"{r['name']}: {r['spill_bytes']} bytes spilled, {r['stack_bytes']} bytes of stack")
    assert not failures, "\n".join(failures)


# ---- the wire-format kernels (FP8 blocks, float32 sum of slices) ---------------------------------------------------

# One warp per 128-element block holds a block's values, the residual and the dequantized copy at once; 40 leaves
# headroom over what Triton 3.0-3.9 compiled them to (30-39, python -m bench.codegen --wire). With one warp per CTA
# the CTA limit per SM (32 on sm_90), not registers, bounds their occupancy (RESULTS.md says what is unmeasured).
WIRE_REGISTER_CEILING = 40
# E2M1's quantize and reduce pack the 4-bit codes eight to a word: LLVM narrows the codes to 4-bit integers and moves
# a vector of them through 2 bytes of local memory (ptxas reports 8 bytes of stack; no spill). Triton 3.8, sm_90.
# With the residual in bfloat16 the quantize keeps them (8 bytes), the reduce does not (0).
WIRE_STACK_CEILING = {"quantize fp32->e2m1 +ef": 8, "reduce e2m1 x8 +ef": 8, "quantize fp32->e2m1 +ef bf16": 8}


@pytest.fixture(scope="module")
def wire_reports():
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-m", "bench.codegen", "--wire", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_wire_kernels_compile_without_spills_or_contraction(wire_reports):
    from bench.codegen import WIRE_NO_FUSION

    assert {r["name"] for r in wire_reports} >= WIRE_NO_FUSION | {"sum slices bf16 x8", "sum slices bf16 x8 -> fp32",
                                                              "sum blocks e4m3 x8 -> fp32"} | set(WIRE_STACK_CEILING)
    for r in wire_reports:  # None: ptxas gave no report, which is a failure here, not a pass
        assert r["spill_bytes"] == 0 and r["stack_bytes"] is not None, r
        assert r["stack_bytes"] <= WIRE_STACK_CEILING.get(r["name"], 0), r
        assert r["registers"] is not None and r["registers"] <= WIRE_REGISTER_CEILING, r
        if r["name"] in WIRE_NO_FUSION:
            # A fused multiply-add rounds once where the torch path rounds twice: the residuals would differ.
            assert not r["fp_fusion"] and r["fma"] == 0, r


def test_fp8_codes_are_stored_four_to_a_thread_not_byte_by_byte(wire_reports):
    checked = [r for r in wire_reports if r["name"].startswith(("quantize", "reduce"))]
    assert checked
    for r in checked:
        assert r["store_widths"], f"{r['name']}: no global store found in its PTX"
        assert 8 not in r["store_widths"], f"{r['name']} stores single bytes: {r['store_widths']}"


def test_the_contraction_check_can_fail():
    """The same quantize launch compiled with contraction on does fuse: the fma count above measures something."""
    code = ("import bench.codegen as g; name, k, a, c, nw, _ = g.wire_launches()[0]; "
            "print(g.wire_report(name, k, a, c, nw, {})['fma'])")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) > 0
