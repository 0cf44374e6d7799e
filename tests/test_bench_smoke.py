"""The benchmark scripts still run: their CPU smoke modes, end to end, in subprocesses.

Tier: no device. Nothing here is timed or compared: speed is measured in bench/ on a GPU, never in tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", *args, "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (saved,) = tmp_path.glob("*.json")
    return out.stdout, json.loads(saved.read_text())


def test_kernels_benchmark_smoke(tmp_path):
    stdout, data = run(["bench.kernels", "--device", "cpu", "--quick", "--no-compile", "--no-results"], tmp_path)
    assert "copy ceiling" in stdout
    assert {r["op"] for r in data["buckets"]} == {"pack", "unpack"}
    assert all(r["bitexact"] for r in data["buckets"] + data["gradient_list"])
    assert data["gradient_list"][0]["tensors"] == 148


def test_ddp_step_benchmark_smoke(tmp_path):
    stdout, data = run(["bench.ddp_step", "--small", "--steps", "2", "--warmup", "1", "--no-results"], tmp_path)
    variants = {(r["variant"], r["gradient_as_bucket_view"]) for r in data["rows"]}
    assert ("triton_hook_bf16", True) in variants and ("no_hook", False) in variants
    assert any("bf16_compress_hook skipped" in n for n in data["notes"])


def test_kernels_benchmark_says_so_without_a_gpu():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would measure")
    out = subprocess.run([sys.executable, "-m", "bench.kernels"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "no CUDA device" in out.stdout


def test_host_benchmark_smoke():
    import torch

    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "bench.host", "--json", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    for key in ("pack_1", "pack_148", "bound", "unpack_148", "unpack_stats_148", "hook_bucket"):
        assert data[f"{key}_ratio"] > 0 and data[f"{key}_us"] > 0, key
    assert data["torch_op_us"] > 0 and data["env"]["torch"] == torch.__version__
