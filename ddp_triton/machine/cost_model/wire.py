"""Wire formats of a gradient bucket: which collectives carry it, how many bytes, and how long they take.

A bucket of ``n`` float32 gradients at world size N can travel as

* ``fp32``, ``bf16``, ``fp16``: one all-reduce of n x 4 or n x 2 bytes (the hook's path today), with the algorithm
  the hook forces for that size (``ramp.best``);
* ``bf16+fp32sum``: the bucket, padded to a multiple of N elements, cast to bfloat16 and exchanged with an
  all-to-all (each rank sends N-1 of its N shards, (N-1)/N of the 2n bytes), each rank sums its shard's N copies in
  float32, then an all-gather of the bfloat16 shards (the same bytes again). As many bytes per rank as a ring
  all-reduce, but two collectives and no bfloat16 rounding in the sum;
* ``fp8``: the same exchange in block-scaled FP8: blocks of ``FP8_BLOCK`` = 128 elements, each sent as 128 one-byte
  values and a float32 scale (``FP8_BLOCK_BYTES`` = 132 bytes, 1.03125 bytes per element), the block count padded
  to a multiple of N.

Time is the wire's only: the casts, the FP8 scaling and the float32 sums are kernels this does not model. The
runtime's names (``ddp_triton.runtime.wire``) are accepted too: ``fp16+fp32sum`` travels as ``bf16+fp32sum`` does,
``fp8e4m3`` and ``fp8e5m2`` as ``fp8``, and a ``+ef`` suffix (error feedback) sends nothing more.

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
"""

from __future__ import annotations

import math
from typing import List, Tuple

from dataclasses import replace

from .fabric import PROTOCOLS, Fabric, _SIMPLE
from .nccl import (BASE_LATENCY_US, HW_LATENCY_US, SINGLE_RANK_US, _latency_parts, _plateau, inter_gbps_nccl,
                   intra_gbps_nccl, nccl_protocol_time_us)
from .ramp import NET_CHUNK_OVERHEAD_US, _factors, best, protocol_time_us

#: The formats, in the order tables show them.
WIRE_FORMATS: Tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16+fp32sum", "fp8")
#: Elements per FP8 block and the bytes a block travels as: 128 one-byte values and a float32 scale.
FP8_BLOCK = 128
FP8_BLOCK_BYTES = FP8_BLOCK + 4
#: The runtime's names of the same traffic (ddp_triton/runtime/wire.py).
WIRE_FORMAT_ALIASES = {"fp16+fp32sum": "bf16+fp32sum", "fp8e4m3": "fp8", "fp8e5m2": "fp8"}
_ALL_REDUCE_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
_ALL_REDUCE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_wire_format(wire_format: str) -> str:
    """The name of ``WIRE_FORMATS`` that travels as ``wire_format`` does (runtime names and ``+ef`` accepted)."""
    name = wire_format[:-3] if isinstance(wire_format, str) and wire_format.endswith("+ef") else wire_format
    name = WIRE_FORMAT_ALIASES.get(name, name)
    if name not in WIRE_FORMATS:
        known = ", ".join([*WIRE_FORMATS, *WIRE_FORMAT_ALIASES])
        raise ValueError(f"unknown wire format {wire_format!r}; known: {known} (fp8 formats may end in +ef)")
    return name


def _check(n_elements: int, wire_format: str, world_size: int) -> str:
    wire_format = canonical_wire_format(wire_format)
    if isinstance(n_elements, bool) or not isinstance(n_elements, int) or n_elements < 1:
        raise ValueError(f"n_elements must be an int >= 1, got {n_elements!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return wire_format


def wire_collectives(n_elements: int, wire_format: str, world_size: int) -> List[Tuple[str, int]]:
    """The collectives that carry a bucket of ``n_elements`` float32 gradients, each as (``all_reduce`` |
    ``all_to_all`` | ``all_gather``, bytes of its whole buffer, as nccl-tests counts a message)."""
    wire_format = _check(n_elements, wire_format, world_size)
    if wire_format in _ALL_REDUCE_ITEMSIZE:
        return [("all_reduce", n_elements * _ALL_REDUCE_ITEMSIZE[wire_format])]
    n = world_size
    if wire_format == "bf16+fp32sum":
        msg = math.ceil(n_elements / n) * n * 2
    else:
        msg = math.ceil(math.ceil(n_elements / FP8_BLOCK) / n) * n * FP8_BLOCK_BYTES
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
            total += best(fabric, msg, _ALL_REDUCE_DTYPE[canonical_wire_format(wire_format)]).time_us
        elif kind == "all_to_all":
            total += all_to_all_time_us(fabric, msg)
        else:
            total += all_gather_time_us(fabric, msg)
    return total


def two_level_part(n_elements: int, ranks_per_node: int) -> int:
    """Elements of each rank's part in a two-level exchange: the bucket's blocks shared out, whole blocks each."""
    blocks = math.ceil(n_elements / FP8_BLOCK)
    return max(1, math.ceil(blocks / ranks_per_node)) * FP8_BLOCK


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
