"""Launching the conversion kernels: through Triton's launcher, or bound once and replayed with little host work.

Triton's generic launcher re-binds and re-specialises every argument on every call (17-21 us of host time per
launch measured on an H200 host, shared/measurements/h200-2026-11-30-launch.json), which a DDP hook would pay at
every bucket on the training thread. A :class:`BoundLaunch` resolves the compiled kernel once for a fixed set of
arguments and afterwards calls its launcher directly. The launcher's calling convention changed in Triton 3.3
(constexpr arguments are passed too), so the bound path checks itself once per process against the generic
launcher and falls back to it, with a warning, if they ever disagree.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from . import _triton
from .convert import _contiguous_convert_kernel, _worklist_convert_kernel
from .worklist import Plan

logger = logging.getLogger("ddp_triton.kernels")

_direct_launch_ok: Optional[bool] = None  # None: not checked yet in this process


def kernel_arguments(
    plan: Plan,
    src_base: torch.Tensor,
    dst_base: torch.Tensor,
    scale: float,
    out_kind: int,
    stats: Optional[torch.Tensor],
) -> Tuple[Any, tuple, dict]:
    """(kernel, positional args, constexpr kwargs) of one launch; bfloat16 sources are read through their bits."""
    src_bf16 = src_base.dtype == torch.bfloat16
    if src_bf16:
        src_base = src_base.view(torch.int16)
    constexprs = dict(BLOCK=plan.block, APPLY_SCALE=scale != 1.0, SRC_BF16=src_bf16, OUT_KIND=out_kind,
                      STATS=stats is not None)
    stats_arg = stats if stats is not None else src_base  # never written when STATS is off
    if plan.table is None:
        return _contiguous_convert_kernel, (src_base, dst_base, plan.n_elements, scale, stats_arg), constexprs
    return _worklist_convert_kernel, (src_base, dst_base, plan.table, scale, stats_arg), constexprs


def launch(plan: Plan, kernel: Any, args: tuple, constexprs: dict) -> None:
    """One launch through Triton's own launcher (compiled on first use; the interpreter when it is on)."""
    if plan.n_items == 0:
        return
    kernel[(plan.n_items,)](*args, **constexprs, num_warps=plan.num_warps)


def _key_of(arg: Any) -> Any:
    """What identifies an argument for reuse: a tensor's dtype with its address (the compiled kernel depends on the
    pointer type), a float's exact bits (-0.0 is not 0.0)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr()
    if isinstance(arg, float):
        return arg.hex()
    return arg


def _as_int(arg):
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


class BoundLaunch:
    """A launch whose arguments are fixed; calling it launches again on the current CUDA stream.

    Holds references to all its tensors (``keepalive``: the work table has the addresses of tensors that are not
    arguments), so they stay alive as long as the launch does. In the interpreter, or when
    the direct launch is unavailable, it goes through Triton's launcher.
    """

    def __init__(self, plan: Plan, kernel: Any, args: tuple, constexprs: dict, keepalive: Sequence = ()) -> None:
        self._plan, self._kernel, self._args, self._constexprs = plan, kernel, args, constexprs
        self._keepalive = tuple(keepalive)  # every tensor whose address is baked into the launch
        self._direct: Optional[Callable[[], None]] = None
        device = args[0].device
        if device.type == "cuda" and plan.n_items and not _triton.INTERPRETER:
            self._direct = _bind_direct(plan, kernel, args, constexprs, device)

    def __call__(self) -> None:
        if self._direct is not None:
            self._direct()
        else:
            launch(self._plan, self._kernel, self._args, self._constexprs)


class OneShotLaunches:
    """Launches for calls that are not bound (plain ``pack``/``unpack``): the direct launch of each set of argument
    values seen recently, so a caller repeating a layout skips Triton's argument handling too.

    Keyed by every value the launch bakes in (addresses, sizes, scale, constexprs): a hit means the same memory and
    layout, which this call has just validated. Entries hold no tensors, only the plan whose work table the launch
    reads.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._entries: "OrderedDict[tuple, Tuple[Callable[[], None], Plan]]" = OrderedDict()
        self._capacity = capacity

    def __call__(self, plan: Plan, kernel: Any, args: tuple, constexprs: dict) -> None:
        device = args[0].device
        if device.type != "cuda" or _triton.INTERPRETER or plan.n_items == 0:
            launch(plan, kernel, args, constexprs)
            return
        key = (id(kernel), plan.n_items, plan.num_warps, tuple(_key_of(a) for a in args), tuple(constexprs.items()))
        entry = self._entries.get(key)
        if entry is None:
            direct = _bind_direct(plan, kernel, args, constexprs, device)
            if direct is None:
                launch(plan, kernel, args, constexprs)
                return
            entry = self._entries[key] = (direct, plan)
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        entry[0]()


