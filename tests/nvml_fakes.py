"""Stand-in NVML modules: pynvml's API over recorded or described hardware, so NVML code runs without a GPU.

`FakeNVML` answers from a list of device dicts. A value "ERR NVMLError_Name(code)" raises that NVMLError (the
way our measurement scripts record failures); a key that is absent raises NVMLError_NotSupported, the usual
answer of a VM. Constants and error classes are pynvml's own, so the code under test sees the real exceptions
and the real (sometimes odd) constants: nvidia-ml-py 13 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,).

Builders: `h200_vm()` replays our reading on the H200 VM (tests/data/h200_vm_nvml.json, read there on
2026-11-30); `dgx_h100()` plays an 8-GPU NVSwitch node;
`nvlink_bridged_pcie()` a PCIe box with NVLink bridges between GPU pairs; `bare()` one with only the basic calls.
"""

from __future__ import annotations

import json
import pathlib
import re
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Optional

import pynvml

DATA = pathlib.Path(__file__).parent / "data"

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
_ERR_RE = re.compile(r"^ERR (\w+)\((\d+)\)$")


def nvml_error(code: int) -> Exception:
    """An instance of pynvml's subclass for that code (NVMLError(3) is an NVMLError_NotSupported)."""
    return pynvml.NVMLError(code)


def affinity_words(cpus: Iterable[int], words: int = 4) -> List[int]:
    """CPU numbers -> NVML's affinity bitmask, a list of 64-bit words."""
    out = [0] * words
    for c in cpus:
        out[c // 64] |= 1 << (c % 64)
    return out


class _Handle:
    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


QUERY_FUNCTIONS = (
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetCpuAffinity",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkVersion",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlDeviceGetP2PStatus",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
)


class FakeNVML:
    """pynvml's API over `devices` (dicts, see the module docstring); `missing` names functions left out entirely.

    Device keys: name, pci, pcie_gen / pcie_width (current), pcie_gen_max / pcie_width_max, mem, cc,
    cpu_affinity (64-bit words), numa, nvlink_version, nvlink ({link: {"remote_pci", "remote_type", "active"}} or an
    "ERR ..." string per link). System: driver, cuda_driver. ancestor(i, j) gives NVML_TOPOLOGY_* levels,
    p2p(i, j) NVML_P2P_STATUS_* values; both raise NotSupported when not given.
    """

    def __init__(
        self,
        devices: List[Dict[str, Any]],
        *,
        driver: Any = None,
        cuda_driver: Any = None,
        max_links: int = 18,
        ancestor: Optional[Callable[[int, int], int]] = None,
        p2p: Optional[Callable[[int, int], int]] = None,
        missing: Iterable[str] = (),
        init_error: Optional[Exception] = None,
        count_error: Optional[Exception] = None,
        as_bytes: bool = False,
    ) -> None:
        self._devices = devices
        self._driver = driver
        self._cuda_driver = cuda_driver
        self._ancestor = ancestor
        self._p2p = p2p
        self._missing = set(missing)
        self._init_error = init_error
        self._count_error = count_error
        self._as_bytes = as_bytes  # old pynvml returned bytes for strings
        self.NVML_NVLINK_MAX_LINKS = max_links
        self.calls: Dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            if name in object.__getattribute__(self, "_missing"):
                raise AttributeError(name)
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML"):  # constants and error classes: pynvml's own
            return getattr(pynvml, name)
        raise AttributeError(name)

    # ---- plumbing ----

    def _str(self, s: str) -> Any:
        return s.encode() if self._as_bytes else s

    def _answer(self, value: Any) -> Any:
        if value is None:
            raise nvml_error(NOT_SUPPORTED)
        if isinstance(value, str):
            m = _ERR_RE.match(value)
            if m:
                raise nvml_error(int(m.group(2)))
        return value

    def _dev(self, handle: _Handle) -> Dict[str, Any]:
        return self._devices[handle.index]

    def _get(self, handle: _Handle, key: str) -> Any:
        return self._answer(self._dev(handle).get(key))

    def _link(self, handle: _Handle, link: int) -> Dict[str, Any]:
        if not 0 <= link < self.NVML_NVLINK_MAX_LINKS:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        links = self._answer(self._dev(handle).get("nvlink"))
        return self._answer(links.get(str(link), links.get(link)))

    # ---- system ----

    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise self._init_error

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._str(self._answer(self._driver))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._answer(self._cuda_driver)

    def nvmlDeviceGetCount(self) -> int:
        if self._count_error is not None:
            raise self._count_error
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self._devices):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    # ---- one device ----

    def nvmlDeviceGetName(self, handle: _Handle) -> Any:
        return self._str(self._get(handle, "name"))

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        return SimpleNamespace(busId=self._str(self._get(handle, "pci")))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._get(handle, "pcie_gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._get(handle, "pcie_gen_max")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: _Handle) -> int:
        return self._get(handle, "pcie_width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: _Handle) -> int:
        return self._get(handle, "pcie_width_max")

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        total = self._get(handle, "mem")
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple:
        return tuple(self._get(handle, "cc"))

    def nvmlDeviceGetCpuAffinity(self, handle: _Handle, cpu_set_size: int) -> List[int]:
        words = list(self._get(handle, "cpu_affinity"))
        return (words + [0] * cpu_set_size)[:cpu_set_size]

    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        return self._get(handle, "numa")

    # ---- links and pairs ----

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        return int(self._link(handle, link).get("active", 1))

    def nvmlDeviceGetNvLinkVersion(self, handle: _Handle, link: int) -> int:
        self._link(handle, link)
        return self._get(handle, "nvlink_version")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._str(self._answer(self._link(handle, link).get("remote_pci"))))

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        return self._answer(self._link(handle, link).get("remote_type"))

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: _Handle, h2: _Handle) -> int:
        if self._ancestor is None:
            raise nvml_error(NOT_SUPPORTED)
        return self._ancestor(h1.index, h2.index)

    def nvmlDeviceGetP2PStatus(self, h1: _Handle, h2: _Handle, p2p_index: int) -> int:
        if not isinstance(p2p_index, int):  # what ctypes does with the tuple pynvml's constant is
            raise TypeError(f"p2pIndex must be an int, got {p2p_index!r}")
        if self._p2p is None:
            raise nvml_error(NOT_SUPPORTED)
        return self._p2p(h1.index, h2.index)


