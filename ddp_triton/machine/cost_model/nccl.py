"""NCCL's own all-reduce tuning model, in NCCL's form: ``time = latency + bytes / bandwidth`` per (algorithm,
protocol), from its constants and the link rates of the machine; and what NCCL derives from the topology besides
(channels, chunk sizes) that the ramp (``ramp.py``) needs.

NCCL chooses an all-reduce's protocol, and its algorithm unless one is forced, with this model
(``ncclTopoGetAlgoTime``, the minimum over enabled pairs). ``nccl_protocol_time_us`` is that estimate and
``nccl_protocol`` NCCL's pick. The model is close at large messages but optimistic in between (about 1.4 to 2x at
1 to 16 MiB on A100 and H100, bench/published/nccl_allreduce_published.md, B.6): ``ramp.py`` times what NCCL picks.

Where the numbers come from (facts read from public sources, not code):

* ``BASE_LATENCY_US``, ``HW_LATENCY_US``, the protocol factors, ``LL_MAX_BUSBW``, ``TREE_CORRECTION``, the per-channel
  caps, the ring plateau and the network post overhead: NCCL 2.30.7, ``src/graph/tuning.cc``
  (``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``). They are the same in 2.23.4 for
  Volta to Hopper.
* Link efficiencies: NCCL 2.30.7 ``src/graph/topo.h`` gives the bandwidth NCCL's topology search assumes per link:
  ``SM90_NVLINK_BW 20.6`` GB/s per NVLink4 link of 25 GB/s line rate, ``SM80_NVLINK_BW 20.0`` of 25,
  ``SM100_NVLINK_BW 40.1`` of 50, ``PCI_BW 12.0`` for PCIe Gen3 x16 (16 GB/s line), ``NET_BW 12.0`` for
  100 Gbit/s (12.5 GB/s line). The H100 value agrees with what NCCL's maintainer reports measured: "450GB/s is the
  line rate ... NCCL can get an effective NVLink bandwidth of 370GB/s" (NVIDIA/nccl-tests#212).
* NVLS throughput: the same comment gives 8 x H100 with NVLink SHARP "a peak busBw of ~480GB/s (algbw ~275GB/s)",
  i.e. algbw = 0.61 of the 450 GB/s line rate. H800 (200 GB/s NVLink) was reported at 215 GB/s busbw
  (NVIDIA/nccl#1374), the same fraction. Blackwell scales it by NCCL's ``nvlsEfficiency`` ratio (0.74 Blackwell /
  0.85 Hopper, tuning.cc).
* Channels, chunks and thresholds: ``src/graph/search.cc`` (speed ladders, ``ncclTopoDupChannels``),
  ``src/graph/connect.cc`` (the communicator doubles the graph's channels), ``src/include/device.h`` (``NCCL_STEPS``,
  ``MAXCHANNELS``), ``src/include/collectives.h`` (``ALLREDUCE_CHUNKSTEPS``), ``src/init.cc`` (buffer sizes),
  ``src/include/comm.h`` (thread thresholds), ``src/enqueue.cc`` (``calcCollChunking``, channel reduction) and
  ``src/transport/nvls.cc`` (``ncclNvlsTuning``), NCCL 2.23.4 and 2.30.7 (line numbers in
  bench/published/nccl_allreduce_published.md, B.4-B.5).

Traffic per algorithm (what turns link rates into algbw):

* ring: every rank sends 2(n-1)/n * S over its slowest link (NVLink inside a node; the node's NICs where the ring
  crosses nodes), so ``busbw = min(intra, inter)`` and ``algbw = busbw * n / (2(n-1))``.
* tree (NCCL's double binary tree across nodes, a chain inside each): a rank sends S up and S down its chain
  (algbw <= intra/2); a node sends 2S through its NICs over the two trees, or S with two nodes (why two-node tree
  busbw can exceed the NIC rate, NVIDIA/nccl#307). NCCL charges trees a further 0.92 (tuning.cc).
* NVLS: the NVSwitch reduces (multimem.ld_reduce) and multicasts, so a GPU moves about S each way whatever n is;
  the achieved fraction of line rate is the measured 0.61 above.
* NVLS-tree (multi-node NVLS): NVLS inside each node, then the same tree traffic across nodes.

What it leaves out: CollNet/SHARP in the network, PAT (all-gather and reduce-scatter only), the network latency of
the particular fabric (``latencyInter``, 0 here), and contention with compute kernels during backward.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from .fabric import PROTOCOLS, Fabric, _LL, _LL128, _SIMPLE

# --------------------------------------------------------------------------------------------------------------------
# NCCL 2.30.7 tuning constants (src/graph/tuning.cc), microseconds; index [protocol] = LL, LL128, Simple
# --------------------------------------------------------------------------------------------------------------------

#: ``baseLatencies``. NCCL adds it for NVLSTree (only NVLS overwrites it), but both rows are 0 since 2.19 (2.18 had
#: 23 us for Simple), so ``_latency_parts`` adds a 0 for nvls_tree.
BASE_LATENCY_US: Dict[str, Tuple[float, float, float]] = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
}
#: Per-hop latency by the hardware the hop crosses.
HW_LATENCY_US: Dict[str, Dict[str, Tuple[float, float, float]]] = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
               "nvls_tree": (0.0, 0.0, 25.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 20.9)},
}
#: Host cost of posting a network send (getNetOverhead, Intel x86 value), tripled for Simple; it floors the per-step
#: latency of rings that cross nodes.
NET_OVERHEAD_US = 1.0
#: "Plateau effect of ring": multi-node Simple ring latency x1.4 on sm80+ (x1.9 before).
RING_PLATEAU = {"old": 1.9, "new": 1.4}
#: Ring LL moves half the bytes per flag word; tree LL one in 3.8; LL128 120 of 128 bytes (7/9 for a one-node tree).
RING_LL_FACTOR = 0.5
RING_LL128_FACTOR = 0.92
TREE_LL_FACTOR = 1.0 / 3.8
TREE_LL128_FACTOR_ONE_NODE = 7.0 / 9.0
TREE_LL128_FACTOR_MULTI_NODE = 120.0 / 128.0
#: NCCL charges tree all-reduce 0.92 of the link bandwidth.
TREE_FACTOR = 0.92
#: Cap on LL bus bandwidth (llMaxBws): one node by GPU generation; several nodes by CPU (Intel row: 2 nodes, >2).
LL_MAX_BUSBW_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0, "unknown": 39.0}
LL_MAX_BUSBW_MULTI_NODE = {2: 39.0, 3: 20.4}
#: Per-channel caps, GB/s, by GPU generation and [1 node, 2 nodes, more] (``perChMaxRingLL128Bws``,
#: ``perChMaxTreeLL128Bws``, ``perChMaxTreeBws``), multiplied by the ring/tree graph's channels.
PER_CHANNEL_MAX_GBPS: Dict[str, Dict[str, Tuple[float, float, float]]] = {
    "ring_ll128": {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 36.7),
                   "blackwell": (40.0, 40.0, 40.0)},
    "tree_ll128": {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0),
                   "blackwell": (55.6, 31.67, 20.0)},
    "tree": {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
             "blackwell": (70.0, 42.8, 24.0)},
}
#: "Trees are not perfectly sticking to the model for medium sizes": bandwidth multipliers for tree all-reduce,
#: indexed by floor(log2(bytes / 64)) from 64 B to 256 MiB.
TREE_CORRECTION: Tuple[Tuple[float, ...], ...] = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)

# --------------------------------------------------------------------------------------------------------------------
# Link efficiencies (see module docstring for sources)
# --------------------------------------------------------------------------------------------------------------------

#: Fraction of NVLink line rate NCCL reaches, by GPU generation (topo.h SMxx_NVLINK_BW / line rate per link).
NVLINK_EFFICIENCY = {"volta": 20.0 / 25.0, "ampere": 20.0 / 25.0, "hopper": 20.6 / 25.0, "blackwell": 40.1 / 50.0,
                     "unknown": 20.0 / 25.0}
#: PCIe: topo.h PCI_BW 12.0 GB/s for Gen3 x16, against 8 GT/s * 16 lanes / 8 = 16 GB/s (the rate
#: ``Topology.pcie_gbps`` counts, before 128b/130b encoding and packet overhead).
PCIE_EFFICIENCY = 12.0 / 16.0
#: Network: topo.h NET_BW 12.0 GB/s per 100 Gbit/s (12.5 GB/s). Public cross-checks: NDR 400G NICs "46-48GB/s per
#: NIC" (NVIDIA/nccl-tests#290), DGX-A100 with 8x200G IB "192GB/s AllReduce BusBW" (NVIDIA/nccl#812).
NET_EFFICIENCY = 12.0 / 12.5
#: NVLS algbw as a fraction of the unidirectional NVLink line rate, Hopper: 275 / 450 (NVIDIA/nccl-tests#212), at
#: NCCL's largest NVLS chunk (``ramp.py`` charges smaller chunks more).
NVLS_ALGBW_FRACTION_HOPPER = 275.0 / 450.0
#: Blackwell relative to Hopper: NCCL nvlsEfficiency 0.74 / 0.85.
NVLS_ALGBW_FRACTION = {"hopper": NVLS_ALGBW_FRACTION_HOPPER,
                       "blackwell": NVLS_ALGBW_FRACTION_HOPPER * 0.74 / 0.85}
#: With one rank an in-place all-reduce moves nothing; what remains is NCCL's fixed cost of a collective
#: (base latency of ring/Simple above).
SINGLE_RANK_US = 8.4

# --------------------------------------------------------------------------------------------------------------------
# Channels, chunks, thresholds
# --------------------------------------------------------------------------------------------------------------------

#: Per-channel speeds the graph search tries, GB/s, highest first (search.cc ``speedArrayIntra`` and, for SM90 and
#: later, ``sm90SpeedArrayIntra``).
SPEED_ARRAY_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SM90_SPEED_ARRAY_INTRA = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
#: The search looks for at most MAXCHANNELS/2 channels (MAXCHANNELS 32 in 2.23.4); the communicator doubles them.
MAX_GRAPH_CHANNELS = 16
MAX_CHANNELS = 32
#: Data bytes one ring step moves per channel at most (``calcCollChunking``), a step being a buffer over its
#: ``NCCL_STEPS`` 8 slots (device.h): LL 512 KiB buffer / 8 steps / 2 (half of each LL line is flags); LL128
#: 4,915,200 B / 8 * 15/16 (15 data words of 16); Simple 4 MiB / 8 * ALLREDUCE_CHUNKSTEPS 4 (collectives.h). A
#: message larger than channels x ranks x this runs in several windows.
RING_CHUNK_BYTES = (32 * 1024, 576_000, 2 * 1024 * 1024)
#: Bytes per thread below which NCCL drops a channel (comm.h: LL 8 (x nRanks for rings), LL128 8, Simple 64) and the
#: threads per channel they count (LL 512, LL128 640, Simple 512; trees always 640): ``enqueue.cc`` keeps
#: ``nBytes >= nChannels * threads * threshold``.
THREAD_THRESHOLD = (8, 8, 64)
RING_THREADS = (512, 640, 512)
TREE_THREADS = 640
#: NVLS (``ncclNvlsTuning``, nvls.cc): channels (SM90 16; SM100 24 on one node, 32 on several), largest chunk
#: (``NCCL_NVLS_CHUNKSIZE`` 128 KiB) and NVLSTree's on 4 or more nodes (64 KiB).
NVLS_CHANNELS = {"hopper": (16, 16), "blackwell": (24, 32)}
NVLS_CHUNK_BYTES = 128 * 1024
NVLS_TREE_MAX_CHUNK_BYTES_4_NODES = 64 * 1024
#: How ``calcCollChunking`` shrinks an NVLS (NVLSTree) chunk: to ``smaller`` below ``times`` x (channels x heads x
#: chunk) bytes, each step in turn.
NVLS_CHUNK_STEPS = {"nvls": ((64, 64 * 1024), (8, 32 * 1024), (2, 16 * 1024)),
                    "nvls_tree": ((32, 256 * 1024), (16, 128 * 1024), (4, 64 * 1024), (1, 32 * 1024))}


def _log2i(x: int) -> int:
    return x.bit_length() - 1 if x > 0 else -1


def _sm90_or_later(f: Fabric) -> bool:
    return f.arch in ("hopper", "blackwell")


def intra_gbps_nccl(f: Fabric) -> float:
    """The bandwidth per GPU NCCL's search assumes inside a node: NVLink line rate x NCCL's per-link efficiency; PCIe
    x PCI_BW's fraction, capped by the link between CPU sockets where the ring crosses it."""
    if f.intra_link == "nvlink":
        return f.intra_gbps * NVLINK_EFFICIENCY[f.arch]
    bw = f.intra_gbps * PCIE_EFFICIENCY
    return min(bw, f.cpu_link_gbps) if f.cpu_link_gbps > 0 else bw


