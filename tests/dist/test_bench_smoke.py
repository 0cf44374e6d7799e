"""The benchmark scripts still run: their CPU smoke modes, end to end, in subprocesses (the wire-format benchmarks
``bench.numerics`` and ``bench.quality`` in this process, to save a second interpreter start).

Tier: no device; ``bench.quality`` spawns 2 gloo processes. Nothing here is timed: speed is measured in bench/ on a
GPU, never in tests. The wire-format tests check properties of their quick runs (error orderings, bytes counted).
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tracked_bench_files():
    """The bytes of every file git tracks under bench/ that a run could write: RESULTS.md and bench/results/."""
    paths = [ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "bench" / "results").glob("*"))]
    return {p: p.read_bytes() for p in paths}


def run(args, tmp_path, saved_as="*.json", stderr=None):
    """Run a benchmark with ``--out-dir tmp_path``; its stdout and the one JSON it saved there. ``stderr``: a list
    that receives the run's stderr (its progress lines)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", *args, "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if stderr is not None:
        stderr.append(out.stderr)
    (saved,) = tmp_path.glob(saved_as)
    return out.stdout, json.loads(saved.read_text())


def run_json(args):
    """The one JSON object a benchmark prints with ``--json`` (on the torch path)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", *args, "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def timed(value):
    """A time a run measured: a finite number of microseconds or milliseconds above zero."""
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_kernels_benchmark_smoke(tmp_path):
    stdout, data = run(["bench.kernels", "--device", "cpu", "--quick", "--no-compile"], tmp_path)
    assert "copy ceiling" in stdout and timed(data["copy_ceiling_gbps"])
    # --quick keeps the default sizes up to 4 MiB: a pack and an unpack row for each
    assert sorted((r["mb"], r["op"]) for r in data["buckets"]) == [(1.0, "pack"), (1.0, "unpack"), (4.0, "pack"),
                                                                    (4.0, "unpack")]
    assert all(r["bitexact"] for r in data["buckets"] + data["gradient_list"])
    for r in data["buckets"]:
        assert timed(r["ours_us"]) and timed(r["torch_us"]) and r["compiled_us"] is None, r
        assert r["bytes"] == r["elements"] * 6 and r["elements"] == int(r["mb"] * (1 << 20)) // 4
        assert r["ours_over_torch"] == r["ours_us"] / r["torch_us"]
        assert r["ours_gbps"] == r["bytes"] / r["ours_us"] / 1e3
        assert math.isclose(r["floor_us"], r["bytes"] / data["copy_ceiling_gbps"] / 1e3)
    assert [(r["tensors"], r["op"]) for r in data["gradient_list"]] == [(148, "pack"), (148, "unpack")]
    for r in data["gradient_list"]:
        assert timed(r["ours_us"]) and timed(r["torch_us"]) and r["torch_over_ours"] == r["torch_us"] / r["ours_us"]
    assert len(data["host"]) == 6 and all(timed(r["host_us"]) for r in data["host"])


def test_ddp_step_benchmark_smoke(tmp_path):
    before, stderr = tracked_bench_files(), []
    stdout, data = run(["bench.ddp_step", "--small", "--steps", "2", "--warmup", "1"], tmp_path, stderr=stderr)
    # A line per variant and round as it finishes, and nothing written where git tracks it unless asked.
    assert "bucket view on, round 2/5: triton_hook_bf16 median" in stderr[0], stderr[0][-2000:]
    assert tracked_bench_files() == before
    # every default variant in both bucket views, but what gloo and a CPU cannot run
    ran = ["no_hook", "allreduce_hook", "triton_hook_bf16", "triton_hook_fp32", "triton_hook_bf16_clip_state",
           "triton_hook_bf16_clip_torch"]
    assert [(r["variant"], r["gradient_as_bucket_view"]) for r in data["rows"]] == [
        (v, view) for view in (False, True) for v in ran]
    assert any("bf16_compress_hook skipped" in n for n in data["notes"])
    assert any("triton_hook_bf16_graph skipped" in n for n in data["notes"])
    base = {r["gradient_as_bucket_view"]: r["median_ms"] for r in data["rows"] if r["variant"] == "no_hook"}
    for r in data["rows"]:
        # --steps 2 over the default 5 rounds: at least one step a round
        assert r["steps"] == 5 and timed(r["median_ms"]) and 0 < r["min_ms"] <= r["median_ms"], r
        assert r["vs_no_hook"] == r["median_ms"] / base[r["gradient_as_bucket_view"]]


def test_ddp_step_two_level_variants_and_link_counters_smoke(tmp_path):
    """World size 1 (one node: the two-level variant runs flat); --link-iface reads loopback's kernel counters."""
    stdout, data = run(["bench.ddp_step", "--small", "--steps", "2", "--warmup", "1", "--rounds", "2",
                        "--bucket-view", "off", "--variants", "no_hook,triton_hook_fp8_2level,triton_hook_bf16_2level",
                        "--link-iface", "lo"], tmp_path)
    assert [r["variant"] for r in data["rows"]] == ["no_hook", "triton_hook_fp8_2level", "triton_hook_bf16_2level"]
    for row in data["rows"]:
        assert row["steps"] == 2 and timed(row["median_ms"]) and row["min_ms"] <= row["median_ms"], row
        # loopback's counters are the machine's: whatever else uses it shows, but never a negative count
        assert row["node_link_tx_bytes_per_step"] >= 0 and row["node_link_rx_bytes_per_step"] >= 0
    assert "node link MB sent per step" in stdout


