"""The global gradient norm and non-finite check from the unpack pass, and which gradients the state vouches for.

With ``CommState(grad_stats=True)`` every bucket has a float32 tensor of shape (2,), ``BucketComm.stats``, that
its unpack overwrites in the same pass that writes the averaged gradients: [sum of squares, number of non-finite
values] of the values stored, in the gradients' own dtype. After a synchronising backward, ``grad_norm`` is the
square root of the sum over that pass's buckets and ``found_inf`` whether any count is non-zero: a stack, a sum
and a square root of a few numbers on the gradients' device, no read of the gradients, no host synchronisation.

**Buckets that take no kernel without stats.** A bucket sent in its own dtype through NCCL's AVG has neither pack
nor unpack, and one sent in place in its own dtype (gloo, NVLS, a bfloat16 model with bfloat16 on the wire) has an
unpack that does nothing. With stats on, both keep their path and get a stats pass: the unpack kernel run in place
with scale 1, which reads the averaged bucket once and writes the same values back (on the GPU NaNs made canonical,
as the kernels write them). Giving NCCL's AVG up instead would add a pack (a read and a write, to scale by
1/N before a sum) to the same unpack: twice the memory traffic for the same numbers, since NCCL computes a float
AVG as a pre-multiplied sum.

**Other bucket paths** (other wire formats) plug in by giving their BucketComm (``bucket.py``)
``stats=new_stats(buffer)`` when ``grad_stats`` is on and having their own unpack overwrite it; the sum runs over
the buckets of the pass.

**Which pass.** The buckets the hook saw in the state's latest backward pass (``CommState.latest_pass``), all of
DDP's buckets, so unused parameters (zeros in their bucket under ``find_unused_parameters``) count as zeros, and
mixed-dtype models sum their float32 and bfloat16 buckets alike. ``no_sync`` backward passes do not call the hook:
the stats stay those of the latest synchronising backward, which averaged the accumulated gradients. Under
``join()`` a rank that has joined runs the hook on DDP's zero buckets; its stats are those zeros.

**What the state vouches for** (``cannot_vouch``, the test ``clip_grad_norm_`` makes before it trusts the norm):
that every gradient of the model holds what the latest pass's unpack wrote. At the end of each synchronising
backward, after DDP has finished with the gradients (an autograd callback queued behind DDP's own), each bucket
notes its buffer's version counter; gradients that are views of the bucket (``gradient_as_bucket_view=True``)
share that counter, so one number per bucket covers them. Gradients DDP copied out of the bucket (the default)
are noted one by one, and only if DDP wrote them in this pass (it leaves a globally unused parameter's gradient as
it was), and so are the parameters left without a gradient. An in-place change to a gradient afterwards (``mul_``,
an optimizer hook, a ``no_sync`` backward accumulating into it) moves its counter, a gradient replaced or not in
the pass is not the one noted, a gradient dropped since (set to None, ``zero_grad()``) is missing from a norm that
counts it, and each makes the state decline. The counter cannot see writes through ``.data``.

**GradScaler's unscale_** multiplies the gradients by 1/scale with an op that moves no version counter,
``torch._amp_foreach_non_finite_check_and_unscale_``. While a state with statistics exists (``watch_unscale``, run
when a bucket binds) that function is wrapped, off the hook's path: after the op it moves the counter of each tensor
it was given, once, and notes the factor and each tensor's versions before and after (``unscaled_since``). torch's
GradScalers (``torch.amp``'s, ``torch.cuda.amp``'s subclass, FSDP's ``ShardedGradScaler``, which overrides
``unscale_``) all run that op; other writes either move the counter (the state declines) or go through ``.data``
(not seen; older torch's ``ShardedGradScaler`` unscaled CPU gradients so).
A gradient then holds what the unpack wrote (its noted version), or that times one factor (the version noted is the
one before the op, and the one after it is the current one: nothing written since), or the state declines.
``bucket_factors`` gives each bucket of the pass one factor (None: as written), or declines where a bucket's
gradients differ (``unscale_`` of only one of two optimizers that share a bucket).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

#: Why ``grad_norm`` refuses under compiled autograd (DDP's Python reducer calls the hook once per parameter).
PER_PARAMETER_REASON = ("the hook was called per parameter (compiled autograd with optimize_ddp='python_reducer'), "
                        "which keeps no gradient statistics; use torch.nn.utils.clip_grad_norm_ there")


def new_stats(buffer: torch.Tensor) -> torch.Tensor:
    """A bucket's stats tensor: float32 (2,) on the bucket's device, for its unpack to overwrite each pass."""
    return torch.zeros(2, dtype=torch.float32, device=buffer.device)


def why_no_stats(enabled: bool, per_parameter: bool, entries: List[Any]) -> Optional[str]:
    """None when ``entries`` (a state's latest pass) hold statistics; else why not (for ``grad_norm``'s error).
    ``enabled``: the state's ``grad_stats``; ``per_parameter``: whether the hook ran per parameter."""
    if not enabled:
        return "this CommState was built without grad_stats=True"
    if per_parameter:
        return PER_PARAMETER_REASON
    if not entries:
        return "no backward pass has gone through the hook yet"
    if any(e.stats is None for e in entries):
        return "a bucket of the latest pass was bound before grad_stats was turned on (set it at construction)"
    return None


