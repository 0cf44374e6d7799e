"""Latency-bandwidth model of NCCL all-reduce: ring, tree, NVLS and NVLS-tree, per message size and dtype.

What it is for: ranking NCCL's algorithms per message size (which one the hook should force for a bucket of a given
size) and sizing DDP buckets, on machines we cannot measure (``ddp-triton autotune --model-only``). It is a model in
NCCL's own form, ``time = latency + bytes / bandwidth`` for each (algorithm, protocol), with NCCL choosing the
fastest protocol inside an algorithm (the hook only sets ``NCCL_ALGO``), and the bandwidths taken from the link
rates of the topology times the efficiencies NCCL itself assumes.

Units: bytes, microseconds, GB/s (10^9 bytes per second, as nccl-tests prints). ``algbw = bytes / time`` and
``busbw = algbw * 2(n-1)/n`` (nccl-tests, doc/PERFORMANCE.md, all-reduce).

Where the numbers come from (facts read from public sources, not code):

* ``BASE_LATENCY_US``, ``HW_LATENCY_US``, the protocol factors, ``LL_MAX_BUSBW``, ``TREE_CORRECTION``, the ring
  plateau and the network post overhead: NCCL 2.30.7, ``src/graph/tuning.cc`` (``ncclTunerConstantsDefaults``,
  ``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``).
* Link efficiencies: NCCL 2.30.7 ``src/graph/topo.h`` gives the bandwidth NCCL's topology search assumes per link:
  ``SM90_NVLINK_BW 20.6`` GB/s per NVLink4 link of 25 GB/s line rate, ``SM80_NVLINK_BW 20.0`` of 25,
  ``SM100_NVLINK_BW 40.1`` of 50, ``PCI_BW 12.0`` for PCIe Gen3 x16 (16 GB/s line), ``NET_BW 12.0`` for
  100 Gbit/s (12.5 GB/s line). The H100 value agrees with what NCCL's maintainer reports measured: "450GB/s is the
  line rate ... NCCL can get an effective NVLink bandwidth of 370GB/s" (NVIDIA/nccl-tests#212).
* NVLS throughput: the same comment gives 8 x H100 with NVLink SHARP "a peak busBw of ~480GB/s (algbw ~275GB/s)",
  i.e. algbw = 0.61 of the 450 GB/s line rate. H800 (200 GB/s NVLink) was reported at 215 GB/s busbw
  (NVIDIA/nccl#1374), the same fraction; ``tests/machine/test_cost_model.py`` checks both. Blackwell scales it by NCCL's
  ``nvlsEfficiency`` ratio (0.74 Blackwell / 0.85 Hopper, tuning.cc).

Traffic per algorithm (what turns link rates into algbw):

* ring: every rank sends 2(n-1)/n * S over its slowest link (NVLink inside a node; the node's NICs where the ring
  crosses nodes), so ``busbw = min(intra, inter)`` and ``algbw = busbw * n / (2(n-1))``.
* tree (NCCL's double binary tree across nodes, a chain inside each): a rank sends S up and S down its chain
  (algbw <= intra/2); a node sends 2S through its NICs over the two trees, or S with two nodes (why two-node tree
  busbw can exceed the NIC rate, NVIDIA/nccl#307). NCCL charges trees a further 0.92 (tuning.cc).
* NVLS: the NVSwitch reduces (multimem.ld_reduce) and multicasts, so a GPU moves about S each way whatever n is;
  the achieved fraction of line rate is the measured 0.61 above.
* NVLS-tree (multi-node NVLS): NVLS inside each node, then the same tree traffic across nodes.

What it leaves out: NCCL's per-channel caps (not binding at the 16+ channels NCCL opens on NVLink systems), the
network latency of the particular fabric (``latencyInter``, 0 here), CollNet/SHARP in the network, PAT (all-gather
and reduce-scatter only), and contention with compute kernels during backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..dtypes import DTYPE_SIZES, dtype_size, normalize_dtype  # noqa: F401 (DTYPE_SIZES: part of the model's vocabulary)
from ..versions import parse_nccl_version  # noqa: F401 (the model's NCCL versions are these tuples)

# --------------------------------------------------------------------------------------------------------------------
# Algorithms, protocols and dtypes
# --------------------------------------------------------------------------------------------------------------------

#: Algorithms the model knows, in the canonical order used everywhere (group creation order included).
ALGORITHMS: Tuple[str, ...] = ("ring", "tree", "nvls", "nvls_tree")

#: Spelling of each algorithm in ``NCCL_ALGO`` (NCCL ``src/init.cc``, ``ncclAlgoStr``).
NCCL_ALGO_NAMES: Dict[str, str] = {"ring": "Ring", "tree": "Tree", "nvls": "NVLS", "nvls_tree": "NVLSTree"}

#: First NCCL release with each all-reduce algorithm: NVLS arrived in 2.17.1, NVLSTree in 2.18.1 (``ncclAlgoStr``
#: in those releases' src/init.cc); ring and tree all-reduce predate every NCCL torch>=2.4 ships with.
MIN_NCCL_VERSION: Dict[str, Tuple[int, int, int]] = {
    "ring": (2, 0, 0),
    "tree": (2, 4, 0),
    "nvls": (2, 17, 1),
    "nvls_tree": (2, 18, 1),
}

PROTOCOLS: Tuple[str, ...] = ("LL", "LL128", "Simple")
_LL, _LL128, _SIMPLE = 0, 1, 2

#: dtypes NVLS can reduce with a sum (NCCL ``ncclNvlsSupported`` in src/include/device.h): no 8-bit types.
NVLS_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16", "int64", "int32"})

#: NCCL releases in which ``ncclNvlsInit`` (src/transport/nvls.cc) turns NVLS off for ``gpuCount <= 2``, i.e. needs
#: at least 3 GPUs of the communicator on a node: 2.18.1 up to 2.28.3. 2.17 (``localRanks <= 1``) and 2.28.7 on
#: (``gpuCount < 2``) need 2. First and last release of the range, end exclusive.
NVLS_NEEDS_3_GPUS = ((2, 18, 1), (2, 28, 7))
#: NCCL 2.20 also turned NVLS off across nodes (``comm->nNodes > 1`` in the same check): no nvls_tree there.
NVLS_SINGLE_NODE_ONLY = ((2, 20, 0), (2, 21, 0))

# --------------------------------------------------------------------------------------------------------------------
# NCCL 2.30.7 tuning constants (src/graph/tuning.cc), microseconds; index [protocol] = LL, LL128, Simple
# --------------------------------------------------------------------------------------------------------------------

#: ``baseLatencies``. NCCL adds it for NVLSTree (only NVLS overwrites it), but both rows are 0 since 2.19 (2.18 had
#: 23 us for Simple), so ``_latency_us`` adds a 0 for nvls_tree.
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
#: NVLS algbw as a fraction of the unidirectional NVLink line rate, Hopper: 275 / 450 (NVIDIA/nccl-tests#212).
NVLS_ALGBW_FRACTION_HOPPER = 275.0 / 450.0
#: Blackwell relative to Hopper: NCCL nvlsEfficiency 0.74 / 0.85.
NVLS_ALGBW_FRACTION = {"hopper": NVLS_ALGBW_FRACTION_HOPPER,
                       "blackwell": NVLS_ALGBW_FRACTION_HOPPER * 0.74 / 0.85}
#: With one rank an in-place all-reduce moves nothing; what remains is NCCL's fixed cost of a collective
#: (base latency of ring/Simple above).
SINGLE_RANK_US = 8.4

KNOWN_ARCHES = ("volta", "ampere", "hopper", "blackwell", "unknown")
LINK_KINDS = ("nvlink", "pcie")


# --------------------------------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """What the model needs to know of the machines: ranks, link rates and link kinds."""

    ranks_per_node: int
    """Ranks (GPUs) per node taking part in the all-reduce."""
    nodes: int = 1
    """Number of nodes."""
    intra_gbps: float = 0.0
    """Unidirectional line rate per GPU inside a node, GB/s (450 for NVLink4 H100, 300 for NVLink3 A100)."""
    inter_gbps: float = 0.0
    """Unidirectional line rate of one node's NICs together, GB/s (8 x 400 Gbit/s = 400). Needed when nodes > 1."""
    intra_link: str = "nvlink"
    """``nvlink`` or ``pcie``: what links GPUs inside a node (LL128 needs NVLink; the hop latencies differ)."""
    nvswitch: bool = False
    """Whether the GPUs of a node meet at NVSwitches (a precondition of NVLS)."""
    arch: str = "unknown"
    """GPU generation: ``volta``, ``ampere``, ``hopper``, ``blackwell`` or ``unknown``."""

    def __post_init__(self) -> None:
        Layout(self.ranks_per_node, self.nodes, self.nvswitch, self.arch)  # checks ranks, nodes and arch
        if self.intra_link not in LINK_KINDS:
            raise ValueError(f"intra_link must be one of {LINK_KINDS}, got {self.intra_link!r}")
        if self.ranks_per_node > 1 and not self.intra_gbps > 0:
            raise ValueError(f"intra_gbps must be > 0 with {self.ranks_per_node} ranks per node, "
                             f"got {self.intra_gbps!r}")
        if self.nodes > 1 and not self.inter_gbps > 0:
            raise ValueError(f"inter_gbps must be > 0 with {self.nodes} nodes, got {self.inter_gbps!r}")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @classmethod
    def from_topology(cls, topo: Any) -> "Fabric":
        """Build from a ``ddp_triton.machine.topology.Topology``: its nodes, GPUs per node, link kinds and rates.

        ValueError naming what is missing (an inter-node rate for several nodes, an intra-node rate for several
        GPUs per node)."""
        nodes = int(topo.nodes)
        per_node = int(topo.gpus_per_node)
        if nodes > 1 and not topo.inter_node_gbps:
            raise ValueError(f"topology {topo.name!r} on {nodes} nodes has no inter-node bandwidth: "
                             "give it (--inter-node-gbps, GB/s per node per direction, e.g. 400 for 8 x 400 Gb/s)")
        if per_node > 1 and not topo.intra_node_gbps:
            raise ValueError(f"topology {topo.name!r} has no intra-node bandwidth (neither NVLink rate nor PCIe link)")
        arch = getattr(topo, "arch", "unknown")
        return cls(
            ranks_per_node=per_node,
            nodes=nodes,
            intra_gbps=float(topo.intra_node_gbps or 0.0),
            inter_gbps=float(topo.inter_node_gbps or 0.0),
            intra_link="nvlink" if topo.intra_node_fabric == "nvlink" else "pcie",
            nvswitch=bool(topo.has_nvswitch),
            arch=arch if arch in KNOWN_ARCHES else "unknown",
        )


