"""The bandwidth ramp: what an all-reduce of a given size really costs with the protocol NCCL picks.

NCCL's estimate (``nccl.py``) is ``latency + bytes / bandwidth`` with one bandwidth per (algorithm, protocol): close
at large messages, 1.4 to 2x optimistic at 1 to 16 MiB on 8-GPU NVLink nodes. NCCL reaches its peak only for large
messages, for reasons its own code shows; this module charges them:

1. **The protocol NCCL picks.** NCCL picks a protocol (and, unless forced, an algorithm) by its estimate; the hook
   only forces the algorithm. ``estimate`` therefore takes NCCL's pick and times it with the terms below, which can
   be slower than another protocol would have been.
2. **Per-protocol latencies, per step.** NCCL's base and per-hop latencies (``nccl.BASE_LATENCY_US``,
   ``nccl.HW_LATENCY_US``), with one correction measured in public sweeps: Ampere NVLink steps cost
   ``AMPERE_NVLINK_STEP_US`` more (LL a fraction of it, ``_step_extra_us``), and ring LL on Ampere moves
   ``AMPERE_RING_LL_FACTOR`` of the links, not NCCL 2.21+'s 0.5.
3. **Channels per size, bandwidth per channel.** Below ``channels x threads x threshold`` bytes NCCL drops channels
   (enqueue.cc), and each channel moves its share at a channel's bandwidth (NCCL's per-channel caps are in
   ``nccl.PER_CHANNEL_MAX_GBPS``): the bandwidth term cannot fall below one channel's minimum share.
4. **Chunk pipelining.** A ring moves at most one chunk per channel per step (``nccl.RING_CHUNK_BYTES``); a larger
   message runs in several windows of 2(n-1) steps, each paying the hops again (NCCL charges them once; the AWS
   tuner plugin, aws-ofi-nccl include/internal/tuner/algo/allreduce/ring.h, counts windows the same way). NVLS and
   NVLSTree pipeline chunks that NCCL shrinks for smaller messages (``nccl.nvls_chunk_bytes``); every chunk costs a
   synchronisation (``NVLS_CHUNK_SYNC_US``), and a node's proxies post the chunks that cross the network no faster
   than one per ``NET_CHUNK_OVERHEAD_US`` each.

Held against published nccl-tests sweeps (tests/unit/machine/test_cost_model_validation.py; the table is in
docs/autotune.md) this is within 1.3x at 1 MiB and above on the five systems the validation requires, except 1.35x at
two points; multi-node trees at 16 MiB on 4 and 8 nodes remain 1.4 and 1.9x optimistic, as NCCL's own estimate is.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from ...dtypes import dtype_size, normalize_dtype
from .calibration import AlgorithmCalibration
from .fabric import (Estimate, Fabric, _LL, _LL128, _SIMPLE, algbw_gbps, algorithm_unavailable_reason,
                     available_algorithms, busbw_factor)
from .nccl import (HW_LATENCY_US, NET_OVERHEAD_US, NVLS_ALGBW_FRACTION, NVLS_CHUNK_BYTES, RING_CHUNK_BYTES,
                   _bus_and_ratio, _latency_parts, _plateau, _protocol_runs, channel_min_bytes, checked_protocol,
                   comm_channels, inter_gbps_nccl, nccl_protocol, nccl_protocol_time_us, nvls_channels,
                   nvls_chunk_bytes, protocol_algbw_gbps, untimed_us)

#: Extra latency per intra-node ring or tree step on Ampere NVLink, LL128 and Simple, microseconds. Both published
#: 8 x A100 sweeps are 1.4 to 1.8x slower than NCCL's estimate from 2 to 32 MiB (bench/published/
#: nccl_allreduce_published.md, A.4: 1a OCI BM.GPU4.8, 1b NCCL 2.29.3), where the H100 sweeps match it; the
#: difference is a near constant time per size, i.e. per step. A plausible cause for Simple, not measured: NCCL reads
#: rather than writes over NVLink on SM80 only (P2P read, ``ncclTopoCheckP2p`` in src/graph/paths.cc), and only for
#: the Simple buffer (src/transport/p2p.cc, ``info->read && p == NCCL_PROTO_SIMPLE``). 4.0 us is fitted to the 1a
#: sweep (1 MiB to 8 GiB, least squares on log-time) and checked against 1b. LL pays a fraction (``_step_extra_us``).
AMPERE_NVLINK_STEP_US = 4.0
#: Ring LL all-reduce on Ampere moves this fraction of the ring's bus bandwidth (capped at NCCL's llMaxBws, 87.7 GB/s
#: on one node). NCCL 2.7.3 to 2.20.5 modelled it so for every GPU (src/graph/tuning.cc, ``busBw * 1.0/4.0`` for
#: all-reduce: 60 GB/s on 8 x A100); 2.21.5 changed it to 0.5 together with Hopper's llMaxBws (87.7 -> 141), so on
#: A100 NCCL's estimate now sits at the Ampere cap, which the old factor never reached. The published A100 sweep
#: agrees with the old figure: 1a's LL sizes add time at 44 to 52 GB/s busbw (256 KiB to 2 MiB). NCCL still picks
#: its protocol by its own estimate (``nccl.py``); only the time of ring LL uses this.
AMPERE_RING_LL_FACTOR = 0.25
#: Synchronisation per NVLS chunk per channel, microseconds. The H100 NVLS sweep (together-nccl-tests,
#: benchmarks/H100/results/20260306_001221_slurm/all_reduce_nvls.out) jumps from 249 to 267 GB/s algbw between
#: 512 MiB and 1 GiB, exactly where NCCL's chunk grows from 64 to 128 KiB (calcCollChunking): with 16 channels at
#: about 19 GB/s each, 0.64 us per chunk makes both sizes fit (12 KiB of transfer per chunk). Fitted on those two
#: points; the sweep's other sizes (2 MiB to 256 MiB, chunks of 16 to 64 KiB) are within 1.34x.
NVLS_CHUNK_SYNC_US = 0.64
#: Cost of each chunk a rank sends across the network, by protocol: its proxy thread posts one send per chunk,
#: which NCCL charges as ``getNetOverhead`` (1 us on Intel), tripled for Simple, in its multi-node ring latency
#: (tuning.cc). Not fitted.
NET_CHUNK_OVERHEAD_US = (NET_OVERHEAD_US, NET_OVERHEAD_US, 3.0 * NET_OVERHEAD_US)
#: Data one tree step moves per channel (calcCollChunking, chunkSteps 1): LL 32 KiB, LL128 576,000 B, Simple 512 KiB.
TREE_CHUNK_BYTES = (32 * 1024, 576_000, 512 * 1024)

_UNCALIBRATED = AlgorithmCalibration()


def _factors(f: Fabric, algorithm: str) -> AlgorithmCalibration:
    return f.calibration.for_algorithm(algorithm) if f.calibration is not None else _UNCALIBRATED


def ring_windows(f: Fabric, nbytes: int, p: int) -> int:
    """Windows of 2(n-1) steps a ring all-reduce of ``nbytes`` runs in: channels x ranks x chunk bytes each."""
    window = comm_channels(f) * f.world_size * RING_CHUNK_BYTES[p]
    return max(1, math.ceil(nbytes / window))


def _tree_chunk(f: Fabric, nbytes: int, p: int) -> int:
    """NCCL's tree chunk: LL128 halves it for small messages against the tree's depth (calcCollChunking)."""
    chunk = TREE_CHUNK_BYTES[p]
    if p == _LL128:
        ppn = f.ranks_per_node
        steps = 1 + max(0, f.nodes.bit_length() - 1) + 0.1 * ppn
        nc = comm_channels(f)
        while nbytes // (nc * chunk) < steps * 64 / ppn and chunk > 131072:
            chunk //= 2
        while nbytes // (nc * chunk) < steps * 16 / ppn and chunk > 32768:
            chunk //= 2
    return chunk


def _intra_steps(f: Fabric, algorithm: str) -> int:
    """Steps of a ring or tree all-reduce that stay inside a node (NVLS has none of NCCL's ring steps)."""
    if algorithm == "ring":
        return 2 * (f.world_size - 1) - (2 * (f.nodes - 1) if f.nodes > 1 else 0)
    if algorithm == "tree":
        return 2 * (f.ranks_per_node - 1)
    return 0


def _step_extra_us(f: Fabric, algorithm: str, p: int) -> float:
    """What an intra-node step on Ampere NVLink costs beyond NCCL's per-hop latency. LL pays
    ``AMPERE_NVLINK_STEP_US`` scaled by NCCL's own NVLink hop latency of LL against LL128 (tuning.cc hwLatencies: ring
    0.6 vs 1.9 us, tree 0.6 vs 1.25): LL pushes its data the way LL128 does (flags inline in the lines it writes into
    the receiver's buffer, no per-step fence, no P2P read), with less per hop. Free fits on the LL sizes (128 KiB to
    2 MiB) give 1.7 us (1a) and 1.1 us (1b) per ring step, against 1.26 here."""
    if not (f.arch == "ampere" and f.intra_link == "nvlink"):
        return 0.0
    if p == _LL:
        hop = HW_LATENCY_US["nvlink"][algorithm]
        return AMPERE_NVLINK_STEP_US * hop[_LL] / hop[_LL128]
    return AMPERE_NVLINK_STEP_US


def _proxy_gbps(f: Fabric, chunk: int, p: int) -> float:
    """What a node's network proxies can post: one chunk per ``NET_CHUNK_OVERHEAD_US`` per rank (one proxy thread
    per rank posts every network send of its channels), GB/s per node."""
    return f.ranks_per_node * chunk / (1e3 * NET_CHUNK_OVERHEAD_US[p])


def _tree_egress_ratio(f: Fabric) -> float:
    """algbw per node egress of a tree across nodes: a node sends S over the two trees, S with two nodes."""
    return 1.0 if f.nodes == 2 else 0.5


def _transfer_us(f: Fabric, nbytes: int, algorithm: str, p: int, bw_scale: float, lat_scale: float) -> float:
    """Time the bytes take: NCCL's bandwidth for the protocol, the channels the size gets, and the chunk
    overheads of NVLS and of the network."""
    if algorithm in ("nvls", "nvls_tree"):
        fraction = NVLS_ALGBW_FRACTION[f.arch] * f.intra_gbps * bw_scale
        nch = nvls_channels(f)
        chunk = nvls_chunk_bytes(f, nbytes, algorithm)
        # NCCL's NVLS throughput holds at its largest chunk; smaller chunks pay more synchronisations per byte.
        extra_chunks = nbytes / nch * (1.0 / chunk - 1.0 / NVLS_CHUNK_BYTES)
        nvls = nbytes / (1e3 * fraction) + extra_chunks * NVLS_CHUNK_SYNC_US * lat_scale
        if algorithm == "nvls":
            return nvls
        # Across nodes a tree: each node sends S through its NICs, 2S over the two trees beyond two nodes; no
        # faster than its ranks' proxies post the chunks.
        inter_alg = min(inter_gbps_nccl(f) * (1.0 if f.nodes == 2 else 0.5), _proxy_gbps(f, chunk, _SIMPLE))
        return max(nvls, nbytes / (1e3 * inter_alg))
    alg = protocol_algbw_gbps(f, nbytes, algorithm, p, bw_scale)
    bus, ratio = _bus_and_ratio(f, algorithm, bw_scale)
    if algorithm == "ring" and p == _LL and f.arch == "ampere":
        alg = min(alg, bus * AMPERE_RING_LL_FACTOR * ratio)
    nc = comm_channels(f)
    q = channel_min_bytes(f, algorithm, p)
    used = min(float(nc), max(1.0, nbytes / q)) if q else float(nc)
    # The channels kept move at most their share of the links (the protocol's own cap may be lower still).
    alg = min(alg, bus * ratio * used / nc)
    if algorithm == "tree" and f.nodes > 1:
        alg = min(alg, _proxy_gbps(f, _tree_chunk(f, nbytes, p), p) * _tree_egress_ratio(f))
    return nbytes / (1e3 * alg)


def protocol_time_us(fabric: Fabric, nbytes: int, algorithm: str, protocol: str) -> Optional[float]:
    """Time of one all-reduce of ``nbytes`` with (algorithm, protocol), ramp and calibration included; None where
    NCCL would not run it."""
    p = checked_protocol(nbytes, protocol)
    if fabric.world_size == 1 or not _protocol_runs(fabric, algorithm, p):
        return untimed_us(fabric, algorithm, p)
    cal = _factors(fabric, algorithm)
    base, intra, inter = _latency_parts(fabric, algorithm, p)
    windows = ring_windows(fabric, nbytes, p) if algorithm == "ring" else 1
    intra += _intra_steps(fabric, algorithm) * _step_extra_us(fabric, algorithm, p)
    latency = (base * cal.latency_scale + windows * (intra * cal.latency_scale + inter)) * \
        _plateau(fabric, algorithm, p)
    return latency + _transfer_us(fabric, nbytes, algorithm, p, cal.bandwidth_scale, cal.latency_scale)


def _check_size(nbytes: int, dtype: Any) -> None:
    size = dtype_size(dtype)
    if nbytes % size:
        raise ValueError(f"{nbytes} bytes is not a whole number of {normalize_dtype(dtype)} elements")


def _timed(fabric: Fabric, nbytes: int, algorithm: str) -> Estimate:
    proto = nccl_protocol(fabric, nbytes, algorithm)
    assert proto is not None, (algorithm, fabric)
    t = protocol_time_us(fabric, nbytes, algorithm, proto)
    assert t is not None, (algorithm, proto, fabric)
    alg = algbw_gbps(nbytes, t) if nbytes else 0.0
    return Estimate(nbytes=nbytes, algorithm=algorithm, protocol=proto, time_us=t, algbw_gbps=alg,
                    busbw_gbps=alg * busbw_factor(fabric.world_size))


def estimate(fabric: Fabric, nbytes: int, algorithm: str, dtype: Any = "bfloat16") -> Estimate:
    """One all-reduce of ``nbytes`` with ``algorithm`` forced: the protocol NCCL picks for it and what that costs
    (ValueError if the algorithm is unavailable)."""
    why = algorithm_unavailable_reason(fabric, algorithm, dtype)
    if why is not None:
        raise ValueError(why)
    _check_size(nbytes, dtype)
    return _timed(fabric, nbytes, algorithm)


def sweep(fabric: Fabric, sizes: Sequence[int], dtype: Any = "bfloat16",
          algorithms: Optional[Iterable[str]] = None) -> List[Estimate]:
    """Estimates for every size and every available (or given) algorithm, size-major."""
    algs = list(algorithms) if algorithms is not None else available_algorithms(fabric, dtype)
    return [estimate(fabric, s, a, dtype) for s in sizes for a in algs]


def best(fabric: Fabric, nbytes: int, dtype: Any = "bfloat16") -> Estimate:
    """The fastest available algorithm for ``nbytes`` (what the hook forces for a bucket of that size)."""
    return min((estimate(fabric, nbytes, a, dtype) for a in available_algorithms(fabric, dtype)),
               key=lambda e: e.time_us)


def nccl_choice(fabric: Fabric, nbytes: int, dtype: Any = "bfloat16",
                nccl_version: Optional[Tuple[int, int, int]] = None) -> Estimate:
    """What NCCL does left to itself: the (algorithm, protocol) its own estimate ranks fastest, timed by this model.
    This is what nccl-tests measures without ``NCCL_ALGO``."""
    _check_size(nbytes, dtype)
    choices = []
    for a in available_algorithms(fabric, dtype, nccl_version):
        proto = nccl_protocol(fabric, nbytes, a)
        if proto is not None:
            choices.append((nccl_protocol_time_us(fabric, nbytes, a, proto), a))
    return _timed(fabric, nbytes, min(choices)[1])