def pass_totals(entries: List[Any]) -> torch.Tensor:
    """[sum of squares, non-finite count] over ``entries`` (a pass's buckets, each with stats), float32 (2,), on the
    gradients' device."""
    stats = [e.stats for e in entries]
    if len(stats) == 1:
        return stats[0].clone()
    device = stats[0].device
    return torch.stack([s.to(device) for s in stats]).sum(dim=0)


def grad_norm(entries: List[Any]) -> torch.Tensor:
    """The L2 norm of every averaged gradient of a pass (``entries``, each with stats): 0-dim float32 on the
    gradients' device; inf if a gradient holds inf, NaN if one holds NaN (as torch's clip_grad_norm_ reports them)."""
    return pass_totals(entries)[0].sqrt()


def found_inf(entries: List[Any]) -> torch.Tensor:
    """1.0 if any averaged gradient of a pass is not finite, else 0.0 (0-dim float32)."""
    return (pass_totals(entries)[1] > 0).to(torch.float32)


# ---- coverage: which gradients the latest pass's statistics describe ------------------------------------------------


class BucketCoverage:
    """One bucket's parameters, and what its gradients were when the latest pass ended (see the module docstring)."""

    __slots__ = ("params", "buffer", "views", "before", "pass_id", "buffer_version", "grads", "absent")

    def __init__(self, params: List[torch.Tensor], buffer: torch.Tensor) -> None:
        watch_unscale()  # before any gradient it covers can be unscaled
        self.params = params
        self.buffer = buffer
        self.views: Optional[bool] = None
        """True once every gradient was seen to be a view of the bucket; None until known."""
        self.before: Optional[List[Optional[Tuple[torch.Tensor, int]]]] = None
        """Gradients and their versions when the hook ran (for gradients DDP copies out of the bucket)."""
        self.pass_id = -1
        """The pass whose end was noted; -1 before any."""
        self.buffer_version = -1
        self.grads: Dict[int, Tuple[Any, int]] = {}
        """id(param) -> (weak reference to its gradient, its version) for gradients that are not bucket views."""
        self.absent: frozenset = frozenset()
        """id(param) of the parameters that had no gradient when the pass ended (they count as zeros)."""

    def note_before(self) -> None:
        """At the hook, before DDP copies the bucket out: each gradient and its version (not for bucket views)."""
        if self.views:
            return
        self.before = [None if p.grad is None else (p.grad, p.grad._version) for p in self.params]

    def note_end(self, pass_id: int) -> None:
        """After DDP's end of backward: the buffer's version, and the gradients DDP wrote from the bucket."""
        self.buffer_version = self.buffer._version
        self.grads = {}
        self.absent = frozenset(id(p) for p in self.params if p.grad is None)
        if not self.views:
            before, self.before = self.before, None
            views, seen = True, False
            for i, p in enumerate(self.params):
                g = p.grad
                if g is None:
                    continue
                seen = True
                if g._base is self.buffer:
                    continue
                views = False
                old = before[i] if before is not None else None
                if old is not None and old[0] is g and old[1] == g._version:
                    continue  # DDP did not write it (a globally unused parameter): not vouched for
                self.grads[id(p)] = (weakref.ref(g), g._version)
            if seen:
                self.views = views
        self.pass_id = pass_id

    def holds(self, param: torch.Tensor, grad: torch.Tensor) -> Any:
        """What ``grad`` (``param.grad``) holds: ``WRITTEN``, what the noted pass's unpack wrote; the factor tensor
        one unscale op multiplied that by since (``unscaled_since``); or None, neither (the state declines)."""
        if grad._base is self.buffer:
            noted = self.buffer_version
        else:
            entry = self.grads.get(id(param))
            if entry is None or entry[0]() is not grad:
                return None
            noted = entry[1]
        version = grad._version
        unscaled = unscaled_since(grad, noted)
        if unscaled is None:
            return WRITTEN if version == noted else None
        factor, after = unscaled  # an unscale op since: it moved the counter (not traced away), and nothing since
        return factor if after == version != noted else None


