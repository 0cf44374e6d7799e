"""Sharded exchanges: a bucket averaged by all-to-all, a local float32 sum and all-gather, instead of one all-reduce.

Used by the wire formats whose sum must not be taken in the wire dtype (``wire.py``): 16 bits with float32 sums, and
block-scaled FP8. Per bucket: a kernel packs (or quantizes) the bucket into the send buffer, an all-to-all hands each
rank the N copies of its shard, a kernel sums them in float32 (and requantizes), an all-gather returns every shard,
and a kernel unpacks (or dequantizes) into DDP's bucket. One rank's bytes sent equal a ring all-reduce's. The three
kernels are bound once to the bucket's buffers (``kernels.bind_*``: direct launches on CUDA, no checks per step).

An exchange is a list of stages (``StagedExchange``), each a computation and an asynchronous collective: the
sharded exchange has two (pack + all-to-all, sum + all-gather), a two-level one (``two_level.py``) a reduce-scatter
inside the node, the node-crossing stages and an all-gather inside the node.

Every rank must issue its collectives on a group in one order, and a gloo future's callback runs on gloo's own
thread whenever the work finishes. So nothing here is issued from a callback in a race with the hook: an
``ExchangeQueue`` issues, under one lock, the remaining stages of the bucket before (each once the collective
before it has finished) and then the first stage of the next, giving a2a(0), ag(0), a2a(1), ag(1), ... on every
rank. The last bucket of a backward, or a bucket whose next never comes, is driven by its first collective's
completion (on gloo's thread, which then waits for the bucket's later collectives, all on other works). Any error
(a failed collective, a kernel's) fails that bucket's future, so the backward fails on this rank as with one
all-reduce.

The state's other collectives (the residuals' re-slice at a new bucket layout, ``state_dict``) go through the same
queue (``ExchangeQueue.ordered``): they are issued after the pending bucket's all-gather and before the next
bucket's all-to-all, never beside a callback's all-gather in an order that depends on which rank was late.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels.blocks import BlockLayout
from ..kernels.fp8 import ROW_BYTES
from .residuals import LayoutResiduals
from .wire import WireFormat

# torch >= 2.12 names the all-gather into one tensor all_gather_single; older releases all_gather_into_tensor.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Stage(NamedTuple):
    """One step of an exchange: a computation on this rank, then a collective issued asynchronously."""

    compute_phase: str
    """Telemetry name of the computation ("pack", "reduce", ...)."""
    compute: Callable[[], None]
    collective_phase: str
    """Telemetry name of the collective ("all_to_all", "all_gather", ...)."""
    issue: Callable[[], Any]
    """Issues the collective (``async_op=True``) and returns its Work."""


class StagedExchange:
    """One bucket's exchange as stages, each a computation and a collective, and the last computation: the first
    stage runs when the bucket is started, the others once the collective before has finished, and ``finish``
    (writing DDP's bucket) on the last collective's completion."""

    def __init__(self, buffer: torch.Tensor, group: Any, stages: Sequence[Stage], finish: Callable[[], None],
                 held: Sequence[torch.Tensor]) -> None:
        self.buffer, self.group = buffer, group
        """DDP's bucket buffer, and the group of the first collective."""
        self.stages, self.finish = tuple(stages), finish
        self.held = tuple(held)
        """The buffers the exchange holds (its memory), the first what its first collective is handed."""


class ShardedExchange(StagedExchange):
    """All-to-all, a computation on this rank's shard, all-gather: what the formats summed in float32 run."""

    def __init__(self, buffer: torch.Tensor, group: Any, world_size: int, send: torch.Tensor, recv: torch.Tensor,
                 shard: torch.Tensor, prepare: Callable[[], None], reduce: Callable[[], None],
                 finish: Callable[[], None]) -> None:
        stages = (Stage("pack", prepare, "all_to_all",
                        lambda: dist.all_to_all_single(recv, send, group=group, async_op=True)),
                  Stage("reduce", reduce, "all_gather",
                        lambda: all_gather_into(send, shard, group=group, async_op=True)))
        super().__init__(buffer, group, stages, finish, (send, recv, shard))
        self.world_size = world_size
        self.send, self.recv, self.shard = send, recv, shard
        self.prepare, self.reduce = prepare, reduce

    def collective_bytes(self) -> Tuple[int, int]:
        """Bytes handed to the all-to-all (the whole send buffer) and to the all-gather (this rank's shard)."""
        return self.send.numel() * self.send.element_size(), self.shard.numel() * self.shard.element_size()


class _Run:
    """One bucket's exchange in flight: the stage whose collective was issued last, and its Work; ``watch``
    (telemetry.Watch) records its phases, or None."""

    def __init__(self, exchange: StagedExchange, result: torch.futures.Future, watch: Any) -> None:
        self.exchange, self.result, self.watch = exchange, result, watch
        self.stage = 0
        self.work: Any = None

    def phase(self, name: str) -> Any:
        return self.watch.phase(name) if self.watch is not None else contextlib.nullcontext()

    def run_stage(self, stage: Stage) -> None:
        with self.phase(stage.compute_phase):
            stage.compute()
        with self.phase(stage.collective_phase):
            self.work = stage.issue()


class ExchangeQueue:
    """Issues a state's collectives in the same order on every rank (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Optional[_Run] = None

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """Issue collectives of one's own inside this block: after every collective the queue has issued or owes
        (the pending bucket's all-gather is issued first), and before any it issues next. Blocking ones may wait
        here: no callback issues a collective while the block runs."""
        with self._lock:
            self._drive_pending()
            yield

    def start(self, exchange: StagedExchange, last: bool, watch: Any = None) -> torch.futures.Future:
        """Start ``exchange``'s bucket; the future completes once DDP's bucket holds the mean. ``watch``: the
        bucket's telemetry (profiler ranges, timing) for this pass, or None."""
        devices = [exchange.buffer.device] if exchange.buffer.is_cuda else None
        result = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        with self._lock:
            self._drive_pending()
            run = _Run(exchange, result, watch)
            run.run_stage(exchange.stages[0])
            work = run.work
            self._pending = run
            if last:
                self._drive_pending()
        if not last:
            work.get_future().then(lambda _: self._drive_if_pending(run))
        return result

    def _drive_if_pending(self, run: _Run) -> None:
        # Never block on the lock here (gloo's thread): a held lock means the hook is in ``start`` or ``ordered``,
        # which drive the pending bucket before anything else. A gloo Work's wait() returns only after its future's
        # callbacks ran, so the hook waits on the future, which returns before them.
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._pending is run:
                self._drive_pending()
        finally:
            self._lock.release()

    def _drive_pending(self) -> None:
        """The pending bucket's remaining stages, each once the collective before has finished; then its finish on
        the last collective's completion."""
        run, self._pending = self._pending, None
        if run is None:
            return
        exchange, result = run.exchange, run.result
        try:
            for stage in exchange.stages[1:]:
                run.work.get_future().wait()  # raises if it failed; on CUDA, orders this stream after it
                run.run_stage(stage)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach DDP through the bucket's future
            _fail(result, exc)
            return

        unpack = run.watch.unpack(exchange.finish) if run.watch is not None else exchange.finish

        def finish(fut: torch.futures.Future) -> None:
            try:
                fut.value()  # raises if the last collective failed
                unpack()
                result.set_result(exchange.buffer)
            except BaseException as exc:  # noqa: BLE001
                _fail(result, exc)

        run.work.get_future().then(finish)


def _fail(result: torch.futures.Future, exc: BaseException) -> None:
    if not result.done():
        result.set_exception(exc)


def float32_sum_exchange(buffer: torch.Tensor, wire: WireFormat, group: Any, world_size: int,
                         pre_scale: float, post_scale: float, stats: Optional[torch.Tensor]) -> ShardedExchange:
    """16 bits on the wire, summed in float32: pack, all-to-all, sum of slices, all-gather, unpack."""
    n = buffer.numel()
    padded = -(-n // world_size) * world_size  # whole shards: the all-to-all splits the buffer evenly
    send = torch.zeros(padded, dtype=wire.comm_dtype, device=buffer.device)  # the tail stays zero
    recv = torch.empty_like(send)
    shard = torch.empty(padded // world_size, dtype=wire.comm_dtype, device=buffer.device)
    pack = kernels.bind_pack([buffer], send[:n], pre_scale, canonical_nan=False)  # NaN bits: see bucket.py
    unpack = kernels.bind_unpack(send[:n], [buffer], post_scale, stats=stats, canonical_nan=False)
    return ShardedExchange(buffer, group, world_size, send, recv, shard, pack,
                           kernels.bind_sum_slices(recv, world_size, shard, canonical_nan=False), unpack)


def block_fp8_exchange(buffer: torch.Tensor, wire: WireFormat, layout: BlockLayout, group: Any, world_size: int,
                       pre_scale: float, residuals: Optional[LayoutResiduals],
                       stats: Optional[torch.Tensor]) -> ShardedExchange:
    """Block-scaled FP8: quantize (with error feedback), all-to-all, float32 sum and requantize, all-gather,
    dequantize."""
    send = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8, device=buffer.device)
    recv = torch.empty_like(send)
    shard = torch.empty(layout.rows_per_shard * ROW_BYTES, dtype=torch.uint8, device=buffer.device)
    fmt = wire.comm_dtype
    first = residuals.first if residuals is not None else None
    second = residuals.second if residuals is not None else None
    quantize = kernels.bind_quantize_blocks(buffer, layout, send, pre_scale, fmt=fmt, residual=first)
    reduce = kernels.bind_reduce_blocks(recv, world_size, shard, fmt=fmt, residual=second)
    dequantize = kernels.bind_dequantize_blocks(send, layout, buffer, fmt=fmt, stats=stats, canonical_nan=False)
    return ShardedExchange(buffer, group, world_size, send, recv, shard, quantize, reduce, dequantize)
