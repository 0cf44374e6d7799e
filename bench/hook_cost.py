"""Host cost per bucket of DDP communication hooks: torch's against ours, measured by step time.

    python -m bench.hook_cost                  # the table (about a minute on a 2-core CPU)
    python -m bench.hook_cost --json           # one JSON object: microseconds per bucket, ratios, the machine
    python -m bench.hook_cost --quick          # a few seconds (smoke run; noisy numbers)

What it measures: DDP calls a communication hook once per bucket, from Python, on its autograd thread. Besides the
bytes it moves, every call pays a fixed host cost: the Python of the hook, torch's op dispatch for each cast or
scale, the collective's call, its future and the callback that writes the result back into DDP's bucket. A model
with many small buckets pays it many times per step, and no kernel speed-up hides it. A user judges a hook by step
time, so that is what is timed: a full step (forward and backward; the backward waits for every bucket's future)
of a model built for the fixed cost to dominate, under each hook in turn.

Model of the time: a step takes ``t = t0 + n_buckets * (h + p * b / BW)``, with ``t0`` the step without a hook,
``h`` the hook's fixed host cost per bucket, ``b`` the bucket's bytes, ``p`` the passes the hook makes over them
(casts, the collective's copies, the copy back) and ``BW`` the memory bandwidth; at world size 1 no byte crosses a
network. Here the model is ``--buckets`` layers ``Linear(64, 64)`` with a bucket cap below one layer's bytes, so
DDP makes one bucket per layer (counted: the hook calls of one backward) of 16.6 KB: ``p * b / BW`` is a few
microseconds at most, and ``(t - t0) / n_buckets`` is essentially ``h``. That is the row's "extra us per bucket".
In a real job with 25 MB buckets the byte term dominates per bucket, and ``h`` matters through the bucket count.

How: DDP at world size 1 on gloo (a FileStore, no port), one intra-op thread, one DDP instance per variant built
identically from one model. After warm-up (DDP rebuilds its buckets after the first backward; the hooks allocate
their buffers at the new buckets), the variants take turns in rounds, each timed over ``--steps`` steps per round
(garbage collection off inside a timed block), in an order rotated every round. A variant's extra time per bucket
is the median over rounds of its step time minus the no-hook step time of the same round, and a ratio the median
over rounds of the two variants' extra times in the same round: pairs taken minutes apart at most, where this
machine's speed drifts by tens of percent over a run (the JSON's rows also give every round's time, the median step
and the fastest round). CPU tensors take the kernels' torch path (``kernels/torch_path.py``,
``kernels/torch_wire.py``), the path a gloo job runs; Triton's interpreter, which ``TRITON_INTERPRET=1`` would
select, is refused.

torch refuses ``bf16_compress_hook`` by name outside NCCL (its check predates gloo's bfloat16 sums); the script
registers a copy of the same function under another name. The ratios compare each of our variants with torch's hook
of the same wire format: float32 with ``allreduce_hook``, float16 with ``fp16_compress_hook``, bfloat16 (and
bfloat16 with float32 sums, and FP8, which torch lacks) with ``bf16_compress_hook``; E2M1 with our FP8.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # Triton decides at import time whether kernels run in its interpreter: unset before ddp_triton is imported, so
    # that CPU tensors take the torch path a gloo job takes (main checks, for callers that imported it before).
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddp_triton  # noqa: E402
from bench.common import (environment, format_table, host_us_per_call, json_text, machine,  # noqa: E402
                          one_rank_gloo, save_json)

CPU = torch.device("cpu")


def _renamed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn``'s own code under another name (a wrapper would add a call to the timed path)."""
    out = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__annotations__ = dict(fn.__annotations__)
    return out


BF16_COMPRESS_HOOK = _renamed(default_hooks.bf16_compress_hook, "bf16_compress_hook_any_backend")


class Variant(NamedTuple):
    key: str
    what: str
    counterpart: Optional[str]  # torch's hook of the same wire format, for the ratio
    ratio_key: Optional[str]
    register: Callable[[DDP], Any]


def _torch_hook(hook: Callable[..., Any]) -> Callable[[DDP], Any]:
    return lambda ddp: ddp.register_comm_hook(dist.group.WORLD, hook)  # state: the process group


def _ours(**options: Any) -> Callable[[DDP], Any]:
    return lambda ddp: ddp_triton.register(ddp, profile=None, **options)


