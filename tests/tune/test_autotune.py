"""Making profiles: from the model, by timing all-reduces, by timing DDP steps; NCCL tuner CSV; bench smoke run.

Tiers: no device (model profile, CSV, candidates) and gloo multi-process at world size 2 (measured sweep and e2e
steps on CPU, short and tiny). Measuring on NCCL needs GPUs (``ddp-triton autotune`` on a GPU machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import nvml_fakes
from dist_utils import run_workers
from factories import tiny_factory
from ddp_triton.tune import autotune
from ddp_triton.machine import cost_model as cm
from ddp_triton.machine.profile import Profile, TableEntry, cache_path, fallback_profile, model_profile
from ddp_triton.machine.topology import apply_launch_env, from_nvml, load_topology
from ddp_triton.tune.autotune import (TUNER_CSV_HEADER, TUNER_MAX_BYTES, default_algorithms, e2e_profile,
                                      measure_profile, nccl_tuner_csv_text, share_profile)
from ddp_triton.tune.step_timing import e2e_bucket_candidates, load_factory
from ddp_triton.tune.sweep import format_rows

REPO = Path(__file__).resolve().parents[2]


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


# ---------------------------------------------------------------------------------------------------------------------
# gloo, two ranks
# ---------------------------------------------------------------------------------------------------------------------


def _measure_and_e2e(rank: int, world: int, out_dir: str) -> None:
    sizes = [1024, 4096, 16384]
    p = measure_profile(sizes=sizes, comm_dtype="float32", dtypes=["float32", "bfloat16"], warmup=1, iters=3,
                        progress=False)
    assert (p.source, p.backend, p.world_size, p.nodes) == ("measured", "gloo", 2, 1)
    assert sorted((r.dtype, r.nbytes) for r in p.sweep) == sorted((d, s) for d in ("float32", "bfloat16")
                                                                  for s in sizes)
    assert all(r.algorithm == "ring" and r.time_us > 0 for r in p.sweep)
    assert all(r.busbw_gbps == pytest.approx(r.algbw_gbps, rel=1e-12) for r in p.sweep)  # 2(n-1)/n = 1 at n = 2
    assert any("one all-reduce algorithm" in n for n in p.notes)
    assert p.table == [TableEntry(0, None, "ring", None)]
    # No topology: nothing to calibrate the model to, and the profile says so.
    assert p.calibration is None and any("not calibrated: no topology" in n for n in p.notes)

    e = e2e_profile("factories:tiny_factory", p, bucket_mbs=[0.001, 1.0], hooks=["allreduce", "bf16_compress"],
                    warmup=1, steps=2)
    assert e.source == "e2e" and e.table == p.table
    cands = e.e2e["candidates"]
    timed = [c for c in cands if "step_ms" in c]
    assert [(c["hook"], c["bucket_cap_mb"]) for c in timed][:2] == [("allreduce", 0.001), ("allreduce", 1.0)]
    assert all(c["step_ms"] > 0 for c in timed)
    # torch's bf16 hook refuses CPU at registration: recorded as skipped, not a failure.
    bf16 = [c for c in cands if c["hook"] == "bf16_compress"]
    assert all("step_ms" in c for c in bf16) or (len(bf16) == 1 and "CUDA" in bf16[0]["error"])
    assert e.bucket_cap_mb == e.e2e["winner"]["bucket_cap_mb"]
    assert e.e2e["model_bytes"] == (32 * 64 + 64 + 64 * 8 + 8) * 4
    if rank == 0:
        p.save(os.path.join(out_dir, "measured.json"))
        e.save(os.path.join(out_dir, "e2e.json"))


def test_measure_and_e2e_on_gloo(tmp_path):
    run_workers(_measure_and_e2e, 2, str(tmp_path), timeout=90)
    # Both files load back, and rank 0 wrote what every rank agreed on.
    assert Profile.load(tmp_path / "measured.json").source == "measured"
    assert Profile.load(tmp_path / "e2e.json").e2e["winner"]["hook"] in ("allreduce", "bf16_compress")


def _ranks_disagree(rank: int, world: int) -> None:
    # Each rank is given other sizes, dtypes, comm dtype, warm-up and iterations: all follow rank 0.
    if rank == 0:
        kw = {"sizes": [1024, 4096], "comm_dtype": "float32", "dtypes": ["float32"], "warmup": 1, "iters": 3}
    else:
        kw = {"sizes": [2048, 8192, 16384], "comm_dtype": "bfloat16", "dtypes": ["bfloat16", "float16"],
              "warmup": 0, "iters": 2}
    p = measure_profile(progress=False, **kw)
    assert p.comm_dtype == "float32"
    assert sorted((r.dtype, r.nbytes) for r in p.sweep) == [("float32", 1024), ("float32", 4096)]
    assert any("1 warm-up + 3 timed" in n for n in p.notes)
    # A plan rank 0 cannot make fails on every rank, instead of rank 0 leaving the others waiting.
    with pytest.raises(ValueError, match="one all-reduce algorithm"):
        measure_profile(sizes=[1024], algorithms=["ring", "tree"] if rank == 0 else ["ring"], progress=False)
    # e2e: rank 0's base profile and candidates (a base read from each node's own cache may differ).
    base = fallback_profile(2, 1, "float32", "gloo")
    if rank != 0:
        base = Profile.from_dict(dict(base.to_dict(), bucket_cap_mb=99.0, notes=["rank 1's own base"]))
    e = e2e_profile("factories:tiny_factory", base, bucket_mbs=[0.001] if rank == 0 else [1.0, 2.0],
                    hooks=["allreduce"], warmup=1 if rank == 0 else 0, steps=2 if rank == 0 else 3)
    assert [(c["hook"], c["bucket_cap_mb"]) for c in e.e2e["candidates"]] == [("allreduce", 0.001)]
    assert (e.e2e["warmup"], e.e2e["steps"]) == (1, 2)
    assert "rank 1's own base" not in e.notes and e.created


def test_ranks_measure_rank_0s_plan():
    run_workers(_ranks_disagree, 2, timeout=90)


def _share(rank: int, world: int, root: str) -> None:
    topo = apply_launch_env(load_topology("dgx-h100"), nodes=2, env={})
    prof = model_profile(topo)
    mine = prof.to_dict() if rank == 0 else dict(prof.to_dict(), bucket_cap_mb=1.0)  # rank 1's differs

    def cache_of(node: str) -> str:
        os.environ["XDG_CACHE_HOME"] = os.path.join(root, node)
        return str(cache_path(prof.topology_fingerprint, prof.world_size, prof.nodes, prof.comm_dtype))

    # Two nodes, one rank each: both first on their node (LOCAL_RANK 0), each with its own cache directory.
    os.environ["LOCAL_RANK"] = "0"
    expected = cache_of(f"node{rank}")
    shared, path = share_profile(mine)
    assert shared["bucket_cap_mb"] == prof.bucket_cap_mb  # rank 0's, on rank 1 too
    if rank == 0:
        assert path is None and not os.path.exists(expected)  # rank 0 caches it with the rest of its output
    else:
        assert str(path) == expected
        cached = Profile.load(path)
        assert cached.to_dict() == shared and cached.bucket_cap_mb == prof.bucket_cap_mb != 1.0
    # Not first on its node, or --no-cache: rank 0's profile all the same, nothing written.
    os.environ["LOCAL_RANK"] = "1"
    elsewhere = cache_of(f"second-process-{rank}")
    again, path = share_profile(mine)
    assert again == shared and path is None and not os.path.exists(elsewhere)
    os.environ["LOCAL_RANK"] = "0"
    elsewhere = cache_of(f"no-cache-{rank}")
    again, path = share_profile(mine, cache=False)
    assert again == shared and path is None and not os.path.exists(elsewhere)


def test_share_profile_caches_rank_0s_profile_on_every_node(tmp_path):
    run_workers(_share, 2, str(tmp_path), timeout=60)
    assert os.path.exists(tmp_path / "node1") and not os.path.exists(tmp_path / "node0")


def test_bench_allreduce_smoke(tmp_path):
    out = tmp_path / "bench.json"
    # World size 1 runs in place (the spawn path is autotune's, tested in test_cli); busbw is 0 there.
    r = subprocess.run([sys.executable, "-m", "bench.allreduce", "--backend", "gloo", "--nproc", "1", "-b", "1K",
                        "-e", "4K", "--iters", "2", "--warmup", "1", "--dtypes", "float32", "--topology",
                        "dgx-h100", "--json", str(out), "--plot", str(tmp_path / "bench.png")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "busbw" in r.stdout and "algbw" in r.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 1 and len(data["rows"]) == 3
    assert all("model_busbw_gbps" in row for row in data["rows"])
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "bench.png").exists()
    except ImportError:
        assert "matplotlib" in r.stdout + r.stderr


def _join_talk_leave(rank: int, world: int, root: str, rounds: int) -> None:
    """Join a gloo group, exchange objects, leave; again and again, as the CLI and spawned workers do."""
    import torch.distributed as dist

    from ddp_triton.tune.processes import leave_process_group

    for i in range(rounds):
        store = dist.FileStore(os.path.join(root, f"store-{i}"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        objects = [{"round": i}] if rank == 0 else [None]
        dist.broadcast_object_list(objects, src=0)
        assert objects == [{"round": i}]
        leave_process_group()
        assert not dist.is_initialized()


def test_leave_process_group_after_object_collectives_never_hangs(tmp_path):
    # torch 2.4 deadlocked here in about one round in five without leave_process_group's settle time.
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_join_talk_leave, args=(2, str(tmp_path), 10), nprocs=2, join=False,
                             start_method="spawn")
    try:
        deadline = 90
        while not ctx.join(timeout=1):
            deadline -= 1
            assert deadline > 0, "a rank hung leaving its process group"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
