"""``ddp-triton autotune``: check the usage and every output first, then model or measure, then write the profile.

``--model-only`` asks the cost model (no GPU), calibrated with ``--calibration PROFILE`` (a measured profile's
fitted factors, e.g. one node's, to predict K nodes); ``--wire-formats`` adds the predicted time of each wire format
per bucket size. Otherwise the workers of ``ddp_triton.tune.autotune`` time all-reduces or DDP steps on one process
per local GPU (``tune.processes.spawn_local``), or in place under torchrun. torch and the tuner are imported by
the functions that measure, not here: the cost model's path starts without torch or Triton.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import COMM_DTYPE_NAMES, dtype_size, normalize_dtype
from ..formats import TRAFFIC, WireFormat
from ..log import warn_once
from ..machine import cost_model as cm
from ..machine import profile as profiles
from ..machine.cost_model import default_sizes
from ..machine.profile import MiB as MIB
from ..machine.profile import DEFAULT_BUDGET_S, DEFAULT_REL_ERROR, Profile, ProfileError
from ..machine.topology import TopologyError, apply_launch_env, load_topology, under_torchrun
from ..tune.e2e_hooks import E2E_HOOKS
from ..versions import nccl_version
from .args import EXIT_FAILED, EXIT_OK, UsageError
from .outputs import check_outputs, emit


def _launch_topology(args: argparse.Namespace, world_size: Optional[int], required: bool) -> Any:
    """The topology as launched (nodes, ranks per node), or None when it is unknown and not required."""
    try:
        topo = load_topology(args.topology)
    except TopologyError as e:
        if required or args.topology is not None:
            raise UsageError(str(e)) from None
        warn_once(f"topology unknown ({e}); the profile gets no fingerprint, so the hook will not find it in the "
                  "cache: pass --topology, and use --out to keep it")
        return None
    _check_world_fits(topo, args, world_size)
    try:
        return apply_launch_env(topo, nodes=args.nodes, world_size=world_size, inter_node_gbps=args.inter_node_gbps)
    except (TopologyError, ValueError) as e:
        raise UsageError(str(e)) from None


def _check_world_fits(topo: Any, args: argparse.Namespace, world_size: Optional[int]) -> None:
    """A world size the topology's GPUs per node cannot hold over the nodes given, named in the flags' words (the
    library's own error speaks of its ``nodes=`` argument). Node counts from the launcher are left to it."""
    if world_size is None or (args.nodes is None and "LOCAL_WORLD_SIZE" in os.environ):
        return
    nodes = args.nodes if args.nodes is not None else topo.nodes
    have = topo.gpus_per_node
    if world_size % nodes or world_size // nodes <= have:
        return
    fits = next(n for n in range(-(-world_size // have), world_size + 1) if world_size % n == 0)
    given = f"--nodes {args.nodes}" if args.nodes is not None else f"{nodes} node(s)"
    other = " (or a smaller --world-size)" if args.world_size is not None else ""
    raise UsageError(f"world size {world_size} over {given} needs {world_size // nodes} GPUs per node, but topology "
                     f"{topo.name!r} has {have}: pass --nodes {fits}{other}")


def _sizes(args: argparse.Namespace, comm_dtype: str) -> List[int]:
    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    try:
        sizes = default_sizes(args.min_bytes, args.max_bytes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sizes[-1] < dtype_size(comm_dtype):
        raise UsageError(f"--max-bytes {args.max_bytes} is less than one {comm_dtype} element")
    return sizes


def _check_tuner_csv(args: argparse.Namespace, topo: Any, backend: str) -> None:
    """Before measuring: can the measured profile become NCCL's tuner CSV? It needs the cost model's protocol per
    range, hence an NCCL measurement and a topology the model can describe."""
    if not args.nccl_tuner_csv:
        return
    if backend != "nccl":
        raise UsageError(f"--nccl-tuner-csv needs NCCL's protocols; backend {backend} has none (use --backend nccl, "
                         "or --model-only)")
    if topo is None:
        raise UsageError("--nccl-tuner-csv needs a protocol per range, guessed by the cost model from the topology: "
                         "pass --topology")
    try:
        cm.Fabric.from_topology(topo)
    except ValueError as e:
        raise UsageError(f"--nccl-tuner-csv needs the cost model's protocols: {e}") from None


def _common_profile_kwargs(args: argparse.Namespace) -> dict:
    return {"fraction": args.fraction, "model_bytes": args.model_bytes, "min_buckets": args.min_buckets,
            "host_us_per_bucket": args.host_us_per_bucket}


def cmd_autotune(args: argparse.Namespace) -> int:
    """``ddp-triton autotune``: check the usage and every output, then model or measure, then write."""
    try:
        comm_dtype = normalize_dtype(args.comm_dtype)
        dtypes = [normalize_dtype(d) for d in args.dtypes] if args.dtypes else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if comm_dtype not in COMM_DTYPE_NAMES:
        raise UsageError(f"--comm-dtype {args.comm_dtype}: the hook all-reduces in {', '.join(COMM_DTYPE_NAMES)} "
                         "only (--dtypes may time others)")
    if args.algorithms:
        bad = [a for a in args.algorithms if a not in cm.ALGORITHMS]
        if bad:
            raise UsageError(f"unknown algorithm(s) {bad}; known: {', '.join(cm.ALGORITHMS)}")
    bad_hooks = [h for h in args.hooks if h not in E2E_HOOKS]
    if bad_hooks:
        raise UsageError(f"unknown hook(s) {bad_hooks}; known: {', '.join(E2E_HOOKS)}")
    modes = [m for m, on in (("--model-only", args.model_only), ("--e2e", args.e2e)) if on]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} exclude each other")
    for flag, on, why in (("--calibration", args.calibration is not None, "a measurement calibrates itself"),
                          ("--wire-formats", args.wire_formats, "the table is the cost model's"),
                          ("--host-cost", args.host_cost is not None, "a measurement times the host")):
        if on and not args.model_only:
            raise UsageError(f"{flag} is for --model-only ({why})")
    _check_formats(args)
    check_outputs(args)  # before modelling or measuring: an output that cannot be written fails now
    if args.model_only:
        return _autotune_model(args, comm_dtype)
    return _autotune_distributed(args, comm_dtype, dtypes)


def _check_formats(args: argparse.Namespace) -> None:
    """``--formats``: every name a wire format, no e2e mode, and bucket sizes to choose at; its timing flags only
    where formats are timed."""
    timing_flags = [f for f, v in (("--format-error", args.format_error), ("--format-budget", args.format_budget))
                    if v is not None]
    if timing_flags and (args.formats is None or args.model_only):
        raise UsageError(f"{' and '.join(timing_flags)} are for --formats in measure mode (they bound the timing "
                         "of each format)")
    if args.formats is None:
        if args.host_cost is not None:
            raise UsageError("--host-cost is for --formats (the host cost the model adds per bucket)")
        return
    if args.e2e:
        raise UsageError("--formats is for --model-only and measure mode (e2e times hooks, not formats)")
    if not args.formats:
        raise UsageError("--formats names no format")
    for name in args.formats:
        try:
            WireFormat.parse(name)
        except ValueError as e:
            raise UsageError(f"--formats: {e}") from None
    _format_sizes(args)


def _format_sizes(args: argparse.Namespace) -> List[int]:
    """Bucket sizes (gradient bytes) the format choice is evaluated at: the default sizes within --min-bytes and
    --max-bytes, or those two where none falls between."""
    sizes = [s for s in profiles.DEFAULT_BUCKET_SIZES if args.min_bytes <= s <= args.max_bytes]
    if not sizes:
        sizes = sorted({args.min_bytes, args.max_bytes})
    return sizes


def _autotune_model(args: argparse.Namespace, comm_dtype: str) -> int:
    topo = _launch_topology(args, args.world_size, required=True)
    calibration = _calibration(args, topo)
    try:
        prof = profiles.model_profile(topo, comm_dtype=comm_dtype, sizes=_sizes(args, comm_dtype),
                                      calibration=calibration, **_common_profile_kwargs(args))
        if args.formats is not None:
            host = cm.CPU_HOST_COST if args.host_cost == "cpu" else cm.GPU_HOST_COST
            prof.formats = profiles.model_format_choice(cm.Fabric.from_topology(topo, calibration), args.formats,
                                                        _format_sizes(args), host)
        wire = _wire_table(cm.Fabric.from_topology(topo, calibration)) if args.wire_formats else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    code = emit(prof, args)
    if wire is not None:
        print(wire, file=sys.stderr if args.json else sys.stdout)
    return code


def _calibration(args: argparse.Namespace, topo: Any) -> Optional[cm.Calibration]:
    """The calibration of ``--calibration PROFILE``, checked against the topology; None without the flag."""
    if args.calibration is None:
        return None
    try:
        measured = Profile.load(args.calibration)
    except ProfileError as e:
        raise UsageError(f"--calibration {e}") from None
    if measured.calibration is None:
        raise UsageError(f"--calibration {args.calibration}: the profile has no calibration (a {measured.source} "
                         "profile; measure mode stores one when it knows the topology: autotune --topology ...)")
    try:
        profiles.check_calibration_fits(measured.calibration, topo)
    except ValueError as e:
        raise UsageError(f"--calibration {args.calibration}: {e}") from None
    return measured.calibration


#: Bucket sizes of the wire-format table, MiB of float32 gradients (DDP's 25 MB default among them).
WIRE_TABLE_BUCKET_MIB = (1, 4, 16, 25, 64, 256)


def _wire_table(fabric: cm.Fabric) -> str:
    """Predicted wire time per bucket size and wire format, microseconds, and the fastest format."""
    head = ["bucket (fp32)", *[f"{w} us" for w in TRAFFIC], "fastest"]
    lines = [f"wire formats, predicted time per bucket ({fabric.ranks_per_node} per node x {fabric.nodes} node(s); "
             "the wire only, not the casts or sums):"]
    rows = []
    for mib in WIRE_TABLE_BUCKET_MIB:
        n = mib * MIB // 4
        times = {w: cm.wire_format_time_us(fabric, n, w) for w in TRAFFIC}
        rows.append([f"{mib} MiB", *[f"{times[w]:.1f}" for w in TRAFFIC], min(times, key=times.get)])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def _backend(args: argparse.Namespace) -> str:
    """The backend to measure on: ``--backend``, else NCCL where CUDA GPUs are; UsageError where it cannot run."""
    import torch
    import torch.distributed as dist

    from ..runtime.algo_groups import check_nccl_support

    backend = args.backend
    if backend is None:
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise UsageError("no CUDA GPU with NCCL here: use --model-only (with --topology), or --backend gloo "
                             "--nproc N to time CPU processes")
        backend = "nccl"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA GPUs; none are visible")
    if args.algorithms and not args.e2e:
        if backend != "nccl" and args.algorithms != ["ring"]:
            raise UsageError(f"backend {backend} has one all-reduce algorithm (recorded as ring); "
                             f"cannot sweep {','.join(args.algorithms)}")
        if backend == "nccl":
            try:
                check_nccl_support(args.algorithms, nccl_version())
            except RuntimeError as e:
                raise UsageError(str(e)) from None
    return backend


def _processes(args: argparse.Namespace, backend: str) -> Tuple[Optional[int], int]:
    """(processes to spawn, or None under torchrun; the world size they make)."""
    import torch

    if under_torchrun():
        nproc, world = None, int(os.environ["WORLD_SIZE"])
    else:
        nproc = args.nproc or (torch.cuda.device_count() if backend == "nccl" else 1)
        if backend == "nccl" and nproc > torch.cuda.device_count():
            raise UsageError(f"--nproc {nproc} but only {torch.cuda.device_count()} GPUs are visible")
        world = nproc
    if args.world_size is not None and args.world_size != world:
        raise UsageError(f"--world-size {args.world_size} does not match the {world} processes that will run "
                         "(set --nproc, or the launcher's world size)")
    return nproc, world


def _e2e_config(args: argparse.Namespace, topo: Any, world: int, backend: str, comm_dtype: str,
                sizes: List[int]) -> Dict[str, Any]:
    """What every e2e worker runs: the factory, the base profile, the candidates."""
    from ..tune import autotune as tuner
    from ..tune.step_timing import load_factory

    try:
        load_factory(args.e2e)  # fail here, with exit 2, rather than in every worker
    except ValueError as e:
        raise UsageError(str(e)) from None
    base = tuner.e2e_base_profile(topo, world, comm_dtype, backend, sizes=sizes, **_common_profile_kwargs(args))
    if args.nccl_tuner_csv and any(t.protocol is None for t in base.table):
        raise UsageError("--nccl-tuner-csv needs a protocol per range; the base profile e2e mode starts from "
                         "has none (no topology the cost model can describe, or a cached profile measured "
                         "without one): pass --topology (and --inter-node-gbps for several nodes), or make the "
                         "CSV with --model-only")
    return {"factory": args.e2e, "base": base.to_dict(), "bucket_mbs": args.buckets, "hooks": args.hooks,
            "warmup": args.warmup if args.warmup is not None else 3, "steps": args.steps}


def _measure_config(args: argparse.Namespace, topo: Any, backend: str, comm_dtype: str,
                    dtypes: Optional[List[str]], sizes: List[int]) -> Dict[str, Any]:
    """What every measuring worker runs: the sweep's plan."""
    _check_tuner_csv(args, topo, backend)
    return {"topology": topo.to_dict() if topo is not None else None, "sizes": sizes,
            "algorithms": args.algorithms, "comm_dtype": comm_dtype, "dtypes": dtypes,
            "warmup": args.warmup if args.warmup is not None else 5, "iters": args.iters,
            "progress": not args.no_progress, "formats": args.formats,
            "format_sizes": _format_sizes(args) if args.formats else None,
            "format_rel_error": args.format_error if args.format_error is not None else DEFAULT_REL_ERROR,
            "format_budget_s": args.format_budget if args.format_budget is not None else DEFAULT_BUDGET_S,
            **_common_profile_kwargs(args)}


def _run_workers(worker_name: str, config: Dict[str, Any], nproc: Optional[int], backend: str,
                 args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """Run ``tune.autotune.<worker_name>`` on every process: in place (under torchrun, or one process) or spawned.
    Rank 0's profile dict; None on the other ranks of a torchrun job (rank 0 reports)."""
    import torch.distributed as dist

    from ..tune import autotune as tuner
    from ..tune import processes

    if nproc is not None and nproc > 1:
        return processes.spawn_local(f"ddp_triton.tune.autotune:{worker_name}", nproc, backend, (config,),
                                     timeout_s=args.timeout)
    torchrun = nproc is None
    created = processes.init_in_place(backend)
    try:
        result = getattr(tuner, worker_name)(config)
        if torchrun:  # rank 0's profile, cached on every node for the hook's profile="auto"
            result, _ = tuner.share_profile(result, cache=not args.no_cache)
    except BaseException:
        if created:
            dist.destroy_process_group()  # no barrier: the other ranks may never reach one
        raise
    if created:
        processes.leave_process_group()
    if torchrun and int(os.environ["RANK"]) != 0:
        return None
    return result


def _autotune_distributed(args: argparse.Namespace, comm_dtype: str, dtypes: Optional[List[str]]) -> int:
    backend = _backend(args)
    nproc, world = _processes(args, backend)
    topo = _launch_topology(args, world, required=False)
    sizes = _sizes(args, comm_dtype)
    if args.e2e:
        worker, config = "e2e_worker", _e2e_config(args, topo, world, backend, comm_dtype, sizes)
    else:
        worker, config = "measure_worker", _measure_config(args, topo, backend, comm_dtype, dtypes, sizes)
    # Usage was checked above: from here on, any error (ValueError included) is a failure while measuring.
    try:
        result = _run_workers(worker, config, nproc, backend, args)
    except ImportError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # a failure while measuring: report it whole, exit 1
        print(f"ddp-triton: autotune failed: {e.__class__.__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if result is None:
        return EXIT_OK  # another rank of a torchrun job: rank 0 reports
    return emit(Profile.from_dict(result), args)
