"""What the library's kernels compile to for a GPU, built here without one.

    python -m bench.codegen                 # a table for sm_90 (H100, H200): the conversion kernels
    python -m bench.codegen --arch 90 --json
    python -m bench.codegen --wire [--json] # the wire-format kernels (FP8 blocks, sums of slices)

Triton compiles to PTX and runs its bundled ptxas without a device, so the code a GPU would run can be inspected on
any Linux machine. Every variant is one launch the library really makes (``VARIANTS``): the contiguous kernel for a
25 MiB and a 100 MiB DDP bucket, the work-list kernel for GPT-2 small's 148 gradients, to bfloat16, float16 and
float32 and back, with and without stats. BLOCK, num_warps, the constexprs and the argument types come from the
library's own launch path (``worklist.build_plan`` on CPU tensors of the real sizes, then
``launch.kernel_arguments``), so this report follows the library when its heuristics change.

Columns, per variant:

- registers: per thread, of the cubin Triton built (``cuobjdump -res-usage``, which also gives ``stack_bytes``);
  spill bytes (stores + loads): what Triton's own ptxas says (``-v``) of the same PTX; shared memory: the bytes
  Triton launches the kernel with (its metadata).
- load and store widths: bits per thread of every global ``ld``/``st`` in the PTX (``ld.global.v4.b32`` = 128);
  "full block": those on the path a full, aligned block takes (below), as ``bits x count``; in the JSON,
  ``other_paths``: the widths off that path, where partial and misaligned blocks go.
- hw convert: whether narrowing uses the hardware's ``cvt.rn`` to bf16/f16 (always False for float32 outputs).
- instructions per element, PTX and SASS: instructions *executed* by one thread on the full-block path, divided by
  the elements each thread converts (BLOCK / (32 * num_warps)). The path is found in each listing's control-flow
  graph (a DAG here: no loops): of all paths from entry to exit, the one with the most global stores of the
  kernel's widest store width, and among those the shortest: a full block is stored in the widest accesses, and a
  thread that may leave early at a predicated exit does. SASS is disassembled from the cubin Triton built
  (``nvdisasm``); PTX counts are virtual instructions before ptxas optimises them. A listing with loops or indirect
  jumps gets no count (``None``).

Triton's binaries are found as Triton finds them: ptxas through Triton's backend (3.9 assembles sm_90 with its
newer "ptxas-blackwell"), nvdisasm and cuobjdump as ``TRITON_<NAME>_PATH``, then the wheel's
``triton/backends/nvidia/bin``, then ``PATH``. A missing tool leaves its columns empty.

``--wire``: the launches the FP8, E2M1 and float32-sum exchanges make (``ddp_triton.runtime.exchange``), with the
arguments their launchers pass, for a 25 MiB float32 bucket at 8 ranks: quantize (with error feedback), the
rank-order reduce, the dequantizing unpack (with stats), FSDP's sum of blocks (each in FP8 E4M3 and in E2M1), and
the sum of bfloat16 slices. Per
kernel: registers, spills, global access widths and the count of fused multiply-adds, which must be zero where the
launcher turns contraction off (``enable_fp_fusion=False``, ``WIRE_NO_FUSION``): the residuals are only the same
bits as the torch path's without them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # Triton decides when a kernel is decorated whether it is interpreted: compiled mode must be on before the
    # kernels are imported. Importers set it themselves (compile_launch refuses interpreted kernels).
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402

from bench.common import format_table, json_text  # noqa: E402
from bench.kernels import gpt2_small_shapes  # noqa: E402
from bench.listing import Listing, access_fields, full_block_path, parse_ptx, parse_sass, widths  # noqa: E402
from ddp_triton.kernels import INTERPRETER, blockscale, fp4, slices, triton_version  # noqa: E402
from ddp_triton.kernels.blocks import block_layout  # noqa: E402
from ddp_triton.kernels.dtypes import BITS_DTYPE, OUT_KIND  # noqa: E402
from ddp_triton.kernels.fp8 import BLOCK_ELEMENTS, E4M3, ROW_BYTES, ROW_WORDS  # noqa: E402
from ddp_triton.kernels.launch import kernel_arguments  # noqa: E402
from ddp_triton.kernels.worklist import build_plan  # noqa: E402
from ddp_triton.formats import average_factors  # noqa: E402

MiB = 1 << 20
WORLD = 8  # the world size behind the scales; only whether a scale is 1.0 changes the code
WARP = 32

# Triton's type names for pointer arguments, by the tensor's dtype.
_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int16: "*i16",
                  torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}

_HW_CONVERT = re.compile(r"\bcvt\.rn(?:\.satfinite)?\.(?:bf16|f16)(?:x2)?\.f32\b")
_FMA = re.compile(r"\bfma\.rn\.f32\b")


# ----------------------------------------------------------------------------------------------------------------
# The launches the library makes


@dataclass(frozen=True)
class Variant:
    """One launch: which layout, which direction, the wire dtype, and whether unpack also writes stats."""

    name: str
    layout: str  # "bucket25", "bucket100" (one flat bucket: the contiguous kernel) or "gpt2" (148 tensors)
    op: str  # "pack" (fp32 tensors -> flat comm buffer) or "unpack" (flat -> fp32 tensors)
    comm: torch.dtype  # the flat buffer's dtype
    stats: bool = False


VARIANTS: Tuple[Variant, ...] = (
    Variant("bucket 25M pack fp32->bf16", "bucket25", "pack", torch.bfloat16),
    Variant("bucket 25M unpack bf16->fp32", "bucket25", "unpack", torch.bfloat16),
    Variant("bucket 100M pack fp32->bf16", "bucket100", "pack", torch.bfloat16),
    Variant("bucket 100M unpack bf16->fp32", "bucket100", "unpack", torch.bfloat16),
    Variant("bucket 25M pack fp32->fp16", "bucket25", "pack", torch.float16),
    Variant("bucket 25M unpack fp16->fp32", "bucket25", "unpack", torch.float16),
    Variant("bucket 25M pack fp32->fp32", "bucket25", "pack", torch.float32),
    Variant("gpt2 pack fp32->bf16", "gpt2", "pack", torch.bfloat16),
    Variant("gpt2 unpack bf16->fp32", "gpt2", "unpack", torch.bfloat16),
    Variant("gpt2 unpack bf16->fp32 +stats", "gpt2", "unpack", torch.bfloat16, stats=True),
    Variant("gpt2 pack fp32->fp16", "gpt2", "pack", torch.float16),
    Variant("gpt2 unpack fp16->fp32 +stats", "gpt2", "unpack", torch.float16, stats=True),
    Variant("gpt2 pack fp32->fp32", "gpt2", "pack", torch.float32),
)


def _separate_tensors(numels: Sequence[int]) -> List[torch.Tensor]:
    """float32 CPU tensors of these sizes, none a memory neighbour of the next (as separately allocated gradients
    are), so each is its own segment of the work list. Views of one buffer with a 64-byte gap after each: memory
    untouched, layout deterministic."""
    gap = 16
    buffer = torch.empty(sum(numels) + gap * len(numels))
    tensors, position = [], 0
    for n in numels:
        tensors.append(buffer[position:position + n])
        position += n + gap
    return tensors


def _layout_tensors(layout: str) -> List[torch.Tensor]:
    if layout == "gpt2":
        return _separate_tensors([int(torch.Size(s).numel()) for s in gpt2_small_shapes()])
    mib = {"bucket25": 25, "bucket100": 100}[layout]
    return [torch.empty(mib * MiB // 4)]


def launch_of(variant: Variant) -> Tuple[Any, tuple, dict, int]:
    """(kernel, args, constexprs, num_warps) of the variant as pack.py builds them, on CPU tensors of the real
    sizes (allocated, never touched)."""
    tensors = _layout_tensors(variant.layout)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=variant.comm)
    pre, post = average_factors(WORLD, variant.comm)
    device = torch.device("cpu")
    if variant.op == "pack":
        plan = build_plan(tensors, flat, True, device)
        dst = flat.view(BITS_DTYPE[flat.dtype])
        kernel, args, constexprs = kernel_arguments(plan, tensors[plan.base_index], dst, pre, OUT_KIND[flat.dtype],
                                                    None)
    else:
        plan = build_plan(tensors, flat, False, device)
        base = tensors[plan.base_index]
        stats = torch.empty((plan.n_items, 2)) if variant.stats else None
        kernel, args, constexprs = kernel_arguments(plan, flat, base.view(BITS_DTYPE[base.dtype]), post,
                                                    OUT_KIND[base.dtype], stats)
    return kernel, args, constexprs, plan.num_warps


# ----------------------------------------------------------------------------------------------------------------
# The compile request


def argument_types(args: Sequence[Any]) -> List[str]:
    """Triton's signature types of launch arguments: tensors by dtype, ints as i32 when they fit, floats as fp32."""
    types = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            types.append(_POINTER_TYPES[arg.dtype])
        elif isinstance(arg, bool):
            types.append("i1")
        elif isinstance(arg, int):
            types.append("i32" if -(2 ** 31) <= arg < 2 ** 31 else "i64")
        elif isinstance(arg, float):
            types.append("fp32")
        else:
            raise TypeError(f"no Triton type for {type(arg).__name__}")
    return types


