"""The cost model of a bucket's wire formats: bytes by hand, the all-to-all and all-gather times by hand, and where
each format is predicted to win.

Tier: no device (pure Python).
"""

from __future__ import annotations

import math

import pytest

from ddp_triton.formats import TRAFFIC, traffic_of
from ddp_triton.machine import cost_model as cm
from ddp_triton.machine.topology import apply_launch_env, load_topology


def fabric(preset: str, nodes: int = 1, inter: float = None) -> cm.Fabric:
    return cm.Fabric.from_topology(apply_launch_env(load_topology(preset), nodes=nodes, inter_node_gbps=inter, env={}))


@pytest.mark.parametrize("n,world,fmt,collectives", [
    pytest.param(1000, 8, "fp32", [("all_reduce", 4000)], id="fp32"),
    pytest.param(1000, 8, "bf16", [("all_reduce", 2000)], id="bf16"),
    pytest.param(1000, 8, "fp16", [("all_reduce", 2000)], id="fp16"),
    pytest.param(1000, 8, "bf16+fp32sum", [("all_to_all", 2000), ("all_gather", 2000)], id="bf16-fp32sum"),
    # 1001 elements padded to 1008, a multiple of 8 ranks.
    pytest.param(1001, 8, "bf16+fp32sum", [("all_to_all", 2016), ("all_gather", 2016)], id="bf16-fp32sum-padded"),
    # 3072 elements: 24 blocks of 128, a multiple of 8; 132 bytes each (128 codes, a float32 scale).
    pytest.param(3072, 8, "fp8", [("all_to_all", 3168), ("all_gather", 3168)], id="fp8"),
    # One element: one block, padded to 8 blocks.
    pytest.param(1, 8, "fp8", [("all_to_all", 1056), ("all_gather", 1056)], id="fp8-one-element"),
    # 129 elements: 2 blocks, padded to 3 over 3 ranks.
    pytest.param(129, 3, "fp8", [("all_to_all", 396), ("all_gather", 396)], id="fp8-3-ranks"),
    # The runtime's names travel as the model's.
    pytest.param(3072, 8, "fp8e5m2+ef", [("all_to_all", 3168), ("all_gather", 3168)], id="fp8e5m2-ef"),
    pytest.param(1000, 8, "fp16+fp32sum", [("all_to_all", 2000), ("all_gather", 2000)], id="fp16-fp32sum"),
])
def test_wire_collectives_by_hand(n, world, fmt, collectives):
    assert cm.wire_collectives(n, fmt, world) == collectives


def test_wire_bytes_per_rank():
    n, world = 1 << 20, 8
    ring = 2 * (world - 1) * 2 * n // world  # a bf16 ring all-reduce sends 2(N-1)/N of the message
    assert cm.wire_bytes(n, "bf16", world) == ring
    # bf16 with float32 sums: the same bytes as the ring, in two collectives of (N-1)/N each.
    assert cm.wire_bytes(n, "bf16+fp32sum", world) == ring
    # FP8: 1.03125 bytes per element against 2.
    assert cm.wire_bytes(n, "fp8", world) / ring == 1.03125 / 2
    assert cm.wire_bytes(n, "fp32", world) == 2 * ring
    assert cm.wire_bytes(n, "fp8", 1) == 0  # one rank sends nothing


def test_all_to_all_by_hand():
    # 4 nodes x 1 GPU over 100 Gb/s (NCCL: 12 GB/s): base 8.4 + 3 peers x 3 us (a network post each) + one network
    # hop 14 us, and each node sends 3/4 of the buffer through its NIC.
    f = fabric("h200-vm-1gpu", 4, inter=12.5)
    n = 64 << 20
    expected = 8.4 + 3 * 3.0 + 14.0 + 0.75 * n / (1e3 * 12.0)
    assert cm.all_to_all_time_us(f, n) == pytest.approx(expected, rel=1e-12)
    # 8 GPUs per node: each node sends 8 x 24/32 of the buffer off-node, 3.1x what a ring all-reduce sends there.
    f8 = fabric("dgx-h100", 4)
    latency = 8.4 + 7 * 3.4 + 24 * 3.0 + 14.0
    assert cm.all_to_all_time_us(f8, n) == pytest.approx(latency + 8 * 24 / 32 * n / (1e3 * 384.0), rel=1e-12)


def test_all_gather_is_half_a_ring_all_reduce():
    # NCCL's ring all-gather: N-1 steps and (N-1)/N of the buffer, half of an all-reduce's, with the base once.
    f = fabric("dgx-a100")
    n = 256 << 20
    ring = cm.protocol_time_us(f, n, "ring", "Simple")
    assert cm.all_gather_time_us(f, n) == pytest.approx(8.4 + (ring - 8.4) / 2, rel=1e-12)


