"""FSDP2 step time and bytes per step: FSDP2's own reduce-scatter (float32, or ``reduce_dtype=torch.bfloat16``)
against ours (``ddp_triton.fsdp.register``: bf16 on the wire with float32 sums, or FP8 with error feedback).

    python -m bench.fsdp_step --small --steps 2                      # a CPU smoke run, world size 1
    python -m bench.cluster --nodes 2 --procs-per-node 2 --link 1gbit -- python -m bench.fsdp_step --blocks 3 \
        --batch 1 --steps 9 --rounds 3 --link-iface eth0
    ... --variants hsdp_float32,hsdp_bf16_reduce,hsdp_triton_bf16_fp32sum   # HSDP: replicas = nodes

The MLP of ``bench.ddp_models`` (blocks of Linear(w, 4w) - GELU - Linear(4w, w)), each Linear sharded with
``fully_shard`` over all ranks, then the root. Each variant trains its own copy; the variants take turns in rounds
(a slow patch of the machine hits them all alike), the median step time per variant is reported, and with
``--link-iface`` each node's link bytes per step from the kernel's counters (rounds after the first). Every
variant's parameters are all-gathered in float32 in forward and backward alike: only the reduce-scatter differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import ddp_triton.fsdp  # noqa: E402
from bench.common import environment, format_table  # noqa: E402
from bench.ddp_models import make_model  # noqa: E402
from bench.ddp_step import init, link_bytes, node_link_per_step, sync  # noqa: E402

#: ``triton_fp8_bf16_reduce``: FP8 with FSDP's reduce dtype bfloat16 (mixed precision: our reduce-scatter is handed
#: bf16 gradients and writes the bf16 shard).
VARIANTS = ("fsdp_float32", "fsdp_bf16_reduce", "triton_bf16_fp32sum", "triton_fp8", "triton_fp8_bf16_reduce")
#: HSDP over nodes x local ranks: FSDP2's native HSDP (float32, or both hops in bf16), and ours (float32 in the node,
#: bf16 with float32 sums between nodes; or bf16 with float32 sums on both hops; or FP8 with error feedback between
#: nodes).
HSDP_VARIANTS = ("hsdp_float32", "hsdp_bf16_reduce", "hsdp_triton_bf16_fp32sum", "hsdp_triton_bf16_fp32sum_both",
                 "hsdp_triton_fp8")
OUT_DIR = Path(__file__).resolve().parent / "out"


def sharded(base: nn.Module, variant: str) -> nn.Module:
    """A copy of ``base`` sharded over every rank, with the variant's reduce-scatter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if variant not in VARIANTS + HSDP_VARIANTS:
        raise ValueError(f"unknown variant {variant}; known: {', '.join(VARIANTS + HSDP_VARIANTS)}")
    model = copy.deepcopy(base)
    device = next(model.parameters()).device
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if variant in HSDP_VARIANTS:  # replicas are the nodes, shards the ranks of a node
        mesh2d = init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))
        mesh = mesh2d["shard"] if variant.startswith("hsdp_triton") else mesh2d
    else:
        mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if variant.endswith("bf16_reduce") else None
    kwargs: Dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if variant == "triton_bf16_fp32sum":
        ddp_triton.fsdp.register(model)
    elif variant in ("triton_fp8", "triton_fp8_bf16_reduce"):  # block-scaled E4M3 with error feedback
        ddp_triton.fsdp.register(model, comm_dtype=torch.float8_e4m3fn)
    elif variant == "hsdp_triton_bf16_fp32sum":
        ddp_triton.fsdp.register(model, comm_dtype=torch.float32, accumulate_dtype=None,
                                 replicate_group=mesh2d.get_group("replicate"))
    elif variant == "hsdp_triton_bf16_fp32sum_both":
        ddp_triton.fsdp.register(model, replicate_group=mesh2d.get_group("replicate"))
    elif variant == "hsdp_triton_fp8":  # float32 in the node, FP8 with error feedback between nodes
        ddp_triton.fsdp.register(model, comm_dtype=torch.float32, accumulate_dtype=None,
                                 replicate_group=mesh2d.get_group("replicate"),
                                 replicate_comm_dtype=torch.float8_e4m3fn)
    return model


def timer(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor],
          device: torch.device) -> Callable[[int, int], List[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(steps: int, warmup: int) -> List[float]:
        times = []
        for i in range(warmup + steps):
            sync(device)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss(model).backward()
            opt.step()
            sync(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
        return times

    return run


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--blocks", type=int, default=3, help="MLP blocks of width 1024 (3: 25.2M parameters)")
    p.add_argument("--small", action="store_true", help="width 128, 2 blocks: a CPU smoke run")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=9, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--link-iface", default=None,
                   help="count this node's interface bytes per step (eth0 in bench.cluster)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS + HSDP_VARIANTS))
    if unknown or args.steps < 1 or args.rounds < 1 or args.blocks < 1:
        p.error(f"unknown variants {unknown}" if unknown else "--steps, --rounds and --blocks must be at least 1")
    device = init()
    width, blocks = (128, 2) if args.small else (1024, args.blocks)
    torch.manual_seed(0)
    base = make_model(width, blocks).to(device)
    x = torch.randn(args.batch, width, device=device)

    def loss(model: nn.Module) -> torch.Tensor:
        return model(x).float().square().mean()

    runs = [(v, timer(sharded(base, v), loss, device), []) for v in variants]
    link = {v: [0, 0, 0] for v in variants}
    for round_ in range(args.rounds):
        for variant, run, times in runs:
            steps, warmup = max(1, args.steps // args.rounds), args.warmup if round_ == 0 else 1
            counted = args.link_iface if round_ > 0 or args.rounds == 1 else None
            before = link_bytes(counted)
            times += run(steps, warmup)
            after = link_bytes(counted)
            if counted:
                link[variant] = [link[variant][0] + after[0] - before[0], link[variant][1] + after[1] - before[1],
                                 link[variant][2] + steps + warmup]
    rows = []
    for variant, _, times in runs:
        row: Dict[str, Any] = {"variant": variant, "median_ms": statistics.median(times), "min_ms": min(times),
                               "steps": len(times)}
        if args.link_iface:
            row.update(node_link_per_step(*link[variant]))
        rows.append(row)
    env = dict(environment(device), world_size=dist.get_world_size(), backend=str(dist.get_backend()),
               parameters=sum(q.numel() for q in base.parameters()), batch=args.batch)
    if dist.get_rank() == 0:
        print(env)
        headers = ["variant", "median ms", "min ms"] + (["node link MB sent per step"] if args.link_iface else [])
        print(format_table(headers, [[r["variant"], f"{r['median_ms']:.0f}", f"{r['min_ms']:.0f}"]
                                     + ([f"{r['node_link_tx_bytes_per_step'] / 1e6:.1f}"] if args.link_iface else [])
                                     for r in rows]))
        out_dir = Path(args.out_dir) if args.out_dir else OUT_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"fsdp_step-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str) + "\n")
        print(f"saved {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
