"""Making profiles by measuring: timed all-reduces (``measure_profile``, which also calibrates the cost model to them)
or timed DDP steps of the user's model (``e2e_profile``).

The cost model's profile needs no measuring: ``ddp_triton.machine.profile.model_profile``; nor does NCCL's tuner
CSV of a profile (``ddp_triton.machine.profile.nccl_tuner_csv_text``). ``measure_worker`` and
``e2e_worker`` are the entry points ``processes.spawn_local`` runs on each process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..dtypes import normalize_dtype
from ..machine import cost_model as cm
from ..machine.profile import (CONFIDENCE, DEFAULT_BUCKET_SIZES, DEFAULT_BUDGET_S, DEFAULT_FRACTION, DEFAULT_MIN_BUCKETS,
                               DEFAULT_REL_ERROR, MAX_ROUNDS, MIN_ROUNDS, FormatChoice, FormatRow, Profile,
                               admitted_formats, calibrate, fallback_profile, find_cached_profile, format_bytes,
                               format_choice, model_profile, now_iso, profile_fingerprint, profile_from_rows,
                               rows_for_dtype, save_to_cache)
from ..machine.topology import Topology
from ..versions import nccl_version, software_versions
from .processes import agree_on_plan
from .e2e_hooks import E2E_HOOKS
from .format_timing import node_count, time_formats
from .step_timing import run_e2e
from .sweep import run_sweep


def default_algorithms(topo: Any, backend: str, comm_dtype: str = "bfloat16") -> List[str]:
    """What a measurement sweeps: one ("ring") on gloo; on NCCL what NCCL can run here.

    Decided from the topology's layout (GPUs per node, nodes, NVSwitch, GPU generation), the dtype and NCCL's
    version, not from link rates: NVML sees no NICs, so a multi-node topology read from it has no inter-node rate,
    and measuring must not need one.
    """
    if backend != "nccl":
        return ["ring"]
    if topo is None:
        return ["ring", "tree"]
    return cm.available_algorithms(cm.Layout.from_topology(topo), comm_dtype, nccl_version())


def _measure_plan(topo: Any, backend: str, sizes: Optional[Sequence[int]], algorithms: Optional[Sequence[str]],
                  comm_dtype: str, dtypes: Optional[Sequence[str]], warmup: int, iters: int) -> Dict[str, Any]:
    """What this rank would measure (sizes, dtypes, algorithms per dtype, ...), or ``{"error": why}``."""
    try:
        comm_dtype = normalize_dtype(comm_dtype)
        dts = [normalize_dtype(d) for d in (dtypes or [comm_dtype])]
        if comm_dtype not in dts:
            dts.append(comm_dtype)
        if algorithms:
            algs = {dt: list(algorithms) for dt in dts}
        else:
            algs = {dt: default_algorithms(topo, backend, dt) for dt in dts}
        if backend != "nccl" and any(a != ["ring"] for a in algs.values()):
            raise ValueError(f"backend {backend!r} has one all-reduce algorithm; cannot sweep {algs[comm_dtype]}")
        size_list = [int(s) for s in sizes] if sizes is not None else cm.default_sizes()
    except ValueError as e:
        return {"error": str(e)}
    return {"comm_dtype": comm_dtype, "dtypes": dts, "sizes": size_list, "algorithms": algs, "warmup": int(warmup),
            "iters": int(iters)}


def measure_profile(topo: Any = None, sizes: Optional[Sequence[int]] = None,
                    algorithms: Optional[Sequence[str]] = None, comm_dtype: str = "bfloat16",
                    dtypes: Optional[Sequence[str]] = None, warmup: int = 5, iters: int = 20,
                    fraction: float = DEFAULT_FRACTION, model_bytes: Optional[int] = None,
                    min_buckets: int = DEFAULT_MIN_BUCKETS, progress: bool = True,
                    host_us_per_bucket: float = 0.0, formats: Optional[Sequence[str]] = None,
                    format_sizes: Optional[Sequence[int]] = None, format_rel_error: float = DEFAULT_REL_ERROR,
                    format_budget_s: float = DEFAULT_BUDGET_S) -> Profile:
    """Time all-reduces on the default process group (every rank calls this) and build a ``measured`` profile.

    ``dtypes`` defaults to ``[comm_dtype]``; the table and bucket size use the ``comm_dtype`` rows, and the cost
    model is calibrated to them (per algorithm, least squares on log-time) and stored in the profile for ``autotune
    --model-only --calibration``. On gloo the one algorithm is recorded as ``ring`` (gloo's CPU all-reduce is
    ring-based), and the notes say so. Every rank measures rank 0's plan (sizes, dtypes, algorithms, comm dtype,
    warmup, iters): ranks that read their machine or NCCL version differently must still issue the same
    collectives. A plan rank 0 cannot make is a ValueError on every rank.

    ``formats`` (wire format names): also time a bucket's whole exchange in each of them, per bucket size in
    ``format_sizes`` (gradient bytes; default 256 KiB to 1 GiB), through the hook's path (``format_timing``), until
    each median is known within ``format_rel_error`` or ``format_budget_s`` seconds are spent, and record the
    format ``format_rule`` picks per size range in the profile's ``formats`` (the most accurate unless another is
    faster beyond the noise), with each timing's median and interval, beside the cost model's times where it can
    describe the machine.
    """
    backend = str(dist.get_backend()).lower()
    plan = agree_on_plan(_measure_plan(topo, backend, sizes, algorithms, comm_dtype, dtypes, warmup, iters))
    comm_dtype, warmup, iters = plan["comm_dtype"], plan["warmup"], plan["iters"]
    notes = []
    if backend != "nccl":
        notes.append(f"backend {backend}: one all-reduce algorithm, recorded as 'ring'")
    rows = run_sweep(plan["sizes"], plan["algorithms"], plan["dtypes"], warmup=warmup, iters=iters,
                     progress=progress)
    world = dist.get_world_size()
    nodes = topo.nodes if topo is not None and world % topo.nodes == 0 else 1
    notes.append(f"measured: {warmup} warm-up + {iters} timed all-reduces per point, slowest rank's median")
    calibration, note = calibrate_measured(topo, rows, comm_dtype, "nccl" if backend == "nccl" else "gloo")
    notes.append(note)
    profile = profile_from_rows(rows, source="measured", backend="nccl" if backend == "nccl" else "gloo",
                                world_size=world, nodes=nodes, comm_dtype=comm_dtype, topo=topo, fraction=fraction,
                                model_bytes=model_bytes, min_buckets=min_buckets, notes=notes,
                                calibration=calibration, host_us_per_bucket=host_us_per_bucket)
    if formats:
        profile.formats = measure_formats(formats, format_sizes, topo, calibration, backend, world, warmup,
                                          progress, format_rel_error, format_budget_s)
    return profile


def measure_formats(formats: Sequence[str], sizes: Optional[Sequence[int]], topo: Any, calibration: Any,
                    backend: str, world: int, warmup: int, progress: bool, rel_error: float = DEFAULT_REL_ERROR,
                    budget_s: float = DEFAULT_BUDGET_S) -> FormatChoice:
    """Time the admitted formats per bucket size (every rank calls this) and choose per range by ``format_rule``.

    Formats are admitted on the nodes the runtime sees (``format_timing.node_count``), whatever the topology says:
    a two-level format the hook would run flat here is timed and recorded as its flat format."""
    nodes = node_count()
    admitted, replaced = admitted_formats(formats, world, nodes)
    host = cm.GPU_HOST_COST if backend == "nccl" else cm.CPU_HOST_COST
    fabric = None
    if topo is not None:
        try:
            fabric = cm.Fabric.from_topology(topo, calibration=calibration)
        except ValueError:
            fabric = None  # several nodes and no inter-node rate, say: no model column
    rows = [FormatRow.from_dict(r) for r in time_formats(list(sizes) if sizes else list(DEFAULT_BUCKET_SIZES),
                                                         admitted, warmup=min(warmup, 2), rel_error=rel_error,
                                                         budget_s=budget_s, progress=progress, fabric=fabric,
                                                         host=host)]
    choice = format_choice("measured", formats, rows, replaced,
                           f"measured ({backend}); model column: {host.source}" if fabric else f"measured ({backend})")
    choice.notes.append(_precision_note(rows, rel_error, budget_s))
    return choice


def _precision_note(rows: Sequence[FormatRow], rel_error: float, budget_s: float) -> str:
    """How the format timings were taken, and the sizes whose medians the time budget left less precise."""
    text = (f"timed: rounds of one exchange per format in turn (the slowest rank's time), {MIN_ROUNDS} to "
            f"{MAX_ROUNDS} per size, until each median is within +-{rel_error:.0%} ({CONFIDENCE:.0%} interval) or "
            f"the {budget_s:g} s budget is spent")
    loose: Dict[int, FormatRow] = {}
    for r in rows:
        if r.stats.relative_error > rel_error and (r.nbytes not in loose
                                                     or r.stats.relative_error > loose[r.nbytes].stats.relative_error):
            loose[r.nbytes] = r
    if loose:
        worst = ", ".join(f"{format_bytes(n)} ({r.format} +-{r.stats.relative_error:.0%})"
                          for n, r in sorted(loose.items()))
        text += f"; not reached (budget or rounds spent) at: {worst}"
    return text


def calibrate_measured(topo: Any, rows: Sequence[Dict[str, Any]], comm_dtype: str,
                       backend: str) -> Tuple[Optional[Any], str]:
    """The cost model calibrated to the ``comm_dtype`` rows of a measured sweep, and a note for the profile saying
    how well it fits, or why there is none (no topology; several nodes without an inter-node rate; too few sizes)."""
    comm_rows = rows_for_dtype(rows, comm_dtype)
    try:
        calibration = calibrate(topo, comm_rows, backend)
    except ValueError as e:
        return None, f"cost model not calibrated: {e}"
    fits = ", ".join(f"{a} rms log error {c.rms_log_error:.3f}" for a, c in calibration.algorithms.items())
    return calibration, f"cost model calibrated to the {comm_dtype} sweep ({fits})"


def e2e_base_profile(topo: Any, world_size: int, comm_dtype: str, backend: str, **model_kwargs: Any) -> Profile:
    """The profile e2e mode starts from: this machine's cached one, else the cost model's (``model_kwargs`` go to
    ``model_profile``), else (no topology, or one the model cannot describe: several nodes and no inter-node rate,
    say) one ring range with DDP's default bucket size."""
    if topo is not None:
        cached = find_cached_profile(profile_fingerprint(topo), topo.world_size, topo.nodes, comm_dtype)
        if cached is not None:
            return cached
        try:
            return model_profile(topo, comm_dtype=comm_dtype, **model_kwargs)
        except ValueError:
            pass
    return fallback_profile(world_size, topo.nodes if topo is not None else 1, comm_dtype, backend)


