"""The ``ddp-triton`` command line: every subcommand in a subprocess, bad usage and bad input in process.

Tier: no device, no process group (topo, autotune --model-only, profile show, env, bad input). The modes that
measure on gloo ranks are in tests/dist/cli/test_cli_measure.py. Subprocesses get a private XDG_CACHE_HOME so the
cache they write is the test's (tests/cli_runner.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runner import REPO, cli, env  # noqa: F401 (env: a fixture)
from ddp_triton.cli import main, parse_size
from ddp_triton.machine.profile import Profile, TableEntry, cache_path

# ---------------------------------------------------------------------------------------------------------------------
# Subprocess: every subcommand
# ---------------------------------------------------------------------------------------------------------------------


def test_the_commands_that_need_no_gpu_start_without_torch(env, tmp_path):
    # topo, profile show and the cost model's autotune answer in a fraction of a second; importing torch (and
    # Triton) would take seconds.
    profile, csv = tmp_path / "p.json", tmp_path / "t.csv"
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--out", str(profile), "--no-cache"]) == 0
    model_only = ["autotune", "--model-only", "--topology", "dgx-h100", "--nodes", "2"]
    runs = [["topo", "--topology", "dgx-h100"], ["profile", "show", str(profile)],
            [*model_only, "--nccl-tuner-csv", str(csv), "--wire-formats"],  # and the cache: the test's own
            [*model_only, "--formats", "bf16,fp8e4m3+ef", "--no-cache", "--json"]]
    code = ("import sys; from ddp_triton.cli import main\n"
            f"for argv in {runs!r}:\n"
            "    assert main(argv) == 0, argv\n"
            "    assert not {'torch', 'triton'} & set(sys.modules), (argv, {'torch', 'triton'} & set(sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


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


@pytest.mark.parametrize("preset", ["dgx-h100", "pcie-gen4-4gpu"])
def test_topo_prints_the_fingerprint_profiles_are_cached_under(env, tmp_path, preset):
    # topo --help promises the key of the cache; dgx-h100 knows its NICs' rate, which the key leaves out.
    r = cli(env, "topo", "--topology", preset)
    assert r.returncode == 0, r.stderr
    shown = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if line.startswith("fingerprint: ")]
    assert len(shown) == 1, r.stdout
    out = tmp_path / "p.json"
    r = cli(env, "autotune", "--model-only", "--topology", preset, "--out", str(out))
    assert r.returncode == 0, r.stderr
    p = Profile.load(out)
    assert p.topology_fingerprint == shown[0]
    assert f"wrote {cache_path(shown[0], p.world_size, p.nodes, p.comm_dtype)}" in r.stdout


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


def test_autotune_counts_the_host_cost_per_bucket(env, capsys):
    """The default host time per bucket picks larger buckets for a small model on one fast node; 0 turns it off."""
    picked = {}
    for host in ("0", "66"):
        assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--model-bytes", "1G", "--min-buckets",
                     "2", "--host-us-per-bucket", host, "--json", "--no-cache"]) == 0
        profile = Profile.from_dict(json.loads(capsys.readouterr().out))
        picked[host] = profile.bucket_cap_mb
        assert ("host time per bucket" in profile.bucket_reason) == (host != "0")
    assert picked["66"] > picked["0"], picked
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--model-bytes", "1G", "--min-buckets", "2",
                 "--json", "--no-cache"]) == 0
    assert Profile.from_dict(json.loads(capsys.readouterr().out)).bucket_cap_mb == picked["66"]  # the default


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


@pytest.mark.parametrize("version", [pytest.param(1, id="schema-1"), pytest.param(2, id="schema-2")])
def test_a_profile_of_an_older_schema_is_one_line_and_exit_2(env, tmp_path, version):
    good = tmp_path / "p.json"
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--out", str(good), "--no-cache"]) == 0
    # As the file was written before the schema had calibrations (1) and wire formats (2).
    dropped = ("calibration", "formats") if version == 1 else ("formats",)
    old = {k: v for k, v in json.loads(good.read_text()).items() if k not in dropped}
    path = tmp_path / f"schema{version}.json"
    path.write_text(json.dumps(dict(old, schema_version=version)))
    line = (f"ddp-triton: error: {path}: a profile of schema_version {version}; this ddp-triton reads "
            "schema_version 3 only: re-run `ddp-triton autotune` to write it again\n")
    r = cli(env, "profile", "show", str(path))
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line)
    r = cli(env, "autotune", "--model-only", "--topology", "dgx-h100", "--no-cache", "--calibration", str(path))
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line.replace("error: ", "error: --calibration ", 1))


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


# ---------------------------------------------------------------------------------------------------------------------
# In process: bad usage and bad input exit 2 with a message
def _measured_one_node(path: Path, preset: str = "dgx-h100", latency: float = 1.5, bandwidth: float = 0.8) -> Path:
    """A measured-looking one-node profile of ``preset`` whose rows the model made with known factors, calibrated
    as measure mode calibrates (``tune.autotune.calibrate_measured``)."""
    from ddp_triton.machine import cost_model as cm
    from ddp_triton.machine.profile import profile_from_rows
    from ddp_triton.machine.topology import load_topology
    from ddp_triton.tune.autotune import calibrate_measured

    topo = load_topology(preset)
    cal = cm.Calibration(algorithms={a: cm.AlgorithmCalibration(latency, bandwidth) for a in ("ring", "tree", "nvls")})
    truth = cm.Fabric.from_topology(topo, cal)
    rows = [e.row("bfloat16") for e in cm.sweep(truth, cm.default_sizes(1 << 10, 1 << 28), "bfloat16")]
    fitted, note = calibrate_measured(topo, rows, "bfloat16", "nccl")
    prof = profile_from_rows(rows, source="measured", backend="nccl", world_size=8, nodes=1,
                             comm_dtype="bfloat16", topo=topo, notes=[note], calibration=fitted)
    return prof.save(path)


def test_autotune_model_only_with_a_calibration(env, tmp_path, capsys):
    # One node measured (here: made by the model with intra-node latency x1.5, bandwidth x0.8), four predicted.
    measured = _measured_one_node(tmp_path / "measured.json")
    argv = ["autotune", "--model-only", "--topology", "dgx-h100", "--nodes", "4", "--json", "--no-cache"]
    assert main(argv + ["--calibration", str(measured)]) == 0
    cal = Profile.from_dict(json.loads(capsys.readouterr().out))
    assert main(argv) == 0
    plain = Profile.from_dict(json.loads(capsys.readouterr().out))
    assert cal.calibration is not None and plain.calibration is None
    assert cal.calibration.for_algorithm("ring").latency_scale == pytest.approx(1.5, rel=1e-3)
    assert any("calibrated" in n for n in cal.notes) and (cal.world_size, cal.nodes) == (32, 4)
    # Slower intra-node links and hops: every predicted all-reduce is slower than the uncalibrated one's.
    slower = [c.time_us > p.time_us for c, p in zip(cal.sweep, plain.sweep)]
    assert len(slower) == len(plain.sweep) and all(slower)
    # In words, the calibration is named.
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--nodes", "4", "--no-cache",
                 "--calibration", str(measured)]) == 0
    assert "calibration (measured on 8 ranks x 1 node(s)" in capsys.readouterr().out


def test_autotune_model_only_wire_formats(env, capsys):
    # FP8 on 4 nodes x 1 GPU over 100 Gb/s (12.5 GB/s): the example in docs/autotune.md.
    assert main(["autotune", "--model-only", "--topology", "h200-vm-1gpu", "--nodes", "4", "--inter-node-gbps",
                 "12.5", "--wire-formats", "--no-cache"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("wire formats"):].splitlines()
    assert "fp8 us" in table[1] and "bf16+fp32sum us" in table[1] and "fastest" in table[1]
    assert [line.split()[0:2] for line in table[2:]] == [[str(m), "MiB"] for m in (1, 4, 16, 25, 64, 256)]
    assert table[-1].split()[-1] == "fp8"
    # With --json the table goes to stderr and stdout stays the profile.
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--wire-formats", "--json", "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert "wire formats" in captured.err and Profile.from_dict(json.loads(captured.out)).world_size == 8


def test_autotune_model_only_formats_are_in_the_profile_and_cached_for_auto(env, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--nodes", "2", "--inter-node-gbps", "12.5",
                 "--formats", "fp32,bf16,fp8e4m3+ef,two-level fp8e4m3+ef", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    p = Profile.load(out)
    assert p.formats.source == "model" and p.formats.allowed == ["fp32", "bf16", "fp8e4m3+ef", "two-level fp8e4m3+ef"]
    # 16 ranks: plain bf16 is replaced, and the profile says why.
    assert "bf16" not in p.formats.admitted and "bf16+fp32sum" in p.formats.admitted
    assert "in place of bf16" in p.formats.notes[0] and "in place of bf16" in text
    # At 12.5 GB/s per node a large bucket goes in FP8 (one of its forms); every evaluated size has each format.
    assert "fp8" in p.format_for(1 << 30)
    assert len(p.formats.rows) == len(p.formats.admitted) * 13
    assert "wire format by bucket size" in text
    # Cached apart from the per-dtype profile, where comm_dtype="auto" looks.
    assert cache_path(p.topology_fingerprint, 16, 2, "auto").exists()
    assert not cache_path(p.topology_fingerprint, 16, 2, "bfloat16").exists()
    # The default admits no FP8.
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--formats", "--no-cache", "--json"]) == 0
    default = Profile.from_dict(json.loads(capsys.readouterr().out))
    assert default.formats.allowed == ["fp32", "bf16", "bf16+fp32sum"]
    assert not any("fp8" in f for f in default.formats.admitted)


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,says", [
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--formats", "bf16,fp9"], "'fp9'",
                 id="unknown-format"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--formats", "bf16+ef"], "block-scaled formats only",
                 id="ef-on-bf16"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--host-cost", "cpu"], "--formats",
                 id="host-cost-without-formats"),
    pytest.param(["autotune", "--backend", "gloo", "--formats", "bf16", "--e2e", "m:f"], "e2e",
                 id="formats-with-e2e"),
    pytest.param(["autotune", "--backend", "gloo", "--format-budget", "5"], "--formats in measure mode",
                 id="format-budget-without-formats"),
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--formats", "--format-error", "0.1"],
                 "--formats in measure mode", id="format-error-with-model-only"),
    pytest.param(["autotune", "--backend", "gloo", "--formats", "--format-error", "0"], "--format-error: must be",
                 id="format-error-zero"),
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
    pytest.param(["autotune", "--model-only", "--topology", "dgx-h100", "--host-us-per-bucket", "-1"], ">= 0",
                 id="negative-host-cost"),
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
    from ddp_triton.tune import processes

    def refuse(*args, **kwargs):
        raise AssertionError("started measuring before checking usage")

    monkeypatch.setattr(processes, "spawn_local", refuse)
    monkeypatch.setattr(processes, "init_in_place", refuse)


@pytest.mark.parametrize("argv,says", [
    pytest.param(["--nproc", "2", "--topology", "dgx-h100", "--nccl-tuner-csv", "t.csv"], "backend gloo",
                 id="tuner-csv-from-gloo"),
    pytest.param(["--nproc", "1", "--e2e", "factories:tiny_factory", "--nccl-tuner-csv", "t.csv"],
                 "protocol per range", id="tuner-csv-e2e-without-topology"),
    pytest.param(["--nproc", "1", "--comm-dtype", "int8"], "--comm-dtype int8", id="comm-dtype-int8"),
    pytest.param(["--nproc", "2", "--comm-dtype", "float8_e4m3fn"], "bfloat16, float16, float32",
                 id="comm-dtype-float8"),
    pytest.param(["--nproc", "1", "--comm-dtype", "float32", "--min-bytes", "1", "--max-bytes", "2"],
                 "less than one float32", id="sizes-below-one-element"),
])
def test_usage_is_checked_before_measuring(argv, says, no_measuring, capsys, env, monkeypatch):
    from ddp_triton.machine.topology import TopologyError, nvml

    def no_nvml(nvml=None):
        raise TopologyError("NVML unavailable (test)")

    monkeypatch.setattr(nvml, "from_nvml", no_nvml)  # a GPU machine's NVML would give the model a topology
    assert main(["autotune", "--backend", "gloo", *argv]) == 2
    assert says in capsys.readouterr().err


def test_comm_dtype_int8_rejected_in_model_only(capsys, env):
    assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--comm-dtype", "int8", "--no-cache"]) == 2
    assert "--comm-dtype int8" in capsys.readouterr().err


def test_cli_comm_dtypes_are_the_hooks(capsys, env):
    from ddp_triton.dtypes import COMM_DTYPE_NAMES

    for name in COMM_DTYPE_NAMES:  # every dtype the hook takes, the CLI takes as the comm dtype
        assert main(["autotune", "--model-only", "--topology", "dgx-h100", "--comm-dtype", name, "--no-cache",
                     "--max-bytes", "4K", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["comm_dtype"] == name


def test_value_error_while_measuring_exits_1(monkeypatch, capsys, env):
    from ddp_triton.tune import autotune, processes

    def fail(config):
        raise ValueError("went wrong while measuring")

    monkeypatch.setattr(processes, "init_in_place", lambda backend: False)
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


# ---------------------------------------------------------------------------------------------------------------------
# Bad input and unwritable outputs: exit 2, one line naming the cause, no traceback, nothing written
# ---------------------------------------------------------------------------------------------------------------------


def _snapshot(root: Path) -> dict:
    """Every path under root with its kind, and the bytes of regular files (symlinks: where they point)."""
    import stat

    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                seen[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                seen[str(p)] = ("file", p.read_bytes(), stat.S_IMODE(st.st_mode))
            else:
                seen[str(p)] = (stat.S_IFMT(st.st_mode), st.st_rdev)
    return seen


def _char_device(path: Path) -> None:
    """A character device node (the numbers of /dev/full) in the test's own folder, so that code which replaced it
    would replace nothing of the machine's; skipped where we may not make device nodes."""
    import stat

    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except (PermissionError, AttributeError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")


def _deep_json(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


MODEL = ["autotune", "--model-only", "--topology", "dgx-h100"]


def _binary(t, name="bin.json", data=bytes(range(128, 256))):
    (t / name).write_bytes(data)
    return str(t / name)


def _deep(t, name="deep.json"):
    (t / name).write_text(_deep_json())
    return str(t / name)


def _dir(t, name="d"):
    (t / name).mkdir()
    return str(t / name)


def _link(t, name, to, target_text=None):
    if target_text is not None:
        (t / to).write_text(target_text)
    (t / name).symlink_to(to)
    return str(t / name)


def _fifo(t, name="fifo"):
    os.mkfifo(t / name)
    return str(t / name)


def _device(t, name="full"):
    _char_device(t / name)
    return str(t / name)


def _file(t, name, text="a file\n"):
    (t / name).write_text(text)
    return str(t / name)


def _cache_link(t):
    (t / "cache").mkdir()
    (t / "cache" / "ddp-triton").symlink_to(t / "nowhere")
    return MODEL


# Each case: a set-up (given the test's folder, it makes the bad input there and returns the argv, or the argv and
# extra environment) and the words the one line of error must hold. autotune runs also get --out tmp/out.json and
# --nccl-tuner-csv tmp/t.csv where the case names none of its own, and the cache is at tmp/cache (unless the case
# moves it): every output is watched.
BAD_INPUTS = [
    pytest.param(lambda t: ["autotune", "--model-only", "--topology", _binary(t)], ["bin.json", "UTF-8"],
                 id="binary-topology-autotune"),
    pytest.param(lambda t: ["topo", "--topology", _binary(t, data=b"\xff\xfe{}")], ["bin.json", "UTF-8"],
                 id="binary-topology-topo"),
    pytest.param(lambda t: ["topo", "--topology", _deep(t)], ["deep.json", "nested too deeply"], id="deep-topology"),
    pytest.param(lambda t: ["profile", "show", _deep(t)], ["deep.json", "nested too deeply"], id="deep-profile"),
    pytest.param(lambda t: ["profile", "show", _binary(t, data=b"\x80\x81")], ["bin.json", "UTF-8"],
                 id="binary-profile"),
    pytest.param(lambda t: MODEL + ["--out", _dir(t)], ["--out", "is a directory"], id="out-directory"),
    pytest.param(lambda t: MODEL + ["--nccl-tuner-csv", _dir(t)], ["--nccl-tuner-csv", "is a directory"],
                 id="csv-directory"),
    pytest.param(lambda t: MODEL + ["--out", _link(t, "link.json", "target.json", "keep me\n")],
                 ["--out", "link.json", "symbolic link"], id="out-symlink-to-a-file"),
    pytest.param(lambda t: MODEL + ["--out", _link(t, "link.json", "missing.json")],
                 ["--out", "link.json", "symbolic link"], id="out-dangling-symlink"),
    pytest.param(lambda t: MODEL + ["--out", _link(t, "stdout", "/proc/self/fd/1")], ["--out", "symbolic link"],
                 id="out-like-dev-stdout"),
    pytest.param(lambda t: MODEL + ["--out", _device(t)], ["--out", "character device"], id="out-device"),
    pytest.param(lambda t: MODEL + ["--nccl-tuner-csv", _device(t)], ["--nccl-tuner-csv", "character device"],
                 id="csv-device"),
    pytest.param(lambda t: MODEL + ["--out", _fifo(t)], ["--out", "FIFO"], id="out-fifo"),
    pytest.param(lambda t: MODEL + ["--nccl-tuner-csv", _fifo(t)], ["--nccl-tuner-csv", "FIFO"], id="csv-fifo"),
    pytest.param(lambda t: MODEL + ["--out", os.path.join(_file(t, "file"), "p.json")], ["--out", "not a directory"],
                 id="out-under-a-file"),
    pytest.param(lambda t: (MODEL, {"XDG_CACHE_HOME": _file(t, "xdg")}),
                 ["cache", "xdg", "is not a directory", "--no-cache"], id="cache-home-is-a-file"),
    pytest.param(_cache_link, ["cache", "ddp-triton", "symbolic link"], id="cache-dir-is-a-dangling-symlink"),
    pytest.param(lambda t: MODEL + ["--out", str(t / "same"), "--nccl-tuner-csv", str(t / "same")], ["same file"],
                 id="out-and-csv-one-file"),
    pytest.param(lambda t: MODEL + ["--world-size", "12"], ["--nodes 2"], id="world-size-names-the-flag"),
    pytest.param(lambda t: MODEL + ["--calibration", str(t / "missing.json")], ["--calibration", "missing.json"],
                 id="calibration-missing"),
    pytest.param(lambda t: MODEL + ["--calibration", _file(t, "model.json", Profile(
        source="model", world_size=8, nodes=1, comm_dtype="bfloat16", bucket_cap_mb=25.0,
        table=[TableEntry(0, None, "ring")]).to_json())], ["--calibration", "model.json", "no calibration"],
                 id="calibration-absent"),
    pytest.param(lambda t: MODEL + ["--calibration", str(_measured_one_node(t / "a100.json", "dgx-a100"))],
                 ["--calibration", "a100.json", "another kind of node"], id="calibration-other-node"),
    pytest.param(lambda t: ["autotune", "--backend", "gloo", "--calibration", "p.json"], ["--calibration",
                                                                                          "--model-only"],
                 id="calibration-without-model-only"),
    pytest.param(lambda t: ["autotune", "--backend", "gloo", "--wire-formats"], ["--wire-formats", "--model-only"],
                 id="wire-formats-without-model-only"),
]


def _run_bad_input(setup, says, tmp_path, run) -> None:
    work = tmp_path / "w"
    work.mkdir()
    made = setup(work)
    argv, extra_env = made if isinstance(made, tuple) else (made, {})
    if argv[0] == "autotune":
        for flag, name in (("--out", "out.json"), ("--nccl-tuner-csv", "t.csv")):
            if flag not in argv:
                argv = argv + [flag, str(work / name)]
    before = _snapshot(work)
    code, out, err = run({"XDG_CACHE_HOME": str(work / "cache"), **extra_env}, argv)
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp-triton: error: "), err
    for word in says:
        assert word in lines[0], (word, lines[0])
    assert "nodes=" not in lines[0]
    assert out == ""
    # No cache, no --out, no CSV, no temporary file; links, FIFOs and device nodes as they were.
    assert _snapshot(work) == before


@pytest.mark.parametrize("setup,says", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(setup, says, env, tmp_path, monkeypatch, capsys):
    def in_process(extra_env, argv):
        for k, v in extra_env.items():
            monkeypatch.setenv(k, v)
        code = main(argv)  # an exception here (a traceback from the command) fails the test
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    _run_bad_input(setup, says, tmp_path, in_process)


@pytest.mark.parametrize("setup,says", [c for c in BAD_INPUTS if c.id in (
    "binary-topology-topo", "deep-profile", "csv-directory", "out-like-dev-stdout", "cache-home-is-a-file")])
def test_bad_input_from_the_command_line(setup, says, env, tmp_path):
    """The same, as a user runs it: a fresh interpreter, no traceback on stderr, exit 2."""

    def subprocess_run(extra_env, argv):
        r = cli({**env, **extra_env}, *argv)
        return r.returncode, r.stdout, r.stderr

    _run_bad_input(setup, says, tmp_path, subprocess_run)


def test_outputs_are_checked_before_modelling(env, tmp_path, monkeypatch, capsys):
    # An output that cannot be written fails before the (possibly long) work, not after it.
    from ddp_triton.machine import profile

    def refuse(*a, **k):
        raise AssertionError("modelled before checking the outputs")

    monkeypatch.setattr(profile, "model_profile", refuse)
    (tmp_path / "d").mkdir()
    assert main(MODEL + ["--out", str(tmp_path / "d")]) == 2
    assert "--out" in capsys.readouterr().err


def test_out_replaces_a_regular_file_atomically_keeping_its_mode(env, tmp_path):
    out, csv = tmp_path / "p.json", tmp_path / "t.csv"
    out.write_text("old\n")
    os.chmod(out, 0o640)
    hard = tmp_path / "other-name.json"
    os.link(out, hard)
    r = cli(env, *MODEL, "--out", str(out), "--nccl-tuner-csv", str(csv))
    assert r.returncode == 0, r.stderr
    assert Profile.load(out).world_size == 8
    assert os.stat(out).st_mode & 0o777 == 0o640
    assert hard.read_text() == "old\n"  # replaced by rename, not rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "other-name.json", "p.json", "t.csv"]
    # a new file gets the umask's mode, not a temporary file's 0600
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(csv).st_mode & 0o777 == 0o666 & ~umask


def test_topo_json_without_a_topology_prints_json(env, monkeypatch, capsys):
    from ddp_triton.machine.topology import TopologyError, nvml

    def no_nvml(nvml=None):
        raise TopologyError("NVML unavailable (test)")

    monkeypatch.setattr(nvml, "from_nvml", no_nvml)
    assert main(["topo", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is JSON, and nothing else
    assert doc["topology"] is None and "NVML unavailable (test)" in doc["error"]
    assert "dgx-h100" in doc["presets"]
    assert "NVML unavailable (test)" in captured.err
    # without --json, words as before
    assert main(["topo"]) == 0
    assert "presets: " in capsys.readouterr().out


def test_world_size_error_speaks_of_flags(env, capsys):
    assert main(MODEL + ["--world-size", "12", "--nodes", "1", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "--nodes" in err and "nodes=" not in err


def test_profile_with_an_unknown_field_is_refused_by_name(env, tmp_path, capsys):
    good = tmp_path / "p.json"
    assert main(MODEL + ["--out", str(good), "--no-cache"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(json.loads(good.read_text()), bucket_cap_mbs=3)))
    capsys.readouterr()
    assert main(["profile", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "bucket_cap_mbs" in err