def test_ddp_step_timeline_smoke(tmp_path):
    """--timeline: one recorded step per triton variant, a JSON of its hook calls and stage events (and a PNG where
    matplotlib is installed), and the exposed exchange in the row and the table; --backward-ms stalls the backward
    (the small MLP's own takes a few ms)."""
    stdout, data = run(["bench.ddp_step", "--small", "--steps", "2", "--warmup", "1", "--rounds", "1",
                        "--bucket-view", "off", "--variants", "no_hook,triton_hook_fp8,triton_hook_fp8_whole",
                        "--timeline", "--link-mbit", "200", "--backward-ms", "200"], tmp_path,
                       saved_as="ddp_step-*.json")
    assert data["env"]["backward_ms"] == 200
    rows = {r["variant"]: r for r in data["rows"]}
    assert "timeline_exposed_ms" not in rows["no_hook"]
    for variant in ("triton_hook_fp8", "triton_hook_fp8_whole"):
        (saved,) = tmp_path.glob(f"timeline-{variant}-*.json")
        recorded = json.loads(saved.read_text())
        assert recorded["variant"] == variant and recorded["backward_end"] - recorded["backward_start"] >= 200
        assert [h["last"] for h in recorded["hooks"]][-1] is True
        # the row's exposed exchange is the JSON's: from the last bucket's hook call to the backward's return
        exposed = recorded["backward_end"] - recorded["hooks"][-1]["ms"]
        assert 0 < exposed < recorded["backward_end"] - recorded["backward_start"]
        assert rows[variant]["timeline_exposed_ms"] == pytest.approx(exposed), rows[variant]
        rows_seen = {e["row"] for e in recorded["events"]}
        assert {"pack", "all_to_all", "all_gather", "unpack"} <= rows_seen, rows_seen  # FP8's stages, staged
    assert "exposed ms (timeline step)" in stdout