@dataclass(frozen=True)
class Layout:
    """Where the ranks sit and what joins them, without link rates: all that decides which algorithms NCCL can run.

    ``Fabric`` has the same fields (and the rates the timings need). Planning a measurement uses a Layout, as NVML
    sees no NICs and so gives no inter-node rate."""

    ranks_per_node: int
    nodes: int = 1
    nvswitch: bool = False
    arch: str = "unknown"

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {self.nodes!r}")
        if self.arch not in KNOWN_ARCHES:
            raise ValueError(f"arch must be one of {KNOWN_ARCHES}, got {self.arch!r}")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @classmethod
    def from_topology(cls, topo: Any) -> "Layout":
        """From a ``ddp_triton.machine.topology.Topology``: nodes, GPUs per node, NVSwitch and GPU generation."""
        arch = getattr(topo, "arch", "unknown")
        return cls(ranks_per_node=int(topo.gpus_per_node), nodes=int(topo.nodes), nvswitch=bool(topo.has_nvswitch),
                   arch=arch if arch in KNOWN_ARCHES else "unknown")


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one (message size, algorithm): NCCL's best protocol and what it costs."""

    nbytes: int
    algorithm: str
    protocol: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float

    def row(self, dtype: Optional[str] = None) -> Dict[str, Any]:
        """As a profile sweep row."""
        r: Dict[str, Any] = {"bytes": self.nbytes, "algorithm": self.algorithm, "time_us": round(self.time_us, 4),
                             "algbw_gbps": round(self.algbw_gbps, 4), "busbw_gbps": round(self.busbw_gbps, 4),
                             "protocol": self.protocol}
        if dtype is not None:
            r["dtype"] = dtype
        return r


