"""``DistributedDataParallel(manager, module, ...)``: torchft's fault-tolerant DDP, sending the gradients exchanged
between replica groups in ddp-triton's wire formats.

    from ddp_triton.integrations.torchft import DistributedDataParallel   # instead of torchft.ddp's
    model = DistributedDataParallel(manager, model, comm_dtype=torch.float8_e4m3fn)
    optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
    # the loop as torchft's: optimizer.zero_grad() (the quorum), forward, backward, optimizer.step() (the commit)

The arguments are torchft's (``manager``, ``module``, torch DDP's keywords) plus ``ddp_triton.register``'s options;
``model.comm_state`` is the CommState. Each step follows the manager's quorum, as torchft's own all-reduce does: the
exchange runs over the manager's process group of that quorum (bound again, before the step's first bucket, when the
quorum changed), a replica group that is healing or not participating sends zeros, and the sum is divided by
``manager.num_participants()``. A failed exchange is reported to the manager (``report_error``), so the step is not
committed; the bucket is zeroed, the backward returns, and the error-feedback residuals go back to what they were
before the step. A step that is not committed for any other reason (another rank's failure, too few replicas) has its
residuals rolled back as well, before the next exchange. What a healed group starts with, and the other decisions:
docs/integrations.md.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects (as runtime/hook.py says).
import threading
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..machine.profile import AUTO_FORMAT
from ..runtime.hook import triton_hook
from ..runtime.state import CommState, check_options

try:
    import torchft.ddp
    from torchft.process_group import ProcessGroupWrapper
except ImportError:
    raise ImportError("ddp_triton.integrations.torchft needs torchft, which ddp-triton does not install: "
                      "pip install torchft (or ddp-triton[torchft])") from None

#: The key the hook's state is registered under with ``manager.register_state_dict_fn`` (what a heal carries).
STATE_KEY = "ddp_triton"

#: ``ddp_triton.fsdp.register``'s options and FSDP2's ``fully_shard`` keywords: refused by name here.
FSDP_ONLY = ("replicate_group", "replicate_comm_dtype", "replicate_accumulate_dtype", "replicate_error_feedback",
             "mesh", "reshard_after_forward", "mp_policy", "offload_policy", "shard_placement_fn")

#: CommState options this integration decides itself: the groups come from the manager, no NCCL profile groups
#: can be made over a quorum's group, and the group's own ranks are averaged in full precision already.
DECIDED_HERE = {"device": "the model's", "profile": "None: torchft's groups change with the quorum",
                "hierarchical": "the ranks inside a replica group average in full precision, then one format between "
                                "groups"}


def cross_group(pg: Any) -> Any:
    """The process group of the current quorum behind the manager's ``pg``: a torchft ProcessGroupWrapper's
    ``parent`` (made anew at each reconfiguration, with this replica's rank in it), else ``pg`` itself."""
    return pg.parent if isinstance(pg, ProcessGroupWrapper) else pg


class FaultTolerantExchange:
    """What the hook keeps across steps: the manager, the CommState, the group inside the replica group, and the
    step in flight (whether it exchanges at all, the factor to the participants' mean, the residuals before it)."""

    def __init__(self, manager: Any, state: CommState, inner: Any) -> None:
        self.manager, self.state, self.inner = manager, state, inner
        self.inner_size = 1 if inner is None else dist.get_world_size(inner)
        self.inner_first = None if inner is None else dist.get_global_rank(inner, 0)
        self.quorum: Optional[int] = None
        """The manager's quorum id the state is bound for."""
        self.in_pass = False
        self.skip = False
        """The manager had an error before the step's first bucket: no exchange at all (as torchft's allreduce)."""
        self.participating = True
        self.factor = 1.0
        """Group size / participants: a healing group is in the group but not among the participants."""
        self.saved: Optional[Tuple[int, Any]] = None
        """(manager step, residual snapshot) of the step in flight, until it is known to have been committed."""
        self.step_call: Any = None
        """The manager's quorum call of the step in flight (``start_quorum``'s, one per step): a further backward
        of the same step (accumulation without no_sync) keeps the step's snapshot."""
        self.failed = False
        self.exchanged_at: Optional[int] = None
        """The manager's step whose exchange ran last (None: none since it was settled)."""
        self.restart = False
        """The last step was not committed: bind afresh before the next, even on the same group. Every group sees
        that alike (torchft's commit is a vote of all), so every group binds again, in one order."""
        self._lock = threading.Lock()
        self._launched = 0
        self._settled = 0
        self._all_launched = False

    # ---- a step's start and end ----------------------------------------------------------------------------------

    def begin(self) -> None:
        """Before a backward's first bucket: for a new step, roll back a step that was not committed and follow the
        quorum; for another backward of the step in flight, keep its snapshot. ``in_pass`` is set last, so that a
        failure here leaves the next bucket to begin again."""
        manager = self.manager
        step_call = getattr(manager, "_quorum_future", None)
        same_step = step_call is not None and step_call is self.step_call and self.saved is not None
        if not same_step:
            self.settle()
        manager.wait_quorum()
        self.failed, self._launched, self._settled, self._all_launched = False, 0, 0, False
        self.skip = manager.errored() is not None
        if not self.skip and not same_step:
            self._follow_quorum()
        self.step_call = step_call
        self.in_pass = True

    def _follow_quorum(self) -> None:
        """A new step's binding: the quorum's group, the participants' factor, the residuals' snapshot. A group that
        takes no part sends zeros: its residuals (owed to steps it now misses) are dropped, as a heal drops them."""
        manager = self.manager
        group = cross_group(manager._pg)
        quorum = getattr(manager, "_quorum_id", None)
        if self.restart or group is not self.state.process_group or quorum != self.quorum:
            self.state.regroup(group)
            self.quorum, self.restart = quorum, False
        participants = manager.num_participants()
        self.participating = manager.is_participating() and participants > 0
        self.factor = group.size() / participants if participants > 0 else 1.0
        self.exchanged_at = manager.current_step()
        if self.state.keeps_residuals:
            self.saved = (self.exchanged_at, self.state.residuals.snapshot())
            if not self.participating:
                self.state.residuals.zero()

    def settle(self) -> None:
        """Where the latest step was not committed (the manager's step did not advance), on this group and so on
        every one: put the residuals back, and bind afresh before the next exchange."""
        saved, self.saved = self.saved, None
        exchanged_at, self.exchanged_at = self.exchanged_at, None
        if exchanged_at is not None and self.manager.current_step() == exchanged_at:
            self.restart = True
            if saved is not None:
                self.state.residuals.restore(saved[1])

    def heal(self) -> None:
        """This replica group took another's checkpoint: its residuals were its own history, which ends here."""
        self.saved = None
        self.state.residuals.zero()

    # ---- per bucket ----------------------------------------------------------------------------------------------

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        with self._lock:
            self._launched += 1
            self._all_launched = bucket.is_last()
        if self.inner is None:
            return self._exchange(bucket, buffer)
        # The replica group's own ranks, in full precision, then the format between groups. torchft runs a quorum
        # per group rank, and at a heal the ranks of one group may see different participants (each heals on its
        # own): the group takes its first rank's result, so that its ranks never drift apart.
        # A failure inside the group settles the bucket as failed, as one between groups does.
        try:
            dist.all_reduce(buffer, group=self.inner)
        except Exception as exc:  # noqa: BLE001 - a rank of this group gone: the step is thrown away
            return self._done(buffer, exc)
        buffer.div_(self.inner_size)
        self._exchange(bucket, buffer).wait()
        try:
            dist.broadcast(buffer, src=self.inner_first, group=self.inner)
        except Exception as exc:  # noqa: BLE001 - settled already: the step is reported and its residuals rolled back
            self.manager.report_error(exc)
            buffer.zero_()
            self._roll_back()
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _exchange(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future:
        """The bucket's exchange between replica groups; a future that always completes with the bucket."""
        if self.skip:
            return self._done(buffer, None)
        if not self.participating:
            buffer.zero_()
        try:
            sent = triton_hook(self.state, bucket)
        except Exception as exc:  # noqa: BLE001 - binding's collectives: the step is lost, not the job
            return self._done(buffer, exc)
        return sent.then(lambda fut: self._finish(fut, buffer))

    def _finish(self, fut: torch.futures.Future, buffer: torch.Tensor) -> torch.Tensor:
        try:
            fut.value()
        except Exception as exc:  # noqa: BLE001 - a peer gone, a collective timed out: the step is thrown away
            return self._settle_bucket(buffer, exc)
        if self.factor != 1.0:
            buffer.mul_(self.factor)
        return self._settle_bucket(buffer, None)

    def _done(self, buffer: torch.Tensor, error: Optional[BaseException]) -> torch.futures.Future:
        done = torch.futures.Future()
        done.set_result(self._settle_bucket(buffer, error))
        return done

    def _settle_bucket(self, buffer: torch.Tensor, error: Optional[BaseException]) -> torch.Tensor:
        """One bucket is done; the last of a failed step puts the residuals back before the backward returns."""
        if error is not None:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))
            buffer.zero_()  # never the optimizer's to take: the step is not committed anywhere
        with self._lock:
            self._settled += 1
            self.failed = self.failed or error is not None or self.skip
            whole = self._all_launched and self._settled == self._launched
        if whole:
            self.in_pass = False
            if self.failed and not self.skip:
                self._roll_back()
        return buffer

    def _roll_back(self) -> None:
        """A failed step: its residuals go back to the snapshot now (the next step's ``settle`` binds afresh)."""
        saved = self.saved
        if saved is not None:
            self.state.residuals.restore(saved[1])

    # ---- what a heal carries ---------------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The settings and online tuning's choice, sent to a replica group that heals from this one. Not the
        residuals: they are this rank's own, and a healed group starts from zero (docs/integrations.md)."""
        tuner = self.state.tuner
        return {"wire_format": self.state.wire_setting, "online": None if tuner is None else tuner.state()}

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Take a healthy group's state while healing: the settings must match; the residuals start from zero; the
        tuning choice is not taken (every group re-tunes at a quorum change, together)."""
        theirs = saved.get("wire_format") if isinstance(saved, dict) else None
        if theirs != self.state.wire_setting:
            raise ValueError(f"ddp_triton.integrations.torchft: this replica group sends {self.state.wire_setting} and "
                             f"heals from one that sends {theirs}: give every replica group the same comm_dtype, "
                             "accumulate_dtype and error_feedback")
        self.heal()


def exchange_hook(ft: FaultTolerantExchange, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's comm hook: the bucket averaged over the quorum's participants in the CommState's format."""
    if not ft.in_pass:
        ft.begin()
    return ft.run(bucket)


