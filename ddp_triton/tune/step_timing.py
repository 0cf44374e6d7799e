"""Timing real DDP training steps of the user's model, for candidate bucket sizes and comm hooks.

``run_e2e``: DDP steps of the model a ``MODULE:FUNCTION`` factory makes (contract in ``load_factory``) under each
hook and bucket size; the median step time of the slowest rank decides. The only part of the tuner that needs the
hook itself.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..machine.profile import Profile
from ..runtime.algo_groups import collective_device
from .e2e_hooks import E2E_HOOKS


def load_factory(spec: str) -> Callable[[], Tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]]:
    """Import ``MODULE:FUNCTION`` for e2e mode; ValueError with the reason if it cannot be had.

    The contract: ``FUNCTION()`` takes no arguments and returns ``(model, loss_fn)``: an ``nn.Module`` (any device;
    it is moved to this rank's device) and ``loss_fn(model) -> scalar tensor`` that makes one batch on the model's
    device (``next(model.parameters()).device``), runs the forward pass and returns the loss. Every rank calls it;
    DDP broadcasts rank 0's weights, so the model needs no seeding, but its parameters must be the same shapes.
    """
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--e2e wants MODULE:FUNCTION, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a model file next to where the user runs the command
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ValueError(f"cannot import {module!r} for --e2e: {e.__class__.__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{module!r} has no function {name!r} for --e2e")
    return fn


def _register_hook(ddp: Any, hook: str, profile_dict: Optional[Dict[str, Any]]) -> None:
    if hook == "allreduce":
        return
    if hook == "bf16_compress":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return
    if hook == "triton":
        # Here, not at the top: the hook loads Triton, which only timing this hook needs (``autotune --model-only``
        # and the CLI's checks of --hooks import this module too).
        from ..runtime.hook import triton_hook
        from ..runtime.state import CommState

        prof = Profile.from_dict(profile_dict) if profile_dict else None
        ddp.register_comm_hook(CommState(process_group=None, comm_dtype=torch.bfloat16, profile=prof), triton_hook)
        return
    raise ValueError(f"unknown hook {hook!r}; known: {', '.join(E2E_HOOKS)}")


def _time_steps(ddp: Any, loss_fn: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer, warmup: int,
                steps: int, device: torch.device) -> List[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(ddp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_e2e(factory_spec: str, bucket_mbs: Optional[Sequence[float]], hooks: Sequence[str], warmup: int,
            steps: int, profile_dict: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Time DDP steps for every (hook, bucket_cap_mb); every rank returns the same result dict.

    ``bucket_mbs`` None: ``e2e_bucket_candidates`` around the profile's bucket_cap_mb (25 without a profile).

    Result: ``{"model_bytes", "candidates": [{"hook", "bucket_cap_mb", "step_ms"} or {..., "error"}], "winner"}``
    with the slowest rank's median step time per candidate. A hook that cannot be had (import error) is skipped
    with its reason (the hook's own checks, e.g. torch's bf16 hook wants CUDA and NCCL); an error inside a step is
    raised (it would leave the ranks out of step).
    """
    device = collective_device(dist.group.WORLD)
    factory = load_factory(factory_spec)
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)
            and callable(made[1])):
        raise ValueError(f"{factory_spec} must return (model: nn.Module, loss_fn), got {type(made).__name__}")
    base_model, loss_fn = made
    base_model = base_model.to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in base_model.parameters() if p.requires_grad)
    if bucket_mbs is None:
        base_mb = float(profile_dict["bucket_cap_mb"]) if profile_dict else 25.0
        bucket_mbs = e2e_bucket_candidates(base_mb, model_bytes)
    candidates: List[Dict[str, Any]] = []
    medians: List[float] = []
    for hook in hooks:
        for mb in bucket_mbs:
            model = copy.deepcopy(base_model)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=mb,
                      gradient_as_bucket_view=True)
            try:
                # Local checks only (imports, torch's hook preconditions): every rank fails alike, none waits.
                _register_hook(ddp, hook, profile_dict)
            except Exception as e:
                candidates.append({"hook": hook, "bucket_cap_mb": None, "error": f"{e.__class__.__name__}: {e}"})
                break
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
            times = _time_steps(ddp, loss_fn, opt, warmup, steps, device)
            candidates.append({"hook": hook, "bucket_cap_mb": mb})
            medians.append(statistics.median(times))
            del ddp, model, opt
    timed = [c for c in candidates if "error" not in c]
    if not timed:
        raise RuntimeError(f"no e2e candidate could run: {candidates}")
    stats = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    for c, ms in zip(timed, stats.tolist()):
        c["step_ms"] = ms
    winner = min(timed, key=lambda c: c["step_ms"])
    return {"factory": factory_spec, "warmup": warmup, "steps": steps, "model_bytes": model_bytes,
            "world_size": dist.get_world_size(), "candidates": candidates, "winner": dict(winner),
            "gradient_as_bucket_view": True}


def e2e_bucket_candidates(base_mb: float, model_bytes: int) -> List[float]:
    """Bucket sizes to try: the profile's choice, half and twice it, and DDP's default 25 MiB, none above the
    model's size (one bucket holds everything there)."""
    model_mb = max(model_bytes / (1 << 20), 1e-3)
    picks = {round(x, 4) for x in (base_mb / 2, base_mb, base_mb * 2, 25.0)}
    return sorted({min(x, round(model_mb, 4)) for x in picks if x > 0 and math.isfinite(x)})