def test_timeline_summary_counts_the_chunks_still_to_cross():
    """The exposed exchange, and the link-byte time of the chunks whose cross-node collectives ended after the last
    bucket's hook: a bucket's bytes shared evenly by its chunks."""
    timeline = _import_bench("timeline")
    recorded = {
        "hooks": [{"bucket": 0, "last": False, "ms": 10.0, "elements": 100},
                  {"bucket": 1, "last": True, "ms": 50.0, "elements": 200}],
        "events": [{"bucket": 0, "chunk": 0, "row": "cross_all_to_all", "kind": "collective", "start": 11, "end": 40},
                   {"bucket": 0, "chunk": 1, "row": "cross_all_gather", "kind": "collective", "start": 41, "end": 70},
                   {"bucket": 1, "chunk": 0, "row": "cross_all_to_all", "kind": "collective", "start": 71, "end": 90},
                   {"bucket": 1, "chunk": 0, "row": "all_gather", "kind": "collective", "start": 91, "end": 95}],
        "backward_end": 100.0}
    # 1 Mbit/s: 125 bytes a millisecond; a bucket of n elements sends 125 * n / 100 bytes (n ms at that rate)
    summary = timeline.summarize(recorded, lambda n: 125 * n // 100, 1.0)
    assert summary["exposed_ms"] == 50.0 and summary["last_bucket_link_ms"] == 2.0
    assert summary["pending_link_ms"] == 1.0 * 1 / 2 + 2.0  # bucket 0's second chunk, all of bucket 1
    assert summary["exposed_over_pending_link"] == 50.0 / 2.5
    assert timeline.summarize(recorded, lambda n: None, 1.0) == {"exposed_ms": 50.0, "last_bucket_elements": 200}


def test_variants_take_turns_and_link_bytes_are_counted_per_step(monkeypatch):
    """The rounds of bench.ddp_step and bench.fsdp_step, in this process on a fake link: each variant's timer runs
    once a round with the steps spread over the rounds, the first round's warm-up longer, and the link's bytes are
    counted over the rounds after the first, divided by the steps (warm-up included) they took."""
    ddp_step, common = _import_bench("ddp_step"), _import_bench("common")
    counters = [0, 0]  # tx, rx: each step sends 100 bytes and receives 30, warm-up steps too
    calls = []

    def timer(name, step_ms):
        def run(steps, warmup):
            calls.append((name, steps, warmup))
            counters[0] += 100 * (steps + warmup)
            counters[1] += 30 * (steps + warmup)
            return [step_ms * (len(calls) % 3 + 1)] * steps
        return run

    monkeypatch.setattr(ddp_step, "link_bytes", lambda iface: tuple(counters) if iface else (0, 0))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with common.one_rank_gloo():
        rows = ddp_step.take_turns([("a", timer("a", 1.0)), ("b", timer("b", 10.0))], rounds=3, steps=7, warmup=5,
                                   later_warmup=2, link_iface="fake")
    assert calls == [("a", 2, 5), ("b", 2, 5), ("a", 2, 2), ("b", 2, 2), ("a", 2, 2), ("b", 2, 2)]
    # a's steps took 2, 1, 3 ms in its three rounds (1 ms x (calls so far mod 3 + 1)), b's 30, 20, 10
    assert [(r["variant"], r["steps"], r["median_ms"], r["min_ms"]) for r in rows] == [
        ("a", 6, 2.0, 1.0), ("b", 6, 20.0, 10.0)]
    assert [r["mean_ms"] for r in rows] == [pytest.approx(2.0), pytest.approx(20.0)]  # a job's pace: every step
    for r in rows:
        assert (r["node_link_tx_bytes_per_step"], r["node_link_rx_bytes_per_step"]) == (100.0, 30.0)


def test_fsdp_step_smoke(tmp_path):
    """World size 1: FSDP2 runs no reduce-scatter, but every variant builds, trains and is reported."""
    stdout, data = run(["bench.fsdp_step", "--small", "--steps", "2", "--rounds", "1", "--link-iface", "lo"],
                       tmp_path, "fsdp_step-*.json")
    assert [r["variant"] for r in data["rows"]] == ["fsdp_float32", "fsdp_bf16_reduce", "triton_bf16_fp32sum",
                                                    "triton_fp8", "triton_fp8_bf16_reduce"]
    for r in data["rows"]:  # --steps 2 in one round
        assert r["steps"] == 2 and timed(r["median_ms"]) and 0 < r["min_ms"] <= r["median_ms"], r
        assert r["node_link_tx_bytes_per_step"] >= 0  # loopback's counters, of the whole machine
    assert "node link MB sent per step" in stdout


def test_ddp_step_gpt2_smoke(tmp_path):
    stdout, data = run(["bench.ddp_step", "--small", "--model", "gpt2", "--steps", "2", "--warmup", "1", "--rounds",
                        "1", "--variants", "no_hook,triton_hook_bf16,triton_hook_bf16_clip_state"],
                       tmp_path, "ddp_step_gpt2-*.json")
    env = data["env"]
    assert env["model"] == "gpt2" and env["tied_embeddings"] is True and env["autocast"] is None  # CPU: float32
    assert env["gpt2_config"] == {"layers": 2, "d_model": 64, "heads": 4, "mlp": 256, "vocab": 256, "context": 32}
    # embeddings 256*64 + 32*64, 2 blocks of 49984 (LayerNorms, QKV, projection, MLP), final LayerNorm; head tied
    assert env["parameters"] == 256 * 64 + 32 * 64 + 2 * 49984 + 128
    assert (env["batch"], env["seq"]) == (2, 32)
    assert {(r["variant"], r["gradient_as_bucket_view"]) for r in data["rows"]} == {
        (v, view) for v in ("no_hook", "triton_hook_bf16", "triton_hook_bf16_clip_state") for view in (False, True)}
    assert all(r["steps"] == 2 and timed(r["median_ms"]) and r["min_ms"] <= r["median_ms"] for r in data["rows"])
    assert not any("fell back" in n for n in data["notes"])  # the clip variant clipped from the state
    assert "saved" in stdout


def _profiles_every_thread():
    import torch

    try:
        torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # torch before profile_all_threads
        return False
    return True


def test_ddp_step_profile_smoke(tmp_path):
    stdout, data = run(["bench.ddp_step", "--small", "--profile", "--variants", "no_hook,triton_hook_bf16",
                        "--steps", "2", "--warmup", "1"], tmp_path, "ddp_profile-*.json")
    assert data["mode"] == "profile" and data["env"]["profiled_steps"] == 2
    profiles = {(p["variant"], p["gradient_as_bucket_view"]): p for p in data["profiles"]}
    assert set(profiles) == {(v, view) for v in ("no_hook", "triton_hook_bf16") for view in (False, True)}
    traces = {p.name for p in tmp_path.glob("ddp_trace-*.json")}
    assert traces == {p["trace"] for p in profiles.values()}
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in traces)
    for (variant, _), prof in profiles.items():
        assert prof["steps"] == 2 and prof["gpu"] is False and prof["buckets"]
        assert prof["step"]["gpu_idle_backward_us"] is None and prof["step"]["backward_us"] > 0
        assert "DistributedDataParallel.forward" in prof["ddp_ranges"]
        for row in prof["buckets"]:
            assert row["gpu_idle_in_hook_us"] is None and row["collective_us"] > 0 and row["steps"] == 2
            if variant == "no_hook":  # DDP's own all-reduce: no hook, no pack or unpack
                assert row["hook_us"] is row["pack_us"] is row["unpack_us"] is None
            else:  # at world size 1 gloo completes the all-reduce at once: the unpack runs inside the hook
                assert row["hook_us"] > 0 and row["pack_us"] > 0 and row["unpack_us"] > 0
        assert prof["all_threads"] is _profiles_every_thread()
    assert len(data["rows"]) == sum(len(p["buckets"]) for p in data["profiles"])
    assert len(data["tables"]["buckets"]) == 4 and "GPU idle bwd us" in data["tables"]["steps"]
    assert "n/a" in stdout


