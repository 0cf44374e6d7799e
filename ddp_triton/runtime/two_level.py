"""The two-level exchange of a bucket: reduced inside the node uncompressed, compressed only between nodes.

With L ranks on each of M nodes (``nodes.py``), per bucket of n elements, cut into L parts of ``part_length(n, L)``
elements (a whole number of FP8 blocks, the last parts zero-padded):

1. pack: the bucket times the pre-division factor, into a send buffer of L parts in the bucket's own dtype;
   reduce-scatter inside the node: local rank j gets the node's sum of part j, summed in the bucket's dtype.
2. the node-crossing exchange of part j among the ranks with local index j on every node (the cross group), in the
   wire format, exactly as the flat exchange of that format over M ranks: one all-reduce in the comm dtype, or the
   all-to-all / float32 sum / all-gather of the formats summed in float32; for FP8, block-scaled with blocks of 128
   that follow the parameters inside the part (a parameter cut at a part's edge starts a block there), and error
   feedback with residuals kept per parameter (``residuals.py``: this rank's first stage is its part's).
3. all-gather inside the node of the averaged parts into the send buffer, and unpack into DDP's bucket (with the
   gradient statistics).

Only step 2 crosses a node's link: per rank, what a ring all-reduce of 1/L of the bucket in the wire format sends,
against the whole bucket for the flat exchange. Every stage goes through the state's exchange queue, so each
group's collectives are issued in one order on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import kernels
from ..formats import WireFormat
from ..kernels.fp8 import BLOCK_ELEMENTS
from .exchange import Stage, StagedExchange
from .wire_exchanges import ShardedExchange, all_gather_into, block_fp8_exchange, float32_sum_exchange
from .nodes import NodeGroups, reduce_scatter_single
from .residuals import LayoutResiduals, ResidualStore
from .telemetry import IN_NODE, wire_name


def part_length(n: int, local_size: int) -> int:
    """Elements in each of the L parts of a bucket of ``n``: a whole number of blocks, at least one block."""
    blocks = -(-n // BLOCK_ELEMENTS)
    return max(1, -(-blocks // local_size)) * BLOCK_ELEMENTS


def pieces_within(sizes: Sequence[int], start: int, end: int) -> List[int]:
    """The sizes of the parts of tensors of ``sizes`` (laid out flat) that fall in elements [start, end)."""
    out, offset = [], 0
    for size in sizes:
        low, high = max(start, offset), min(end, offset + size)
        if high > low:
            out.append(high - low)
        offset += size
    return out


def _nothing() -> None:
    return None


def two_level_exchange(buffer: torch.Tensor, params: Tuple[int, ...], sizes: Tuple[int, ...], wire: WireFormat,
                       nodes: NodeGroups, group: Any, pre_scale: float, post_scale: float,
                       stats: Optional[torch.Tensor], store: ResidualStore
                       ) -> Tuple[StagedExchange, Optional[LayoutResiduals], Dict[str, int]]:
    """Bind ``buffer``'s two-level exchange: the stages, the FP8 residuals (or None) and the bytes each pass hands
    to the collectives per wire format (the node's bucket-dtype exchange, then the cross exchange).

    ``params``/``sizes``: the bucket's parameters (ids) and their element counts, in bucket order (FP8 only).
    ``group``: the whole averaging group (the residuals' re-slice runs on it). Collective for FP8 with error
    feedback when residuals move from an earlier layout.
    """
    n, local = buffer.numel(), nodes.local_size
    part = part_length(n, local)
    send = torch.zeros(local * part, dtype=buffer.dtype, device=buffer.device)  # the padding stays zero
    shard = torch.zeros(part, dtype=buffer.dtype, device=buffer.device)
    start = min(nodes.local_index * part, n)
    end = min(start + part, n)
    bucket, sent = [buffer], send[:n]
    pack = kernels.pack.prepare(bucket, sent, pre_scale, canonical_nan=False).fixed(bucket, sent)
    unpack = kernels.unpack.prepare(sent, bucket, 1.0, stats=stats, canonical_nan=False).fixed(sent, bucket, stats)
    node_group, cross_group, gather_group = nodes.node_group, nodes.cross_group, nodes.gather_group
    if nodes.reduce_scatter:
        first = Stage("pack", pack, "reduce_scatter", lambda: reduce_scatter_single(shard, send, node_group),
                      node_group)
        take_part: Callable[[], None] = _nothing
    else:  # the node's sum by an all-reduce of the whole send buffer; this rank's part is copied out of it
        first = Stage("pack", pack, "all_reduce", lambda: dist.all_reduce(send, group=node_group, async_op=True),
                      node_group)
        mine = send[nodes.local_index * part:(nodes.local_index + 1) * part]

        def take_part() -> None:
            shard.copy_(mine)

    residuals = None
    if not wire.sharded or wire.one_all_reduce(nodes.n_nodes):
        cross_stages, cross_finish, cross_held, cross_bytes = _cross_all_reduce(shard, wire, cross_group, post_scale)
    else:
        if wire.block_scaled:
            layout = kernels.block_layout(pieces_within(sizes, start, end), nodes.n_nodes)
            if wire.error_feedback:
                residuals = store.for_layout(params, sizes, layout, group, buffer.device, span=(start, end),
                                             shard=nodes.node_index, node_group=node_group)
            cross: ShardedExchange = block_fp8_exchange(shard[: end - start], wire.flat(), layout, cross_group,
                                                        nodes.n_nodes, 1.0, residuals, None)
        else:
            cross = float32_sum_exchange(shard, wire.flat(), cross_group, nodes.n_nodes, 1.0, post_scale, None)
        cross_stages = [stage._replace(compute_phase="cross_" + stage.compute_phase,
                                       collective_phase="cross_" + stage.collective_phase) for stage in cross.stages]
        cross_finish, cross_held, cross_bytes = cross.finish, cross.held, cross.collective_bytes()[0]
    cross_stages[0] = cross_stages[0]._replace(compute=_in_turn(take_part, cross_stages[0].compute))
    gather = Stage("cross_unpack", cross_finish, "all_gather",
                   lambda: all_gather_into(send, shard, group=gather_group, async_op=True), gather_group)
    exchange = StagedExchange(buffer, [first, *cross_stages, gather], unpack, (send, shard, *cross_held))
    node_bytes = send.numel() * send.element_size()
    return exchange, residuals, {wire_name(buffer.dtype) + IN_NODE: node_bytes, wire.flat().name: cross_bytes}


def _in_turn(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """``first`` then ``then``, as one call (``then`` alone where ``first`` does nothing)."""
    if first is _nothing:
        return then

    def both() -> None:
        first()
        then()

    return both


def _cross_all_reduce(shard: torch.Tensor, wire: WireFormat, cross_group: Any, post_scale: float
                      ) -> Tuple[List[Stage], Callable[[], None], Tuple[torch.Tensor, ...], int]:
    """The cross exchange as one all-reduce of the part in the comm dtype (summed in it, as NCCL adds; over two
    nodes also the 16-bit formats with float32 sums, ``WireFormat.one_all_reduce``): its stage, the computation
    after it, the buffers it holds and the bytes it hands the all-reduce."""
    in_place = wire.comm_dtype == shard.dtype
    on_wire = shard if in_place else torch.empty(shard.numel(), dtype=wire.comm_dtype, device=shard.device)
    part = [shard]
    cross_pack = _nothing if in_place else kernels.pack.prepare(part, on_wire, 1.0, canonical_nan=False).fixed(
        part, on_wire)
    stage = Stage("cross_pack", cross_pack, "cross_all_reduce",
                  lambda: dist.all_reduce(on_wire, group=cross_group, async_op=True), cross_group)
    cross_unpack = kernels.unpack.prepare(on_wire, part, post_scale, canonical_nan=False).fixed(on_wire, part, None)
    return [stage], cross_unpack, (() if in_place else (on_wire,)), on_wire.numel() * on_wire.element_size()
