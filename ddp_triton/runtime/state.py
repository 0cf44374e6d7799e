"""CommState: what triton_hook keeps across steps, built once per DDP model: the user's options and what they bound.

It pickles (``torch.save`` of a whole DDP model, ``copy.deepcopy``) as its options alone (``pickled.py``), and binds
again at its first bucket: to the default group, or to the one set as ``process_group`` before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..machine.profile import AUTO_FORMAT, MiB
from . import grad_stats as stats
from .algo_groups import device_scope
from .context import Context, bind_context
from .exchange import ExchangeQueue
from .options import ProfileSpec, check, settings_wire
from .online import OnlineTuner, save_tuned_profile, tuned_choice
from .pickled import pickled_options, restore_options
from .plan import Plan, plan_bucket, refuse_during_capture
from .residuals import ResidualStore
from .telemetry import Summary, summarize

# Plans unused for this many backward passes are dropped (old buckets after DDP's rebuild, join()'s shadow buckets).
STALE_AFTER = 4


@dataclass(eq=False)
class CommState:
    """State for :func:`ddp_triton.triton_hook`: build it on every rank, in the same order (compared by identity).

    Its options are checked at once. After ``init_process_group`` it binds at once (it may create process groups);
    built before, at its first bucket, on every rank, or at ``bind``/``register``."""

    process_group: Any = None
    """Group the gradients are averaged over; None is the default (world) group."""
    comm_dtype: Any = torch.bfloat16
    """Dtype on the wire: bfloat16, float16, float32, block-scaled float8_e4m3fn / float8_e5m2; or ``"auto"``: each
    bucket in the format the profile chose for its size (``autotune --formats``; none found: bfloat16, warned)."""
    profile: ProfileSpec = "auto"
    """The per-size NCCL algorithm choice: "auto" (this machine's cached profile, else NCCL's, warned if unusable), a
    profile JSON's path or a Profile (unusable: a ProfileError on every rank at binding), or None (NCCL's)."""
    device: Optional[torch.device] = None
    """CUDA device for the collectives run while binding; default the current one (``register``: the model's)."""
    accumulate_dtype: Optional[torch.dtype] = None
    """What the sum is taken in: None, the wire dtype (one all-reduce); torch.float32 (an all-to-all, a float32 sum
    and an all-gather: same bytes, one rounding after the sum whatever the world size). FP8 always sums in float32."""
    error_feedback: Optional[bool] = None
    """FP8 only (None: on): each rank adds what its FP8 rounding left out to the next step's gradients, at both
    rounding stages. Residuals are state: ``state_dict()`` / ``load_state_dict()``."""
    hierarchical: bool = False
    """Two-level exchange (``two_level.py``): reduced inside the node in the bucket's dtype, only the node-crossing hop
    in ``comm_dtype``. Nodes of different sizes are an error; one node, or one rank per node, the flat exchange."""
    grad_stats: bool = False
    """Each bucket's unpack also computes its statistics, for ``grad_norm()``, ``found_inf()`` and
    ``ddp_triton.clip_grad_norm_`` (``grad_stats.py``)."""
    timing: bool = False
    """Time each bucket's pack, communication and unpack (``telemetry.py``; read back by ``summary()``)."""
    tune: Optional[str] = None
    """``"online"`` (with ``comm_dtype="auto"``): the job's first steps choose each bucket's format (``online.py``)."""
    formats: Optional[List[str]] = None
    """The formats online tuning chooses among; None: the profile's admitted set, else fp32, bf16, bf16+fp32sum."""

    context: Optional[Context] = field(init=False, repr=False)
    """What the state bound to (``context.py``); None until it binds."""
    plans: Dict[int, Plan] = field(init=False, repr=False)
    """Per DDP bucket buffer (by its Python object's identity): its Plan."""
    residuals: ResidualStore = field(init=False, repr=False)
    """FP8 error-feedback residuals by parameter, and the parameters' names (``residuals.py``)."""
    queue: ExchangeQueue = field(init=False, repr=False)
    """The one order in which this state issues its collectives (``exchange.py``)."""
    passes: int = field(init=False, repr=False)
    """Backward passes this state has averaged (counted at each backward's last bucket)."""
    per_parameter_calls: bool = field(init=False, repr=False)
    """Whether the hook was called per parameter (compiled autograd's Python reducer): no statistics then."""
    needs_group: bool = field(init=False, repr=False)
    """Restored from a state saved on a group other than the default one: it must be given one before binding."""
    tuner: Optional[OnlineTuner] = field(init=False, repr=False)
    """With ``tune="online"``: what chooses each bucket's format (``online.py``)."""
    ddp_bucket_cap_mb: Optional[float] = field(init=False, repr=False)
    """The bucket size of the DDP model the state is registered on (``follow_model``), which the profile online
    tuning saves names; None: not known (the hook was registered without ``register``)."""

    def __post_init__(self) -> None:
        check_options({name: getattr(self, name) for name in STATE_OPTIONS})
        self._reset(needs_group=False)
        if dist.is_available() and dist.is_initialized():
            self._bind()

    def _reset(self, needs_group: bool) -> None:
        self.context, self.plans, self.residuals, self.queue = None, {}, ResidualStore(), ExchangeQueue()
        self.passes, self.per_parameter_calls, self.needs_group = 0, False, needs_group
        self.tuner = OnlineTuner(self.formats) if self.tune else None  # the options were checked
        self.ddp_bucket_cap_mb = None

    @property
    def bound(self) -> bool:
        return self.context is not None

    @property
    def wire(self) -> Any:
        """The WireFormat of the options (bound: as bound, flat where the job has one node); "auto": bfloat16's."""
        if self.context is not None:
            return self.context.wire
        return settings_wire(self.comm_dtype, self.accumulate_dtype, self.error_feedback, self.hierarchical)

    @property
    def wire_setting(self) -> str:
        """The wire format the options name: ``wire.name``, or ``"auto"`` (each bucket's from the profile)."""
        return AUTO_FORMAT if self.comm_dtype == AUTO_FORMAT else self.wire.name

    @property
    def keeps_residuals(self) -> bool:
        """Whether some bucket may keep error-feedback residuals (``state_dict`` has something to save)."""
        formats = self.context.formats if self.context is not None else None
        wires = formats.values() if formats is not None else (self.wire,)
        return any(w.error_feedback for w in wires) or bool(self.residuals.layouts or self.residuals.pending_first)

    def bind(self, process_group: Any = None, device: Optional[torch.device] = None) -> "CommState":
        """Bind now, if not bound yet, to ``process_group`` and ``device`` where it has none (collective)."""
        if self.context is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("CommState.bind needs torch.distributed to be initialised (init_process_group)")
            self.process_group = self.process_group if self.process_group is not None else process_group
            self.device = self.device if self.device is not None else device
            self._bind()
        return self

    def _bind(self) -> None:
        self.context = bind_context(self.averaging_group(), profile=self.profile, comm_dtype=self.comm_dtype,
                                    wire=self.wire, device=self.device, queue=self.queue, residuals=self.residuals,
                                    grad_stats=self.grad_stats, online=self.tuner and self.tuner.formats)
        if self.tuner is not None:
            self.tuner.admit(list(self.context.formats))

    def regroup(self, process_group: Any) -> None:
        """Bind again, at the next bucket, to ``process_group``, which replaces a group whose members changed (torchft's
        quorum: a replica gone or back). Nothing here is collective, as the old group may hold a dead peer: the buckets
        bind afresh on a new exchange queue (a failure may have broken the old one), each rank keeps its residuals
        as ``ResidualStore.release_locally`` says, and online tuning starts over (every rank of the new group
        regroups before the same step, so they tune together)."""
        self.residuals.release_locally()
        self.process_group, self.needs_group = process_group, False
        self.context, self.plans, self.queue = None, {}, ExchangeQueue()
        if self.tuner is not None:
            self.tuner = OnlineTuner(self.formats)

    def averaging_group(self) -> Any:
        """``process_group``, or the default group when it is None and the state was not saved on another group."""
        if self.process_group is not None:
            return self.process_group
        if self.needs_group:
            raise ValueError("this CommState was saved while bound to a process group other than the default one; "
                             "set state.process_group to the group to average over before its first bucket")
        return dist.group.WORLD

    def __getstate__(self) -> Dict[str, Any]:
        return pickled_options(self)

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        self._reset(needs_group=restore_options(self, saved))

    def plan_for(self, buffer: torch.Tensor, bucket: Any) -> Plan:
        """Bind ``buffer``'s Plan (new, or its residuals moved to another layout), off the per-step path."""
        refuse_during_capture(buffer)
        # Binding may issue collectives (a lazy state's agreement, the residuals' re-slice): in the one order.
        with self.queue.ordered():
            if self.context is None:  # built before init_process_group, or restored
                self.device = buffer.device if self.device is None and buffer.is_cuda else self.device
                self._bind()
            name = self.tuner and self.tuner.format_for(bucket)  # None: the context's format for its size
            plan = self.plans[id(buffer)] = plan_bucket(buffer, bucket, self.context, name)
        return plan

    def drop_stale_plans(self) -> None:
        """Drop the plans no bucket used for ``STALE_AFTER`` passes (the hook calls it every ``STALE_AFTER``)."""
        oldest = self.passes - STALE_AFTER
        self.plans = {key: plan for key, plan in self.plans.items() if plan.record.last_used >= oldest}

    def latest_pass(self) -> List[Plan]:
        """The plans of the latest backward pass counted."""
        return [plan for plan in self.plans.values() if plan.record.last_used == self.passes - 1]

    def held_bytes(self) -> int:
        """Bytes of communication buffers (not DDP's buckets) and error-feedback residuals this state holds."""
        held = sum(t.numel() * t.element_size() for plan in self.plans.values() for t in plan.exchange.held)
        return held + self.residuals.held_bytes()

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the averaged gradients of the latest synchronising backward (``grad_stats=True``): a 0-dim
        float32 tensor on the gradients' device, from the unpack's statistics, without a host sync."""
        return stats.grad_norm(self._with_stats())

    def found_inf(self) -> torch.Tensor:
        """1.0 if any averaged gradient of the latest synchronising backward is inf or NaN, else 0.0 (0-dim)."""
        return stats.found_inf(self._with_stats())

    def cannot_vouch(self, model: Any, norm_type: float = 2.0) -> Optional[str]:
        """None when ``grad_norm()`` is the norm torch's ``clip_grad_norm_`` would compute over ``model``'s
        gradients; else why not (``grad_stats.cannot_vouch``)."""
        plans = self.latest_pass()
        return stats.cannot_vouch(model, plans, self.passes - 1,
                                  stats.why_no_stats(self.grad_stats, self.per_parameter_calls, plans), norm_type)

    def _with_stats(self) -> List[Plan]:
        plans = self.latest_pass()
        reason = stats.why_no_stats(self.grad_stats, self.per_parameter_calls, plans)
        if reason is not None:
            raise RuntimeError(f"no gradient statistics: {reason}")
        return plans

    def summary(self) -> Summary:
        """Per bucket of the latest backward: bytes, wire format and bytes, algorithm, timings (``print`` it)."""
        ctx = self.context
        return summarize(self.latest_pass(), passes=self.passes, world_size=ctx and ctx.world_size,
                         backend=ctx and ctx.backend, timing=self.timing)

    def follow_model(self, ddp_model: Any) -> None:
        """Keep what the state needs of the DDP model it is registered on (``register`` and ``reattach`` call it):
        its parameters' names (the residuals') and its bucket size (the profile online tuning saves)."""
        self.name_parameters(ddp_model.module)
        cap = getattr(ddp_model, "bucket_bytes_cap", None)
        self.ddp_bucket_cap_mb = _cap_mb(cap) if isinstance(cap, int) and cap > 0 else None

    def name_parameters(self, module: torch.nn.Module) -> None:
        """Name the residuals' parameters after ``module``'s (``register`` and ``reattach`` do)."""
        self.residuals.name_parameters(module)

    def state_dict(self) -> Dict[str, Any]:
        """The error-feedback residuals by parameter name (empty without error feedback), and online tuning's
        choice. Collective; each rank's dict holds its own first-stage residuals, so save one per rank."""
        with self.queue.ordered():
            saved = self.residuals.state_dict(self.context and self.context.group, {"wire_format": self.wire_setting})
        return saved if self.tuner is None else {**saved, "online": self.tuner.state()}

    def all_ranks_state_dict(self) -> Dict[str, Any]:
        """``state_dict`` with every rank's residuals, the same dict on every rank, for checkpoints that one rank
        writes (Lightning's, Accelerate's). Collective; ``load_state_dict`` takes it on every rank."""
        if self.context is None:
            raise ValueError("all_ranks_state_dict needs a bound state (it gathers from every rank)")
        with self.queue.ordered(), device_scope(self.device):  # its gathers on the model's GPU, as the binding's
            return self.residuals.all_ranks_state_dict(self.context.group, {"wire_format": self.wire_setting})

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on this rank, checking everything first (one ValueError naming the
        mismatch, nothing changed); an unbound state checks the rank and world size when it binds."""
        online = saved.get("online") if isinstance(saved, dict) and self.tuner is not None else None
        tuned = None if online is None else self.tuner.check_saved(online)
        self.residuals.load_state_dict(saved, self.context and self.context.group, {"wire_format": self.wire_setting})
        if tuned is not None:
            self.tuner.lock(tuned)  # a resumed job skips tuning
        self.plans.clear()  # the buckets bind again, re-slicing the residuals to their layout

    def tuned_formats(self) -> Optional[Dict[int, Dict[str, Any]]]:
        """Per bucket index: the format online tuning chose and the medians (ms) that chose it; None while tuning."""
        return tuned_choice(self.tuner)

    def save_profile(self, path: Any) -> Any:
        """Write online tuning's choice as a profile that ``comm_dtype="auto"`` follows in the next run."""
        return save_tuned_profile(self.tuner, self.context, path, self.ddp_bucket_cap_mb)


def _cap_mb(cap_bytes: int) -> float:
    """The shortest ``bucket_cap_mb`` that DDP turns into ``cap_bytes`` (it truncates ``bucket_cap_mb * MiB``): the
    value the user gave, 0.01 rather than 0.0099993."""
    for digits in range(1, 17):
        mb = float(f"{cap_bytes / MiB:.{digits}g}")
        if int(mb * MiB) == cap_bytes:
            return mb
    return cap_bytes / MiB


#: The options a CommState takes, with their defaults: its fields that are constructor arguments.
STATE_OPTIONS = {f.name: f.default for f in fields(CommState) if f.init}


def check_options(options: Dict[str, Any]) -> Any:
    """Check CommState options without building a state (which may bind: collectives), and give their WireFormat:
    for the integrations, which take the options where a framework is configured (``options.check``)."""
    return check(options, STATE_OPTIONS)
