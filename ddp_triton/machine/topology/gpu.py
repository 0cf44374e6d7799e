"""One GPU as data: its fields, checked when built, its PCIe and NVLink rates, its architecture; and the field checks
and CPU affinity notation the topology shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# P2P read status labels, as `nvidia-smi topo -p2p r` prints them.
P2P_LABELS = ("OK", "CNS", "GNS", "TNS", "NS", "U")

# Unidirectional GB/s of one PCIe lane per generation: the figures usually quoted (gen1-2 after 8b/10b encoding,
# gen3+ rounded, ignoring the ~1.5% of 128b/130b), so gen5 x16 = 64 GB/s. Theoretical: DMA reaches ~80-90% of it.
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0}

# Unidirectional GB/s of one NVLink, keyed by NVML's nvmlNvlinkVersion_t (NVML_NVLINK_VERSION_*):
# 1 = NVLink1 (P100, 20), 2 = 2.0 / 3 = 2.2 (V100, 25), 4 = 3.0 / 5 = 3.1 (A100: 12 links = 600 GB/s bidirectional,
# 25 per direction), 6 = 4.0 (H100/H200: 18 links = 900 GB/s bidirectional), 7 = 5.0 (B200: 18 links = 1.8 TB/s).
# Older drivers returned the plain major version (3 for A100, 4 for H100): those land on 25 as well.
NVLINK_GBPS_BY_NVML_VERSION = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
# When NVML gives no version: per-link rate by architecture (same public figures).
NVLINK_GBPS_BY_ARCH = {"ampere": 25.0, "hopper": 25.0, "blackwell": 50.0}

_AFFINITY_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")


class TopologyError(ValueError):
    """A topology cannot be built or read: unknown preset, bad file or field, NVML unavailable."""


# ----------------------------------------------------------------------------------------------------------------
# Field checks shared by GPU and Topology. Messages start with the field name so that callers can prefix a path.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any, *, optional: bool = False, minimum: Optional[int] = None) -> None:
    if v is None and optional:
        return
    if not _is_int(v):
        raise TopologyError(f"{name} must be an int{' or null' if optional else ''}, got {v!r}")
    if minimum is not None and v < minimum:
        raise TopologyError(f"{name} must be >= {minimum}, got {v!r}")


def _check_float(name: str, v: Any) -> Optional[float]:
    """Accept None, int or float >= 0 and return it as a float, so that JSON and fingerprints stay stable."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise TopologyError(f"{name} must be a number >= 0 or null, got {v!r}")
    return float(v)


def _check_str(name: str, v: Any, *, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str) or not v:
        raise TopologyError(f"{name} must be a non-empty string{' or null' if optional else ''}, got {v!r}")


def _check_fields(d: Mapping[str, Any], known: Sequence[str], required: Sequence[str], where: str = "") -> None:
    """TopologyError naming the fields of ``d`` that are not ``known``, else the ``required`` ones it lacks."""
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise TopologyError(f"{where}unknown field(s) {', '.join(map(repr, unknown))}")
    missing = [k for k in required if k not in d]
    if missing:
        raise TopologyError(f"{where}missing field(s) {', '.join(map(repr, missing))}")


