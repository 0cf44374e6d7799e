"""Topology: presets, JSON files, the NVML adapter and the launch environment.

Tier: no device. NVML is played by the stand-ins of tests/nvml_fakes.py, one of which replays our reading on
the H200 VM (tests/data/h200_vm_nvml.json).
"""

import dataclasses
import json
import re

import pytest

import nvml_fakes
from ddp_triton.machine.topology.presets import PRESETS as PRESETS_FROM_PRESETS
from ddp_triton.machine.profile import profile_fingerprint
from ddp_triton.machine.topology import (
    GPU,
    LEGEND,
    PRESETS,
    Topology,
    TopologyError,
    apply_launch_env,
    build_matrix,
    cpu_affinity_from_words,
    format_cpu_ranges,
    from_nvml,
    load_preset,
    load_topology,
)

# What each preset must say, from the public figures cited in ddp_triton/machine/topology/presets.py.
# intra: unidirectional GB/s per GPU for a ring inside the node (NVLink links x 25, or PCIe gen/width).
EXPECTED = {
    "dgx-h100": dict(gpus=8, arch="hopper", nvswitch=True, links=18, intra=450.0, inter=400.0, fabric="nvlink"),
    "dgx-h200": dict(gpus=8, arch="hopper", nvswitch=True, links=18, intra=450.0, inter=400.0, fabric="nvlink"),
    "dgx-a100": dict(gpus=8, arch="ampere", nvswitch=True, links=12, intra=300.0, inter=200.0, fabric="nvlink"),
    "pcie-gen5-8gpu": dict(gpus=8, arch="hopper", nvswitch=False, links=0, intra=64.0, inter=None, fabric="pcie"),
    "pcie-gen4-4gpu": dict(gpus=4, arch="ampere", nvswitch=False, links=0, intra=32.0, inter=None, fabric="pcie"),
    "h200-vm-1gpu": dict(gpus=1, arch="hopper", nvswitch=False, links=0, intra=64.0, inter=None, fabric="pcie"),
}


def tiny(**changes) -> Topology:
    """A two-GPU topology written out by hand, for the cases presets do not cover."""
    gpus = [
        GPU(
            index=i,
            name="NVIDIA H100 PCIe",
            pcie_gen=5,
            pcie_width=16,
            compute_capability=(9, 0),
            nvlink_peers={1 - i: 4},
        )
        for i in range(2)
    ]
    kwargs = dict(name="tiny", gpus=gpus, matrix=[["X", "NV4"], ["NV4", "X"]], nvlink_gbps_per_link=25)
    kwargs.update(changes)
    return Topology(**kwargs)


def row(rendered: str, head: str) -> list:
    return next(line.split() for line in rendered.splitlines() if line.startswith(head + " "))


# ---- presets ---------------------------------------------------------------------------------------------------


def test_preset_names():
    assert sorted(PRESETS) == sorted(EXPECTED)
    assert PRESETS is PRESETS_FROM_PRESETS


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_self_consistent(name):
    exp = EXPECTED[name]
    topo = load_preset(name)
    assert topo.name == name and topo.source == "preset" and topo.nodes == 1
    assert topo.gpus_per_node == exp["gpus"] == topo.world_size
    assert [g.index for g in topo.gpus] == list(range(exp["gpus"]))
    assert topo.arch == exp["arch"]
    assert topo.has_nvswitch is exp["nvswitch"]
    assert topo.nvlink_links_per_gpu == exp["links"]
    assert topo.intra_node_gbps == exp["intra"]
    assert topo.intra_node_fabric == exp["fabric"]
    assert topo.inter_node_gbps == exp["inter"]
    # The matrix is the one the GPUs' link data implies (Topology also checks this on construction).
    pcie = {(i, j): topo.matrix[i][j] for i in range(exp["gpus"]) for j in range(exp["gpus"])}
    assert topo.matrix == build_matrix(topo.gpus, lambda i, j: pcie[i, j])
    assert all(g.cpu_affinity and g.pcie_gen and g.pcie_width == 16 and g.memory_bytes for g in topo.gpus)
    assert topo.notes, "a preset says where its figures come from"
    assert Topology.from_dict(topo.to_dict()) == topo