#: torchft's process groups the exchange cannot run over yet: the Baby ones (a subprocess's group, without the
#: collectives into one tensor the exchange issues) and the accelerator ones (their timeouts and aborts, which turn a
#: dead peer into a step's error, live in torchft's wrapper, which the exchange goes around).
UNSUPPORTED_GROUPS = ("ProcessGroupBaby", "ProcessGroupNCCL", "ProcessGroupXCCL")


def _check_process_group(pg: Any) -> None:
    unsupported = [cls.__name__ for cls in type(pg).__mro__ if cls.__name__ in UNSUPPORTED_GROUPS]
    if unsupported:
        raise TypeError(f"ddp_triton.integrations.torchft exchanges over torchft's ProcessGroupGloo only, not "
                        f"{type(pg).__name__} ({unsupported[0]}: not supported yet); give the Manager "
                        "pg=ProcessGroupGloo()")


def _check_module(module: Any) -> None:
    if isinstance(module, TorchDDP):
        raise TypeError(f"DistributedDataParallel wraps a plain module; this one is already a "
                        f"{type(module).__name__}: pass its .module")
    if type(module).__name__.startswith("FSDP") or hasattr(module, "set_custom_reduce_scatter"):
        raise TypeError(f"DistributedDataParallel takes a module not sharded by FSDP (got {type(module).__name__}); "
                        "with FSDP2 inside a replica group use torchft's own HSDP path")


