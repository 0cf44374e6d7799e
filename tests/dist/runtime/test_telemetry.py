"""Telemetry: profiler ranges per bucket, bytes on the wire counted per collective, timings and the summary table.

Tiers: no device (the record, the table, the plain path with no profiler, in this process) and gloo multi-process
on CPU (world size 2, one spawned job for every case, the kernels' torch CPU path). The reference for bytes on the
wire is the buckets' element counts times the wire dtype's size, which is what each all-reduce is handed.
"""

import json
import os
import tempfile
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.runtime import telemetry
from ddp_triton.runtime.telemetry import BucketRecord, BucketSummary, Summary
from ddp_helpers import TwoDtypes, local_slice, make_data, make_model, step, torch_path_workers

PHASES = ("pack", "all_reduce", "unpack")


def all_threads_config():
    """A profiler config that records every thread (gloo runs late unpacks on its own), where torch has one."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def _profiler_ranges(rank, world_size, ddp, state):
    buckets = sorted(state.summary().buckets, key=lambda b: b.index)
    config = all_threads_config()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        step(ddp, rank, world_size, 5)
    names = {e.name for e in prof.events()}
    with tempfile.TemporaryDirectory() as tmp:  # and in the trace file a user opens
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            traced = {e.get("name") for e in json.load(f)["traceEvents"]}
    for b in buckets:
        for phase in PHASES if config is not None else PHASES[:2]:
            name = f"ddp_triton.{phase} bucket {b.index} ({telemetry.human_bytes(b.bucket_bytes)})"
            assert name in names and name in traced, (name, sorted(n for n in names if "ddp_triton" in n))
    # without a profiler the hook takes its plain path again: no range, no Watch
    with mock.patch.object(telemetry, "Watch", side_effect=AssertionError("watched without a profiler")):
        step(ddp, rank, world_size, 6)


def _summary_contents(rank, world_size):
    # bfloat16 on the wire: half of float32's bytes; several buckets after DDP's rebuild
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, profile=None)
    for s in range(3):
        step(ddp, rank, world_size, s)
    summary = state.summary()
    assert [b.index for b in summary.buckets] == list(range(len(summary.buckets))) and len(summary.buckets) > 1
    assert sum(b.elements for b in summary.buckets) == sum(p.numel() for p in ddp.parameters())
    for b in summary.buckets:
        assert b.bucket_bytes == 4 * b.elements and b.dtype == "float32"
        assert b.wire_format == "bfloat16" and b.algorithm == "gloo"
        assert b.wire_bytes == {"bfloat16": 2 * b.elements}  # one all-reduce per pass, handed the bf16 copy
        total = b.wire_bytes_total["bfloat16"]
        assert total == b.collectives * 2 * b.elements and b.collectives >= 2  # the passes since DDP's rebuild
        assert b.pack_ms is None and b.comm_ms is None and b.unpack_ms is None
    assert summary.wire_bytes_per_step * 2 == summary.fp32_bytes_per_step
    assert summary.clock is None and summary.passes == 3 and summary.world_size == world_size
    table = str(summary)
    assert table.splitlines()[0].split()[:2] == ["bucket", "dtype"] and "pack ms" not in table
    assert "0.50x float32" in summary.headline() and "algorithm per bucket: gloo, gloo" in summary.headline()
    _profiler_ranges(rank, world_size, ddp, state)

    # float32 on the wire (in place) and a mixed float32/bfloat16 model: per dtype, what was actually sent
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    state = ddp_triton.register(ddp, comm_dtype=torch.float32, profile=None)
    step(ddp, rank, world_size, 0)
    assert all(b.wire_bytes == {"float32": 4 * b.elements} for b in state.summary().buckets)
    assert "1.00x float32" in state.summary().headline()
    model = TwoDtypes()
    ddp = DDP(model)
    state = ddp_triton.register(ddp, profile=None, timing=True)
    x, y = make_data(0)
    nn.functional.mse_loss(ddp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    summary = state.summary()
    assert {b.dtype for b in summary.buckets} == {"float32", "bfloat16"}
    assert all(b.wire_bytes == {"bfloat16": 2 * b.elements} for b in summary.buckets)
    # timing on CPU tensors: the host's clock, labelled as such
    assert summary.clock == telemetry.HOST_CLOCK
    for b in summary.buckets:
        assert all(t is not None and t >= 0 for t in (b.pack_ms, b.comm_ms, b.unpack_ms)), b
    table = str(summary)
    assert "pack ms" in table and "host perf_counter" in table


def test_summary_and_profiler_ranges_under_ddp():
    torch_path_workers(_summary_contents, 2)


# ---- no device, in this process --------------------------------------------------------------------------------------


def test_record_counts_per_pass_and_per_format():
    # a format with a second tensor (scales, say) in each pass of two collectives
    record = BucketRecord(3, "fp8", {"bfloat16": 100, "float32": 8}, collectives_per_pass=2)
    assert record.sent_bytes == {"bfloat16": 0, "float32": 0} and record.collectives == 0
    record.passes += 2
    assert record.pass_bytes == {"bfloat16": 100, "float32": 8}
    assert record.sent_bytes == {"bfloat16": 200, "float32": 16} and record.collectives == 4


def test_no_watch_without_profiler_or_timing():
    comm = SimpleNamespace(record=BucketRecord(0), buffer=torch.zeros(4))
    assert not telemetry.profiler_active()
    assert telemetry.watch(False, comm) is None
    watched = telemetry.watch(True, comm)
    assert watched is not None and watched.timing  # (under a profiler: test_summary_and_profiler_ranges)


def test_table_and_headline():
    rows = [BucketSummary(index=i, dtype="float32", elements=1 << 20, bucket_bytes=4 << 20, wire_format="bfloat16",
                          algorithm=algo, wire_bytes={"bfloat16": 2 << 20}, wire_bytes_total={}, collectives=1,
                          pack_ms=0.1, comm_ms=1.5, unpack_ms=0.2)
            for i, algo in enumerate(("ring", "tree"))]
    summary = Summary(buckets=rows, passes=7, world_size=8, backend="nccl", clock=telemetry.CUDA_EVENTS)
    lines = str(summary).splitlines()
    assert lines[0].split()[:2] == ["bucket", "dtype"] and len(lines) == 5  # header, 2 rows, headline, clock
    assert "4 MiB" in lines[1] and "2 MiB bfloat16" in lines[1] and "1.500" in lines[1]
    assert summary.headline() == ("ddp_triton: 2 buckets, 4 MiB on the wire per step (0.50x float32's 8 MiB), "
                                  "algorithm per bucket: ring, tree")
    assert "no backward pass" in Summary([], 0, None, None, None).headline()


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (6553600, "6.25 MiB"),
                                     (3 << 30, "3 GiB")])
def test_human_bytes(n, text):
    assert telemetry.human_bytes(n) == text
