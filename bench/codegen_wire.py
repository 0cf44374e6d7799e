"""What the wire-format kernels compile to for a GPU (sm_90), built here without one.

    python -m bench.codegen_wire            # a table
    python -m bench.codegen_wire --json

The launches the FP8 and float32-sum exchanges make (``ddp_triton.runtime.exchange``), with the arguments their
launchers pass, for a 25 MiB float32 bucket at 8 ranks: quantize (with error feedback), the rank-order reduce, the
dequantizing unpack (with stats), and the sum of bfloat16 slices. Per kernel: registers, spills, global access widths
and the count of fused multiply-adds, which must be zero where the launcher turns contraction off
(``enable_fp_fusion=False``): the residuals are only the same bits as the torch path's without them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # compiled mode before the kernels are imported (see bench.codegen)

import torch  # noqa: E402
import triton  # noqa: E402

from bench.codegen import compile_launch, parse_ptx, resource_usage, spill_bytes, _widths  # noqa: E402
from bench.common import format_table  # noqa: E402
from ddp_triton.kernels import blockscale, slices  # noqa: E402
from ddp_triton.kernels.blocks import block_layout  # noqa: E402
from ddp_triton.kernels.fp8 import BLOCK_ELEMENTS, E4M3, ROW_BYTES, ROW_WORDS  # noqa: E402
from ddp_triton.kernels.dtypes import OUT_KIND  # noqa: E402

MiB = 1 << 20
WORLD = 8
_FMA = re.compile(r"\bfma\.rn\.f32\b")
# The launches that must compile without contraction (their launchers pass enable_fp_fusion=False).
NO_FUSION = {"quantize fp32->e4m3 +ef", "reduce e4m3 x8 +ef", "dequantize e4m3->bf16 +stats",
             "sum blocks e4m3 x8 -> fp32"}


def launches() -> List[Tuple[str, Any, tuple, dict, int, dict]]:
    """(name, kernel, args, constexprs, num_warps, options) of each launch, on CPU tensors of the real sizes."""
    n = 25 * MiB // 4
    layout = block_layout([n], WORLD)
    rows = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
    shard = torch.empty(layout.rows_per_shard * ROW_BYTES, dtype=torch.uint8)
    bucket, residual = torch.empty(n), torch.empty(n)
    fmt = dict(MANTISSA=E4M3.mantissa_bits, BIAS=E4M3.bias)
    rows_constexprs = dict(BLOCK=BLOCK_ELEMENTS, ROW_BYTES_=ROW_BYTES, ROW_WORDS_=ROW_WORDS)
    no_fusion = dict(enable_fp_fusion=False)
    bf16 = torch.empty(n, dtype=torch.bfloat16)
    return [
        ("quantize fp32->e4m3 +ef", blockscale._quantize_blocks_kernel,
         (bucket, layout.table, residual, rows, rows.view(torch.int32), 1.0 / WORLD),
         dict(**rows_constexprs, APPLY_SCALE=True, SRC_BF16=False, RESIDUAL=True, MAX_EXPONENT_OF=E4M3.max_exponent,
              **fmt), blockscale._NUM_WARPS, no_fusion),
        ("reduce e4m3 x8 +ef", blockscale._reduce_blocks_kernel,
         (rows, rows.view(torch.int32), residual[: shard.numel() // ROW_BYTES * BLOCK_ELEMENTS], shard,
          shard.view(torch.int32), WORLD, shard.numel(), shard.numel() // 4),
         dict(**rows_constexprs, RESIDUAL=True, MAX_EXPONENT_OF=E4M3.max_exponent, **fmt), blockscale._NUM_WARPS,
         no_fusion),
        ("dequantize e4m3->bf16 +stats", blockscale._dequantize_blocks_kernel,
         (rows, rows.view(torch.int32), layout.table, bf16.view(torch.int16), torch.empty(layout.n_blocks, 2)),
         dict(**rows_constexprs, OUT_KIND=0, STATS=True, HW_CONVERT=True, **fmt), blockscale._NUM_WARPS, no_fusion),
        # FSDP's FP8 reduce-scatter keeps the float32 sum of the ranks' rows
        ("sum blocks e4m3 x8 -> fp32", blockscale._sum_blocks_kernel,
         (rows, rows.view(torch.int32), layout.table, bucket[: layout.rows_per_shard * BLOCK_ELEMENTS], WORLD,
          shard.numel(), shard.numel() // 4),
         dict(**rows_constexprs, **fmt), blockscale._NUM_WARPS, no_fusion),
        ("sum slices bf16 x8", slices._sum_slices_kernel,
         (bf16.view(torch.int16), bf16[: n // WORLD].view(torch.int16), WORLD, n // WORLD),
         dict(BLOCK=slices._BLOCK, SRC_BF16=True, OUT_KIND=0, HW_CONVERT=True), slices._NUM_WARPS, {}),
        # FSDP's reduce-scatter keeps the float32 sum itself
        ("sum slices bf16 x8 -> fp32", slices._sum_slices_kernel,
         (bf16.view(torch.int16), bucket[: n // WORLD].view(torch.int32), WORLD, n // WORLD),
         dict(BLOCK=slices._BLOCK, SRC_BF16=True, OUT_KIND=OUT_KIND[torch.float32], HW_CONVERT=True),
         slices._NUM_WARPS, {}),
    ]


def report(name: str, kernel: Any, args: tuple, constexprs: dict, num_warps: int, options: dict,
           arch: int = 90) -> Dict[str, Any]:
    compiled = compile_launch(kernel, args, constexprs, num_warps, arch, **options)
    ptx = compiled.asm["ptx"]
    listing = parse_ptx(ptx)
    everything = range(len(listing.instrs))
    return {"name": name, "kernel": kernel.__name__, "arch": arch, "triton": triton.__version__,
            "num_warps": num_warps, "fp_fusion": options.get("enable_fp_fusion", True),
            **resource_usage(compiled.asm["cubin"]), "spill_bytes": spill_bytes(ptx, arch),
            "load_widths": _widths(listing, everything, "load"), "store_widths": _widths(listing, everything, "store"),
            "fma": len(_FMA.findall(ptx))}


def reports(arch: int = 90) -> List[Dict[str, Any]]:
    return [report(*launch, arch=arch) for launch in launches()]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codegen_wire", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    rows = reports(options.arch)
    if options.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"Triton {triton.__version__}, compute capability {options.arch}")
    print(format_table(["kernel", "warps", "regs", "spill B", "stack B", "ld bits", "st bits", "fma"],
                       [[r["name"], r["num_warps"], r["registers"], r["spill_bytes"], r["stack_bytes"],
                         ",".join(map(str, r["load_widths"])), ",".join(map(str, r["store_widths"])), r["fma"]]
                        for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
