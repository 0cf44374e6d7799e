"""Each wire format's exchange of a bucket, as stages for the queue (``exchange.py``): what runs, not in which order.

- ``all_reduce_exchange``: pack, one all-reduce, unpack (fp32, bf16, fp16; 16 bits with float32 sums over two ranks).
- ``float32_sum_exchange`` and ``block_fp8_exchange``: the formats whose sum must not be taken in the wire dtype
  (``formats.py``; the block-scaled one serves FP8 and E2M1 alike). A kernel packs (or quantizes) the bucket into
  the send buffer, an all-to-all hands each rank the N copies of its shard, a kernel sums them in float32 (and
  requantizes), an all-gather returns every shard, and a kernel unpacks (or dequantizes) into DDP's bucket. One rank's bytes sent equal a ring all-reduce's.
  Over two ranks the block-scaled one is one all-gather of each rank's whole rows (``GatheredExchange``), the same
  bytes, summed in float32 in rank order into the bucket: no requantization (``WireFormat.one_all_gather``).
- ``chunked_fp8_exchange``: the FP8 exchange of a bucket cut into chunks at block boundaries (``chunks.py``), one
  ``block_fp8_exchange`` per chunk: the same blocks, so the same bits.

A DDP bucket's kernels are prepared once and fixed to its buffers (``kernels.<op>.prepare(...).fixed(...)``: direct
launches on CUDA, no checks per step); an FSDP group's, whose buffers are new at every step, are prepared once and
run on each step's (``prepared_calls.py``). The two-level exchange (``two_level.py``) is made of these: its
node-crossing hop is one of them over the cross group.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat
from ..kernels.blocks import BlockLayout
from .chunks import boundaries, cuts, pieces_within
from .exchange import ChunkedExchange, Stage, StagedExchange, nothing
from .prepared_calls import PreparedCalls
from .residuals import LayoutResiduals
from .telemetry import BucketRecord, RoundingSample

# torch >= 2.12 names the all-gather into one tensor all_gather_single; older releases all_gather_into_tensor.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedExchange(StagedExchange):
    """All-to-all, a computation on this rank's shard, all-gather: what the formats summed in float32 run."""

    def __init__(self, buffer: torch.Tensor, group: Any, send: torch.Tensor, recv: torch.Tensor,
                 shard: torch.Tensor, prepare: Callable[[], None], reduce: Callable[[], None],
                 finish: Callable[[], None]) -> None:
        stages = (Stage("pack", prepare, "all_to_all",
                        lambda: dist.all_to_all_single(recv, send, group=group, async_op=True), group),
                  Stage("reduce", reduce, "all_gather",
                        lambda: all_gather_into(send, shard, group=group, async_op=True), group))
        super().__init__(buffer, stages, finish, (send, recv, shard))
        self.send, self.recv, self.shard = send, recv, shard
        self.prepare, self.reduce = prepare, reduce

    def collective_bytes(self) -> Tuple[int, int]:
        """Bytes handed to the all-to-all (the whole send buffer) and to the all-gather (this rank's shard)."""
        return self.send.numel() * self.send.element_size(), self.shard.numel() * self.shard.element_size()


class GatheredExchange(StagedExchange):
    """One all-gather of every rank's whole send buffer, then the last computation on all of them: the block-scaled
    formats over two ranks (``WireFormat.one_all_gather``), the bytes of the all-to-all and the all-gather together
    in one collective."""

    def __init__(self, buffer: torch.Tensor, group: Any, send: torch.Tensor, recv: torch.Tensor,
                 prepare: Callable[[], None], finish: Callable[[], None], held: Sequence[torch.Tensor]) -> None:
        stage = Stage("pack", prepare, "all_gather",
                      lambda: all_gather_into(recv, send, group=group, async_op=True), group)
        super().__init__(buffer, [stage], finish, (send, recv, *held))
        self.send, self.recv = send, recv

    def collective_bytes(self) -> Tuple[int, int]:
        """Bytes handed to the all-gather (the whole send buffer) and to an all-gather of shards (none), as
        ``ShardedExchange.collective_bytes``."""
        return self.send.numel() * self.send.element_size(), 0


