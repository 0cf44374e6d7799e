"""What the hook did per bucket, for a user to see: profiler ranges, bytes on the wire, timings, a summary table.

Three pieces, each costing nothing a step does not need:

- **Profiler ranges.** While a profiler records (``profiler_active``: a Python flag and one C call per bucket
  otherwise), the hook wraps its pack, the collective's launch and its unpack in ``torch.profiler.record_function``
  ranges named ``ddp_triton.pack bucket 3 (6.25 MiB)``, ``ddp_triton.all_reduce bucket 3 (...)``,
  ``ddp_triton.unpack bucket 3 (...)``. The unpack runs where the collective's future completes: with NCCL inline on
  the autograd thread (its futures complete at launch), with gloo on gloo's own thread when the all-reduce finishes
  late, which ``torch.profiler`` records only when told to record every thread (``experimental_config=
  torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`` in recent torch); otherwise those unpack
  ranges are missing from the trace while pack and launch ranges are all there.
- **Bytes on the wire**: what each pass hands to the collectives, per wire format, fixed when the bucket binds
  (``BucketRecord.pass_bytes``), and the passes counted as the collectives are issued: one integer addition per
  bucket. A sharded exchange counts its all-to-all's buffer, once: with its all-gather it sends what a ring
  all-reduce of that buffer sends (2(N-1)/N of it per rank), so the counts of all formats compare as message
  sizes, the way NCCL's own tests size an all-reduce.
- **Timings**, with ``CommState(timing=True)`` only: pack, communication (from the collective's launch to the start
  of its unpack, in stream order) and unpack of each bucket in the latest pass. On CUDA tensors they are CUDA
  events recorded on the tensors' stream and read back only in ``summary()`` (which waits for them: the step never
  synchronises); on CPU tensors, where pack and unpack run on the host, ``time.perf_counter`` around them, labelled
  ``host perf_counter`` (the communication time then includes the wait for gloo's thread to run the callback).
  A phase that runs more than once in a pass (a bucket cut into chunks, a stage name two stages share) is timed
  from its first start to its last end: the span the bucket spent in it.
- **Rounding**, for the block-scaled formats (FP8, E2M1): on a bucket's first pass and every ``ROUNDING_EVERY``-th
  after, its exchange measures what its quantization lost (``RoundingSample``): the norm of the rounding of what
  this rank sent, against the norm of what it meant to send (its gradients' share plus what error feedback owed),
  and the norm of what error feedback owes after it. One dequantize and three dot products of the bucket on the
  sampled passes, kept on the device; ``summary()`` reads them.

A bucket path of its own (another wire format) plugs in the same way as the hook's (``plan.py``): it gives its
``BucketRecord`` the format's name and bytes per pass when it binds and counts ``passes`` when it sends; ``watch``
and its phases take any phase name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.autograd import profiler as _autograd_profiler

from ..dtypes import normalize_dtype

#: The clock of the timings: CUDA events on CUDA tensors, the host's perf_counter on CPU tensors.
CUDA_EVENTS = "cuda events"
HOST_CLOCK = "host perf_counter"


#: What ends the name of bytes that stay inside a node (a two-level exchange's reduce-scatter and all-gather).
IN_NODE = " (node)"

#: A block-scaled bucket measures its rounding on its first pass and then every this many passes.
ROUNDING_EVERY = 64


def human_bytes(n: float) -> str:
    """``6553600`` -> ``"6.25 MiB"`` (binary units, three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"  # unreachable; keeps type checkers calm


@dataclass
class BucketRecord:
    """One bucket's telemetry: its index, what each pass hands to the collectives (fixed when the bucket binds), how
    many passes it was sent in, and (with timing) its latest pass's marks."""

    index: Optional[int] = None
    """DDP's index of the bucket (``GradBucket.index()``)."""
    wire_format: str = ""
    """The bucket's wire format as the summary names it ("bfloat16", "float32 (AVG)", "fp8e4m3+ef", ...)."""
    pass_bytes: Dict[str, int] = field(default_factory=dict)
    """Bytes handed to collectives in one pass, per wire format."""
    collectives_per_pass: int = 1
    """Collectives issued for the bucket in one pass."""
    passes: int = 0
    """Passes the bucket was sent in (counted as its collectives are issued)."""
    last_used: int = 0
    """The state's backward-pass count when the bucket was last sent (stale buckets are dropped)."""
    marks: Dict[str, list] = field(default_factory=dict, repr=False)
    """Timing: phase -> [start, end], CUDA events or perf_counter seconds, overwritten every pass."""
    clock: Optional[str] = None
    """CUDA_EVENTS or HOST_CLOCK once timed; None before."""
    labels: Dict[str, str] = field(default_factory=dict, repr=False)
    """Profiler range names per phase, made once."""
    rounding: List["RoundingSample"] = field(default_factory=list, repr=False)
    """Block-scaled formats: what each of the bucket's quantizations (one per chunk) measured of its rounding."""

    @property
    def sent_bytes(self) -> Dict[str, int]:
        """Bytes handed to collectives over every pass, per wire format."""
        return {fmt: n * self.passes for fmt, n in self.pass_bytes.items()}

    @property
    def collectives(self) -> int:
        """Collectives issued for the bucket over every pass."""
        return self.collectives_per_pass * self.passes

    def label(self, phase: str, bucket_bytes: int) -> str:
        name = self.labels.get(phase)
        if name is None:
            name = self.labels[phase] = f"ddp_triton.{phase} bucket {self.index} ({human_bytes(bucket_bytes)})"
        return name


class RoundingSample:
    """What one block-scaled quantization (a bucket's, or one chunk's) lost, measured on a sampled pass: float32
    ``sums`` = [squared norm of the rounding, of what was meant to be sent, of what error feedback owes after it],
    on the bucket's device, and the state's pass they were measured in (from 1; 0: not yet)."""

    __slots__ = ("sums", "at_pass")

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, dtype=torch.float32, device=device)
        self.at_pass = 0

    @staticmethod
    def due(passes: int) -> bool:
        """Whether a bucket's ``passes``-th pass measures its rounding: the first, then every ``ROUNDING_EVERY``."""
        return passes % ROUNDING_EVERY == 1 or ROUNDING_EVERY == 1


