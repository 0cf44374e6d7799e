"""Making a profile: the table and bucket size from sweep rows, and a whole profile from rows or from the cost model
(no GPU needed; calibrated to a measured sweep if given).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ...dtypes import dtype_size, normalize_dtype
from ...versions import software_versions
from .. import cost_model as cm
from ..cost_model import ALGORITHMS, Calibration
from .cache import profile_fingerprint
from .rows import FormatChoice, FormatRange, SweepRow, TableEntry, size_ranges
from .schema import DEFAULT_MIN_BUCKETS, MiB, Profile, format_bytes

#: Default fraction of the best busbw a bucket's all-reduce must reach: 90%.
DEFAULT_FRACTION = 0.9
#: Largest bucket_cap_mb chosen when the model's size is unknown. Bandwidth alone points at 128-512 MiB (90% of the
#: best busbw is reached only near the 1 GiB end of the sweep), one bucket for most models and no overlap with
#: backward. 64 MiB keeps a model of a few hundred MB split into several buckets; --model-bytes or
#: ddp_kwargs(profile, model) bound it by the real model instead.
DEFAULT_MAX_BUCKET_MB = 64.0
#: Two algorithms within this fraction of each other at a size count as tied; the table then keeps the algorithm of
#: the previous size, which avoids flapping between near-equal algorithms on measurement noise (and extra groups).
DEFAULT_TIE_TOLERANCE = 0.03
#: Host microseconds a bucket costs besides its all-reduce, measured on the lent H200 (torch 2.11, 2026-11-30):
#: triton_hook bf16 with bucket views took 6.10 ms a step against 4.94 without a hook (bench.ddp_step, the 100.7M
#: MLP, 13 buckets after DDP's rebuild), of which about 0.3 ms is its pack and unpack kernels' GPU time:
#: (1.16 - 0.3) ms / 13 = 66 us. Measured before the bucket paths were bound once per bucket, so an upper estimate
#: for this release until bench.hook_cost runs there; `autotune --host-us-per-bucket` takes this machine's.
DEFAULT_HOST_US_PER_BUCKET = 66.0

#: dtype of the gradients DDP buckets hold; bucket_cap_mb counts those bytes.
DEFAULT_GRAD_DTYPE = "float32"


def _as_rows(rows: Iterable[Union[SweepRow, Mapping[str, Any]]]) -> List[SweepRow]:
    return [r if isinstance(r, SweepRow) else SweepRow.from_dict(r) for r in rows]


def build_table(rows: Iterable[Union[SweepRow, Mapping[str, Any]]],
                tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
                protocol_of: Optional[Callable[[str, int], Optional[str]]] = None) -> List[TableEntry]:
    """Ranges of the fastest algorithm per swept size.

    A size between two swept sizes a < b follows a up to floor(sqrt(a*b)) (the geometric midpoint) and b above it.
    Where the previous size's algorithm is within ``tie_tolerance`` of the fastest it is kept, so that noise does
    not alternate algorithms. Each range carries the row's protocol, else ``protocol_of(algorithm, bytes)`` (the
    model's guess for measured rows), else None; ranges split where the protocol changes.
    """
    by_size: Dict[int, List[SweepRow]] = {}
    for r in _as_rows(rows):
        by_size.setdefault(r.nbytes, []).append(r)
    if not by_size:
        raise ValueError("no sweep rows to build a table from")
    sizes = sorted(by_size)
    picks: List[SweepRow] = []
    for s in sizes:
        fastest = min(by_size[s], key=lambda r: (r.time_us, ALGORITHMS.index(r.algorithm)))
        if picks:
            same = [r for r in by_size[s] if r.algorithm == picks[-1].algorithm]
            if same and same[0].time_us <= fastest.time_us * (1.0 + tie_tolerance):
                fastest = same[0]
        picks.append(fastest)
    keys = [(r.algorithm, r.protocol if r.protocol is not None or protocol_of is None else protocol_of(r.algorithm, s))
            for s, r in zip(sizes, picks)]
    return [TableEntry(lo, hi, alg, proto) for lo, hi, (alg, proto), _ in size_ranges(sizes, keys)]


def choose_bucket_cap_mb(rows: Iterable[Union[SweepRow, Mapping[str, Any]]], fraction: float = DEFAULT_FRACTION,
                         model_bytes: Optional[int] = None, min_buckets: int = DEFAULT_MIN_BUCKETS,
                         comm_ratio: float = 1.0, host_us_per_bucket: float = 0.0) -> Tuple[float, str]:
    """DDP ``bucket_cap_mb`` and the reason for it.

    First the largest bucket allowed: ``model_bytes / min_buckets`` (gradient bytes of the model, so that it still
    splits into that many buckets that overlap backward), else ``DEFAULT_MAX_BUCKET_MB``. Then the smallest swept
    all-reduce, no larger than that, whose best busbw reaches ``fraction`` of the best busbw an allowed bucket gets;
    where that is the largest swept size allowed (busbw still rising), the bucket is the largest allowed.

    ``host_us_per_bucket``: the host time each bucket costs besides its all-reduce (the hook's Python, the
    collective's call, the completion: ``python -m bench.hook_cost`` measures it; ``DEFAULT_HOST_US_PER_BUCKET``
    is the H200's). Each row's busbw is then taken over its time plus that cost, so where the host is the limit
    small buckets lose and the rule picks fewer, larger ones.

    Why against the largest allowed bucket and not the whole sweep: NCCL reaches its peak only for messages of
    hundreds of MiB to GiB (chunk pipelining, ``cost_model.ramp``), so 90% of the sweep's best lies beyond any bucket
    a model would use, and would pick the cap every time. ``comm_ratio`` is bytes sent per gradient byte (0.5 for
    fp32 gradients sent as bf16), since DDP counts bucket size in gradient bytes.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if min_buckets < 1:
        raise ValueError(f"min_buckets must be >= 1, got {min_buckets!r}")
    if not comm_ratio > 0:
        raise ValueError(f"comm_ratio must be > 0, got {comm_ratio!r}")
    if model_bytes is not None and model_bytes <= 0:
        raise ValueError(f"model_bytes must be > 0, got {model_bytes!r}")
    if not (isinstance(host_us_per_bucket, (int, float)) and 0 <= host_us_per_bucket < float("inf")):
        raise ValueError(f"host_us_per_bucket must be a finite number >= 0, got {host_us_per_bucket!r}")
    best: Dict[int, SweepRow] = {}
    for r in _as_rows(rows):
        if host_us_per_bucket and r.time_us > 0:  # the bucket's busbw over its all-reduce and its host cost
            r = dataclasses.replace(r, time_us=r.time_us + host_us_per_bucket,
                                    algbw_gbps=r.algbw_gbps * r.time_us / (r.time_us + host_us_per_bucket),
                                    busbw_gbps=r.busbw_gbps * r.time_us / (r.time_us + host_us_per_bucket))
        if r.nbytes not in best or r.busbw_gbps > best[r.nbytes].busbw_gbps:
            best[r.nbytes] = r
    if not best:
        raise ValueError("no sweep rows to choose a bucket size from")
    if max(r.busbw_gbps for r in best.values()) <= 0:
        # One rank: nothing crosses a wire, bandwidth says nothing. Keep DDP's default.
        return 25.0, "one rank (busbw 0 everywhere): DDP's default 25 MiB"
    cap = model_bytes / min_buckets if model_bytes is not None else DEFAULT_MAX_BUCKET_MB * MiB
    allowed = [s for s in sorted(best) if s / comm_ratio <= cap]
    if not allowed:
        bucket_bytes = cap
        reason = "every swept all-reduce is larger than the largest bucket allowed"
    else:
        ref = max((best[s] for s in allowed), key=lambda r: r.busbw_gbps)
        target = fraction * ref.busbw_gbps
        chosen = next(best[s] for s in allowed if best[s].busbw_gbps >= target)
        reason = (f"smallest all-reduce reaching {fraction:.0%} of the busbw of the largest bucket allowed "
                  f"({ref.busbw_gbps:.1f} GB/s at {format_bytes(ref.nbytes)}): {format_bytes(chosen.nbytes)} at "
                  f"{chosen.busbw_gbps:.1f} GB/s ({chosen.algorithm})")
        bucket_bytes = chosen.nbytes / comm_ratio
        if comm_ratio != 1.0:
            reason += f"; {comm_ratio:g} bytes sent per gradient byte -> {format_bytes(bucket_bytes)} of gradients"
        if chosen.nbytes == allowed[-1] and bucket_bytes < cap:
            bucket_bytes = cap
            reason += f"; busbw still rising there: {format_bytes(cap)}, the largest bucket allowed"
    if host_us_per_bucket:
        reason += f"; busbw counted over each all-reduce plus {host_us_per_bucket:g} us of host time per bucket"
    if model_bytes is not None:
        reason += (f"; at most {format_bytes(cap)} so the {format_bytes(model_bytes)} of gradients split into "
                   f"{min_buckets} buckets that overlap backward")
    elif bucket_bytes >= cap:
        reason += (f"; model size unknown: capped at {DEFAULT_MAX_BUCKET_MB:g} MiB so a model of a few hundred MB "
                   "still splits into several buckets that overlap backward (--model-bytes, or ddp_kwargs(profile, "
                   "model), bounds it by the real model)")
    else:
        reason += "; model size unknown (--model-bytes, or ddp_kwargs(profile, model), bounds it by the real model)"
    mb = float(f"{bucket_bytes / MiB:.4g}")
    return mb, reason


def rows_for_dtype(rows: Iterable[Union[SweepRow, Mapping[str, Any]]], comm_dtype: str) -> List[SweepRow]:
    """The rows measured in ``comm_dtype`` (rows without a dtype count as comm_dtype)."""
    dt = normalize_dtype(comm_dtype)
    return [r for r in _as_rows(rows) if r.dtype in (None, dt)]


def _protocol_guesser(topo: Any, comm_dtype: str) -> Optional[Callable[[str, int], Optional[str]]]:
    """The cost model's protocol per (algorithm, bytes) for this topology, or None if it cannot model it."""
    if topo is None:
        return None
    try:
        fabric = cm.Fabric.from_topology(topo)
    except ValueError:
        return None

    def guess(algorithm: str, nbytes: int) -> Optional[str]:
        try:
            return cm.estimate(fabric, nbytes, algorithm, comm_dtype).protocol
        except ValueError:
            return None

    return guess


def profile_from_rows(rows: Sequence[Union[SweepRow, Dict[str, Any]]], *, source: str, backend: str,
                      world_size: int, nodes: int, comm_dtype: str, topo: Any = None,
                      fraction: float = DEFAULT_FRACTION, model_bytes: Optional[int] = None,
                      min_buckets: int = DEFAULT_MIN_BUCKETS, grad_dtype: str = DEFAULT_GRAD_DTYPE,
                      notes: Optional[List[str]] = None, calibration: Optional[Calibration] = None,
                      host_us_per_bucket: float = 0.0) -> Profile:
    """A profile from sweep rows: table and bucket size from the rows in ``comm_dtype``; ``calibration`` is stored
    with it."""
    all_rows = _as_rows(rows)
    comm_rows = rows_for_dtype(all_rows, comm_dtype)
    if not comm_rows:
        raise ValueError(f"no sweep rows in comm dtype {comm_dtype}")
    # Protocols are NCCL's; a gloo measurement has none to guess.
    guesser = _protocol_guesser(topo, comm_dtype) if backend in ("nccl", "model") else None
    table = build_table(comm_rows, protocol_of=guesser)
    mb, reason = choose_bucket_cap_mb(comm_rows, fraction=fraction, model_bytes=model_bytes,
                                      min_buckets=min_buckets,
                                      comm_ratio=dtype_size(comm_dtype) / dtype_size(grad_dtype),
                                      host_us_per_bucket=host_us_per_bucket)
    return Profile(source=source, backend=backend, world_size=world_size, nodes=nodes, comm_dtype=comm_dtype,
                   bucket_cap_mb=mb, bucket_reason=reason, sweep=all_rows, table=table,
                   topology_fingerprint=profile_fingerprint(topo) if topo is not None else "",
                   topology_name=topo.name if topo is not None else "",
                   versions=software_versions(nccl=backend != "model"),  # the cost model ran no NCCL
                   notes=list(notes or []), calibration=calibration)


def model_profile(topo: Any, comm_dtype: str = "bfloat16", sizes: Optional[Sequence[int]] = None,
                  fraction: float = DEFAULT_FRACTION, model_bytes: Optional[int] = None,
                  min_buckets: int = DEFAULT_MIN_BUCKETS, grad_dtype: str = DEFAULT_GRAD_DTYPE,
                  calibration: Optional[Calibration] = None, host_us_per_bucket: float = 0.0) -> Profile:
    """The cost model's profile for ``topo`` (its nodes and GPUs per node as launched; see apply_launch_env), with a
    ``calibration`` measured on one of its nodes if given (``check_calibration_fits`` first)."""
    comm_dtype = normalize_dtype(comm_dtype)
    fabric = cm.Fabric.from_topology(topo, calibration=calibration)
    sizes = list(sizes) if sizes is not None else cm.default_sizes()
    sizes = [s for s in sizes if s % dtype_size(comm_dtype) == 0]
    rows = [e.row(comm_dtype) for e in cm.sweep(fabric, sizes, comm_dtype)]
    notes = [f"cost model: {fabric.ranks_per_node} ranks x {fabric.nodes} node(s), intra {fabric.intra_gbps:g} GB/s "
             f"{fabric.intra_link}, inter {fabric.inter_gbps:g} GB/s per node, {fabric.arch}"]
    if calibration is not None:
        notes.append(f"calibrated: intra-node factors fitted to a sweep of {calibration.ranks_per_node} ranks x "
                     f"{calibration.nodes} node(s) ({calibration.backend}); inter-node terms as modelled")
    return profile_from_rows(rows, source="model", backend="model", world_size=fabric.world_size,
                             nodes=fabric.nodes, comm_dtype=comm_dtype, topo=topo, fraction=fraction,
                             model_bytes=model_bytes, min_buckets=min_buckets, grad_dtype=grad_dtype, notes=notes,
                             calibration=calibration, host_us_per_bucket=host_us_per_bucket)


def node_fingerprint(topo: Any) -> str:
    """The fingerprint of one node of ``topo`` (its GPUs and links, not the node count or NICs): what a
    calibration describes."""
    return dataclasses.replace(topo, nodes=1, inter_node_gbps=None).fingerprint()


def calibrate(topo: Any, rows: Sequence[Union[SweepRow, Mapping[str, Any]]], backend: str) -> Calibration:
    """The cost model's per-algorithm factors fitted to measured ``rows`` (one dtype) on ``topo`` as launched.
    ValueError when the model cannot describe the machine (no topology, no inter-node rate for several nodes) or no
    algorithm has two sizes to fit."""
    if topo is None:
        raise ValueError("no topology: the model needs one to compare the measurement with (pass --topology)")
    fabric = cm.Fabric.from_topology(topo)
    return cm.fit_calibration(fabric, _as_rows(rows), backend=backend, node_fingerprint=node_fingerprint(topo))


def check_calibration_fits(calibration: Calibration, topo: Any) -> None:
    """ValueError unless ``calibration`` was measured on nodes of the kind ``topo`` has (same GPUs and links per
    node); one without a recorded node must at least match the GPU generation and the intra-node link."""
    fabric = cm.Layout.from_topology(topo)
    if calibration.node_fingerprint:
        if calibration.node_fingerprint != node_fingerprint(topo):
            raise ValueError(f"the calibration was measured on another kind of node ({calibration.ranks_per_node} "
                             f"x {calibration.arch}, {calibration.intra_link}) than topology {topo.name!r} has "
                             f"({topo.gpus_per_node} x {fabric.arch}): measure one of these nodes")
        return
    link = "nvlink" if topo.intra_node_fabric == "nvlink" else "pcie"
    if (calibration.arch, calibration.intra_link) != (fabric.arch, link):
        raise ValueError(f"the calibration was measured on {calibration.arch} GPUs over {calibration.intra_link}; "
                         f"topology {topo.name!r} has {fabric.arch} GPUs over {link}")


def fallback_profile(world_size: int, nodes: int, comm_dtype: str, backend: str) -> Profile:
    """A one-range ring profile, for e2e on a machine the model cannot describe (no topology)."""
    return Profile(source="model", backend=backend if backend in ("nccl", "gloo") else "model",
                   world_size=world_size, nodes=nodes, comm_dtype=comm_dtype, bucket_cap_mb=25.0,
                   bucket_reason="no topology to model: DDP's default 25 MiB", table=[TableEntry(0, None, "ring")],
                   versions=software_versions(), notes=["no topology: one range, ring"])


def profile_from_choice(decided: Dict[int, Dict[str, Any]], formats: Sequence[str], base: Optional[Profile],
                        world_size: int, nodes: int, backend: str, bucket_cap_mb: Optional[float] = None) -> Profile:
    """A profile whose format table is online tuning's choice (``decided``: per bucket index, its ``format`` and
    ``elements``), by bucket size, for ``comm_dtype="auto"`` in the next run: ``base`` (the profile the job
    followed) with that table, else a one-range ring profile. Of buckets of one size given different formats, the
    first's holds.

    Its ``source`` is ``online`` and its bucket size the job's (``bucket_cap_mb``, DDP's; None: unknown, the base's
    or DDP's default kept, and said so): the formats were measured on the job's own buckets, so a run that follows
    the profile should build the same ones (``ddp_kwargs``)."""
    by_size = sorted((d["elements"] * 4, i, d["format"]) for i, d in decided.items())
    table: List[FormatRange] = []
    for grad_bytes, index, name in by_size:
        if table and grad_bytes <= table[-1].max_bytes:
            continue  # the same size as the bucket before, in another format: the first's holds
        if table and table[-1].format == name:
            table[-1] = FormatRange(table[-1].min_bytes, grad_bytes, name, table[-1].reason)
            continue
        if table:
            cut = (table[-1].max_bytes + grad_bytes) // 2
            table[-1] = FormatRange(table[-1].min_bytes, cut, table[-1].format, table[-1].reason)
        table.append(FormatRange(table[-1].max_bytes + 1 if table else 0, grad_bytes, name,
                                 f"chosen online for bucket {index}"))
    table[-1] = FormatRange(table[-1].min_bytes, None, table[-1].format, table[-1].reason)
    notes = [f"formats chosen online by the job's own steps over buckets {sorted(decided)}"]
    choice = FormatChoice(source="measured", allowed=list(formats), admitted=list(formats), table=table,
                          notes=notes)
    profile = base if base is not None else fallback_profile(world_size, nodes, "bfloat16", backend)
    if base is not None:
        notes = [*notes, f"the algorithm table is that of the profile the job followed (source={base.source})"]
    if bucket_cap_mb is not None:
        mb, reason = bucket_cap_mb, "the job's DDP bucket_cap_mb, on whose buckets online tuning chose the formats"
    else:
        mb, reason = profile.bucket_cap_mb, (f"{profile.bucket_cap_mb:g} MiB: the job's bucket size is unknown "
                                             "(its hook was registered without ddp_triton.register)")
    return dataclasses.replace(profile, source="online", bucket_cap_mb=mb, bucket_reason=reason, formats=choice,
                               notes=[*profile.notes, *notes])