def divisible_by_16(args: Sequence[Any]) -> List[int]:
    """Indices of arguments Triton's launcher reports as multiples of 16: tensors at 16-byte-aligned addresses
    (every fresh torch allocation) and ints divisible by 16. (A size of exactly 1, which the launcher turns into a
    constant, does not occur here.)"""
    indices = []
    for i, arg in enumerate(args):
        value = arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
        if isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0:
            indices.append(i)
    return indices


def source(fn: Any, types: Dict[str, str], constexprs: Dict[str, Any], aligned: Sequence[int]) -> Any:
    """Triton's compile request for ``fn``: argument types by name, constexpr values, and which arguments (by
    position) are multiples of 16. How a request says so changed twice: Triton 3.0-3.1, 3.2, and 3.3 onwards."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    version = triton_version()
    if version < (3, 2):
        from triton.compiler.compiler import AttrsDescriptor

        return ASTSource(fn=fn, signature={i: types[n] for i, n in enumerate(names) if n in types},
                         constants={i: constexprs[n] for i, n in enumerate(names) if n in constexprs},
                         attrs=AttrsDescriptor(divisible_by_16=set(aligned)))
    signature = {n: types.get(n, "constexpr") for n in names}
    if version < (3, 3):
        from triton.backends.compiler import AttrsDescriptor

        return ASTSource(fn=fn, signature=signature, constants=constexprs,
                         attrs=AttrsDescriptor.from_hints({i: 16 for i in aligned}))
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                     attrs={(i,): [["tt.divisibility", 16]] for i in aligned})


def compile_launch(kernel: Any, args: tuple, constexprs: dict, num_warps: int, arch: int,
                   **options: Any) -> Any:
    """The compiled kernel Triton's launcher would build for these arguments on a GPU of compute capability
    ``arch`` (90: sm_90a). Needs the kernels imported in compiled mode (TRITON_INTERPRET=0)."""
    if INTERPRETER:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: run this in a fresh process with "
                           "TRITON_INTERPRET=0 (python -m bench.codegen does)")
    from triton.backends.compiler import GPUTarget

    names = kernel.arg_names
    types = dict(zip(names, argument_types(args)))
    src = source(kernel, types, constexprs, divisible_by_16(args))
    return triton.compile(src, target=GPUTarget("cuda", arch, WARP), options={"num_warps": num_warps, **options})


# ----------------------------------------------------------------------------------------------------------------
# Triton's CUDA tools


def tool(name: str) -> Optional[str]:
    """Path of one of the CUDA binaries Triton bundles (nvdisasm, cuobjdump), found as Triton finds them, or None."""
    override = os.environ.get(f"TRITON_{name.upper().replace('-', '_')}_PATH")
    if override and os.access(override, os.X_OK):
        return override
    bundled = Path(triton.__file__).resolve().parent / "backends" / "nvidia" / "bin" / name
    if os.access(bundled, os.X_OK):
        return str(bundled)
    return shutil.which(name)


def triton_ptxas(arch: int) -> Optional[str]:
    """The ptxas Triton itself runs for ``arch``: Triton 3.9 assembles sm_90 with its newer "ptxas-blackwell",
    3.6 only sm_100 on, 3.0 has one. Asked of Triton's backend (private, so any failure falls back to the plain
    bundled ptxas)."""
    try:
        from triton.backends.nvidia import compiler

        if hasattr(compiler, "get_ptxas"):
            found = compiler.get_ptxas(arch)
            return getattr(found, "path", found)
        return compiler._path_to_binary("ptxas")[0]
    except Exception:  # another version's private API: the bundled one is the next best guess
        return tool("ptxas")


def _version_line(path: Optional[str]) -> str:
    """``ptxas 12.8.55``: a CUDA tool's name and release, from its ``--version``."""
    if path is None:
        return "no ptxas"
    run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    release = re.search(r"release [\d.]+, V([\d.]+)", run.stdout)
    return f"{Path(path).name} {release.group(1) if release else '?'}"