def all_reduce_options(op: Any) -> Any:
    """The options of an asynchronous all-reduce with ``op``, for a process group's own ``allreduce`` call."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.7: what dist.all_reduce(async_op=True) sets
        opts.asyncOp = True
    return opts


def all_reduce_exchange(buffer: torch.Tensor, wire_buffer: torch.Tensor, group: Any, op: Any,
                        pack: Callable[[], None], unpack: Callable[[], None]) -> StagedExchange:
    """One all-reduce as a one-stage exchange (pack, all-reduce of ``wire_buffer`` with ``op``, unpack), for a state
    whose buckets mix formats: through the queue, it keeps its place in its group's one order."""
    # The process group's own call, bound with its arguments once: nothing of the project's between the plan and it.
    issue = functools.partial(group.allreduce, [wire_buffer], all_reduce_options(op))
    stage = Stage("pack", pack, "all_reduce", issue, group)
    return StagedExchange(buffer, [stage], unpack, () if wire_buffer is buffer else (wire_buffer,))


def _kernel(prepared: Optional[PreparedCalls], what: tuple, prepare: Callable[..., kernels.PreparedCall],
            *tensors: Any) -> Callable[[], None]:
    """One kernel of an exchange: ``prepare(*tensors)``'s call fixed to the exchange's buffers (a DDP bucket keeps
    them); or, with ``prepared`` (an FSDP group, whose buffers are new at every step), its call ``what`` kept
    prepared there and run on these."""
    if prepared is None:
        return prepare(*tensors).fixed(*tensors)
    return prepared.later(what, prepare, *tensors)


