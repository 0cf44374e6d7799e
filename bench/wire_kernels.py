"""Throughput of the wire-format kernels: on the GPU against the copy ceiling, on CPU against the bf16 pack.

    python -m bench.wire_kernels [--mb 25] [--ranks 8] [--out-dir DIR] [--append-results]
    python -m bench.wire_kernels --cpu [--mb 25] [--ranks 4] [--json]    # the torch path, one thread

For a float32 bucket of ``--mb`` MiB and ``--ranks`` ranks (one process: the all-to-all's received buffer is
simulated, each rank's slice the same bytes), times each launch the exchanges make, as a DDP bucket's exchange runs
them (``kernels.<op>.prepare(...).fixed(...)``: direct launches), and counts the bytes it must move:

- quantize (FP8 E4M3, error feedback): reads the bucket (4 B) and the residual (2 B: bfloat16, as the runtime keeps
  residuals), writes the residual (2 B) and the rows (132/128 B) per element;
- reduce (N ranks, error feedback): reads N rows per row of its shard (N * 132 B per 128 elements) and the shard's
  residual, writes it and the new row: per shard element N * 132/128 + 2 + 2 + 132/128 B;
- dequantize (to float32, no stats): reads the rows (132/128 B), writes the bucket (4 B);
- sum of blocks (FSDP's FP8 reduce-scatter, N ranks): reads N rows per row of its shard, writes float32: per shard
  element N * 132/128 + 4 B;
- the same four in E2M1 (68-byte rows: 68/128 B an element where FP8 moves 132/128);
- sum of slices (bfloat16, N ranks): reads N * 2 B, writes 2 B per shard element;
- torch's ``copy_`` of the bucket to bfloat16 as a reference point (4 + 2 B per element).

GB/s = bytes / median time; "of ceiling" divides by a float32 copy's GB/s (read + write).

``--cpu``: the torch path a gloo job runs on CPU tensors (``kernels/torch_wire.py``; ``TRITON_INTERPRET`` unset),
on one thread, fixed to its tensors as the exchanges fix it. What one rank does per step and bucket element, side by
side in one run: FP8 E4M3 with error feedback (quantize the bucket, reduce its shard over N ranks' copies,
dequantize the all-gathered bucket into float32 gradients) against bfloat16 (pack the bucket at scale 1/N, unpack
it), and bf16 with float32 sums (pack, sum of slices, unpack). ``fp8_over_bf16_cpu`` is FP8's nanoseconds per
element over bfloat16's: the part of a step the CPU path adds, where the link is what the format is chosen for. The
FP8 passes are the compiled ones (``kernels/native_cpu.py``) where they build, else torch's (``fp8_cpu_path`` says
which; ``DDP_TRITON_NATIVE_CPU=0`` times torch's). Beside them, the same three passes in E2M1 with error feedback
(68-byte rows; ``e2m1_cpu_path``): ``e2m1_over_fp8_cpu`` is their nanoseconds per element over FP8's, in all and
pass by pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import append_results, bench_us, environment, format_table, json_text, save_json  # noqa: E402
from bench.kernels import copy_ceiling_gbps  # noqa: E402
from ddp_triton.kernels import (FP4_E2M1, block_layout, dequantize_blocks, quantize_blocks,  # noqa: E402
                                reduce_blocks, row_bytes, sum_blocks, sum_slices)
from ddp_triton.kernels.fp8 import ROW_BYTES  # noqa: E402
from ddp_triton.runtime.residuals import RESIDUAL_DTYPE  # noqa: E402

MiB = 1 << 20


def rows(mb: float, ranks: int, ceiling: float, device: torch.device) -> List[Dict[str, Any]]:
    n = int(mb * MiB) // 4
    layout = block_layout([n], ranks)
    bucket = torch.randn(n, device=device)
    residual = torch.zeros(n, dtype=RESIDUAL_DTYPE, device=device)
    send = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8, device=device)
    quantize_blocks(bucket, layout, send, 1.0 / ranks, residual=residual)
    shard_rows = layout.rows_per_shard
    received = send.view(-1)[: shard_rows * ROW_BYTES].repeat(ranks)  # N ranks' copies of one shard
    shard = torch.empty(shard_rows * ROW_BYTES, dtype=torch.uint8, device=device)
    shard_residual = torch.zeros(shard_rows * 128, dtype=RESIDUAL_DTYPE, device=device)
    summed = torch.empty(shard_rows * 128, device=device)  # FSDP's float32 reduce-scatter output
    out = torch.empty_like(bucket)
    wire16 = bucket.to(torch.bfloat16)
    slice_n = -(-n // ranks)
    slices16 = torch.randn(slice_n * ranks, device=device).to(torch.bfloat16)
    summed16 = torch.empty(slice_n, dtype=torch.bfloat16, device=device)
    row_bytes_per_element = ROW_BYTES / 128
    shard_layout = block_layout([shard_rows * 128], 1)  # one shard's worth of whole blocks
    cases = [
        ("quantize e4m3 +ef", quantize_blocks.prepare(bucket, layout, send, 1.0 / ranks, residual=residual).fixed(
            bucket, send, residual), n * (4 + 2 + 2 + row_bytes_per_element)),
        (f"reduce e4m3 x{ranks} +ef", reduce_blocks.prepare(received, ranks, shard, residual=shard_residual).fixed(
            received, shard, shard_residual),
         shard_rows * 128 * (ranks * row_bytes_per_element + 4 + row_bytes_per_element)),
        ("dequantize e4m3 -> fp32", dequantize_blocks.prepare(send, layout, out).fixed(send, out, None),
         n * (row_bytes_per_element + 4)),
        # FSDP's end: the N ranks' rows of one shard summed into float32 (shard_rows rows a rank)
        (f"sum blocks e4m3 x{ranks} -> fp32", sum_blocks.prepare(received, ranks, shard_layout, summed).fixed(
            received, summed), shard_rows * 128 * (ranks * row_bytes_per_element + 4)),
        (f"sum slices bf16 x{ranks}", sum_slices.prepare(slices16, ranks, summed16).fixed(slices16, summed16),
         slice_n * (ranks * 2 + 2)),
        ("torch copy_ fp32 -> bf16", lambda: wire16.copy_(bucket), n * 6),
    ]
    cases[5:5] = _e2m1_cases(bucket, layout, residual, shard_residual, summed, out, ranks)
    out_rows = []
    for name, fn, nbytes in cases:
        us = bench_us(fn, device)
        gbps = nbytes / us / 1e3
        out_rows.append({"kernel": name, "mb": mb, "ranks": ranks, "bytes": int(nbytes), "us": round(us, 1),
                         "gbps": round(gbps, 1), "of_ceiling": round(gbps / ceiling, 3)})
    return out_rows


def _e2m1_cases(bucket: torch.Tensor, layout: Any, residual: torch.Tensor, shard_residual: torch.Tensor,
                summed: torch.Tensor, out: torch.Tensor, ranks: int) -> List[Any]:
    """The same launches in E2M1 (68-byte rows): quantize, reduce and dequantize with their bytes, and FSDP's sum."""
    row4 = row_bytes(FP4_E2M1)
    per = row4 / 128
    send = torch.empty(layout.n_rows * row4, dtype=torch.uint8, device=bucket.device)
    quantize_blocks(bucket, layout, send, 1.0 / ranks, fmt=FP4_E2M1, residual=residual)
    shard_rows = layout.rows_per_shard
    received = send[: shard_rows * row4].repeat(ranks)
    shard = torch.empty(shard_rows * row4, dtype=torch.uint8, device=bucket.device)
    shard_layout = block_layout([shard_rows * 128], 1)
    n = bucket.numel()
    return [
        ("quantize e2m1 +ef", quantize_blocks.prepare(bucket, layout, send, 1.0 / ranks, fmt=FP4_E2M1,
                                                      residual=residual).fixed(bucket, send, residual),
         n * (4 + 2 + 2 + per)),
        (f"reduce e2m1 x{ranks} +ef", reduce_blocks.prepare(received, ranks, shard, fmt=FP4_E2M1,
                                                            residual=shard_residual).fixed(received, shard,
                                                                                           shard_residual),
         shard_rows * 128 * (ranks * per + 4 + per)),
        ("dequantize e2m1 -> fp32", dequantize_blocks.prepare(send, layout, out, fmt=FP4_E2M1).fixed(send, out, None),
         n * (per + 4)),
        (f"sum blocks e2m1 x{ranks} -> fp32", sum_blocks.prepare(received, ranks, shard_layout, summed,
                                                                 fmt=FP4_E2M1).fixed(received, summed),
         shard_rows * 128 * (ranks * per + 4)),
    ]