def _run_on_file(argv: List[str], content: Union[str, bytes], name: str) -> str:
    """Run a tool on ``content``, written to a file called ``name`` that ``argv`` names as "{}", in a scratch
    directory; its stdout and stderr, or "" when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        argv = [str(path) if a == "{}" else a for a in argv]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp)
    return run.stdout + run.stderr if run.returncode == 0 else ""


def spill_bytes(ptx: str, arch: int) -> Optional[int]:
    """Bytes spilled (stores + loads) that Triton's ptxas reports (``-v``) for the PTX's own target, with ptxas's
    default options: Triton may add others (3.9: ``--regAllocOptLevel=2``), so the cubin's stack frame
    (:func:`resource_usage`) is the other witness of no spills."""
    ptxas = triton_ptxas(arch)
    target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    if ptxas is None or target is None:
        return None
    log = _run_on_file([ptxas, "-v", f"--gpu-name={target.group(1)}", "{}", "-o", "kernel.cubin"], ptx, "kernel.ptx")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(spills.group(1)) + int(spills.group(2)) if spills else None


def resource_usage(cubin: bytes) -> Dict[str, Optional[int]]:
    """Registers per thread and stack frame bytes of the cubin Triton built (``cuobjdump -res-usage``)."""
    cuobjdump = tool("cuobjdump")
    log = _run_on_file([cuobjdump, "-res-usage", "{}"], cubin, "kernel.cubin") if cuobjdump else ""
    registers, stack = re.search(r"REG:(\d+)", log), re.search(r"STACK:(\d+)", log)
    return {"registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None}


def disassemble(cubin: bytes) -> Optional[str]:
    """The cubin's SASS as ``nvdisasm -c`` prints it, or None without nvdisasm."""
    nvdisasm = tool("nvdisasm")
    return (_run_on_file([nvdisasm, "-c", "{}"], cubin, "kernel.cubin") or None) if nvdisasm else None


