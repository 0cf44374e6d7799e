"""Making profiles: from the model, the plans and candidates of measuring, NCCL tuner CSV.

Tier: no device, no process group (model profile, CSV, candidates). Measuring on gloo ranks is tested in
tests/dist/tune/test_autotune_gloo.py; measuring on NCCL needs GPUs (``ddp-triton autotune`` on a GPU machine).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import nvml_fakes
from factories import tiny_factory
from ddp_triton.tune import autotune
from ddp_triton.machine import cost_model as cm
from ddp_triton.machine.profile import (TUNER_CSV_HEADER, TUNER_MAX_BYTES, fallback_profile, model_profile,
                                       nccl_tuner_csv_text)
from ddp_triton.machine.topology import apply_launch_env, from_nvml, load_topology
from ddp_triton.tune.autotune import default_algorithms
from ddp_triton.tune.step_timing import e2e_bucket_candidates, load_factory
from ddp_triton.tune.sweep import format_rows


# ---------------------------------------------------------------------------------------------------------------------
# No device
# ---------------------------------------------------------------------------------------------------------------------


def test_model_profile_dgx_h100_four_nodes():
    topo = apply_launch_env(load_topology("dgx-h100"), nodes=4, env={})
    p = model_profile(topo)
    assert (p.source, p.backend, p.world_size, p.nodes, p.comm_dtype) == ("model", "model", 32, 4, "bfloat16")
    sizes = sorted({r.nbytes for r in p.sweep})
    assert sizes == cm.default_sizes()
    assert {r.algorithm for r in p.sweep} == {"ring", "tree", "nvls_tree"}
    assert p.algorithm_for(1024) == "tree"  # latency-bound across 4 nodes
    assert p.algorithm_for(64 << 20) == "nvls_tree"
    # From about 1 GiB both run at the NICs; the ring's windows cost less than NVLSTree's 64 KiB chunks' proxy posts.
    assert p.algorithm_for(1 << 30) == "ring"
    assert p.bucket_cap_mb > 0 and "90%" in p.bucket_reason
    assert all(t.protocol is not None for t in p.table)
    assert p.versions["torch"] == torch.__version__.split("+")[0] or p.versions["torch"].startswith(
        torch.__version__.split("+")[0])


def test_model_profile_bucket_bounded_by_model_size():
    topo = load_topology("dgx-h100")
    unbounded = model_profile(topo)
    bounded = model_profile(topo, model_bytes=64 << 20, min_buckets=4)
    assert bounded.bucket_cap_mb == 16.0 < unbounded.bucket_cap_mb
    assert "4 buckets" in bounded.bucket_reason


def test_model_profile_bucket_capped_without_model_size():
    # Bandwidth alone would pick a bucket of hundreds of MiB on 4 nodes; unknown model size caps it at 64 MiB.
    p = model_profile(apply_launch_env(load_topology("dgx-h100"), nodes=4, env={}))
    assert p.bucket_cap_mb <= 64.0 and "model size unknown" in p.bucket_reason


def test_measure_mode_calibrates_the_model():
    # What measure_profile does with its rows (calibrate_measured): rows as run_sweep returns them, made here by the
    # model with known factors on one DGX H100, in bfloat16 beside float32 rows of other times that must be ignored.
    topo = load_topology("dgx-h100")
    truth = cm.Fabric.from_topology(topo, cm.Calibration(algorithms={"ring": cm.AlgorithmCalibration(1.4, 0.8),
                                                                     "nvls": cm.AlgorithmCalibration(0.7, 1.1)}))
    rows = [dict(cm.estimate(truth, n, a).row("bfloat16")) for n in cm.default_sizes(1 << 10, 1 << 28)
            for a in ("ring", "nvls")]
    rows += [dict(r, dtype="float32", time_us=r["time_us"] * 3) for r in rows]
    cal, note = autotune.calibrate_measured(topo, rows, "bfloat16", "nccl")
    # 2e-3: the rows' times are rounded to 1e-4 us (Estimate.row), a relative 1e-5 at 1 KiB.
    assert cal.for_algorithm("ring").latency_scale == pytest.approx(1.4, rel=2e-3)
    assert cal.for_algorithm("ring").bandwidth_scale == pytest.approx(0.8, rel=2e-3)
    assert cal.for_algorithm("nvls").latency_scale == pytest.approx(0.7, rel=2e-3)
    assert cal.node_fingerprint and (cal.ranks_per_node, cal.nodes, cal.arch) == (8, 1, "hopper")
    assert "calibrated to the bfloat16 sweep" in note and "ring rms log error" in note
    # Several nodes and NVML's topology (no NIC rate): the model cannot describe the measured machine.
    cal, note = autotune.calibrate_measured(_dgx_h100_nvml(2), rows, "bfloat16", "nccl")
    assert cal is None and "not calibrated" in note and "inter-node" in note


def _dgx_h100_nvml(nodes: int, world_size: Optional[int] = None):
    """The DGX H100 as NVML reads it (no NIC, so no inter-node rate), launched on ``nodes`` nodes."""
    return apply_launch_env(from_nvml(nvml_fakes.dgx_h100()), nodes=nodes, world_size=world_size, env={})


@pytest.mark.parametrize("nodes,world,version,expected", [
    pytest.param(4, None, None, ["ring", "tree", "nvls_tree"], id="4nodes-8gpus"),
    pytest.param(4, None, (2, 21, 5), ["ring", "tree", "nvls_tree"], id="4nodes-8gpus-nccl2.21"),
    pytest.param(4, None, (2, 20, 5), ["ring", "tree"], id="4nodes-nccl2.20-no-nvls-across-nodes"),
    pytest.param(4, 8, None, ["ring", "tree"], id="4nodes-2gpus"),
    pytest.param(4, 8, (2, 28, 9), ["ring", "tree", "nvls_tree"], id="4nodes-2gpus-nccl2.28.9"),
    pytest.param(1, 2, (2, 27, 7), ["ring", "tree"], id="1node-2gpus-nccl2.27"),
    pytest.param(1, 3, (2, 27, 7), ["ring", "tree", "nvls"], id="1node-3gpus-nccl2.27"),
])
def test_default_algorithms_from_nvml_without_a_nic_rate(monkeypatch, nodes, world, version, expected):
    topo = _dgx_h100_nvml(nodes, world)
    assert topo.inter_node_gbps is None
    monkeypatch.setattr(autotune, "nccl_version", lambda: version)
    assert default_algorithms(topo, "nccl", "bfloat16") == expected
    assert default_algorithms(topo, "gloo", "bfloat16") == ["ring"]


def test_measure_plan_per_dtype(monkeypatch):
    monkeypatch.setattr(autotune, "nccl_version", lambda: (2, 21, 5))
    plan = autotune._measure_plan(_dgx_h100_nvml(4), "nccl", None, None, "bf16", ["int8"], 5, 20)
    # NVLS cannot sum 8-bit types: int8 is timed without it, the comm dtype with it.
    assert plan["algorithms"] == {"int8": ["ring", "tree"], "bfloat16": ["ring", "tree", "nvls_tree"]}
    assert plan["dtypes"] == ["int8", "bfloat16"] and plan["comm_dtype"] == "bfloat16"
    assert plan["sizes"] == cm.default_sizes() and (plan["warmup"], plan["iters"]) == (5, 20)
    bad = autotune._measure_plan(None, "gloo", [1024], ["ring", "tree"], "float32", None, 1, 1)
    assert "one all-reduce algorithm" in bad["error"]


def test_nccl_tuner_csv_text():
    topo = apply_launch_env(load_topology("dgx-h100"), nodes=2, env={})
    p = model_profile(topo)
    lines = nccl_tuner_csv_text(p).splitlines()
    assert lines[1] == "# " + TUNER_CSV_HEADER
    rows = [ln.split(",") for ln in lines if not ln.startswith("#")]
    assert len(rows) == len(p.table)
    for r, t in zip(rows, p.table):
        assert r[0] == "allreduce" and int(r[1]) == t.min_bytes
        assert int(r[2]) == (TUNER_MAX_BYTES if t.max_bytes is None else t.max_bytes)
        assert r[3] == t.algorithm and r[4] == t.protocol.lower() and r[4] in ("ll", "ll128", "simple")
        assert r[5:] == ["-1", "2", "16"]
    # Ranges must tile all sizes, as NCCL's plugin matches min <= size <= max.
    assert int(rows[0][1]) == 0 and all(int(a[2]) + 1 == int(b[1]) for a, b in zip(rows, rows[1:]))


def test_tuner_csv_needs_protocols():
    p = fallback_profile(2, 1, "bfloat16", "gloo")
    with pytest.raises(ValueError, match="protocol"):
        nccl_tuner_csv_text(p)


def test_e2e_bucket_candidates():
    assert e2e_bucket_candidates(64.0, 1 << 30) == [25.0, 32.0, 64.0, 128.0]
    assert e2e_bucket_candidates(10.0, 8 << 20) == [5.0, 8.0]  # none above the 8 MiB model


def test_load_factory_errors():
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        load_factory("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_factory("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no function"):
        load_factory("factories:missing")
    assert load_factory("factories:tiny_factory") is tiny_factory


def test_format_rows_nccl_tests_columns():
    rows = [{"bytes": 4096, "algorithm": "ring", "time_us": 10.0, "algbw_gbps": 0.41, "busbw_gbps": 0.41,
             "dtype": "bfloat16"}]
    out = format_rows(rows, 2)
    assert "size" in out and "count" in out and "busbw" in out
    assert "2048" in out  # 4096 bytes of bf16 = 2048 elements
