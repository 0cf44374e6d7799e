"""Launching the kernels: through Triton's launcher, or directly through the compiled kernel's launcher.

Triton's generic launcher re-binds and re-specialises every argument on every call (17-21 us of host time per
launch measured on the lent H200's host on 2026-11-30, torch 2.11, Triton 3.6), which a DDP hook would pay at
every bucket on the training thread. A :class:`_DirectLaunch` holds the compiled kernel's own launcher and hands it
argument values directly; a prepared call (``prepared.py``) compiles one for the tensors it runs on. The launcher's
calling convention changed in Triton 3.3 (constexpr arguments are passed too), so the direct launch checks itself
once per process against the generic launcher and is not used, with a warning, if they ever disagree.

What a launch runs over is a ``plan``: a work-list :class:`~.worklist.Plan` for pack and unpack, a :class:`Grid` for
the wire-format kernels; both give ``n_items`` (programs), ``num_warps`` and ``options`` (compile options).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _triton
from .convert import _contiguous_convert_kernel, _worklist_convert_kernel
from .worklist import Plan, build_plan

logger = logging.getLogger("ddp_triton.kernels")

_direct_launch_ok: Optional[bool] = None  # None: not checked yet in this process
_SELF_CHECK_LOCK = threading.Lock()


@dataclass(frozen=True)
class Grid:
    """A one-dimensional launch of ``n_items`` programs of ``num_warps`` warps; ``options``: compile options as
    (name, value) pairs, such as ``("enable_fp_fusion", False)``."""

    n_items: int
    num_warps: int
    options: Tuple[Tuple[str, Any], ...] = ()


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
                      STATS=stats is not None, HW_CONVERT=not _triton.INTERPRETER)
    stats_arg = stats if stats is not None else src_base  # never written when STATS is off
    if plan.table is None:
        return _contiguous_convert_kernel, (src_base, dst_base, plan.n_elements, scale, stats_arg), constexprs
    return _worklist_convert_kernel, (src_base, dst_base, plan.table, scale, stats_arg), constexprs


def launch(plan: Plan, kernel: Any, args: tuple, constexprs: dict) -> None:
    """One launch through Triton's own launcher (compiled on first use; the interpreter when it is on)."""
    if plan.n_items == 0:
        return
    with _triton.serialized():
        kernel[(plan.n_items,)](*args, **constexprs, num_warps=plan.num_warps, **dict(plan.options))


def _as_int(arg):
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def _launcher_values(kernel: Any, args: tuple, constexprs: dict) -> list:
    """The argument list a compiled kernel's launcher takes: before Triton 3.3 the non-constexpr arguments, since
    then every argument of the signature in order (the launcher skips the constexprs)."""
    values = [_as_int(a) for a in args]
    if _triton.version_tuple() >= (3, 3):
        values += [constexprs[name] for name in kernel.arg_names[len(args):]]
    return values


class _DirectLaunch:
    """The compiled kernel's launcher, launched on its tensors' device whatever device is current on the calling
    thread: with the argument values it was compiled for (``values``; the self-check's launch), or with each call's
    (``launch_with``; a prepared call, which clears ``values``, so that it cannot launch on a past call's addresses).
    Keeps ``compiled`` alive: its destructor unloads the module that ``function`` lives in."""

    __slots__ = ("compiled", "run", "grid", "index", "function", "metadata", "values", "current_stream",
                 "current_device")

    def __init__(self, compiled: Any, run: Callable, function: Any, metadata: Any, grid: int, index: int,
                 values: list) -> None:
        self.compiled, self.run, self.function, self.metadata = compiled, run, function, metadata
        self.grid, self.index, self.values = grid, index, tuple(values)
        self.current_stream = _raw_stream_getter()
        self.current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

    def __call__(self) -> None:
        self.launch_with(self.values)

    def launch_with(self, values: Sequence) -> None:
        """Launch with these argument values (the launcher's list, as :func:`_launcher_values` gives it), which must
        be of the specialisation it was compiled for."""
        if self.current_device() != self.index:
            with torch.cuda.device(self.index):  # the C launcher uses the thread's current context
                self._launch(values)
        else:
            self._launch(values)

    def _launch(self, values: Sequence) -> None:
        self.run(self.grid, 1, 1, self.current_stream(self.index), self.function, self.metadata, None, None, None,
                 *values)


def _hook_holder() -> Any:
    """Where this Triton keeps its launch hooks: ``knobs.runtime`` from 3.4, ``CompiledKernel`` before."""
    knobs = getattr(_triton.triton, "knobs", None) if _triton.AVAILABLE else None
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "launch_enter_hook"):
        return runtime
    if _triton.AVAILABLE:
        from triton.compiler.compiler import CompiledKernel

        return CompiledKernel
    return None


_HOOKS = _hook_holder()