# ----------------------------------------------------------------------------------------------------------------
# Reports


def _per_element(listing: Optional[Listing], elements_per_thread: float) -> Optional[float]:
    path = full_block_path(listing) if listing is not None else None
    return round(len(path) / elements_per_thread, 2) if path else None


def report(variant: Variant, arch: int = 90) -> Dict[str, Any]:
    """Compile one variant for ``arch`` and describe its code (see the module docstring for each field)."""
    kernel, args, constexprs, num_warps = launch_of(variant)
    compiled = compile_launch(kernel, args, constexprs, num_warps, arch)
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    sass = disassemble(cubin)
    elements_per_thread = constexprs["BLOCK"] / (WARP * num_warps)
    ptx_per_element = _per_element(parse_ptx(ptx), elements_per_thread)
    sass_per_element = _per_element(parse_sass(sass) if sass else None, elements_per_thread)
    return {
        "name": variant.name,
        "kernel": kernel.__name__,
        "arch": arch,
        "triton": triton.__version__,
        "block": constexprs["BLOCK"],
        "num_warps": num_warps,
        "elements_per_thread": elements_per_thread,
        "constexprs": constexprs,
        "signature": argument_types(args),
        "src_bits": args[0].element_size() * 8,
        "dst_bits": args[1].element_size() * 8,
        **resource_usage(cubin),
        "spill_bytes": spill_bytes(ptx, arch),
        "shared_bytes": compiled.metadata.shared,
        **access_fields(ptx),
        "hw_convert": bool(_HW_CONVERT.search(ptx)),
        "ptx_per_element": ptx_per_element,
        "sass_per_element": sass_per_element,
        "instr_per_element": sass_per_element if sass_per_element is not None else ptx_per_element,
    }


