"""One rank of one replica group, for tests/integrations/test_torchft.py and bench: a tiny model trained under a real
torchft Manager, with torchft's DDP or ours, logging each step to a file.

    python tests/integrations/torchft_replica.py --lighthouse http://host:port --replica 1 --out DIR [...]

Rank 0 of a group starts the group's TCPStore (port 0) and writes its port to ``DIR/store<replica>``; the group's
other ranks read it there. Each rank appends one JSON line per step to ``DIR/r<replica>_<rank>.log``: the manager's
step before and after, whether it committed, the loss, the participants, the time, and a digest of this rank's
error-feedback residuals before and after the step. At the end it writes its parameters to ``DIR/r<replica>_<rank>.pt``.
``--die-in-hook STEP``: the rank SIGKILLs itself during the backward of that step, after the step's first bucket
went out and before its last (a peer lost between the hook and the optimizer's step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

IN, HIDDEN, OUT, BATCH = 16, 64, 8, 32


def residual_digest(model) -> str:
    """A hash of every live residual tensor of ours (empty without error feedback), in a fixed order."""
    state = getattr(model, "comm_state", None)
    if state is None:
        return ""
    h = hashlib.sha256()
    for key in sorted(state.residuals.layouts, key=str):
        held = state.residuals.layouts[key]
        for t in (held.first, held.second):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # any dtype's bits
    return h.hexdigest()[:16]


def params_digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def batch(step: int, replica: int, rank: int):
    gen = torch.Generator().manual_seed(1000003 * step + 7919 * replica + rank)
    x = torch.randn(BATCH, IN, generator=gen)
    teacher = torch.Generator().manual_seed(5)
    w = torch.randn(IN, OUT, generator=teacher)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(BATCH, OUT, generator=gen)


def wait_file(path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)
    return path.read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1, help="ranks per replica group")
    ap.add_argument("--impl", choices=("ours", "torchft"), default="ours")
    ap.add_argument("--comm", default="fp8e4m3+ef", help="ours: a wire format's name, or bf16+fp32sum, fp32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--barrier", type=int, default=0, help="wait for this many ready files before the first step")
    ap.add_argument("--die-in-hook", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=10.0, help="collectives' and the manager's timeout, seconds")
    ap.add_argument("--pace", type=float, default=0.0,
                    help="seconds each step waits while the file DIR/pace exists (a driver paces the job with it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    store_file = out / f"store{args.replica}"
    if args.rank == 0:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        (out / f"store{args.replica}.tmp").write_text(str(store.port))
        os.replace(out / f"store{args.replica}.tmp", store_file)
    else:
        store = dist.TCPStore("localhost", int(wait_file(store_file, 60)), is_master=False, wait_for_workers=False)
    port = store.port
    if args.ranks > 1:  # the replica group's own ranks: its default group, on the group's store
        dist.init_process_group("gloo", store=dist.PrefixStore("inner", store), rank=args.rank,
                                world_size=args.ranks)

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                           nn.Linear(HIDDEN, OUT))
    inner = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd):
        module.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"replica_{args.replica}",
                      store_addr="localhost", store_port=port, rank=args.rank, world_size=args.ranks,
                      lighthouse_addr=args.lighthouse, timeout=timeout, quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=30))
    # Two buckets (the last layer's apart), so that a rank can die between a step's first bucket and its last.
    if args.impl == "ours":
        from ddp_triton.integrations.torchft import DistributedDataParallel
        model = DistributedDataParallel(manager, module, comm_dtype=args.comm, bucket_cap_mb=0.01)
    else:
        from torchft.ddp import DistributedDataParallel
        model = DistributedDataParallel(manager, module, bucket_cap_mb=0.01)
    optimizer = OptimizerWrapper(manager, inner)
    if args.die_in_hook >= 0:
        def die(grad):
            if manager.current_step() == args.die_in_hook:
                time.sleep(0.2)  # the first bucket's exchange under way on every rank
                os.kill(os.getpid(), signal.SIGKILL)
            return grad
        module[0].weight.register_hook(die)
    (out / f"ready{args.replica}_{args.rank}").write_text("1")
    if args.barrier:
        deadline = time.monotonic() + 120
        while len(list(out.glob("ready*"))) < args.barrier:
            if time.monotonic() > deadline:
                raise TimeoutError("the other replicas did not start")
            time.sleep(0.05)
    log = open(out / f"r{args.replica}_{args.rank}.log", "a", buffering=1)
    loss_fn = nn.MSELoss()
    while manager.current_step() < args.steps:
        if args.pace and (out / "pace").exists():
            time.sleep(args.pace)
        before, digest = manager.current_step(), residual_digest(model)
        optimizer.zero_grad()
        x, y = batch(manager.current_step(), args.replica, args.rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        after, error = manager.current_step(), manager.errored()
        log.write(json.dumps({"t": time.time(), "before": before, "after": after, "committed": after == before + 1,
                              "loss": loss.item(), "participants": manager.num_participants(),
                              "errored": None if error is None else repr(error.original_exception)[:300],
                              "res_before": digest,
                              "res_after": residual_digest(model), "params": params_digest(module),
                              "pid": os.getpid()}) + "\n")
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    torch.save(params, out / f"r{args.replica}_{args.rank}.pt")
    log.write(json.dumps({"done": True, "t": time.time()}) + "\n")
    log.close()
    sys.stdout.flush()
    os._exit(0)  # torchft's threads (quorum, checkpoint server) and gloo's: nothing left to wait for


if __name__ == "__main__":
    main()