def check_torchft_options(options: Dict[str, Any], ddp_kwargs: Dict[str, Any]) -> None:
    """Refuse what this integration cannot take, naming it: FSDP's options, the options it decides itself, a
    ``comm_dtype="auto"`` without online tuning (there is no profile to follow), then ``register``'s own check."""
    fsdp = sorted(set(options) & set(FSDP_ONLY) | set(ddp_kwargs) & set(FSDP_ONLY))
    if fsdp:
        raise TypeError(f"DistributedDataParallel takes DDP's and ddp_triton.register's options; {fsdp} are FSDP's "
                        "(ddp_triton.fsdp.register / fully_shard)")
    decided = sorted(set(options) & set(DECIDED_HERE))
    if decided:
        raise TypeError("DistributedDataParallel decides " + "; ".join(f"{k} ({DECIDED_HERE[k]})" for k in decided)
                        + ": leave it out")
    if options.get("comm_dtype") == AUTO_FORMAT and options.get("tune") != "online":
        raise ValueError("comm_dtype='auto' over torchft needs tune='online' (a profile's algorithm groups cannot be "
                         "made over a quorum's group)")
    check_options({**options, "profile": None})


class DistributedDataParallel(torchft.ddp.DistributedDataParallel):
    """torchft's ``DistributedDataParallel`` whose exchange between replica groups is ddp-triton's.

    ``manager`` and ``module`` as torchft's; ``process_group``: the group of this replica group's own ranks, averaged
    over in full precision before the exchange between groups (default: the default group when the replica group has
    several ranks; none for one rank); other keywords go to torch's DDP, as with torchft; ``comm_dtype`` and
    ``options``: ``ddp_triton.register``'s (``accumulate_dtype``, ``error_feedback``, ``grad_stats``, ``timing``,
    ``tune``, ``formats``). ``comm_state`` is the CommState.
    """

    def __init__(self, manager: Any, module: torch.nn.Module, comm_dtype: Any = torch.bfloat16, *,
                 process_group: Any = None, accumulate_dtype: Any = None, error_feedback: Optional[bool] = None,
                 grad_stats: bool = False, timing: bool = False, tune: Optional[str] = None,
                 formats: Any = None, **ddp_kwargs: Any) -> None:
        options = dict(comm_dtype=comm_dtype, accumulate_dtype=accumulate_dtype, error_feedback=error_feedback,
                       grad_stats=grad_stats, timing=timing, tune=tune, formats=formats)
        options.update({k: ddp_kwargs.pop(k) for k in list(ddp_kwargs) if k in DECIDED_HERE})
        check_torchft_options(options, ddp_kwargs)
        if getattr(manager, "_pg", None) is None:
            raise ValueError(f"DistributedDataParallel needs a torchft Manager with a process group "
                             f"(Manager(pg=ProcessGroupGloo(), ...)); got {type(manager).__name__} without one")
        _check_process_group(manager._pg)
        _check_module(module)
        inner = _inner_group(manager, process_group)
        state = CommState(profile=None, **options)
        state.name_parameters(module)
        object.__setattr__(self, "_pending_exchange", FaultTolerantExchange(manager, state, inner))
        super().__init__(manager, module, **ddp_kwargs)  # registers the hook through register_comm_hook below
        self.comm_state = state
        manager.register_state_dict_fn(STATE_KEY, self._exchange.load_state_dict, self._exchange.state_dict)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torchft's constructor registers its own hook here: this model registers ddp-triton's instead. Any later
        call is DDP's, which refuses a second hook."""
        pending = self.__dict__.pop("_pending_exchange", None)
        if pending is not None:
            self._exchange = pending
            super().register_comm_hook(pending, exchange_hook)
            return
        super().register_comm_hook(state, hook)


def _inner_group(manager: Any, process_group: Any) -> Any:
    """The group of this replica group's ranks (None: one rank), checked against the manager's group size."""
    size = getattr(manager, "_group_world_size", 1)
    if process_group is None and size > 1:
        if not dist.is_initialized():
            raise ValueError(f"this replica group has {size} ranks (the manager's world_size): they average among "
                             "themselves over their own process group; init_process_group (torchrun does) or pass "
                             "process_group=")
        process_group = dist.group.WORLD
    if process_group is not None and dist.get_world_size(process_group) != size:
        raise ValueError(f"process_group has {dist.get_world_size(process_group)} ranks and the manager's replica "
                         f"group {size}: give the group of this replica group's own ranks")
    return process_group
