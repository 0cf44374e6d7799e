"""Wire formats of a gradient bucket: which collectives carry it, how many bytes, and how long they take.

A bucket of ``n`` float32 gradients at world size N can travel as

* ``fp32``, ``bf16``, ``fp16``: one all-reduce of n x 4 or n x 2 bytes (the hook's path today), with the algorithm
  the hook forces for that size (``ramp.best``);
* ``bf16+fp32sum``: the bucket, padded to a multiple of N elements, cast to bfloat16 and exchanged with an
  all-to-all (each rank sends N-1 of its N shards, (N-1)/N of the 2n bytes), each rank sums its shard's N copies in
  float32, then an all-gather of the bfloat16 shards (the same bytes again). As many bytes per rank as a ring
  all-reduce, but two collectives and no bfloat16 rounding in the sum. At N = 2 the runtime sends it as one bf16
  all-reduce, the same bits (a sum of two values rounds once either way), and so is it priced;
* ``fp8``: the same exchange in block-scaled FP8: blocks of ``BLOCK`` = 128 elements, each sent as 128 one-byte
  values and a float32 scale (132 bytes, 1.03125 bytes per element), the block count padded to a multiple of N;
* ``fp4e2m1``: the same in block-scaled E2M1, a block's row 68 bytes (0.53125 bytes per element). At N = 2 the
  runtime sends either block-scaled format as one all-gather of each rank's whole rows (the same bytes per rank, one
  collective, no requantized sum), and so is it priced.

Time is the wire's only: the casts, the block scaling and the float32 sums are kernels this does not model. A
format is priced by its own properties (``ddp_triton.formats.WireFormat``: whether it is one all-reduce at this
world size, its bytes per element or per block's row, its dtype), read from ``formats.WIRES`` where each is declared;
``formats.TRAFFIC``'s class names (``fp8``, ``bf16+fp32sum``) stand for the formats that travel alike
(``formats.traffic_format``): ``fp16+fp32sum`` travels as ``bf16+fp32sum`` does, ``fp8e4m3`` and ``fp8e5m2`` as
``fp8``, and a ``+ef`` suffix (error feedback) sends nothing more.

All-to-all is NCCL's grouped send/receive to every peer: a base latency, a per-peer cost for each of the N-1
messages (an intra-node hop, or a network proxy post), one network hop where nodes are crossed; bandwidth: each GPU
sends (ppn-1)/N of the message over its intra-node link while each node sends ppn x (N-ppn)/N of it through its NICs,
the two at once. With several GPUs per node that node traffic is ppn times a ring's per rank, so on 8-GPU nodes the
all-to-all formats pay for their fewer bytes at the NICs; with one GPU per node they do not.
All-gather is NCCL's ring all-gather: half the steps and half the bytes of a ring all-reduce.

Two-level (``two_level_time_us``, the runtime's ``hierarchical=True``): inside each node a reduce-scatter of the
float32 bucket (priced as the ring all-gather of the same buffer: the same steps and bytes), the node-crossing
exchange of each rank's part (1/ppn of the bucket, whole FP8 blocks) among one rank per node in the format, and an
all-gather inside the node. The ppn cross exchanges run at once and share the node's NICs, so each is priced on a
fabric of one rank per node with 1/ppn of the node's rate. The stages run one after another.

Chunks (``chunked_time_us``): the runtime cuts a two-level bucket, and a flat FP8 one, into chunks at block
boundaries, each exchanged on its own in order, so that a stage works on chunk k+1 while the next stage has chunk k.
Its price is fill plus drain: the stages of one chunk (``chunk_stages_us``: each stage's collective at the chunk's
size, its passes and its host call) one after another, then the slowest stage once for every further chunk. A
chunk costs its collectives' latencies and host calls again, so ``best_chunk_count`` weighs that against the fill,
with at least ``MIN_CHUNK_BYTES`` of the bucket a chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple, Union

from ...dtypes import DTYPE_SIZES
from ...formats import BLOCK, WireFormat, traffic_format
from .fabric import PROTOCOLS, Fabric, _SIMPLE
from .nccl import (BASE_LATENCY_US, HW_LATENCY_US, SINGLE_RANK_US, _latency_parts, _plateau, inter_gbps_nccl,
                   intra_gbps_nccl, nccl_protocol_time_us)
from .ramp import NET_CHUNK_OVERHEAD_US, _factors, best, protocol_time_us

def _one_all_reduce(fmt: WireFormat, world_size: int) -> bool:
    """Whether ``fmt`` travels as one all-reduce at ``world_size``: the 32- and 16-bit all-reduce formats always;
    16 bits with float32 sums over two ranks (``WireFormat.one_all_reduce``: the same bits)."""
    return not fmt.sharded or fmt.one_all_reduce(world_size)


def _collectives(fmt: WireFormat, world_size: int) -> int:
    """Collectives a flat exchange in ``fmt`` issues at ``world_size``: one all-reduce, or over two ranks the
    block-scaled formats' one all-gather (``WireFormat.one_all_gather``); else an all-to-all and an all-gather."""
    return 1 if _one_all_reduce(fmt, world_size) or fmt.one_all_gather(world_size) else 2