def reports(arch: int = 90, variants: Sequence[Variant] = VARIANTS) -> List[Dict[str, Any]]:
    """One report per variant, compiled for ``arch``."""
    return [report(v, arch) for v in variants]


def _accesses(counts: Dict[str, int]) -> str:
    return " ".join(f"{bits}x{n}" for bits, n in counts.items()) or "-"


def format_reports(rows: Sequence[Dict[str, Any]]) -> str:
    """The reports as a markdown table."""
    headers = ["variant", "BLOCK", "warps", "regs", "spill B", "smem B", "ld bits", "st bits", "full-block ld",
               "full-block st", "hw cvt", "PTX/elem", "SASS/elem"]
    body = [[r["name"], r["block"], r["num_warps"], r["registers"], r["spill_bytes"], r["shared_bytes"],
             ",".join(map(str, r["load_widths"])), ",".join(map(str, r["store_widths"])),
             _accesses(r["full_block"]["loads"]), _accesses(r["full_block"]["stores"]),
             "yes" if r["hw_convert"] else "no", r["ptx_per_element"], r["sass_per_element"]] for r in rows]
    return format_table(headers, body)


# ----------------------------------------------------------------------------------------------------------------
# The wire-format kernels


#: The wire-format launches that must compile without contraction (their launchers pass enable_fp_fusion=False).
WIRE_NO_FUSION = {"quantize fp32->e4m3 +ef", "reduce e4m3 x8 +ef", "dequantize e4m3->bf16 +stats",
                  "sum blocks e4m3 x8 -> fp32", "quantize fp32->e2m1 +ef", "reduce e2m1 x8 +ef",
                  "dequantize e2m1->bf16 +stats", "sum blocks e2m1 x8 -> fp32", "quantize fp32->e4m3 +ef bf16",
                  "reduce e4m3 x8 +ef bf16", "quantize fp32->e2m1 +ef bf16", "reduce e2m1 x8 +ef bf16"}


