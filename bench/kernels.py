"""pack / unpack against torch's equivalents and the copy ceiling, on one GPU.

    python -m bench.kernels                 # CUDA: the full table, JSON in bench/out/, a section in RESULTS.md
    python -m bench.kernels --device cpu --quick --no-compile   # smoke run of the same code on CPU (no GPU needed)

Bytes model: a pack or unpack of n elements between float32 and bfloat16 reads 4 and writes 2 bytes per element
(or the reverse), ``bytes = n * (4 + 2)``; the least it can take is those bytes at the copy ceiling, measured in
the same run as a float32 device-to-device copy of 1 GiB (bytes read + written). Torch's equivalents are what its
bf16_compress_hook does around the all-reduce: ``buf.to(bfloat16).div_(N)`` before, ``buf.copy_(bf16)`` after,
and for a list of gradients ``torch.cat(grads).to(bfloat16).div_(N)``; torch.compile's fused kernels for the same
expressions are timed beside them.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    append_results,
    bench_us,
    environment,
    format_table,
    host_us_per_call,
    save_json,
)
from ddp_triton.kernels import pack, unpack  # noqa: E402

WORLD = 8  # the division by world size in the pack; any N costs the same
MiB = 1 << 20


def gpt2_small_shapes(hidden: int = 768, vocab: int = 50257, context: int = 1024, layers: int = 12) -> List[tuple]:
    """The 148 parameter shapes of GPT-2 small (124,439,808 parameters at the defaults), in module order."""
    shapes = [(vocab, hidden), (context, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,), (hidden, 3 * hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                   (hidden,), (hidden,), (hidden, 4 * hidden), (4 * hidden,), (4 * hidden, hidden), (hidden,)]
    return shapes + [(hidden,), (hidden,)]


def copy_ceiling_gbps(device: torch.device, gib: float) -> float:
    """GB/s of a float32 copy, bytes read plus written: the most any of these kernels can reach."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), device)
    return 2 * n * 4 / us / 1e3


def _compiled(fn: Callable, example: Any, enabled: bool) -> Optional[Callable]:
    """torch.compile of ``fn`` for exactly ``example``'s shape (``dynamic=False``: a kernel specialised to the size,
    as Inductor gives a static-shape model), compiled and warmed up here so that no timing includes compilation."""
    if not enabled:
        return None
    torch._dynamo.reset()  # each size compiles afresh, never into a dynamic-shape kernel from an earlier size
    compiled = torch.compile(fn, dynamic=False)
    for _ in range(3):
        compiled(example)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return compiled


def _bucket_case(device: torch.device, mb: float, ceiling: float, compile_: bool) -> List[Dict[str, Any]]:
    """Pack and unpack rows for one flat float32 bucket of ``mb`` MiB."""
    n = int(mb * MiB) // 4
    buf = torch.randn(n, device=device)
    comm = torch.empty(n, dtype=torch.bfloat16, device=device)
    compiled_pre = _compiled(lambda b: (b * (1.0 / WORLD)).to(torch.bfloat16), buf, compile_)
    compiled_post = _compiled(lambda c: c.float(), comm, compile_)
    ours_pack = pack.prepare([buf], comm, 1.0 / WORLD).fixed([buf], comm)
    ours_unpack = unpack.prepare(comm, [buf], 1.0).fixed(comm, [buf], None)
    ours_pack()
    expected = buf.float().mul(1.0 / WORLD).to(torch.bfloat16)
    exact = {"pack": bool(torch.equal(comm.view(torch.int16), expected.view(torch.int16)))}
    back = buf.clone()
    unpack(comm, [back], 1.0)
    exact["unpack"] = bool(torch.equal(back, comm.float()))
    nbytes = n * (4 + 2)
    floor_us = nbytes / ceiling / 1e3
    cases = [
        ("pack", ours_pack, lambda: buf.to(torch.bfloat16).div_(WORLD),
         (lambda: compiled_pre(buf)) if compiled_pre else None),
        ("unpack", ours_unpack, lambda: buf.copy_(comm), (lambda: compiled_post(comm)) if compiled_post else None),
    ]
    rows = []
    graph = device.type == "cuda"
    for op, ours, theirs, compiled in cases:
        ours_us = bench_us(ours, device)
        torch_us = bench_us(theirs, device)
        compiled_us = bench_us(compiled, device) if compiled else None
        row = {
            "mb": mb, "op": op, "elements": n, "bytes": nbytes, "ours_us": ours_us, "torch_us": torch_us,
            "compiled_us": compiled_us, "floor_us": floor_us, "ours_gbps": nbytes / ours_us / 1e3,
            "ours_of_ceiling": floor_us / ours_us, "ours_over_torch": ours_us / torch_us, "bitexact": exact[op],
        }
        if graph:  # GPU time alone: every column replayed from a CUDA graph, no launch overhead in any of them
            row.update(ours_graph_us=graph_us(ours, device), torch_graph_us=graph_us(theirs, device),
                       compiled_graph_us=graph_us(compiled, device))
            row.update(graph_ours_over_torch=_ratio(row["ours_graph_us"], row["torch_graph_us"]),
                       graph_ours_over_compiled=_ratio(row["ours_graph_us"], row["compiled_graph_us"]),
                       graph_ours_of_ceiling=_ratio(floor_us, row["ours_graph_us"]) or 0.0)
        rows.append(row)
    return rows