#: ``BucketCoverage.holds``: the gradient holds what the unpack wrote.
WRITTEN = "written"


def note_bucket(comm: Any, last: bool, pass_entries: Callable[[], List[Any]]) -> None:
    """The hook's per-bucket step with ``grad_stats``: note what DDP's copy will change, and at the pass's ``last``
    bucket arrange for the pass's end to be noted after DDP's, on the buckets ``pass_entries()`` gives then."""
    comm.coverage.note_before()
    if last:
        pass_id = comm.record.last_used
        _after_ddp(lambda: _note_pass_end(pass_entries(), pass_id))


def _after_ddp(callback: Any) -> None:
    """Run ``callback`` once this backward is over, DDP's own end of backward included.

    DDP queues its end-of-backward callback right after launching its last bucket, so a callback queued from the
    last bucket's hook would run before it; this one queues ``callback`` from there, behind DDP's. Outside a
    backward pass (``join()``'s shadow all-reduces on a rank that has joined) nothing is queued and the pass is not
    vouched for.
    """
    engine = torch.autograd.Variable._execution_engine
    try:
        engine.queue_callback(lambda: engine.queue_callback(callback))
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        pass


def _note_pass_end(entries: List[Any], pass_id: int) -> None:
    for e in entries:
        if e.record.last_used == pass_id and e.coverage is not None:
            e.coverage.note_end(pass_id)


def cannot_vouch(model: Any, entries: List[Any], pass_id: int, no_stats: Optional[str],
                 norm_type: float = 2.0) -> Optional[str]:
    """None when the norm of pass ``pass_id`` (its buckets ``entries``; ``no_stats``: ``why_no_stats``'s answer) is
    the norm torch's ``clip_grad_norm_`` would compute over ``model``'s parameters (a module, or an iterable of
    parameters as torch's takes); else why not, in words (also when GradScaler's ``unscale_`` ran since:
    ``bucket_factors`` says by what). Reads no gradient values (a host loop over the parameters)."""
    factors, reason = bucket_factors(model, entries, pass_id, no_stats, norm_type)
    if reason is None and any(f is not None for f in factors):
        return ("GradScaler's unscale_ multiplied gradients since the latest synchronising backward: the pass's norm "
                "is theirs before it (ddp_triton.clip_grad_norm_ accounts for the factor)")
    return reason