ONE_SHOT = OneShotLaunches()


def _launcher_values(kernel: Any, args: tuple, constexprs: dict) -> list:
    """The argument list a compiled kernel's launcher takes: before Triton 3.3 the non-constexpr arguments, since
    then every argument of the signature in order (the launcher skips the constexprs)."""
    values = [_as_int(a) for a in args]
    if _triton.version_tuple() >= (3, 3):
        values += [constexprs[name] for name in kernel.arg_names[len(args):]]
    return values


class _DirectLaunch:
    """The compiled kernel's launcher with every argument fixed. Keeps ``compiled`` alive: its destructor unloads
    the module that ``function`` lives in."""

    __slots__ = ("compiled", "run", "grid", "index", "function", "metadata", "values", "current_stream")

    def __init__(self, compiled: Any, run: Callable, function: Any, metadata: Any, grid: int, index: int,
                 values: list) -> None:
        self.compiled, self.run, self.function, self.metadata = compiled, run, function, metadata
        self.grid, self.index, self.values = grid, index, tuple(values)
        self.current_stream = _raw_stream_getter()

    def __call__(self) -> None:
        self.run(self.grid, 1, 1, self.current_stream(self.index), self.function, self.metadata, None, None, None,
                 *self.values)


def _raw_stream_getter() -> Callable[[int], int]:
    """device index -> the current CUDA stream's handle; torch's private getter (what Triton itself calls) skips
    building a Stream object per call."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _bind_direct(plan: Plan, kernel: Any, args: tuple, constexprs: dict,
                 device: torch.device) -> Optional[Callable[[], None]]:
    """A closure that launches the compiled kernel without Triton's per-call argument handling, or None."""
    global _direct_launch_ok
    if _direct_launch_ok is False or (plan.table is None and plan.n_elements == 1):
        return None  # a size of 1 is specialised away as a constant: not worth a second convention
    try:
        if _direct_launch_ok is None:
            _direct_launch_ok = True  # provisionally, so that the self-check's own binds take this path
            with torch.cuda.device(device):  # Triton's launcher, which the check compares with, uses this device
                _direct_launch_ok = _self_check(device)
            if not _direct_launch_ok:
                return None
        with torch.cuda.device(device):  # compile and load the binary into the tensors' device's context
            compiled = kernel.warmup(*args, **constexprs, num_warps=plan.num_warps, grid=(plan.n_items,))
            if hasattr(compiled, "result"):  # Triton 3.6 hands back a future under asynchronous compilation
                compiled = compiled.result()
            run = compiled.run  # first: reading it loads the binary, which sets compiled.function
        function, metadata, grid = compiled.function, compiled.packed_metadata, plan.n_items
        return _DirectLaunch(compiled, run, function, metadata, grid, device.index,
                             _launcher_values(kernel, args, constexprs))
    except Exception as exc:  # any incompatibility with this Triton version: keep working, just slower
        _direct_launch_ok = False
        logger.warning("direct kernel launch unavailable (%s: %s); using Triton's launcher", type(exc).__name__, exc)
        return None


def _self_check(device: torch.device) -> bool:
    """Pack through both launch paths, for both kernels, and compare bits; False (and a warning) if they differ."""
    from .worklist import build_plan  # local: avoids an import cycle at module load

    gen = torch.Generator(device=device).manual_seed(0)
    layouts = ([torch.randn(n, device=device, generator=gen) for n in (3000, 17, 5000)],  # the work-list kernel
               [torch.randn(8017, device=device, generator=gen)])  # the contiguous kernel
    for src in layouts:
        expected = torch.empty(8017, dtype=torch.int16, device=device)
        got = torch.full_like(expected, -1)
        plan = build_plan(src, expected, True, device)
        kernel, args, constexprs = kernel_arguments(plan, src[0], expected, 0.125, 0, None)
        launch(plan, kernel, args, constexprs)
        kernel, args, constexprs = kernel_arguments(plan, src[0], got, 0.125, 0, None)
        bound = _bind_direct(plan, kernel, args, constexprs, device)
        if bound is None:
            return False
        bound()
        torch.cuda.synchronize(device)
        if not torch.equal(expected, got):
            logger.warning("direct kernel launch disagreed with Triton's launcher; using Triton's launcher")
            return False
    return True