def wire_name(dtype: torch.dtype) -> str:
    """A dtype as a wire format's name: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return normalize_dtype(dtype)


# ---- profiler ranges and timing -------------------------------------------------------------------------------------


def profiler_active() -> bool:
    """Whether a profiler records: torch's Python-level flag (set by ``torch.profiler.profile``, also when it
    records every thread), else the calling thread's profiler state (``emit_nvtx`` and other direct uses)."""
    return getattr(_autograd_profiler, "_is_profiler_enabled", False) or torch.autograd._profiler_enabled()


def watch(timing: bool, comm: Any) -> Optional["Watch"]:
    """The bucket's phases to record this pass: None (the hook's plain path) unless a profiler records or
    ``timing`` (the state's) is on."""
    profiling = profiler_active()
    if not (profiling or timing):
        return None
    if timing and comm.buffer.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("triton_hook: CommState(timing=True) cannot time a step captured in a CUDA graph (its "
                           "events would be recorded once, at capture); build the state without timing, and time "
                           "graph replays from outside")
    return Watch(comm, profiling, timing)


class Watch:
    """Ranges and timing marks around one bucket's phases in one pass (see the module docstring)."""

    __slots__ = ("record", "profiling", "timing", "device", "nbytes", "started")

    def __init__(self, comm: Any, profiling: bool, timing: bool) -> None:
        self.record: BucketRecord = comm.record
        self.profiling, self.timing = profiling, timing
        self.started: set = set()
        """Phases whose start this pass has marked: a phase's later starts in the pass keep the first."""
        self.device = comm.buffer.device
        self.nbytes = comm.buffer.numel() * comm.buffer.element_size()
        if timing:
            self.record.clock = CUDA_EVENTS if self.device.type == "cuda" else HOST_CLOCK

    def phase(self, name: str) -> "_Phase":
        """A context manager around phase ``name`` ("pack", "all_reduce", ...): its profiler range, and with timing
        its marks. The first communication phase of the pass ("all_reduce", "all_to_all", ...) also starts "comm"."""
        return _Phase(self, name)

    def unpack(self, unpack: Callable[[], None]) -> Callable[[], None]:
        """``unpack`` wrapped in its range and marks, to run where the collective's future completes. Its start ends
        the "comm" mark."""

        def run() -> None:
            if self.timing:
                self.mark("comm", 1)
            with _Phase(self, "unpack"):
                unpack()

        return run

    def mark(self, phase: str, end: int) -> None:
        if not end:
            if phase in self.started:
                return
            self.started.add(phase)
        marks = self.record.marks.get(phase)
        if marks is None:
            marks = self.record.marks[phase] = [None, None]
        if self.device.type == "cuda":
            event = marks[end]
            if event is None:
                event = marks[end] = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        else:
            marks[end] = time.perf_counter()
            if not end and marks[1] is not None:
                marks[1] = None  # a new pass: the old end no longer belongs to this start


