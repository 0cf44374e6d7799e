"""Reading this node's topology through NVML (pynvml's API).

VMs and containers often answer only part of it (the H200 VM we measured raised NotSupported for every NVLink
call), so every call is tried on its own (`_Probe`), what answers is kept and what does not is written to
`Topology.notes`. NVML sees neither NICs nor other nodes: see `launch_env.apply_launch_env`.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ...log import describe_error
from .gpu import (GPU, NVLINK_GBPS_BY_ARCH, NVLINK_GBPS_BY_NVML_VERSION, TopologyError, _is_int,
                  cpu_affinity_from_words, format_cpu_ranges, gpu_arch)
from .model import Topology, build_matrix

_NVML_ANCESTOR_LABELS = {
    # NVML_TOPOLOGY_INTERNAL means two GPUs on one board (K80-style). For two distinct GPUs nvidia-smi shows
    # the on-board PCIe switch, so it maps to PIX here ("X" is kept for the diagonal).
    0: "PIX",
    10: "PIX",  # NVML_TOPOLOGY_SINGLE
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE
    40: "NODE",  # NVML_TOPOLOGY_NODE (= NVML_TOPOLOGY_CPU)
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM
}
_NVML_P2P_LABELS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "NS", 5: "NS", 6: "U"}
_NVML_NVLINK_DEVICE_TYPE_GPU = 0
_NVML_NVLINK_DEVICE_TYPE_SWITCH = 2


def nvml_text(v: Any) -> Optional[str]:
    """A string NVML returned, stripped; None when empty or not a string. pynvml returns str in new versions and
    bytes in old ones."""
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str):
        v = v.strip("\x00").strip()
        return v or None
    return None


def _bus_key(bus_id: Optional[str]) -> Optional[Tuple[int, int, int, int]]:
    """Bus id ("00000000:18:00.0", "0000:18:00.0") -> (domain, bus, device, function): compares any spelling."""
    if not bus_id:
        return None
    m = re.match(r"^\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)\s*$", bus_id)
    if not m:
        return None
    return tuple(int(x, 16) for x in m.groups())  # type: ignore[return-value]


class _Failed:
    """Marks a call that raised or does not exist (None can be a real answer)."""


_FAILED = _Failed()


class _Probe:
    """Calls NVML functions one at a time; a failure is recorded for the notes and the caller goes on."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        # (function, error) -> contexts: (gpu,), (gpu, link) or (gpu, other gpu)
        self.failures: Dict[Tuple[str, str], List[Tuple[int, ...]]] = {}

    def __call__(self, fn_name: str, *args: Any, ctx: Tuple[int, ...] = ()) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            self.failures.setdefault((fn_name, "missing from this NVML binding"), []).append(ctx)
            return _FAILED
        try:
            return fn(*args)
        except Exception as e:  # NVMLError_*, ctypes errors, anything: keep going
            self.failures.setdefault((fn_name, describe_error(e)), []).append(ctx)
            return _FAILED

    def notes(self) -> List[str]:
        out = []
        for (fn, err), ctxs in self.failures.items():
            out.append(f"{fn}: {err}{_describe_contexts(fn, ctxs)}")
        return out


def _describe_contexts(fn: str, ctxs: List[Tuple[int, ...]]) -> str:
    ctxs = [c for c in ctxs if c]
    if not ctxs:
        return ""
    if len(ctxs[0]) == 1:
        gpus = sorted({c[0] for c in ctxs})
        return f" (GPU{'s' if len(gpus) > 1 else ''} {format_cpu_ranges(gpus)})"
    if "NvLink" in fn:
        by_gpu: Dict[int, List[int]] = {}
        for gpu, link in ctxs:
            by_gpu.setdefault(gpu, []).append(link)
        link_sets = {tuple(sorted(v)) for v in by_gpu.values()}
        if len(link_sets) == 1:
            plural = "s" if len(by_gpu) > 1 else ""
            return f" (GPU{plural} {format_cpu_ranges(list(by_gpu))}, links {format_cpu_ranges(list(link_sets.pop()))})"
        return " (" + "; ".join(f"GPU {g} links {format_cpu_ranges(v)}" for g, v in sorted(by_gpu.items())) + ")"
    return f" ({len(ctxs)} GPU pair{'s' if len(ctxs) > 1 else ''})"