def test_preset_figures():
    """The headline numbers of the datasheets, bidirectional as NVIDIA quotes them."""
    h100, a100 = load_preset("dgx-h100"), load_preset("dgx-a100")
    assert 2 * h100.nvlink_links_per_gpu * h100.nvlink_gbps_per_link == 900  # GB/s per GPU, NVLink4
    assert 2 * a100.nvlink_links_per_gpu * a100.nvlink_gbps_per_link == 600  # GB/s per GPU, NVLink3
    assert h100.gpus[0].pcie_gbps == 64.0 and a100.gpus[0].pcie_gbps == 32.0
    assert load_preset("dgx-h200").gpus[0].memory_bytes > h100.gpus[0].memory_bytes
    assert all(label.startswith("NV18") for r in h100.matrix for label in r if label != "X")
    pcie = load_preset("pcie-gen5-8gpu")
    assert pcie.matrix[0][1] == "PIX" and pcie.matrix[0][2] == "NODE" and pcie.matrix[0][4] == "SYS"
    assert {label for r in load_preset("pcie-gen4-4gpu").matrix for label in r} == {"X", "PHB", "NODE"}
    vm = load_preset("h200-vm-1gpu")
    assert vm.gpus[0].cpu_affinity == "0-15" and vm.gpus[0].memory_bytes == 150754820096


def test_preset_is_a_fresh_copy():
    a = load_preset("dgx-h100")
    a.gpus[0].name = "changed"
    a.notes.append("changed")
    assert load_preset("dgx-h100").gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert "changed" not in load_preset("dgx-h100").notes


def test_unknown_preset_lists_names():
    with pytest.raises(TopologyError, match="dgx-h100.*h200-vm-1gpu") as info:
        load_preset("dgx-h900")
    assert "dgx-h900" in str(info.value)
    assert isinstance(info.value, ValueError)


# ---- JSON files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_json_round_trip(name, tmp_path):
    topo = load_preset(name)
    path = tmp_path / f"{name}.json"
    topo.save(path)
    back = Topology.load(path)
    assert back.source == "file"
    assert dataclasses.replace(back, source=topo.source) == topo
    assert back.fingerprint() == topo.fingerprint()
    assert json.loads(back.to_json()) == dict(json.loads(topo.to_json()), source="file")
    assert load_topology(str(path)) == back


def test_fingerprint_is_stable_and_about_hardware():
    topo = tiny()
    # Pinned: the canonical form must not drift between runs, Python versions or releases (cached tuning is
    # keyed by it, so a change orphans every cached profile). Change it only on purpose.
    assert topo.fingerprint() == PINNED_TINY_FINGERPRINT
    relabelled = dataclasses.replace(topo, name="other", source="file", notes=["x"])
    assert relabelled.fingerprint() == topo.fingerprint()
    assert tiny(nodes=2).fingerprint() != topo.fingerprint()
    assert tiny(nvlink_gbps_per_link=50).fingerprint() != topo.fingerprint()
    assert tiny(nvlink_gbps_per_link=25.0).fingerprint() == topo.fingerprint()  # int and float agree
    assert tiny(inter_node_gbps=400).fingerprint() != topo.fingerprint()
    assert len({load_preset(n).fingerprint() for n in PRESETS}) == len(PRESETS)


# Re-pinned when the fingerprint was narrowed to the hardware class (bus ids, CPU affinity, memory, compute
# capability and P2P status left out), so that NVML and a preset of the same machine agree.
PINNED_TINY_FINGERPRINT = "94bbe7f0e1a80dfbcd56bd2befef805300f6b4f2080a5f9d666355b937a3d2d8"


