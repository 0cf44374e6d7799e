"""A complete small DDP training run with triton_hook: the minimal DDP example, plus the hook.

    torchrun --standalone --nproc_per_node=2 examples/train.py

NCCL on GPUs (one per process), gloo on CPU otherwise. The data is synthetic (a fixed random teacher network labels
random inputs) so the script needs no download, and the loss visibly falls. It shows the pieces a real job has:
DistributedSampler with set_epoch, gradient accumulation with no_sync, gradient clipping (with the norm the hook's
unpack computed), a checkpoint written from model.module on rank 0, the hook registered with one line, and at the
end one line of what the hook sent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddp_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
          "fp8e5m2": torch.float8_e5m2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank micro-batch size")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (no_sync between)")
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--comm-dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype on the wire (fp8: block-scaled, float32 sums, error feedback)")
    p.add_argument("--fp32-sums", action="store_true", help="bf16/fp16 on the wire, summed in float32")
    p.add_argument("--no-hook", action="store_true", help="plain DDP, for comparison")
    p.add_argument("--checkpoint", default="checkpoints/example.pt")
    return p.parse_args()


def setup() -> torch.device:
    """Join the job torchrun started: NCCL with one GPU per local rank when GPUs exist, else gloo on CPU."""
    if "RANK" not in os.environ:  # plain `python examples/train.py`: a job of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def synthetic_dataset(samples: int, features: int = 32, classes: int = 10) -> TensorDataset:
    """Inputs labelled by a fixed random teacher: every rank builds the same data from the same seed."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    y = (x @ teacher + 0.3 * torch.randn(samples, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    args = parse_args()
    device = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    dataset = synthetic_dataset(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    features = dataset.tensors[0].shape[1]
    model = nn.Sequential(
        nn.Linear(features, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden), nn.GELU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    state = None
    if not args.no_hook:  # grad_stats: the unpack also sums the squares of the averaged gradients, for the clip
        state = ddp_triton.register(ddp_model, comm_dtype=DTYPES[args.comm_dtype], grad_stats=True,
                                    accumulate_dtype=torch.float32 if args.fp32_sums else None)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        running, batches = 0.0, 0
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accumulate == 0
            # Skip the all-reduce on all but the last micro-batch of each optimizer step.
            with contextlib.nullcontext() if sync_now else ddp_model.no_sync():
                loss = loss_fn(ddp_model(x), y) / args.accumulate
                loss.backward()
            running += loss.item() * args.accumulate
            batches += 1
            if sync_now:
                # torch's clip_grad_norm_ with the norm the hook computed (torch's own without the hook)
                ddp_triton.clip_grad_norm_(ddp_model, args.clip, state=state)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
        if rank == 0:
            print(f"epoch {epoch}  steps {step}  loss {running / max(batches, 1):.4f}  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   args.checkpoint)
        print(f"saved {args.checkpoint} (world size {world_size}, {device.type}, "
              f"hook: {'none' if args.no_hook else 'triton_hook ' + args.comm_dtype})", flush=True)
        if state is not None:  # buckets, bytes on the wire per step against float32, algorithm per bucket
            print(state.summary().headline(), flush=True)
    dist.barrier()
    del ddp_model, optimizer, state
    gc.collect()  # gloo's threads end with their group, not at the process's exit (docs/troubleshooting.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