def inter_gbps_nccl(f: Fabric) -> float:
    """A node's NICs as NCCL counts them (NET_BW per 100 Gbit/s)."""
    return f.inter_gbps * NET_EFFICIENCY


def graph_channels(f: Fabric) -> Tuple[int, float]:
    """The ring/tree graph NCCL's search finds inside a node: (channels, GB/s each), approximated from search.cc:
    the highest speed of the ladder that the GPU's bandwidth holds, as many channels of it as fit, then
    ``ncclTopoDupChannels`` (twice the channels at half the speed when the speed is >= 25, except on SM90+ below 50
    with more than 4 channels). 8 x A100 NVLink: 6 x 40 -> 12 x 20; 8 x H100: 6 x 60 -> 12 x 30
    (bench/published/nccl_allreduce_published.md, B.4)."""
    if f.ranks_per_node == 1:
        bw = inter_gbps_nccl(f) if f.nodes > 1 else 12.0
    else:
        bw = intra_gbps_nccl(f)
    ladder = SM90_SPEED_ARRAY_INTRA if _sm90_or_later(f) else SPEED_ARRAY_INTRA
    speed = next((s for s in ladder if s <= bw), ladder[-1])
    channels = max(1, min(int(bw // speed), MAX_GRAPH_CHANNELS))
    if speed >= 25 and not (_sm90_or_later(f) and speed < 50 and channels > 4):
        channels, speed = min(2 * channels, MAX_CHANNELS), speed / 2
    return channels, speed


def comm_channels(f: Fabric) -> int:
    """Channels a communicator runs rings and trees on: the graph's, doubled (connect.cc), at most MAXCHANNELS."""
    return min(2 * graph_channels(f)[0], MAX_CHANNELS)


def nvls_channels(f: Fabric) -> int:
    return NVLS_CHANNELS.get(f.arch, NVLS_CHANNELS["hopper"])[0 if f.nodes == 1 else 1]


def nvls_chunk_bytes(f: Fabric, nbytes: int, algorithm: str) -> int:
    """NCCL's NVLS (or NVLSTree) chunk for an all-reduce of ``nbytes`` (``calcCollChunking``): the largest chunk
    shrinks while the message is small against (channels x heads x chunk), heads being the node's GPUs."""
    ops = nvls_channels(f) * f.ranks_per_node
    chunk = NVLS_TREE_MAX_CHUNK_BYTES_4_NODES if algorithm == "nvls_tree" and f.nodes >= 4 else NVLS_CHUNK_BYTES
    for times, smaller in NVLS_CHUNK_STEPS[algorithm]:
        if nbytes < times * ops * chunk and chunk > smaller:
            chunk = smaller
    return chunk


def channel_min_bytes(f: Fabric, algorithm: str, p: int) -> int:
    """Bytes a channel must get before NCCL gives a message another: threads x bytes per thread (rings' LL x
    ranks). NVLS keeps its channels."""
    if algorithm == "ring":
        per_thread = THREAD_THRESHOLD[p] * (f.world_size if p == _LL else 1)
        return RING_THREADS[p] * per_thread
    if algorithm == "tree":
        return TREE_THREADS * THREAD_THRESHOLD[p]
    return 0


# --------------------------------------------------------------------------------------------------------------------
# NCCL's estimate
# --------------------------------------------------------------------------------------------------------------------


def _node_index(f: Fabric) -> int:
    return 0 if f.nodes == 1 else (1 if f.nodes == 2 else 2)


def _per_channel_cap(f: Fabric, table: str) -> float:
    row = PER_CHANNEL_MAX_GBPS[table].get(f.arch)
    if row is None:
        return math.inf
    return graph_channels(f)[0] * row[_node_index(f)]


def _bus_and_ratio(f: Fabric, algorithm: str, intra_scale: float = 1.0) -> Tuple[float, float]:
    """NCCL-style bus bandwidth (before protocol factors) and the ratio that turns it into algbw; ``intra_scale``
    multiplies the intra-node bandwidth (a calibration's)."""
    n = f.world_size
    intra = intra_gbps_nccl(f) * intra_scale if f.ranks_per_node > 1 else math.inf
    inter = inter_gbps_nccl(f) if f.nodes > 1 else math.inf
    ring_ratio = n / (2.0 * (n - 1))
    if algorithm == "ring":
        return min(intra, inter), ring_ratio
    if algorithm == "tree":
        # Node egress: 2S over the two trees, S with two nodes; chain inside: 2S per rank (the 0.5 ratio).
        inter_tree = inter * (2.0 if f.nodes == 2 else 1.0)
        return min(TREE_FACTOR * min(intra, inter_tree), _per_channel_cap(f, "tree")), 0.5
    fraction = NVLS_ALGBW_FRACTION[f.arch] * f.intra_gbps * intra_scale
    if algorithm == "nvls":
        return fraction / ring_ratio, ring_ratio
    if algorithm == "nvls_tree":
        alg = min(fraction, inter * (1.0 if f.nodes == 2 else 0.5))
        return alg / ring_ratio, ring_ratio
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _ll_max(f: Fabric) -> float:
    if f.nodes == 1:
        return LL_MAX_BUSBW_ONE_NODE[f.arch]
    return LL_MAX_BUSBW_MULTI_NODE[min(f.nodes, 3)]


def protocol_algbw_gbps(f: Fabric, nbytes: int, algorithm: str, p: int, intra_scale: float = 1.0) -> float:
    """NCCL's algbw for (algorithm, protocol index) at ``nbytes`` (the tree correction depends on the size)."""
    bus, ratio = _bus_and_ratio(f, algorithm, intra_scale)
    if algorithm == "ring":
        if p == _LL:
            bus = min(bus * RING_LL_FACTOR, _ll_max(f))
        elif p == _LL128:
            bus = min(bus * RING_LL128_FACTOR, _per_channel_cap(f, "ring_ll128"))
    elif algorithm == "tree":
        if p == _LL:
            bus = min(bus * TREE_LL_FACTOR, _ll_max(f))
        elif p == _LL128:
            factor = TREE_LL128_FACTOR_ONE_NODE if f.nodes == 1 else TREE_LL128_FACTOR_MULTI_NODE
            bus = min(bus * factor, _per_channel_cap(f, "tree_ll128"))
        log_size = _log2i(nbytes >> 6)
        if 0 <= log_size < len(TREE_CORRECTION[p]) - 1:
            bus *= TREE_CORRECTION[p][log_size]
    return bus * ratio


def _latency_parts(f: Fabric, algorithm: str, p: int) -> Tuple[float, float, float]:
    """NCCL's latency of (algorithm, protocol) as (base, intra-node hops, inter-node hops), microseconds, before the
    multi-node ring plateau (``_plateau``)."""
    intra_hw = "nvlink" if f.intra_link == "nvlink" else "pcie"
    intra_lat = HW_LATENCY_US[intra_hw][algorithm][p]
    ppn = f.ranks_per_node
    # With one rank per node every step is exposed to the network: NCCL uses the tree's network latency.
    inter_lat = HW_LATENCY_US["net"]["tree" if ppn == 1 else algorithm][p]
    base = BASE_LATENCY_US[algorithm][p]
    n, m = f.world_size, f.nodes
    if algorithm == "ring":
        nsteps = 2 * (n - 1)
        ninter = 2 * (m - 1) if m > 1 else 0
        if m > 1:
            intra_lat = max(intra_lat, NET_OVERHEAD_US * (3.0 if p == _SIMPLE else 1.0))
        return base, (nsteps - ninter) * intra_lat, ninter * inter_lat
    if algorithm == "tree":
        return base, 2 * (ppn - 1) * intra_lat, 2 * _log2i(m) * inter_lat
    if algorithm == "nvls":
        return 0.0, intra_lat, (inter_lat if m > 1 else 0.0)
    if algorithm == "nvls_tree":
        return base, intra_lat, 2 * _log2i(m) * inter_lat
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _plateau(f: Fabric, algorithm: str, p: int) -> float:
    """NCCL's multiplier on multi-node ring/Simple latency (1 elsewhere)."""
    if algorithm == "ring" and p == _SIMPLE and f.nodes > 1:
        return RING_PLATEAU["old" if f.arch == "volta" else "new"]
    return 1.0


def _latency_us(f: Fabric, algorithm: str, p: int, nbytes: int = 0) -> float:
    """NCCL's latency of (algorithm, protocol index), microseconds (``ncclTopoTuneModel``)."""
    return sum(_latency_parts(f, algorithm, p)) * _plateau(f, algorithm, p)


def _protocol_runs(f: Fabric, algorithm: str, p: int) -> bool:
    if algorithm in ("nvls", "nvls_tree") and p != _SIMPLE:
        return False
    return not (p == _LL128 and f.intra_link != "nvlink")  # NCCL enables LL128 only where GPUs talk over NVLink


def checked_protocol(nbytes: int, protocol: str) -> int:
    """The index of ``protocol`` in PROTOCOLS, after checking it and ``nbytes``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {PROTOCOLS}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return PROTOCOLS.index(protocol)


def untimed_us(fabric: Fabric, algorithm: str, p: int) -> Optional[float]:
    """The answer for a call no model times: one rank's floor (as ring Simple), or None where NCCL does not run
    (algorithm, protocol) on this fabric."""
    return SINGLE_RANK_US if fabric.world_size == 1 and algorithm == "ring" and p == _SIMPLE else None


def nccl_protocol_time_us(fabric: Fabric, nbytes: int, algorithm: str, protocol: str) -> Optional[float]:
    """NCCL's own estimate of one all-reduce of ``nbytes`` with (algorithm, protocol), or None where NCCL would not
    run it. No calibration: this is what NCCL believes, and so what it chooses by."""
    p = checked_protocol(nbytes, protocol)
    if fabric.world_size == 1 or not _protocol_runs(fabric, algorithm, p):
        return untimed_us(fabric, algorithm, p)
    alg = protocol_algbw_gbps(fabric, nbytes, algorithm, p)
    if not alg > 0:
        return None
    return _latency_us(fabric, algorithm, p) + nbytes / (1e3 * alg)


def nccl_protocol(fabric: Fabric, nbytes: int, algorithm: str) -> Optional[str]:
    """The protocol NCCL picks for ``algorithm`` at ``nbytes`` (the fastest by its own estimate), None if none runs."""
    timed = [(t, proto) for proto in PROTOCOLS
             if (t := nccl_protocol_time_us(fabric, nbytes, algorithm, proto)) is not None]
    return min(timed)[1] if timed else None