# ---- builders ----


def h200_vm(*, cc: Optional[tuple] = None) -> FakeNVML:
    """Replays what NVML answered on our H200 VM; calls the reading did not record raise NotSupported.

    ``cc``: a compute capability to answer as well (the reading has none; a driver that answers gives (9, 0))."""
    reading = json.loads((DATA / "h200_vm_nvml.json").read_text())["nvml"]
    devices = []
    for d in reading["devices"]:
        devices.append(
            {
                "name": d["name"],
                "pci": d["pci"],
                "pcie_gen": d["pcie_gen"],
                "pcie_width": d["pcie_width"],
                "pcie_gen_max": d["pcie_gen_max"],
                "pcie_width_max": d["pcie_width_max"],
                "mem": d["mem"],
                "cpu_affinity": d["cpu_affinity"],
                "numa": d["numa"],
                "nvlink": d["nvlink"],
                "cc": cc,
            }
        )
    assert len(devices) == reading["count"]
    return FakeNVML(devices, driver=reading["driver"], max_links=len(reading["devices"][0]["nvlink"]))


DGX_H100_BUS_IDS = [f"00000000:{b}:00.0" for b in ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")]
DGX_H100_AFFINITY = [list(range(56)) + list(range(112, 168)), list(range(56, 112)) + list(range(168, 224))]


def dgx_h100(*, missing: Iterable[str] = ()) -> FakeNVML:
    """8 x H100 SXM, all 18 NVLinks of each GPU to one of 4 NVSwitches; GPUs 0-3 on socket 0, 4-7 on socket 1."""
    switches = [f"00000000:{b:02X}:00.0" for b in (0x05, 0x06, 0x07, 0x08)]
    devices = []
    for i, bus in enumerate(DGX_H100_BUS_IDS):
        devices.append(
            {
                "name": "NVIDIA H100 80GB HBM3",
                "pci": bus,
                "pcie_gen": 1,  # idle: the link drops to gen1 to save power; the max is what counts
                "pcie_width": 16,
                "pcie_gen_max": 5,
                "pcie_width_max": 16,
                "mem": 81559 * 1024**2,
                "cc": (9, 0),
                "cpu_affinity": affinity_words(DGX_H100_AFFINITY[i // 4]),
                "numa": i // 4,
                "nvlink_version": pynvml.NVML_NVLINK_VERSION_4_0,
                "nvlink": {
                    str(link): {"remote_pci": switches[link % 4], "remote_type": pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH}
                    for link in range(18)
                },
            }
        )

    def ancestor(i: int, j: int) -> int:
        return pynvml.NVML_TOPOLOGY_NODE if i // 4 == j // 4 else pynvml.NVML_TOPOLOGY_SYSTEM

    return FakeNVML(
        devices,
        driver="580.159.04",
        cuda_driver=13000,
        max_links=18,
        ancestor=ancestor,
        p2p=lambda i, j: pynvml.NVML_P2P_STATUS_OK,
        missing=missing,
    )


def nvlink_bridged_pcie() -> FakeNVML:
    """4 x H100 PCIe; NVLink bridges join GPUs 0-1 and 2-3 (12 links each); old-style bytes strings.

    The remote bus ids are spelled differently from the device's own (4-digit domain, lower case), as sources
    disagree on the spelling; pairs without NVLink cross the host bridge (PHB) or the sockets (SYS).
    """
    bus = ["00000000:1B:00.0", "00000000:1C:00.0", "00000000:AD:00.0", "00000000:AE:00.0"]
    devices = []
    for i in range(4):
        peer = i ^ 1
        links: Dict[str, Any] = {
            str(link): {"remote_pci": bus[peer].lower()[4:], "remote_type": pynvml.NVML_NVLINK_DEVICE_TYPE_GPU}
            for link in range(12)
        }
        links.update({str(link): {"active": 0} for link in range(12, 18)})
        devices.append(
            {
                "name": "NVIDIA H100 PCIe",
                "pci": bus[i],
                "pcie_gen_max": 5,
                "pcie_width_max": 16,
                "mem": 81559 * 1024**2,
                "cc": (9, 0),
                "cpu_affinity": affinity_words(range(32) if i < 2 else range(32, 64)),
                "nvlink_version": pynvml.NVML_NVLINK_VERSION_4_0,
                "nvlink": links,
            }
        )

    def ancestor(i: int, j: int) -> int:
        return pynvml.NVML_TOPOLOGY_HOSTBRIDGE if i // 2 == j // 2 else pynvml.NVML_TOPOLOGY_SYSTEM

    def p2p(i: int, j: int) -> int:
        return pynvml.NVML_P2P_STATUS_OK if i // 2 == j // 2 else pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED

    return FakeNVML(devices, driver="580.159.04", ancestor=ancestor, p2p=p2p, as_bytes=True)


def bare(n: int = 2) -> FakeNVML:
    """Only init, count, handles and names exist: every other function raises AttributeError."""
    keep = {"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName"}
    devices = [{"name": "NVIDIA A100-SXM4-40GB"} for _ in range(n)]
    return FakeNVML(devices, missing=[f for f in QUERY_FUNCTIONS if f not in keep])


def unavailable() -> FakeNVML:
    """What pynvml does on a machine without the NVIDIA driver: nvmlInit raises LibraryNotFound."""
    return FakeNVML([], init_error=nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