L2_FLUSH_BYTES = 256 << 20  # several times an H100/H200's 50 MiB L2, as triton.testing.do_bench flushes


def graph_us(fn: Optional[Callable], device: torch.device) -> Optional[float]:
    """GPU microseconds per call with a cold L2, from CUDA graph replays: each replay first overwrites a 256 MiB
    buffer, then runs ``fn``; the flush alone is timed the same way and subtracted. Without the flush, a 25 MiB
    bucket and its bf16 copy stay in L2 between replays and read faster than memory allows. None (with the reason
    printed) where ``fn`` is absent or cannot be captured."""
    if fn is None:
        return None
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    try:
        both = bench_us(lambda: (flush.zero_(), fn()), device, graph=True)
        return both - bench_us(flush.zero_, device, graph=True)
    except Exception as exc:  # one column lost, not the run
        print(f"graph timing failed: {type(exc).__name__}: {exc}")
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def block_sweep_rows(device: torch.device, sizes_mb: List[float], ceiling: float) -> List[Dict[str, Any]]:
    """GPU time of the contiguous kernel (the hook's) per (BLOCK, warps), pack and unpack, from CUDA graphs: what
    ``worklist.launch_config`` should pick."""
    from ddp_triton.kernels.launch import kernel_arguments, launch
    from ddp_triton.kernels.worklist import Plan

    rows = []
    for mb in sizes_mb:
        n = int(mb * MiB) // 4
        buf = torch.randn(n, device=device)
        comm = torch.empty(n, dtype=torch.bfloat16, device=device)
        floor_us = n * 6 / ceiling / 1e3
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                plan = Plan(None, -(-n // block), n, block, warps, 0)
                # Triton's launcher: in a CUDA graph only the kernel it records is timed
                pack_launch = functools.partial(launch, plan, *kernel_arguments(
                    plan, buf, comm.view(torch.int16), 1.0 / WORLD, 0, None))
                unpack_launch = functools.partial(launch, plan, *kernel_arguments(
                    plan, comm, buf.view(torch.int32), 1.0, 2, None))
                for op, fn in (("pack", pack_launch), ("unpack", unpack_launch)):
                    us = graph_us(fn, device)
                    if us is None:
                        continue
                    rows.append({"mb": mb, "op": op, "block": block, "warps": warps, "graph_us": us,
                                 "of_ceiling": floor_us / us})
    return rows


def bucket_rows(device: torch.device, sizes_mb: List[float], ceiling: float, compile_: bool) -> List[Dict[str, Any]]:
    """One flat float32 bucket per size: pack (to bf16, /N) and unpack (to fp32), ours beside torch's."""
    rows = []
    for mb in sizes_mb:
        rows += _bucket_case(device, mb, ceiling, compile_)
    return rows


def gradient_list_rows(device: torch.device, shapes: List[tuple], ceiling: float, compile_: bool) -> List[Dict]:
    """GPT-2 small's gradients: flatten + scale + cast in one launch, against torch.cat and its compiled form."""
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=gen) for s in shapes]
    n = sum(g.numel() for g in grads)
    flat = torch.empty(n, dtype=torch.bfloat16, device=device)
    nbytes = n * (4 + 2)
    floor_us = nbytes / ceiling / 1e3
    ours_pack = pack.prepare(grads, flat, 1.0 / WORLD).fixed(grads, flat)
    ours_pack()
    expected = torch.cat([g.flatten() for g in grads]).mul(1.0 / WORLD).to(torch.bfloat16)
    exact = {"pack": bool(torch.equal(flat.view(torch.int16), expected.view(torch.int16)))}
    back = [torch.empty_like(g) for g in grads]
    unpack(flat, back, 1.0)
    exact["unpack"] = bool(torch.equal(torch.cat([b.flatten() for b in back]), flat.float()))
    compiled = _compiled(lambda gs: torch.cat([g.flatten() for g in gs]).mul(1.0 / WORLD).to(torch.bfloat16),
                         grads, compile_)
    ours_unpack = unpack.prepare(flat, grads, 1.0).fixed(flat, grads, None)
    views = list(flat.split([g.numel() for g in grads]))

    def torch_unpack() -> None:
        for g, v in zip(grads, views):
            g.copy_(v.view_as(g))

    rows = []
    for op, ours, theirs, comp in (
        ("pack", ours_pack, lambda: torch.cat([g.flatten() for g in grads]).to(torch.bfloat16).div_(WORLD),
         (lambda: compiled(grads)) if compiled else None),
        ("unpack", ours_unpack, torch_unpack, None),
    ):
        ours_us = bench_us(ours, device)
        torch_us = bench_us(theirs, device)
        compiled_us = bench_us(comp, device) if comp else None
        graphs = ({"ours_graph_us": graph_us(ours, device), "torch_graph_us": graph_us(theirs, device),
                   "compiled_graph_us": graph_us(comp, device)} if device.type == "cuda" else {})
        rows.append({
            **graphs,
            "tensors": len(grads), "op": op, "elements": n, "bytes": nbytes, "ours_us": ours_us, "torch_us": torch_us,
            "compiled_us": compiled_us, "floor_us": floor_us, "ours_over_floor": ours_us / floor_us,
            "torch_over_ours": torch_us / ours_us,
            "compiled_over_ours": (compiled_us / ours_us) if compiled_us else None, "bitexact": exact[op],
        })
    return rows


