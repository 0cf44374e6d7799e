"""The GPU topology of one node, as data: which GPUs there are, how they are joined, and how fast.

The cost model and the autotuner need to know whether a ring inside a node runs over NVLink or PCIe, how many
nodes take part and how fast they are joined. A `Topology` is validated when built, saved and loaded as JSON
(`Topology.save` / `Topology.load`), and fingerprinted for the profile cache. Its GPUs are `gpu.GPU`; where a
topology comes from (NVML, presets, files, the launcher) is the rest of this package.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

from ...safe_write import OutputError, atomic_write_text
from .gpu import GPU, TopologyError, _check_fields, _check_float, _check_int, _check_str, gpu_arch, gpu_from_dict

FORMAT_VERSION = 1  # the "format" key of saved JSON files; bump when a field changes meaning

# Labels between two GPUs, as `nvidia-smi topo -m` prints them. NV<n> = n bonded NVLinks.
_LABEL_RE = re.compile(r"^(X|NV[1-9][0-9]*|PIX|PXB|PHB|NODE|SYS)$")
_NV_RE = re.compile(r"^NV([1-9][0-9]*)$")

SOURCES = ("nvml", "preset", "file")

LEGEND = """Legend:

  X    = Self
  SYS  = Path crosses PCIe and the link between NUMA nodes / sockets (e.g. QPI/UPI)
  NODE = Path crosses PCIe and the link between PCIe host bridges inside one NUMA node
  PHB  = Path crosses PCIe and a PCIe host bridge (usually the CPU)
  PXB  = Path crosses several PCIe bridges, but no PCIe host bridge
  PIX  = Path crosses at most one PCIe bridge
  NV#  = Path over a bonded set of # NVLinks"""


def nvlink_count(gpus: Sequence[GPU], i: int, j: int) -> int:
    """NVLinks between GPUs at positions i and j: direct links, else (both on NVSwitches) the smaller link count.

    On an NVSwitch node every pair is joined through the switches, and nvidia-smi shows NV<links per GPU>
    (NV18 on DGX H100); this returns the same number.
    """
    a, b = gpus[i], gpus[j]
    direct = a.nvlink_peers.get(b.index, 0)
    if direct:
        return direct
    if a.nvswitch_links and b.nvswitch_links:
        return min(a.nvswitch_links, b.nvswitch_links)
    return 0