def cpu_rows(mb: float, ranks: int) -> Dict[str, Any]:
    """Nanoseconds per bucket element of each pass of the torch path, and the per-format totals and ratio."""
    from ddp_triton.kernels import pack, unpack

    cpu = torch.device("cpu")
    n = int(mb * MiB) // 4
    gen = torch.Generator().manual_seed(0)
    bucket = torch.randn(n, generator=gen)
    layout = block_layout([n], ranks)
    residual = torch.zeros(n, dtype=RESIDUAL_DTYPE)
    send = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
    quantize_blocks(bucket, layout, send, 1.0 / ranks, residual=residual)
    shard_rows = layout.rows_per_shard
    received = send[: shard_rows * ROW_BYTES].repeat(ranks)
    shard = torch.empty(shard_rows * ROW_BYTES, dtype=torch.uint8)
    shard_residual = torch.zeros(shard_rows * 128, dtype=RESIDUAL_DTYPE)
    grads = torch.empty_like(bucket)
    wire16 = torch.empty(n, dtype=torch.bfloat16)
    slice_n = -(-n // ranks)
    sent16 = torch.zeros(slice_n * ranks, dtype=torch.bfloat16)
    summed16 = torch.empty(slice_n, dtype=torch.bfloat16)
    passes = {
        "bf16 pack": pack.prepare([bucket], wire16, 1.0 / ranks, canonical_nan=False).fixed([bucket], wire16),
        "bf16 unpack": unpack.prepare(wire16, [grads], 1.0, canonical_nan=False).fixed(wire16, [grads], None),
        f"bf16 sum of slices x{ranks}": sum_slices.prepare(sent16, ranks, summed16, canonical_nan=False).fixed(
            sent16, summed16),
        "fp8 quantize +ef": quantize_blocks.prepare(bucket, layout, send, 1.0 / ranks, residual=residual).fixed(
            bucket, send, residual),
        f"fp8 reduce x{ranks} +ef": reduce_blocks.prepare(received, ranks, shard, residual=shard_residual).fixed(
            received, shard, shard_residual),
        "fp8 dequantize": dequantize_blocks.prepare(send, layout, grads, canonical_nan=False).fixed(send, grads, None),
    }
    # E2M1 with error feedback: the same bucket, residuals and passes in 68-byte rows (its residuals of their own).
    fp4_bytes = row_bytes(FP4_E2M1)
    residual4 = torch.zeros(n, dtype=RESIDUAL_DTYPE)
    shard_residual4 = torch.zeros(shard_rows * 128, dtype=RESIDUAL_DTYPE)
    send4 = torch.empty(layout.n_rows * fp4_bytes, dtype=torch.uint8)
    quantize_blocks(bucket, layout, send4, 1.0 / ranks, fmt=FP4_E2M1, residual=residual4)
    received4 = send4[: shard_rows * fp4_bytes].repeat(ranks)
    shard4 = torch.empty(shard_rows * fp4_bytes, dtype=torch.uint8)
    passes.update({
        "e2m1 quantize +ef": quantize_blocks.prepare(bucket, layout, send4, 1.0 / ranks, fmt=FP4_E2M1,
                                                     residual=residual4).fixed(bucket, send4, residual4),
        f"e2m1 reduce x{ranks} +ef": reduce_blocks.prepare(received4, ranks, shard4, fmt=FP4_E2M1,
                                                           residual=shard_residual4).fixed(received4, shard4,
                                                                                           shard_residual4),
        "e2m1 dequantize": dequantize_blocks.prepare(send4, layout, grads, fmt=FP4_E2M1, canonical_nan=False).fixed(
            send4, grads, None),
    })
    ns = {name: bench_us(fn, cpu, rep_ms=400) * 1e3 / n for name, fn in passes.items()}
    bf16 = ns["bf16 pack"] + ns["bf16 unpack"]
    fp8 = ns["fp8 quantize +ef"] + ns[f"fp8 reduce x{ranks} +ef"] + ns["fp8 dequantize"]
    e2m1 = ns["e2m1 quantize +ef"] + ns[f"e2m1 reduce x{ranks} +ef"] + ns["e2m1 dequantize"]
    sums = bf16 + ns[f"bf16 sum of slices x{ranks}"]
    e2m1_over_fp8 = {op: ns[f"e2m1 {op}"] / ns[f"fp8 {op}"]
                     for op in ("quantize +ef", f"reduce x{ranks} +ef", "dequantize")}
    from ddp_triton.kernels.cpu_fp4 import cpu_fp4_passes
    from ddp_triton.kernels.cpu_fp8 import cpu_fp8_passes

    return {"mb": mb, "ranks": ranks, "elements": n, "threads": torch.get_num_threads(),
            "fp8_cpu_path": cpu_fp8_passes(), "e2m1_cpu_path": cpu_fp4_passes(),
            "ns_per_element": ns,
            "bf16_ns": bf16, "bf16_fp32sum_ns": sums, "fp8_ns": fp8, "fp8_over_bf16_cpu": fp8 / bf16,
            "bf16_fp32sum_over_bf16_cpu": sums / bf16, "e2m1_ns": e2m1, "e2m1_over_fp8_cpu": e2m1 / fp8,
            "e2m1_over_fp8_by_pass": e2m1_over_fp8}


def main_cpu(args: argparse.Namespace) -> int:
    from ddp_triton.kernels import INTERPRETER

    if INTERPRETER:
        print("bench.wire_kernels --cpu times the torch path: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    result = cpu_rows(args.mb, args.ranks)
    result["env"] = environment(torch.device("cpu"))
    save_json("wire_kernels_cpu", result, args.out_dir)
    if args.json:
        print(json_text(result), end="")
        return 0
    print(f"{result['env']}; {result['elements']} elements ({args.mb:g} MiB float32), {args.ranks} ranks, one thread")
    print(format_table(["pass", "ns per bucket element"], [[k, v] for k, v in result["ns_per_element"].items()]))
    print(f"bf16 (pack + unpack) {result['bf16_ns']:.2f} ns, bf16 + fp32 sums {result['bf16_fp32sum_ns']:.2f}, "
          f"FP8 + ef (quantize + reduce + dequantize, {result['fp8_cpu_path']} passes) {result['fp8_ns']:.2f}: "
          f"fp8_over_bf16_cpu {result['fp8_over_bf16_cpu']:.2f}")
    by_pass = ", ".join(f"{op} {ratio:.2f}" for op, ratio in result["e2m1_over_fp8_by_pass"].items())
    print(f"E2M1 + ef ({result['e2m1_cpu_path']} passes) {result['e2m1_ns']:.2f} ns: e2m1_over_fp8_cpu "
          f"{result['e2m1_over_fp8_cpu']:.2f} ({by_pass})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=25.0, help="bucket size in MiB of float32 (default 25)")
    p.add_argument("--ranks", type=int, default=None, help="ranks the reduce sums over (default 8; --cpu: 4)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--append-results", action="store_true", help="also append the table to bench/RESULTS.md")
    p.add_argument("--cpu", action="store_true", help="the torch path on CPU tensors, one thread, against bf16")
    p.add_argument("--json", action="store_true", help="with --cpu: print one JSON object")
    args = p.parse_args(argv)
    if args.ranks is None:
        args.ranks = 4 if args.cpu else 8
    if args.mb <= 0 or args.ranks < 1:
        p.error("--mb must be > 0 and --ranks >= 1")
    if args.cpu:
        return main_cpu(args)
    if not torch.cuda.is_available():
        print("bench.wire_kernels needs a CUDA device (or --cpu for the torch path)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ceiling = copy_ceiling_gbps(device, 1.0)
    table_rows = rows(args.mb, args.ranks, ceiling, device)
    env = environment(device)
    headers = ["kernel", "MiB", "ranks", "bytes", "us", "GB/s", "of ceiling"]
    table = format_table(headers, [[r["kernel"], r["mb"], r["ranks"], r["bytes"], r["us"], r["gbps"],
                                    r["of_ceiling"]] for r in table_rows])
    print(f"copy ceiling {ceiling:.0f} GB/s")
    print(table)
    save_json("wire_kernels", {"env": env, "ceiling_gbps": ceiling, "rows": table_rows}, args.out_dir)
    if args.append_results:
        append_results("Wire-format kernels", env, [f"Copy ceiling (float32 copy, read + write): {ceiling:.0f} GB/s",
                                                   table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
