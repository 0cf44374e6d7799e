"""A fault-tolerant training run with torchft, whose replica groups exchange gradients in ddp-triton's wire formats.

Start a lighthouse, then each replica group (here one process each, on one machine; any of them may die and come back):

    torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 10000
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=0 torchrun --master_port 29600 \\
        --nnodes 1 --nproc_per_node 1 examples/torchft_train.py --comm fp8
    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=1 torchrun --master_port 29601 \\
        --nnodes 1 --nproc_per_node 1 examples/torchft_train.py --comm fp8

Each replica group is its own torchrun job (its own store and ranks); ``--nproc_per_node 2`` gives a group two ranks,
which average among themselves in float32 over their own group first. The loop is torchft's own, with one import
changed: ``ddp_triton.integrations.torchft.DistributedDataParallel`` for ``torchft.ddp.DistributedDataParallel``.
Kill a group (Ctrl-C, SIGKILL) and start it again: the others go on, and it heals from one of them. The data is
synthetic (a fixed random teacher labels random inputs, a different stream per group and rank), so the loss falls.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torchft import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from ddp_triton.integrations.torchft import DistributedDataParallel

FORMATS = {"bf16": "bf16+fp32sum", "fp8": torch.float8_e4m3fn, "fp4": "fp4e2m1+ef", "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--comm", choices=sorted(FORMATS), default="fp8", help="wire format between replica groups")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a step may commit with")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, ranks = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    if ranks > 1:  # the replica group's own ranks (torchrun's store)
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # every group starts alike; torchft syncs the first step anyway
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=args.min_replicas, replica_id=f"train_{group_id}",
                      timeout=timedelta(seconds=10))
    ddp_model = DistributedDataParallel(manager, model, comm_dtype=FORMATS[args.comm])  # the one line that changes
    optimizer = OptimizerWrapper(manager, inner)
    teacher = nn.Linear(32, 8)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(1))
    while manager.current_step() < args.steps:
        gen = torch.Generator().manual_seed(manager.current_step() * 1000 + group_id * 10 + rank)
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        optimizer.zero_grad()  # starts the quorum
        loss = nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()  # the exchange between replica groups, in the chosen format
        optimizer.step()  # steps only if every group's exchange went through (should_commit)
        if manager.current_step() % 20 == 0 and rank == 0:
            print(f"group {group_id} step {manager.current_step()}: loss {loss.item():.4f}, "
                  f"{manager.num_participants()} groups taking part", flush=True)
    if rank == 0:
        print(f"group {group_id} done: {ddp_model.comm_state.wire_setting} between groups", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
