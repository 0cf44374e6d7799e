"""Where a bucket is cut into chunks, and into how many: so that a stage of its exchange works on chunk k+1 while
the next stage has chunk k.

A two-level bucket (``two_level.py``) and a flat FP8 one (``wire_exchanges.py``) can be exchanged as K chunks, each
an exchange of its own started through the queue in order. For the results to keep their bits, every cut falls on a
block boundary of the FP8 block layout the unchunked exchange uses (blocks follow the parameters, so a cut is a
parameter's start or 128 elements on from one): a chunk's blocks, scales and sums are then the unchunked ones. A
two-level bucket is cut in each of its L parts at the same targets, each part at its own boundary at or below the
target; a chunk then takes one slot of the longest of its L pieces from every part (the shorter ones zero-padded),
as the reduce-scatter and all-gather inside the node need slots of one size.

The count: ``DDP_TRITON_CHUNK_BYTES`` when set (bytes of the bucket per chunk; ``0``: never cut), else the cost
model's fill plus drain (``cost_model.link_bound_chunk_count``: at least ``MIN_CHUNK_BYTES`` of the bucket a chunk,
so small buckets are never cut), read when the state binds and the same on every rank.
"""

from __future__ import annotations

import bisect
import os
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

from ..formats import WireFormat
from ..kernels import BlockLayout
from ..kernels.fp8 import BLOCK_ELEMENTS
from ..machine import cost_model as cm
from .algo_groups import gather_text

#: Bytes of a bucket per chunk, in place of the cost model's choice (``0``: no chunks). Read when a state binds.
CHUNK_BYTES_ENV = "DDP_TRITON_CHUNK_BYTES"

#: Characters of the setting each rank hands in to compare (``agreed_chunk_bytes``).
_SETTING_WIDTH = 24

#: gloo's all-reduce between two ranks of this machine through the loopback, GB/s (bench/RESULTS.md, H11): the
#: in-node rate of CPU ranks, which the count is priced with.
GLOO_LOOPBACK_GBPS = 0.44


def chunk_bytes_setting(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """``DDP_TRITON_CHUNK_BYTES`` as an int (None: unset, the cost model chooses); a ValueError naming it if it is
    not a non-negative whole number."""
    text = env.get(CHUNK_BYTES_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{CHUNK_BYTES_ENV} must be a whole number of bytes (0: no chunks), got {text!r}")
    return int(text)


def agreed_chunk_bytes(group: Any, env: Mapping[str, str] = os.environ) -> Optional[int]:
    """``chunk_bytes_setting`` on every rank of ``group``, or a ValueError on every rank where one cannot read it or
    they differ (their buckets would issue different collectives). Collective over ``group``: one all-gather."""
    try:
        setting, problem = chunk_bytes_setting(env), None
    except ValueError as exc:
        setting, problem = None, str(exc)
    said = [str(setting) if problem is None else "unreadable"]
    if dist.get_world_size(group) > 1:
        said = [text.strip() for text in gather_text(said[0].rjust(_SETTING_WIDTH)[-_SETTING_WIDTH:], group)]
    if problem is not None:
        raise ValueError(problem)
    if len(set(said)) > 1:
        raise ValueError(f"ranks disagree on {CHUNK_BYTES_ENV} ({', '.join(said)}; None: unset): set it alike on "
                         "every rank, or on none")
    return setting


def chunk_count(n_elements: int, element_bytes: int, wire: WireFormat, ranks_per_node: int, nodes: int,
                on_cuda: bool, chunk_bytes: Optional[int], node_reduce_scatter: bool = True) -> int:
    """Into how many chunks a bucket of ``n_elements`` gradients of ``element_bytes`` each is cut: by
    ``chunk_bytes`` (the setting; 0: one chunk; at most ``MAX_CHUNKS``), else by the cost model on the layout this
    state runs on, where the model says the runtime cuts (``cost_model.chunkable``: CPU ranks, and only where chunks
    keep the bits; on CUDA one chunk unless the setting says). ``ranks_per_node`` 1 and ``nodes`` the world size: a
    flat format; ``node_reduce_scatter``: the node's sum is a reduce-scatter (else an all-reduce)."""
    if chunk_bytes is not None:  # at most the cost model's MAX_CHUNKS: each chunk binds its own buffers and calls
        return min(cm.MAX_CHUNKS, max(1, -(-n_elements * element_bytes // chunk_bytes))) if chunk_bytes else 1
    if not wire.chunks_keep_bits(ranks_per_node, nodes, node_reduce_scatter):
        return 1
    fabric = cm.Fabric(ranks_per_node=ranks_per_node, nodes=nodes, intra_gbps=GLOO_LOOPBACK_GBPS,
                       inter_gbps=GLOO_LOOPBACK_GBPS, intra_link="pcie")
    host = cm.GPU_HOST_COST if on_cuda else cm.CPU_HOST_COST
    return cm.link_bound_chunk_count(fabric, n_elements, element_bytes, wire, host)


def pieces_within(sizes: Sequence[int], start: int, end: int) -> List[int]:
    """The sizes of the parts of tensors of ``sizes`` (laid out flat) that fall in elements [start, end)."""
    out, offset = [], 0
    for size in sizes:
        low, high = max(start, offset), min(end, offset + size)
        if high > low:
            out.append(high - low)
        offset += size
    return out


def boundaries(layout: BlockLayout) -> List[int]:
    """The element offsets at which ``layout``'s blocks start, and its end: where it may be cut."""
    starts = layout.table[: layout.n_blocks, 0].tolist()
    return starts + [layout.n_elements] if not starts or starts[-1] != layout.n_elements else starts


def element_boundaries(length: int) -> List[int]:
    """Where a piece of ``length`` elements that no block layout constrains is cut: every block's length."""
    return list(range(0, length, BLOCK_ELEMENTS)) + [length]


def cuts(part_boundaries: Sequence[Sequence[int]], slot: int, count: int) -> Tuple[List[List[int]], List[int]]:
    """Cut L parts, whose allowed cuts are ``part_boundaries`` (each ascending, from 0 to the part's length), into
    at most ``count`` chunks at the targets k * slot / count: (each part's offsets c_0 = 0 < ... = its length, one
    list per part, all of one length K + 1), and each chunk's slot (the longest of its pieces; the slots add up to at
    least ``slot``). Chunks that would be empty in every part are left out."""
    targets = [k * slot // count for k in range(1, count)]
    offsets = []
    for allowed in part_boundaries:
        at = [allowed[max(0, bisect.bisect_right(allowed, t) - 1)] for t in targets]
        offsets.append([0, *at, allowed[-1]])
    keep = [0] + [k for k in range(1, count + 1) if any(c[k] > c[k - 1] for c in offsets)]
    if len(keep) == 1:
        keep.append(count)  # every part is empty: one chunk
    offsets = [[c[k] for k in keep] for c in offsets]
    keep_count = len(keep) - 1
    slots = [max(c[k + 1] - c[k] for c in offsets) for k in range(keep_count)]
    slots[-1] += max(0, slot - sum(slots))  # the last slot takes the part's padding, as the unchunked one
    return offsets, slots