def bucket_factors(model: Any, entries: List[Any], pass_id: int, no_stats: Optional[str],
                   norm_type: float = 2.0) -> Tuple[List[Optional[torch.Tensor]], Optional[str]]:
    """(factors, None): for each of ``entries`` (the buckets of pass ``pass_id``), None when its gradients hold what
    the unpack wrote, or the 0-dim tensor that one unscale op multiplied all of them by since; with these the pass's
    statistics give the norm torch's ``clip_grad_norm_`` would compute over ``model``'s parameters. ([], reason)
    where they cannot (``no_stats``: ``why_no_stats``'s answer)."""
    try:
        if float(norm_type) != 2.0:
            return [], f"norm_type={norm_type}: the state keeps the 2-norm only"
    except (TypeError, ValueError):
        return [], f"norm_type={norm_type!r} is not a number"
    if no_stats is not None:
        return [], no_stats
    owner: Dict[int, BucketCoverage] = {}
    for e in entries:
        coverage = e.coverage
        if coverage is None or coverage.pass_id != pass_id:
            return [], ("the latest backward pass was not seen to its end (a failed collective, or join()'s shadow "
                        "all-reduces on a rank that has joined)")
        for p in coverage.params:
            owner[id(p)] = coverage
    given = set()
    held: Dict[int, Any] = {}  # id(coverage) -> what its gradients hold (one for all of them)
    for name, p in _named(model):
        given.add(id(p))
        g = p.grad
        coverage = owner.get(id(p))
        if g is None:
            if coverage is not None and id(p) not in coverage.absent:
                return [], (f"parameter {name}'s gradient was dropped (set to None, or zero_grad()) after the latest "
                            "synchronising backward, whose norm counts it")
            continue  # torch's clip skips it too
        if coverage is None:
            return [], f"parameter {name} has a gradient that was not in the latest synchronising backward"
        holds = coverage.holds(p, g)
        if holds is None:
            return [], (f"parameter {name}'s gradient changed since the latest synchronising backward (or DDP did not "
                        "write it there)")
        if held.setdefault(id(coverage), holds) is not holds:
            return [], (f"parameter {name}'s gradient was unscaled (GradScaler's unscale_) differently from others of "
                        "its bucket (unscale_ of one of two optimizers that share a bucket, or of another scaler)")
    for param_id, coverage in owner.items():
        if param_id not in given and param_id not in coverage.absent:
            return [], ("the latest synchronising backward's norm counts gradients of parameters that were not given "
                        "(clip the whole model, or all of its parameters)")
    factors = [held.get(id(e.coverage), WRITTEN) for e in entries]
    return [None if f is WRITTEN else f for f in factors], None


# Below this sum of squares of a bucket's n values, n values squared below float32's normal range (2**-126; flushed
# to zero, or denormal) could leave it off by more than float32's rounding (2**-23 of it): n * 2**-126 / 2**-23.
_UNDERFLOW = 2.0 ** -103
_FLOAT32_MAX = torch.finfo(torch.float32).max


