"""The ``ddp-triton`` command line: every subcommand in a subprocess, bad usage and bad input in process.

Tiers: no device (topo, autotune --model-only, profile show, env, bad input) and gloo multi-process (autotune's
measure mode at world size 2 with a short sweep; e2e mode at world size 1). Subprocesses get a private
XDG_CACHE_HOME so the cache they write is the test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_triton.cli import main, parse_size
from ddp_triton.profile import Profile, cache_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    e = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
        monkeypatch.delenv(k, raising=False)
    return e


def cli(env, *args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ddp_triton.cli", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess: every subcommand
# ---------------------------------------------------------------------------------------------------------------------


def test_topo(env, capsys):
    r = cli(env, "topo", "--topology", "dgx-h100")
    assert r.returncode == 0, r.stderr
    assert "GPU0" in r.stdout and "NV18" in r.stdout and "fingerprint" in r.stdout
    # No argument: NVML on a GPU machine; here (no NVML) a message and the presets, still exit 0.
    r = cli(env, "topo")
    assert r.returncode == 0, r.stderr
    if "GPU0" not in r.stdout:
        assert "presets" in r.stdout and "no GPU topology" in r.stderr
    assert main(["topo", "--topology", "dgx-a100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "dgx-a100"
    assert main(["topo", "--topology", "no-such-machine"]) == 2
    err = capsys.readouterr().err
    assert "no-such-machine" in err and "dgx-h100" in err


def test_autotune_model_only(env, tmp_path, capsys):
    out, csv = tmp_path / "p.json", tmp_path / "t.csv"
    r = cli(env, "autotune", "--model-only", "--topology", "dgx-h100", "--nodes", "4", "--out", str(out),
            "--nccl-tuner-csv", str(csv))
    assert r.returncode == 0, r.stderr
    assert "nvls_tree" in r.stdout and "bucket_cap_mb" in r.stdout
    p = Profile.load(out)
    assert (p.source, p.world_size, p.nodes) == ("model", 32, 4)
    assert cache_path(p.topology_fingerprint, 32, 4, "bfloat16").exists()  # the hook finds it here
    assert csv.read_text().count("allreduce,") == len(p.table)
    # --json: the profile, and nothing else, on stdout.
    assert main(["autotune", "--model-only", "--topology", "dgx-a100", "--nodes", "2", "--json", "--no-cache"]) == 0
    assert Profile.from_dict(json.loads(capsys.readouterr().out)).world_size == 16


def test_profile_show(env, tmp_path, capsys):
    good = tmp_path / "p.json"
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--out", str(good), "--no-cache",
                 "--json"]) == 0
    r = cli(env, "profile", "show", str(good))
    assert r.returncode == 0, r.stderr
    assert "digest" in r.stdout and "nvls" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "source": "model"')
    capsys.readouterr()
    assert main(["profile", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not valid JSON" in err
    assert main(["profile", "show", str(good), "--json"]) == 0
    assert Profile.from_dict(json.loads(capsys.readouterr().out)).digest() == Profile.load(good).digest()


@pytest.mark.parametrize("field,value", [
    pytest.param("e2e", [1], id="e2e-list"),
    pytest.param("notes", "abc", id="notes-string"),
])
def test_profile_show_rejects_malformed_e2e_and_notes(env, tmp_path, capsys, field, value):
    good = tmp_path / "p.json"
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--out", str(good), "--no-cache"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(json.loads(good.read_text()), **{field: value})))
    capsys.readouterr()
    assert main(["profile", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and field in err
    r = cli(env, "profile", "show", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr and field in r.stderr


def test_env(env, capsys):
    r = cli(env, "env")
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "NVML answers" in r.stdout and torch.__version__ in r.stdout
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["torch"] == torch.__version__


def test_output_into_a_closed_pipe_ends_quietly(env):
    # `ddp-triton env | head -1`, with the reader already gone: no traceback, the exit status a shell expects.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "ddp_triton.cli", "env"], env=env, cwd=REPO, stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


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


# ---------------------------------------------------------------------------------------------------------------------
# In process: bad usage and bad input exit 2 with a message
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,says", [
    pytest.param([], "required", id="no-command"),
    pytest.param(["frobnicate"], "invalid choice", id="unknown-command"),
    pytest.param(["autotune", "--model-only", "--nodes", "0", "--topology", "dgx-h100"], "must be >= 1", id="nodes-0"),
    pytest.param(["autotune", "--model-only", "--topology", "pcie-gen4-4gpu", "--nodes", "2"], "--inter-node-gbps",
                 id="no-inter-node-rate"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--min-bytes", "2G", "--max-bytes", "1K"],
                 "above", id="sizes-reversed"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--min-bytes", "1.5"], "whole number",
                 id="size-fraction"),
    pytest.param(["autotune", "--model-only", "--e2e", "m:f", "--topology", "dgx-h100"], "exclude", id="two-modes"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--comm-dtype", "complex64"], "complex64",
                 id="bad-dtype"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--fraction", "1.5"], "(0, 1]",
                 id="bad-fraction"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--world-size", "12"], "world size 12",
                 id="world-size-not-fitting"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--algorithms", "ring,warp"], "warp",
                 id="bad-algorithm"),
    pytest.param(["autotune", "--backend", "gloo", "--hooks", "allreduce,powersgd"], "powersgd", id="bad-hook"),
    pytest.param(["autotune", "--backend", "gloo", "--algorithms", "ring,tree"], "one all-reduce algorithm",
                 id="gloo-has-one-algorithm"),
    pytest.param(["profile", "show", "/nonexistent/p.json"], "/nonexistent/p.json", id="missing-profile"),
    pytest.param(["profile"], "required", id="profile-without-action"),
    pytest.param(["autotune", "--backend", "gloo", "--nproc", "1", "--e2e", "nocolon"], "MODULE:FUNCTION",
                 id="e2e-bad-spec"),
])
def test_bad_usage_exits_2(argv, says, capsys, env):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert says in capsys.readouterr().err


@pytest.fixture
def no_measuring(monkeypatch):
    """Measuring (spawned or in place) fails the test: usage must be checked before it starts."""
    from ddp_triton import measure

    def refuse(*args, **kwargs):
        raise AssertionError("started measuring before checking usage")

    monkeypatch.setattr(measure, "spawn_local", refuse)
    monkeypatch.setattr(measure, "init_in_place", refuse)


@pytest.mark.parametrize("argv,says", [
    pytest.param(["--nproc", "2", "--topology", "dgx-h100", "--nccl-tuner-csv", "t.csv"], "backend gloo",
                 id="tuner-csv-from-gloo"),
    pytest.param(["--nproc", "1", "--e2e", "test_autotune:tiny_factory", "--nccl-tuner-csv", "t.csv"],
                 "protocol per range", id="tuner-csv-e2e-without-topology"),
    pytest.param(["--nproc", "1", "--comm-dtype", "int8"], "--comm-dtype int8", id="comm-dtype-int8"),
    pytest.param(["--nproc", "2", "--comm-dtype", "float8_e4m3fn"], "bfloat16, float16, float32",
                 id="comm-dtype-float8"),
    pytest.param(["--nproc", "1", "--comm-dtype", "float32", "--min-bytes", "1", "--max-bytes", "2"],
                 "less than one float32", id="sizes-below-one-element"),
])
def test_usage_is_checked_before_measuring(argv, says, no_measuring, capsys, env, monkeypatch):
    from ddp_triton import topology

    def no_nvml(nvml=None):
        raise topology.TopologyError("NVML unavailable (test)")

    monkeypatch.setattr(topology, "from_nvml", no_nvml)  # a GPU machine's NVML would give the model a topology
    assert main(["autotune", "--backend", "gloo", *argv]) == 2
    assert says in capsys.readouterr().err


def test_comm_dtype_int8_rejected_in_model_only(capsys, env):
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--comm-dtype", "int8", "--no-cache"]) == 2
    assert "--comm-dtype int8" in capsys.readouterr().err


def test_cli_comm_dtypes_are_the_hooks():
    from ddp_triton.cli import HOOK_COMM_DTYPES
    from ddp_triton.state import COMM_DTYPES

    assert list(HOOK_COMM_DTYPES) == [str(d).replace("torch.", "") for d in COMM_DTYPES]


def test_value_error_while_measuring_exits_1(monkeypatch, capsys, env):
    from ddp_triton import autotune, measure

    def fail(config):
        raise ValueError("went wrong while measuring")

    monkeypatch.setattr(measure, "init_in_place", lambda backend: False)
    monkeypatch.setattr(autotune, "measure_worker", fail)
    assert main(["autotune", "--backend", "gloo", "--nproc", "1", "--max-bytes", "4K", "--no-cache"]) == 1
    assert "autotune failed: ValueError: went wrong while measuring" in capsys.readouterr().err


def test_measure_without_gpu_says_what_to_do(capsys, env):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: measuring is the default")
    assert main(["autotune"]) == 2
    err = capsys.readouterr().err
    assert "--model-only" in err and "--backend gloo" in err


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("64K", 65536), ("1MiB", 1 << 20), ("1g", 1 << 30),
                                           ("2KB", 2048)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected
