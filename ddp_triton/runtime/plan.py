"""A bucket's Plan: its path decided once, when it binds, and run as one straight line at every step.

``plan_bucket`` reads everything that cannot change between steps from the state's ``Context`` (the wire format
for the bucket's size, the group and NCCL algorithm, the averaging factors, the node groups) and builds the
bucket's exchange (``exchange.py``): its buffers, its kernels' prepared calls fixed to them, and collectives.
``Plan.run`` then packs, issues the collective through the process group's own call and returns the future DDP
waits on, which completes once the bucket holds the mean. Every plan is an exchange of stages:

- one all-reduce (the bucket itself, or a comm-dtype copy): run here, the unpack on the all-reduce's completion.
  NCCL completes its futures at launch (stream order), so the unpack runs inline; gloo completes them on its own
  thread. Where buckets mix formats and some are staged, it goes through the state's queue instead.
- the formats summed in float32 (all-to-all, float32 sum, all-gather) and the two-level exchange (``two_level.py``:
  reduce-scatter in the node, the format between nodes, all-gather in the node): through the state's queue, which
  issues every collective in one order on every rank.

A failed collective fails the future: the backward fails on this rank instead of training on with local gradients,
with a message naming the collective and the bucket (``collective_errors.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat
from .collective_errors import collective_error
from .context import Context
from .chunks import chunk_count
from .exchange import ChunkedExchange, ExchangeQueue, StagedExchange, nothing
from .grad_stats import BucketCoverage, new_stats
from .residuals import LayoutResiduals
from .telemetry import BucketRecord, Watch, wire_name
from .two_level import two_level_exchange
from .wire_exchanges import (all_reduce_exchange, block_fp8_exchange, chunked_fp8_exchange, float32_sum_exchange,
                             fp8_chunk_layouts)


@dataclass(frozen=True, eq=False)
class Plan:
    """One bucket's bound path: DDP's bucket buffer, its exchange, and what the state reads of it (statistics,
    telemetry, residuals)."""

    buffer: torch.Tensor
    """DDP's bucket buffer; holding it keeps its address (and Python object) this bucket's while the plan lives."""
    exchange: Union[StagedExchange, ChunkedExchange]
    queue: Optional[ExchangeQueue]
    """The state's queue, for an exchange of several collectives; None: one all-reduce, issued here."""
    wire_buffer: torch.Tensor
    """What the first collective is handed: the bucket itself, its comm-dtype copy, or the exchange's bytes."""
    algorithm: Optional[str]
    """The NCCL algorithm group an all-reduce is sent to; None: NCCL's own choice (or not NCCL, or staged)."""
    stats: Optional[torch.Tensor]
    """With ``grad_stats``: float32 (2,) that the unpack overwrites with [sum of squares, non-finite count]."""
    coverage: Optional[BucketCoverage]
    """With ``grad_stats``: the bucket's parameters and what their gradients were at the pass's end."""
    residuals: Optional[LayoutResiduals]
    """FP8 with error feedback: this bucket layout's residuals."""
    record: BucketRecord
    """Telemetry: what each pass hands to the collectives, the passes, timings (``telemetry.py``)."""
    start: Callable[..., torch.futures.Future] = field(init=False, repr=False)
    """How the queue starts the exchange (``ExchangeQueue.starter``: for its kind and device, chosen once)."""

    def __post_init__(self) -> None:
        if self.queue is not None:
            object.__setattr__(self, "start", self.queue.starter(self.exchange))

    @property
    def valid(self) -> bool:
        """False once its residuals moved to another layout: the bucket must bind again."""
        return self.residuals is None or self.residuals.alive

    def run(self, last: bool) -> torch.futures.Future:
        """Send the bucket; the future completes once DDP's bucket holds the mean. ``last``: the backward's last."""
        self.record.passes += 1
        if self.queue is not None:
            return self.start(self.exchange, last)
        stage = self.exchange.stages[0]
        stage.compute()
        return stage.issue().get_future().then(self._finish)

    def run_watched(self, last: bool, watch: Watch) -> torch.futures.Future:
        """``run``, with profiler ranges and timing marks around its phases."""
        self.record.passes += 1
        if self.queue is not None:
            return self.start(self.exchange, last, watch)
        stage = self.exchange.stages[0]
        with watch.phase(stage.compute_phase):
            stage.compute()
        with watch.phase(stage.collective_phase):
            reduced = stage.issue().get_future()
        unpack = watch.unpack(self.exchange.finish)
        return reduced.then(lambda fut: self._finish(fut, unpack))

    def _finish(self, fut: torch.futures.Future, unpack: Optional[Callable[[], None]] = None) -> torch.Tensor:
        try:
            fut.value()  # raises if the all-reduce failed: the backward fails instead of training on local gradients
        except Exception as exc:  # noqa: BLE001 - whatever the backend raised is this all-reduce's failure
            raise collective_error("all_reduce", self.exchange.subject, exc) from exc
        (unpack or self.exchange.finish)()  # on CUDA this runs on a stream ordered after the all-reduce
        return self.buffer


