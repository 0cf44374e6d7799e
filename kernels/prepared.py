"""Prepared calls: a kernel call checked and compiled once for tensors like its examples, then run on the tensors
each call passes, or fixed to tensors its caller keeps.

The hot path's form of every operation (``pack.prepare(...)``, ``quantize_blocks.prepare(...)``, ...). An FSDP group
prepares its calls at its first reduce-scatter and calls them with each step's new buffers: a call compares its
tensors with the examples (about a microsecond a tensor) and runs without the full checks. A DDP bucket's buffers
live as long as its plan: ``call.fixed(*tensors)`` checks them once and gives the work on them as a call of no
arguments that compares nothing more (on CPU tensors the torch path's pass itself, on CUDA a direct launch), for
the per-step host cost of the work alone.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from . import launch as launching
from .validation import check_disjoint, describe_like, like_key


class _Specialised(NamedTuple):
    """A direct launch compiled for one specialisation: its launcher, the values of the arguments that are not
    pointers (fixed for a prepared call: they come from its sizes and settings; Triton specialises ints on their
    value) and the constexprs the launcher takes after the arguments."""

    direct: launching._DirectLaunch
    others: tuple
    tail: tuple


class _Relaunch:
    """A direct launch again, with the same argument values, then its ``after``; holds the work table its values
    point into (the plan)."""

    __slots__ = ("direct", "values", "plan", "after")

    def __init__(self, direct: launching._DirectLaunch, values: list, plan: Any,
                 after: Optional[Callable[[], None]]) -> None:
        self.direct, self.values, self.plan, self.after = direct, values, plan, after

    def __call__(self) -> None:
        self.direct.launch_with(self.values)
        if self.after is not None:
            self.after()


class _TritonLaunch:
    """A launch through Triton's launcher again, with the same arguments, then its ``after``."""

    __slots__ = ("arguments", "after")

    def __init__(self, arguments: Tuple[Any, Any, tuple, dict], after: Optional[Callable[[], None]]) -> None:
        self.arguments, self.after = arguments, after

    def __call__(self) -> None:
        launching.launch(*self.arguments)
        if self.after is not None:
            self.after()


class PreparedCall:
    """A kernel call checked once for tensors like its examples, then run on the tensors each call passes.

    ``call(*tensors)`` takes the tensors in the order of ``names``: a tensor, None where the example was None, a
    list of tensors where the example was a list. Each must be like its example in everything the full checks read
    (``like``: shape, dtype, device, contiguity, address modulo 4), and no two may share memory (unless
    ``disjoint`` is off: pack and unpack check their own overlaps, and run in place); a call that differs is refused
    with a ValueError naming the tensor, before anything runs, and otherwise runs without the full checks. On CUDA
    each specialisation seen (kernel, grid, and whether each pointer is 16-byte aligned, which Triton specialises
    on; FSDP's buffers always are) is compiled once, at its first call, and the compiled kernel's launcher then
    takes each call's addresses directly (``_DirectLaunch.launch_with``); a call at the last call's addresses
    relaunches its values. Calls go through Triton's launcher in the interpreter, with a launch hook installed,
    where the direct launch is unavailable, and for arguments Triton makes constants (an int of 1). On the torch
    path (CPU tensors) each call builds that path afresh: its views and scratch. A call holds none of its tensors
    after it returns.

    ``call.fixed(*tensors)``: the call on these tensors only, for a caller that keeps them (see :meth:`fixed`).
    """

    def __init__(self, build: Callable[..., launching.KernelCall], names: Sequence[str],
                 examples: Sequence[Any], *, disjoint: bool = True) -> None:
        self._checked(build, names, examples, disjoint)

    @classmethod
    def run_new(cls, build: Callable[..., launching.KernelCall], names: Sequence[str], args: Sequence[Any], *,
                disjoint: bool = True) -> "PreparedCall":
        """Prepare for ``args`` and run on them at once, with the call the full checks built (a plain call that
        meets a layout for the first time: its work list is built once, not a second time by its first run)."""
        prepared = cls.__new__(cls)
        call = prepared._checked(build, names, args, disjoint)
        prepared._run_built(args, tuple(0 if t is None else t.data_ptr() for t in prepared._tensors(args)), call)
        return prepared

    def _checked(self, build: Callable[..., launching.KernelCall], names: Sequence[str], examples: Sequence[Any],
                 disjoint: bool) -> launching.KernelCall:
        """Set up for ``examples`` after every check of a plain call (naming any problem); the call they built."""
        if len(names) != len(examples):
            raise TypeError(f"{len(names)} names for {len(examples)} example arguments")
        self._build, self._names, self._disjoint = build, tuple(names), disjoint
        self._lists = tuple(i for i, e in enumerate(examples) if isinstance(e, (list, tuple)))
        call = build(*examples, checked=True)
        self._likes = tuple(self._like(name, i, e) for i, (name, e) in enumerate(zip(self._names, examples)))
        tensors = self._tensors(examples)
        if disjoint:
            check_disjoint(self._tensor_names(examples), tensors)
        self._sizes = tuple(0 if t is None else t.numel() * t.element_size() for t in tensors)
        self._compiled: Dict[tuple, Optional[_Specialised]] = {}
        self._last: Optional[Tuple[tuple, _Relaunch]] = None
        """(addresses, relaunch) of the last direct launch without an ``after``: it holds no tensor of a caller's."""
        return call

    def __call__(self, *args: Any) -> None:
        self._run(args, self._check(args))

    def run_if_like(self, args: Sequence[Any]) -> bool:
        """Run on ``args`` and return True if they are like the examples; return False, running nothing, if they
        are not (for a caller that keeps calls for several shapes). Other problems raise as a call does."""
        tensors = self._check(args, unlike_ok=True)
        if tensors is None:
            return False
        self._run(args, tensors)
        return True

    def fixed(self, *args: Any) -> Callable[[], None]:
        """This call on ``args`` and no others, as a callable of no arguments, for a caller that keeps them (a DDP
        bucket's buffers): checked now as a call is, built once, and run at every call with no check at all, so at
        the host cost of the work alone (on CPU tensors it is the torch path's pass). It holds the tensors: fix the
        call again to tensors that replace them. Nothing runs until it is called."""
        self._check(args)
        call = self._build(*args, checked=False)
        return call.torch_path if call.torch_path is not None else _Fixed(self, call, args)

    # ---- the tensors, against the examples ------------------------------------------------------------------------

    def _like(self, name: str, index: int, arg: Any) -> Any:
        if index not in self._lists:
            return like_key(arg, name)
        if not isinstance(arg, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(arg).__name__}")
        return tuple(like_key(t, f"{name}[{j}]") for j, t in enumerate(arg))

    def _unlike(self, name: str, index: int, got: Any, want: Any) -> str:
        if index not in self._lists:
            return f"{name} is {describe_like(got)}; this call was prepared for {describe_like(want)}"
        if len(got) != len(want):
            return f"{name} holds {len(got)} tensors; this call was prepared for {len(want)}"
        j = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        return f"{name}[{j}] is {describe_like(got[j])}; this call was prepared for {describe_like(want[j])}"

    def _tensors(self, args: Sequence[Any]) -> tuple:
        """The call's tensors one after another, its lists' spread out."""
        if not self._lists:
            return tuple(args)
        return tuple(t for i, arg in enumerate(args) for t in (arg if i in self._lists else (arg,)))

    def _tensor_names(self, args: Sequence[Any]) -> list:
        names = []
        for i, (name, arg) in enumerate(zip(self._names, args)):
            names += [f"{name}[{j}]" for j in range(len(arg))] if i in self._lists else [name]
        return names

    def _check(self, args: Sequence[Any], unlike_ok: bool = False) -> Optional[tuple]:
        """The call's tensors (:meth:`_tensors`), after checking that they are like the examples (else a
        ValueError, or None with ``unlike_ok``) and, where asked, disjoint."""
        if len(args) != len(self._names):
            raise TypeError(f"this prepared call takes {len(self._names)} arguments ({', '.join(self._names)}), got "
                            f"{len(args)}")
        for i, (name, want, arg) in enumerate(zip(self._names, self._likes, args)):
            got = self._like(name, i, arg)
            if got != want:
                if unlike_ok:
                    return None
                raise ValueError(self._unlike(name, i, got, want))
        tensors = self._tensors(args)
        if self._disjoint:
            # Like-shaped tensors: each spans the bytes its example did (None, and empty tensors, span none).
            spans = sorted((t.data_ptr(), size) for t, size in zip(tensors, self._sizes) if size)
            for (start, size), (next_start, _) in zip(spans, spans[1:]):
                if next_start < start + size:
                    check_disjoint(self._tensor_names(args), tensors)  # names the pair
                    raise ValueError(f"two of {', '.join(self._names)} overlap in memory")
        return tensors

    # ---- running ------------------------------------------------------------------------------------------------

    def _run(self, args: Sequence[Any], tensors: tuple) -> None:
        self.run_at(args, tuple(0 if t is None else t.data_ptr() for t in tensors))

    def run_at(self, args: Sequence[Any], addresses: tuple) -> None:
        """Run on ``args``, known to be like the examples (a caller that compared everything the examples' checks
        read), whose tensors one after another lie at ``addresses``."""
        last = self._last
        if last is not None and last[0] == addresses and not launching.launch_hooks_installed():
            # The same addresses as the last direct launch: the same values (the rest are the call's sizes and
            # settings, and a work table of its own), so the same launch.
            last[1]()
            return
        self._run_built(args, addresses, self._build(*args, checked=False))

    def _run_built(self, args: Sequence[Any], addresses: tuple, call: launching.KernelCall) -> None:
        repeat, direct = self._launch(call)
        if direct and call.after is None:
            self._last = (addresses, repeat)

    def _launch(self, call: launching.KernelCall) -> Tuple[Optional[Callable[[], None]], bool]:
        """Run ``call`` once; return what runs it again on the same tensors (None: build it again, where a direct
        launch may still come: a launch hook listens, or its self-check waits for CUDA graph capture to end) and
        whether that is a direct launch."""
        if call.torch_path is not None:
            call.torch_path()
            return call.torch_path, False
        plan, kernel, args, constexprs = call.launch
        repeatable = True
        if launching._can_launch_directly(plan, args):
            if launching.launch_hooks_installed():
                repeatable = False
            else:
                specialised, values, repeatable = self._specialised(plan, kernel, args, constexprs)
                if specialised is not None:
                    relaunch = _Relaunch(specialised.direct, values, plan, call.after)
                    relaunch()
                    return relaunch, True
        launching.launch(plan, kernel, args, constexprs)
        if call.after is not None:
            call.after()
        return (_TritonLaunch(call.launch, call.after) if repeatable else None), False

    def _specialised(self, plan: Any, kernel: Any, args: tuple, constexprs: dict
                     ) -> Tuple[Optional[_Specialised], Optional[list], bool]:
        """(direct launch, the launcher's values for ``args``, True) for this specialisation, compiled at its first
        call; (None, None, final) for Triton's launcher, final False where that is only until the self-check can
        run (inside CUDA graph capture)."""
        values = [launching._as_int(a) for a in args]
        pointers = [isinstance(a, torch.Tensor) for a in args]
        alignment = tuple(v & 15 == 0 for v, pointer in zip(values, pointers) if pointer)
        key = (kernel, plan.n_items, plan.num_warps, plan.options, tuple(constexprs.items()), alignment)
        if key not in self._compiled:
            if launching._direct_launch_ok is None and launching._capturing():
                return None, None, False  # the self-check cannot run inside CUDA graph capture: decide later
            direct = launching._bind_direct(plan, kernel, args, constexprs, args[0].device)
            specialised = None
            if direct is not None:
                full = launching._launcher_values(kernel, args, constexprs)
                direct.values = ()  # it launches with each call's values only
                specialised = _Specialised(direct, tuple(v for v, p in zip(full, pointers) if not p),
                                           tuple(full[len(args):]))
            self._compiled[key] = specialised
        specialised = self._compiled[key]
        if specialised is None or tuple(v for v, p in zip(values, pointers) if not p) != specialised.others:
            return None, None, True
        return specialised, values + list(specialised.tail), True


class _Fixed:
    """A prepared call fixed to tensors its caller keeps (:meth:`PreparedCall.fixed`): built once, run again with
    no check. A direct launch gives way to Triton's launcher while a launch hook (a profiler) listens; inside CUDA
    graph capture before the direct launch's self-check could run, each call goes through Triton's launcher (which
    the graph records) until one outside capture compiles the direct launch. Holds the tensors (``keeps``): a work
    table has the addresses of tensors that are no argument of the kernel's."""

    __slots__ = ("prepared", "call", "keeps", "repeat", "direct")

    def __init__(self, prepared: PreparedCall, call: launching.KernelCall, keeps: Sequence[Any]) -> None:
        self.prepared, self.call, self.keeps = prepared, call, tuple(keeps)
        self.repeat: Optional[Callable[[], None]] = None
        self.direct = False

    def __call__(self) -> None:
        repeat = self.repeat
        if repeat is not None and not (self.direct and launching.launch_hooks_installed()):
            repeat()
            return
        self.repeat, self.direct = self.prepared._launch(self.call)


def with_prepare(prepare: Callable[..., PreparedCall]) -> Callable[[Callable], Callable]:
    """Give a plain call its prepared form, as ``plain.prepare``: an operation is one callable with both forms."""
    def attach(plain: Callable) -> Callable:
        plain.prepare = prepare
        return plain
    return attach
