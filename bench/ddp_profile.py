"""Turn a chrome trace of ``python -m bench.ddp_step --profile`` into tables: host and GPU time per bucket and per
step.

The trace holds the ranges bench.ddp_step records (``ddp_step.step``, ``.forward``, ``.backward``, and
``ddp_step.hook bucket N`` around every comm hook's call, torch's hooks too), triton_hook's own ranges and the
profiler's events. Per bucket: host time in the hook's call, in the hook's pack, in the collective's call
(triton_hook's ``ddp_triton.all_reduce`` range, else torch's ``c10d::`` ops inside the hook; without a hook the
reducer's own ``c10d::`` calls, k-th call = bucket k), in the completion (``ddp_triton.unpack``), and the compute
stream's idle time on the GPU while the host was in that bucket's hook. Per step: the compute stream's idle gaps
during the backward (the gaps between consecutive kernel, memcpy and memset events on the stream that runs most of
them, over the span of the backward's own GPU work) and DDP's own ranges. Means over the profiled steps. A trace of
a CPU run has no CUDA events: the GPU columns are None ("n/a").

Reading only: nothing here imports torch's profiler or runs a step, so a synthetic trace can be analysed anywhere.
"""

from __future__ import annotations

import bisect
import re
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from bench.common import format_table

#: The ranges bench.ddp_step records around each profiled step, its forward and its backward.
STEP_RANGE = "ddp_step.step"
FORWARD_RANGE = "ddp_step.forward"
BACKWARD_RANGE = "ddp_step.backward"
#: The range bench.ddp_step puts around every comm hook's call in --profile (torch's hooks too).
HOOK_RANGE = re.compile(r"^ddp_step\.hook bucket (\d+)$")
#: triton_hook's own ranges (ddp_triton/runtime/telemetry.py): pack, the collective phase(s), unpack; the float32
#: sums' exchange also has a local "reduce" between its all-to-all and all-gather.
TRITON_RANGE = re.compile(r"^ddp_triton\.(\w+) bucket (\d+) \(")
#: The phases of TRITON_RANGE that are a collective's call.
COLLECTIVE_PHASES = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter", "collective")
#: Collective calls through the dispatcher (ProcessGroup.allreduce, dist.all_reduce, DDP's reducer).
COLLECTIVE_OP = "c10d::"
#: DDP's own ranges: the forward's, and the reducer's (gradient copies into and out of the buckets, ...).
DDP_RANGE = re.compile(r"^(DistributedDataParallel|torch\.distributed\.ddp|torch::distributed::reducer)")
#: Trace categories of work on a GPU stream (not "gpu_user_annotation", which only mirrors host ranges there).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Host-side launch records, whose "correlation" names the GPU event they launched.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")

Interval = Tuple[float, float]