def e2e_profile(factory: str, base: Profile, bucket_mbs: Optional[Sequence[float]] = None,
                hooks: Sequence[str] = E2E_HOOKS, warmup: int = 3, steps: int = 10) -> Profile:
    """Time DDP training steps (every rank calls this) and return ``base`` turned into an ``e2e`` profile.

    Candidates: each hook in ``hooks`` x each bucket size (default: ``step_timing.e2e_bucket_candidates`` around the
    base profile's choice, bounded by the model's size). The winner's bucket size becomes ``bucket_cap_mb``; its
    hook is in ``e2e["winner"]`` (comm_dtype float32 when the winner is DDP's own fp32 all-reduce). Every rank
    times rank 0's candidates (factory, base profile, hooks, bucket sizes, warmup, steps).
    """
    base_dict = base.to_dict()
    del base_dict["created"]  # a timestamp: ranks that made the same base profile differ only in it
    plan = {"factory": factory, "base": base_dict, "hooks": list(hooks), "warmup": int(warmup),
            "steps": int(steps), "bucket_mbs": None if bucket_mbs is None else [float(b) for b in bucket_mbs]}
    bad = [h for h in hooks if h not in E2E_HOOKS]
    if bad:
        plan = {"error": f"unknown hook {bad[0]!r}; known: {', '.join(E2E_HOOKS)}"}
    # Every rank times rank 0's candidates: a base profile read from each node's own cache may differ.
    plan = agree_on_plan(plan)
    factory, base, hooks = plan["factory"], Profile.from_dict(plan["base"]), plan["hooks"]
    warmup, steps, bucket_mbs = plan["warmup"], plan["steps"], plan["bucket_mbs"]
    result = run_e2e(factory, bucket_mbs, hooks, warmup, steps, base.to_dict())
    win = result["winner"]
    timed = [c for c in result["candidates"] if "step_ms" in c]
    d = base.to_dict()
    d.update(source="e2e", bucket_cap_mb=win["bucket_cap_mb"], e2e=result,
             comm_dtype="float32" if win["hook"] == "allreduce" else base.comm_dtype,
             world_size=dist.get_world_size(), versions=software_versions(), created=now_iso())
    d["bucket_reason"] = (f"fastest of {len(timed)} timed DDP configurations: hook {win['hook']}, bucket_cap_mb "
                          f"{win['bucket_cap_mb']:g}: {win['step_ms']:.3f} ms/step (slowest rank's median of "
                          f"{steps} steps)")
    d["notes"] = list(base.notes) + [f"e2e: base table from a {base.source} profile"]
    return Profile.from_dict(d)


