"""Calibration: the cost model's per-algorithm factors fitted to a sweep (least squares on log-time), recovered from
synthetic sweeps made with known factors, applied to more nodes than were measured, fitted to a published sweep, and
stored and validated as data.

Tier: no device (pure Python).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from ddp_triton.machine import cost_model as cm
from ddp_triton.machine.topology import apply_launch_env, load_topology

SIZES = cm.default_sizes(1 << 10, 1 << 30)
DATA = Path(__file__).resolve().parents[3] / "bench" / "published" / "nccl_tests_allreduce.json"


def fabric(preset: str, nodes: int = 1, inter: float = None) -> cm.Fabric:
    return cm.Fabric.from_topology(apply_launch_env(load_topology(preset), nodes=nodes, inter_node_gbps=inter, env={}))


def calibrated(f: cm.Fabric, **factors) -> cm.Fabric:
    algs = {alg: cm.AlgorithmCalibration(lat, bw) for alg, (lat, bw) in factors.items()}
    return dataclasses.replace(f, calibration=cm.Calibration(algorithms=algs))


def synthetic_sweep(truth: cm.Fabric, algorithm: str, noise: float = 0.0, seed: int = 0):
    """(bytes, time_us) from the model with the true factors, times exp(N(0, noise)) (a fixed seed)."""
    rng = random.Random(seed)
    return [(n, cm.estimate(truth, n, algorithm).time_us * math.exp(rng.gauss(0.0, noise))) for n in SIZES]


CASES = [
    pytest.param("dgx-h100", 1, "ring", (1.7, 0.8), id="h100-ring"),
    pytest.param("dgx-h100", 1, "nvls", (0.6, 1.25), id="h100-nvls"),
    pytest.param("dgx-h100", 1, "tree", (2.5, 0.5), id="h100-tree"),
    pytest.param("dgx-a100", 1, "ring", (1.3, 0.9), id="a100-ring"),
    pytest.param("pcie-gen4-4gpu", 1, "ring", (0.8, 0.6), id="pcie-ring"),
    pytest.param("dgx-h100", 2, "nvls_tree", (1.4, 0.7), id="h100-2nodes-nvls-tree"),
]


@pytest.mark.parametrize("preset,nodes,alg,factors", CASES)
def test_fit_recovers_known_factors_from_an_exact_sweep(preset, nodes, alg, factors):
    f = fabric(preset, nodes)
    fit = cm.fit_algorithm(f, alg, synthetic_sweep(calibrated(f, **{alg: factors}), alg))
    # 1e-4: the fit stops when a step moves the log-factors by less than 1e-10; what is left is the numerical
    # Jacobian's rounding, far below this.
    assert fit.latency_scale == pytest.approx(factors[0], rel=1e-4)
    assert fit.bandwidth_scale == pytest.approx(factors[1], rel=1e-4)
    assert fit.rms_log_error < 1e-6 and fit.points == len(SIZES)


@pytest.mark.parametrize("preset,nodes,alg,factors", CASES)
def test_fit_recovers_known_factors_through_3_percent_noise(preset, nodes, alg, factors):
    f = fabric(preset, nodes)
    truth = calibrated(f, **{alg: factors})
    for seed in range(3):
        fit = cm.fit_algorithm(f, alg, synthetic_sweep(truth, alg, noise=0.03, seed=seed))
        # 3% log-normal noise on each of 21 sizes: each factor is set by the half of the sweep its term dominates
        # (about 10 points), a standard error of about 0.03 / sqrt(10) = 1%; 6% is several of those.
        assert fit.latency_scale == pytest.approx(factors[0], rel=0.06), seed
        assert fit.bandwidth_scale == pytest.approx(factors[1], rel=0.06), seed
        # The residual is the noise: rms about 0.03.
        assert 0.015 < fit.rms_log_error < 0.045


def test_one_node_calibration_predicts_k_nodes():
    # The workflow: measure one node, predict K nodes from that plus the inter-node link. A machine whose
    # intra-node terms differ from the model's by known factors is measured on one node; the factors fitted there,
    # applied to 4 nodes, give the truth's 4-node times: the inter-node terms are the model's on both sides.
    one = fabric("dgx-h100", 1)
    truth_factors = {"ring": (1.5, 0.85), "tree": (1.2, 0.9), "nvls": (1.8, 0.95)}
    truth_one = calibrated(one, **truth_factors)
    rows = [{"bytes": n, "algorithm": a, "time_us": t} for a in truth_factors
            for n, t in synthetic_sweep(truth_one, a)]
    cal = cm.fit_calibration(one, rows, node_fingerprint="node")
    assert set(cal.algorithms) == {"ring", "tree", "nvls"} and cal.ranks_per_node == 8 and cal.nodes == 1
    four = fabric("dgx-h100", 4)
    predicted = dataclasses.replace(four, calibration=cal)
    truth_four = calibrated(four, **truth_factors)
    for alg in ("ring", "tree", "nvls_tree"):  # nvls_tree borrows nvls's factors: NVLS inside each node
        for n in (1 << 20, 64 << 20, 1 << 30):
            # 1e-3: the factors are recovered to 1e-4; a time is a sum of terms each scaled by one of them.
            assert cm.estimate(predicted, n, alg).time_us == pytest.approx(cm.estimate(truth_four, n, alg).time_us,
                                                                           rel=1e-3), (alg, n)
    # And the calibration matters there: the uncalibrated model is off by more than 5% somewhere.
    assert any(abs(cm.estimate(four, n, "ring").time_us / cm.estimate(truth_four, n, "ring").time_us - 1) > 0.05
               for n in (1 << 20, 64 << 20, 1 << 30))


def test_calibration_leaves_inter_node_terms_alone():
    # A ring across 4 nodes whose NICs (4 x 100 Gb/s, 48 GB/s as NCCL counts) are 8x slower than NVLink: halving
    # the intra-node bandwidth leaves the bandwidth term to the NICs, and scaling latency scales only the
    # intra-node hops (NCCL's ring latency: base + intra hops + inter hops, x1.4 for multi-node Simple).
    f = fabric("dgx-h100", 4, inter=50.0)
    n = 1 << 30
    slow_links = calibrated(f, ring=(1.0, 0.5))
    assert cm.protocol_time_us(slow_links, n, "ring", "Simple") == pytest.approx(
        cm.protocol_time_us(f, n, "ring", "Simple"), rel=1e-12)
    base, intra, inter = cm.nccl._latency_parts(f, "ring", 2)
    windows = cm.ring_windows(f, n, 2)
    slow_hops = calibrated(f, ring=(2.0, 1.0))
    added = (base + windows * intra) * 1.4  # the intra-node part counted twice instead of once
    assert cm.protocol_time_us(slow_hops, n, "ring", "Simple") - cm.protocol_time_us(f, n, "ring", "Simple") == \
        pytest.approx(added, rel=1e-9)


def test_fit_on_a_published_sweep():
    # together-nccl-tests' H100 ring-only run (NCCL 2.26.2), sizes above twice its 35 us launch floor: the model
    # with NCCL's constants already fits it, so the factors stay near 1 and the residual is small.
    system = next(s for s in json.loads(DATA.read_text())["systems"] if s["id"] == "2b")
    f = cm.Fabric(**system["fabric"])
    points = [(n, t) for n, t in system["sweep"] if t > 2 * system["host_floor_us"]]
    fit = cm.fit_algorithm(f, "ring", points)
    # 0.85-1.15 and 5%: what the uncalibrated validation shows for this run (within 3% from 16 MiB up).
    assert 0.85 < fit.latency_scale < 1.15 and 0.85 < fit.bandwidth_scale < 1.15
    assert fit.rms_log_error < 0.05


def test_fit_refuses_what_it_cannot_fit():
    f = fabric("dgx-h100")
    with pytest.raises(ValueError, match="two sizes"):
        cm.fit_algorithm(f, "ring", [(1 << 20, 10.0)])
    with pytest.raises(ValueError, match="two sizes"):
        cm.fit_algorithm(f, "ring", [(1 << 20, 10.0), (1 << 20, 11.0), (2 << 20, float("nan"))])
    with pytest.raises(ValueError, match="single node"):
        cm.fit_algorithm(f, "nvls_tree", [(1 << 20, 10.0), (2 << 20, 20.0)])
    with pytest.raises(ValueError, match="no algorithm could be calibrated"):
        cm.fit_calibration(f, [{"bytes": 1 << 20, "algorithm": "ring", "time_us": 10.0}])
    # An algorithm that cannot be fitted is left out, the others kept.
    rows = [{"bytes": n, "algorithm": "ring", "time_us": t} for n, t in synthetic_sweep(f, "ring")]
    rows.append({"bytes": 1 << 20, "algorithm": "tree", "time_us": 30.0})
    assert set(cm.fit_calibration(f, rows).algorithms) == {"ring"}


def test_calibration_round_trip_and_validation():
    cal = cm.Calibration(algorithms={"ring": cm.AlgorithmCalibration(1.5, 0.9, 0.02, 21)}, ranks_per_node=8,
                         arch="hopper", node_fingerprint="abc")
    again = cm.Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again == cal and again.for_algorithm("ring").latency_scale == 1.5
    # nvls_tree borrows nvls's factors; an algorithm without any gets 1 and 1.
    both = cm.Calibration(algorithms={"nvls": cm.AlgorithmCalibration(2.0, 0.5)})
    assert both.for_algorithm("nvls_tree") == both.algorithms["nvls"]
    assert both.for_algorithm("tree") == cm.AlgorithmCalibration()
    assert "ring" in cal.summary() and "x1.5" in cal.summary()
    for bad, says in [({"algorithms": {"collnet": {}}}, "collnet"),
                      ({"algorithms": {"ring": {"latency_scale": -1}}}, "-1"),
                      ({"algorithms": {"ring": {"bandwidth_scale": float("nan")}}}, "nan"),
                      ({"algorithms": {"ring": {"latency_scale": 1e9}}}, "1000000000"),
                      ({"algorithms": {"ring": {"scale": 1}}}, "'scale'"),
                      ({"algorithms": [], "ranks_per_node": 8}, "algorithms"),
                      ({"fabric": 1}, "'fabric'"),
                      ({"nodes": 0}, "nodes")]:
        with pytest.raises(ValueError, match=says):
            cm.Calibration.from_dict(bad)
