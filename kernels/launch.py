"""Launching the work-list kernel: through Triton's launcher, or bound once and replayed with little host work.

Triton's generic launcher re-binds and re-specialises every argument on every call (17-21 us of host time per
launch measured on an H200 host, shared/measurements/h200-2026-11-30-launch.json), which a DDP hook would pay at
every bucket on the training thread. A :class:`BoundLaunch` resolves the compiled kernel once for a fixed set of
arguments and afterwards calls its launcher directly. The launcher's calling convention changed in Triton 3.3
(constexpr arguments are passed too), so the bound path checks itself once per process against the generic
launcher and falls back to it, with a warning, if they ever disagree.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from . import _triton
from .convert import _worklist_convert_kernel
from .worklist import Plan

logger = logging.getLogger("ddp_triton.kernels")

_PARAMS = ("src_base", "dst_base", "table", "scale", "stats")
_CONSTEXPRS = ("BLOCK", "ALIGNED", "APPLY_SCALE", "SRC_BF16", "OUT_KIND", "STATS")

_direct_launch_ok: Optional[bool] = None  # None: not checked yet in this process


def kernel_arguments(
    plan: Plan,
    src_base: torch.Tensor,
    dst_base: torch.Tensor,
    scale: float,
    out_kind: int,
    stats: Optional[torch.Tensor],
) -> tuple:
    """(positional args, constexpr kwargs) of one launch; bfloat16 sources are read through their int16 bits."""
    src_bf16 = src_base.dtype == torch.bfloat16
    if src_bf16:
        src_base = src_base.view(torch.int16)
    args = (src_base, dst_base, plan.table, scale, stats if stats is not None else plan.table)
    constexprs = dict(
        BLOCK=plan.block,
        ALIGNED=plan.aligned,
        APPLY_SCALE=scale != 1.0,
        SRC_BF16=src_bf16,
        OUT_KIND=out_kind,
        STATS=stats is not None,
    )
    return args, constexprs


def launch(plan: Plan, args: tuple, constexprs: dict) -> None:
    """One launch through Triton's own launcher (compiled on first use; the interpreter when it is on)."""
    if plan.n_items == 0:
        return
    _worklist_convert_kernel[(plan.n_items,)](*args, **constexprs, num_warps=plan.num_warps)


def _as_int(arg):
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


class BoundLaunch:
    """A launch whose arguments are fixed; calling it launches again on the current CUDA stream.

    Holds references to its tensors, so they stay alive as long as the launch does. On CPU (torch path or
    interpreter) it simply replays ``fallback``.
    """

    def __init__(self, plan: Plan, args: tuple, constexprs: dict, fallback: Callable[[], None]) -> None:
        self._plan = plan
        self._args = args
        self._constexprs = constexprs
        self._fallback = fallback
        self._direct: Optional[Callable[[], None]] = None
        device = args[2].device
        if device.type == "cuda" and plan.n_items and not _triton.INTERPRETER:
            self._direct = _bind_direct(plan, args, constexprs, device)

    def __call__(self) -> None:
        if self._direct is not None:
            self._direct()
        else:
            self._fallback()


def _bind_direct(plan: Plan, args: tuple, constexprs: dict, device: torch.device) -> Optional[Callable[[], None]]:
    """A closure that launches the compiled kernel without Triton's per-call argument handling, or None."""
    global _direct_launch_ok
    if _direct_launch_ok is False:
        return None
    try:
        with torch.cuda.device(device):
            compiled = _worklist_convert_kernel.warmup(
                *args, **constexprs, num_warps=plan.num_warps, grid=(plan.n_items,)
            )
        values = [_as_int(a) for a in args]
        if _triton.version_tuple() >= (3, 3):
            values += [constexprs[name] for name in _CONSTEXPRS]
        run = compiled.run  # first: reading it loads the binary, which sets compiled.function
        function, metadata, grid = compiled.function, compiled.packed_metadata, plan.n_items
        index = device.index

        def direct() -> None:
            stream = torch.cuda.current_stream(index).cuda_stream
            run(grid, 1, 1, stream, function, metadata, None, None, None, *values)

        if _direct_launch_ok is None:
            _direct_launch_ok = _self_check(device)
            if not _direct_launch_ok:
                return None
        return direct
    except Exception as exc:  # any incompatibility with this Triton version: keep working, just slower
        _direct_launch_ok = False
        logger.warning("direct kernel launch unavailable (%s: %s); using Triton's launcher", type(exc).__name__, exc)
        return None


def _self_check(device: torch.device) -> bool:
    """Run a small pack through both launch paths and compare bits; False (and a warning) if they differ."""
    from .worklist import build_plan  # local: avoids an import cycle at module load

    global _direct_launch_ok
    _direct_launch_ok = True  # let the nested bind below take the direct path
    src = [torch.randn(n, device=device) for n in (3000, 17, 5000)]
    expected = torch.empty(8017, dtype=torch.int16, device=device)
    got = torch.full_like(expected, -1)
    plan = build_plan(src, expected, True, device)
    for out, direct in ((expected, False), (got, True)):
        args, constexprs = kernel_arguments(plan, src[0], out, 0.125, 0, None)
        if direct:
            bound = _bind_direct(plan, args, constexprs, device)
            if bound is None:
                return False
            bound()
        else:
            launch(plan, args, constexprs)
    torch.cuda.synchronize(device)
    ok = bool(torch.equal(expected, got))
    if not ok:
        logger.warning("direct kernel launch disagreed with Triton's launcher; using Triton's launcher")
    return ok
