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
import functools
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import ddp_triton.fsdp  # noqa: E402
from bench.common import environment, format_table, save_json  # noqa: E402
from bench.ddp_models import make_model  # noqa: E402
from bench.ddp_step import init, take_turns, time_steps  # noqa: E402

#: ``triton_fp8_bf16_reduce``: FP8 with FSDP's reduce dtype bfloat16 (mixed precision: our reduce-scatter is handed
#: bf16 gradients and writes the bf16 shard).
VARIANTS = ("fsdp_float32", "fsdp_bf16_reduce", "triton_bf16_fp32sum", "triton_fp8", "triton_fp8_bf16_reduce")
#: HSDP over nodes x local ranks: FSDP2's native HSDP (float32, or both hops in bf16), and ours (float32 in the node,
#: bf16 with float32 sums between nodes; or bf16 with float32 sums on both hops; or FP8 with error feedback between
#: nodes).
HSDP_VARIANTS = ("hsdp_float32", "hsdp_bf16_reduce", "hsdp_triton_bf16_fp32sum", "hsdp_triton_bf16_fp32sum_both",
                 "hsdp_triton_fp8")


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

    timers = [(v, functools.partial(time_steps, sharded(base, v), loss, device=device)) for v in variants]
    rows = take_turns(timers, args.rounds, args.steps, args.warmup, 1, args.link_iface)
    env = dict(environment(device), world_size=dist.get_world_size(), backend=str(dist.get_backend()),
               parameters=sum(q.numel() for q in base.parameters()), batch=args.batch)
    if dist.get_rank() == 0:
        print(env)
        headers = ["variant", "median ms", "min ms"] + (["node link MB sent per step"] if args.link_iface else [])
        print(format_table(headers, [[r["variant"], f"{r['median_ms']:.0f}", f"{r['min_ms']:.0f}"]
                                     + ([f"{r['node_link_tx_bytes_per_step'] / 1e6:.1f}"] if args.link_iface else [])
                                     for r in rows]))
        print(f"saved {save_json('fsdp_step', {'env': env, 'rows': rows}, args.out_dir)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
