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

VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
COMMON = {"scale": "fp32", "stats": "*fp32"}
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


def source(fn, types, constexprs):
    # The first two pointers are 16-byte aligned, as the launcher reports for any fresh torch tensor. How a
    # compile request says so changed twice: Triton 3.0-3.1, 3.2, and 3.3 onwards.
    names = fn.arg_names
    if VERSION < (3, 2):
        from triton.compiler.compiler import AttrsDescriptor
        return ASTSource(fn=fn, signature={i: types[n] for i, n in enumerate(names) if n in types},
                         constants={i: constexprs[n] for i, n in enumerate(names) if n in constexprs},
                         attrs=AttrsDescriptor(divisible_by_16={0, 1}))
    signature = {n: types.get(n, "constexpr") for n in names}
    if VERSION < (3, 3):
        from triton.backends.compiler import AttrsDescriptor
        return ASTSource(fn=fn, signature=signature, constants=constexprs,
                         attrs=AttrsDescriptor.from_hints({0: 16, 1: 16}))
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                     attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})


result = {}
for name, (fn, types, constexprs) in CASES.items():
    src = source(fn, types, {"BLOCK": 2048, **constexprs})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    result[name] = {"loads": sorted(set(re.findall(r"ld\.global\S*", ptx))),
                    "stores": sorted(set(re.findall(r"st\.global\S*", ptx)))}
print(json.dumps(result))
"""


def test_kernels_compile_for_sm90_with_vector_accesses():
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for name, accesses in result.items():
        assert any(".v4." in op for op in accesses["loads"]), f"{name}: no 16-byte loads in {accesses['loads']}"
        assert any(".v4." in op for op in accesses["stores"]), f"{name}: no 16-byte stores in {accesses['stores']}"