# --------------------------------------------------------------------------------------------------------------------
# Helpers shared with the measuring code
# --------------------------------------------------------------------------------------------------------------------


def busbw_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n (0 for one rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return 2.0 * (world_size - 1) / world_size


def algbw_gbps(nbytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 B/s) of moving ``nbytes`` in ``time_us`` microseconds."""
    if time_us <= 0:
        raise ValueError(f"time_us must be > 0, got {time_us!r}")
    return nbytes / (time_us * 1e3)


def busbw_gbps(nbytes: int, time_us: float, world_size: int) -> float:
    """Bus bandwidth in GB/s as nccl-tests reports it for all-reduce."""
    return algbw_gbps(nbytes, time_us) * busbw_factor(world_size)


def default_sizes(min_bytes: int = 1 << 10, max_bytes: int = 1 << 30) -> List[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` inclusive (1 KiB to 1 GiB by default)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes!r}, {max_bytes!r}")
    sizes = []
    s = 1 << max(0, (min_bytes - 1).bit_length())
    while s <= max_bytes:
        sizes.append(s)
        s <<= 1
    if not sizes:
        raise ValueError(f"no power of two between {min_bytes} and {max_bytes}")
    return sizes


def _in_range(version: Tuple[int, int, int], bounds: Tuple[Tuple[int, int, int], Tuple[int, int, int]]) -> bool:
    return bounds[0] <= tuple(version) < bounds[1]


def nvls_min_ranks_per_node(nccl_version: Optional[Tuple[int, int, int]] = None) -> int:
    """Fewest ranks per node with which NCCL enables NVLS; with the version unknown, the stricter 3 (forcing an
    algorithm NCCL has turned off makes every all-reduce fail)."""
    if nccl_version is None or _in_range(nccl_version, NVLS_NEEDS_3_GPUS):
        return 3
    return 2


def algorithm_unavailable_reason(fabric: Union[Fabric, Layout], algorithm: str, dtype: Any = "bfloat16",
                                 nccl_version: Optional[Tuple[int, int, int]] = None) -> Optional[str]:
    """Why NCCL would not run ``algorithm`` for this fabric (or rate-free layout), dtype and NCCL version; None when
    it can."""
    if algorithm not in ALGORITHMS:
        return f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}"
    if nccl_version is not None and tuple(nccl_version) < MIN_NCCL_VERSION[algorithm]:
        need = ".".join(map(str, MIN_NCCL_VERSION[algorithm]))
        have = ".".join(map(str, nccl_version))
        return f"{algorithm} needs NCCL >= {need}, this is NCCL {have}"
    if fabric.world_size == 1:
        return None if algorithm == "ring" else "one rank: NCCL runs no algorithm, the model keeps 'ring'"
    if algorithm in ("nvls", "nvls_tree"):
        if fabric.arch not in NVLS_ALGBW_FRACTION:
            return f"{algorithm} needs Hopper or later GPUs, these are {fabric.arch}"
        if not fabric.nvswitch:
            return f"{algorithm} needs NVSwitch"
        need = nvls_min_ranks_per_node(nccl_version)
        if fabric.ranks_per_node < need:
            if need == 3:
                rule = ("NCCL 2.18.1 to 2.28.3 turn NVLS off with 2 or fewer" if nccl_version is None else
                        f"NCCL {'.'.join(map(str, nccl_version))} turns NVLS off with 2 or fewer")
            else:
                rule = "NCCL turns NVLS off with one"
            return f"{algorithm} needs at least {need} GPUs per node ({rule}); this has {fabric.ranks_per_node}"
        if normalize_dtype(dtype) not in NVLS_DTYPES:
            return f"{algorithm} cannot reduce {normalize_dtype(dtype)}"
        if algorithm == "nvls" and fabric.nodes > 1:
            return "nvls across nodes needs CollNet; NCCL uses nvls_tree there"
        if algorithm == "nvls_tree" and fabric.nodes == 1:
            return "nvls_tree is disabled by NCCL on a single node"
        if nccl_version is not None and _in_range(nccl_version, NVLS_SINGLE_NODE_ONLY):
            return f"NCCL {'.'.join(map(str, nccl_version))} turns NVLS off across nodes"
    return None


def available_algorithms(fabric: Union[Fabric, Layout], dtype: Any = "bfloat16",
                         nccl_version: Optional[Tuple[int, int, int]] = None) -> List[str]:
    """The algorithms NCCL can run here, in canonical order."""
    return [a for a in ALGORITHMS if algorithm_unavailable_reason(fabric, a, dtype, nccl_version) is None]


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


def _log2i(x: int) -> int:
    return x.bit_length() - 1 if x > 0 else -1


def _effective_intra(f: Fabric) -> float:
    eff = NVLINK_EFFICIENCY[f.arch] if f.intra_link == "nvlink" else PCIE_EFFICIENCY
    return f.intra_gbps * eff


def _effective_inter(f: Fabric) -> float:
    return f.inter_gbps * NET_EFFICIENCY


def _bus_and_ratio(f: Fabric, algorithm: str) -> Tuple[float, float]:
    """NCCL-style bus bandwidth (before protocol factors) and the ratio that turns it into algbw."""
    n = f.world_size
    intra = _effective_intra(f) if f.ranks_per_node > 1 else math.inf
    inter = _effective_inter(f) if f.nodes > 1 else math.inf
    ring_ratio = n / (2.0 * (n - 1))
    if algorithm == "ring":
        return min(intra, inter), ring_ratio
    if algorithm == "tree":
        # Node egress: 2S over the two trees, S with two nodes; chain inside: 2S per rank (the 0.5 ratio).
        inter_tree = inter * (2.0 if f.nodes == 2 else 1.0)
        return TREE_FACTOR * min(intra, inter_tree), 0.5
    fraction = NVLS_ALGBW_FRACTION[f.arch] * f.intra_gbps
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


def _latency_us(f: Fabric, algorithm: str, p: int, nbytes: int) -> float:
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
        lat = base + (nsteps - ninter) * intra_lat + ninter * inter_lat
        if p == _SIMPLE and m > 1:
            lat *= RING_PLATEAU["old" if f.arch == "volta" else "new"]
        return lat
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra_lat + _log2i(m) * inter_lat)
    if algorithm == "nvls":
        return intra_lat + (inter_lat if m > 1 else 0.0)
    if algorithm == "nvls_tree":
        return base + intra_lat + 2 * _log2i(m) * inter_lat
    raise ValueError(f"unknown algorithm {algorithm!r}")


def protocol_time_us(fabric: Fabric, nbytes: int, algorithm: str, protocol: str) -> Optional[float]:
    """Time of one all-reduce of ``nbytes`` with (algorithm, protocol), or None where NCCL would not run it."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {PROTOCOLS}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    p = PROTOCOLS.index(protocol)
    if fabric.world_size == 1:
        return SINGLE_RANK_US if (algorithm == "ring" and p == _SIMPLE) else None
    if algorithm in ("nvls", "nvls_tree") and p != _SIMPLE:
        return None
    if p == _LL128 and fabric.intra_link != "nvlink":
        return None  # NCCL enables LL128 only where GPUs talk over NVLink
    bus, ratio = _bus_and_ratio(fabric, algorithm)
    if algorithm == "ring":
        if p == _LL:
            bus = min(bus * RING_LL_FACTOR, _ll_max(fabric))
        elif p == _LL128:
            bus = bus * RING_LL128_FACTOR
    elif algorithm == "tree":
        if p == _LL:
            bus = min(bus * TREE_LL_FACTOR, _ll_max(fabric))
        elif p == _LL128:
            bus = bus * (TREE_LL128_FACTOR_ONE_NODE if fabric.nodes == 1 else TREE_LL128_FACTOR_MULTI_NODE)
        log_size = _log2i(nbytes >> 6)
        if 0 <= log_size < len(TREE_CORRECTION[p]) - 1:
            bus *= TREE_CORRECTION[p][log_size]
    alg = bus * ratio
    if not alg > 0:
        return None
    return _latency_us(fabric, algorithm, p, nbytes) + nbytes / (1e3 * alg)


def estimate(fabric: Fabric, nbytes: int, algorithm: str, dtype: Any = "bfloat16") -> Estimate:
    """Best protocol and time for one all-reduce of ``nbytes`` with ``algorithm`` (ValueError if unavailable)."""
    why = algorithm_unavailable_reason(fabric, algorithm, dtype)
    if why is not None:
        raise ValueError(why)
    size = dtype_size(dtype)
    if nbytes % size:
        raise ValueError(f"{nbytes} bytes is not a whole number of {normalize_dtype(dtype)} elements")
    best: Optional[Tuple[float, str]] = None
    for proto in PROTOCOLS:
        t = protocol_time_us(fabric, nbytes, algorithm, proto)
        if t is not None and (best is None or t < best[0]):
            best = (t, proto)
    assert best is not None, (algorithm, fabric)
    t, proto = best
    alg = algbw_gbps(nbytes, t)
    return Estimate(nbytes=nbytes, algorithm=algorithm, protocol=proto, time_us=t, algbw_gbps=alg,
                    busbw_gbps=alg * busbw_factor(fabric.world_size))


def sweep(fabric: Fabric, sizes: Sequence[int], dtype: Any = "bfloat16",
          algorithms: Optional[Iterable[str]] = None) -> List[Estimate]:
    """Estimates for every size and every available (or given) algorithm, size-major."""
    algs = list(algorithms) if algorithms is not None else available_algorithms(fabric, dtype)
    return [estimate(fabric, s, a, dtype) for s in sizes for a in algs]


def best(fabric: Fabric, nbytes: int, dtype: Any = "bfloat16") -> Estimate:
    """The fastest available algorithm for ``nbytes``."""
    return min((estimate(fabric, nbytes, a, dtype) for a in available_algorithms(fabric, dtype)),
               key=lambda e: e.time_us)
