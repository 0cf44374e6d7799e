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
counts it, and each makes the state decline. Changes the counter cannot see: writes through ``.data``, and ops
that skip autograd's bookkeeping, GradScaler's ``unscale_`` among them (``torch._amp_foreach_non_finite_check_and_
unscale_``): ``clip_grad_norm_`` takes the scaler to account for it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

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

    def vouches(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (``param.grad``) still holds what the noted pass's unpack wrote."""
        if grad._base is self.buffer:
            return grad._version == self.buffer_version
        noted = self.grads.get(id(param))
        return noted is not None and noted[0]() is grad and grad._version == noted[1]


def note_bucket(comm: Any, last: bool, pass_entries: Callable[[], List[Any]]) -> None:
    """The hook's per-bucket step with ``grad_stats``: note what DDP's copy will change, and at the pass's ``last``
    bucket arrange for the pass's end to be noted after DDP's, on the buckets ``pass_entries()`` gives then."""
    comm.coverage.note_before()
    if last:
        pass_id = comm.last_used
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
        if e.last_used == pass_id and e.coverage is not None:
            e.coverage.note_end(pass_id)


def cannot_vouch(model: Any, entries: List[Any], pass_id: int, no_stats: Optional[str],
                 norm_type: float = 2.0) -> Optional[str]:
    """None when the norm of pass ``pass_id`` (its buckets ``entries``; ``no_stats``: ``why_no_stats``'s answer) is
    the norm torch's ``clip_grad_norm_`` would compute over ``model``'s parameters (a module, or an iterable of
    parameters as torch's takes); else why not, in words. Reads no gradient values (a host loop over the
    parameters)."""
    try:
        if float(norm_type) != 2.0:
            return f"norm_type={norm_type}: the state keeps the 2-norm only"
    except (TypeError, ValueError):
        return f"norm_type={norm_type!r} is not a number"
    if no_stats is not None:
        return no_stats
    owner: Dict[int, BucketCoverage] = {}
    for e in entries:
        coverage = e.coverage
        if coverage is None or coverage.pass_id != pass_id:
            return ("the latest backward pass was not seen to its end (a failed collective, or join()'s shadow "
                    "all-reduces on a rank that has joined)")
        for p in coverage.params:
            owner[id(p)] = coverage
    given = set()
    for name, p in _named(model):
        given.add(id(p))
        g = p.grad
        coverage = owner.get(id(p))
        if g is None:
            if coverage is not None and id(p) not in coverage.absent:
                return (f"parameter {name}'s gradient was dropped (set to None, or zero_grad()) after the latest "
                        "synchronising backward, whose norm counts it")
            continue  # torch's clip skips it too
        if coverage is None:
            return f"parameter {name} has a gradient that was not in the latest synchronising backward"
        if not coverage.vouches(p, g):
            return (f"parameter {name}'s gradient changed since the latest synchronising backward (or DDP did not "
                    "write it there)")
    for param_id, coverage in owner.items():
        if param_id not in given and param_id not in coverage.absent:
            return ("the latest synchronising backward's norm counts gradients of parameters that were not given "
                    "(clip the whole model, or all of its parameters)")
    return None


def _named(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, parameter) of a module, or of the parameters of an iterable (or one tensor) named by position."""
    if isinstance(model, torch.nn.Module):
        return iter(model.named_parameters())
    params = [model] if isinstance(model, torch.Tensor) else list(model)
    return ((f"#{i} of those given", p) for i, p in enumerate(params))
