"""The kernels compile for a Hopper GPU, and full blocks use 16-byte vector loads and stores.

Tier: no device. Triton compiles to PTX and runs its bundled ptxas without a GPU, so the GPU code path is built
here even though it cannot run: a kernel that only works in the interpreter, or that stops vectorising (the
difference between ~4 TB/s and a fraction of it), fails this test. Runs in a subprocess because the test session
imports the kernels in interpreter mode.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

PROBE = r"""
import json, re, warnings
warnings.simplefilter("ignore")
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from ddp_triton.kernels import convert

COMMON = {"scale": "fp32", "stats": "*fp32", "BLOCK": "constexpr", "APPLY_SCALE": "constexpr",
          "SRC_BF16": "constexpr", "OUT_KIND": "constexpr", "STATS": "constexpr"}
CASES = {
    "contiguous fp32->bf16": (convert._contiguous_convert_kernel,
                              {"src": "*fp32", "dst": "*i16", "n_elements": "i64", **COMMON},
                              {"APPLY_SCALE": True, "SRC_BF16": False, "OUT_KIND": 0, "STATS": False}),
    "contiguous bf16->fp32 with stats": (convert._contiguous_convert_kernel,
                                         {"src": "*i16", "dst": "*i32", "n_elements": "i64", **COMMON},
                                         {"APPLY_SCALE": False, "SRC_BF16": True, "OUT_KIND": 2, "STATS": True}),
    "work list fp32->fp16": (convert._worklist_convert_kernel,
                             {"src_base": "*fp32", "dst_base": "*i16", "table": "*i64", **COMMON},
                             {"APPLY_SCALE": True, "SRC_BF16": False, "OUT_KIND": 1, "STATS": False}),
}
result = {}
for name, (fn, signature, constexprs) in CASES.items():
    signature = {k: signature[k] for k in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": 2048, **constexprs},
                       attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    result[name] = {"loads": sorted(set(re.findall(r"ld\.global\S*", ptx))),
                    "stores": sorted(set(re.findall(r"st\.global\S*", ptx)))}
print(json.dumps(result))
"""


def test_kernels_compile_for_sm90_with_vector_accesses():
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version < (3, 5):
        pytest.skip("the ASTSource/attrs form used here is Triton >= 3.5's")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for name, accesses in result.items():
        assert any(".v4." in op for op in accesses["loads"]), f"{name}: no 16-byte loads in {accesses['loads']}"
        assert any(".v4." in op for op in accesses["stores"]), f"{name}: no 16-byte stores in {accesses['stores']}"
