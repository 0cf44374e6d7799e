"""torchft's fault-tolerant DDP step across replica groups: torchft's own float32 all-reduce against ours, and a group
killed mid-run.

    python -m bench.cluster --nodes 3 --procs-per-node 1 --link 200mbit -- python -m bench.torchft_step
    python -m bench.cluster --nodes 3 --procs-per-node 1 --link 200mbit -- python -m bench.torchft_step \\
        --variants fp8 --kill-node 2 --kill-step 20 --steps 60

One replica group per node (one rank each), each its own torchft Manager; node 0 also runs the lighthouse. Per
variant (``torchft``: ``torchft.ddp.DistributedDataParallel``, float32; ``bf16``: ours in bf16 + float32 sums;
``fp8``: ours in FP8 + error feedback) every node trains an MLP of ``--hidden`` (4.2M parameters by default) for
``--warmup`` + ``--steps`` steps and reports the median step time after warm-up and what its link (``eth0``) sent
and received per step, as the kernel counted it. With ``--kill-node N --kill-step S`` the trainer of node N runs as
a child process that is SIGKILLed once it committed S steps and started again 3 s later; every node then reports
the steps it lost (uncommitted steps) and the killed node the seconds from the kill until it took part again.

Inside the cluster's network namespaces the host name resolves to no node, so each node's Manager and checkpoint
server advertise the node's ``eth0`` address (torchft's HTTP transport names ``socket.gethostname()``: it is set to
that address in this process). Results: one JSON line per node and variant on stdout, and ``--out`` (a JSON file
per node).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

LIGHTHOUSE_PORT = 29610  # + the variant's index: each variant has its own lighthouse on node 0


def node_address() -> str:
    """This node's address towards node 0 (its eth0 in the emulated cluster)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))
        return s.getsockname()[0]


def link_bytes(iface: str) -> int:
    stats = Path("/sys/class/net") / iface / "statistics"
    try:
        return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())
    except OSError:
        return 0


def train(args: argparse.Namespace, variant: str, index: int, node: int, log: Path) -> Dict[str, Any]:
    """One replica group's run of ``variant``; a line per step in ``log``."""
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    address = node_address()
    socket.gethostname = lambda: address  # torchft's checkpoint server advertises this name
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.hidden, 2 * args.hidden), nn.ReLU(), nn.Linear(2 * args.hidden, args.hidden))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(sd: Dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                      min_replica_size=2, replica_id=f"node{node}", store_addr=address, store_port=store.port,
                      rank=0, world_size=1, hostname=address, timeout=timeout,
                      lighthouse_addr=f"http://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{LIGHTHOUSE_PORT + index}")
    if variant == "torchft":
        from torchft.ddp import DistributedDataParallel
        ddp = DistributedDataParallel(manager, model)
    else:
        from ddp_triton.integrations.torchft import DistributedDataParallel
        ddp = DistributedDataParallel(manager, model, comm_dtype={"bf16": "bf16+fp32sum", "fp8": "fp8e4m3+ef"}[variant])
    optimizer = OptimizerWrapper(manager, inner)
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(node))
    total = args.warmup + args.steps
    rows = []
    with open(log, "a", buffering=1) as out:
        while manager.current_step() < total:
            before, started, moved = manager.current_step(), time.time(), link_bytes(args.link_iface)
            optimizer.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            optimizer.step()
            row = {"t": time.time(), "s": time.time() - started, "before": before, "after": manager.current_step(),
                   "participants": manager.num_participants(), "bytes": link_bytes(args.link_iface) - moved,
                   "loss": loss.item()}
            out.write(json.dumps(row) + "\n")
            rows.append(row)
    manager.shutdown(wait=False)
    return {"rows": rows}


def summarize(rows: List[Dict[str, Any]], warmup: int) -> Dict[str, Any]:
    timed = [r for r in rows if r["before"] >= warmup and r["after"] == r["before"] + 1]
    return {"median_step_s": statistics.median(r["s"] for r in timed) if timed else None,
            "link_bytes_per_step": statistics.median(r["bytes"] for r in timed) if timed else None,
            "steps": len(rows), "lost_steps": sum(1 for r in rows if r["after"] != r["before"] + 1)}


def child_main(args: argparse.Namespace) -> None:
    train(args, args.child_variant, args.child_index, int(os.environ.get("GROUP_RANK", 0)), Path(args.child_log))
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="torchft,bf16,fp8", help="comma-separated: torchft, bf16, fp8")
    p.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024, help="the MLP's width: 4 * hidden^2 parameters")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--link-iface", default="eth0")
    p.add_argument("--kill-node", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--out", default="bench/out/torchft")
    p.add_argument("--child-variant", help=argparse.SUPPRESS)
    p.add_argument("--child-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-log", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_variant:
        return child_main(args)
    node = int(os.environ.get("GROUP_RANK", os.environ.get("RANK", 0)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from torchft._torchft import LighthouseServer
    results = {}
    for index, variant in enumerate(args.variants.split(",")):
        lighthouse = None
        if node == 0:
            lighthouse = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT + index}", min_replicas=2,
                                          join_timeout_ms=20000, heartbeat_timeout_ms=2000)
        log = out / f"{variant}-node{node}.jsonl"
        log.unlink(missing_ok=True)
        killed_at = None
        if node == args.kill_node:
            child = [sys.executable, "-m", "bench.torchft_step", *sys.argv[1:], "--child-variant", variant,
                     "--child-index", str(index), "--child-log", str(log)]
            proc = subprocess.Popen(child)
            while not (log.exists() and any(json.loads(line)["after"] >= args.kill_step
                                            for line in log.read_text().splitlines() if line.strip())):
                if proc.poll() is not None:
                    raise SystemExit(f"node {node}: the trainer exited ({proc.returncode}) before step "
                                     f"{args.kill_step}")
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = time.time()
            time.sleep(3.0)
            proc = subprocess.Popen(child)
            proc.wait()
            rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        else:
            rows = train(args, variant, index, node, log)["rows"]
        summary = {"variant": variant, "node": node, **summarize(rows, args.warmup)}
        if killed_at is not None:
            back = [r["t"] for r in rows if r["t"] > killed_at and r["after"] == r["before"] + 1
                    and r["participants"] >= 3]
            summary["seconds_until_back"] = back[0] - killed_at if back else None
        results[variant] = summary
        print(json.dumps(summary), flush=True)
        if lighthouse is not None:
            time.sleep(5.0)  # the others' last should_commit
            lighthouse.shutdown()
    (out / f"summary-node{node}.json").write_text(json.dumps(results, indent=1))
    os._exit(0)  # torchft's and gloo's threads: nothing left to wait for


if __name__ == "__main__":
    main()
