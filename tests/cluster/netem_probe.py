"""A rank program for tests/cluster/test_netem.py, started by ``python -m bench.cluster`` on every rank.

    python tests/cluster/netem_probe.py env                                    # no torch: the launch variables
    python tests/cluster/netem_probe.py allreduce --numel 2097152 --dtypes float32,bfloat16 --iters 3
    python tests/cluster/netem_probe.py pingpong --iters 20                    # rank 0 <-> the last rank, 4 bytes
    python tests/cluster/netem_probe.py send --bytes 4194304 --ready-file F    # no torch: rank 0 -> the last rank, TCP
    python tests/cluster/netem_probe.py fail --code 3                          # exit 3 (rank 1), others sleep
    python tests/cluster/netem_probe.py sleep --seconds 60                     # prints its pid, then sleeps
    python tests/cluster/netem_probe.py two-level                              # hierarchical=True vs its reference

Each rank prints one line ``PROBE {json}``; the test reads them from bench.cluster's output. Times are wall-clock
seconds per collective, measured after a barrier so that the ranks start it together.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def report(**fields) -> None:
    print("PROBE " + json.dumps(fields), flush=True)


def init():
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://, as torchrun's workers do
    return dist


def leave(dist) -> None:
    dist.barrier()
    # Leave without tearing gloo down: its teardown is not what is tested here (tests/dist_utils.py says why).
    sys.stdout.flush()
    os._exit(0)


def allreduce(args) -> None:
    import torch

    dist = init()

    def timed() -> dict:
        out = {}
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            t = torch.ones(args.numel, dtype=dtype)
            dist.all_reduce(t)  # warm-up: connections, buffers
            times = []
            for _ in range(args.iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            out[name] = times
        return out

    out = timed()
    after = None
    if args.rate_after:  # the links change rate mid-job (bench.cluster's link control), then the same again
        if dist.get_rank() == 0:
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            from bench.cluster.control import request_rate  # the repository's bench, beside tests/

            request_rate(args.rate_after)
        dist.barrier()
        after = timed()
    report(rank=dist.get_rank(), world=dist.get_world_size(), numel=args.numel, times=out, times_after=after)
    leave(dist)


def pingpong(args) -> None:
    import torch

    dist = init()
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    t = torch.zeros(1, dtype=torch.float32)
    rtts = []
    for i in range(args.iters + 2):  # the first two warm the connection up
        if rank == 0:
            start = time.perf_counter()
            dist.send(t, last)
            dist.recv(t, last)
            if i >= 2:
                rtts.append(time.perf_counter() - start)
        elif rank == last:
            dist.recv(t, 0)
            dist.send(t, 0)
    report(rank=rank, rtts=rtts)
    leave(dist)


def send(args) -> None:
    """Rank 0 sends exactly ``--bytes`` bytes to the last rank over one TCP connection, so that nothing crosses the
    link but that connection's segments (and the ARP that finds the peer). Rank 0 listens on
    MASTER_ADDR:MASTER_PORT and then creates ``--ready-file``; the last rank connects once that file exists (the
    nodes share the filesystem), so no refused attempt adds traffic. Each side stops only when the other has
    closed: every byte has crossed the link before either process exits."""
    rank, last = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]) - 1
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if rank == 0:
        with socket.create_server(addr) as server:
            open(args.ready_file, "x").close()
            conn, _ = server.accept()
        with conn:
            conn.sendall(bytes(args.bytes))
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(1 << 16):  # until the receiver closes: it has everything
                pass
        report(rank=rank, sent=args.bytes)
    elif rank == last:
        deadline = time.monotonic() + 30
        while not os.path.exists(args.ready_file):
            if time.monotonic() > deadline:
                sys.exit(f"rank 0 did not listen within 30 s ({args.ready_file} missing)")
            time.sleep(0.01)
        received = 0
        with socket.create_connection(addr, timeout=30) as conn:
            while True:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                received += len(chunk)
        report(rank=rank, received=received)


def two_level() -> None:
    """Train under DDP with hierarchical=True, nodes as torchrun gives them, every step against the reference of
    tests/dist/runtime/test_two_level.py (which raises on the first difference); report the state's node groups."""
    import torch

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [tests, os.path.join(tests, "dist", "runtime")]
    from test_two_level import check_against_reference

    dist = init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nodes = []
    for options in (dict(comm_dtype=torch.float8_e4m3fn), dict(comm_dtype=torch.bfloat16)):
        state = check_against_reference(rank, world_size, options, 0.004)
        groups = state.context.nodes
        nodes.append([groups.n_nodes, groups.local_size, groups.node_index, groups.local_index])
    report(rank=rank, same_bits=True, nodes=nodes, wire=state.wire.name)
    leave(dist)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("env", "allreduce", "pingpong", "send", "fail", "sleep", "two-level"))
    p.add_argument("--numel", type=int, default=1 << 21, help="elements per all-reduce, in every dtype")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rate-after", help="allreduce: then set every link to this rate and time them again")
    p.add_argument("--bytes", type=int, default=4 << 20, help="what rank 0 sends to the last rank")
    p.add_argument("--ready-file", help="send: rank 0 creates it once it listens (a new path)")
    p.add_argument("--code", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60)
    args = p.parse_args()
    if args.mode == "two-level":
        two_level()
    elif args.mode == "env":
        report(pid=os.getpid(), **{k: os.environ.get(k) for k in LAUNCH_VARS})
    elif args.mode == "allreduce":
        allreduce(args)
    elif args.mode == "pingpong":
        pingpong(args)
    elif args.mode == "send":
        if not args.ready_file:
            p.error("send needs --ready-file")
        send(args)
    elif args.mode == "fail":
        report(pid=os.getpid(), rank=os.environ.get("RANK"))
        if os.environ.get("RANK") == "1":
            sys.exit(args.code)
        time.sleep(args.seconds)
    else:
        report(pid=os.getpid(), rank=os.environ.get("RANK"))
        time.sleep(args.seconds)


if __name__ == "__main__":
    main()