def _passes_of(fmt: WireFormat, world_size: int) -> str:
    """The class whose passes a bucket in ``fmt`` runs over ``world_size`` ranks (``HostCost``'s key): 16 bits with
    float32 sums over two ranks is one all-reduce, a 16-bit format's pack and unpack with no sum pass."""
    return replace(fmt, fp32_sum=False).traffic if fmt.sharded and _one_all_reduce(fmt, world_size) else fmt.traffic


def _check(n_elements: int, wire_format: str, world_size: int) -> WireFormat:
    fmt = traffic_format(wire_format)
    if isinstance(n_elements, bool) or not isinstance(n_elements, int) or n_elements < 1:
        raise ValueError(f"n_elements must be an int >= 1, got {n_elements!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return fmt


def wire_collectives(n_elements: int, wire_format: str, world_size: int) -> List[Tuple[str, int]]:
    """The collectives that carry a bucket of ``n_elements`` float32 gradients, each as (``all_reduce`` |
    ``all_to_all`` | ``all_gather``, bytes of its whole buffer, as nccl-tests counts a message)."""
    fmt = _check(n_elements, wire_format, world_size)
    itemsize = DTYPE_SIZES[fmt.wire_dtype]
    if _one_all_reduce(fmt, world_size):
        return [("all_reduce", n_elements * itemsize)]
    n = world_size
    if fmt.row_bytes is None:
        msg = math.ceil(n_elements / n) * n * itemsize
    else:
        msg = math.ceil(math.ceil(n_elements / BLOCK) / n) * n * fmt.row_bytes
    if fmt.one_all_gather(n):  # every rank's whole rows gathered: the same bytes sent, in one collective
        return [("all_gather", n * msg)]
    return [("all_to_all", msg), ("all_gather", msg)]


def wire_bytes(n_elements: int, wire_format: str, world_size: int) -> int:
    """Bytes one rank sends for the bucket: 2(N-1)/N of a ring all-reduce's message (rounded down), (N-1)/N of an
    all-to-all's and of an all-gather's."""
    total = 0
    for kind, msg in wire_collectives(n_elements, wire_format, world_size):
        total += (2 if kind == "all_reduce" else 1) * (world_size - 1) * msg // world_size
    return total


def all_to_all_time_us(fabric: Fabric, nbytes: int) -> float:
    """One all-to-all of an ``nbytes`` buffer (each rank sends nbytes/N to each peer). The intra-node link and hop
    follow the ring's calibration, if the fabric has one."""
    n, ppn, m = fabric.world_size, fabric.ranks_per_node, fabric.nodes
    if n == 1:
        return SINGLE_RANK_US
    cal = _factors(fabric, "ring")
    hw = "nvlink" if fabric.intra_link == "nvlink" else "pcie"
    latency = (BASE_LATENCY_US["ring"][_SIMPLE] + (ppn - 1) * HW_LATENCY_US[hw]["ring"][_SIMPLE]) * cal.latency_scale
    if m > 1:
        latency += (n - ppn) * NET_CHUNK_OVERHEAD_US[_SIMPLE] + HW_LATENCY_US["net"]["ring"][_SIMPLE]
    intra = (ppn - 1) / n * nbytes / (1e3 * intra_gbps_nccl(fabric) * cal.bandwidth_scale) if ppn > 1 else 0.0
    inter = ppn * (n - ppn) / n * nbytes / (1e3 * inter_gbps_nccl(fabric)) if m > 1 else 0.0
    return latency + max(intra, inter)


def all_gather_time_us(fabric: Fabric, nbytes: int) -> float:
    """One ring all-gather into an ``nbytes`` buffer: N-1 steps of nbytes/N, half a ring all-reduce's steps and
    bytes, with its base latency once; the protocol NCCL's estimate prefers."""
    if fabric.world_size == 1:
        return SINGLE_RANK_US
    cal = _factors(fabric, "ring")
    times = []
    for proto in PROTOCOLS:
        nccl = nccl_protocol_time_us(fabric, nbytes, "ring", proto)
        if nccl is None:
            continue
        p = PROTOCOLS.index(proto)
        base = _latency_parts(fabric, "ring", p)[0] * cal.latency_scale * _plateau(fabric, "ring", p)
        whole = protocol_time_us(fabric, nbytes, "ring", proto)
        times.append((nccl, base + 0.5 * (whole - base)))  # type: ignore[operator]
    return min(times)[1]


def wire_format_time_us(fabric: Fabric, n_elements: int, wire_format: str) -> float:
    """Predicted wire time of a bucket of ``n_elements`` float32 gradients in ``wire_format`` on ``fabric``."""
    total = 0.0
    for kind, msg in wire_collectives(n_elements, wire_format, fabric.world_size):
        if kind == "all_reduce":
            total += best(fabric, msg, traffic_format(wire_format).wire_dtype).time_us
        elif kind == "all_to_all":
            total += all_to_all_time_us(fabric, msg)
        else:
            total += all_gather_time_us(fabric, msg)
    return total


def two_level_part(n_elements: int, ranks_per_node: int) -> int:
    """Elements of each rank's part in a two-level exchange: the bucket's blocks shared out, whole blocks each."""
    blocks = math.ceil(n_elements / BLOCK)
    return max(1, math.ceil(blocks / ranks_per_node)) * BLOCK


def two_level_node_bytes(n_elements: int, wire_format: str, ranks_per_node: int, nodes: int) -> int:
    """Bytes one node sends through its link for a two-level bucket: its ppn ranks' cross exchanges."""
    part = two_level_part(n_elements, ranks_per_node)
    return ranks_per_node * wire_bytes(part, wire_format, nodes)


def two_level_time_us(fabric: Fabric, n_elements: int, wire_format: str) -> float:
    """Predicted wire time of a bucket of ``n_elements`` float32 gradients exchanged two-level in ``wire_format``;
    on one node or with one rank per node, the flat exchange's (what the runtime falls back to)."""
    _check(n_elements, wire_format, fabric.world_size)
    ppn, m = fabric.ranks_per_node, fabric.nodes
    if ppn == 1 or m == 1:
        return wire_format_time_us(fabric, n_elements, wire_format)
    part = two_level_part(n_elements, ppn)
    node = replace(fabric, nodes=1, inter_gbps=0.0)
    cross = replace(fabric, ranks_per_node=1, intra_gbps=0.0, inter_gbps=fabric.inter_gbps / ppn, nvswitch=False,
                    calibration=None)
    inside = 2 * all_gather_time_us(node, ppn * part * 4)  # reduce-scatter + all-gather of the float32 bucket
    return inside + wire_format_time_us(cross, part, wire_format)


# --------------------------------------------------------------------------------------------------------------------
# What a bucket costs in each format (``ddp_triton.formats.WireFormat``): the wire plus the host
# --------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostCost:
    """What a bucket costs on the host and in its passes, besides the wire: a fixed cost per bucket (the hook, the
    first collective's call, the completion), a cost per further collective a staged format issues (the exchange
    queue, the call, the completion), and the format's passes over the bucket per float32 element (pack and unpack;
    FP8's quantize, reduce and dequantize; a two-level exchange's copies)."""

    bucket_us: float
    collective_us: float
    ns_per_element: Tuple[Tuple[str, float], ...]
    """(``WireFormat.traffic``, the class each dtype declares in ``formats.WIRES``; ns per bucket element of its
    passes on the whole bucket); two-level formats run them on 1/ppn of the bucket plus
    ``two_level_ns_per_element``."""
    two_level_ns_per_element: float = 0.0
    cuts_buckets: bool = False
    """Whether the runtime cuts a large FP8 or two-level bucket into chunks on this host (``chunkable``): on CPU
    ranks; CUDA ranks keep whole buckets, their stages on one stream."""
    source: str = ""
    """Where the numbers come from."""

    def passes_ns(self, traffic: str) -> float:
        return dict(self.ns_per_element)[traffic]


#: The host of a CPU gloo rank (``runtime`` on CPU tensors, the FP8 passes compiled): bench.hook_cost's extra host
#: time per bucket over DDP without a hook (51.5 us for float32, 162 for bf16 + float32 sums, 147 for FP8: one more
#: collective each, about 100 us) and bench.wire_kernels --cpu's passes per element (one thread, 25 MiB), both on
#: an AMD EPYC with 2 cores, torch 2.13 (bench/RESULTS.md, 2026-12-01). E2M1's compiled passes took 0.97-1.00x
#: FP8's in the same runs (bench/RESULTS.md, H24, torch 2.14): FP8's figure.
CPU_HOST_COST = HostCost(
    bucket_us=51.5, collective_us=100.0,
    ns_per_element=(("fp32", 0.12), ("bf16", 0.35), ("fp16", 0.35), ("bf16+fp32sum", 0.55), ("fp8", 0.83),
                    ("fp4e2m1", 0.83)),
    two_level_ns_per_element=0.25, cuts_buckets=True,
    source="CPU ranks on gloo: bench.hook_cost and bench.wire_kernels --cpu, AMD EPYC, 2026-12-01")

#: The host of a GPU rank: 66 us per bucket (the H200's bench.ddp_step, ``profile.DEFAULT_HOST_US_PER_BUCKET``); the
#: passes are kernels at HBM rate (about 12 bytes per element for the 16-bit formats' pack and unpack, 30 for FP8's
#: and about as many for E2M1's, whose residuals and bucket are the same bytes and whose rows are half, at 3 TB/s).
#: The further collective's cost is the CPU's figure: not measured on a GPU.
GPU_HOST_COST = HostCost(
    bucket_us=66.0, collective_us=100.0,
    ns_per_element=(("fp32", 0.0), ("bf16", 0.004), ("fp16", 0.004), ("bf16+fp32sum", 0.005), ("fp8", 0.010),
                    ("fp4e2m1", 0.010)),
    two_level_ns_per_element=0.003,
    source="GPU ranks: the H200's host time per bucket (bench.ddp_step); kernels at HBM rate; the further "
           "collective's cost as measured on CPU (not on a GPU)")


def collectives_of(fmt: WireFormat, fabric: Fabric) -> int:
    """How many collectives a bucket in ``fmt`` issues on ``fabric`` (two-level falls back to flat on one node or
    with one rank per node, as the runtime does)."""
    if fmt.two_level and fabric.ranks_per_node > 1 and fabric.nodes > 1:
        # the node's reduce-scatter (or all-reduce) and all-gather around the exchange between the nodes
        return _collectives(fmt, fabric.nodes) + 2
    return _collectives(fmt, fabric.world_size)


def host_time_us(fabric: Fabric, n_elements: int, fmt: WireFormat, host: HostCost) -> float:
    """The host and pass time of one bucket of ``n_elements`` float32 gradients in ``fmt``."""
    two_level = fmt.two_level and fabric.ranks_per_node > 1 and fabric.nodes > 1
    exchanged_by = fabric.nodes if two_level else fabric.world_size
    passes = host.passes_ns(_passes_of(fmt, exchanged_by))
    if two_level:
        passes = passes / fabric.ranks_per_node + host.two_level_ns_per_element
    return host.bucket_us + (collectives_of(fmt, fabric) - 1) * host.collective_us + passes * n_elements * 1e-3


def bucket_time_us(fabric: Fabric, n_elements: int, fmt: Union[WireFormat, str], host: HostCost) -> float:
    """Predicted time of one bucket of ``n_elements`` float32 gradients in ``fmt`` (a WireFormat or its name): the
    wire (``wire_format_time_us``, or ``two_level_time_us``) plus ``host_time_us``; a format the runtime cuts into
    chunks at the count ``best_chunk_count`` picks (``chunked_time_us``: one chunk is the sum above)."""
    fmt = WireFormat.parse(fmt) if isinstance(fmt, str) else fmt
    if chunkable(fmt, fabric, host):
        return chunked_time_us(fabric, n_elements, fmt, host, best_chunk_count(fabric, n_elements, fmt, host))
    wire = (two_level_time_us if fmt.two_level else wire_format_time_us)(fabric, n_elements, fmt.traffic)
    return wire + host_time_us(fabric, n_elements, fmt, host)


# --------------------------------------------------------------------------------------------------------------------
# A bucket cut into chunks: fill plus drain
# --------------------------------------------------------------------------------------------------------------------

#: The least of a bucket a chunk holds (its gradients' bytes), so that a chunk's host calls (a few hundred us on a
#: CPU rank, ``CPU_HOST_COST``) and gloo's latency below 128 KiB (0.9-4 ms whatever the size, bench/RESULTS.md) stay
#: small beside its bytes: a bucket under twice this is never cut.
MIN_CHUNK_BYTES = 1 << 20
#: The most chunks a bucket is cut into: beyond it the fill saved is under 1/64 of the other stages.
MAX_CHUNKS = 64


def chunkable(fmt: WireFormat, fabric: Fabric, host: HostCost) -> bool:
    """Whether the runtime cuts a bucket in ``fmt`` into chunks on ``fabric`` and ``host`` (``runtime/chunks.py``
    asks this too): where the host cuts buckets at all, a two-level exchange that runs two-level there, or the flat
    block-scaled FP8 exchange, and only where chunks keep the bits (``WireFormat.chunks_keep_bits``)."""
    if not host.cuts_buckets:
        return False
    if fmt.two_level and fabric.ranks_per_node > 1 and fabric.nodes > 1:
        return fmt.chunks_keep_bits(fabric.ranks_per_node, fabric.nodes)
    return fmt.block_scaled and not fmt.two_level and fabric.world_size > 1 and \
        fmt.chunks_keep_bits(1, fabric.world_size)


def pipelined_us(stage_us: Sequence[float], chunks: int) -> float:
    """Fill plus drain: the stages of one chunk one after another, then the slowest stage for each further chunk."""
    return sum(stage_us) + (chunks - 1) * max(stage_us)


def chunk_stages_us(fabric: Fabric, n_elements: int, fmt: WireFormat, host: HostCost,
                    link_elements: Optional[int] = None) -> List[float]:
    """Each stage's time for one chunk of ``n_elements`` float32 gradients, in pipeline order, the stage that
    crosses the node link second. Two-level: the node's sum (reduce-scatter and the pack), the exchange between the
    nodes (its collectives and the format's passes on the chunk's part), the node's all-gather (and the unpack).
    Flat FP8: the quantize, the all-to-all, reduce and all-gather (one group: one after another), the dequantize.
    Each stage's collectives cost ``host.collective_us`` on the host. ``link_elements``: the collectives that cross
    the node link priced at that many elements instead (one block: their fixed cost), for
    ``link_bound_chunk_count``."""
    on_link = n_elements if link_elements is None else link_elements
    call = host.collective_us
    if fmt.two_level:
        ppn = fabric.ranks_per_node
        part = two_level_part(n_elements, ppn)
        node = replace(fabric, nodes=1, inter_gbps=0.0)
        cross = replace(fabric, ranks_per_node=1, intra_gbps=0.0, inter_gbps=fabric.inter_gbps / ppn,
                        nvswitch=False, calibration=None)
        inside = all_gather_time_us(node, ppn * part * 4) + call
        copies = 0.5 * host.two_level_ns_per_element * n_elements * 1e-3
        between = (wire_format_time_us(cross, two_level_part(on_link, ppn), fmt.traffic)
                   + host.passes_ns(_passes_of(fmt, fabric.nodes)) * part * 1e-3)
        return [inside + copies, between + _collectives(fmt, fabric.nodes) * call,
                inside + copies]
    third = host.passes_ns(fmt.traffic) * n_elements * 1e-3 / 3
    return [third, wire_format_time_us(fabric, on_link, fmt.traffic) + _collectives(fmt, fabric.world_size) * call
            + third, third]


def chunked_time_us(fabric: Fabric, n_elements: int, fmt: WireFormat, host: HostCost, chunks: int) -> float:
    """Predicted time of one bucket in ``fmt`` cut into ``chunks`` chunks (``chunkable``): the host's cost per bucket
    (which includes the first collective's call) and the chunks' fill plus drain."""
    stages = chunk_stages_us(fabric, math.ceil(n_elements / chunks), fmt, host)
    return host.bucket_us - host.collective_us + pipelined_us(stages, chunks)


def _chunk_counts(n_elements: int, element_bytes: int, min_chunk_bytes: int) -> range:
    return range(1, max(1, min(MAX_CHUNKS, n_elements * element_bytes // min_chunk_bytes)) + 1)


def best_chunk_count(fabric: Fabric, n_elements: int, fmt: WireFormat, host: HostCost,
                     min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """The chunk count that prices a bucket of ``n_elements`` float32 gradients lowest (``chunked_time_us``), each
    chunk at least ``min_chunk_bytes`` of it; 1 where ``fmt`` is not cut on ``fabric``."""
    if not chunkable(fmt, fabric, host):
        return 1
    counts = _chunk_counts(n_elements, 4, min_chunk_bytes)
    return min(counts, key=lambda k: chunked_time_us(fabric, n_elements, fmt, host, k))


def link_bound_chunk_count(fabric: Fabric, n_elements: int, element_bytes: int, fmt: WireFormat, host: HostCost,
                           min_chunk_bytes: int = MIN_CHUNK_BYTES) -> int:
    """``best_chunk_count`` where the node link's rate is not known (NVML sees no NICs), as if the link were the
    slowest stage, the case chunks are for. Fill plus drain is then the link's bytes, whatever the count, plus the
    other stages of one chunk and the link stage's fixed cost (latency, host calls: its time at one block) for every
    further chunk; the count that minimises that does not depend on the link's rate (``fabric.inter_gbps`` prices
    one block only). Buckets of ``element_bytes`` per gradient."""
    if not chunkable(fmt, fabric, host):
        return 1

    def price(k: int) -> float:
        stages = chunk_stages_us(fabric, math.ceil(n_elements / k), fmt, host, link_elements=BLOCK)
        return sum(stages) + (k - 1) * stages[1]

    return min(_chunk_counts(n_elements, element_bytes, min_chunk_bytes), key=price)