def test_all_reduce_formats_are_the_hooks_all_reduce():
    f = fabric("dgx-h100", 2)
    n = 16 << 20
    assert cm.wire_format_time_us(f, n, "bf16") == cm.best(f, 2 * n, "bfloat16").time_us
    assert cm.wire_format_time_us(f, n, "fp32") == cm.best(f, 4 * n, "float32").time_us
    assert cm.wire_format_time_us(f, n, "fp32") > cm.wire_format_time_us(f, n, "bf16")


def test_fp8_wins_across_nodes_with_one_gpu_each():
    # 4 nodes x 1 GPU over 100 Gb/s: every byte crosses the slow link, and FP8 sends half of bf16's; the two
    # collectives' latencies are small beside it. docs/autotune.md, "The cost model".
    f = fabric("h200-vm-1gpu", 4, inter=12.5)
    n = 64 << 20 >> 2  # a 64 MiB bucket of float32 gradients
    times = {w: cm.wire_format_time_us(f, n, w) for w in TRAFFIC}
    assert min(times, key=times.get) == "fp8"
    # bytes 1.03125 / 2 of bf16's; 0.6 leaves room for the latencies.
    assert times["fp8"] < 0.6 * times["bf16"]


def test_all_to_all_formats_pay_at_the_nics_of_8_gpu_nodes():
    # On 8-GPU nodes an all-to-all sends ppn x (N-ppn)/N of the buffer through each node's NICs, 3.1x a ring's
    # 2(N-1)/N at 4 nodes: FP8's half-size buffer does not make up for it, and bf16 all-reduce stays fastest.
    f = fabric("dgx-h100", 4)
    for mib in (4, 64):
        n = (mib << 20) >> 2
        times = {w: cm.wire_format_time_us(f, n, w) for w in TRAFFIC}
        assert min(times, key=times.get) in ("bf16", "fp16"), (mib, times)
        assert times["bf16+fp32sum"] > times["bf16"]


def test_wire_format_input_errors():
    with pytest.raises(ValueError, match="fp4"):
        cm.wire_bytes(10, "fp4", 8)
    with pytest.raises(ValueError, match="n_elements"):
        cm.wire_collectives(0, "fp8", 8)
    with pytest.raises(ValueError, match="world_size"):
        cm.wire_collectives(10, "fp8", 0)
    assert traffic_of("fp8e4m3+ef") == "fp8"
    assert math.isfinite(cm.wire_format_time_us(fabric("h200-vm-1gpu"), 10, "fp8"))


def test_two_level_node_bytes_against_the_flat_ring_at_2_nodes_x_2_ranks():
    """Per node link, per bucket: flat bf16 rings 2(N-1)/N of 2n bytes = 3n over 4 ranks; two-level each of the two
    ranks sends its half once (2(M-1)/M = 1 at M = 2): 2n in bf16, 2 x 1.03n / 2 in FP8."""
    n = 128 * 100_000
    flat_bf16 = 3 * n
    assert cm.two_level_part(n, 2) == n // 2
    assert cm.two_level_node_bytes(n, "bf16", 2, 2) == 2 * n
    assert cm.two_level_node_bytes(n, "fp8e4m3+ef", 2, 2) == n * 132 // 128
    assert round(cm.two_level_node_bytes(n, "bf16", 2, 2) / flat_bf16, 2) == 0.67
    assert round(cm.two_level_node_bytes(n, "fp8", 2, 2) / flat_bf16, 2) == 0.34


def test_two_level_time_is_the_flat_time_where_the_runtime_goes_flat_and_cheaper_across_slow_nics():
    one_node = cm.Fabric(ranks_per_node=8, nodes=1, intra_gbps=450, intra_link="nvlink", nvswitch=True, arch="hopper")
    per_node = cm.Fabric(ranks_per_node=1, nodes=4, inter_gbps=12.5, arch="hopper")
    for fabric in (one_node, per_node):
        for fmt in ("bf16", "fp8"):
            assert cm.two_level_time_us(fabric, 1 << 22, fmt) == cm.wire_format_time_us(fabric, 1 << 22, fmt)
    slow = cm.Fabric(ranks_per_node=8, nodes=4, intra_gbps=450, inter_gbps=12.5, intra_link="nvlink", nvswitch=True,
                     arch="hopper")
    n = 26_214_400  # 100 MiB of float32 gradients
    # FP8's all-to-all sends ppn times a ring's bytes per node; two-level sends one part per rank.
    assert cm.two_level_time_us(slow, n, "fp8") < 0.5 * cm.wire_format_time_us(slow, n, "fp8")
    assert cm.two_level_time_us(slow, n, "fp8") < cm.two_level_time_us(slow, n, "bf16")
    with pytest.raises(ValueError, match="unknown wire format"):
        cm.two_level_time_us(slow, n, "int4")