_COMM_PHASES = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter", "collective")


class _Phase:
    __slots__ = ("watch", "name", "range")

    def __init__(self, watch: Watch, name: str) -> None:
        self.watch, self.name, self.range = watch, name, None

    def __enter__(self) -> "_Phase":
        w = self.watch
        if w.profiling:
            self.range = torch.profiler.record_function(w.record.label(self.name, w.nbytes))
            self.range.__enter__()
        if w.timing:
            if self.name in _COMM_PHASES:
                w.mark("comm", 0)
            w.mark(self.name, 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        w = self.watch
        if w.timing:
            w.mark(self.name, 1)
        if self.range is not None:
            self.range.__exit__(*exc)


# ---- the summary -----------------------------------------------------------------------------------------------------


@dataclass
class BucketSummary:
    """One bucket of the latest backward pass."""

    index: Optional[int]
    """DDP's bucket index."""
    dtype: str
    """The gradients' (bucket's) dtype."""
    elements: int
    bucket_bytes: int
    """Bytes of DDP's bucket buffer."""
    wire_format: str
    """What travels: the comm dtype, "(AVG)" where the collective averages, or a bucket path's own format."""
    algorithm: str
    """The NCCL algorithm group the bucket was sent to ("NCCL's choice" without a profile; the backend's name
    off NCCL)."""
    wire_bytes: Dict[str, int]
    """Bytes handed to collectives for this bucket in the latest pass, per wire format."""
    wire_bytes_total: Dict[str, int]
    """... over every pass the state has seen."""
    collectives: int
    """Collectives issued for this bucket over every pass."""
    pack_ms: Optional[float] = None
    comm_ms: Optional[float] = None
    unpack_ms: Optional[float] = None
    """Timings of the latest pass (``timing=True``); None without."""
    rounding_error: Optional[float] = None
    """Block-scaled formats: the norm of what this rank's quantization lost, over the norm of what it meant to send
    (its share of the gradients plus what error feedback owed), at pass ``rounding_pass``; None for other formats."""
    residual_norm: Optional[float] = None
    """With error feedback: the norm of what it owes after that pass (both stages, this rank's), over the same norm."""
    residual_bytes: Optional[int] = None
    """With error feedback: the memory of this rank's residuals of the bucket (bfloat16)."""
    rounding_pass: Optional[int] = None
    """The state's pass (from 1) the rounding was measured in: the bucket's first, then its every
    ``ROUNDING_EVERY``-th."""

    @property
    def sent(self) -> int:
        """Bytes on the wire for this bucket in the latest pass, all formats."""
        return sum(self.wire_bytes.values())


@dataclass
class Summary:
    """What ``CommState.summary()`` returns; ``print`` it for a table."""

    buckets: List[BucketSummary]
    """The buckets of the latest backward pass, by DDP's index."""
    passes: int
    """Backward passes the state has averaged."""
    world_size: Optional[int]
    backend: Optional[str]
    clock: Optional[str]
    """How the timings were taken: CUDA_EVENTS, HOST_CLOCK, or None (no timing)."""

    @property
    def wire_bytes_per_step(self) -> int:
        """Bytes handed to collectives in the latest pass, over its buckets."""
        return sum(b.sent for b in self.buckets)

    @property
    def between_nodes_bytes_per_step(self) -> int:
        """Bytes handed to collectives that cross nodes in the latest pass: all of them but a two-level exchange's
        inside its nodes."""
        return sum(n for b in self.buckets for fmt, n in b.wire_bytes.items() if not fmt.endswith(IN_NODE))

    @property
    def fp32_bytes_per_step(self) -> int:
        """What the same gradients would send as float32 (DDP's default all-reduce of float32 gradients)."""
        return sum(b.elements * 4 for b in self.buckets)

    def headline(self) -> str:
        """One line: buckets, bytes on the wire per step against float32, the algorithm per bucket."""
        if not self.buckets:
            return "ddp_triton: no backward pass through the hook yet"
        sent, fp32 = self.wire_bytes_per_step, self.fp32_bytes_per_step
        algorithms = ", ".join(b.algorithm for b in self.buckets)
        n = len(self.buckets)
        between = self.between_nodes_bytes_per_step
        crossing = "" if between == sent else \
            f", {human_bytes(between)} of it between nodes ({between / fp32:.2f}x float32's)"
        return (f"ddp_triton: {n} bucket{'s' if n != 1 else ''}, {human_bytes(sent)} on the wire per step "
                f"({sent / fp32:.2f}x float32's {human_bytes(fp32)}{crossing}), algorithm per bucket: {algorithms}")

    def __str__(self) -> str:
        timed = self.clock is not None
        rounded = any(b.rounding_pass is not None for b in self.buckets)
        headers = ["bucket", "dtype", "bucket bytes", "wire format", "on the wire (last pass)", "algorithm"]
        if timed:
            headers += ["pack ms", "comm ms", "unpack ms"]
        if rounded:
            headers += ["rounding (rel.)", "residual (rel.)", "residual memory", "measured at pass"]
        rows = []
        for b in self.buckets:
            wire = ", ".join(f"{human_bytes(n)} {fmt}" for fmt, n in b.wire_bytes.items()) or "-"
            row = [str(b.index), b.dtype, human_bytes(b.bucket_bytes), b.wire_format, wire, b.algorithm]
            if timed:
                row += [_ms(b.pack_ms), _ms(b.comm_ms), _ms(b.unpack_ms)]
            if rounded:
                row += [_rel(b.rounding_error), _rel(b.residual_norm),
                        "-" if b.residual_bytes is None else human_bytes(b.residual_bytes),
                        "-" if b.rounding_pass is None else str(b.rounding_pass)]
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(self.headline())
        if timed:
            lines.append(f"timings of the latest pass, by {self.clock}"
                         + (" (CPU tensors: no CUDA events; comm includes gloo's callback wait)"
                            if self.clock == HOST_CLOCK else ""))
        if rounded:
            lines.append(f"rounding: what this rank's quantization lost, over what it meant to send (its gradients' "
                         f"share and what error feedback owed); residual: what error feedback owes after it; "
                         f"measured on a bucket's first pass and every {ROUNDING_EVERY}th")
        return "\n".join(lines)


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rel(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}"


def elapsed_ms(marks: Optional[list]) -> Optional[float]:
    """Milliseconds between a phase's start and end marks; waits for CUDA events (only ``summary`` calls this)."""
    if not marks or marks[0] is None or marks[1] is None:
        return None
    start, end = marks
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return start.elapsed_time(end)


def summarize(entries: List[Any], *, passes: int, world_size: Optional[int], backend: Optional[str],
              timing: bool) -> Summary:
    """The summary of ``entries`` (BucketComm, a state's latest pass) of a state that has averaged ``passes`` passes
    over ``world_size`` ranks on ``backend``, with ``timing`` on or off."""
    rows = []
    for e in sorted(entries, key=lambda e: (e.record.index is None, e.record.index or 0)):
        record: BucketRecord = e.record
        algorithm = e.algorithm or ("NCCL's choice" if backend == "nccl" else (backend or "-"))
        timed = record.clock is not None and timing
        rounding = _rounding(record.rounding, getattr(e, "residuals", None))
        rows.append(BucketSummary(
            index=record.index, dtype=wire_name(e.buffer.dtype), elements=e.buffer.numel(),
            bucket_bytes=e.buffer.numel() * e.buffer.element_size(), wire_format=record.wire_format,
            algorithm=algorithm, wire_bytes=dict(record.pass_bytes), wire_bytes_total=record.sent_bytes,
            collectives=record.collectives,
            pack_ms=elapsed_ms(record.marks.get("pack")) if timed else None,
            comm_ms=elapsed_ms(record.marks.get("comm")) if timed else None,
            unpack_ms=elapsed_ms(record.marks.get("unpack")) if timed else None,
            **rounding,
        ))
    clocks = {e.record.clock for e in entries if e.record.clock is not None}
    clock = (clocks.pop() if len(clocks) == 1 else "mixed") if clocks and timing else None
    return Summary(buckets=rows, passes=passes, world_size=world_size, backend=backend, clock=clock)


def _rounding(samples: List[RoundingSample], residuals: Any) -> Dict[str, Any]:
    """A bucket's rounding fields of its summary from its chunks' samples of their latest measured pass (waits for
    them on CUDA: only ``summary`` calls this); none before a measured pass, or for a format without blocks."""
    at_pass = max((s.at_pass for s in samples), default=0)
    if not at_pass:
        return {}
    lost, meant, owed = torch.stack([s.sums for s in samples if s.at_pass == at_pass]).sum(0).tolist()
    scale = meant ** 0.5
    out: Dict[str, Any] = {"rounding_error": (lost ** 0.5 / scale) if scale > 0 else 0.0, "rounding_pass": at_pass}
    if residuals is not None:
        out["residual_norm"] = (owed ** 0.5 / scale) if scale > 0 else 0.0
        out["residual_bytes"] = residuals.first.nbytes + residuals.second.nbytes
    return out