@pytest.mark.parametrize("field,value,same", [
    pytest.param("pci_bus_id", "00000000:AB:00.0", True, id="bus-id"),
    pytest.param("cpu_affinity", "0-7", True, id="cpu-affinity"),
    pytest.param("memory_bytes", 1 << 30, True, id="memory"),
    pytest.param("compute_capability", None, True, id="compute-capability"),
    pytest.param("p2p", {1: "OK"}, True, id="p2p"),
    pytest.param("name", "NVIDIA H200", False, id="gpu-name"),
    pytest.param("pcie_gen", 4, False, id="pcie-gen"),
    pytest.param("pcie_width", 8, False, id="pcie-width"),
])
def test_fingerprint_covers_the_hardware_class_only(field, value, same):
    topo = tiny()
    changed = dataclasses.replace(topo, gpus=[dataclasses.replace(topo.gpus[0], **{field: value}), topo.gpus[1]])
    assert (changed.fingerprint() == topo.fingerprint()) is same


def _valid_dict() -> dict:
    return load_preset("pcie-gen4-4gpu").to_dict()


def _edit(fn):
    d = _valid_dict()
    fn(d)
    return json.dumps(d)


BAD_FILES = [
    pytest.param("", "not valid JSON", id="empty"),
    pytest.param('{"name": "x", "gpus": [', "not valid JSON", id="truncated"),
    pytest.param("[1, 2]", "JSON object", id="list"),
    pytest.param(_edit(lambda d: d.pop("matrix")), "'matrix'", id="missing-matrix"),
    pytest.param(_edit(lambda d: d["gpus"][1].pop("name")), r"gpus\[1\].*'name'", id="missing-gpu-name"),
    pytest.param(_edit(lambda d: d["gpus"][2].update(pcie_gen="five")), r"gpus\[2\]\.pcie_gen", id="wrong-type"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(index=True)), r"gpus\[0\]\.index", id="bool-index"),
    pytest.param(_edit(lambda d: d["gpus"][3].update(index=0)), r"gpus\[3\]\.index", id="index-not-position"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(compute_capability=[9])), "compute_capability", id="cc"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(cpu_affinity="0..15")), "cpu_affinity", id="affinity"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(nvlink_peers={"a": 1})), "nvlink_peers", id="peer-key"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(p2p={"1": "YES"})), r"p2p\[1\]", id="p2p-label"),
    pytest.param(_edit(lambda d: d["gpus"][0].update(nvlink_peers={"9": 2})), "nvlink_peers", id="peer-range"),
    pytest.param(_edit(lambda d: d.update(nodes=0)), "nodes", id="zero-nodes"),
    pytest.param(_edit(lambda d: d.update(inter_node_gbps="fast")), "inter_node_gbps", id="rate-type"),
    pytest.param(_edit(lambda d: d.update(source="guess")), "source", id="source"),
    pytest.param(_edit(lambda d: d.update(gpus=[])), "gpus", id="no-gpus"),
    pytest.param(_edit(lambda d: d.update(colour="red")), "colour", id="unknown-field"),
    pytest.param(_edit(lambda d: d.update(format=99)), "format", id="future-format"),
    pytest.param(_edit(lambda d: d["matrix"].pop()), "matrix", id="matrix-short"),
    pytest.param(_edit(lambda d: d["matrix"][0].__setitem__(1, "QPI")), r"matrix\[0\]\[1\]", id="label"),
    pytest.param(_edit(lambda d: d["matrix"][0].__setitem__(1, "SYS")), "symmetric", id="asymmetric"),
    pytest.param(_edit(lambda d: d["matrix"][2].__setitem__(2, "PHB")), r"matrix\[2\]\[2\]", id="diagonal"),
    pytest.param(
        _edit(lambda d: (d["matrix"][0].__setitem__(1, "NV4"), d["matrix"][1].__setitem__(0, "NV4"))),
        "NVLinks",
        id="nv-label-without-links",
    ),
]