def fsdp_group_calls(device: torch.device) -> List[Tuple[str, str, Callable[[], None], int]]:
    """(key, what, call, calls per round) for the kernel calls of one FSDP group's FP8 reduce-scatter (quantize with
    the residual it keeps, in ``RESIDUAL_DTYPE``, then the sum of the ranks' blocks; 8 ranks, 8 parameter chunks of a
    block each, so that the GPU is never the limit): plain calls, and the prepared calls the group keeps, through
    ``PreparedCalls.run`` as ``runtime/fsdp.py`` runs them, on the same buffers every call or on other ones every
    other call (FSDP's buffers are new each step: the caching allocator often, not always, hands back the same
    addresses)."""
    from ddp_triton.kernels import block_layout, quantize_blocks, sum_blocks
    from ddp_triton.kernels.fp8 import ROW_BYTES
    from ddp_triton.runtime.prepared_calls import PreparedCalls
    from ddp_triton.runtime.residuals import RESIDUAL_DTYPE

    ranks, sizes, scale, fmt = 8, (128, 96, 128, 64, 128, 96, 128, 64), 0.125, torch.float8_e4m3fn
    layout, row_layout = block_layout(sizes * ranks, ranks), block_layout(sizes, 1)
    buffers = [(torch.randn(layout.n_elements, device=device), torch.empty(layout.n_rows * ROW_BYTES,
                dtype=torch.uint8, device=device), torch.zeros(layout.n_elements, dtype=RESIDUAL_DTYPE, device=device),
                torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8, device=device),
                torch.empty(row_layout.n_elements, device=device)) for _ in range(2)]
    calls, turns = PreparedCalls(), iter(range(1 << 62))

    def plain() -> None:
        src, send, residual, received, total = buffers[0]
        quantize_blocks(src, layout, send, scale, fmt=fmt, residual=residual)
        sum_blocks(received, ranks, row_layout, total, fmt=fmt)

    def prepared(index: int) -> None:
        src, send, residual, received, total = buffers[index]
        calls.run(("quantize", sizes, ranks, scale, fmt), lambda s, rows, left: quantize_blocks.prepare(
            s, layout, rows, scale, fmt=fmt, residual=left), src, send, residual)
        calls.run(("sum_blocks", sizes, ranks, fmt), lambda rows, out: sum_blocks.prepare(
            rows, ranks, row_layout, out, fmt=fmt), received, total)

    return [("fsdp_fp8_plain", "FSDP FP8 group, plain quantize + sum_blocks", plain, 300),
            ("fsdp_fp8_prepared", "FSDP FP8 group, prepared quantize + sum_blocks, the same buffers",
             lambda: prepared(0), 300),
            ("fsdp_fp8_prepared_new", "FSDP FP8 group, prepared quantize + sum_blocks, other buffers each call",
             lambda: prepared(next(turns) % 2), 300)]


