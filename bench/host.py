"""Host cost of pack / unpack (plain calls, and prepared calls called with their tensors or fixed to them), of the
hook's per-bucket front end and of one FSDP group's FP8 kernel calls (plain, and prepared), on any CPU.

    python -m bench.host              # the table, with each row's ratio to one torch op timed in the same run
    python -m bench.host --json       # one JSON object: microseconds, ratios, targets and the environment
    python -m bench.host --quick      # fewer calls and rounds (smoke run)

Timed: the whole Python path of each call as it runs on CUDA: a plain call's checks, its work list and argument
building; a prepared call's comparison of its tensors with its examples (and, at new addresses, its argument
building); a fixed call's ``__call__``; then the direct launcher's call. Stubbed, and only this: the final call into
Triton's compiled launcher (``run``, a C function that parses its arguments and calls cuLaunchKernel) is a Python
function that returns at once, and the two getters the direct launch calls per launch (torch's current CUDA device
and raw stream, C functions of its CUDA build) are C builtins that return 0. To take the CUDA path without a GPU,
``uses_triton`` answers True for CPU tensors, and a prepared call compiles (``launch._bind_direct``) a real
``_DirectLaunch`` built around those stubs instead of a compiled kernel. Plain calls go through Triton's own
launcher, stubbed whole here (its argument handling: 17.3 us per launch measured on the lent H200's host,
2026-11-30): on a GPU they cost that much more per launch, as does the plain FSDP row (two launches).

Ratios are to torch's host cost for one elementwise op on a small CPU tensor (``torch.mul(src, 0.125, out=dst)``,
1024 float32), measured in the same run and interleaved with the rows, round by round (the fastest round of each
counts), so that they carry over between machines. Targets: a fixed call (what a DDP bucket runs every step) at most
1x; a plain call of a layout seen before (every row's call repeats one) at most 2x for one tensor, 20x for 148.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (environment, format_table, host_us_per_call, json_text, one_rank_gloo,  # noqa: E402
                          save_json)
from bench.kernels import fsdp_group_calls, gpt2_small_shapes  # noqa: E402

pack_module = importlib.import_module("ddp_triton.kernels.pack")  # the module: the package exports a function `pack`
blockscale_module = importlib.import_module("ddp_triton.kernels.blockscale")
launch_module = importlib.import_module("ddp_triton.kernels.launch")

CPU = torch.device("cpu")
TARGETS = {"fixed": 1.0, "pack_1": 2.0, "pack_148": 20.0, "unpack_148": 20.0}
SCALE = 0.125
STUBBED = ("Triton's compiled launcher (a no-op Python function) and torch's current CUDA device and stream getters "
           "(C builtins returning 0); CPU tensors take the CUDA path (uses_triton patched to True)")


def _no_launch(*args: Any) -> None:
    """Stands for Triton's compiled launcher: same arguments, no argument parsing, no driver call."""


def stub_direct_launch(plan: Any, kernel: Any, args: tuple, constexprs: dict) -> Any:
    """A real ``_DirectLaunch`` for these arguments around the stubs (see the module docstring)."""
    values = launch_module._launcher_values(kernel, args, constexprs)
    direct = launch_module._DirectLaunch(None, _no_launch, 0, None, plan.n_items, 0, values)
    direct.current_device, direct.current_stream = int, abs  # C builtins: int() == 0 == index, abs(0) == 0
    return direct


@contextlib.contextmanager
def cuda_like_path() -> Iterator[None]:
    """CPU tensors take the Triton path down to the stubbed launcher."""
    with mock.patch.object(pack_module, "uses_triton", lambda device: True), \
            mock.patch.object(blockscale_module, "uses_triton", lambda device: True), \
            mock.patch.object(launch_module, "_can_launch_directly", lambda plan, args: plan.n_items > 0), \
            mock.patch.object(launch_module, "_direct_launch_ok", True), \
            mock.patch.object(launch_module, "_bind_direct", lambda plan, kernel, args, constexprs, device:
                              stub_direct_launch(plan, kernel, args, constexprs)), \
            mock.patch.object(launch_module, "launch", lambda plan, kernel, args, constexprs: None):
        yield