def _trace(*events):
    """A chrome trace of complete events: (cat, name, ts, dur, tid[, args])."""
    out = []
    for cat, name, ts, dur, tid, *args in events:
        gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
        out.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0 if gpu else 100,
                    "tid": tid, "args": args[0] if args else {}})
    return {"traceEvents": out + [{"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {}}]}


def _cuda_step(t0, hook0_dur):
    """One profiled step on CUDA, shifted by t0: triton_hook's ranges for bucket 0, torch's hook for bucket 1."""
    def e(cat, name, ts, dur, tid, args=None):
        return (cat, name, t0 + ts, dur, tid, args or {})

    return [
        e("user_annotation", "ddp_step.step", 0, 10000, 1),
        e("user_annotation", "ddp_step.forward", 10, 1990, 1),
        e("user_annotation", "DistributedDataParallel.forward", 20, 1480, 1),
        e("cuda_runtime", "cudaLaunchKernel", 100, 5, 1, {"correlation": t0 + 10}),
        e("kernel", "forward_gemm", 150, 1750, 7, {"correlation": t0 + 10}),
        e("user_annotation", "ddp_step.backward", 2000, 6000, 1),
        e("cuda_runtime", "cudaLaunchKernel", 2100, 5, 2, {"correlation": t0 + 1}),
        e("kernel", "a", 2200, 400, 7, {"correlation": t0 + 1}),
        e("cuda_runtime", "cudaLaunchKernel", 2500, 5, 2, {"correlation": t0 + 2}),
        e("kernel", "b", 2700, 300, 7, {"correlation": t0 + 2}),
        e("user_annotation", "ddp_step.hook bucket 0", 3000, hook0_dur, 2),
        e("user_annotation", "ddp_triton.pack bucket 0 (1 MiB)", 3010, 40, 2),
        e("cuda_driver", "cuLaunchKernel", 3040, 5, 2, {"correlation": t0 + 3}),
        e("kernel", "pack", 3100, 50, 7, {"correlation": t0 + 3}),
        e("user_annotation", "ddp_triton.all_reduce bucket 0 (1 MiB)", 3060, 140, 2),
        e("cpu_op", "c10d::allreduce_", 3070, 120, 2),
        e("kernel", "ncclDevKernel_AllReduce_Sum_f32", 3100, 400, 20, {"correlation": t0 + 9}),
        e("user_annotation", "ddp_triton.unpack bucket 0 (1 MiB)", 3210, 80, 2),
        e("kernel", "unpack_seen_by_no_launch_record", 3400, 100, 7),
        e("user_annotation", "ddp_step.hook bucket 1", 5000, 100, 2),
        e("cpu_op", "c10d::allreduce_", 5010, 80, 2),
        e("cuda_runtime", "cudaLaunchKernel", 7000, 5, 2, {"correlation": t0 + 5}),
        e("kernel", "e", 7100, 200, 7, {"correlation": t0 + 5}),
        e("gpu_user_annotation", "ddp_step.backward", 2000, 6000, 7),
        e("cpu_op", "torch.distributed.ddp.reducer::copy_bucket_to_grad", 7900, 50, 2),
        e("user_annotation", "ddp_step.optimizer", 8050, 500, 1),
        e("cuda_runtime", "cudaLaunchKernel", 8100, 5, 1, {"correlation": t0 + 6}),
        e("kernel", "sgd", 8200, 100, 7, {"correlation": t0 + 6}),
    ]


def test_ddp_step_profile_reads_a_cuda_trace():
    """The GPU columns, from a synthetic trace shaped like the profiler's on CUDA (no GPU here to make one)."""
    ddp_profile = _import_bench("ddp_profile")
    result = ddp_profile.analyse_trace(_trace(*_cuda_step(0, 300), *_cuda_step(20000, 500)))
    assert result["steps"] == 2 and result["gpu"] is True
    step = result["step"]
    assert step["compute_stream"] == "device 0 7"  # the NCCL stream is never the compute stream
    # backward span on stream 7: from kernel a (first launched in the backward) to sgd (first launched after it);
    # gaps a-b 100, b-pack 100, pack-unpack 250, unpack-e 3600; sgd and the forward's kernel are outside
    assert step["gpu_idle_backward_us"] == 4050 and step["gpu_gaps_backward"] == 4
    assert step["gpu_busy_backward_us"] == 400 + 300 + 50 + 100 + 200 and step["gpu_events_backward"] == 5
    assert step["step_ms"] == 10 and step["backward_us"] == 6000 and step["buckets"] == 2
    b0, b1 = result["buckets"]
    assert (b0["bucket"], b0["hook_us"], b0["pack_us"], b0["collective_us"], b0["unpack_us"]) == (0, 400, 40, 140, 80)
    # idle while in bucket 0's hook: 3000-3100 and 3150-3300 (hook of 300 us), then 3000-3100 and 3150-3400 (500 us)
    assert b0["gpu_idle_in_hook_us"] == (250 + 350) / 2 and b0["steps"] == 2
    # torch's hook style: the collective is the c10d call inside the hook range; no pack or unpack ranges
    assert (b1["hook_us"], b1["pack_us"], b1["collective_us"], b1["unpack_us"]) == (100, None, 80, None)
    assert b1["gpu_idle_in_hook_us"] == 100
    assert result["ddp_ranges"] == {"DistributedDataParallel.forward": 1480,
                                    "torch.distributed.ddp.reducer::copy_bucket_to_grad": 50}


def test_ddp_step_profile_without_a_hook_counts_the_reducers_calls():
    """No hook: the reducer's top-level c10d calls in the backward are buckets 0, 1, ... in order; no GPU events."""
    ddp_profile = _import_bench("ddp_profile")
    result = ddp_profile.analyse_trace(_trace(
        ("user_annotation", "ddp_step.step", 0, 1000, 1),
        ("cpu_op", "c10d::broadcast_", 10, 5, 1),  # before the backward: not a bucket
        ("user_annotation", "ddp_step.backward", 100, 800, 1),
        ("cpu_op", "c10d::allreduce_", 200, 30, 1),
        ("cpu_op", "c10d::allreduce_", 205, 10, 1),  # nested in the call above: the same call
        ("cpu_op", "c10d::allreduce_", 500, 20, 1),
    ))
    assert result["gpu"] is False and result["step"]["gpu_idle_backward_us"] is None
    assert [(b["bucket"], b["collective_us"], b["hook_us"], b["gpu_idle_in_hook_us"]) for b in result["buckets"]] == [
        (0, 30, None, None), (1, 20, None, None)]
    assert ddp_profile.bucket_table(result).count("n/a") == 2


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

    data = run_json(["bench.host", "--quick"])
    keys = ["torch_op", "pack_1", "pack_148", "unpack_148", "unpack_stats_148", "prepared_1", "prepared_148", "fixed",
            "fixed_fp8", "fsdp_fp8_plain", "fsdp_fp8_prepared", "fsdp_fp8_prepared_new", "hook_bucket"]
    assert [r["key"] for r in data["rows"]] == keys
    assert timed(data["torch_op_us"]) and data["env"]["torch"] == torch.__version__
    for row in data["rows"][1:]:
        key = row["key"]
        assert timed(row["us"]) and data[f"{key}_us"] == row["us"], key
        assert data[f"{key}_ratio"] == row["ratio"] == row["us"] / data["torch_op_us"], key
    assert data["targets"] == {"fixed_ratio": 1.0, "pack_1_ratio": 2.0, "pack_148_ratio": 20.0,
                               "unpack_148_ratio": 20.0}


def test_wire_kernels_cpu_mode_smoke(tmp_path):
    data = run_json(["bench.wire_kernels", "--cpu", "--mb", "0.25", "--ranks", "3", "--out-dir", str(tmp_path)])
    assert data["ranks"] == 3 and data["threads"] == 1 and data["fp8_cpu_path"] in ("compiled", "torch")
    assert data["e2m1_cpu_path"] in ("compiled", "torch")
    ns = data["ns_per_element"]
    assert set(ns) == {"bf16 pack", "bf16 unpack", "bf16 sum of slices x3", "fp8 quantize +ef", "fp8 reduce x3 +ef",
                       "fp8 dequantize", "e2m1 quantize +ef", "e2m1 reduce x3 +ef", "e2m1 dequantize"}
    assert all(timed(v) for v in ns.values()), ns
    # each format's total is the sum of its passes, and the ratios are of those totals
    assert data["bf16_ns"] == ns["bf16 pack"] + ns["bf16 unpack"]
    assert data["bf16_fp32sum_ns"] == data["bf16_ns"] + ns["bf16 sum of slices x3"]
    assert data["fp8_ns"] == ns["fp8 quantize +ef"] + ns["fp8 reduce x3 +ef"] + ns["fp8 dequantize"]
    assert data["fp8_over_bf16_cpu"] == data["fp8_ns"] / data["bf16_ns"]
    assert data["e2m1_ns"] == ns["e2m1 quantize +ef"] + ns["e2m1 reduce x3 +ef"] + ns["e2m1 dequantize"]
    assert data["e2m1_over_fp8_cpu"] == data["e2m1_ns"] / data["fp8_ns"]
    assert data["bf16_fp32sum_over_bf16_cpu"] == data["bf16_fp32sum_ns"] / data["bf16_ns"]
    assert data["elements"] == int(0.25 * (1 << 20)) // 4


def test_hook_cost_benchmark_smoke():
    import torch

    data = run_json(["bench.hook_cost", "--quick"])
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == ["no_hook", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "triton_fp32",
                          "triton_fp16", "triton_bf16", "triton_bf16_fp32sum", "triton_fp8", "triton_fp4",
                          "triton_auto_bf16", "triton_auto_queued"]
    assert data["buckets"] == data["requested_buckets"] == 50  # --quick: one bucket per layer, counted in a backward
    assert (data["rounds"], data["steps_per_round"]) == (3, 3)
    base = rows["no_hook"]["round_ms"]
    for key, r in rows.items():
        # a step time per round, its median; an extra time per bucket over the no-hook step of the same round
        assert len(r["round_ms"]) == 3 and all(timed(t) for t in r["round_ms"]), key
        assert r["step_ms"] == statistics.median(r["round_ms"]) and r["min_step_ms"] == min(r["round_ms"]), key
        extra = [(ms - b) * 1e3 / 50 for ms, b in zip(r["round_ms"], base)]
        assert math.isclose(r["extra_us_per_bucket"], statistics.median(extra), rel_tol=1e-12, abs_tol=1e-12), key
        if key != "no_hook":
            assert data[f"{key}_us"] == r["extra_us_per_bucket"], key
        if r["counterpart"] is not None:
            theirs = [(ms - b) * 1e3 / 50 for ms, b in zip(rows[r["counterpart"]]["round_ms"], base)]
            ratios = [a / b for a, b in zip(extra, theirs) if b > 0]
            expected = statistics.median(ratios) if ratios else None
            assert r["ratio"] == expected or math.isclose(r["ratio"], expected, rel_tol=1e-12), key
    assert rows["no_hook"]["extra_us_per_bucket"] == 0
    assert data["fp32_ratio"] == rows["triton_fp32"]["ratio"] and data["bf16_ratio"] == rows["triton_bf16"]["ratio"]
    assert rows["triton_fp4"]["counterpart"] == "triton_fp8" and data["fp4_over_fp8_ratio"] == rows["triton_fp4"]["ratio"]
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
        assert list(rows) == [*quality.FORMATS, *quality.FSDP_FORMATS], name
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


def test_unused_residuals_benchmark_smoke(capsys):
    """A head used on every step is never exchanged as zeros: "dropped" and "kept" then see the same gradients and
    give the same error; used on some steps, dropping the residuals of the others costs accuracy."""
    unused = _import_bench("unused_residuals")
    always = unused.run(1.0, ranks=4, steps=6)
    assert always["used_steps"] == 6 and always["dropped"] == always["kept"] > 0
    assert unused.main(["--json", "--steps", "8", "--ranks", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["by_fraction_used"]) == {"0.5", "0.1", "0.01"}
    assert data["by_fraction_used"]["0.5"]["used_steps"] > 0  # seed 0
    for fraction, row in data["by_fraction_used"].items():
        assert 0 <= row["used_steps"] <= 8, fraction
        if row["used_steps"]:  # else nothing was applied or exact: 0 / 0
            assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("dropped", "kept", "no error feedback")), row


def test_host_us_per_call_gc_off_collects_nothing_while_timing():
    """``gc_off`` (bench.hook_cost's blocks of steps): the warm-up calls run as usual, the timed ones with the
    collector off, and it is on again afterwards, also when a timed call raises."""
    import gc

    import pytest
    import torch

    common = _import_bench("common")
    seen = []
    us = common.host_us_per_call(lambda: seen.append(gc.isenabled()), torch.device("cpu"), calls=5, warmup=2,
                                 gc_off=True)
    assert seen == [True, True, False, False, False, False, False] and gc.isenabled() and timed(us)

    def fails():
        raise RuntimeError("a step failed")

    with pytest.raises(RuntimeError, match="a step failed"):
        common.host_us_per_call(fails, torch.device("cpu"), calls=3, warmup=0, gc_off=True)
    assert gc.isenabled()


def test_json_text_puts_flat_lists_on_one_line_and_reads_back():
    common = _import_bench("common")
    data = {"curve": [1.5, -2e-07, 3], "words": ["inf", "fp8e4m3+ef"], "kept": ["a, b", "c"],
            "nested": [[1, 2], {"x": None}], "flags": [True, None]}
    text = common.json_text(data)
    assert json.loads(text) == data
    lines = text.splitlines()
    assert ' "curve": [1.5, -2e-07, 3],' in lines and ' "words": ["inf", "fp8e4m3+ef"],' in lines
    assert '  "a, b",' in lines  # a string with a comma is never split: its list keeps a line per item
    assert '  [1, 2],' in lines and ' "flags": [true, null]' in lines



def test_walk_of_the_plain_bucket_stays_a_short_straight_line():
    """bench.walk of the default bf16 bucket: at most 8 project calls in at most 3 modules (the hook, the plan, the
    kernel's pass), besides the hook's dropping of stale plans every fourth pass (state.py). A completion that ran on
    gloo's thread is not in a walk (bench.walk's docstring), so a walk may end at the pack."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "bench.walk"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    walks = re.findall(r"(\d+) of (\d+) backwards:\n(.*?)\n\d+ project calls in", out.stdout, re.S)
    assert sum(int(count) for count, _, _ in walks) == 10, out.stdout
    for _, _, lines in walks:
        calls = [tuple(line.strip().split(": ", 1)) for line in lines.splitlines()]
        on_path = [(module, function) for module, function in calls if "drop_stale_plans" not in function]
        assert [function for _, function in on_path[:2]] == ["triton_hook", "Plan.run"], out.stdout
        assert len(on_path) <= 8 and len({module for module, _ in on_path}) <= 3, out.stdout
        assert {module for module, _ in calls} - {module for module, _ in on_path} <= {"ddp_triton/runtime/state.py"}


def test_online_tuning_benchmark_smoke(tmp_path):
    """One rank, one rate (no cluster to change it): the online model tunes within 39 steps (four rounds of four
    formats and a mix), every model takes its turns, and the fp32 and online models step on until the loss step."""
    stdout, data = run(["bench.online_tuning", "--rates", "local", "--small", "--rounds", "1", "--steps", "2",
                        "--loss-step", "40"], tmp_path)
    (phase,) = data["phases"]
    assert phase["tuning"]["ended"] and phase["tuning"]["steps"] <= 39, phase["tuning"]
    assert sorted(phase["median_ms"]) == sorted(["fp32", "bf16", "bf16+fp32sum", "fp8e4m3+ef", "online"])
    assert all(timed(ms) for ms in phase["median_ms"].values())
    assert phase["online_over_best"] == phase["median_ms"]["online"] / phase["median_ms"][phase["best_single"]]
    assert len(data["losses"]["fp32"]) == 40 <= len(data["losses"]["online"])
    assert data["loss_at_step"]["online"] == data["losses"]["online"][39]
    assert "| local |" in stdout and "loss at step 40: fp32" in stdout


def test_timeline_peers_lag_is_the_last_rank_to_reach_its_last_bucket():
    timeline = _import_bench("timeline")
    recorded = {"origin_unix_s": 1000.0, "hooks": [{"ms": 5.0, "last": False}, {"ms": 20.0, "last": True}]}
    assert timeline.last_hook_unix_s(recorded) == 1000.02
    assert timeline.peers_lag_ms(1000.02, [1000.02, 1000.0, None, 1000.065]) == pytest.approx(45.0)
    assert timeline.peers_lag_ms(1000.02, [1000.0]) == 0.0  # every peer was earlier: nothing waited for
    assert timeline.peers_lag_ms(None, [1000.0]) is None


def test_fp4_lag_benchmark_smoke(tmp_path):
    """The lag study's written-out AdamW is torch's: fed the float32 average for both moments it trains as fp32."""
    from bench import fp4_lag

    out = tmp_path / "lag.json"
    assert fp4_lag.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert abs(rows["fp32 by hand"]["vs_fp32"]) < 1e-4
    assert rows["e2m1+ef"]["vs_fp32"] != 0.0  # the rounding moves the trajectory
    assert {f"e2m1+ef, exact {g}" for g in fp4_lag.EXACT_GROUPS} <= set(rows)
    # Every parameter named exact: no rounding anywhere, so the float32 average's losses to the bit.
    from bench import fp4_candidates
    from bench.quality import CharTask

    task, e2m1 = CharTask(True), lambda g: fp4_candidates.quantize(g, fp4_lag.SHIPPED)
    assert fp4_candidates.train(task, e2m1, 2, 5, exact=lambda name: True) == fp4_candidates.train(task, None, 2, 5)
