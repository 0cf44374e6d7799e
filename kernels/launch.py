"""Launching the kernels: through Triton's launcher, bound once and replayed, or prepared once and run on new tensors.

Triton's generic launcher re-binds and re-specialises every argument on every call (17-21 us of host time per
launch measured on the lent H200's host on 2026-11-30, torch 2.11, Triton 3.6), which a DDP hook would pay at
every bucket on the training thread. A :class:`BoundLaunch` resolves the compiled kernel once for a fixed set of
arguments and afterwards calls its launcher directly. The launcher's calling convention changed in Triton 3.3
(constexpr arguments are passed too), so the bound path checks itself once per process against the generic
launcher and falls back to it, with a warning, if they ever disagree.

A :class:`PreparedCall` is for buffers that are new at every call (FSDP's): checked once for tensors like its
examples, it compares each call's tensors with them and hands the compiled launcher their addresses.

What a launch runs over is a ``plan``: a work-list :class:`~.worklist.Plan` for pack and unpack, a :class:`Grid` for
the wire-format kernels; both give ``n_items`` (programs), ``num_warps`` and ``options`` (compile options).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _triton
from .convert import _contiguous_convert_kernel, _worklist_convert_kernel
from .validation import check_disjoint, describe_like, like_key
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


class BoundLaunch:
    """A launch whose arguments are fixed; calling it launches again on the current CUDA stream.

    Holds references to all its tensors (``keepalive``: the work table has the addresses of tensors that are not
    arguments), so they stay alive as long as the launch does. In the interpreter, while a launch hook (a profiler)
    is installed, or when the direct launch is unavailable, it goes through Triton's launcher. Bound during CUDA
    graph capture before the direct launch's self-check could run, it uses Triton's launcher (which the graph
    records) and binds directly at its first call outside capture.
    """

    def __init__(self, plan: Plan, kernel: Any, args: tuple, constexprs: dict, keepalive: Sequence = ()) -> None:
        self._plan, self._kernel, self._args, self._constexprs = plan, kernel, args, constexprs
        self._keepalive = tuple(keepalive)  # every tensor whose address is baked into the launch
        self._direct: Optional[Callable[[], None]] = None
        self._device = args[0].device
        self._bind_later = self._device.type == "cuda" and plan.n_items > 0 and not _triton.INTERPRETER
        if self._bind_later:
            self._try_bind()

    def _try_bind(self) -> None:
        if _direct_launch_ok is None and _capturing():
            return  # keep _bind_later: the self-check cannot run inside capture
        self._bind_later = False
        self._direct = _bind_direct(self._plan, self._kernel, self._args, self._constexprs, self._device)

    def __call__(self) -> None:
        if self._bind_later:
            self._try_bind()
        if self._direct is not None and not launch_hooks_installed():
            self._direct()
        else:
            launch(self._plan, self._kernel, self._args, self._constexprs)


def _launcher_values(kernel: Any, args: tuple, constexprs: dict) -> list:
    """The argument list a compiled kernel's launcher takes: before Triton 3.3 the non-constexpr arguments, since
    then every argument of the signature in order (the launcher skips the constexprs)."""
    values = [_as_int(a) for a in args]
    if _triton.version_tuple() >= (3, 3):
        values += [constexprs[name] for name in kernel.arg_names[len(args):]]
    return values


class _DirectLaunch:
    """The compiled kernel's launcher, launched on its tensors' device whatever device is current on the calling
    thread: with the argument values it was bound with (``values``; a bound launch), or with each call's
    (``launch_with``; a prepared call, which binds it with none, so that it cannot launch on a past call's
    addresses). Keeps ``compiled`` alive: its destructor unloads the module that ``function`` lives in."""

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
    return args[0].device.type == "cuda" and not _triton.INTERPRETER and plan.n_items > 0


def direct_launch(plan: Plan, kernel: Any, args: tuple, constexprs: dict) -> Optional[Callable[[], None]]:
    """The compiled kernel's direct launch for these argument values, holding no tensor (their addresses are baked
    in), or None where Triton's launcher must be used: not CUDA, the interpreter, nothing to launch, or no direct
    launch (self-check failed, or not yet possible inside CUDA graph capture)."""
    if not _can_launch_directly(plan, args):
        return None
    return _bind_direct(plan, kernel, args, constexprs, args[0].device)


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
    """A closure that launches the compiled kernel without Triton's per-call argument handling, or None (use
    Triton's launcher): when the self-check failed or cannot run yet (CUDA graph capture)."""
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
    """One checked call of a kernel that may also run on the torch CPU path: there ``torch_path``; otherwise
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


def bind_call(call: KernelCall) -> Callable[[], None]:
    """``call`` as a callable to repeat: the kernel as a :class:`BoundLaunch` (direct on CUDA), holding its tensors."""
    if call.torch_path is not None:
        return call.torch_path
    kernel_launch = BoundLaunch(*call.launch)
    after = call.after
    if after is None:
        return kernel_launch

    def launch_then_after() -> None:
        kernel_launch()
        after()

    return launch_then_after


# ---- prepared calls: checked and compiled once, run on the caller's tensors of each call ------------------------


class _Specialised(NamedTuple):
    """A prepared call's direct launch for one alignment of its pointers: the launcher compiled for it, the values
    of its other arguments (fixed for a prepared call: they come from its sizes and settings; Triton specialises
    ints on their value) and the constexprs the launcher takes after them."""

    direct: _DirectLaunch
    others: tuple
    tail: tuple


class PreparedCall:
    """A kernel call checked once for tensors like its examples, then run on the tensors each call passes: a bound
    launch's host work for a caller whose buffers are new at every call (FSDP allocates its reduce-scatter's input
    and output each step), without holding them between calls.

    ``call(*tensors)`` takes the tensors in the order of ``names``. Each must be like its example in everything the
    full checks read (``like``: shape, dtype, device, contiguity, address modulo 4; None where the example was None),
    and no two may share memory; a call that differs is refused with a ValueError naming the tensor, before anything
    runs, and otherwise runs without the full checks. On CUDA each alignment of the pointers seen (16 bytes or not,
    which Triton specialises on; FSDP's buffers always have the same) is compiled once, at its first call, and the
    compiled kernel's launcher then takes each call's addresses directly (``_DirectLaunch.launch_with``). Calls go
    through Triton's launcher in the interpreter, with a launch hook installed, where the direct launch is
    unavailable, and for arguments Triton makes constants (an int of 1). On the torch path (CPU tensors) each call
    binds that path afresh: its views and closures.
    """

    def __init__(self, build: Callable[..., KernelCall], names: Sequence[str],
                 examples: Sequence[Optional[torch.Tensor]]) -> None:
        if len(names) != len(examples):
            raise TypeError(f"{len(names)} names for {len(examples)} example tensors")
        self._build, self._names = build, tuple(names)
        first = build(*examples, checked=True)  # every check of a plain call, naming any problem
        self._likes = PreparedCall.like(examples, self._names)
        check_disjoint(self._names, examples)
        self._sizes = tuple(0 if t is None else t.numel() * t.element_size() for t in examples)
        self._by_alignment: Dict[tuple, Optional[_Specialised]] = {}
        self._direct, self._pointers, self._others = False, (), ()
        self._last: Optional[tuple] = None  # (addresses, direct launch, values) of the last direct launch
        if first.launch is not None:
            plan, _, args, _ = first.launch
            self._direct = _can_launch_directly(plan, args)
            self._pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self._others = tuple(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))

    @staticmethod
    def like(tensors: Sequence[Optional[torch.Tensor]], names: Optional[Sequence[str]] = None) -> tuple:
        """What a prepared call compares of its tensors at every call (see the class docstring)."""
        names = names or [f"tensors[{i}]" for i in range(len(tensors))]
        return tuple(like_key(t, name) for t, name in zip(tensors, names))

    def _check(self, tensors: Sequence[Optional[torch.Tensor]], unlike_ok: bool = False) -> Optional[tuple]:
        """The tensors' addresses (0 for None), after checking that they are like the examples (else a ValueError,
        or None with ``unlike_ok``) and disjoint."""
        if len(tensors) != len(self._names):
            raise TypeError(f"this prepared call takes {len(self._names)} tensors ({', '.join(self._names)}), got "
                            f"{len(tensors)}")
        for name, want, tensor in zip(self._names, self._likes, tensors):
            got = like_key(tensor, name)
            if got != want:
                if unlike_ok:
                    return None
                raise ValueError(f"{name} is {describe_like(got)}; this call was prepared for {describe_like(want)}")
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        # Like-shaped tensors: each spans the bytes its example did (None, and empty tensors, span none).
        spans = sorted((address, size) for address, size in zip(addresses, self._sizes) if size)
        for (start, size), (next_start, _) in zip(spans, spans[1:]):
            if next_start < start + size:
                check_disjoint(self._names, tensors)  # names the pair
                raise ValueError(f"two of {', '.join(self._names)} overlap in memory")
        return addresses

    def _specialised(self, plan: Any, kernel: Any, args: tuple, constexprs: dict,
                     alignment: tuple) -> Optional[_Specialised]:
        """The direct launch for ``alignment``, compiled at its first call (None: Triton's launcher for it)."""
        if alignment in self._by_alignment:
            return self._by_alignment[alignment]
        if _direct_launch_ok is None and _capturing():
            return None  # the self-check cannot run inside CUDA graph capture: decide at a later call
        direct = _bind_direct(plan, kernel, args, constexprs, args[0].device)
        specialised = None
        if direct is not None:
            values = _launcher_values(kernel, args, constexprs)
            direct.values = ()  # it launches with each call's values only
            specialised = _Specialised(direct, tuple(values[i] for i in self._others), tuple(values[len(args):]))
        self._by_alignment[alignment] = specialised
        return specialised

    def __call__(self, *tensors: Optional[torch.Tensor]) -> None:
        self._run(tensors, self._check(tensors))

    def run_if_like(self, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
        """Run on ``tensors`` and return True if they are like the examples; return False, running nothing, if they
        are not (for a caller that keeps calls for several shapes). Other problems raise as a call does."""
        addresses = self._check(tensors, unlike_ok=True)
        if addresses is None:
            return False
        self._run(tensors, addresses)
        return True

    def _run(self, tensors: Sequence[Optional[torch.Tensor]], addresses: tuple) -> None:
        last = self._last
        if last is not None and last[0] == addresses and not launch_hooks_installed():
            # The same addresses as the last direct launch: the same values (the rest are the call's sizes and
            # settings, and the layout's table, which the build holds), so the same launch.
            last[1].launch_with(last[2])
            return
        call = self._build(*tensors, checked=False)
        if call.torch_path is not None:
            call.torch_path()
            return
        plan, kernel, args, constexprs = call.launch
        launched = False
        if self._direct and not launch_hooks_installed():
            values = [_as_int(a) for a in args]
            specialised = self._specialised(plan, kernel, args, constexprs,
                                            tuple(values[i] & 15 == 0 for i in self._pointers))
            if specialised is not None and tuple(values[i] for i in self._others) == specialised.others:
                values.extend(specialised.tail)
                specialised.direct.launch_with(values)
                if call.after is None:
                    self._last = (addresses, specialised.direct, values)
                launched = True
        if not launched:
            launch(plan, kernel, args, constexprs)
        if call.after is not None:
            call.after()