def _nvml_const(nvml: Any, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    if isinstance(value, tuple):  # nvidia-ml-py 13 spells NVML_P2P_CAPS_INDEX_READ as "0," -> (0,)
        value = value[0] if value else default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def from_nvml(nvml: Any = None) -> Topology:
    """Read this node's GPUs and links through NVML (a module with pynvml's API; default: import pynvml).

    Any single call may raise (NotSupported in VMs, FunctionNotFound on old drivers) or be missing: what answers
    is kept, the rest is listed in `notes`. Raises TopologyError("NVML unavailable: ...") only when NVML cannot
    start or count the GPUs.
    """
    if nvml is None:
        try:  # here, not at the top: NVML is an optional dependency and only this function needs it
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError as e:
            raise TopologyError(f"NVML unavailable: cannot import pynvml ({e}); pip install nvidia-ml-py") from e
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise TopologyError(f"NVML unavailable: nvmlInit failed: {describe_error(e)}") from e
    try:
        return _read_nvml(nvml)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _read_nvml(nvml: Any) -> Topology:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as e:
        raise TopologyError(f"NVML unavailable: nvmlDeviceGetCount failed: {describe_error(e)}") from e
    if count < 1:
        raise TopologyError("NVML unavailable: it reports no GPUs")
    probe = _Probe(nvml)
    notes: List[str] = []  # what could not be read or was assumed, in the order it was met

    handles: List[Any] = []
    for i in range(count):
        h = probe("nvmlDeviceGetHandleByIndex", i, ctx=(i,))
        handles.append(None if h is _FAILED else h)
    fields_by_gpu = [_gpu_fields(probe, i, h, notes) for i, h in enumerate(handles)]
    versions = _read_nvlinks(nvml, probe, handles, fields_by_gpu, notes)
    _reconcile_nvlink_counts(fields_by_gpu, notes)
    _read_p2p(nvml, probe, handles, fields_by_gpu)
    gpus = [GPU(**f) for f in fields_by_gpu]
    matrix = _matrix(probe, handles, gpus, notes)
    rate = _nvlink_rate(gpus, versions, notes)

    notes = probe.notes() + notes
    notes.append("NVML sees no NICs or other nodes: nodes=1 and inter_node_gbps unknown (see apply_launch_env)")
    slug = re.sub(r"[^a-z0-9]+", "-", gpus[0].name.lower()).strip("-") or "gpu"
    return Topology(
        name=f"nvml-{count}x-{slug}",
        gpus=gpus,
        matrix=matrix,
        nodes=1,
        nvlink_gbps_per_link=rate,
        inter_node_gbps=None,
        source="nvml",
        notes=notes,
    )


def _gpu_fields(probe: _Probe, i: int, h: Any, notes: List[str]) -> Dict[str, Any]:
    """GPU i's own facts (name, PCI bus id and link, memory, compute capability, CPU affinity), as GPU's fields."""
    f: Dict[str, Any] = {"index": i, "name": f"GPU {i}"}
    if h is None:
        return f
    name = nvml_text(probe("nvmlDeviceGetName", h, ctx=(i,)))
    if name:
        f["name"] = name
    pci = probe("nvmlDeviceGetPciInfo", h, ctx=(i,))
    if pci is not _FAILED:
        f["pci_bus_id"] = nvml_text(getattr(pci, "busId", None)) or nvml_text(getattr(pci, "busIdLegacy", None))
    for key, what in (("pcie_gen", "Generation"), ("pcie_width", "Width")):
        # Max = the most device and slot allow; Curr drops when idle (power saving), so it is the fallback.
        value = probe(f"nvmlDeviceGetMaxPcieLink{what}", h, ctx=(i,))
        if value is _FAILED or not value:
            value = probe(f"nvmlDeviceGetCurrPcieLink{what}", h, ctx=(i,))
        if value is not _FAILED and _is_int(value) and value > 0:
            f[key] = value
    mem = probe("nvmlDeviceGetMemoryInfo", h, ctx=(i,))
    if mem is not _FAILED and _is_int(getattr(mem, "total", None)):
        f["memory_bytes"] = mem.total
    cc = probe("nvmlDeviceGetCudaComputeCapability", h, ctx=(i,))
    if cc is not _FAILED:
        try:
            f["compute_capability"] = (int(cc[0]), int(cc[1]))
        except (TypeError, ValueError, IndexError):
            notes.append(f"GPU {i}: unreadable compute capability {cc!r}")
    words = max(16, -(-(os.cpu_count() or 1) // 64))  # 64-bit words; 16 covers 1024 CPUs
    aff = probe("nvmlDeviceGetCpuAffinity", h, words, ctx=(i,))
    if aff is not _FAILED:
        try:
            f["cpu_affinity"] = cpu_affinity_from_words(list(aff))
        except (TypeError, ValueError):
            notes.append(f"GPU {i}: unreadable CPU affinity {aff!r}")
    return f


def _read_nvlinks(nvml: Any, probe: _Probe, handles: List[Any], fields_by_gpu: List[Dict[str, Any]],
                  notes: List[str]) -> List[int]:
    """Fill each GPU's ``nvlink_peers`` and ``nvswitch_links``; the NVLink versions read (one per GPU with links).

    Each link is on or off; an active link ends at another GPU (by PCI bus id) or at an NVSwitch.
    """
    bus_to_index = {}
    for f in fields_by_gpu:
        key = _bus_key(f.get("pci_bus_id"))
        if key is not None:
            bus_to_index[key] = f["index"]
    max_links = _nvml_const(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    switch_type = _nvml_const(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", _NVML_NVLINK_DEVICE_TYPE_SWITCH)
    gpu_type = _nvml_const(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", _NVML_NVLINK_DEVICE_TYPE_GPU)
    versions: List[int] = []
    assumed_switch = unknown_remote = 0
    for i, h in enumerate(handles):
        f = fields_by_gpu[i]
        f["nvlink_peers"], f["nvswitch_links"] = {}, 0
        if h is None:
            continue
        version_read = False
        for link in range(max_links):
            state = probe("nvmlDeviceGetNvLinkState", h, link, ctx=(i, link))
            if state is _FAILED or not state:
                continue
            if not version_read:
                version_read = True
                v = probe("nvmlDeviceGetNvLinkVersion", h, link, ctx=(i, link))
                if v is not _FAILED and _is_int(v):
                    versions.append(v)
            rtype = probe("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, ctx=(i, link))
            if rtype is not _FAILED and rtype == switch_type:
                f["nvswitch_links"] += 1
                continue
            remote = probe("nvmlDeviceGetNvLinkRemotePciInfo", h, link, ctx=(i, link))
            rkey = _bus_key(nvml_text(getattr(remote, "busId", None))) if remote is not _FAILED else None
            peer = bus_to_index.get(rkey) if rkey is not None else None
            if peer is not None and peer != i:
                f["nvlink_peers"][peer] = f["nvlink_peers"].get(peer, 0) + 1
            elif rtype is not _FAILED and rtype != gpu_type:
                pass  # e.g. an IBM NPU (POWER9 CPU): not a path between GPUs
            elif rkey is not None and rtype is _FAILED:
                f["nvswitch_links"] += 1  # the far end answers but is none of our GPUs: an NVSwitch
                assumed_switch += 1
            else:
                unknown_remote += 1
    if assumed_switch:
        notes.append(f"{assumed_switch} active NVLinks end at no local GPU: counted as NVSwitch links")
    if unknown_remote:
        notes.append(f"{unknown_remote} active NVLinks with an unknown far end: ignored")
    return versions


def _reconcile_nvlink_counts(fields_by_gpu: List[Dict[str, Any]], notes: List[str]) -> None:
    """Links are counted from both ends; where the two ends disagree (a call failed on one), keep the larger count."""
    for i, f in enumerate(fields_by_gpu):
        for peer, links in list(f["nvlink_peers"].items()):
            other = fields_by_gpu[peer]["nvlink_peers"]
            if other.get(i, 0) != links:
                both = max(links, other.get(i, 0))
                notes.append(f"GPU {i} and GPU {peer} disagree on their NVLink count: using {both}")
                f["nvlink_peers"][peer] = other[i] = both


def _read_p2p(nvml: Any, probe: _Probe, handles: List[Any], fields_by_gpu: List[Dict[str, Any]]) -> None:
    """Fill each GPU's ``p2p``: the P2P read status for every ordered pair."""
    p2p_index = _nvml_const(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    for i, hi in enumerate(handles):
        f = fields_by_gpu[i]
        f["p2p"] = {}
        for j, hj in enumerate(handles):
            if i == j or hi is None or hj is None:
                continue
            status = probe("nvmlDeviceGetP2PStatus", hi, hj, p2p_index, ctx=(i, j))
            if status is not _FAILED:
                f["p2p"][j] = _NVML_P2P_LABELS.get(status, "U")


def _matrix(probe: _Probe, handles: List[Any], gpus: List[GPU], notes: List[str]) -> List[List[str]]:
    """The `nvidia-smi topo -m` matrix: NVLink where it joins a pair, else the PCIe path NVML reports."""
    assumed_sys = 0

    def pcie_label(i: int, j: int) -> str:
        nonlocal assumed_sys
        level = _FAILED
        if handles[i] is not None and handles[j] is not None:
            level = probe("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j], ctx=(i, j))
        label = _NVML_ANCESTOR_LABELS.get(level) if _is_int(level) else None
        if label is None:
            assumed_sys += 1
            return "SYS"
        return label

    matrix = build_matrix(gpus, pcie_label)
    if assumed_sys:
        notes.append(f"PCIe path unknown for {assumed_sys} GPU pair(s): assumed SYS (the slowest)")
    return matrix


def _nvlink_rate(gpus: List[GPU], versions: List[int], notes: List[str]) -> Optional[float]:
    """GB/s per NVLink per direction: from the NVLink versions read, else from the GPU architecture; None without
    NVLink or when neither tells."""
    if not any(g.nvlink_links for g in gpus):
        return None
    rates = [NVLINK_GBPS_BY_NVML_VERSION[v] for v in versions if v in NVLINK_GBPS_BY_NVML_VERSION]
    if rates:
        return min(rates)
    arch = {gpu_arch(g) for g in gpus}
    rate = NVLINK_GBPS_BY_ARCH.get(arch.pop()) if len(arch) == 1 else None
    notes.append(
        f"NVLink version unknown: assumed {rate} GB/s per link from the GPU architecture"
        if rate is not None
        else "NVLink version unknown and the architecture gives no rate: nvlink_gbps_per_link unknown"
    )
    return rate