@dataclass
class GPU:
    """One GPU as NVML or a preset describes it; None = not known."""

    index: int
    """Local index (NVML's, the same as nvidia-smi's); equals the GPU's position in `Topology.gpus`."""
    name: str
    """Marketing name, e.g. "NVIDIA H200"."""
    pci_bus_id: Optional[str] = None
    """As NVML writes it: "00000000:00:06.0"."""
    pcie_gen: Optional[int] = None
    """PCIe generation of the link (the most device and slot allow)."""
    pcie_width: Optional[int] = None
    """PCIe lanes of the link."""
    memory_bytes: Optional[int] = None
    """Total device memory, as NVML reports it."""
    compute_capability: Optional[Tuple[int, int]] = None
    """CUDA compute capability (major, minor)."""
    cpu_affinity: Optional[str] = None
    """CPUs close to the GPU, written like nvidia-smi: "0-15" or "0-31,64-95"."""
    nvlink_peers: Dict[int, int] = field(default_factory=dict)
    """Index of another local GPU -> number of NVLinks straight to it."""
    nvswitch_links: int = 0
    """NVLinks that end at an NVSwitch."""
    p2p: Dict[int, str] = field(default_factory=dict)
    """Index of another local GPU -> P2P read status ("OK", "NS", ... as `nvidia-smi topo -p2p r`), when known."""

    def __post_init__(self) -> None:
        _check_int("index", self.index, minimum=0)
        _check_str("name", self.name)
        _check_str("pci_bus_id", self.pci_bus_id, optional=True)
        _check_int("pcie_gen", self.pcie_gen, optional=True, minimum=1)
        _check_int("pcie_width", self.pcie_width, optional=True, minimum=1)
        _check_int("memory_bytes", self.memory_bytes, optional=True, minimum=0)
        if self.compute_capability is not None:
            cc = self.compute_capability
            if not isinstance(cc, (tuple, list)) or len(cc) != 2 or not all(_is_int(x) and x >= 0 for x in cc):
                raise TopologyError(f"compute_capability must be two ints [major, minor] or null, got {cc!r}")
            self.compute_capability = (cc[0], cc[1])
        if self.cpu_affinity is not None and (
            not isinstance(self.cpu_affinity, str) or not _AFFINITY_RE.match(self.cpu_affinity)
        ):
            raise TopologyError(f"cpu_affinity must look like '0-15' or '0-31,64-95', got {self.cpu_affinity!r}")
        if not isinstance(self.nvlink_peers, dict):
            raise TopologyError(f"nvlink_peers must be a mapping of GPU index to link count, got {self.nvlink_peers!r}")
        for peer, links in self.nvlink_peers.items():
            _check_int(f"nvlink_peers key {peer!r}", peer, minimum=0)
            _check_int(f"nvlink_peers[{peer}]", links, minimum=1)
            if peer == self.index:
                raise TopologyError(f"nvlink_peers names the GPU itself ({peer})")
        _check_int("nvswitch_links", self.nvswitch_links, minimum=0)
        if not isinstance(self.p2p, dict):
            raise TopologyError(f"p2p must be a mapping of GPU index to status, got {self.p2p!r}")
        for peer, status in self.p2p.items():
            _check_int(f"p2p key {peer!r}", peer, minimum=0)
            if status not in P2P_LABELS:
                raise TopologyError(f"p2p[{peer}] must be one of {', '.join(P2P_LABELS)}, got {status!r}")

    @property
    def nvlink_links(self) -> int:
        """All active NVLinks of this GPU: to peers and to NVSwitches."""
        return self.nvswitch_links + sum(self.nvlink_peers.values())

    @property
    def pcie_gbps(self) -> Optional[float]:
        """Theoretical unidirectional GB/s of the PCIe link (see PCIE_GBPS_PER_LANE); None when unknown."""
        if self.pcie_gen is None or self.pcie_width is None:
            return None
        per_lane = PCIE_GBPS_PER_LANE.get(self.pcie_gen)
        if per_lane is None:  # a generation newer than the table: each one has doubled the rate so far
            per_lane = PCIE_GBPS_PER_LANE[6] * 2 ** (self.pcie_gen - 6)
        return per_lane * self.pcie_width


def gpu_arch(gpu: GPU) -> str:
    cc = gpu.compute_capability
    if cc is not None:
        major, minor = cc
        if major == 8 and minor in (0, 6, 7):  # 8.9 is Ada, not Ampere
            return "ampere"
        if major == 9:
            return "hopper"
        if major in (10, 11, 12):
            return "blackwell"
        return "unknown"
    name = gpu.name.upper()
    if re.search(r"\b(G?H100|H200|H800|H20|GH200)\b", name):
        return "hopper"
    if re.search(r"\b(A100|A800|A10G?|A30|A40|A16|A2)\b|\bRTX A[0-9]+", name):
        return "ampere"
    if re.search(r"\b(G?B100|G?B200|G?B300|RTX PRO [0-9]+ BLACKWELL)\b", name):
        return "blackwell"
    return "unknown"


def gpu_from_dict(g: Any, pos: int) -> GPU:
    """A GPU from its dict in a topology file (``gpus[pos]``); TopologyError naming the field on anything bad."""
    where = f"gpus[{pos}]"
    if not isinstance(g, Mapping):
        raise TopologyError(f"{where} must be an object, got {type(g).__name__}")
    _check_fields(g, [f.name for f in fields(GPU)], ("index", "name"), f"{where}: ")
    kwargs = dict(g)
    for key in ("nvlink_peers", "p2p"):
        if key not in kwargs:
            continue
        value = kwargs[key]
        if not isinstance(value, Mapping):
            raise TopologyError(f"{where}.{key} must be an object keyed by GPU index, got {value!r}")
        converted = {}
        for k, v in value.items():
            try:
                converted[int(k)] = v
            except (TypeError, ValueError):
                raise TopologyError(f"{where}.{key} key {k!r} is not a GPU index") from None
        kwargs[key] = converted
    cc = kwargs.get("compute_capability")
    if isinstance(cc, list):
        kwargs["compute_capability"] = tuple(cc)
    try:
        return GPU(**kwargs)
    except TopologyError as e:
        raise TopologyError(f"{where}.{e}") from None


# ----------------------------------------------------------------------------------------------------------------
# CPU affinity as nvidia-smi writes it


def format_cpu_ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8", as nvidia-smi writes CPU affinity."""
    out: List[str] = []
    ordered = sorted(set(cpus))
    k = 0
    while k < len(ordered):
        start = end = ordered[k]
        while k + 1 < len(ordered) and ordered[k + 1] == end + 1:
            k += 1
            end = ordered[k]
        out.append(str(start) if start == end else f"{start}-{end}")
        k += 1
    return ",".join(out)


def cpu_affinity_from_words(words: Sequence[int], bits_per_word: int = 64) -> Optional[str]:
    """NVML's affinity bitmask (a list of 64-bit words, CPU 0 = bit 0 of word 0) -> "0-15"; None when empty."""
    cpus = [w * bits_per_word + b for w, word in enumerate(words) for b in range(bits_per_word) if int(word) >> b & 1]
    return format_cpu_ranges(cpus) or None
