"""The two-level exchange of a bucket: reduced inside the node uncompressed, compressed only between nodes.

With L ranks on each of M nodes (``nodes.py``), per bucket of n elements, cut into L parts of
``two_level_part(n, L)`` elements (the cost model's rule: a whole number of FP8 blocks, the last parts zero-padded):

1. pack: the bucket times the pre-division factor, into a send buffer of L parts in the bucket's own dtype;
   reduce-scatter inside the node: local rank j gets the node's sum of part j, summed in the bucket's dtype.
2. the node-crossing exchange of part j among the ranks with local index j on every node (the cross group), in the
   wire format, exactly as the flat exchange of that format over M ranks: one all-reduce in the comm dtype, or the
   all-to-all / float32 sum / all-gather of the formats summed in float32 (over two nodes FP8's is one all-gather
   and a float32 sum, ``WireFormat.one_all_gather``); for FP8, block-scaled with blocks of 128
   that follow the parameters inside the part (a parameter cut at a part's edge starts a block there), and error
   feedback with residuals kept per parameter (``residuals.py``: this rank's first stage is its part's).
3. all-gather inside the node of the averaged parts into the send buffer, and unpack into DDP's bucket (with the
   gradient statistics).

Only step 2 crosses a node's link: per rank, what a ring all-reduce of 1/L of the bucket in the wire format sends,
against the whole bucket for the flat exchange. Every stage goes through the state's exchange queue, so each
group's collectives are issued in one order on every rank.

A large bucket is cut into chunks (``chunks.py``): every part at the same targets, each at a block boundary of its
own layout, and chunk k is the exchange above of its own: its L pieces packed into L slots of one size (the shorter
zero-padded) of a send buffer of its own, their node sum, the cross exchange of this rank's piece (the part's blocks
from the chunk's first to its last), the all-gather, the unpack. Started in order through the queue, chunk k+1's
node sum runs while chunk k is between nodes; the results, and the residuals each element and block keeps, are the
unchunked exchange's (with two ranks per node, or any sum that does not depend on an element's place in a buffer).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat
from ..machine.cost_model import two_level_part
from ..kernels import BlockLayout
from .chunks import boundaries, cuts, element_boundaries, pieces_within
from .exchange import ChunkedExchange, Stage, StagedExchange, nothing
from .wire_exchanges import (GatheredExchange, ShardedExchange, all_gather_into, block_fp8_exchange,
                             float32_sum_exchange)
from .nodes import NodeGroups, reduce_scatter_single
from .residuals import LayoutResiduals, ResidualStore
from .telemetry import IN_NODE, BucketRecord, wire_name


def two_level_exchange(buffer: torch.Tensor, params: Tuple[int, ...], sizes: Tuple[int, ...], wire: WireFormat,
                       nodes: NodeGroups, group: Any, pre_scale: float, post_scale: float,
                       stats: Optional[torch.Tensor], store: ResidualStore, chunks: int = 1,
                       record: Optional[BucketRecord] = None
                       ) -> Tuple[Union[StagedExchange, ChunkedExchange], Optional[LayoutResiduals], Dict[str, int]]:
    """Bind ``buffer``'s two-level exchange, cut into at most ``chunks`` chunks (``chunks.py``): the exchange (one
    StagedExchange, or one per chunk), the FP8 residuals (or None) and the bytes each pass hands to the collectives
    per wire format (the node's bucket-dtype exchange, then the cross exchange).

    ``params``/``sizes``: the bucket's parameters (ids) and their element counts, in bucket order (FP8 only).
    ``group``: the whole averaging group (the residuals' re-slice runs on it). Collective for FP8 with error
    feedback when residuals move from an earlier layout. ``record``: the bucket's, where a block-scaled cross hop
    measures its rounding.
    """
    n, local, me = buffer.numel(), nodes.local_size, nodes.local_index
    part = two_level_part(n, local)
    lengths = [min(n, (j + 1) * part) - min(n, j * part) for j in range(local)]
    if wire.block_scaled:
        allowed = [boundaries(kernels.block_layout(pieces_within(sizes, j * part, j * part + length), 1))
                   for j, length in enumerate(lengths)]
    else:
        allowed = [element_boundaries(length) for length in lengths]
    offsets, slots = cuts(allowed, part, chunks)
    bases = [sum(slots[:k]) for k in range(len(slots))]
    send = torch.zeros(local * sum(slots), dtype=buffer.dtype, device=buffer.device)  # the padding stays zero
    shard = torch.zeros(sum(slots), dtype=buffer.dtype, device=buffer.device)
    start = min(me * part, n)
    mine = offsets[me]
    residuals, layouts = None, [None] * len(slots)
    if wire.block_scaled and wire.sharded and not wire.one_all_reduce(nodes.n_nodes):
        layouts = [kernels.block_layout(pieces_within(sizes, start + a, start + b), nodes.n_nodes)
                   for a, b in zip(mine, mine[1:])]
        if wire.error_feedback:
            residuals = store.for_layout(params, sizes, layouts, group, buffer.device, span=(start, start + mine[-1]),
                                         shard=nodes.node_index, node_group=nodes.node_group,
                                         second_stage=not wire.one_all_gather(nodes.n_nodes))
    per_chunk = residuals.chunk_residuals() if residuals is not None else [None] * len(slots)
    pieces = [[(j * part + c[k], j * part + c[k + 1], j * slots[k]) for j, c in enumerate(offsets)]
              for k in range(len(slots))]
    calls = [_calls(chunk_pieces) for chunk_pieces in pieces]
    rows = None
    if stats is not None and sum(map(len, calls)) > 1:  # a statistics row per unpack call, added up at the end
        rows = torch.zeros(sum(map(len, calls)), 2, dtype=torch.float32, device=buffer.device)
    built, row = [], 0
    for k, (slot, base) in enumerate(zip(slots, bases)):
        send_k, shard_k = send[local * base:local * (base + slot)], shard[base:base + slot]
        chunk_stats = [stats] * len(calls[k]) if rows is None else [rows[row + i] for i in range(len(calls[k]))]
        row += len(calls[k])
        built.append(_chunk(buffer, send_k, shard_k, calls[k], chunk_stats, wire, nodes, pre_scale, post_scale,
                            mine[k + 1] - mine[k], layouts[k], per_chunk[k], record))
    node_bytes = send.numel() * send.element_size()
    pass_bytes = {wire_name(buffer.dtype) + IN_NODE: node_bytes, wire.flat().name: sum(b for _, _, b in built)}
    if len(built) == 1:
        exchange, held, _ = built[0]
        exchange.held = (send, shard, *held)
        return exchange, residuals, pass_bytes
    finish = nothing if rows is None else functools.partial(torch.sum, rows, dim=0, out=stats)
    cross_held = [t for _, held, _ in built for t in held]
    chunked = ChunkedExchange(buffer, [exchange for exchange, _, _ in built], finish,
                              (send, shard, *cross_held, *(() if rows is None else (rows,))))
    return chunked, residuals, pass_bytes


def _calls(pieces: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, int, List[Tuple[int, int]]]]:
    """The pack (and unpack) calls of one chunk, from its pieces (bucket elements [a, b) at slot offset ``at`` of
    its send buffer): one call per contiguous run of the send buffer (slot_start, slot_end, the bucket ranges in it,
    each as long as the bucket allows)."""
    calls: List[Tuple[int, int, List[Tuple[int, int]]]] = []
    for a, b, at in pieces:
        if b == a:
            continue
        if calls and calls[-1][1] == at:
            first, _, ranges = calls[-1]
            if ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
            calls[-1] = (first, at + b - a, ranges)
        else:
            calls.append((at, at + b - a, [(a, b)]))
    return calls


def _chunk(buffer: torch.Tensor, send: torch.Tensor, shard: torch.Tensor,
           calls: Sequence[Tuple[int, int, List[Tuple[int, int]]]], stats: Sequence[Optional[torch.Tensor]],
           wire: WireFormat, nodes: NodeGroups, pre_scale: float, post_scale: float, length: int,
           layout: Optional[BlockLayout], residual: Optional[Tuple[torch.Tensor, torch.Tensor]],
           record: Optional[BucketRecord] = None) -> Tuple[StagedExchange, Tuple[torch.Tensor, ...], int]:
    """One chunk's two-level exchange, over its ``send`` buffer (L slots) and this rank's ``shard`` of it (its
    piece: ``length`` elements, then zeros): the exchange, the buffers its cross exchange holds, and the bytes it
    hands the cross exchange."""
    packs, unpacks = [], []
    for (low, high, ranges), chunk_stats in zip(calls, stats):
        tensors, out = [buffer[a:b] for a, b in ranges], send[low:high]
        packs.append(kernels.pack.prepare(tensors, out, pre_scale, canonical_nan=False).fixed(tensors, out))
        unpacks.append(kernels.unpack.prepare(out, tensors, 1.0, stats=chunk_stats, canonical_nan=False).fixed(
            out, tensors, chunk_stats))
    node_group, cross_group, gather_group = nodes.node_group, nodes.cross_group, nodes.gather_group
    pack, unpack = _in_order(packs), _in_order(unpacks)
    if nodes.reduce_scatter:
        first = Stage("pack", pack, "reduce_scatter", lambda: reduce_scatter_single(shard, send, node_group),
                      node_group)
        take_part: Callable[[], None] = nothing
    else:  # the node's sum by an all-reduce of the whole send buffer; this rank's part is copied out of it
        first = Stage("pack", pack, "all_reduce", lambda: dist.all_reduce(send, group=node_group, async_op=True),
                      node_group)
        slot = shard.numel()
        mine = send[nodes.local_index * slot:(nodes.local_index + 1) * slot]

        def take_part() -> None:
            shard.copy_(mine)

    if layout is None and (not wire.sharded or wire.one_all_reduce(nodes.n_nodes)):
        cross_stages, cross_finish, cross_held, cross_bytes = _cross_all_reduce(shard, wire, cross_group, post_scale)
    else:
        cross: Union[ShardedExchange, GatheredExchange] = (
            block_fp8_exchange(shard[:length], wire.flat(), layout, cross_group, nodes.n_nodes, 1.0, residual, None,
                               record=record)
            if layout is not None else
            float32_sum_exchange(shard, wire.flat(), cross_group, nodes.n_nodes, 1.0, post_scale, None))
        cross_stages = [stage._replace(compute_phase="cross_" + stage.compute_phase,
                                       collective_phase="cross_" + stage.collective_phase) for stage in cross.stages]
        cross_finish, cross_held, cross_bytes = cross.finish, cross.held, cross.collective_bytes()[0]
    cross_stages[0] = cross_stages[0]._replace(compute=_in_order(
        [call for call in (take_part, cross_stages[0].compute) if call is not nothing]))
    gather = Stage("cross_unpack", cross_finish, "all_gather",
                   lambda: all_gather_into(send, shard, group=gather_group, async_op=True), gather_group)
    return StagedExchange(buffer, [first, *cross_stages, gather], unpack, ()), tuple(cross_held), cross_bytes


def _in_order(calls: List[Callable[[], None]]) -> Callable[[], None]:
    """One call running ``calls`` in order (the call itself where there is one)."""
    if len(calls) == 1:
        return calls[0]

    def run() -> None:
        for call in calls:
            call()

    return run


def _cross_all_reduce(shard: torch.Tensor, wire: WireFormat, cross_group: Any, post_scale: float
                      ) -> Tuple[List[Stage], Callable[[], None], Tuple[torch.Tensor, ...], int]:
    """The cross exchange as one all-reduce of the part in the comm dtype (summed in it, as NCCL adds; over two
    nodes also the 16-bit formats with float32 sums, ``WireFormat.one_all_reduce``): its stage, the computation
    after it, the buffers it holds and the bytes it hands the all-reduce."""
    in_place = wire.comm_dtype == shard.dtype
    on_wire = shard if in_place else torch.empty(shard.numel(), dtype=wire.comm_dtype, device=shard.device)
    part = [shard]
    cross_pack = nothing if in_place else kernels.pack.prepare(part, on_wire, 1.0, canonical_nan=False).fixed(
        part, on_wire)
    stage = Stage("cross_pack", cross_pack, "cross_all_reduce",
                  lambda: dist.all_reduce(on_wire, group=cross_group, async_op=True), cross_group)
    cross_unpack = kernels.unpack.prepare(on_wire, part, post_scale, canonical_nan=False).fixed(on_wire, part, None)
    return [stage], cross_unpack, (() if in_place else (on_wire,)), on_wire.numel() * on_wire.element_size()
