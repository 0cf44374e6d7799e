"""Record a chrome trace of DDP training steps for ``python -m bench.ddp_step --profile``: the profiler's set-up,
a range around every comm hook's call, the recorded steps. bench/ddp_profile.py reads the trace back.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.common import sync
from bench.ddp_profile import STEP_RANGE


def hook_in_range(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` inside a profiler range ``ddp_step.hook bucket N``: the host time of the whole call, for any hook.

    ``functools.wraps`` keeps the name and (through ``__wrapped__``) the signature DDP checks at registration."""

    @functools.wraps(hook)
    def ranged(state: Any, bucket: Any) -> Any:
        with torch.profiler.record_function(f"ddp_step.hook bucket {bucket.index()}"):
            return hook(state, bucket)

    return ranged


def range_hooks(ddp: DDP) -> None:
    """Make every comm hook registered on ``ddp`` from now on (``ddp_triton.register``'s too) run in
    ``hook_in_range``: DDP's reducer takes one hook, so it must be wrapped before it is registered."""
    register_comm_hook = ddp.register_comm_hook

    def register_in_range(state: object, hook: Callable[..., Any]) -> None:
        register_comm_hook(state, hook_in_range(hook))

    ddp.register_comm_hook = register_in_range  # type: ignore[method-assign]


def start_profiler(device: torch.device, steps: int) -> Tuple[Any, bool, Optional[str]]:
    """A started ``torch.profiler.profile`` (CPU, and CUDA on a GPU) that records ``steps`` steps after one step of
    its own warm-up (the first step under a profiler pays for its set-up; ``prof.step()`` after each step), on every
    thread where this torch can.

    Returns (profiler, whether it records every thread, a note when it does not). Without every thread, what gloo
    runs on its own thread (unpacks completing late) is missing from the trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    options: Dict[str, Any] = {"activities": activities,
                               "schedule": torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)}
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # torch before profile_all_threads
        config = None
    if config is not None:
        prof = torch.profiler.profile(experimental_config=config, **options)
        try:
            prof.start()
            return prof, True, None
        except RuntimeError as e:
            note = f"the profiler refused to record every thread ({e}); recorded the calling thread's only"
    else:
        note = f"torch {torch.__version__} cannot record every thread: ranges on other threads are missing"
    prof = torch.profiler.profile(**options)
    prof.start()
    return prof, False, note


def safe_name(*parts: Any) -> str:
    """A file name of letters, digits, '.', '_' and '-' only, from ``parts`` joined by '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(str(p) for p in parts))



def record_trace(step: Callable[[], None], steps: int, warmup: int, device: torch.device,
                 trace_path: Path) -> Tuple[bool, Optional[str]]:
    """Run ``warmup`` steps, then record ``steps`` synchronised steps (each in a ``ddp_step.step`` range, after the
    profiler's own warm-up step) and write the chrome trace to ``trace_path``. Returns (every thread recorded, a
    note when not)."""
    for _ in range(warmup):
        step()
    sync(device)
    prof, all_threads, note = start_profiler(device, steps)
    try:
        for _ in range(1 + steps):  # the profiler's warm-up step, then the recorded ones
            with torch.profiler.record_function(STEP_RANGE):
                step()
                sync(device)  # inside the step's range: its GPU work ends within it
            prof.step()
    finally:
        prof.stop()
    prof.export_chrome_trace(str(trace_path))
    return all_threads, note