def collective_averages(backend: str, on_cuda: bool, comm_dtype: torch.dtype, bucket_dtype: torch.dtype,
                        algorithm: Optional[str]) -> bool:
    """Whether a bucket can be averaged by the collective itself (NCCL's AVG), with no kernel on either side.

    Only when it travels in its own dtype through NCCL on CUDA, not in float16 (whose division is split around
    the sum), and not over NVLS: NCCL implements a float AVG as a pre-multiplied sum, which NVLS does not run.
    """
    nvls = algorithm is not None and algorithm.startswith("nvls")
    return (backend == "nccl" and on_cuda and comm_dtype == bucket_dtype and comm_dtype != torch.float16
            and not nvls)


def refuse_during_capture(buffer: torch.Tensor) -> None:
    """Binding allocates, and may zero residuals or run collectives: kernels a CUDA graph would replay each step."""
    if buffer.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("triton_hook: a bucket was first seen during CUDA graph capture; run eager steps "
                           "before capturing (torch's recipe for DDP: at least 11) so that every bucket binds "
                           "outside the graph, DDP's rebuilt buckets included")


def plan_bucket(buffer: torch.Tensor, bucket: Any, ctx: Context, format_name: Optional[str] = None) -> Plan:
    """Decide and bind ``buffer``'s path (``bucket``: DDP's GradBucket, for its index and its parameters;
    ``format_name``: the format online tuning gives it, else the context's for its size).

    Collective for FP8 with error feedback when its residuals move from an earlier layout, and for a bucket of
    mixed formats that folds in what error feedback still owes its parameters: the caller issues it in the
    state's one order.
    """
    if buffer.layout != torch.strided:
        raise TypeError("triton_hook does not support sparse gradients; use DDP's default reduction for them")
    if buffer.dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"triton_hook got a bucket of dtype {buffer.dtype}; supported are float32, bfloat16 and "
                        "float16")
    wire, pre, post = ctx.wire_for(buffer.numel(), format_name)
    stats = new_stats(buffer) if ctx.grad_stats else None
    index = bucket.index() if bucket is not None else None
    # The parameters, listed once per bucket at binding, where FP8's blocks or the statistics need them.
    fold = ctx.mixed and not wire.error_feedback
    params = list(bucket.parameters()) if bucket is not None and (wire.block_scaled or stats is not None or fold) \
        else []
    ids, sizes = tuple(map(id, params)), tuple(p.numel() for p in params)
    if wire.block_scaled and sum(sizes) != buffer.numel():  # a bucket without its parameters: blocks cannot follow
        raise ValueError(f"an FP8 wire format needs the bucket's parameters, got {len(params)} covering "
                         f"{sum(sizes)} of {buffer.numel()} elements")
    residuals, algorithm, queue = None, None, ctx.queue
    record = BucketRecord(index, wire.name)  # a staged exchange's: its bytes and collectives once it is built
    if wire.two_level:
        if ctx.nodes is None:
            raise ValueError("a two-level wire format needs the node groups (NodeGroups) it runs on")
        chunks = chunk_count(buffer.numel(), buffer.element_size(), wire, ctx.nodes.local_size, ctx.nodes.n_nodes,
                             buffer.is_cuda, ctx.chunk_bytes, ctx.nodes.reduce_scatter)
        exchange, residuals, record.pass_bytes = two_level_exchange(buffer, ids, sizes, wire, ctx.nodes, ctx.group,
                                                                    pre, post, stats, ctx.residuals, chunks, record)
        record.collectives_per_pass = _collectives(exchange)
    elif wire.sharded and not wire.one_all_reduce(ctx.world_size):
        if wire.block_scaled:
            chunks = chunk_count(buffer.numel(), buffer.element_size(), wire, 1, ctx.world_size, buffer.is_cuda,
                                 ctx.chunk_bytes)
            offsets, layouts = fp8_chunk_layouts(sizes, ctx.world_size, chunks)
            if wire.error_feedback:
                residuals = ctx.residuals.for_layout(ids, sizes, layouts, ctx.group, buffer.device,
                                                     second_stage=not wire.one_all_gather(ctx.world_size))
            if len(layouts) == 1:
                exchange = block_fp8_exchange(buffer, wire, layouts[0], ctx.group, ctx.world_size, pre,
                                              residuals.chunk_residuals()[0] if residuals is not None else None, stats,
                                              record=record)
            else:
                exchange = chunked_fp8_exchange(buffer, wire, offsets, layouts, ctx.group, ctx.world_size, pre,
                                                residuals, stats, record)
        else:
            exchange = float32_sum_exchange(buffer, wire, ctx.group, ctx.world_size, pre, post, stats)
        # The all-to-all is handed the whole send buffer, the all-gather this rank's shard: together what a ring
        # all-reduce of the send buffer sends, so the bucket counts as one message of the send buffer's size.
        chunked = exchange.chunks if isinstance(exchange, ChunkedExchange) else [exchange]
        record.pass_bytes = {wire.name: sum(_bytes(c.send) for c in chunked)}
        record.collectives_per_pass = _collectives(exchange)
    else:
        exchange, record, algorithm = _all_reduce(buffer, index, wire, ctx, pre, post, stats)
        queue = ctx.queue if ctx.queue_all else None
    exchange.subject = f"bucket {index} ({wire.name} wire)" if index is not None else f"a bucket ({wire.name} wire)"
    if fold and sum(sizes) == buffer.numel():
        owed = ctx.residuals.take_for_fold(ids, sizes, ctx.group, buffer.device)
        if owed is not None:
            exchange.finish = _FoldOnce(exchange.finish, _fold(buffer, owed, stats))
    wire_buffer = exchange.held[0] if exchange.held else buffer
    coverage = BucketCoverage(params, buffer) if stats is not None else None
    return Plan(buffer, exchange, queue, wire_buffer, algorithm, stats, coverage, residuals, record)