def unscaled_norm(entries: List[Any], factors: List[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm, in_range): the L2 norm of a pass's gradients (``entries``, each with stats) after each bucket's
    gradients were multiplied by its factor (None: 1), 0-dim float32 on the gradients' device; and whether that is
    their norm as float32 computes it (a 0-dim bool): each unscaled bucket's sum of squares, both as the statistics
    took it before the factor and after it (as torch's clip sums it), neither overflowed nor underflowed float32 (or
    its gradients hold inf/NaN, which the factor keeps)."""
    device = entries[0].stats.device
    one = torch.ones((), dtype=torch.float64, device=device)
    squares = torch.stack([e.stats[0].to(device) for e in entries]).double()
    scales = torch.stack([one if f is None else f.to(device, torch.float64) for f in factors])
    norm = (squares * scales.square()).sum().sqrt().float()
    rows = [i for i, f in enumerate(factors) if f is not None]
    stats = torch.stack([entries[i].stats.to(device) for i in rows]).double()
    least = _UNDERFLOW * torch.tensor([entries[i].buffer.numel() for i in rows], dtype=torch.float64, device=device)
    scaled = stats[:, 0]
    unscaled = scaled * scales[rows].square()  # what torch's clip sums, in float32, from the unscaled gradients

    def in_range(squares: torch.Tensor) -> torch.Tensor:
        return (squares >= least) & (squares <= _FLOAT32_MAX)

    fine = (stats[:, 1] > 0) | (torch.isfinite(scaled) & in_range(scaled) & in_range(unscaled))
    return norm, fine.all()


def clip_norm(model: Any, entries: List[Any], pass_id: int, no_stats: Optional[str],
              norm_type: float = 2.0) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """(norm, None): the total norm torch's ``clip_grad_norm_`` would compute over ``model``'s gradients, from the
    statistics of pass ``pass_id`` (its buckets ``entries``) and any unscale since; or (None, reason) where they do
    not give it. After an unscale this reads one flag back to the host (whether the statistics were in float32's
    range); otherwise no host synchronisation."""
    factors, reason = bucket_factors(model, entries, pass_id, no_stats, norm_type)
    if reason is not None:
        return None, reason
    if all(f is None for f in factors):
        return grad_norm(entries), None
    norm, in_range = unscaled_norm(entries, factors)
    if not bool(in_range):
        return None, ("GradScaler's unscale_ ran, and the scaled gradients' sum of squares was out of float32's range "
                      "(overflowed or underflowed), which the unscaled gradients' is not")
    return norm, None


# ---- GradScaler's unscale_: the one write to gradients that moves no version counter ------------------------------

_UNSCALE_OP = "_amp_foreach_non_finite_check_and_unscale_"

# id(tensor) -> (weak reference to it, its version before the unscale op, after it, the factor) for the tensors the
# latest unscale op was given; an entry goes when its tensor does.
_unscaled: Dict[int, Tuple[Any, int, int, torch.Tensor]] = {}


def watch_unscale() -> None:
    """Wrap ``torch._amp_foreach_non_finite_check_and_unscale_`` (what GradScaler's unscale_ runs), once, so that it
    moves the version counters of the tensors it unscales and notes the factor (see the module docstring)."""
    original = getattr(torch, _UNSCALE_OP, None)
    if original is None or getattr(original, "counts_versions", False):
        return

    def unscale(*args: Any, **kwargs: Any) -> Any:
        tensors = args[0] if args else kwargs.get("self")
        inv_scale = args[2] if len(args) > 2 else kwargs.get("inv_scale")
        if not isinstance(tensors, (list, tuple)):  # the op takes a list: its own error follows
            return original(*args, **kwargs)
        try:
            before = [t._version for t in tensors]
        except (AttributeError, RuntimeError):  # not tensors, or inference tensors (no counters): the op decides
            return original(*args, **kwargs)
        done = False
        try:
            result = original(*args, **kwargs)
            done = True
            return result
        finally:
            _count_unscale(tensors, before, inv_scale if done else None)

    # Eager even inside torch.compile: traced, the version bumps would vanish from the graph.
    watched = torch.compiler.disable(unscale)
    watched.counts_versions = True  # type: ignore[attr-defined]
    watched.__module__, watched.__name__, watched.__qualname__ = "torch", _UNSCALE_OP, _UNSCALE_OP  # pickles by name
    watched.__doc__ = original.__doc__
    watched.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(torch, _UNSCALE_OP, watched)


def _count_unscale(tensors: Sequence[torch.Tensor], before: List[int], factor: Any) -> None:
    """After the unscale op on ``tensors`` (their versions ``before`` it): move each one's version counter once and,
    when it succeeded with a tensor ``factor`` on tensors given once each, note them."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)
    if not isinstance(factor, torch.Tensor) or len({id(t) for t in tensors}) != len(tensors):
        return
    factor = factor.detach().clone()  # the value used now, whatever its owner does with it later
    for t, version in zip(tensors, before):
        key = id(t)
        old = _unscaled.get(key)
        ref = old[0] if old is not None and old[0]() is t else weakref.ref(t, lambda r, key=key: _forget(key, r))
        _unscaled[key] = (ref, version, t._version, factor)


def _forget(key: int, ref: Any) -> None:
    entry = _unscaled.get(key)
    if entry is not None and entry[0] is ref:
        del _unscaled[key]


def unscaled_since(grad: torch.Tensor, noted: int) -> Optional[Tuple[torch.Tensor, int]]:
    """(factor, version after it) of the latest unscale op on ``grad``, if its version was ``noted`` before that op;
    else None (no such op since ``noted``)."""
    entry = _unscaled.get(id(grad))
    if entry is None or entry[0]() is not grad or entry[1] != noted:
        return None
    return entry[3], entry[2]


def _named(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, parameter) of a module, or of the parameters of an iterable (or one tensor) named by position."""
    if isinstance(model, torch.nn.Module):
        return iter(model.named_parameters())
    params = [model] if isinstance(model, torch.Tensor) else list(model)
    return ((f"#{i} of those given", p) for i, p in enumerate(params))
