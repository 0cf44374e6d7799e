"""The ``ddp-triton`` modes that measure on gloo ranks: autotune's measure mode at world size 2 with a short sweep
(spawned by the CLI, or started as torchrun starts them), its format timing, and the e2e mode at world size 1.

Tier: gloo multi-process, each rank a subprocess of the CLI. Subprocesses get a private XDG_CACHE_HOME so the cache
they write is the test's (tests/cli_runner.py).
"""

from __future__ import annotations

import subprocess
import sys

from cli_runner import REPO, cli, env  # noqa: F401 (env: a fixture)
from ddp_triton.machine.profile import Profile, cache_path, significantly_faster


def test_autotune_measure_gloo_world_size_2(env, tmp_path):
    out = tmp_path / "m.json"
    r = cli(env, "autotune", "--backend", "gloo", "--nproc", "2", "--topology", "dgx-h100", "--min-bytes", "1K",
            "--max-bytes", "8K", "--iters", "2", "--warmup", "1", "--comm-dtype", "float32", "--out", str(out))
    assert r.returncode == 0, r.stderr
    p = Profile.load(out)
    assert (p.source, p.backend, p.world_size) == ("measured", "gloo", 2)
    assert sorted(r.nbytes for r in p.sweep) == [1024, 2048, 4096, 8192]
    # With a topology the profile is cached under its fingerprint, for 2 of the preset's GPUs.
    assert cache_path(p.topology_fingerprint, 2, 1, "float32").exists()
    assert "4/4" in r.stderr  # the progress bar reached the end


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_autotune_under_torchrun_caches_rank_0s_profile_on_every_node(env, tmp_path):
    """Two nodes of one rank each, as torchrun would start them, each node with its own cache directory; the second
    node is given other sizes (a different plan) and still measures, and caches, rank 0's."""
    port = str(_free_port())
    procs = []
    for rank, max_bytes in ((0, "4K"), (1, "16K")):
        e = dict(env, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=port, XDG_CACHE_HOME=str(tmp_path / f"node{rank}"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddp_triton.cli", "autotune", "--backend", "gloo", "--topology", "dgx-h100",
             "--min-bytes", "1K", "--max-bytes", max_bytes, "--iters", "2", "--warmup", "1", "--comm-dtype",
             "float32", "--no-progress"], env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "bucket_cap_mb" in outs[0][0] and outs[1][0] == ""  # rank 0 reports
    profiles = []
    for rank in (0, 1):
        found = list((tmp_path / f"node{rank}" / "ddp-triton").glob("profile-*-w2-n2-float32.json"))
        assert len(found) == 1, (rank, found)
        profiles.append(Profile.load(found[0]))
    assert profiles[0].to_dict() == profiles[1].to_dict()
    assert sorted(r.nbytes for r in profiles[1].sweep) == [1024, 2048, 4096]  # rank 0's sizes


def test_autotune_e2e_world_size_1(env, tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Linear(8, 4)\n"
        "    return m, lambda mm: mm(torch.randn(2, 8)).sum()\n")
    out = tmp_path / "e.json"
    r = cli(env, "autotune", "--e2e", "mymodel:make", "--backend", "gloo", "--steps", "2", "--warmup", "1",
            "--hooks", "allreduce", "--buckets", "1,25", "--no-cache", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    p = Profile.load(out)
    assert p.source == "e2e" and p.e2e["winner"]["hook"] == "allreduce"
    assert [c["bucket_cap_mb"] for c in p.e2e["candidates"]] == [1.0, 25.0]


def test_autotune_measure_gloo_chooses_formats(env, tmp_path):
    out = tmp_path / "m.json"
    env = dict(env, TRITON_INTERPRET="0")  # the CPU path production runs, not the kernels in the interpreter
    r = cli(env, "autotune", "--backend", "gloo", "--nproc", "2", "--min-bytes", "256K", "--max-bytes", "512K",
            "--iters", "2", "--warmup", "1", "--formats", "fp32,bf16,fp8e4m3+ef", "--no-cache", "--no-progress",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    p = Profile.load(out)
    assert p.formats.source == "measured" and p.formats.admitted == ["fp32", "bf16", "fp8e4m3+ef"]
    assert sorted((row.nbytes, row.format) for row in p.formats.rows) == sorted(
        (size, f) for size in (1 << 18, 1 << 19) for f in ("fp32", "bf16", "fp8e4m3+ef"))
    assert all(row.time_us > 0 and row.model_us is None for row in p.formats.rows)  # no topology: no model
    # Each timing is a median with its interval, from at least five rounds.
    assert all(row.interval_us[0] <= row.time_us <= row.interval_us[1] and row.samples >= 5 for row in p.formats.rows)
    # At the first size: fp32 (the most accurate), unless the chosen format beat it beyond the recorded noise.
    at_first = {row.format: row.stats for row in p.formats.rows if row.nbytes == 1 << 18}
    chosen = p.format_for(1 << 18)
    assert chosen == "fp32" or significantly_faster(at_first[chosen], at_first["fp32"])
    assert any(n.startswith("timed: rounds of one exchange per format") for n in p.formats.notes)
