"""The same small training run with FSDP2 (``fully_shard``) and ddp-triton's reduce-scatter.

    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py                   # bf16 on the wire, float32 sums
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py --comm-dtype fp8  # FP8 with error feedback

NCCL on GPUs (one per process), gloo on CPU otherwise; the synthetic data of ``examples/train.py``. Each Linear is
an FSDP group of its own, then the root; ``ddp_triton.fsdp.register`` sets our reduce-scatter on all of them. At
the end each rank saves its shard of the model and its own error-feedback residuals (FP8), as a sharded job saves.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import ddp_triton.fsdp
from train import setup, synthetic_dataset

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--comm-dtype", choices=sorted(DTYPES), default="bf16",
                   help="on the wire: bf16 (float32 sums), fp8 (block-scaled, error feedback), fp32 (FSDP2's own)")
    p.add_argument("--checkpoint-dir", default="checkpoints/fsdp")
    args = p.parse_args()
    device = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    dataset = synthetic_dataset(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)  # the same initial weights everywhere: FSDP2 shards what each rank holds
    features = dataset.tensors[0].shape[1]
    model = nn.Sequential(
        nn.Linear(features, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden), nn.GELU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm_dtype = DTYPES[args.comm_dtype]
    state = ddp_triton.fsdp.register(model, comm_dtype=comm_dtype,
                                     accumulate_dtype=None if comm_dtype == torch.float32 else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        running, batches = 0.0, 0
        for x, y in loader:
            loss = loss_fn(model(x.to(device)), y.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            running += loss.item()
            batches += 1
        if rank == 0:
            print(f"epoch {epoch}  steps {batches * (epoch + 1)}  loss {running / max(batches, 1):.4f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    shard = {name: p.to_local().clone() for name, p in model.named_parameters()}  # this rank's shard
    torch.save({"model_shard": shard, "residuals": state.state_dict()},
               os.path.join(args.checkpoint_dir, f"rank{rank}.pt"))
    if rank == 0:
        print(f"saved {args.checkpoint_dir}/rank*.pt (world size {world_size}, {device.type}, FSDP2 with "
              f"{state.wire.name} on the wire, {state.calls} reduce-scatters of ours)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
