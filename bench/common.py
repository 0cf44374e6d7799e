"""What every benchmark here shares: timing, printing (tables, progress), the machine's description, and writing
results."""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

if __package__ in (None, ""):  # run as a plain script: make `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_triton.versions import nccl_version_text, package_version  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
OUT_DIR = Path(__file__).resolve().parent / "out"


def environment(device: torch.device) -> Dict[str, Any]:
    """GPU name, software versions and the date: what a recorded number must carry."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,  # the build (+cpu, +cu130), which the distribution's version leaves out
        "triton": package_version("triton"),
        "nccl": nccl_version_text() if torch.cuda.is_available() else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }


def machine() -> Dict[str, Any]:
    """The host: platform, Python, CPU model and core count (what a CPU-timed number must carry)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count()}


@contextlib.contextmanager
def one_rank_gloo() -> Iterator[None]:
    """A 1-rank gloo process group on a FileStore in a temporary directory (no port), destroyed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def bench_us(fn: Callable[[], Any], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
             graph: bool = False) -> float:
    """Median microseconds per call: triton.testing.do_bench on CUDA, wall-clock median on CPU.

    ``graph``: replays of a CUDA graph holding ``fn`` (``do_bench_cudagraph``), so that the GPU time is measured
    even where launching from Python takes longer than the kernels run (small sizes, torch.compile's guards).
    """
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1000.0
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1000.0
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000.0
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only: CPU work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us_per_call(fn: Callable[[], Any], device: torch.device, calls: int = 2000, warmup: int = 200,
                     gc_off: bool = False) -> float:
    """Host microseconds per call over many calls, synchronised once at the end (the GPU is never the limit).
    ``gc_off``: collect garbage first and let no collection run during the timed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
    finally:
        if gc_off:
            gc.enable()
    sync(device)
    return elapsed / calls * 1e6


def time_calls(call: Callable[[], Any], calls: int, warmup: int, device: torch.device) -> List[float]:
    """Milliseconds of each of ``calls`` synchronised calls (training steps, graph replays), after ``warmup``
    untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (which also reads well in a terminal)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# A list of numbers, null/true/false or short words without commas ("inf", "fp8e4m3+ef"): printed on one line.
_ITEM = r'(?:-?[0-9][0-9.eE+-]*|-?Infinity|NaN|null|true|false|"[-0-9a-zE+. ]*")'
_FLAT_LIST = re.compile(rf"\[\s*({_ITEM}(?:\s*,\s*{_ITEM})*)\s*\]")


def json_text(payload: Any, allow_nan: bool = True) -> str:
    """Indented JSON with each flat list of numbers on one line (curves and rows would take a line per value).
    ``allow_nan=False``: strict JSON, a non-finite float is an error (write it as a string first)."""
    text = json.dumps(payload, indent=1, allow_nan=allow_nan, default=str)
    return _FLAT_LIST.sub(lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text) + "\n"


def write_json(path: Union[str, Path], payload: Any, allow_nan: bool = True) -> Path:
    """Write ``payload`` as :func:`json_text` to ``path`` (its folder created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(payload, allow_nan))
    return path


def save_json(name: str, payload: Dict[str, Any], out_dir: Optional[Union[str, Path]] = None) -> Path:
    """Write ``payload`` to ``bench/out/<name>-<time>.json`` (or ``out_dir``) and return the path."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return write_json(Path(out_dir if out_dir is not None else OUT_DIR) / f"{name}-{stamp}.json", payload)


PLOT_MISSING = "matplotlib is not installed (pip install -e '.[bench]'): no plot"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not installed (the ``bench``
    extra): a benchmark then prints :data:`PLOT_MISSING` and saves no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def progress(message: str) -> None:
    """One line on stderr, at once: a long benchmark says what it is doing (stdout keeps its tables)."""
    print(message, file=sys.stderr, flush=True)


def append_results(title: str, env: Dict[str, Any], tables: List[str], notes: Sequence[str] = (),
                   path: Path = RESULTS_MD) -> None:
    """Append a dated section to bench/RESULTS.md: the machine, the tables, and what they mean. Only when the
    user asks (``--append-results``): RESULTS.md is tracked, and a benchmark writes its results under bench/out."""
    header = (f"\n## {title}: {env['device']}, {env['date']}\n\n"
              f"torch {env['torch']}, triton {env['triton']}, NCCL {env['nccl']}.\n")
    body = "\n\n".join(tables)
    extra = "".join(f"\n- {n}" for n in notes)
    with open(path, "a") as f:
        f.write(header + "\n" + body + "\n" + (extra + "\n" if extra else ""))