def build_matrix(gpus: Sequence[GPU], pcie_label: Callable[[int, int], str] = lambda i, j: "SYS") -> List[List[str]]:
    """The `nvidia-smi topo -m` matrix: "X" on the diagonal, NV<n> where NVLink joins a pair, else pcie_label(i, j)."""
    n = len(gpus)
    matrix = [["X"] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            links = nvlink_count(gpus, i, j)
            label = f"NV{links}" if links else pcie_label(i, j)
            matrix[i][j] = matrix[j][i] = label
    return matrix


@dataclass
class Topology:
    """The GPUs of one node and how they are joined; all nodes of a job are assumed identical."""

    name: str
    """A label: the preset name, or "nvml-<n>x-<gpu name>"."""
    gpus: List[GPU]
    """The GPUs of one node, in index order."""
    matrix: List[List[str]]
    """Labels between local GPUs like `nvidia-smi topo -m`: "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"."""
    nodes: int = 1
    """Number of nodes in the job (NVML cannot see them: see apply_launch_env)."""
    nvlink_gbps_per_link: Optional[float] = None
    """Unidirectional GB/s of one NVLink (NVLink3/4: 25); None when there is no NVLink or it is unknown."""
    inter_node_gbps: Optional[float] = None
    """Unidirectional GB/s per node over all its NICs (8 x 400 Gb/s = 400 GB/s); None when unknown."""
    source: str = "preset"
    """Where the facts come from: "nvml", "preset" or "file"."""
    notes: List[str] = field(default_factory=list)
    """What could not be read and which assumptions were made."""

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        if not isinstance(self.gpus, list) or not self.gpus:
            raise TopologyError(f"gpus must be a non-empty list, got {self.gpus!r}")
        n = len(self.gpus)
        for pos, gpu in enumerate(self.gpus):
            if not isinstance(gpu, GPU):
                raise TopologyError(f"gpus[{pos}] must be a GPU, got {type(gpu).__name__}")
            if gpu.index != pos:
                raise TopologyError(f"gpus[{pos}].index must equal its position {pos}, got {gpu.index}")
            for key in ("nvlink_peers", "p2p"):
                for peer in getattr(gpu, key):
                    if peer >= n:
                        raise TopologyError(f"gpus[{pos}].{key} names GPU {peer}, but there are only {n} GPUs")
        self._check_matrix()
        _check_int("nodes", self.nodes, minimum=1)
        self.nvlink_gbps_per_link = _check_float("nvlink_gbps_per_link", self.nvlink_gbps_per_link)
        self.inter_node_gbps = _check_float("inter_node_gbps", self.inter_node_gbps)
        if self.source not in SOURCES:
            raise TopologyError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not isinstance(self.notes, list) or not all(isinstance(s, str) for s in self.notes):
            raise TopologyError(f"notes must be a list of strings, got {self.notes!r}")

    def _check_matrix(self) -> None:
        n = len(self.gpus)
        m = self.matrix
        if not isinstance(m, list) or len(m) != n or not all(isinstance(r, list) and len(r) == n for r in m):
            raise TopologyError(f"matrix must be {n} lists of {n} labels (one per GPU), got {m!r}")
        for i in range(n):
            for j in range(n):
                label = m[i][j]
                where = f"matrix[{i}][{j}]"
                if not isinstance(label, str) or not _LABEL_RE.match(label):
                    raise TopologyError(f"{where} must be X, NV<n>, PIX, PXB, PHB, NODE or SYS, got {label!r}")
                if (label == "X") != (i == j):
                    raise TopologyError(f"{where} is {label!r}: 'X' belongs on the diagonal and only there")
                if m[j][i] != label:
                    raise TopologyError(f"{where} is {label!r} but matrix[{j}][{i}] is {m[j][i]!r}: must be symmetric")
                if i == j:
                    continue
                links = nvlink_count(self.gpus, i, j)
                nv = _NV_RE.match(label)
                if nv and int(nv.group(1)) != links:
                    raise TopologyError(
                        f"{where} is {label!r} but the GPUs say {links} NVLinks between GPU {i} and GPU {j} "
                        "(see their nvlink_peers / nvswitch_links)"
                    )
                if not nv and links:
                    raise TopologyError(f"{where} is {label!r} but GPU {i} and GPU {j} are joined by {links} NVLinks")

    # ---- derived facts ----------------------------------------------------------------------------------------

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpus)

    @property
    def world_size(self) -> int:
        """One rank per GPU on every node."""
        return self.nodes * self.gpus_per_node

    @property
    def has_nvswitch(self) -> bool:
        return any(g.nvswitch_links > 0 for g in self.gpus)

    @property
    def arch(self) -> str:
        """The GPU generation: "hopper", "ampere", "blackwell" or "unknown".

        From the compute capability, else the name; "unknown" when the GPUs disagree or are of another generation
        (Ada 8.9, Volta, Turing).
        """
        archs = {gpu_arch(g) for g in self.gpus}
        return archs.pop() if len(archs) == 1 else "unknown"

    @property
    def nvlink_links_per_gpu(self) -> int:
        """The smallest number of active NVLinks of any GPU (0 when some GPU has none)."""
        return min(g.nvlink_links for g in self.gpus)

    @property
    def nvlink_all_pairs(self) -> bool:
        """Whether NVLink joins every pair of local GPUs (true for a single GPU that has NVLinks)."""
        if self.gpus_per_node == 1:
            return self.nvlink_links_per_gpu > 0
        n = self.gpus_per_node
        return all(self.matrix[i][j].startswith("NV") for i in range(n) for j in range(n) if i != j)

    @property
    def pcie_gbps(self) -> Optional[float]:
        """Slowest GPU's theoretical unidirectional PCIe GB/s (gen5 x16 = 64); None when no GPU's link is known."""
        rates = [g.pcie_gbps for g in self.gpus if g.pcie_gbps is not None]
        return min(rates) if rates else None

    @property
    def intra_node_fabric(self) -> Optional[str]:
        """What a ring inside the node runs over: "nvlink" (every pair joined by NVLink), "pcie", or None (unknown)."""
        if self.nvlink_all_pairs and self.nvlink_gbps_per_link is not None:
            return "nvlink"
        return "pcie" if self.pcie_gbps is not None else None

    @property
    def intra_node_gbps(self) -> Optional[float]:
        """Unidirectional GB/s per GPU available to a ring inside the node, theoretical.

        NVLink, when it joins every pair: links per GPU x rate per link (DGX H100: 18 x 25 = 450; through NVSwitch
        each GPU can drive all its links whatever the ring order). Otherwise PCIe: gen/width rate of the slowest
        GPU (gen5 x16 = 64), an upper bound: a ring crossing sockets (SYS) or without P2P goes slower.
        """
        if self.intra_node_fabric == "nvlink":
            return self.nvlink_links_per_gpu * self.nvlink_gbps_per_link
        return self.pcie_gbps

    # ---- serialisation ----------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-ready dict (GPU-index keys as strings, compute capability as a list)."""

        def gpu_dict(g: GPU) -> dict:
            d = dataclasses.asdict(g)
            d["compute_capability"] = list(g.compute_capability) if g.compute_capability is not None else None
            d["nvlink_peers"] = {str(k): v for k, v in sorted(g.nvlink_peers.items())}
            d["p2p"] = {str(k): v for k, v in sorted(g.p2p.items())}
            return d

        return {
            "format": FORMAT_VERSION,
            "name": self.name,
            "nodes": self.nodes,
            "nvlink_gbps_per_link": self.nvlink_gbps_per_link,
            "inter_node_gbps": self.inter_node_gbps,
            "source": self.source,
            "notes": list(self.notes),
            "gpus": [gpu_dict(g) for g in self.gpus],
            "matrix": [list(row) for row in self.matrix],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        """Build from `to_dict()` output; TopologyError naming the bad field on anything missing or malformed."""
        if not isinstance(d, Mapping):
            raise TopologyError(f"a topology must be a JSON object, got {type(d).__name__}")
        fmt = d.get("format", FORMAT_VERSION)
        if fmt != FORMAT_VERSION:
            raise TopologyError(f"format must be {FORMAT_VERSION}, got {fmt!r}")
        _check_fields(d, [f.name for f in dataclasses.fields(cls)] + ["format"], ("name", "gpus", "matrix"))
        gpus = d["gpus"]
        if not isinstance(gpus, list):
            raise TopologyError(f"gpus must be a list, got {type(gpus).__name__}")
        kwargs = {k: copy.deepcopy(v) for k, v in d.items() if k not in ("format", "gpus")}
        kwargs["gpus"] = [gpu_from_dict(g, pos) for pos, g in enumerate(gpus)]
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: Union[str, os.PathLike[str]]) -> None:
        """Write `to_json()` to path; `Topology.load` reads it back (as source "file").

        Atomically (temp file + rename); a symlink, directory, device or FIFO at `path` is refused with
        TopologyError naming it, and nothing is written (see `ddp_triton.safe_write`).
        """
        try:
            atomic_write_text(path, self.to_json() + "\n")
        except OutputError as e:
            raise TopologyError(f"{e.path}: cannot write topology file: {e.reason}") from None

    @classmethod
    def load(cls, path: Union[str, os.PathLike[str]]) -> Topology:
        """Read a file written by `save`; TopologyError naming the file and the problem if it is unreadable."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise TopologyError(f"{path}: cannot read topology file: {e.strerror or e}") from e
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TopologyError(
                f"{path}: not a JSON topology file: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})"
            ) from None
        try:
            d = json.loads(text)
        except RecursionError:
            raise TopologyError(f"{path}: not valid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, or an integer of too many digits
            raise TopologyError(f"{path}: not valid JSON: {e}") from e
        try:
            topo = cls.from_dict(d)
        except TopologyError as e:
            raise TopologyError(f"{path}: {e}") from e
        except RecursionError:
            raise TopologyError(f"{path}: nested too deeply to be a topology") from None
        return dataclasses.replace(topo, source="file")

    def fingerprint(self) -> str:
        """sha256 hex, in canonical JSON, of the hardware class: what decides how all-reduce performs.

        Covers the GPU names and count, the matrix labels, each GPU's NVLinks (to peers and to NVSwitches) and the
        rate per link, each GPU's PCIe generation and width, the nodes and the inter-node rate. Leaves out what
        differs between machines of one kind, or between NVML and a preset of the same machine: PCI bus ids, CPU
        affinity, memory size, compute capability (a preset may not know it; the name fixes it), P2P status (NVML
        answers it, presets leave it unknown), and `name`, `source`, `notes`. So a profile made from a preset
        (`autotune --model-only --topology dgx-h100`) is found by the hook on the real machine. Profiles are cached
        under this with the inter-node rate left out (`profile_fingerprint`, which `ddp-triton topo` prints): NVML
        cannot see NICs.
        """
        gpus = [
            {
                "name": g.name,
                "pcie_gen": g.pcie_gen,
                "pcie_width": g.pcie_width,
                "nvlink_peers": {str(k): v for k, v in sorted(g.nvlink_peers.items())},
                "nvswitch_links": g.nvswitch_links,
            }
            for g in self.gpus
        ]
        d = {
            "gpus": gpus,
            "matrix": [list(row) for row in self.matrix],
            "nodes": self.nodes,
            "nvlink_gbps_per_link": self.nvlink_gbps_per_link,
            "inter_node_gbps": self.inter_node_gbps,
        }
        canonical = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    def render_matrix(self) -> str:
        """The matrix as `nvidia-smi topo -m` lays it out (GPU rows and columns, CPU affinity), then the legend."""
        heads = [f"GPU{g.index}" for g in self.gpus]
        width = max(len(s) for s in heads + [c for row in self.matrix for c in row]) + 2
        lines = [" " * width + "".join(h.ljust(width) for h in heads) + "CPU Affinity"]
        for gpu, head, row in zip(self.gpus, heads, self.matrix):
            cells = "".join((" X" if c == "X" else c).ljust(width) for c in row)
            lines.append(head.ljust(width) + cells + (gpu.cpu_affinity or "N/A"))
        return "\n".join(lines) + "\n\n" + LEGEND + "\n"
