"""The benchmark scripts still run: their CPU smoke modes, end to end, in subprocesses (the wire-format benchmarks
``bench.numerics`` and ``bench.quality`` in this process, to save a second interpreter start).

Tier: no device; ``bench.quality`` spawns 2 gloo processes. Nothing here is timed: speed is measured in bench/ on a
GPU, never in tests. The wire-format tests check properties of their quick runs (error orderings, bytes counted).
"""

import json
import math
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


def test_hook_cost_benchmark_smoke():
    import torch

    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "bench.hook_cost", "--json", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    keys = [f"{k}_us" for k in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "triton_fp32",
                                "triton_fp16", "triton_bf16", "triton_bf16_fp32sum", "triton_fp8")]
    for key in keys + ["fp32_ratio", "fp16_ratio", "bf16_ratio"]:
        assert isinstance(data[key], float) and math.isfinite(data[key]), key
    assert data["buckets"] == data["requested_buckets"]  # one bucket per layer, counted in a backward
    assert data["rounds"] >= 1 and data["steps_per_round"] >= 1
    assert data["torch"] == torch.__version__ and data["triton"] and data["date"] and data["machine"]["cpu"]


# ---- wire formats: numerics (one process) and training quality (gloo ranks), run in this process to keep them fast --


def _import_bench(name):
    """``bench.<name>`` from the checkout (bench/ is not installed; spawned workers inherit this sys.path)."""
    import importlib

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.{name}")


def test_numerics_benchmark_smoke(tmp_path):
    numerics = _import_bench("numerics")
    out = tmp_path / "numerics.json"
    assert numerics.main(["--quick", "--no-plot", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    # the vectorised simulation gives the library launchers' bits (here through whatever path this process uses)
    assert all(v for k, v in data["self_check"].items() if k.endswith("bit_exact")), data["self_check"]
    one = data["one_step"]
    assert set(one) == {"2", "8", "64"} and set(one["64"]) == set(numerics.SCHEMES)
    # N=64: the ring rounds to bf16 after each of 63 additions, float32 sums round once: the ring's error is larger
    assert one["64"]["bf16+fp32sum"]["all"] < one["64"]["bf16"]["all"]
    # at a power-of-two N torch's division in bf16 is exact: the same result as the pre-division in float32
    assert one["64"]["torch_bf16"]["all"] == one["64"]["bf16"]["all"]
    # blocks cut at bucket offsets give the 1e-6 LayerNorm bias the scale of the 1e2 weight beside it: all zeros
    # (relative error exactly 1); per-tensor blocks keep it at FP8's few percent
    assert one["64"]["fp8e4m3 bucket-offset blocks"]["ln.bias"] == 1.0
    assert one["64"]["fp8e4m3"]["ln.bias"] < 0.1
    for n, curves in data["running_sum"].items():
        assert len(curves["fp8e4m3+ef"]) == data["config"]["steps"]
        # error feedback: after 10 steps the running sum's error is below FP8 without it (seed-fixed data)
        assert curves["drift fp8e4m3+ef"][-1] < curves["drift fp8e4m3"][-1], n


def test_quality_benchmark_smoke(tmp_path):
    quality = _import_bench("quality")
    out = tmp_path / "quality.json"
    assert quality.main(["--quick", "--no-plot", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["summary"]) == {"seed", "char"}
    for name, rows in data["summary"].items():
        assert list(rows) == list(quality.FORMATS), name
        runs = data["results"][name]["runs"]
        assert all(len(r["losses"]) == data["config"]["steps"][name] for r in runs.values())
        assert all(math.isfinite(row["final_loss"]) for row in rows.values())
        sent = {fmt: row["wire_bytes_per_step"] for fmt, row in rows.items()}
        # counted by the state: FP8 (1 byte + a 4-byte scale per 128) < bf16 (2 bytes) < float32 (4 bytes)
        assert sent["fp8e4m3+ef"] == sent["fp8e4m3"] < sent["bf16"] < sent["fp32"]
        assert sent["fp32"] == runs["fp32"]["wire_bytes"]["fp32_per_step"] == 2 * sent["bf16"]
        assert sent["bf16"] <= sent["bf16+fp32sum"] < sent["bf16"] + 2 * data["config"]["world_size"]  # padding
    seed = data["results"]["seed"]["runs"]["fp32"]["losses"]
    assert seed[-1] < seed[0]  # the example's model learns within the quick run
    # a dozen steps cannot tell the formats apart; they must not break training either
    assert all(abs(row["vs_fp32"]) < 0.02 for row in data["summary"]["seed"].values())