@pytest.mark.parametrize("text, problem", BAD_FILES)
def test_bad_file_names_file_and_problem(text, problem, tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(text)
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    message = str(info.value)
    assert str(path) in message
    assert re.search(problem, message), message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(TopologyError, match=re.escape(str(path))):
        Topology.load(path)
    with pytest.raises(TopologyError, match="nope.json"):
        load_topology(str(path))


def test_construction_validates():
    with pytest.raises(ValueError, match="matrix"):
        tiny(matrix=[["X", "SYS"], ["SYS", "X"]])  # the GPUs say NV4
    with pytest.raises(TopologyError, match="pcie_width"):
        GPU(index=0, name="x", pcie_width=0)
    with pytest.raises(TopologyError, match="nvlink_peers"):
        GPU(index=0, name="x", nvlink_peers={0: 2})


# ---- rendering -------------------------------------------------------------------------------------------------


def test_render_matrix_dgx():
    text = load_preset("dgx-h100").render_matrix()
    head = text.splitlines()[0].split()
    assert head == [f"GPU{i}" for i in range(8)] + ["CPU", "Affinity"]
    assert row(text, "GPU0") == ["GPU0", "X"] + ["NV18"] * 7 + ["0-55,112-167"]
    assert row(text, "GPU5") == ["GPU5"] + ["NV18"] * 5 + ["X", "NV18", "NV18", "56-111,168-223"]
    assert text.count("NV18") == 56
    assert LEGEND in text
    for label in ("X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"):
        assert re.search(rf"^  {re.escape(label)} +=", text, re.MULTILINE), label


def test_render_matrix_pcie_and_single():
    text = load_preset("pcie-gen5-8gpu").render_matrix()
    assert row(text, "GPU0") == ["GPU0", "X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS", "0-31,64-95"]
    assert row(text, "GPU6") == ["GPU6", "SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "X", "PIX", "32-63,96-127"]
    vm = load_preset("h200-vm-1gpu").render_matrix()
    assert row(vm, "GPU0") == ["GPU0", "X", "0-15"]
    assert "Legend:" in vm
    unknown = from_nvml(nvml_fakes.bare()).render_matrix()
    assert row(unknown, "GPU1") == ["GPU1", "SYS", "X", "N/A"]


# ---- NVML ------------------------------------------------------------------------------------------------------


def test_nvml_h200_vm_replay():
    fake = nvml_fakes.h200_vm()
    topo = from_nvml(fake)
    assert topo.source == "nvml" and topo.gpus_per_node == 1 and topo.nodes == 1
    gpu = topo.gpus[0]
    assert gpu.name == "NVIDIA H200"
    assert gpu.pci_bus_id == "00000000:00:06.0"
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert gpu.memory_bytes == 150754820096
    assert gpu.cpu_affinity == "0-15"
    assert gpu.nvlink_peers == {} and gpu.nvswitch_links == 0 and not topo.has_nvswitch
    assert topo.matrix == [["X"]]
    assert topo.arch == "hopper"  # from the name: the reading has no compute capability
    assert topo.pcie_gbps == 64.0 and topo.intra_node_gbps == 64.0 and topo.intra_node_fabric == "pcie"
    assert topo.nvlink_gbps_per_link is None
    notes = "\n".join(topo.notes)
    assert "NotSupported" in notes
    assert re.search(r"nvmlDeviceGetNvLinkState: NVMLError_NotSupported.*links 0-17", notes)
    # The preset is the same reading: same hardware facts.
    assert topo.fingerprint() == load_preset("h200-vm-1gpu").fingerprint()
    assert fake.calls["nvmlShutdown"] == 1


def test_nvml_h200_vm_answering_compute_capability_is_still_the_preset():
    # A driver that answers the compute capability (the recorded reading has none, nor has the preset).
    topo = from_nvml(nvml_fakes.h200_vm(cc=(9, 0)))
    preset = load_preset("h200-vm-1gpu")
    assert topo.gpus[0].compute_capability == (9, 0) and preset.gpus[0].compute_capability is None
    assert topo.fingerprint() == preset.fingerprint()
    assert profile_fingerprint(topo) == profile_fingerprint(preset)


def test_nvml_dgx_h100_nvswitch():
    topo = from_nvml(nvml_fakes.dgx_h100())
    preset = load_preset("dgx-h100")
    assert topo.gpus_per_node == 8 and topo.has_nvswitch
    assert all(label == "NV18" for i, r in enumerate(topo.matrix) for j, label in enumerate(r) if i != j)
    assert topo.matrix == preset.matrix
    assert all(g.nvswitch_links == 18 and g.nvlink_peers == {} for g in topo.gpus)
    assert all(g.p2p == {j: "OK" for j in range(8) if j != g.index} for g in topo.gpus)  # the (0,) constant
    assert [g.cpu_affinity for g in topo.gpus] == [g.cpu_affinity for g in preset.gpus]
    assert all(g.pcie_gen == 5 for g in topo.gpus)  # the max, not the idle gen1
    assert topo.nvlink_gbps_per_link == 25.0 and topo.intra_node_gbps == 450.0
    assert topo.inter_node_gbps is None and any("NICs" in n for n in topo.notes)
    # NVML reports bus ids, CPU affinity and compute capability as the machine has them; the preset has no bus
    # ids. The same hardware class all the same: with the NIC rate NVML cannot see it is the preset, and the
    # profile key (which leaves the inter-node rate out) is the preset's, so the hook finds a preset's profile.
    assert all(g.pci_bus_id == bus for g, bus in zip(topo.gpus, nvml_fakes.DGX_H100_BUS_IDS))
    assert all(g.pci_bus_id is None and g.compute_capability == (9, 0) for g in preset.gpus)
    assert all(g.compute_capability == (9, 0) and g.cpu_affinity for g in topo.gpus)
    assert apply_launch_env(topo, inter_node_gbps=400, env={}).fingerprint() == preset.fingerprint()
    assert profile_fingerprint(topo) == profile_fingerprint(preset)
    on_four = [apply_launch_env(t, nodes=4, env={}) for t in (topo, preset)]
    assert profile_fingerprint(on_four[0]) == profile_fingerprint(on_four[1])


def test_nvml_nvswitch_without_remote_device_type():
    topo = from_nvml(nvml_fakes.dgx_h100(missing=["nvmlDeviceGetNvLinkRemoteDeviceType"]))
    assert topo.has_nvswitch and topo.matrix == load_preset("dgx-h100").matrix
    notes = "\n".join(topo.notes)
    assert "nvmlDeviceGetNvLinkRemoteDeviceType: missing" in notes
    assert "counted as NVSwitch" in notes


def test_nvml_nvlink_bridges_by_bus_id():
    topo = from_nvml(nvml_fakes.nvlink_bridged_pcie())
    assert topo.gpus[0].name == "NVIDIA H100 PCIe"  # bytes decoded
    assert [g.nvlink_peers for g in topo.gpus] == [{1: 12}, {0: 12}, {3: 12}, {2: 12}]
    assert topo.matrix == [
        ["X", "NV12", "SYS", "SYS"],
        ["NV12", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "NV12"],
        ["SYS", "SYS", "NV12", "X"],
    ]
    assert not topo.has_nvswitch
    assert topo.intra_node_fabric == "pcie" and topo.intra_node_gbps == 64.0  # a ring must cross SYS
    assert topo.gpus[0].p2p == {1: "OK", 2: "CNS", 3: "CNS"}
    assert apply_launch_env(topo, world_size=2, env={}).intra_node_gbps == 12 * 25.0


def test_nvml_missing_functions_still_give_a_topology():
    fake = nvml_fakes.bare(2)
    topo = from_nvml(fake)
    assert [g.name for g in topo.gpus] == ["NVIDIA A100-SXM4-40GB"] * 2
    assert all(g.pcie_gen is None and g.cpu_affinity is None and g.memory_bytes is None for g in topo.gpus)
    assert topo.matrix == [["X", "SYS"], ["SYS", "X"]]
    assert topo.arch == "ampere" and topo.intra_node_gbps is None and topo.pcie_gbps is None
    notes = "\n".join(topo.notes)
    assert "nvmlDeviceGetPciInfo: missing" in notes and "assumed SYS" in notes
    assert fake.calls["nvmlShutdown"] == 1


def test_nvml_unavailable():
    with pytest.raises(TopologyError, match="NVML unavailable: nvmlInit failed: NVMLError_LibraryNotFound"):
        from_nvml(nvml_fakes.unavailable())
    fake = nvml_fakes.FakeNVML([], count_error=nvml_fakes.nvml_error(nvml_fakes.pynvml.NVML_ERROR_UNKNOWN))
    with pytest.raises(TopologyError, match="NVML unavailable: nvmlDeviceGetCount"):
        from_nvml(fake)
    assert fake.calls["nvmlShutdown"] == 1
    with pytest.raises(TopologyError, match="NVML unavailable.*no GPUs"):
        from_nvml(nvml_fakes.FakeNVML([]))
    with pytest.raises(TopologyError, match="--topology"):
        load_topology(None, nvml=nvml_fakes.unavailable())


def test_nvml_default_module_never_raises_anything_else():
    """On this machine pynvml finds no driver; on a GPU machine it reads it. Either way: a Topology or TopologyError."""
    try:
        topo = from_nvml()
    except TopologyError as e:
        assert "NVML unavailable" in str(e)
    else:
        assert topo.source == "nvml" and topo.gpus


@pytest.mark.parametrize(
    "words, expected",
    [
        pytest.param([65535, 0, 0, 0], "0-15", id="h200-vm"),
        pytest.param([0, 0], None, id="empty"),
        pytest.param([1 | 1 << 2 | 1 << 3, 1 << 63, 1], "0,2-3,127-128", id="across-words"),
        pytest.param(nvml_fakes.affinity_words(nvml_fakes.DGX_H100_AFFINITY[1]), "56-111,168-223", id="dgx"),
    ],
)
def test_cpu_affinity_from_words(words, expected):
    assert cpu_affinity_from_words(words) == expected


def test_format_cpu_ranges():
    assert format_cpu_ranges([3, 1, 2, 7]) == "1-3,7"
    assert format_cpu_ranges([]) == ""


# ---- load_topology ---------------------------------------------------------------------------------------------


def test_load_topology_specs(tmp_path):
    assert load_topology("dgx-a100") == load_preset("dgx-a100")
    assert load_topology(None, nvml=nvml_fakes.h200_vm()).source == "nvml"
    assert load_topology("nvml", nvml=nvml_fakes.h200_vm()).gpus[0].name == "NVIDIA H200"
    path = tmp_path / "mine.json"
    load_preset("pcie-gen4-4gpu").save(path)
    assert load_topology(path).source == "file"
    with pytest.raises(TopologyError, match="no preset.*dgx-a100"):
        load_topology("dgx-a1000")


# ---- launch environment ----------------------------------------------------------------------------------------


def test_launch_env_torchrun_four_nodes():
    topo = load_preset("dgx-h100")
    job = apply_launch_env(topo, env={"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "RANK": "5"})
    assert job.nodes == 4 and job.world_size == 32 and job.gpus_per_node == 8
    assert job.inter_node_gbps == 400.0
    assert any("WORLD_SIZE=32" in n for n in job.notes)
    assert topo.nodes == 1, "the input is left alone"


def test_launch_env_arguments_win():
    topo = load_preset("pcie-gen5-8gpu")
    job = apply_launch_env(topo, nodes=2, inter_node_gbps=50, env={})
    assert job.nodes == 2 and job.world_size == 16 and job.inter_node_gbps == 50.0
    job = apply_launch_env(topo, nodes=2, env={})
    assert any("inter-node bandwidth unknown" in n for n in job.notes)
    assert apply_launch_env(topo, env={}) == dataclasses.replace(topo)  # nothing to apply


def test_launch_env_fewer_gpus_on_one_node():
    topo = load_preset("pcie-gen5-8gpu")
    job = apply_launch_env(topo, world_size=4, env={})
    assert job.gpus_per_node == 4 and job.nodes == 1
    assert job.matrix == [r[:4] for r in topo.matrix[:4]]
    assert len(topo.gpus) == 8, "the input is left alone"
    # CUDA_VISIBLE_DEVICES picks which GPUs, renumbered as CUDA numbers them.
    job = apply_launch_env(topo, env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6,7"})
    assert [g.index for g in job.gpus] == [0, 1]
    assert job.matrix == [["X", "PIX"], ["PIX", "X"]]
    assert job.gpus[0].cpu_affinity == "32-63,96-127"
    # One visible GPU per process (set by a scheduler) says nothing about the others: keep the first ones.
    job = apply_launch_env(topo, env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6"})
    assert job.matrix == [["X", "PIX"], ["PIX", "X"]] and job.gpus[0].cpu_affinity == "0-31,64-95"
    # Trimming drops links to GPUs left out.
    h100 = apply_launch_env(load_preset("dgx-h100"), world_size=2, env={})
    assert h100.gpus[0].p2p == {1: "OK"} and h100.matrix == [["X", "NV18"], ["NV18", "X"]]
    # Several nodes running fewer ranks than GPUs, as torchrun --nproc-per-node=4 on 8-GPU nodes.
    job = apply_launch_env(load_preset("dgx-h100"), env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert job.nodes == 2 and job.gpus_per_node == 4 and job.world_size == 8


@pytest.mark.parametrize(
    "kwargs, env, problem",
    [
        pytest.param({}, {"WORLD_SIZE": "30", "LOCAL_WORLD_SIZE": "8"}, "not a multiple", id="uneven-env"),
        pytest.param({}, {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "16"}, "needs 16 GPUs per node", id="too-many"),
        pytest.param({}, {"WORLD_SIZE": "16"}, "needs 16 GPUs per node", id="ws-without-lws"),
        pytest.param({"nodes": 2}, {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE", id="nodes-arg"),
        pytest.param({"nodes": 3, "world_size": 16}, {}, "evenly", id="uneven-args"),
        pytest.param({"nodes": 0}, {}, "nodes", id="zero-nodes"),
        pytest.param({"world_size": -1}, {}, "world_size", id="negative"),
        pytest.param({}, {"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight'", id="not-int"),
        pytest.param({}, {"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE", id="zero-lws"),
    ],
)
def test_launch_env_inconsistent(kwargs, env, problem):
    with pytest.raises(ValueError, match=problem):
        apply_launch_env(load_preset("dgx-h100"), env=env, **kwargs)


@pytest.mark.parametrize(
    "content, problem",
    [
        pytest.param(b"\xff\xfe\x00{", "UTF-8", id="binary"),
        pytest.param(("[" * 100_000 + "]" * 100_000).encode(), "nested too deeply", id="deep-json"),
        pytest.param(
            ('{"name": "x", "gpus": [], "matrix": [], "notes": ' + "[" * 900 + "]" * 900 + "}").encode(),
            "nested too deeply|notes",
            id="deep-but-parsable",
        ),
    ],
)
def test_undecodable_file_names_file_and_problem(content, problem, tmp_path):
    path = tmp_path / "topo.json"
    path.write_bytes(content)
    with pytest.raises(TopologyError) as info:
        Topology.load(path)
    assert str(path) in str(info.value)
    assert re.search(problem, str(info.value)), str(info.value)


def test_directory_is_named(tmp_path):
    with pytest.raises(TopologyError, match=re.escape(str(tmp_path))):
        Topology.load(tmp_path)


def test_save_refuses_a_symlink_and_replaces_a_file(tmp_path):
    import os

    (tmp_path / "real.json").write_text("keep\n")
    (tmp_path / "link.json").symlink_to("real.json")
    with pytest.raises(TopologyError, match="symbolic link"):
        load_preset("dgx-h100").save(tmp_path / "link.json")
    assert os.readlink(tmp_path / "link.json") == "real.json" and (tmp_path / "real.json").read_text() == "keep\n"
    load_preset("dgx-h100").save(tmp_path / "real.json")
    assert Topology.load(tmp_path / "real.json").name == "dgx-h100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