def _auto(*ranges: Tuple[int, Optional[int], str]) -> Callable[[DDP], Any]:
    """Ours with ``comm_dtype="auto"``, following a one-rank profile whose formats are ``ranges``."""
    from ddp_triton.machine.profile import FormatChoice, FormatRange, Profile, TableEntry

    def register(ddp: DDP) -> Any:
        table = [FormatRange(lo, hi, fmt) for lo, hi, fmt in ranges]
        names = sorted({r.format for r in table})
        profile = Profile(source="model", backend="model", world_size=1, nodes=1, comm_dtype="bfloat16",
                          bucket_cap_mb=25.0, table=[TableEntry(0, None, "ring")],
                          formats=FormatChoice(source="model", allowed=names, admitted=names, table=table))
        return ddp_triton.register(ddp, comm_dtype="auto", profile=profile)

    return register


VARIANTS: List[Variant] = [
    Variant("no_hook", "no hook (DDP's built-in all-reduce)", None, None, lambda ddp: None),
    Variant("allreduce_hook", "torch allreduce_hook", None, None, _torch_hook(default_hooks.allreduce_hook)),
    Variant("fp16_compress_hook", "torch fp16_compress_hook", None, None,
            _torch_hook(default_hooks.fp16_compress_hook)),
    Variant("bf16_compress_hook", "torch bf16_compress_hook", None, None, _torch_hook(BF16_COMPRESS_HOOK)),
    Variant("triton_fp32", "ours, float32", "allreduce_hook", "fp32_ratio", _ours(comm_dtype=torch.float32)),
    Variant("triton_fp16", "ours, float16", "fp16_compress_hook", "fp16_ratio", _ours(comm_dtype=torch.float16)),
    Variant("triton_bf16", "ours, bfloat16", "bf16_compress_hook", "bf16_ratio", _ours(comm_dtype=torch.bfloat16)),
    Variant("triton_bf16_fp32sum", "ours, bfloat16 + float32 sums", "bf16_compress_hook", "bf16_fp32sum_ratio",
            _ours(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)),
    Variant("triton_fp8", "ours, FP8 e4m3 + error feedback", "bf16_compress_hook", "fp8_ratio",
            _ours(comm_dtype=torch.float8_e4m3fn)),
    Variant("triton_fp4", "ours, E2M1 + error feedback", "triton_fp8", "fp4_over_fp8_ratio",
            _ours(comm_dtype="fp4e2m1+ef")),
    # Per-size formats from a profile: every bucket here is bf16; with a staged format in the table (for sizes no
    # bucket has), the all-reduces go through the exchange queue.
    Variant("triton_auto_bf16", "ours, comm_dtype='auto' (bf16 only)", "triton_bf16", "auto_direct_ratio",
            _auto((0, None, "bf16"))),
    Variant("triton_auto_queued", "ours, comm_dtype='auto' (bf16, FP8 above 1 MiB: queued)", "triton_bf16",
            "auto_queued_ratio", _auto((0, 1 << 20, "bf16"), ((1 << 20) + 1, None, "fp8e4m3+ef"))),
]


