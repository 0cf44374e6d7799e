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

import pytest
import torch

from dist_utils import run_workers
from ddp_triton import cost_model as cm
from ddp_triton.autotune import (TUNER_CSV_HEADER, TUNER_MAX_BYTES, e2e_profile, fallback_profile, measure_profile,
                                 model_profile, write_nccl_tuner_csv)
from ddp_triton.measure import e2e_bucket_candidates, format_rows, load_factory
from ddp_triton.profile import Profile, TableEntry
from ddp_triton.topology import apply_launch_env, load_topology

REPO = Path(__file__).resolve().parents[1]


def tiny_factory():
    """e2e contract: () -> (model, loss_fn(model) -> scalar loss)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def loss_fn(m):
        device = next(m.parameters()).device
        x = torch.randn(16, 32, device=device)
        return m(x).square().mean()

    return model, loss_fn


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
    assert p.algorithm_for(1 << 30) == "nvls_tree"
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


def test_write_nccl_tuner_csv(tmp_path):
    topo = apply_launch_env(load_topology("dgx-h100"), nodes=2, env={})
    p = model_profile(topo)
    path = write_nccl_tuner_csv(p, tmp_path / "sub" / "tuner.csv")
    lines = path.read_text().splitlines()
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


def test_tuner_csv_needs_protocols(tmp_path):
    p = fallback_profile(2, 1, "bfloat16", "gloo")
    with pytest.raises(ValueError, match="protocol"):
        write_nccl_tuner_csv(p, tmp_path / "x.csv")


def test_e2e_bucket_candidates():
    assert e2e_bucket_candidates(64.0, 1 << 30) == [25.0, 32.0, 64.0, 128.0]
    assert e2e_bucket_candidates(10.0, 8 << 20) == [5.0, 8.0]  # none above the 8 MiB model


def test_load_factory_errors():
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        load_factory("nocolon")
    with pytest.raises(ValueError, match="cannot import"):
        load_factory("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no function"):
        load_factory("test_autotune:missing")
    assert load_factory("test_autotune:tiny_factory") is tiny_factory


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

    e = e2e_profile("test_autotune:tiny_factory", p, bucket_mbs=[0.001, 1.0], hooks=["allreduce", "bf16_compress"],
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