def share_profile(profile: Optional[Dict[str, Any]], cache: bool = True) -> Tuple[Dict[str, Any], Optional[Path]]:
    """Rank 0's profile dict on every rank (every rank calls this), cached on every node.

    The hook's ``profile="auto"`` reads the cache of the node it runs on, and the ranks' profile check fails
    everywhere if one node has none: so with ``cache``, the first process of every node other than rank 0's
    (``LOCAL_RANK`` 0) writes rank 0's profile to its cache. Rank 0 writes its own with the rest of its output.
    Returns the dict and the cache file this rank wrote (None when it wrote none).
    """
    box = [profile if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    shared = box[0]
    path = None
    if cache and dist.get_rank() != 0 and os.environ.get("LOCAL_RANK") == "0":
        path = save_to_cache(Profile.from_dict(shared))
    return shared, path


# --------------------------------------------------------------------------------------------------------------------
# Spawn entry points (run on every process by processes.spawn_local, or in place under torchrun)
# --------------------------------------------------------------------------------------------------------------------


def measure_worker(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Run ``measure_profile`` with ``config``'s keyword arguments; the profile as a dict."""
    kwargs = {k: v for k, v in config.items() if k != "topology"}
    topo = Topology.from_dict(config["topology"]) if config.get("topology") else None
    return measure_profile(topo=topo, **kwargs).to_dict()


def e2e_worker(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Run ``e2e_profile`` with ``config`` (``factory``, ``base`` profile dict, and its keyword arguments)."""
    kwargs = {k: v for k, v in config.items() if k not in ("factory", "base")}
    return e2e_profile(config["factory"], Profile.from_dict(config["base"]), **kwargs).to_dict()