def float32_sum_exchange(buffer: torch.Tensor, wire: WireFormat, group: Any, world_size: int,
                         pre_scale: float, post_scale: float, stats: Optional[torch.Tensor],
                         prepared: Optional[PreparedCalls] = None) -> ShardedExchange:
    """16 bits on the wire, summed in float32: pack, all-to-all, sum of slices, all-gather, unpack. With
    ``prepared``, its kernels are the calls kept there (no ``stats`` then)."""
    if prepared is not None and stats is not None:
        raise ValueError("an exchange through prepared calls takes no statistics")
    n, dtype = buffer.numel(), wire.comm_dtype
    padded = -(-n // world_size) * world_size  # whole shards: the all-to-all splits the buffer evenly
    send = torch.zeros(padded, dtype=dtype, device=buffer.device)  # the tail stays zero
    recv = torch.empty_like(send)
    shard = torch.empty(padded // world_size, dtype=dtype, device=buffer.device)
    # NaN bits are the arithmetic's (canonical_nan=False): see plan.py
    bucket = [buffer]
    pack = _kernel(prepared, ("pack", pre_scale, "any NaN"),
                   lambda ts, o: kernels.pack.prepare(ts, o, pre_scale, canonical_nan=False), bucket, send[:n])
    add = _kernel(prepared, ("sum_slices", world_size, "any NaN"),
                  lambda r, o: kernels.sum_slices.prepare(r, world_size, o, canonical_nan=False), recv, shard)
    unpack = _kernel(prepared, ("unpack", post_scale, "any NaN"),
                     lambda f, ts, st: kernels.unpack.prepare(f, ts, post_scale, stats=st, canonical_nan=False),
                     send[:n], bucket, stats)
    return ShardedExchange(buffer, group, send, recv, shard, pack, add, unpack)


def block_fp8_exchange(buffer: torch.Tensor, wire: WireFormat, layout: BlockLayout, group: Any, world_size: int,
                       pre_scale: float, residual: Optional[Tuple[torch.Tensor, torch.Tensor]],
                       stats: Optional[torch.Tensor], prepared: Optional[PreparedCalls] = None,
                       record: Optional[BucketRecord] = None) -> Union[ShardedExchange, GatheredExchange]:
    """Block-scaled FP8 or E2M1 (``wire.comm_dtype`` is the passes' ``fmt``, its rows ``kernels.row_bytes(fmt)``
    bytes): quantize (with error feedback: ``residual``, the first and second stages it adds and keeps,
    ``LayoutResiduals.chunk_residuals``), all-to-all, float32 sum and requantize, all-gather, dequantize; over two
    ranks quantize, one all-gather of the whole rows and their float32 sum in rank order (``_gathered``: the second
    stage stays unused). With ``prepared``, its kernels are the calls kept there (no ``stats`` then). With
    ``record`` (a DDP bucket's), the quantize measures its rounding on the bucket's sampled passes, into a sample of
    its own in the record's list."""
    if prepared is not None and (stats is not None or record is not None):
        raise ValueError("an exchange through prepared calls takes no statistics and measures no rounding")
    fmt, sizes = wire.comm_dtype, layout.sizes
    row = kernels.row_bytes(fmt)
    send = torch.empty(layout.n_rows * row, dtype=torch.uint8, device=buffer.device)
    first, second = residual if residual is not None else (None, None)
    quantize = _kernel(prepared, ("quantize", sizes, layout.n_shards, pre_scale, fmt),
                       lambda b, rows, left: kernels.quantize_blocks.prepare(b, layout, rows, pre_scale, fmt=fmt,
                                                                             residual=left),
                       buffer, send, first)
    if record is not None:
        sample = RoundingSample(buffer.device)
        record.rounding.append(sample)
        quantize = _MeasuredQuantize(quantize, record, sample,
                                     _measure_rounding(buffer, send, layout, fmt, pre_scale, first, second))
    if wire.one_all_gather(world_size):
        return _gathered(buffer, fmt, layout, group, world_size, send, quantize, stats, prepared)
    recv = torch.empty_like(send)
    shard = torch.empty(layout.rows_per_shard * row, dtype=torch.uint8, device=buffer.device)
    reduce = _kernel(prepared, ("reduce", world_size, fmt),
                     lambda r, o, left: kernels.reduce_blocks.prepare(r, world_size, o, fmt=fmt, residual=left),
                     recv, shard, second)
    dequantize = _kernel(prepared, ("dequantize", sizes, layout.n_shards, fmt),
                         lambda rows, b, st: kernels.dequantize_blocks.prepare(rows, layout, b, fmt=fmt, stats=st,
                                                                               canonical_nan=False),
                         send, buffer, stats)
    return ShardedExchange(buffer, group, send, recv, shard, quantize, reduce, dequantize)


def _gathered(buffer: torch.Tensor, fmt: Any, layout: BlockLayout, group: Any, world_size: int, send: torch.Tensor,
              quantize: Callable[[], None], stats: Optional[torch.Tensor],
              prepared: Optional[PreparedCalls]) -> GatheredExchange:
    """``block_fp8_exchange`` over two ranks: ``quantize`` into ``send``, one all-gather of every rank's rows, and
    their values summed in float32 in rank order (``kernels.sum_blocks``), rounded once to the bucket's dtype: a
    float32 bucket takes the sum itself; a 16-bit one through a float32 buffer of its size and an unpack, which also
    writes ``stats``."""
    recv = torch.empty(world_size * send.numel(), dtype=torch.uint8, device=buffer.device)
    total = buffer if buffer.dtype == torch.float32 else torch.empty(layout.n_elements, dtype=torch.float32,
                                                                       device=buffer.device)
    add = _kernel(prepared, ("sum_blocks", world_size, layout.sizes, layout.n_shards, fmt),
                  lambda r, o: kernels.sum_blocks.prepare(r, world_size, layout, o, fmt=fmt), recv, total)
    if total is buffer and stats is None:
        return GatheredExchange(buffer, group, send, recv, quantize, add, ())
    bucket = [buffer]
    # NaN bits are the arithmetic's (canonical_nan=False), as the dequantize's in the exchange over more ranks
    unpack = _kernel(prepared, ("unpack", 1.0, "any NaN"),
                     lambda f, ts, st: kernels.unpack.prepare(f, ts, 1.0, stats=st, canonical_nan=False),
                     total, bucket, stats)

    def finish() -> None:
        add()
        unpack()

    return GatheredExchange(buffer, group, send, recv, quantize, finish, () if total is buffer else (total,))


class _MeasuredQuantize:
    """A block-scaled quantize that, on its bucket's sampled passes (``RoundingSample.due``: a bucket's first, so
    again after DDP rebuilds its buckets), then measures what it lost: the one branch it adds to a pass. Not inside
    a CUDA graph's capture, whose replays would repeat it."""

    __slots__ = ("quantize", "record", "sample", "measure")

    def __init__(self, quantize: Callable[[], None], record: BucketRecord, sample: RoundingSample,
                 measure: Callable[[torch.Tensor], None]) -> None:
        self.quantize, self.record, self.sample, self.measure = quantize, record, sample, measure

    def __call__(self) -> None:
        self.quantize()
        if RoundingSample.due(self.record.passes) and not (self.sample.sums.is_cuda
                                                           and torch.cuda.is_current_stream_capturing()):
            self.measure(self.sample.sums)
            self.sample.at_pass = self.record.last_used + 1  # the state's pass, counted from 1


def _measure_rounding(buffer: torch.Tensor, rows: torch.Tensor, layout: BlockLayout, fmt: Any, pre_scale: float,
                      first: Optional[torch.Tensor], second: Optional[torch.Tensor]
                      ) -> Callable[[torch.Tensor], None]:
    """What ``rows`` (just quantized from ``buffer`` at ``pre_scale``, plus ``first`` with error feedback) lost, as
    float32 [|rounding|^2, |meant|^2, |owed|^2]: with error feedback the quantize left the rounding in ``first``
    (meant = sent + first), and it owes ``first`` and ``second``; without, meant is the scaled bucket."""

    def measure(sums: torch.Tensor) -> None:
        sent = torch.empty(layout.n_elements, dtype=torch.float32, device=buffer.device)
        kernels.dequantize_blocks(rows, layout, sent, fmt=fmt)
        if first is not None:  # the residuals are stored in bfloat16: widened, exactly
            lost = first.float()
            meant = sent.add_(lost)
            kept = second.float()
            owed = lost.dot(lost) + kept.dot(kept)
        else:
            meant = buffer.float() * pre_scale
            lost = meant - sent
            owed = torch.zeros((), dtype=torch.float32, device=buffer.device)
        torch.stack([lost.dot(lost), meant.dot(meant), owed], out=sums)

    return measure


def fp8_chunk_layouts(sizes: Sequence[int], world_size: int, count: int) -> Tuple[List[int], List[BlockLayout]]:
    """The flat FP8 exchange of a bucket of tensors of ``sizes`` cut into at most ``count`` chunks at block
    boundaries (``chunks.py``): the chunks' element offsets (from 0 to the bucket's end) and each chunk's block
    layout over ``world_size`` shards, whose blocks are the whole bucket's."""
    whole = kernels.block_layout(sizes, world_size)
    if count == 1:
        return [0, whole.n_elements], [whole]
    offsets = cuts([boundaries(whole)], whole.n_elements, count)[0][0]
    return offsets, [kernels.block_layout(pieces_within(sizes, a, b), world_size)
                     for a, b in zip(offsets, offsets[1:])]


def chunked_fp8_exchange(buffer: torch.Tensor, wire: WireFormat, offsets: Sequence[int],
                         layouts: Sequence[BlockLayout], group: Any, world_size: int, pre_scale: float,
                         residuals: Optional[LayoutResiduals], stats: Optional[torch.Tensor],
                         record: Optional[BucketRecord] = None) -> ChunkedExchange:
    """The flat FP8 exchange of ``buffer`` as one ``block_fp8_exchange`` per chunk (``fp8_chunk_layouts``), the
    quantize of chunk k+1 running while chunk k is on the wire; with ``stats``, each chunk's dequantize writes a row
    of its own, added up once every chunk finished; with ``record``, each chunk measures its rounding."""
    rows = None if stats is None else torch.zeros(len(layouts), 2, dtype=torch.float32, device=buffer.device)
    residual = residuals.chunk_residuals() if residuals is not None else [None] * len(layouts)
    chunks = [block_fp8_exchange(buffer[a:b], wire, layout, group, world_size, pre_scale, left,
                                 None if rows is None else rows[k], record=record)
              for k, (a, b, layout, left) in enumerate(zip(offsets, offsets[1:], layouts, residual))]
    finish = nothing if rows is None else functools.partial(torch.sum, rows, dim=0, out=stats)
    held = [t for chunk in chunks for t in chunk.held] + ([] if rows is None else [rows])
    return ChunkedExchange(buffer, chunks, finish, held)
