"""A bucket's exchange per wire format and size, measured through the hook's path beside the cost model's time.

    python -m bench.cluster --nodes 2 --procs-per-node 2 --link 1gbit -- python -m bench.format_timing \
        --inter-gbps 0.125 --profile-out /tmp/tuned.json

Every rank times each (bucket size, format) with ``ddp_triton.tune.format_timing.time_formats`` (what ``ddp-triton
autotune --formats`` measures); rank 0 prints measured / model per row, the format chosen per size, and, with
``--profile-out``, writes the profile the measured choice makes (the hook follows it with ``comm_dtype="auto"``:
``python -m bench.ddp_step --variants triton_hook_auto --format-profile FILE``). The model is the emulated
cluster's fabric: ``--inter-gbps`` per node (the link's rate), ``--intra-gbps`` between the ranks of a node (gloo
over loopback: 0.44 GB/s measured on the 2-core machine of bench/RESULTS.md), PCIe-like hops, and the host cost of
CPU ranks (``cost_model.CPU_HOST_COST``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from bench.common import format_table, write_json  # noqa: E402
from ddp_triton.machine import cost_model as cm  # noqa: E402
from ddp_triton.machine.profile import (FormatRow, Profile, TableEntry, admitted_formats, format_bytes,  # noqa: E402
                                        format_choice)
from ddp_triton.machine.profile import MAX_ROUNDS  # noqa: E402
from ddp_triton.tune.format_timing import time_formats  # noqa: E402

DEFAULT_FORMATS = "fp32,bf16,bf16+fp32sum,fp8e4m3+ef,two-level bf16,two-level fp8e4m3+ef"
DEFAULT_SIZES = "262144,1048576,4194304,16777216"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated ({DEFAULT_FORMATS})")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="bucket sizes, gradient bytes, comma-separated")
    p.add_argument("--inter-gbps", type=float, required=True, help="each node's link, GB/s (1 Gbit/s: 0.125)")
    p.add_argument("--intra-gbps", type=float, default=0.44, help="between a node's ranks, GB/s (0.44)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed rounds per size at least (5); more until each "
                   "median is known within 5%%, within a 60 s budget (tune.format_timing)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here (rank 0)")
    p.add_argument("--profile-out", type=Path, help="write the profile of the measured choice here (rank 0)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = world // local
    fabric = cm.Fabric(ranks_per_node=local, nodes=nodes, intra_gbps=args.intra_gbps if local > 1 else 0.0,
                       inter_gbps=args.inter_gbps if nodes > 1 else 0.0, intra_link="pcie")
    allowed = [f.strip() for f in args.formats.split(",") if f.strip()]
    admitted, replaced = admitted_formats(allowed, world, nodes)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = time_formats(sizes, admitted, warmup=args.warmup, min_rounds=args.iters,
                        max_rounds=max(args.iters, MAX_ROUNDS), progress=False, fabric=fabric, host=cm.CPU_HOST_COST)
    if dist.get_rank() == 0:
        table = [[format_bytes(r["bytes"]), r["format"], f"{r['time_us'] / 1e3:.2f}", f"{r['model_us'] / 1e3:.2f}",
                  f"{r['time_us'] / r['model_us']:.2f}"] for r in rows]
        print(f"{local} ranks x {nodes} nodes, link {args.inter_gbps:g} GB/s per node, in-node {args.intra_gbps:g}")
        print(format_table(["bucket", "format", "measured ms", "model ms", "measured / model"], table))
        choice = format_choice("measured", allowed, [FormatRow.from_dict(r) for r in rows], replaced,
                               f"measured (gloo); model column: {cm.CPU_HOST_COST.source}")
        for r in choice.table:
            print(f"{format_bytes(r.min_bytes)} .. {'inf' if r.max_bytes is None else format_bytes(r.max_bytes)}: "
                  f"{r.format} ({r.reason})")
        if args.out:
            write_json(args.out, {"world_size": world, "nodes": nodes, "inter_gbps": args.inter_gbps,
                                  "intra_gbps": args.intra_gbps, "rows": rows})
        if args.profile_out:
            Profile(source="measured", backend="gloo", world_size=world, nodes=nodes, comm_dtype="bfloat16",
                    bucket_cap_mb=25.0, table=[TableEntry(0, None, "ring")], formats=choice,
                    bucket_reason="DDP's default", notes=["bench.format_timing"]).save(args.profile_out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