def wire_launches() -> List[Tuple[str, Any, tuple, dict, int, dict]]:
    """(name, kernel, args, constexprs, num_warps, options) of each launch, on CPU tensors of the real sizes."""
    n = 25 * MiB // 4
    layout = block_layout([n], WORLD)
    rows = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
    shard = torch.empty(layout.rows_per_shard * ROW_BYTES, dtype=torch.uint8)
    bucket, residual = torch.empty(n), torch.empty(n)
    residual16 = torch.empty(n, dtype=torch.int16)  # a bfloat16 residual, as the launchers pass it: its bits
    fmt = dict(MANTISSA=E4M3.mantissa_bits, BIAS=E4M3.bias)
    rows_constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS)
    no_fusion = dict(enable_fp_fusion=False)
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    words4 = torch.empty(layout.n_rows * fp4.ROW_WORDS, dtype=torch.int32)  # E2M1 rows, as the launcher views them
    shard4 = words4[: layout.rows_per_shard * fp4.ROW_WORDS]
    fp4_constexprs = dict(BLOCK=BLOCK_ELEMENTS, GROUP=fp4.GROUP_ELEMENTS, ROW_WORDS_=fp4.ROW_WORDS)
    residuals = [("", residual, False), (" bf16", residual16, True)]  # error feedback kept in float32, in bfloat16
    return [
        *[(f"quantize fp32->e4m3 +ef{suffix}", blockscale._quantize_blocks_kernel,
           (bucket, layout.table, carried, rows, rows.view(torch.int32), 1.0 / WORLD),
           dict(**rows_constexprs, APPLY_SCALE=True, SRC_BF16=False, RESIDUAL=True, RESIDUAL_BF16=bf16_residual,
                MAX_EXPONENT_OF=E4M3.max_exponent, **fmt), blockscale._NUM_WARPS, no_fusion)
          for suffix, carried, bf16_residual in residuals],
        *[(f"reduce e4m3 x8 +ef{suffix}", blockscale._reduce_blocks_kernel,
           (rows, rows.view(torch.int32), carried[: shard.numel() // ROW_BYTES * BLOCK_ELEMENTS], shard,
            shard.view(torch.int32), WORLD, shard.numel(), shard.numel() // 4),
           dict(**rows_constexprs, RESIDUAL=True, RESIDUAL_BF16=bf16_residual, MAX_EXPONENT_OF=E4M3.max_exponent,
                **fmt), blockscale._NUM_WARPS, no_fusion)
          for suffix, carried, bf16_residual in residuals],
        ("dequantize e4m3->bf16 +stats", blockscale._dequantize_blocks_kernel,
         (rows, rows.view(torch.int32), layout.table, bf16.view(torch.int16), torch.empty(layout.n_blocks, 2)),
         dict(**rows_constexprs, OUT_KIND=0, STATS=True, HW_CONVERT=True, **fmt), blockscale._NUM_WARPS, no_fusion),
        # FSDP's FP8 reduce-scatter keeps the float32 sum of the ranks' rows
        ("sum blocks e4m3 x8 -> fp32", blockscale._sum_blocks_kernel,
         (rows, rows.view(torch.int32), layout.table, bucket[: layout.rows_per_shard * BLOCK_ELEMENTS], WORLD,
          shard.numel(), shard.numel() // 4),
         dict(**rows_constexprs, **fmt), blockscale._NUM_WARPS, no_fusion),
        # The same four passes in block-scaled E2M1 (kernels/fp4.py)
        *[(f"quantize fp32->e2m1 +ef{suffix}", fp4._quantize_blocks_kernel,
           (bucket, layout.table, carried, words4, 1.0 / WORLD),
           dict(**fp4_constexprs, APPLY_SCALE=True, SRC_BF16=False, RESIDUAL=True, RESIDUAL_BF16=bf16_residual),
           blockscale._NUM_WARPS, no_fusion)
          for suffix, carried, bf16_residual in residuals],
        *[(f"reduce e2m1 x8 +ef{suffix}", fp4._reduce_blocks_kernel,
           (words4, carried[: layout.rows_per_shard * BLOCK_ELEMENTS], shard4, WORLD, shard4.numel()),
           dict(**fp4_constexprs, RESIDUAL=True, RESIDUAL_BF16=bf16_residual), blockscale._NUM_WARPS, no_fusion)
          for suffix, carried, bf16_residual in residuals],
        ("dequantize e2m1->bf16 +stats", fp4._dequantize_blocks_kernel,
         (words4, layout.table, bf16.view(torch.int16), torch.empty(layout.n_blocks, 2)),
         dict(**fp4_constexprs, OUT_KIND=0, STATS=True, HW_CONVERT=True), blockscale._NUM_WARPS, no_fusion),
        ("sum blocks e2m1 x8 -> fp32", fp4._sum_blocks_kernel,
         (words4, layout.table, bucket[: layout.rows_per_shard * BLOCK_ELEMENTS], WORLD, shard4.numel()),
         dict(**fp4_constexprs), blockscale._NUM_WARPS, no_fusion),
        ("sum slices bf16 x8", slices._sum_slices_kernel,
         (bf16.view(torch.int16), bf16[: n // WORLD].view(torch.int16), WORLD, n // WORLD),
         dict(BLOCK=slices._BLOCK, SRC_BF16=True, OUT_KIND=0, HW_CONVERT=True), slices._NUM_WARPS, {}),
        # FSDP's reduce-scatter keeps the float32 sum itself
        ("sum slices bf16 x8 -> fp32", slices._sum_slices_kernel,
         (bf16.view(torch.int16), bucket[: n // WORLD].view(torch.int32), WORLD, n // WORLD),
         dict(BLOCK=slices._BLOCK, SRC_BF16=True, OUT_KIND=OUT_KIND[torch.float32], HW_CONVERT=True),
         slices._NUM_WARPS, {}),
    ]


def wire_report(name: str, kernel: Any, args: tuple, constexprs: dict, num_warps: int, options: dict,
                arch: int = 90) -> Dict[str, Any]:
    """Compile one wire-format launch for ``arch``: registers, spills, access widths, fused multiply-adds."""
    compiled = compile_launch(kernel, args, constexprs, num_warps, arch, **options)
    ptx = compiled.asm["ptx"]
    listing = parse_ptx(ptx)
    everything = range(len(listing.instrs))
    return {"name": name, "kernel": kernel.__name__, "arch": arch, "triton": triton.__version__,
            "num_warps": num_warps, "fp_fusion": options.get("enable_fp_fusion", True),
            **resource_usage(compiled.asm["cubin"]), "spill_bytes": spill_bytes(ptx, arch),
            "load_widths": widths(listing, everything, "load"), "store_widths": widths(listing, everything, "store"),
            "fma": len(_FMA.findall(ptx))}


def wire_reports(arch: int = 90) -> List[Dict[str, Any]]:
    """One report per wire-format launch, compiled for ``arch``."""
    return [wire_report(*launch, arch=arch) for launch in wire_launches()]


def format_wire_reports(rows: Sequence[Dict[str, Any]]) -> str:
    """The wire-format reports as a markdown table."""
    return format_table(["kernel", "warps", "regs", "spill B", "stack B", "ld bits", "st bits", "fma"],
                        [[r["name"], r["num_warps"], r["registers"], r["spill_bytes"], r["stack_bytes"],
                          ",".join(map(str, r["load_widths"])), ",".join(map(str, r["store_widths"])), r["fma"]]
                         for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the reports as a JSON list instead of a table")
    parser.add_argument("--wire", action="store_true",
                        help="the wire-format kernels (FP8 blocks, sums of slices) instead of the conversion kernels")
    options = parser.parse_args(argv)
    rows = wire_reports(options.arch) if options.wire else reports(options.arch)
    if options.json:
        print(json_text(rows), end="")
        return 0
    ptxas = _version_line(triton_ptxas(options.arch))
    print(f"Triton {triton.__version__}, compute capability {options.arch}, {ptxas}"
          + ("" if options.wire else "; per element: instructions one thread executes on the full-block path / "
             "elements per thread"))
    print(format_wire_reports(rows) if options.wire else format_reports(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
