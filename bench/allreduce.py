"""All-reduce sweep through torch.distributed, in nccl-tests' layout, beside the cost model's prediction.

    torchrun --nproc_per_node=8 -m bench.allreduce -b 1K -e 1G --algorithms ring,tree,nvls --dtypes bfloat16,float32
    python -m bench.allreduce --backend gloo --nproc 2 -e 1M          # CPU processes, no GPU needed

Each point: ``--warmup`` all-reduces, then ``--iters`` timed one by one (CUDA events on GPU); the slowest rank's
median (``ddp_triton.tune.sweep.run_sweep``). ``algbw = bytes / time``, ``busbw = algbw * 2(n-1)/n`` (nccl-tests,
doc/PERFORMANCE.md). Algorithms are forced per process group with NCCL_ALGO (``ddp_triton.runtime.algo_groups``).

Output: a table per (algorithm, dtype) with columns size, count, type, time, algbw, busbw and the model's busbw;
``--json`` saves rows, versions and GPUs; ``--plot`` draws busbw against size with the model dashed beside it
(needs matplotlib: ``pip install ddp-triton[bench]``; skipped with a message otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import PLOT_MISSING, pyplot, write_json  # noqa: E402
from ddp_triton.cli.args import csv_list, nonneg_int, parse_size, positive_int  # noqa: E402
from ddp_triton.dtypes import normalize_dtype  # noqa: E402
from ddp_triton.machine import cost_model as cm  # noqa: E402
from ddp_triton.machine.profile import now_iso  # noqa: E402
from ddp_triton.machine.topology import TopologyError, apply_launch_env, load_topology  # noqa: E402
from ddp_triton.tune.autotune import default_algorithms  # noqa: E402
from ddp_triton.tune.processes import init_in_place, leave_process_group, spawn_local  # noqa: E402
from ddp_triton.tune.sweep import format_rows, run_sweep  # noqa: E402


def _bench_worker(config: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank: sweep and return the rows (the same on every rank)."""
    return run_sweep(config["sizes"], config["algorithms"], config["dtypes"], warmup=config["warmup"],
                     iters=config["iters"], progress=config["progress"])


def _topology(spec: Optional[str], world: int) -> Any:
    try:
        return apply_launch_env(load_topology(spec), world_size=world)
    except (TopologyError, ValueError) as e:
        if spec is not None:
            raise SystemExit(f"bench.allreduce: error: {e}") from None
        print(f"no topology for the model column: {e}", file=sys.stderr)
        return None


def add_model(rows: List[Dict[str, Any]], topo: Any) -> None:
    """Put the cost model's busbw (same size, algorithm and dtype) beside each row; None where it has none."""
    fabric = None
    if topo is not None:
        try:
            fabric = cm.Fabric.from_topology(topo)
        except ValueError as e:
            print(f"no model column: {e}", file=sys.stderr)
    for r in rows:
        r["model_busbw_gbps"] = None
        if fabric is not None:
            try:
                r["model_busbw_gbps"] = cm.estimate(fabric, r["bytes"], r["algorithm"], r["dtype"]).busbw_gbps
            except ValueError:
                pass


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> bool:
    """busbw against size per (algorithm, dtype), the model dashed; False (and a message) without matplotlib."""
    plt = pyplot()
    if plt is None:
        print(PLOT_MISSING)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["algorithm"], r["dtype"]) for r in rows})
    for i, (alg, dt) in enumerate(keys):
        pts = sorted((r["bytes"], r["busbw_gbps"], r["model_busbw_gbps"]) for r in rows
                     if (r["algorithm"], r["dtype"]) == (alg, dt))
        color = f"C{i % 10}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{alg} {dt} measured")
        model = [(p[0], p[2]) for p in pts if p[2] is not None]
        if model:
            ax.plot([m[0] for m in model], [m[1] for m in model], "--", color=color, label=f"{alg} {dt} model")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--min-bytes", type=parse_size, default=1 << 10, help="smallest size (1K)")
    p.add_argument("-e", "--max-bytes", type=parse_size, default=1 << 30, help="largest size (1G)")
    p.add_argument("--algorithms", type=csv_list, help="ring,tree,nvls,nvls_tree (default: what NCCL runs here)")
    p.add_argument("--dtypes", type=csv_list, default=["bfloat16", "float32"], help="dtypes (bfloat16,float32)")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="warm-up all-reduces per point (5)")
    p.add_argument("--iters", type=positive_int, default=20, help="timed all-reduces per point (20)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with GPUs, else gloo")
    p.add_argument("--nproc", type=positive_int, help="processes to spawn without torchrun (default: GPUs, or 1)")
    p.add_argument("--topology", help="preset or JSON file for the model column (default: NVML)")
    p.add_argument("--json", metavar="FILE", help="save rows, versions and GPUs as JSON")
    p.add_argument("--plot", metavar="FILE", help="save a busbw plot (PNG)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo")
    torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (
        args.nproc or (torch.cuda.device_count() if backend == "nccl" else 1))
    topo = _topology(args.topology, world)
    config = {"sizes": cm.default_sizes(args.min_bytes, args.max_bytes),
              "algorithms": args.algorithms or default_algorithms(topo, backend, args.dtypes[0]),
              "dtypes": [normalize_dtype(d) for d in args.dtypes], "warmup": args.warmup, "iters": args.iters,
              "progress": True}
    if torchrun or world == 1:
        created = init_in_place(backend)
        rows = _bench_worker(config)
        if created:
            leave_process_group()
        if torchrun and int(os.environ["RANK"]) != 0:
            return 0
    else:
        rows = spawn_local("bench.allreduce:_bench_worker", world, backend, (config,))
    add_model(rows, topo)
    title = f"all-reduce, {world} ranks, {backend}" + (f", {topo.name}" if topo is not None else "")
    print(f"# {title}")
    for alg in config["algorithms"]:
        for dt in config["dtypes"]:
            block = [r for r in rows if r["algorithm"] == alg and r["dtype"] == dt]
            if block:
                print(f"#\n# algorithm {alg}, {dt}")
                print(format_rows(block, world))
    if args.json:
        from ddp_triton.envinfo import collect_env

        doc = {"created": now_iso(), "backend": backend, "world_size": world, "warmup": args.warmup,
               "iters": args.iters, "topology": None if topo is None else {"name": topo.name,
                                                                             "fingerprint": topo.fingerprint()},
               "env": collect_env(), "rows": rows}
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot and plot(rows, args.plot, title):
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
