"""The model's vocabulary: algorithms, protocols, what a machine is (``Fabric``, ``Layout``), what an answer is
(``Estimate``), the bandwidth arithmetic of nccl-tests, and which algorithms NCCL can run where.

Units: bytes, microseconds, GB/s (10^9 bytes per second, as nccl-tests prints). ``algbw = bytes / time`` and
``busbw = algbw * 2(n-1)/n`` (nccl-tests, doc/PERFORMANCE.md, all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ...dtypes import normalize_dtype
from .calibration import Calibration

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

KNOWN_ARCHES = ("volta", "ampere", "hopper", "blackwell", "unknown")
LINK_KINDS = ("nvlink", "pcie")


# --------------------------------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where the ranks sit and what joins them, without link rates: all that decides which algorithms NCCL can run.

    Planning a measurement uses a Layout, as NVML sees no NICs and so gives no inter-node rate; ``Fabric`` adds the
    rates the timings need."""

    ranks_per_node: int
    """Ranks (GPUs) per node taking part in the all-reduce."""
    nodes: int = 1
    """Number of nodes."""
    nvswitch: bool = False
    """Whether the GPUs of a node meet at NVSwitches (a precondition of NVLS)."""
    arch: str = "unknown"
    """GPU generation: ``volta``, ``ampere``, ``hopper``, ``blackwell`` or ``unknown``."""

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
    def from_topology(cls, topo: Any, **rates: Any) -> Any:
        """From a ``ddp_triton.machine.topology.Topology``: nodes, GPUs per node, NVSwitch and GPU generation (and,
        for a ``Fabric``, the ``rates``)."""
        arch = getattr(topo, "arch", "unknown")
        return cls(ranks_per_node=int(topo.gpus_per_node), nodes=int(topo.nodes), nvswitch=bool(topo.has_nvswitch),
                   arch=arch if arch in KNOWN_ARCHES else "unknown", **rates)


@dataclass(frozen=True)
class Fabric(Layout):
    """What the model needs to know of the machines: the layout, link rates and link kinds (and, optionally, a
    calibration measured on one of its nodes)."""

    intra_gbps: float = 0.0
    """Unidirectional line rate per GPU inside a node, GB/s (450 for NVLink4 H100, 300 for NVLink3 A100)."""
    inter_gbps: float = 0.0
    """Unidirectional line rate of one node's NICs together, GB/s (8 x 400 Gbit/s = 400). Needed when nodes > 1."""
    intra_link: str = "nvlink"
    """``nvlink`` or ``pcie``: what links GPUs inside a node (LL128 needs NVLink; the hop latencies differ)."""
    cpu_link_gbps: float = 0.0
    """PCIe only: the bandwidth NCCL assumes for the link between CPU sockets when the ring crosses it (``SYS``
    paths; ``ncclTopoGetInterCpuBw``: AMD 16, Intel Skylake 10, Sapphire Rapids 22, Emerald Rapids 40 GB/s), which
    then caps the ring below the PCIe rate. 0: no socket crossing, or not known."""
    calibration: Optional[Calibration] = None
    """Factors fitted to a measured sweep of one of these nodes (``fit.fit_calibration``); None: the model as is."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.intra_link not in LINK_KINDS:
            raise ValueError(f"intra_link must be one of {LINK_KINDS}, got {self.intra_link!r}")
        if self.ranks_per_node > 1 and not self.intra_gbps > 0:
            raise ValueError(f"intra_gbps must be > 0 with {self.ranks_per_node} ranks per node, "
                             f"got {self.intra_gbps!r}")
        if self.nodes > 1 and not self.inter_gbps > 0:
            raise ValueError(f"inter_gbps must be > 0 with {self.nodes} nodes, got {self.inter_gbps!r}")
        if not self.cpu_link_gbps >= 0:
            raise ValueError(f"cpu_link_gbps must be >= 0, got {self.cpu_link_gbps!r}")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ValueError(f"calibration must be a Calibration or None, got {type(self.calibration).__name__}")

    @classmethod
    def from_topology(cls, topo: Any, calibration: Optional[Calibration] = None) -> "Fabric":
        """Build from a ``ddp_triton.machine.topology.Topology``: its nodes, GPUs per node, link kinds and rates.

        ValueError naming what is missing (an inter-node rate for several nodes, an intra-node rate for several
        GPUs per node)."""
        nodes = int(topo.nodes)
        if nodes > 1 and not topo.inter_node_gbps:
            raise ValueError(f"topology {topo.name!r} on {nodes} nodes has no inter-node bandwidth: "
                             "give it (--inter-node-gbps, GB/s per node per direction, e.g. 400 for 8 x 400 Gb/s)")
        if int(topo.gpus_per_node) > 1 and not topo.intra_node_gbps:
            raise ValueError(f"topology {topo.name!r} has no intra-node bandwidth (neither NVLink rate nor PCIe link)")
        return super().from_topology(topo, intra_gbps=float(topo.intra_node_gbps or 0.0),
                                     inter_gbps=float(topo.inter_node_gbps or 0.0),
                                     intra_link="nvlink" if topo.intra_node_fabric == "nvlink" else "pcie",
                                     calibration=calibration)


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one (message size, algorithm): the protocol NCCL picks and what it costs."""

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


# --------------------------------------------------------------------------------------------------------------------
# Which algorithms NCCL runs where
# --------------------------------------------------------------------------------------------------------------------

#: GPU generations NVLS runs on (Hopper and later; ``ncclNvlsInit`` needs SM90).
NVLS_ARCHES = ("hopper", "blackwell")


def _in_range(version: Tuple[int, int, int], bounds: Tuple[Tuple[int, int, int], Tuple[int, int, int]]) -> bool:
    return bounds[0] <= tuple(version) < bounds[1]


def nvls_min_ranks_per_node(nccl_version: Optional[Tuple[int, int, int]] = None) -> int:
    """Fewest ranks per node with which NCCL enables NVLS; with the version unknown, the stricter 3 (forcing an
    algorithm NCCL has turned off makes every all-reduce fail)."""
    if nccl_version is None or _in_range(nccl_version, NVLS_NEEDS_3_GPUS):
        return 3
    return 2


def algorithm_unavailable_reason(fabric: Layout, algorithm: str, dtype: Any = "bfloat16",
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
        if fabric.arch not in NVLS_ARCHES:
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


def available_algorithms(fabric: Layout, dtype: Any = "bfloat16",
                         nccl_version: Optional[Tuple[int, int, int]] = None) -> List[str]:
    """The algorithms NCCL can run here, in canonical order."""
    return [a for a in ALGORITHMS if algorithm_unavailable_reason(fabric, a, dtype, nccl_version) is None]