def make_model(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def bucket_cap_mb(width: int) -> float:
    """Half a layer's gradient bytes: each bucket closes on its layer's weight, after its bias (DDP fills buckets
    in reverse parameter order, and closes one once it reaches the cap)."""
    return (width * width + width) * 4 / 2 / 2**20


def make_step(ddp: DDP, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        ddp.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
    return step


def count_buckets(base: nn.Module, x: torch.Tensor, cap_mb: float, bucket_view: bool) -> Dict[str, int]:
    """Hook calls in one backward after DDP's bucket rebuild, and the median bucket's bytes."""
    calls: List[int] = []

    def counting_hook(process_group, bucket):  # unannotated: DDP checks annotations, which are strings here
        calls.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(process_group, bucket)

    probe = DDP(copy.deepcopy(base), bucket_cap_mb=cap_mb, gradient_as_bucket_view=bucket_view)
    probe.register_comm_hook(None, counting_hook)
    step = make_step(probe, x)
    for _ in range(3):  # the first backward runs on the constructor's buckets, the rebuilt ones from the second
        calls.clear()
        step()
    return {"buckets": len(calls), "bucket_bytes": int(statistics.median(calls)) if calls else 0}


def run(layers: int, width: int, batch: int, rounds: int, steps: int, warmup: int,
        bucket_view: bool = False) -> Dict[str, Any]:
    """Every variant's median step time and extra microseconds per bucket, with the ratios and the machine."""
    torch.manual_seed(0)
    base = make_model(layers, width)
    x = torch.randn(batch, width)
    cap = bucket_cap_mb(width)
    counted = count_buckets(base, x, cap, bucket_view)
    buckets = counted["buckets"]

    steps_of: Dict[str, Callable[[], None]] = {}
    for v in VARIANTS:
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=bucket_view)
        v.register(ddp)
        steps_of[v.key] = make_step(ddp, x)
        for _ in range(warmup):
            steps_of[v.key]()

    per_round: Dict[str, List[float]] = {v.key: [] for v in VARIANTS}
    keys = [v.key for v in VARIANTS]
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotated: no variant always follows the same one
            per_round[key].append(host_us_per_call(steps_of[key], CPU, calls=steps, warmup=0, gc_off=True) / 1e3)

    step_ms = {k: statistics.median(ts) for k, ts in per_round.items()}
    # Paired by round: each variant against the no-hook block of its own round (minutes apart at most, while a
    # machine's speed drifts by tens of percent over a run), then the median over rounds.
    paired = {k: [(ms - base) * 1e3 / buckets for ms, base in zip(ts, per_round["no_hook"])]
              for k, ts in per_round.items()}
    extra_us = {k: statistics.median(xs) for k, xs in paired.items()}

    def ratio(ours: str, theirs: str) -> Optional[float]:
        """The median over rounds of the two variants' extra times in the same round."""
        per = [a / b for a, b in zip(paired[ours], paired[theirs]) if b > 0]
        return statistics.median(per) if per else None

    result: Dict[str, Any] = {}
    rows = []
    for v in VARIANTS:
        vs_torch = ratio(v.key, v.counterpart) if v.counterpart is not None else None
        if v.key != "no_hook":
            result[f"{v.key}_us"] = extra_us[v.key]
        if v.ratio_key is not None:
            result[v.ratio_key] = vs_torch
        rows.append({"key": v.key, "what": v.what, "step_ms": step_ms[v.key], "extra_us_per_bucket": extra_us[v.key],
                     "counterpart": v.counterpart, "ratio": vs_torch,
                     "min_step_ms": min(per_round[v.key]),
                     "min_extra_us_per_bucket": (min(per_round[v.key]) - min(per_round["no_hook"])) * 1e3 / buckets,
                     "round_ms": per_round[v.key]})
    env = environment(CPU)
    result.update(
        no_hook_step_ms=step_ms["no_hook"], buckets=buckets, requested_buckets=layers,
        bucket_bytes=counted["bucket_bytes"], rounds=rounds, steps_per_round=steps, warmup=warmup,
        layers=layers, width=width, batch=batch, gradient_as_bucket_view=bucket_view, world_size=1,
        backend="gloo", threads=torch.get_num_threads(), rows=rows,
        torch=env["torch"], triton=env["triton"], machine=machine(), date=env["date"], env=env)
    return result


def table(result: Dict[str, Any]) -> str:
    return format_table(["variant", "step ms", "extra us per bucket", "vs torch's", "ratio"],
                        [[r["what"], r["step_ms"], None if r["key"] == "no_hook" else r["extra_us_per_bucket"],
                          r["counterpart"], r["ratio"]] for r in result["rows"]])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="host cost per bucket of DDP communication hooks, from DDP step times "
                                            "(world size 1, gloo, CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="50 buckets, 3 rounds of 3 steps (smoke run; noisy)")
    p.add_argument("--buckets", type=int, default=None, help="layers, one bucket each (default 200)")
    p.add_argument("--rounds", type=int, default=None, help="the variants take turns this many times (default 15)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant per round (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 5)")
    p.add_argument("--width", type=int, default=64, help="features of each Linear layer")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's gradient_as_bucket_view=True")
    p.add_argument("--out-dir", default=None, help="also save the JSON there")
    args = p.parse_args(argv)

    from ddp_triton.kernels import INTERPRETER

    if INTERPRETER:
        p.error("Triton's interpreter is on (TRITON_INTERPRET was set when ddp_triton.kernels was imported): "
                "it would time the interpreter, not the torch path a gloo job runs")
    defaults = (50, 3, 3, 3) if args.quick else (200, 15, 5, 5)
    layers, rounds, steps, warmup = (given if given is not None else default for given, default in
                                     zip((args.buckets, args.rounds, args.steps, args.warmup), defaults))
    if layers < 1 or rounds < 1 or steps < 1 or warmup < 2:
        p.error("--buckets, --rounds and --steps must be >= 1, --warmup >= 2 (DDP rebuilds its buckets after the "
                "first backward)")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_rank_gloo():
            result = run(layers, args.width, args.batch, rounds, steps, warmup, args.gradient_as_bucket_view)
    finally:
        torch.set_num_threads(threads)
    result["quick"] = args.quick
    if args.out_dir is not None:
        save_json("hook_cost", result, args.out_dir)
    if args.json:
        print(json_text(result), end="")
    else:
        print(f"{result['env']} {result['machine']['cpu']}\n{result['buckets']} buckets counted in a backward "
              f"({layers} layers), {result['bucket_bytes']} bytes each; median of {rounds} rounds of {steps} steps\n")
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