def _span(event: Dict[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def merge(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, non-overlapping union of ``intervals``."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def idle_gaps(events: Sequence[Interval]) -> List[Interval]:
    """The gaps between consecutive events of one stream (by start; an event inside an earlier one is no gap)."""
    gaps: List[Interval] = []
    end: Optional[float] = None
    for start, stop in sorted(events):
        if end is not None and start > end:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def _within(events: List[Tuple[float, float, Dict[str, Any]]], starts: List[float], window: Interval
            ) -> List[Tuple[float, float, Dict[str, Any]]]:
    """The events (sorted by start, ``starts`` their starts) that start inside ``window``."""
    return events[bisect.bisect_left(starts, window[0]):bisect.bisect_right(starts, window[1])]


def backward_gpu_span(stream: Sequence[Tuple[float, float, Dict[str, Any]]], launches: Dict[Any, float],
                      backward: Interval, step: Interval) -> Interval:
    """Where the backward's work runs on ``stream`` (GPU events, sorted by start): from the first event launched
    during the ``backward`` host range to the first event launched after it within the ``step`` (the clip's or the
    optimizer's; in stream order nothing of the backward runs later), else the step's end. Events without a launch
    record (a launch path the profiler does not see) then still count by where they ran. Without any launch record
    in the backward, the host range itself (the GPU's clock is the profiler's common one)."""
    first: Optional[float] = None
    end = step[1]
    for start, _, event in stream:
        at = launches.get(event.get("args", {}).get("correlation"))
        if at is None:
            continue
        if backward[0] <= at <= backward[1]:
            first = start if first is None else min(first, start)
        elif backward[1] < at <= step[1]:
            end = min(end, start)
    if first is None:
        return backward
    return first, end


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def analyse_trace(trace: Dict[str, Any]) -> Dict[str, Any]:
    """Per bucket and per step, from a chrome trace that bench.ddp_step's ``profile_variant`` wrote (a dict: its JSON).

    Returns ``{"steps": n, "buckets": [row per bucket index], "step": {...}, "ddp_ranges": {name: us per step},
    "gpu": bool}``: every time in microseconds, means over the trace's ``ddp_step.step`` ranges (a bucket's mean
    over the steps it appears in). GPU fields are None where the trace holds no GPU events (CPU runs).

    Host times are the ranges' durations on whichever thread ran them (every thread where the profiler recorded
    them all). GPU idle: on the compute stream (the stream with the most non-NCCL events), the backward's span
    (``backward_gpu_span``: launch records matched to GPU events through their "correlation"); its idle time is the
    sum of the gaps between consecutive events that start in that span. A bucket's ``gpu_idle_in_hook_us`` is the
    part of those gaps that fell while the host was in that bucket's hook (its hook range and unpack, or for no hook
    its collective call), on the profiler's common clock. ``other_us``: triton_hook phases that are neither pack,
    collective nor unpack (the float32 sums' local reduce).
    """
    host: List[Tuple[float, float, Dict[str, Any]]] = []
    gpu: List[Tuple[float, float, Dict[str, Any]]] = []
    launches: Dict[Any, float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = e.get("cat")
        start, end = _span(e)
        if cat in GPU_CATEGORIES:
            gpu.append((start, end, e))
        elif cat != "gpu_user_annotation":
            host.append((start, end, e))
            if cat in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = start
    host.sort(key=lambda t: t[0])
    host_starts = [t[0] for t in host]

    compute: List[Tuple[float, float, Dict[str, Any]]] = []
    stream_name: Optional[str] = None
    if gpu:
        counts: Dict[Tuple[Any, Any], int] = {}
        for _, _, e in gpu:
            if not str(e.get("name", "")).lower().startswith("nccl"):
                key = (e.get("pid"), e.get("tid"))
                counts[key] = counts.get(key, 0) + 1
        if counts:
            key = max(counts, key=counts.__getitem__)
            stream_name = f"device {key[0]} {key[1]}"
            compute = sorted((t for t in gpu if (t[2].get("pid"), t[2].get("tid")) == key), key=lambda t: t[0])
    compute_starts = [t[0] for t in compute]

    steps = [(s, e) for s, e, ev in host if ev.get("name") == STEP_RANGE]
    per_bucket: Dict[int, List[Dict[str, Optional[float]]]] = {}
    per_step: List[Dict[str, Optional[float]]] = []
    ddp_ranges: Dict[str, float] = {}
    for window in steps:
        events = _within(host, host_starts, window)
        backward = next(((s, e) for s, e, ev in events if ev.get("name") == BACKWARD_RANGE), window)

        # Host ranges per bucket.
        hooks: Dict[int, List[Tuple[float, float, Any]]] = {}
        phases: Dict[int, Dict[str, List[Interval]]] = {}
        collective_calls: List[Tuple[float, float, Any]] = []
        for s, e, ev in events:
            name = str(ev.get("name", ""))
            m = HOOK_RANGE.match(name)
            if m:
                hooks.setdefault(int(m.group(1)), []).append((s, e, ev.get("tid")))
                continue
            m = TRITON_RANGE.match(name)
            if m:
                phase = m.group(1)
                if phase not in ("pack", "unpack"):
                    phase = "collective" if phase in COLLECTIVE_PHASES else "other"
                phases.setdefault(int(m.group(2)), {}).setdefault(phase, []).append((s, e))
                continue
            if name.startswith(COLLECTIVE_OP):
                collective_calls.append((s, e, ev.get("tid")))
            elif DDP_RANGE.match(name):
                ddp_ranges[name] = ddp_ranges.get(name, 0.0) + (e - s)

        def calls_inside(s: float, e: float, tid: Any) -> List[Interval]:
            return [(cs, ce) for cs, ce, ct in collective_calls if ct == tid and s <= cs and ce <= e]

        buckets: Dict[int, Dict[str, Any]] = {}
        for index in sorted(set(hooks) | set(phases)):
            ranges = phases.get(index, {})
            spans = hooks.get(index, [])
            if "collective" in ranges:
                collective: Optional[float] = length(ranges["collective"])
            else:
                inside = [iv for s, e, tid in spans for iv in calls_inside(s, e, tid)]
                collective = length(inside) if inside else None
            host_intervals = [(s, e) for s, e, _ in spans] or [iv for ivs in ranges.values() for iv in ivs]
            host_intervals += ranges.get("unpack", [])
            buckets[index] = {
                "hook_us": sum(e - s for s, e, _ in spans) if spans else None,
                "pack_us": sum(e - s for s, e in ranges["pack"]) if "pack" in ranges else None,
                "collective_us": collective,
                "unpack_us": sum(e - s for s, e in ranges["unpack"]) if "unpack" in ranges else None,
                "other_us": sum(e - s for s, e in ranges["other"]) if "other" in ranges else None,
                "host": merge(host_intervals),
            }
        if not buckets:  # no hook: DDP's reducer calls the collective itself, bucket by bucket in index order
            calls = [c for c in collective_calls if backward[0] <= c[0] <= backward[1]]
            top = [c for c in calls
                   if not any(o is not c and o[2] == c[2] and o[0] <= c[0] and c[1] <= o[1] for o in calls)]
            for index, (s, e, _) in enumerate(sorted(top, key=lambda c: c[0])):
                buckets[index] = {"hook_us": None, "pack_us": None, "collective_us": e - s, "unpack_us": None,
                                  "other_us": None, "host": [(s, e)]}

        # The compute stream during the backward.
        gaps: Optional[List[Interval]] = None
        busy = events_in_backward = None
        if compute:
            span = backward_gpu_span(compute, launches, backward, window)
            running = [(s, e) for s, e, _ in _within(compute, compute_starts, span) if s < span[1]]
            gaps = idle_gaps(running)
            busy, events_in_backward = length(running), float(len(running))
        for index, row in buckets.items():
            row["gpu_idle_in_hook_us"] = overlap(merge(gaps), row.pop("host")) if gaps is not None else None
            per_bucket.setdefault(index, []).append(row)

        def bucket_sum(field: str) -> Optional[float]:
            values = [r[field] for r in buckets.values() if r[field] is not None]
            return sum(values) if values else None

        per_step.append({
            "step_ms": (window[1] - window[0]) / 1e3,
            "backward_us": backward[1] - backward[0],
            "buckets": float(len(buckets)),
            "hook_us": bucket_sum("hook_us"),
            "collective_us": bucket_sum("collective_us"),
            "gpu_busy_backward_us": busy,
            "gpu_idle_backward_us": sum(e - s for s, e in gaps) if gaps is not None else None,
            "gpu_gaps_backward": float(len(gaps)) if gaps is not None else None,
            "gpu_events_backward": events_in_backward,
        })

    fields = ("hook_us", "pack_us", "collective_us", "unpack_us", "other_us", "gpu_idle_in_hook_us")
    rows = [{"bucket": index, **{f: _mean([r[f] for r in seen]) for f in fields}, "steps": len(seen)}
            for index, seen in sorted(per_bucket.items())]
    step_fields = per_step[0].keys() if per_step else ()
    summary = {f: _mean([s[f] for s in per_step]) for f in step_fields}
    summary["compute_stream"] = stream_name
    return {"steps": len(steps), "buckets": rows, "step": summary, "gpu": bool(compute),
            "ddp_ranges": {name: total / len(steps) for name, total in sorted(ddp_ranges.items())}}


BUCKET_HEADERS = ["bucket", "hook us", "pack us", "collective us", "unpack us", "GPU idle in hook us"]
STEP_HEADERS = ["variant", "bucket view", "buckets", "step ms (profiled)", "backward us", "hook us/step",
                "collective us/step", "GPU busy bwd us", "GPU idle bwd us", "GPU gaps bwd"]


def _gpu_cell(value: Optional[float], gpu: bool) -> Any:
    return value if gpu else "n/a"


def bucket_table(result: Dict[str, Any]) -> str:
    """The per-bucket table of one profiled variant (GPU column "n/a" without CUDA events)."""
    return format_table(BUCKET_HEADERS, [[r["bucket"], r["hook_us"], r["pack_us"], r["collective_us"],
                                          r["unpack_us"], _gpu_cell(r["gpu_idle_in_hook_us"], result["gpu"])]
                                         for r in result["buckets"]])


def step_table(results: Sequence[Dict[str, Any]]) -> str:
    """One row per profiled variant: the step's totals and the compute stream's idle time in the backward."""
    rows = []
    for r in results:
        s, gpu = r["step"], r["gpu"]
        rows.append([r["variant"], r["gradient_as_bucket_view"], s.get("buckets"), s.get("step_ms"),
                     s.get("backward_us"), s.get("hook_us"), s.get("collective_us"),
                     _gpu_cell(s.get("gpu_busy_backward_us"), gpu), _gpu_cell(s.get("gpu_idle_backward_us"), gpu),
                     _gpu_cell(s.get("gpu_gaps_backward"), gpu)])
    return format_table(STEP_HEADERS, rows)
