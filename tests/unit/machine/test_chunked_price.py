"""The cost model's price of a bucket cut into chunks: fill plus drain, and the count it picks.

Tier: no process group (the model is arithmetic)."""

import pytest

import ddp_triton.machine.cost_model as cm
from ddp_triton.formats import WireFormat

# The emulated cluster of bench/RESULTS.md (H11): 2 nodes x 2 ranks, gloo's loopback inside, 200 Mbit/s between.
EMULATED_200MBIT = cm.Fabric(ranks_per_node=2, nodes=2, inter_gbps=0.025, intra_gbps=0.44, intra_link="pcie")
TWO_LEVEL_FP8 = WireFormat.parse("two-level fp8e4m3+ef")


def test_fill_plus_drain():
    assert cm.pipelined_us([3.0, 10.0, 2.0], 1) == 15.0
    assert cm.pipelined_us([3.0, 10.0, 2.0], 4) == 15.0 + 3 * 10.0  # the slowest stage once per further chunk


@pytest.mark.parametrize("name", ["two-level fp8e4m3+ef", "two-level bf16", "fp8e4m3+ef"])
def test_one_chunk_is_the_unchunked_price_and_more_chunks_hide_the_other_stages(name):
    fmt, n = WireFormat.parse(name), 25 << 18  # a 25 MiB float32 bucket
    host = cm.CPU_HOST_COST
    wire = (cm.two_level_time_us if fmt.two_level else cm.wire_format_time_us)(EMULATED_200MBIT, n, fmt.traffic)
    assert cm.chunked_time_us(EMULATED_200MBIT, n, fmt, host, 1) == pytest.approx(
        wire + cm.host_time_us(EMULATED_200MBIT, n, fmt, host))
    best = cm.best_chunk_count(EMULATED_200MBIT, n, fmt, host)
    assert 1 < best <= 25  # at least 1 MiB a chunk
    priced = cm.chunked_time_us(EMULATED_200MBIT, n, fmt, host, best)
    assert priced == min(cm.chunked_time_us(EMULATED_200MBIT, n, fmt, host, k) for k in range(1, 26))
    assert priced == cm.bucket_time_us(EMULATED_200MBIT, n, fmt, host)
    # Never below the slowest stage's whole bucket: what a pipeline cannot hide.
    slowest = max(cm.chunk_stages_us(EMULATED_200MBIT, n, fmt, host))
    assert priced > slowest - host.collective_us


def test_two_level_fp8_in_chunks_hides_the_node_stages_behind_the_link():
    host, n = cm.CPU_HOST_COST, 25 << 18
    whole = cm.chunked_time_us(EMULATED_200MBIT, n, TWO_LEVEL_FP8, host, 1)
    best = cm.chunked_time_us(EMULATED_200MBIT, n, TWO_LEVEL_FP8, host,
                              cm.best_chunk_count(EMULATED_200MBIT, n, TWO_LEVEL_FP8, host))
    node, link, gather = cm.chunk_stages_us(EMULATED_200MBIT, n, TWO_LEVEL_FP8, host)
    assert link > node and link > gather  # the link limits: the stages around it are what chunks hide
    assert whole - best > 0.8 * (node + gather - (whole - node - link - gather))


@pytest.mark.parametrize("n_bytes, expected", [(1 << 20, 1), ((2 << 20) - 4, 1), (4 << 10, 1)],
                         ids=["1-MiB", "under-2-MiB", "4-KiB"])
def test_a_bucket_under_twice_the_floor_is_never_cut(n_bytes, expected):
    for count in (cm.best_chunk_count(EMULATED_200MBIT, n_bytes // 4, TWO_LEVEL_FP8, cm.CPU_HOST_COST),
                  cm.link_bound_chunk_count(EMULATED_200MBIT, n_bytes // 4, 4, TWO_LEVEL_FP8, cm.CPU_HOST_COST)):
        assert count == expected


def test_what_is_not_cut():
    host = cm.CPU_HOST_COST
    for name in ("fp32", "bf16", "bf16+fp32sum"):
        assert not cm.chunkable(WireFormat.parse(name), EMULATED_200MBIT, host)
        assert cm.best_chunk_count(EMULATED_200MBIT, 25 << 18, WireFormat.parse(name), host) == 1
    one_node = cm.Fabric(ranks_per_node=4, nodes=1, intra_gbps=0.44, intra_link="pcie")
    assert not cm.chunkable(TWO_LEVEL_FP8, one_node, host)  # the runtime goes flat there: flat FP8 is cut instead
    assert cm.chunkable(WireFormat.parse("fp8e4m3+ef"), one_node, host)


def test_the_model_prices_chunks_where_the_runtime_cuts_them():
    """A GPU rank keeps whole buckets, so its price is the whole bucket's; nor is a bucket cut where an all-reduce
    of three or more ranks would add its elements in another order in a chunk (three nodes in bf16 between them)."""
    n = 25 << 18
    for name in ("two-level fp8e4m3+ef", "fp8e4m3+ef"):
        fmt = WireFormat.parse(name)
        assert not cm.chunkable(fmt, EMULATED_200MBIT, cm.GPU_HOST_COST)
        assert cm.best_chunk_count(EMULATED_200MBIT, n, fmt, cm.GPU_HOST_COST) == 1
        assert cm.bucket_time_us(EMULATED_200MBIT, n, fmt, cm.GPU_HOST_COST) == pytest.approx(
            cm.chunked_time_us(EMULATED_200MBIT, n, fmt, cm.GPU_HOST_COST, 1))
    three_nodes = cm.Fabric(ranks_per_node=2, nodes=3, inter_gbps=0.025, intra_gbps=0.44, intra_link="pcie")
    assert not cm.chunkable(WireFormat.parse("two-level bf16"), three_nodes, cm.CPU_HOST_COST)
    assert cm.chunkable(TWO_LEVEL_FP8, three_nodes, cm.CPU_HOST_COST)  # its sums are float32 in rank order


def test_the_count_without_the_link_rate_is_the_count_where_the_link_limits():
    """``link_bound_chunk_count`` (the runtime's: no NIC rate known) on links slow enough to be the slowest stage,
    at two rates: near the best count (within an eighth: around its minimum the price is flat, its bumps from whole
    blocks per chunk 0.1% apart), and priced within 1% of the best."""
    host, n = cm.CPU_HOST_COST, 25 << 18
    guessed = cm.link_bound_chunk_count(EMULATED_200MBIT, n, 4, TWO_LEVEL_FP8, host)
    for rate in (0.0125, 0.025):
        fabric = cm.Fabric(ranks_per_node=2, nodes=2, inter_gbps=rate, intra_gbps=0.44, intra_link="pcie")
        best = cm.best_chunk_count(fabric, n, TWO_LEVEL_FP8, host)
        assert abs(best - guessed) <= max(1, best // 8), (rate, best, guessed)
        assert cm.chunked_time_us(fabric, n, TWO_LEVEL_FP8, host, guessed) <= 1.01 * cm.chunked_time_us(
            fabric, n, TWO_LEVEL_FP8, host, best)
