"""The DDP bucket size the cost model picks for each preset at 1, 4 and 16 nodes, beside DDP's default 25 MB.

    python -m bench.bucket_table                       # markdown table (docs/autotune.md's)
    python -m bench.bucket_table --nodes 1,2,8 --inter-node-gbps 25

For each preset and node count: ``ddp-triton autotune --model-only`` (``machine.profile.model_profile``, bfloat16 on
the wire, float32 gradients) with the model's size unknown (buckets capped at 64 MiB) and for a model of 1.5 billion
parameters (6 GiB of float32 gradients, capped at a quarter of that), the bucket's all-reduce (algorithm, busbw), and
what DDP's default 25 MiB bucket gets, each also with the host time a bucket costs counted against its all-reduce
(``--host-us-per-bucket``, autotune's default). Presets that describe no NICs get ``--inter-node-gbps`` (default
50 GB/s per node, 4 x 100 Gb/s), marked with *.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table  # noqa: E402
from ddp_triton.cli.args import csv_list, nonneg_float, positive_float  # noqa: E402
from ddp_triton.machine import cost_model as cm  # noqa: E402
from ddp_triton.machine.profile import DEFAULT_HOST_US_PER_BUCKET, MiB, model_profile  # noqa: E402
from ddp_triton.machine.topology import PRESETS, apply_launch_env, load_topology  # noqa: E402

DDP_DEFAULT_MB = 25.0
#: A 1.5-billion-parameter model's float32 gradients (GPT-2 XL's size): the table's second bucket column.
LARGE_MODEL_BYTES = 1_500_000_000 * 4


def _busbw_at(fabric: cm.Fabric, bucket_mb: float) -> cm.Estimate:
    """The all-reduce of one bucket of ``bucket_mb`` MiB of float32 gradients sent as bfloat16."""
    nbytes = int(bucket_mb * MiB) // 2 // 2 * 2
    return cm.best(fabric, nbytes, "bfloat16")


def rows(presets: List[str], nodes_list: List[int], inter_default: float,
         host_us: float = DEFAULT_HOST_US_PER_BUCKET) -> List[List[str]]:
    out = []
    for name in presets:
        for nodes in nodes_list:
            topo = load_topology(name)
            starred = nodes > 1 and not topo.inter_node_gbps
            topo = apply_launch_env(topo, nodes=nodes, inter_node_gbps=inter_default if starred else None, env={})
            fabric = cm.Fabric.from_topology(topo)
            if fabric.world_size == 1:
                out.append([name, str(nodes), "1", "25 (one rank)", "-", "-", "-", "-", "-"])
                continue
            cells, peak = [], None
            for model_bytes in (None, LARGE_MODEL_BYTES):
                bandwidth = model_profile(topo, model_bytes=model_bytes)
                with_host = model_profile(topo, model_bytes=model_bytes, host_us_per_bucket=host_us)
                peak = peak or max(r.busbw_gbps for r in bandwidth.sweep)
                e = _busbw_at(fabric, bandwidth.bucket_cap_mb)
                cells.append(f"{bandwidth.bucket_cap_mb:g} MiB: {e.algorithm}, {e.busbw_gbps:.0f} GB/s "
                             f"({e.busbw_gbps / peak:.0%})")
                cells.append(f"{with_host.bucket_cap_mb:g} MiB")
            ddp = _busbw_at(fabric, DDP_DEFAULT_MB)
            out.append([name, f"{nodes}{'*' if starred else ''}", str(fabric.world_size), *cells,
                        f"{ddp.algorithm}, {ddp.busbw_gbps:.0f} GB/s ({ddp.busbw_gbps / peak:.0%})",
                        f"{peak:.0f}"])
    return out


def markdown(table: List[List[str]], host_us: float = DEFAULT_HOST_US_PER_BUCKET) -> str:
    head = ["preset", "nodes", "ranks", "bucket, model size unknown", f"... with {host_us:g} us host per bucket",
            "bucket, 1.5B-parameter model", f"... with {host_us:g} us host per bucket", "DDP's 25 MiB bucket",
            "best busbw (1 GiB), GB/s"]
    return format_table(head, table)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench.bucket_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list, default=list(PRESETS), help="presets (default: all)")
    p.add_argument("--nodes", type=lambda s: [int(x) for x in csv_list(s)], default=[1, 4, 16],
                   help="node counts (1,4,16)")
    p.add_argument("--inter-node-gbps", type=positive_float, default=50.0,
                   help="GB/s per node for presets without NICs (50 = 4 x 100 Gb/s)")
    p.add_argument("--host-us-per-bucket", type=nonneg_float, default=DEFAULT_HOST_US_PER_BUCKET,
                   help=f"host time per bucket of the second columns (default {DEFAULT_HOST_US_PER_BUCKET:g}, the "
                        "H200's)")
    args = p.parse_args(argv)
    host_us = args.host_us_per_bucket
    print(markdown(rows(args.presets, args.nodes, args.inter_node_gbps, host_us), host_us))
    print(f"\nbfloat16 on the wire, float32 gradients; (n%) = busbw as a share of the best at 1 GiB; "
          f"* = no NIC rate in the preset, {args.inter_node_gbps:g} GB/s per node assumed; the 'with host' "
          f"columns count {host_us:g} us of host time per bucket against each all-reduce "
          "(autotune's default, --host-us-per-bucket).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
