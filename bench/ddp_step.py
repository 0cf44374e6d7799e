"""Median DDP training-step time of a ~100M-parameter model under each communication hook.

    python -m bench.ddp_step                               # world size 1 on one GPU (NCCL), or gloo on CPU
    torchrun --nproc_per_node=8 -m bench.ddp_step          # any world size
    python -m bench.ddp_step --small --steps 5             # a quick CPU smoke run

Model: 12 blocks of Linear(1024, 4096) - GELU - Linear(4096, 1024), 100.7M parameters, batch 64, SGD. Each
variant (no hook, torch's allreduce_hook and bf16_compress_hook, triton_hook in bfloat16 and float32, and
triton_hook in bfloat16 followed by gradient clipping, "hook + clip via state" (``ddp_triton.clip_grad_norm_``
with the norm the unpack computed, ``grad_stats=True``) against "hook + torch clip"
(``torch.nn.utils.clip_grad_norm_``, which reads every gradient again)) runs with
``gradient_as_bucket_view`` off and on, on its own copy of the model, and is timed per step after warm-up (the
step is synchronised, so the time includes the all-reduces); the variants take turns in rounds, so that a slow
patch of the machine does not land on one of them. At world size 1 the all-reduce is nearly free and the
differences are the hooks' own cost. torch refuses bf16_compress_hook outside NCCL, so on gloo it is skipped.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddp_triton  # noqa: E402
from bench.common import append_results, environment, format_table, save_json  # noqa: E402
from ddp_triton.runtime.grad_stats import cannot_vouch  # noqa: E402
from ddp_triton.tune.processes import leave_process_group  # noqa: E402

#: max_norm of the clipping variants: a value the model's gradients exceed, so that every step scales them.
CLIP_MAX_NORM = 1e-3


def make_model(width: int, blocks: int) -> nn.Module:
    layers: List[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def init() -> torch.device:
    """Join torchrun's job, or make a job of one (a FileStore, so no port is needed)."""
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_method, store = "env://", None
    else:
        rank, world = 0, 1
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method=init_method)
    return device


def register(ddp: DDP, variant: str, notes: List[str]) -> Optional[Callable[[], None]]:
    """Attach the variant's hook; each triton variant gets its own state (one per model). Returns the clip the
    variant runs after each backward, if it clips."""
    if variant == "triton_hook_bf16_clip_state":  # "hook + clip via state"
        state = ddp_triton.register(ddp, comm_dtype=torch.bfloat16, grad_stats=True)
        checked: List[bool] = []

        def clip_via_state() -> None:
            if not checked:  # once: a fallback to torch's clip would time the wrong thing
                checked.append(True)
                reason = cannot_vouch(ddp, state)
                if reason is not None:
                    notes.append(f"triton_hook_bf16_clip_state fell back to torch's clip: {reason}")
            ddp_triton.clip_grad_norm_(ddp, CLIP_MAX_NORM, state=state)

        return clip_via_state
    if variant == "triton_hook_bf16_clip_torch":  # "hook + torch clip"
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16)
        return lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP_MAX_NORM)
    if variant == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "bf16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif variant == "triton_hook_bf16":
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16)
    elif variant == "triton_hook_fp32":
        ddp_triton.register(ddp, comm_dtype=torch.float32)
    elif variant == "triton_hook_bf16_fp32sum":  # bf16 on the wire, float32 sums (all-to-all + all-gather)
        ddp_triton.register(ddp, comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
    elif variant == "triton_hook_fp8":  # block-scaled E4M3 with error feedback
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn)
    elif variant == "triton_hook_fp8_no_ef":
        ddp_triton.register(ddp, comm_dtype=torch.float8_e4m3fn, error_feedback=False)
    elif variant != "no_hook":
        raise ValueError(f"unknown variant {variant}")
    return None


def time_steps(ddp: DDP, x: torch.Tensor, steps: int, warmup: int, device: torch.device,
               clip: Optional[Callable[[], None]] = None) -> List[float]:
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        ddp(x).float().square().mean().backward()
        if clip is not None:
            clip()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="DDP step time under each communication hook")
    p.add_argument("--steps", type=int, default=100, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=5, help="the variants take turns this many times")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--small", action="store_true", help="width 128, 2 blocks: a CPU smoke run")
    p.add_argument("--variants", default="no_hook,allreduce_hook,bf16_compress_hook,triton_hook_bf16,"
                                          "triton_hook_fp32,triton_hook_bf16_clip_state,triton_hook_bf16_clip_torch")
    p.add_argument("--no-results", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)

    device = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    width, blocks = (128, 2) if args.small else (1024, 12)
    torch.manual_seed(0)
    base = make_model(width, blocks).to(device)
    params = sum(q.numel() for q in base.parameters())
    x = torch.randn(args.batch, width, device=device)
    backend = str(dist.get_backend()).lower()

    # One untimed run first: the process's own first-use costs (allocator, kernels, threads) land here.
    warm = DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None)
    time_steps(warm, x, 1, args.warmup, device)
    del warm

    rows: List[Dict[str, Any]] = []
    notes = []
    for gabv in (False, True):
        models = []
        for variant in args.variants.split(","):
            if variant == "bf16_compress_hook" and backend != "nccl":
                notes.append(f"bf16_compress_hook skipped: torch allows it on NCCL only (backend {backend})")
                continue
            ddp = DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=gabv)
            clip = register(ddp, variant, notes)
            models.append((variant, ddp, clip, []))
        # Rounds, each variant in turn: a slow patch of the machine (clocks, another tenant) hits them all alike.
        for round_ in range(args.rounds):
            for _, ddp, clip, times in models:
                times += time_steps(ddp, x, max(1, args.steps // args.rounds), args.warmup if round_ == 0 else 2,
                                    device, clip)
        for variant, _, _, times in models:
            rows.append({"variant": variant, "gradient_as_bucket_view": gabv, "median_ms": statistics.median(times),
                         "min_ms": min(times), "steps": len(times)})
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()

    baseline = {r["gradient_as_bucket_view"]: r["median_ms"] for r in rows if r["variant"] == "no_hook"}
    for r in rows:
        base_ms = baseline.get(r["gradient_as_bucket_view"])
        r["vs_no_hook"] = r["median_ms"] / base_ms if base_ms else None

    if rank == 0:
        env = environment(device)
        env.update(world_size=world, backend=backend, parameters=params, batch=args.batch)
        table = format_table(["variant", "bucket view", "median ms", "min ms", "x no hook (same view)"],
                             [[r["variant"], r["gradient_as_bucket_view"], r["median_ms"], r["min_ms"],
                               r["vs_no_hook"]] for r in rows])
        path = save_json("ddp_step", {"env": env, "rows": rows, "notes": notes}, args.out_dir)
        print(f"{env}\n\n{table}\n\nsaved {path}")
        for n in sorted(set(notes)):
            print(n)
        if not args.no_results and device.type == "cuda":
            append_results(f"bench/ddp_step.py (world size {world}, {params / 1e6:.1f}M parameters, batch "
                           f"{args.batch})", env, [table], sorted(set(notes)))
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