def _hook_set(hook: Any) -> bool:
    # A plain callable (Triton < 3.5) or a chain of them that is set when it holds any (3.5 on).
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook (Proton, a profiler) is installed: launches then go through Triton's launcher,
    which calls it."""
    return _HOOKS is not None and (_hook_set(getattr(_HOOKS, "launch_enter_hook", None))
                                   or _hook_set(getattr(_HOOKS, "launch_exit_hook", None)))


def _raw_stream_getter() -> Callable[[int], int]:
    """device index -> the current CUDA stream's handle; torch's private getter (what Triton itself calls) skips
    building a Stream object per call."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _can_launch_directly(plan: Plan, args: tuple) -> bool:
    """Whether a launch of ``args`` may go direct: CUDA tensors, compiled kernels, something to launch."""
    return args[0].device.type == "cuda" and not _triton.INTERPRETER and plan.n_items > 0


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _direct_launch_available(device: torch.device) -> Optional[bool]:
    """Whether the direct launch passed its self-check in this process; None while undecided because the current
    stream is being captured into a CUDA graph (the check synchronises, which capture forbids)."""
    global _direct_launch_ok
    if _direct_launch_ok is not None:
        return _direct_launch_ok
    if _capturing():
        return None
    with _SELF_CHECK_LOCK:
        if _direct_launch_ok is None:
            try:
                with torch.cuda.device(device):  # Triton's launcher, which the check compares with, uses this device
                    _direct_launch_ok = _self_check(device)
            except Exception as exc:  # any incompatibility with this Triton version: keep working, just slower
                logger.warning("direct kernel launch unavailable (%s: %s); using Triton's launcher",
                               type(exc).__name__, exc)
                _direct_launch_ok = False
    return _direct_launch_ok


def _bind_direct(plan: Plan, kernel: Any, args: tuple, constexprs: dict,
                 device: torch.device) -> Optional["_DirectLaunch"]:
    """The compiled kernel's direct launch for these arguments (no per-call argument handling by Triton), or None
    (use Triton's launcher): for an int Triton makes a constant, or when the self-check failed or cannot run yet
    (CUDA graph capture)."""
    if any(type(a) is int and a == 1 for a in args):
        return None  # Triton specialises an int of 1 into a constant, which changes the launcher's arguments
    if not _direct_launch_available(device):
        return None
    try:
        return _compile_direct(plan, kernel, args, constexprs, device)
    except Exception as exc:
        global _direct_launch_ok
        _direct_launch_ok = False
        logger.warning("direct kernel launch unavailable (%s: %s); using Triton's launcher", type(exc).__name__, exc)
        return None


def _compile_direct(plan: Plan, kernel: Any, args: tuple, constexprs: dict, device: torch.device) -> "_DirectLaunch":
    with torch.cuda.device(device):  # compile and load the binary into the tensors' device's context
        compiled = kernel.warmup(*args, **constexprs, num_warps=plan.num_warps, grid=(plan.n_items,),
                                 **dict(plan.options))
        if hasattr(compiled, "result"):  # Triton 3.6 hands back a future under asynchronous compilation
            compiled = compiled.result()
        run = compiled.run  # first: reading it loads the binary, which sets compiled.function
    return _DirectLaunch(compiled, run, compiled.function, compiled.packed_metadata, plan.n_items, device.index,
                         _launcher_values(kernel, args, constexprs))


def _self_check(device: torch.device) -> bool:
    """Pack through both launch paths, for both kernels, and compare bits; False (and a warning) if they differ."""
    gen = torch.Generator(device=device).manual_seed(0)
    # A misaligned full block (flat offset 3017) beside aligned ones, then one contiguous run with a tail.
    layouts = ([torch.randn(n, device=device, generator=gen) for n in (3000, 17, 5000)],  # the work-list kernel
               [torch.randn(8017, device=device, generator=gen)])  # the contiguous kernel
    for src in layouts:
        expected = torch.empty(8017, dtype=torch.int16, device=device)
        got = torch.full_like(expected, -1)
        plan = build_plan(src, expected, True, device)
        kernel, args, constexprs = kernel_arguments(plan, src[0], expected, 0.125, 0, None)
        launch(plan, kernel, args, constexprs)
        kernel, args, constexprs = kernel_arguments(plan, src[0], got, 0.125, 0, None)
        _compile_direct(plan, kernel, args, constexprs, device)()
        torch.cuda.synchronize(device)
        if not torch.equal(expected, got):
            logger.warning("direct kernel launch disagreed with Triton's launcher; using Triton's launcher")
            return False
    return True


class KernelCall(NamedTuple):
    """One call of a kernel, built for its tensors, that may also run on the torch CPU path: there ``torch_path``
    (the pass over those tensors, to run once or again); otherwise
    ``launch`` (plan, kernel, args, constexprs), then ``after`` if given (work queued behind the kernel, such as
    summing its partial statistics)."""

    torch_path: Optional[Callable[[], None]] = None
    launch: Optional[Tuple[Any, Any, tuple, dict]] = None
    after: Optional[Callable[[], None]] = None


def run_call(call: KernelCall) -> None:
    """Do ``call`` once, through Triton's launcher (a plain call: nothing is kept)."""
    if call.torch_path is not None:
        call.torch_path()
        return
    launch(*call.launch)
    if call.after is not None:
        call.after()