def _gradients() -> List[torch.Tensor]:
    """GPT-2 small's 148 parameter shapes, narrowed: sizes matter only to the plan, which is built once."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in gpt2_small_shapes(hidden=64, vocab=1000, context=64)]


def cases(hook_fn: Callable[[], Any]) -> List[Tuple[str, str, Callable[[], Any], int]]:
    """(key, what, call, calls per round) of every row; the first is the torch baseline."""
    from ddp_triton.kernels import block_layout, pack, quantize_blocks, unpack
    from ddp_triton.kernels.fp8 import ROW_BYTES

    src, dst = torch.randn(1024), torch.empty(1024)
    one_out = torch.empty(1024, dtype=torch.bfloat16)
    grads = _gradients()
    flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.bfloat16)
    stats = torch.zeros(2)
    prepared_1 = pack.prepare([src], one_out, SCALE)
    prepared_148 = pack.prepare(grads, flat, SCALE)
    fixed = pack.prepare([src], one_out, SCALE).fixed([src], one_out)
    layout = block_layout([src.numel()], 1)
    fp8_rows, residual = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8), torch.zeros_like(src)
    fixed_fp8 = quantize_blocks.prepare(src, layout, fp8_rows, SCALE, residual=residual).fixed(src, fp8_rows, residual)
    rows = [
        ("torch_op", "torch.mul(src, 0.125, out=dst), 1024 float32 (baseline)",
         lambda: torch.mul(src, SCALE, out=dst), 2000),
        ("pack_1", "pack, 1 tensor of 1024, plain call (+ Triton's launcher, stubbed whole)",
         lambda: pack([src], one_out, SCALE), 1000),
        ("pack_148", "pack, GPT-2's 148 tensors, plain call (+ Triton's launcher, stubbed whole)",
         lambda: pack(grads, flat, SCALE), 20),
        ("unpack_148", "unpack, 148 tensors, plain call (+ Triton's launcher, stubbed whole)",
         lambda: unpack(flat, grads, 8.0), 20),
        ("unpack_stats_148", "unpack with stats, 148 tensors, plain call (+ Triton's launcher, stubbed whole)",
         lambda: unpack(flat, grads, 8.0, stats=stats), 20),
        ("prepared_1", "pack.prepare(...) of 1 tensor, called with it: compared, then relaunched",
         lambda: prepared_1([src], one_out), 2000),
        ("prepared_148", "pack.prepare(...) of 148 tensors, called with them: compared, then relaunched",
         lambda: prepared_148(grads, flat), 300),
        ("fixed", "pack.prepare(...).fixed(...)(): a fixed call, 1 tensor", fixed, 5000),
        ("fixed_fp8", "quantize_blocks.prepare(...).fixed(...)(): a fixed FP8 quantize (wire formats)", fixed_fp8,
         5000),
    ]
    rows += [(key, what + (" (+ Triton's launcher, stubbed whole)" if key == "fsdp_fp8_plain" else ""), fn, 2000)
             for key, what, fn, _ in fsdp_group_calls(CPU)]
    rows.append(("hook_bucket", "hook front end per bucket: its plan + pack", hook_fn, 5000))
    return rows


def hook_front_end() -> Callable[[], Any]:
    """The per-bucket work of ``triton_hook`` before the all-reduce: the bucket's entry, then its fixed pack."""
    from ddp_triton import CommState

    state = CommState(profile=None)  # bfloat16 on the wire: a pack kernel per bucket
    buffer = torch.randn(1 << 16)
    bucket = SimpleNamespace(buffer=lambda: buffer, index=lambda: 0)  # what the hook reads of DDP's GradBucket
    state.plan_for(buffer, bucket)  # its kernel calls compile their (stubbed) direct launches at their first call

    def front_end() -> None:  # the hook's lookup of the bucket's plan, then its pack
        found = state.plans.get(id(bucket.buffer()))
        if found is None or not found.valid:
            found = state.plan_for(buffer, bucket)
        found.exchange.stages[0].compute()

    return front_end


def measure(rows: List[Tuple[str, str, Callable[[], Any], int]], rounds: int, scale_calls: float) -> Dict[str, float]:
    """Fastest round's host microseconds per call of every row, rows interleaved round by round."""
    best: Dict[str, float] = {}
    for _ in range(rounds):
        for key, _what, fn, calls in rows:
            n = max(3, int(calls * scale_calls))
            us = host_us_per_call(fn, CPU, calls=n, warmup=max(1, n // 10))
            best[key] = min(us, best.get(key, float("inf")))
    return best


def run(quick: bool) -> Dict[str, Any]:
    """Every row's microseconds and ratio to the torch op, with the targets and the environment."""
    rounds, scale_calls = (2, 0.05) if quick else (7, 1.0)
    with cuda_like_path(), one_rank_gloo():
        rows = cases(hook_front_end())
        best = measure(rows, rounds, scale_calls)
    base = best["torch_op"]
    result: Dict[str, Any] = {"torch_op_us": base, "baseline": rows[0][1], "stubbed": STUBBED}
    for key, _what, _fn, _calls in rows[1:]:
        result[f"{key}_us"] = best[key]
        result[f"{key}_ratio"] = best[key] / base
    result["rows"] = [{"key": k, "what": w, "us": best[k], "ratio": best[k] / base} for k, w, _f, _c in rows]
    result["targets"] = {f"{k}_ratio": v for k, v in TARGETS.items()}
    result["rounds"], result["quick"] = rounds, quick
    result["env"] = environment(CPU)
    return result


def table(result: Dict[str, Any]) -> str:
    """The rows with their ratio, target and whether they meet it."""
    lines = []
    for row in result["rows"]:
        target = TARGETS.get(row["key"])
        meets = None if target is None else ("yes" if row["ratio"] <= target else "NO")
        lines.append([row["what"], row["us"], row["ratio"], target, meets])
    return format_table(["call", "host us/call", "x torch op", "target", "meets"], lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="host cost of pack/unpack, prepared and fixed calls and the hook's front "
                                            "end, as ratios to one torch op (CPU; the launcher is stubbed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="fewer calls and rounds (smoke run; noisy numbers)")
    p.add_argument("--out-dir", default=None, help="also save the JSON there")
    args = p.parse_args(argv)

    result = run(args.quick)
    if args.out_dir is not None:
        save_json("host", result, args.out_dir)
    if args.json:
        print(json_text(result), end="")
    else:
        print(f"{result['env']}\n")
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
