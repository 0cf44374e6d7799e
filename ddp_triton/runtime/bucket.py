"""One DDP bucket's path, decided when it binds: its buffers, bound kernels, collective and completion.

The hook calls ``start()`` once per bucket per step. Everything that cannot change between steps (the wire format,
the group, the kernels, the collective's options, the bytes each collective is handed) is fixed in ``bind_bucket``,
so a step's path is a straight line: pack, issue the collective through the process group's own call (not
``torch.distributed``'s Python wrapper, which checks the same things again every call), count the pass, and return
the future DDP waits on, which completes once the bucket holds the mean. Two kinds:

- ``AllReduceComm``: one all-reduce of the wire buffer (the bucket itself, or a comm-dtype copy), the unpack on
  the all-reduce's completion. NCCL completes its futures at launch (stream order), so the unpack runs inline;
  gloo completes them on its own thread.
- ``ShardedComm``: a staged exchange through the state's exchange queue: all-to-all, float32 sum, all-gather
  (``exchange.py``; over two ranks the 16-bit formats with float32 sums are an ``AllReduceComm`` instead, the same
  bits: ``WireFormat.one_all_reduce``), or the two-level exchange (``two_level.py``: reduce-scatter in the node,
  the format between nodes, all-gather in the node).

A failed collective fails the future (``then_unpack``): the backward fails on this rank instead of training on with
local gradients, with a message naming the collective and the bucket (``collective_errors.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat
from .collective_errors import completed
from .exchange import (ExchangeQueue, StagedExchange, all_reduce_exchange, all_reduce_options,
                       block_fp8_exchange, float32_sum_exchange)
from .nodes import NodeGroups
from .two_level import two_level_exchange
from .grad_stats import BucketCoverage, new_stats
from .residuals import LayoutResiduals, ResidualStore
from .telemetry import BucketRecord, Watch, wire_name


def split_average(world_size: int, comm_dtype: torch.dtype) -> Tuple[float, float]:
    """(pre, post) factors with pre * post == 1 / world_size, applied before and after the all-reduce sum.

    bfloat16 and float32 have float32's exponent range, so all of the division goes before the all-reduce, in
    float32 before the single rounding: nothing can overflow in the sum. float16 tops out at 65504 and loses
    precision below 6e-5: dividing by the whole world size first would push small gradients into subnormals, not
    dividing would let a sum over many ranks overflow. So float16 splits the factor around the sum, as a power of
    two near 1/sqrt(N) before it: the sum grows at most about sqrt(N) times and gradients shrink only about sqrt(N)
    times before the wire (32x each at N = 1024), and a power of two scales exactly, so at a power-of-two world size
    both factors are exact and the result is what ``fp16_compress_hook`` gives (0.25 stays 0.25).
    """
    if comm_dtype == torch.float16:
        pre = 2.0 ** -round(math.log2(world_size) / 2)
        return pre, 1.0 / (world_size * pre)
    return 1.0 / world_size, 1.0


def collective_averages(backend: str, on_cuda: bool, comm_dtype: torch.dtype, bucket_dtype: torch.dtype,
                        algorithm: Optional[str]) -> bool:
    """Whether a bucket can be averaged by the collective itself (NCCL's AVG), with no kernel on either side.

    Only when it travels in its own dtype through NCCL on CUDA, not in float16 (whose division is split around
    the sum), and not over NVLS: NCCL implements a float AVG as a pre-multiplied sum, which NVLS does not run.
    """
    nvls = algorithm is not None and algorithm.startswith("nvls")
    return (backend == "nccl" and on_cuda and comm_dtype == bucket_dtype and comm_dtype != torch.float16
            and not nvls)


def _nothing() -> None:
    return None


def then_unpack(
    reduced: torch.futures.Future, unpack: Callable[[], None], buffer: torch.Tensor, subject: str = "a bucket"
) -> torch.futures.Future[torch.Tensor]:
    """A future of ``buffer`` that completes once ``reduced`` has and ``unpack`` has run, or fails with its error.

    ``Future.then`` runs its callback even when the future failed; reading the value re-raises the collective's
    error, so a failed all-reduce (a dead peer, a timeout) fails the backward on this rank instead of unpacking
    the un-reduced buffer and training on with local gradients. The error names the all-reduce of ``subject``
    and says a peer is gone (``collective_errors.CollectiveError``), the backend's words in it.
    """

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        completed(fut, "all_reduce", subject)
        unpack()  # on CUDA this runs on a stream ordered after the all-reduce
        return buffer

    return reduced.then(finish)


class BucketComm:
    """What every bucket path holds: DDP's bucket buffer, what travels, statistics, telemetry and the last pass."""

    def __init__(self, buffer: torch.Tensor, wire_buffer: torch.Tensor, group: Any, algorithm: Optional[str],
                 stats: Optional[torch.Tensor], record: BucketRecord) -> None:
        self.buffer = buffer
        """DDP's bucket buffer; holding it keeps its address (and Python object) this bucket's while we live."""
        self.wire_buffer = wire_buffer
        """What the first collective is handed: the bucket itself, its comm-dtype copy, or the exchange's bytes."""
        self.group = group
        self.algorithm = algorithm
        """The NCCL algorithm group the bucket is sent to; None: NCCL's own choice (or not NCCL)."""
        self.stats = stats
        """With ``grad_stats``: float32 (2,) that this bucket's unpack overwrites with [sum of squares, non-finite
        count] of the averaged gradients it stores (``grad_stats.py``)."""
        self.record = record
        """Telemetry: what each pass hands to the collectives, timings (``telemetry.py``)."""
        self.last_used = 0
        """The state's backward-pass count when this entry was last used (stale entries are dropped)."""
        self.coverage: Any = None
        """With ``grad_stats``: the bucket's parameters and what their gradients were at the pass's end."""
        self.residuals: Optional[LayoutResiduals] = None
        """For FP8 with error feedback: this bucket layout's residuals."""
        self.exchange: Optional[StagedExchange] = None
        """For the formats summed in float32 (16-bit ones over three or more ranks) and the two-level ones: the
        staged exchange; None for an all-reduce."""
        self.subject = "a bucket"
        """What a failed collective's message says it carried: "bucket 3 (bf16 wire)", set at binding."""

    @property
    def valid(self) -> bool:
        """False once its residuals moved to another layout: the bucket must bind again."""
        return self.residuals is None or self.residuals.alive

    def start(self, last: bool) -> torch.futures.Future:
        """Send this bucket; the future completes once DDP's bucket holds the mean. ``last``: the backward's last."""
        raise NotImplementedError

    def start_watched(self, last: bool, watch: Watch) -> torch.futures.Future:
        """``start``, with profiler ranges and timing marks around its phases."""
        raise NotImplementedError


class AllReduceComm(BucketComm):
    """Pack (scale, cast), one all-reduce, unpack on its completion."""

    def __init__(self, buffer: torch.Tensor, wire_buffer: torch.Tensor, group: Any, algorithm: Optional[str],
                 stats: Optional[torch.Tensor], record: BucketRecord, pack: Callable[[], None],
                 unpack: Callable[[], None], op: Any) -> None:
        super().__init__(buffer, wire_buffer, group, algorithm, stats, record)
        self.pack, self.unpack, self.op = pack, unpack, op
        self.opts = all_reduce_options(op)
        self._tensors = [wire_buffer]

    def start(self, last: bool) -> torch.futures.Future:
        self.pack()
        reduced = self.group.allreduce(self._tensors, self.opts).get_future()
        self.record.passes += 1
        return reduced.then(self._finish)

    def _finish(self, fut: torch.futures.Future) -> torch.Tensor:
        # raises if the all-reduce failed: the backward fails instead of training on local gradients
        completed(fut, "all_reduce", self.subject)
        self.unpack()
        return self.buffer

    def start_watched(self, last: bool, watch: Watch) -> torch.futures.Future:
        with watch.phase("pack"):
            self.pack()
        with watch.phase("all_reduce"):
            reduced = self.group.allreduce(self._tensors, self.opts).get_future()
        self.record.passes += 1
        return then_unpack(reduced, watch.unpack(self.unpack), self.buffer, self.subject)


class ShardedComm(BucketComm):
    """An exchange of several collectives (all-to-all, float32 sum, all-gather; or the two-level stages), through
    the state's exchange queue (one order on every rank)."""

    def __init__(self, buffer: torch.Tensor, exchange: StagedExchange, queue: ExchangeQueue,
                 stats: Optional[torch.Tensor], record: BucketRecord,
                 residuals: Optional[LayoutResiduals]) -> None:
        super().__init__(buffer, exchange.held[0] if exchange.held else buffer, exchange.group, None, stats, record)
        self.exchange, self.queue, self.residuals = exchange, queue, residuals

    def start(self, last: bool) -> torch.futures.Future:
        self.record.passes += 1
        return self.queue.start(self.exchange, last)

    def start_watched(self, last: bool, watch: Watch) -> torch.futures.Future:
        self.record.passes += 1
        return self.queue.start(self.exchange, last, watch)


def bind_bucket(buffer: torch.Tensor, bucket: Any, *, wire: WireFormat, group: Any, world_size: int, backend: str,
                pre_scale: float, post_scale: float, grad_stats: bool, group_for: Callable[[int], Tuple[Any, Any]],
                residuals: ResidualStore, queue: ExchangeQueue, nodes: Optional[NodeGroups] = None,
                mixed: bool = False, queue_all_reduce: bool = False) -> BucketComm:
    """Decide and bind ``buffer``'s path (``bucket``: DDP's GradBucket, for its index and, for FP8, its parameters).

    ``group_for(nbytes)`` gives the (group, algorithm) a message of that size goes to; ``nodes``, the groups of a
    two-level exchange (``wire.two_level``). Collective for FP8 with error feedback when its residuals move from
    an earlier layout: the caller issues it in the state's one order.

    ``mixed``: the state's buckets travel in formats of their own (a profile's per-size formats): a bucket whose
    format keeps no residuals adds, once, what error feedback still owes its parameters from an earlier layout
    (``ResidualStore.take_for_fold``: collective when there is any). ``queue_all_reduce``: some of those formats are
    staged, so an all-reduce goes through the exchange queue too, and every group's collectives keep one order
    whatever mix of formats is in flight.
    """
    if buffer.layout != torch.strided:
        raise TypeError("triton_hook does not support sparse gradients; use DDP's default reduction for them")
    if buffer.dtype not in kernels.SUPPORTED_DTYPES:
        raise TypeError(f"triton_hook got a bucket of dtype {buffer.dtype}; supported are float32, bfloat16 and "
                        "float16")
    stats = new_stats(buffer) if grad_stats else None
    index = bucket.index() if bucket is not None else None
    # The parameters, listed once per bucket at binding, where FP8's blocks or the statistics need them.
    needs_params = wire.block_scaled or grad_stats or (mixed and not wire.error_feedback)
    params = list(bucket.parameters()) if bucket is not None and needs_params else []
    sizes = tuple(p.numel() for p in params)
    if wire.block_scaled and sum(sizes) != buffer.numel():  # a bucket without its parameters: blocks cannot follow
        raise ValueError(f"an FP8 wire format needs the bucket's parameters, got {len(params)} covering "
                         f"{sum(sizes)} of {buffer.numel()} elements")
    if wire.two_level:
        if nodes is None:
            raise ValueError("a two-level wire format needs the node groups (NodeGroups) it runs on")
        exchange, held, pass_bytes = two_level_exchange(
            buffer, tuple(map(id, params)), sizes, wire, nodes, group, pre_scale, post_scale, stats, residuals)
        record = BucketRecord(index, wire.name, pass_bytes, len(exchange.stages))
        entry: BucketComm = ShardedComm(buffer, exchange, queue, stats, record, held)
    elif wire.sharded and not wire.one_all_reduce(world_size):
        entry = _bind_sharded(buffer, tuple(map(id, params)), sizes, index, wire, group, world_size, pre_scale,
                              post_scale, stats, residuals, queue)
    else:
        entry = _bind_all_reduce(buffer, index, wire.comm_dtype, backend, pre_scale, post_scale, stats, group_for,
                                 queue if queue_all_reduce else None, wire.name if wire.sharded else None)
    entry.subject = f"bucket {index} ({wire.name} wire)" if index is not None else f"a bucket ({wire.name} wire)"
    if entry.exchange is not None:
        entry.exchange.subject = entry.subject
    if mixed and not wire.error_feedback and sum(sizes) == buffer.numel():
        owed = residuals.take_for_fold(tuple(map(id, params)), sizes, group, buffer.device)
        if owed is not None:
            _fold_once(entry, owed, stats)
    if grad_stats:  # the parameters whose gradients the bucket's statistics describe
        entry.coverage = BucketCoverage(params, buffer)
    return entry


def _bind_all_reduce(buffer: torch.Tensor, index: Optional[int], comm_dtype: torch.dtype, backend: str,
                     pre_scale: float, post_scale: float, stats: Optional[torch.Tensor],
                     group_for: Callable[[int], Tuple[Any, Any]], queue: Optional[ExchangeQueue] = None,
                     sharded_name: Optional[str] = None) -> BucketComm:
    """A bucket sent by one all-reduce in ``comm_dtype``, or averaged by the collective itself where it can; through
    ``queue`` as a one-stage exchange where one is given. ``sharded_name``: the 16-bit format with float32 sums
    this all-reduce is at two ranks (``WireFormat.one_all_reduce``): named so in the telemetry, and never averaged
    by the collective (NCCL's AVG multiplies in the wire dtype, a rounding the format does not have)."""
    target, algorithm = group_for(buffer.numel() * comm_dtype.itemsize)
    if sharded_name is None and collective_averages(backend, buffer.is_cuda, comm_dtype, buffer.dtype, algorithm):
        # The collective's own averaging: no kernel at all on either side; with grad_stats, a stats pass (the
        # unpack in place at scale 1: one read and one write, where giving up AVG would cost two of each).
        unpack = _nothing if stats is None else kernels.bind_unpack(buffer, [buffer], 1.0, stats=stats)
        record = BucketRecord(index, wire_name(comm_dtype) + " (AVG)", {wire_name(comm_dtype): _bytes(buffer)}, 1)
        if queue is not None:
            return _queued_all_reduce(buffer, buffer, target, algorithm, stats, record, _nothing, unpack,
                                      dist.ReduceOp.AVG, queue)
        return AllReduceComm(buffer, buffer, target, algorithm, stats, record, _nothing, unpack,
                             dist.ReduceOp.AVG)
    in_place = comm_dtype == buffer.dtype
    wire_buffer = buffer if in_place else torch.empty(buffer.numel(), dtype=comm_dtype, device=buffer.device)
    # A NaN is a NaN to the hook (NCCL's and gloo's sums make NaNs of their own bits anyway): on CPU tensors, no pass
    # to rewrite them canonical (the kernels on the GPU do, at no cost).
    pack = kernels.bind_pack([buffer], wire_buffer, pre_scale, canonical_nan=False)
    # In place at scale 1 the unpack does nothing without stats, and is the stats pass with them.
    unpack = kernels.bind_unpack(wire_buffer, [buffer], post_scale, stats=stats, canonical_nan=False)
    name = sharded_name or wire_name(comm_dtype)
    record = BucketRecord(index, name, {name: _bytes(wire_buffer)}, 1)
    if queue is not None:
        return _queued_all_reduce(buffer, wire_buffer, target, algorithm, stats, record, pack, unpack,
                                  dist.ReduceOp.SUM, queue)
    return AllReduceComm(buffer, wire_buffer, target, algorithm, stats, record, pack, unpack, dist.ReduceOp.SUM)


def _queued_all_reduce(buffer: torch.Tensor, wire_buffer: torch.Tensor, target: Any, algorithm: Optional[str],
                       stats: Optional[torch.Tensor], record: BucketRecord, pack: Callable[[], None],
                       unpack: Callable[[], None], op: Any, queue: ExchangeQueue) -> ShardedComm:
    """The all-reduce path as a one-stage exchange of the state's queue: pack, all-reduce, unpack."""
    exchange = all_reduce_exchange(buffer, wire_buffer, target, op, pack, unpack)
    entry = ShardedComm(buffer, exchange, queue, stats, record, None)
    entry.wire_buffer, entry.algorithm = wire_buffer, algorithm
    return entry


def _fold_once(entry: BucketComm, owed: torch.Tensor, stats: Optional[torch.Tensor]) -> None:
    """Have ``entry``'s next completion add ``owed`` (float32, the bucket's elements) to the averaged bucket, then
    recompute its statistics; later completions are as before."""
    buffer = entry.buffer
    restat = None if stats is None else kernels.bind_unpack(buffer, [buffer], 1.0, stats=stats)

    def fold() -> None:
        if owed.is_cuda:  # a completion's stream, not the one owed was made on: its memory must wait for this use
            owed.record_stream(torch.cuda.current_stream(owed.device))
        buffer.copy_(buffer.float().add_(owed).to(buffer.dtype))
        if restat is not None:
            restat()

    if entry.exchange is not None:
        entry.exchange.finish = _FoldOnce(entry.exchange.finish, fold)
    else:
        entry.unpack = _FoldOnce(entry.unpack, fold)  # type: ignore[attr-defined]


class _FoldOnce:
    """``unpack``, then ``fold`` the first time only."""

    def __init__(self, unpack: Callable[[], None], fold: Callable[[], None]) -> None:
        self.unpack, self.fold = unpack, fold

    def __call__(self) -> None:
        self.unpack()
        if self.fold is not None:
            fold, self.fold = self.fold, None
            fold()


def _bind_sharded(buffer: torch.Tensor, params: Tuple[int, ...], sizes: Tuple[int, ...], index: Optional[int],
                  wire: WireFormat, group: Any, world_size: int, pre_scale: float, post_scale: float,
                  stats: Optional[torch.Tensor], store: ResidualStore, queue: ExchangeQueue) -> ShardedComm:
    """A bucket of a wire format summed in float32: all-to-all, local sum, all-gather (``exchange.py``).
    ``params``/``sizes``: the bucket's parameters (ids) and their element counts (FP8's blocks follow them)."""
    residuals = None
    if wire.block_scaled:
        layout = kernels.block_layout(sizes, world_size)
        if wire.error_feedback:
            residuals = store.for_layout(params, sizes, layout, group, buffer.device)
        exchange = block_fp8_exchange(buffer, wire, layout, group, world_size, pre_scale, residuals, stats)
    else:
        exchange = float32_sum_exchange(buffer, wire, group, world_size, pre_scale, post_scale, stats)
    # The all-to-all is handed the whole send buffer, the all-gather this rank's shard: together what a ring
    # all-reduce of the send buffer sends, so the bucket counts as one message of the send buffer's size.
    record = BucketRecord(index, wire.name, {wire.name: _bytes(exchange.send)}, 2)
    return ShardedComm(buffer, exchange, queue, stats, record, residuals)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
