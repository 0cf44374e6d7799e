"""Described machines, for planning where NVML cannot see the hardware (a laptop, a CI runner, a VM).

Each preset rests on public figures, cited beside it; they are specifications, not measurements, except
"h200-vm-1gpu", which replays our own NVML reading of the lent H200 VM (2026-11-30; tests/data/h200_vm_nvml.json).
Memory sizes are what nvidia-smi reports for the part (MiB), not the marketing GB.
Link rates are per direction: an NVLink4 link is 50 GB/s bidirectional = 25 GB/s each way.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .gpu import GPU, TopologyError
from .model import Topology, build_matrix

MIB = 1024**2

# nvidia-smi's total memory: H100 80GB HBM3 81559 MiB; A100 80GB (SXM4 and PCIe) 81920 MiB;
# H200 143771 MiB = 150754820096 bytes, as NVML reported it on our H200 VM.
H100_80GB_BYTES = 81559 * MIB
A100_80GB_BYTES = 81920 * MIB
H200_141GB_BYTES = 150754820096

_PRESET_NOTE = "preset: public specifications, not read from this machine"


#: The two notes of every illustrative PCIe server below.
_PCIE_NOTES = [
    "illustrative layout; P2P status depends on the platform (ACS, IOMMU) and is left unknown",
    "NICs not described: inter_node_gbps unknown",
]


def _node(
    name: str,
    gpu_name: str,
    count: int,
    *,
    pcie_gen: int,
    memory_bytes: int,
    cc: tuple,
    affinity: Callable[[int], str],
    notes: List[str],
    nvswitch_links: int = 0,
    link_gbps: Optional[float] = None,
    nics_gbps: Optional[float] = None,
    pcie_label: Callable[[int, int], str] = lambda i, j: "SYS",
) -> Topology:
    """``count`` like GPUs on PCIe gen ``pcie_gen`` x16, CPU affinity ``affinity(index)``. With ``nvswitch_links``
    every NVLink goes to an NVSwitch, so any pair sees NV<links> and P2P works everywhere; without, the GPUs are
    joined by PCIe only, ``pcie_label(i, j)`` saying how, and their P2P status is left unknown."""
    gpus = [
        GPU(
            index=i,
            name=gpu_name,
            pcie_gen=pcie_gen,
            pcie_width=16,
            memory_bytes=memory_bytes,
            compute_capability=cc,
            cpu_affinity=affinity(i),
            nvswitch_links=nvswitch_links,
            p2p={j: "OK" for j in range(count) if j != i} if nvswitch_links else {},
        )
        for i in range(count)
    ]
    return Topology(
        name=name,
        gpus=gpus,
        matrix=build_matrix(gpus, pcie_label),
        nvlink_gbps_per_link=link_gbps,
        inter_node_gbps=nics_gbps,
        source="preset",
        notes=[_PRESET_NOTE] + notes,
    )


def _dgx_hopper(name: str, gpu_name: str, memory_bytes: int) -> Topology:
    """The DGX H100 system, which the DGX H200 shares (see those two)."""
    sockets = ["0-55,112-167", "56-111,168-223"]  # GPUs 0-3 on socket 0, 4-7 on socket 1
    return _node(
        name,
        gpu_name,
        8,
        pcie_gen=5,
        memory_bytes=memory_bytes,
        cc=(9, 0),
        affinity=lambda i: sockets[i // 4],
        notes=[],
        nvswitch_links=18,
        link_gbps=25.0,
        nics_gbps=8 * 400 / 8,
    )


def dgx_h100() -> Topology:
    # NVIDIA DGX H100 datasheet / user guide: 8 x H100 SXM5 80 GB; NVLink4, 18 links per GPU, 900 GB/s
    # bidirectional per GPU (18 x 50 GB/s, i.e. 25 GB/s per direction per link) through 4 third-generation NVSwitch
    # chips; 8 x ConnectX-7 400 Gb/s for the compute fabric (8 x 400 Gb/s = 400 GB/s per node per direction);
    # PCIe gen5 x16 per GPU; 2 x Xeon Platinum 8480C (56 cores each, 224 threads with SMT).
    return _dgx_hopper("dgx-h100", "NVIDIA H100 80GB HBM3", H100_80GB_BYTES)


def dgx_h200() -> Topology:
    # NVIDIA DGX H200 datasheet: the DGX H100 system (same 4 NVSwitch chips, NVLink4 18 links x 25 GB/s per
    # direction, 8 x ConnectX-7 400 Gb/s, PCIe gen5, 2 x Xeon 8480C) with 8 x H200 SXM5, 141 GB HBM3e each.
    return _dgx_hopper("dgx-h200", "NVIDIA H200", H200_141GB_BYTES)


def dgx_a100() -> Topology:
    # NVIDIA DGX A100 datasheet (640 GB model): 8 x A100 SXM4 80 GB; NVLink3, 12 links per GPU, 600 GB/s
    # bidirectional per GPU (12 x 50 GB/s, 25 GB/s per direction per link) through 6 NVSwitch chips;
    # 8 x ConnectX-6 200 Gb/s HDR InfiniBand for compute (8 x 200 Gb/s = 200 GB/s per node per direction);
    # PCIe gen4 x16 per GPU; 2 x AMD EPYC 7742 (64 cores each, 256 threads).
    sockets = ["0-63,128-191", "64-127,192-255"]
    return _node(
        "dgx-a100",
        "NVIDIA A100-SXM4-80GB",
        8,
        pcie_gen=4,
        memory_bytes=A100_80GB_BYTES,
        cc=(8, 0),
        affinity=lambda i: sockets[i // 4],
        notes=["CPU affinity given per socket; nvidia-smi on a DGX A100 in NPS4 mode shows narrower ranges"],
        nvswitch_links=12,
        link_gbps=25.0,
        nics_gbps=8 * 200 / 8,
    )


def pcie_gen5_8gpu() -> Topology:
    # An illustrative 2-socket PCIe server: 8 x H100 PCIe 80 GB (PCIe gen5 x16, 64 GB/s per direction; the optional
    # NVLink bridges absent), two PCIe switches per socket with two GPUs each. GPUs on one switch: PIX; on
    # different switches of one socket: NODE; across sockets: SYS (every ring crosses the inter-socket link).
    # CPUs: 2 x 32 cores with SMT (64 threads per socket).
    sockets = ["0-31,64-95", "32-63,96-127"]

    def label(i: int, j: int) -> str:
        if i // 4 != j // 4:
            return "SYS"
        return "PIX" if i // 2 == j // 2 else "NODE"

    return _node(
        "pcie-gen5-8gpu",
        "NVIDIA H100 PCIe",
        8,
        pcie_gen=5,
        memory_bytes=H100_80GB_BYTES,
        cc=(9, 0),
        affinity=lambda i: sockets[i // 4],
        notes=_PCIE_NOTES,
        pcie_label=label,
    )


def pcie_gen4_4gpu() -> Topology:
    # An illustrative 1-socket PCIe workstation/server: 4 x A100 PCIe 80 GB (PCIe gen4 x16, 32 GB/s per direction,
    # no NVLink bridges), each on its own root port; GPUs 0-1 and 2-3 share a PCIe host bridge (PHB), the two pairs
    # sit under different host bridges of the same socket (NODE). CPU: 32 cores with SMT.
    return _node(
        "pcie-gen4-4gpu",
        "NVIDIA A100 80GB PCIe",
        4,
        pcie_gen=4,
        memory_bytes=A100_80GB_BYTES,
        cc=(8, 0),
        affinity=lambda i: "0-63",
        notes=_PCIE_NOTES,
        pcie_label=lambda i, j: "PHB" if i // 2 == j // 2 else "NODE",
    )


def h200_vm_1gpu() -> Topology:
    # Our own NVML reading on the lent H200 VM on 2026-11-30 (tests/data/h200_vm_nvml.json holds it):
    # one "NVIDIA H200" at 00000000:00:06.0, PCIe gen5 x16 (current and max), 150754820096 bytes, CPU affinity
    # words [65535, 0, 0, 0] = CPUs 0-15; NVLink (links 0-17) and NUMA calls raised NVMLError_NotSupported, and
    # `nvidia-smi topo -m` showed one GPU. Compute capability was not recorded, so it is left unknown (the name
    # still gives the architecture); the fingerprint leaves it out, so from_nvml on that VM gives the same one
    # whether or not NVML answers it.
    gpu = GPU(
        index=0,
        name="NVIDIA H200",
        pci_bus_id="00000000:00:06.0",
        pcie_gen=5,
        pcie_width=16,
        memory_bytes=H200_141GB_BYTES,
        cpu_affinity="0-15",
    )
    return Topology(
        name="h200-vm-1gpu",
        gpus=[gpu],
        matrix=[["X"]],
        source="preset",
        notes=[
            "preset: NVML reading of the H200 VM, 2026-11-30 (driver 580.159.04)",
            "NVLink and NUMA calls raised NVMLError_NotSupported in the VM: no NVLink seen",
            "compute capability not recorded",
        ],
    )


PRESETS: Dict[str, Callable[[], Topology]] = {
    "dgx-h100": dgx_h100,
    "dgx-h200": dgx_h200,
    "dgx-a100": dgx_a100,
    "pcie-gen5-8gpu": pcie_gen5_8gpu,
    "pcie-gen4-4gpu": pcie_gen4_4gpu,
    "h200-vm-1gpu": h200_vm_1gpu,
}
"""Preset name -> a function building a fresh Topology."""


def load_preset(name: str) -> Topology:
    """A fresh copy of the preset; TopologyError listing the valid names for an unknown one."""
    build: Optional[Callable[[], Topology]] = PRESETS.get(name) if isinstance(name, str) else None
    if build is None:
        raise TopologyError(f"unknown topology preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return build()