def _all_reduce(buffer: torch.Tensor, index: Optional[int], wire: WireFormat, ctx: Context, pre: float,
                post: float, stats: Optional[torch.Tensor]) -> Any:
    """A bucket sent by one all-reduce in the wire dtype, or averaged by the collective itself where it can: its
    one-stage exchange, telemetry record and NCCL algorithm. A 16-bit format with float32 sums is one all-reduce at
    two ranks (``WireFormat.one_all_reduce``): named so in the telemetry, and never averaged by the collective
    (NCCL's AVG multiplies in the wire dtype, a rounding the format does not have)."""
    comm_dtype = wire.comm_dtype
    group, algorithm = ctx.group_for(buffer.numel() * comm_dtype.itemsize)
    if not wire.sharded and collective_averages(ctx.backend, buffer.is_cuda, comm_dtype, buffer.dtype, algorithm):
        # The collective's own averaging: no kernel at all on either side; with grad_stats, a stats pass (the
        # unpack in place at scale 1: one read and one write, where giving up AVG would cost two of each).
        unpack = nothing if stats is None else _stats_pass(buffer, stats)
        record = BucketRecord(index, wire_name(comm_dtype) + " (AVG)", {wire_name(comm_dtype): _bytes(buffer)}, 1)
        return all_reduce_exchange(buffer, buffer, group, dist.ReduceOp.AVG, nothing, unpack), record, algorithm
    wire_buffer = buffer if comm_dtype == buffer.dtype else torch.empty(buffer.numel(), dtype=comm_dtype,
                                                                         device=buffer.device)
    # A NaN is a NaN to the hook (NCCL's and gloo's sums make NaNs of their own bits anyway): on CPU tensors, no pass
    # to rewrite them canonical (the kernels on the GPU do, at no cost). In place at scale 1 the unpack does nothing
    # without stats, and is the stats pass with them.
    bucket = [buffer]
    pack = kernels.pack.prepare(bucket, wire_buffer, pre, canonical_nan=False).fixed(bucket, wire_buffer)
    unpack = kernels.unpack.prepare(wire_buffer, bucket, post, stats=stats, canonical_nan=False).fixed(
        wire_buffer, bucket, stats)
    name = wire.name if wire.sharded else wire_name(comm_dtype)
    record = BucketRecord(index, name, {name: _bytes(wire_buffer)}, 1)
    return all_reduce_exchange(buffer, wire_buffer, group, dist.ReduceOp.SUM, pack, unpack), record, algorithm


def _stats_pass(buffer: torch.Tensor, stats: torch.Tensor) -> Callable[[], None]:
    """The unpack of ``buffer`` into itself at scale 1: its values stay, ``stats`` gets their statistics."""
    bucket = [buffer]
    return kernels.unpack.prepare(buffer, bucket, 1.0, stats=stats).fixed(buffer, bucket, stats)


def _fold(buffer: torch.Tensor, owed: torch.Tensor, stats: Optional[torch.Tensor]) -> Callable[[], None]:
    """Add ``owed`` (float32, the bucket's elements) to the averaged bucket, then recompute its statistics."""
    restat = None if stats is None else _stats_pass(buffer, stats)

    def fold() -> None:
        if owed.is_cuda:  # a completion's stream, not the one owed was made on: its memory must wait for this use
            owed.record_stream(torch.cuda.current_stream(owed.device))
        buffer.copy_(buffer.float().add_(owed).to(buffer.dtype))
        if restat is not None:
            restat()

    return fold


class _FoldOnce:
    """``unpack``, then ``fold`` the first time only."""

    def __init__(self, unpack: Callable[[], None], fold: Callable[[], None]) -> None:
        self.unpack, self.fold = unpack, fold

    def __call__(self) -> None:
        self.unpack()
        if self.fold is not None:
            fold, self.fold = self.fold, None
            fold()


def _collectives(exchange: Union[StagedExchange, ChunkedExchange]) -> int:
    """Collectives an exchange issues in one pass: its stages, or every chunk's."""
    chunks = exchange.chunks if isinstance(exchange, ChunkedExchange) else (exchange,)
    return sum(len(chunk.stages) for chunk in chunks)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