def host_overhead_rows(device: torch.device, shapes: List[tuple], calls: int = 2000) -> List[Dict[str, Any]]:
    """Host microseconds per call (the GPU is never the limit here): the cost a hook pays on the training thread
    per bucket, and a plain pack of GPT-2's gradient list, beside torch's own ops; ``calls`` per row."""
    src = torch.randn(1024, device=device)
    out = torch.empty(1024, dtype=torch.bfloat16, device=device)
    fixed = pack.prepare([src], out, 1.0 / WORLD).fixed([src], out)
    grads = [torch.empty(s, device=device) for s in shapes]
    flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.bfloat16, device=device)
    candidates = [
        ("ddp_triton pack.prepare(...).fixed(...) (a fixed prepared call)", fixed),
        ("ddp_triton pack() of 1 tensor (checks + launch)", lambda: pack([src], out, 1.0 / WORLD)),
        (f"ddp_triton pack() of {len(grads)} tensors", lambda: pack(grads, flat, 1.0 / WORLD)),
        (f"ddp_triton unpack() of {len(grads)} tensors", lambda: unpack(flat, grads)),
        ("torch copy_ (one elementwise op)", lambda: out.copy_(src)),
        ("torch mul(...).to(bfloat16) (two ops)", lambda: src.mul(1.0 / WORLD).to(torch.bfloat16)),
    ]
    rows = [{"call": name, "host_us": host_us_per_call(fn, device, calls=calls, warmup=max(1, calls // 10))}
            for name, fn in candidates]
    if device.type == "cuda":  # two launches a call: few enough calls that the launch queue never fills
        rows += [{"call": what, "host_us": host_us_per_call(fn, device, calls=min(calls, n), warmup=max(1, n // 10))}
                 for _, what, fn, n in fsdp_group_calls(device)]
    if device.type == "cuda":
        rows.append({"call": "CUDA graph replay of the fixed pack", "host_us": graph_replay_host_us(fixed, device)})
    return rows


def graph_replay_host_us(launch_fn: Callable[[], None], device: torch.device) -> float:
    """Host microseconds per replay of a CUDA graph that holds one launch of a fixed call."""
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch_fn()
    return host_us_per_call(graph.replay, device)


def graph_rows(device: torch.device, mb: float) -> List[Dict[str, Any]]:
    """The hook's pack and unpack of one ``mb`` MiB bucket captured in a CUDA graph: device time per replay beside
    the eager fixed calls, and whether the replay gives the eager bits."""
    n = int(mb * MiB) // 4
    buf = torch.randn(n, device=device)
    comm = torch.empty(n, dtype=torch.bfloat16, device=device)
    pack_b = pack.prepare([buf], comm, 1.0 / WORLD).fixed([buf], comm)
    unpack_b = unpack.prepare(comm, [buf], 1.0).fixed(comm, [buf], None)
    eager = lambda: (pack_b(), unpack_b())  # noqa: E731
    source = buf.clone()
    eager()
    expected = buf.clone()
    buf.copy_(source)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            eager()
    buf.copy_(source)
    graph.replay()
    torch.cuda.synchronize(device)
    exact = bool(torch.equal(buf, expected))
    return [{"mb": mb, "eager_pack_unpack_us": bench_us(eager, device),
             "graph_pack_unpack_us": bench_us(graph.replay, device), "graph_bitexact": exact}]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="pack/unpack kernels against torch and the copy ceiling")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run of this script")
    p.add_argument("--sizes-mb", default="1,4,25,100,400", help="bucket sizes in MiB, comma separated")
    p.add_argument("--quick", action="store_true", help="small sizes and a narrow GPT-2 (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    p.add_argument("--sweep", action="store_true", help="also time BLOCK x warps of the contiguous kernel")
    p.add_argument("--append-results", action="store_true", help="also append the tables to bench/RESULTS.md")
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/out)")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.kernels: no CUDA device here; nothing measured (use --device cpu for a smoke run)")
        return 0
    device = torch.device(args.device)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    shapes = gpt2_small_shapes()
    if args.quick:
        sizes, shapes = [s for s in sizes if s <= 4] or [1.0], gpt2_small_shapes(64, 1000, 64, 12)
    env = environment(device)
    ceiling = copy_ceiling_gbps(device, 1.0 if device.type == "cuda" and not args.quick else 1 / 64)
    compile_ = not args.no_compile
    buckets = bucket_rows(device, sizes, ceiling, compile_)
    gradients = gradient_list_rows(device, shapes, ceiling, compile_)
    host = host_overhead_rows(device, shapes, calls=100 if args.quick else 2000)
    graphs = graph_rows(device, 25.0 if not args.quick else 1.0) if device.type == "cuda" else []
    sweep = block_sweep_rows(device, [1.0, 4.0, 25.0, 100.0], ceiling) if args.sweep and device.type == "cuda" else []

    bucket_table = format_table(
        ["MiB", "op", "ours us", "GB/s", "of ceiling", "torch us", "compiled us", "ours/torch", "bit-exact"],
        [[r["mb"], r["op"], r["ours_us"], r["ours_gbps"], f"{r['ours_of_ceiling']:.0%}", r["torch_us"],
          r["compiled_us"], r["ours_over_torch"], r["bitexact"]] for r in buckets])
    gradient_table = format_table(
        ["tensors", "op", "ours us", "floor us", "ours/floor", "torch us", "torch/ours", "compiled us",
         "compiled/ours", "bit-exact"],
        [[r["tensors"], r["op"], r["ours_us"], r["floor_us"], r["ours_over_floor"], r["torch_us"],
          r["torch_over_ours"], r["compiled_us"], r["compiled_over_ours"], r["bitexact"]] for r in gradients])
    gradient_gpu_table = format_table(
        ["tensors", "op", "ours us", "ours/floor", "torch us", "compiled us"],
        [[r["tensors"], r["op"], r["ours_graph_us"], _ratio(r["ours_graph_us"], r["floor_us"]), r["torch_graph_us"],
          r["compiled_graph_us"]] for r in gradients if "ours_graph_us" in r])
    gpu_time_table = format_table(
        ["MiB", "op", "ours us", "of ceiling", "torch us", "compiled us", "ours/torch", "ours/compiled"],
        [[r["mb"], r["op"], r["ours_graph_us"], f"{r['graph_ours_of_ceiling']:.0%}", r["torch_graph_us"],
          r["compiled_graph_us"], r["graph_ours_over_torch"], r["graph_ours_over_compiled"]]
         for r in buckets if "ours_graph_us" in r])
    sweep_table = format_table(["MiB", "op", "BLOCK", "warps", "GPU us", "of ceiling"],
                               [[r["mb"], r["op"], r["block"], r["warps"], r["graph_us"], f"{r['of_ceiling']:.0%}"]
                                for r in sweep])
    host_table = format_table(["call", "host us/call"], [[r["call"], r["host_us"]] for r in host])
    graph_table = format_table(["MiB", "eager pack+unpack us", "graph replay us", "replay bit-exact"],
                               [[r["mb"], r["eager_pack_unpack_us"], r["graph_pack_unpack_us"], r["graph_bitexact"]]
                                for r in graphs])
    path = save_json("kernels", {"env": env, "copy_ceiling_gbps": ceiling, "buckets": buckets,
                                 "gradient_list": gradients, "host": host, "graph": graphs, "sweep": sweep},
                     args.out_dir)
    print(f"{env}\ncopy ceiling: {ceiling:.0f} GB/s\n")
    print(bucket_table, "\nGPU time only, cold L2 (CUDA graph replays):", gpu_time_table, "\n", gradient_table,
          "\nGPU time only (CUDA graph replays):", gradient_gpu_table, "\n", host_table, "\n", graph_table, "\n",
          sweep_table, sep="\n")
    print(f"\nsaved {path}")
    if args.append_results:
        append_results("bench/kernels.py", env, [f"Copy ceiling {ceiling:.0f} GB/s.", bucket_table,
                                                 "GPU time only, cold L2, every column replayed from a CUDA graph:",
                                                 gpu_time_table, gradient_table, "GPU time only (CUDA graphs):",
                                                 gradient_gpu_table, host_table, graph_table]
                       + (["BLOCK x warps of the contiguous kernel (CUDA graphs):", sweep_table] if sweep else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
