"""CommState: what triton_hook needs across steps, built once per DDP model.

It holds the process group, the wire format, how the division by world size is split around the sum, the
autotuned per-size choice of NCCL algorithm (one process group per algorithm), the error-feedback residuals and,
per bucket, its bound path (``bucket.py``). Memory held: one comm-dtype copy of each bucket (half the gradients'
bytes for float32 gradients sent as bfloat16), nothing when the comm dtype equals the bucket dtype, which is sent
in place; the sharded exchanges' send, receive and shard buffers instead for the formats summed in float32, and
the FP8 residuals (``held_bytes``); two-level, a padded bucket-dtype copy of each bucket and a part, plus the
cross format's buffers for the part.

A state pickles (``torch.save`` of a whole DDP model, ``copy.deepcopy``) as its settings alone, the way torch's
PowerSGDState does: the process group, the resolved profile, the algorithm groups, buffers and launches stay behind,
and the restored state binds again, to the default group unless given another, at its first bucket.

``profile`` is the argument as given ("auto", a path, a Profile or None); ``active_profile`` is the Profile the
state follows once bound (``profile_choice.resolve_profile``), or None when NCCL chooses.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..dtypes import comm_dtypes
from ..formats import WireFormat
from ..log import logger, warn_once
from ..machine.profile import AUTO_FORMAT
from . import grad_stats as stats
from .algo_groups import fail_together, select_group
from .bucket import BucketComm, bind_bucket, split_average
from .exchange import ExchangeQueue
from .nodes import NodeGroups, bind_node_groups
from .profile_choice import bind_profile, check_profile_spec
from .residuals import ResidualStore
from .telemetry import Summary, summarize

#: The dtypes the hook can all-reduce in (``ddp_triton.dtypes.COMM_DTYPE_NAMES``), as torch dtypes.
COMM_DTYPES = comm_dtypes()

ProfileSpec = Union[None, str, "os.PathLike[str]", Any]  # "auto", a path, a Profile, or None


# The format of what a pickled CommState holds (``CommState.__getstate__``); any other is refused, not converted.
_PICKLE_VERSION = 4
_PICKLED = ("version", "comm_dtype", "profile", "on_default_group", "accumulate_dtype", "error_feedback",
            "hierarchical", "grad_stats", "timing")

# Entries unused for this many backward passes are dropped: old buckets after DDP's rebuild, join()'s shadow
# buckets, models that stopped training. Several models sharing a state each touch theirs every step, far within.
_STALE_AFTER = 4


@dataclass(eq=False)
class CommState:
    """State for :func:`ddp_triton.triton_hook`.

    Build it on every rank, in the same order. After ``init_process_group`` it binds at once (it may create
    process groups); built before, it holds its settings (checked at once) and binds its group, device and profile
    at its first bucket, on every rank, or at ``bind``/``register``. Compared by identity: it holds tensors.
    """

    process_group: Any = None
    """Group the gradients are averaged over; None is the default (world) group."""
    comm_dtype: Union[torch.dtype, str] = torch.bfloat16
    """Dtype on the wire: bfloat16, float16, float32, or block-scaled float8_e4m3fn / float8_e5m2; or ``"auto"``:
    each bucket in the wire format the profile chose for its size (``ddp-triton autotune --formats``), with
    ``accumulate_dtype``, ``error_feedback`` and ``hierarchical`` left unset (the format names them). Where no
    profile with formats is found every bucket travels in bfloat16, and every rank warns."""
    profile: ProfileSpec = "auto"
    """Autotuned per-size NCCL algorithm choice: "auto" (this machine's cached profile if there is one, else NCCL's
    own choice, with a warning when the cached file cannot be used), a path to a profile JSON, a Profile, or None
    (NCCL's). A path or Profile that cannot be used (unreadable, not a profile, made for another world size or
    dtype) is a ProfileError on every rank when the state binds, before any bucket is sent. Kept as given, also
    when pickled; the Profile followed is ``active_profile``."""
    device: Optional[torch.device] = None
    """CUDA device for the collectives run while the state is built (profile check, algorithm groups); default the
    current device. ``register`` passes the model's, so a job that never called ``torch.cuda.set_device`` works.
    A state restored from a pickle uses its first bucket's."""
    accumulate_dtype: Optional[torch.dtype] = None
    """What the sum is taken in: None, the wire dtype (one all-reduce, as NCCL adds); torch.float32, float32 (an
    all-to-all, a float32 sum and an all-gather: same bytes, one rounding after the sum whatever the world size).
    FP8 always sums in float32."""
    error_feedback: Optional[bool] = None
    """FP8 only (None: on for FP8): each rank adds what its FP8 rounding left out to the next step's gradients,
    at both rounding stages, so the rounding errors do not accumulate in the weights. Residuals are state:
    ``state_dict()`` / ``load_state_dict()``."""
    hierarchical: bool = False
    """Two-level exchange (``two_level.py``): each bucket is reduced inside the node in its own dtype and only the
    node-crossing hop travels in ``comm_dtype`` (and its accumulate dtype, error feedback). Nodes come from
    torchrun's ``GROUP_RANK`` or the host names, agreed by every rank when the state binds; nodes of different sizes
    are an error, one node or one rank per node the flat exchange (with a warning)."""
    grad_stats: bool = False
    """Have each bucket's unpack also compute the sum of squares and non-finite count of the averaged gradients, for
    ``grad_norm()``, ``found_inf()`` and ``ddp_triton.clip_grad_norm_`` (``grad_stats.py``). Set at construction."""
    timing: bool = False
    """Time each bucket's pack, communication and unpack (CUDA events on CUDA tensors, read back only by
    ``summary()``; the host's perf_counter on CPU tensors), see ``telemetry.py``."""

    # ---- what the state builds; made by ``_reset`` (construction and unpickling alike) ----------------------------
    wire: WireFormat = field(init=False, repr=False)
    """The wire format of the settings (``ddp_triton/formats.py``); with ``comm_dtype="auto"``, bfloat16's, for the
    buckets of a state that found no profile with formats."""
    formats: Optional[Dict[str, WireFormat]] = field(init=False, repr=False)
    """With ``comm_dtype="auto"`` and a profile that chooses formats, once bound: each format it may choose, by name
    (``active_profile.format_for`` gives a bucket's); None: every bucket in ``wire``."""
    residuals: ResidualStore = field(init=False, repr=False)
    """FP8 error-feedback residuals by parameter, and the parameters' names (``residuals.py``)."""
    exchanges: ExchangeQueue = field(init=False, repr=False)
    """The one order in which this state issues its collectives (``exchange.py``)."""
    nodes: Optional[NodeGroups] = field(init=False, repr=False)
    """The node and cross groups of a two-level exchange, once bound; None: flat."""
    buckets: Dict[int, BucketComm] = field(init=False, repr=False)
    """Per DDP bucket buffer (by its Python object's identity): its bound path (``bucket.py``)."""
    algorithm_groups: Dict[str, Any] = field(init=False, repr=False)
    """Algorithm -> the process group whose NCCL communicator runs it, for the algorithms ``active_profile`` uses."""
    active_profile: Any = field(init=False, repr=False)
    """The Profile this state follows, resolved from ``profile`` when the state binds; None: NCCL chooses."""
    group: Any = field(init=False, repr=False)
    """The process group it averages over, once bound."""
    world_size: Optional[int] = field(init=False, repr=False)
    backend: Optional[str] = field(init=False, repr=False)
    """"nccl" (also for a mixed "cpu:gloo,cuda:nccl" group: CUDA buckets go through NCCL) or the group's backend."""
    pre_scale: float = field(init=False, repr=False)
    post_scale: float = field(init=False, repr=False)
    """The factors around the sum (``bucket.split_average``), once bound."""
    per_parameter_calls: bool = field(init=False, repr=False)
    """Whether the hook was called per parameter (compiled autograd's Python reducer): no statistics then."""
    _needs_group: bool = field(init=False, repr=False)
    _passes: int = field(init=False, repr=False)
    _bound: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._reset(check_options({name: getattr(self, name) for name in STATE_OPTIONS}), needs_group=False)
        # Before init_process_group (a framework that wants the state when its strategy is built, like Lightning's
        # DDPStrategy(ddp_comm_state=...)): settings only; binds at its first bucket or at ``bind``/``register``.
        if dist.is_available() and dist.is_initialized():
            self._bind_group()

    def _reset(self, wire: WireFormat, needs_group: bool) -> None:
        """Everything but the settings, as a state that has not bound yet holds it."""
        self.wire = wire
        self.formats = None
        self.residuals = ResidualStore()
        self.exchanges = ExchangeQueue()
        self.nodes = None
        self.buckets = {}
        self.algorithm_groups = {}
        self.active_profile = None
        self.group = None
        self.world_size = None
        self.backend = None
        self.pre_scale, self.post_scale = 1.0, 1.0
        self.per_parameter_calls = False
        self._needs_group = needs_group
        self._passes = 0
        self._bound = False

    @property
    def bound(self) -> bool:
        """Whether the state has bound its process group, device and profile (False until then for a state built
        before ``init_process_group`` or restored from a pickle)."""
        return self._bound

    @property
    def passes(self) -> int:
        """Backward passes this state has averaged (counted at each backward's last bucket)."""
        return self._passes

    def bind(self, process_group: Any = None, device: Optional[torch.device] = None) -> "CommState":
        """Bind now, if not bound yet: to ``process_group`` and ``device`` where the state was given none.

        Collective, like construction after ``init_process_group``: call on every rank in the same order. A bound
        state is left as it is.
        """
        if not self._bound:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("CommState.bind needs torch.distributed to be initialised (init_process_group)")
            if self.process_group is None and process_group is not None:
                self.process_group = process_group
            if self.device is None and device is not None:
                self.device = device
            self._bind_group()
        return self

    def _bind_group(self) -> None:
        """Bind to the process group and resolve the profile: at construction, or at a restored state's first bucket.

        Collective (the profile agreement, algorithm groups): every rank gets here at the same point, which for a
        restored state is its first bucket, reached by every rank in the same order as DDP's backward.
        """
        group = self.averaging_group()
        if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group")
        world_size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        backend = "nccl" if "nccl" in backend else backend
        loaded = self.residuals.loaded_from
        here = (dist.get_rank(group), world_size)
        fail_together(None if loaded is None or loaded == here else
                      f"the residuals loaded into this state are rank {loaded[0]} of {loaded[1]}'s; it binds as rank "
                      f"{here[0]} of {here[1]}: load each rank's own file", group)
        self.active_profile, self.algorithm_groups = bind_profile(
            self.profile, group=group, world_size=world_size, comm_dtype=self.comm_dtype, backend=backend,
            wire_format=self.wire_setting, device=self.device)  # the ranks agree on the wire format here
        if self.comm_dtype == AUTO_FORMAT:  # every rank follows the same profile (agreed above), so the same formats
            self.formats = formats_of(self.active_profile)
        two_level = [w for w in (self.formats or {self.wire.name: self.wire}).values() if w.two_level]
        if two_level:
            on_device = self.device is not None and self.device.type == "cuda"
            with torch.cuda.device(self.device) if on_device else contextlib.nullcontext():
                self.nodes = bind_node_groups(group, two_level[0].flat().name)
            if self.nodes is None:  # one node, or one rank per node: every rank goes flat together
                self.wire = self.wire.flat()
                if self.formats is not None:
                    self.formats = {name: w.flat() for name, w in self.formats.items()}
        self.group, self.world_size, self.backend = group, world_size, backend
        self.pre_scale, self.post_scale = split_average(world_size, self.wire.comm_dtype)
        self._bound = True

    @property
    def wire_setting(self) -> str:
        """The wire format the settings name: ``wire.name``, or ``"auto"`` (each bucket's from the profile)."""
        return AUTO_FORMAT if self.comm_dtype == AUTO_FORMAT else self.wire.name

    @property
    def keeps_residuals(self) -> bool:
        """Whether some bucket may keep error-feedback residuals (``state_dict`` has something to save)."""
        wires = self.formats.values() if self.formats is not None else (self.wire,)
        return any(w.error_feedback for w in wires) or bool(self.residuals.layouts or self.residuals.pending_first)

    def averaging_group(self) -> Any:
        """The group gradients are averaged over: ``process_group``, or the default group when it is None.

        A state restored from one saved on another group has no group until given one (``state.process_group =
        group`` before its first bucket), rather than averaging over the wrong ranks.
        """
        if self.process_group is not None:
            return self.process_group
        if self._needs_group:
            raise ValueError("this CommState was saved while bound to a process group other than the default one; "
                             "set state.process_group to the group to average over before its first bucket")
        return dist.group.WORLD

    def __getstate__(self) -> Dict[str, Any]:
        """The settings, with the profile argument as given. No process group, resolved profile, algorithm groups,
        buffers or launches: they belong to this process's communicators and memory."""
        if self.process_group is None:
            on_default = not self._needs_group
        else:
            on_default = dist.is_initialized() and self.process_group == dist.group.WORLD
        if self.residuals.layouts or self.residuals.pending_first:
            logger.warning("triton_hook: a pickled CommState leaves its error-feedback residuals behind; save them "
                           "with state.state_dict() on every rank")
        return {"version": _PICKLE_VERSION, "comm_dtype": self.comm_dtype, "profile": self.profile,
                "on_default_group": on_default, "accumulate_dtype": self.accumulate_dtype,
                "error_feedback": self.error_feedback, "hierarchical": self.hierarchical,
                "grad_stats": self.grad_stats, "timing": self.timing}

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        """A state that binds at its first bucket: to the default group, or to ``process_group`` if set before. A
        state pickled in another format is refused with a ValueError saying what to do."""
        version = saved.get("version") if isinstance(saved, dict) else None
        if version != _PICKLE_VERSION or sorted(saved) != sorted(_PICKLED):
            raise ValueError(f"a CommState pickled in format {version!r} by another ddp-triton; this one reads format "
                             f"{_PICKLE_VERSION} only: make the state anew with ddp_triton.register(ddp_model, ...) "
                             "(and load a saved model from its state_dict, not from a pickle)")
        self.process_group = None
        self.comm_dtype = saved["comm_dtype"]
        self.profile = saved["profile"]
        self.accumulate_dtype = saved["accumulate_dtype"]
        self.error_feedback = saved["error_feedback"]
        self.hierarchical = saved["hierarchical"]
        self.grad_stats = saved["grad_stats"]
        self.timing = saved["timing"]
        self.device = None  # the saving rank's device means nothing here; the first bucket's is used
        self._reset(settings_wire(self.comm_dtype, self.accumulate_dtype, self.error_feedback, self.hierarchical),
                    needs_group=not saved["on_default_group"])

    # ---- buckets ------------------------------------------------------------------------------------------------

    def bucket_comm(self, bucket: Any) -> BucketComm:
        """This bucket's bound path: made when its buffer is first seen, reused while it lives (and counted in the
        current pass). Keyed by the buffer's Python object, which the entry holds: torch keeps one Python object per
        tensor while a reference lives, so no other buffer can have its identity meanwhile."""
        buffer = bucket.buffer()
        entry = self.buckets.get(id(buffer))
        if entry is None or not entry.valid:  # new, or its residuals moved to another layout: bind (again)
            # Binding may issue collectives (a lazy state's agreement, the residuals' re-slice): in the one order.
            with self.exchanges.ordered():
                entry = self.buckets[id(buffer)] = self._bind_bucket(buffer, bucket)
        entry.last_used = self._passes
        return entry

    def count_pass(self) -> None:
        """Called when the hook starts a backward's last bucket: count the pass and, now and then, drop entries gone
        stale."""
        self._passes += 1
        if self._passes % _STALE_AFTER == 0:
            oldest = self._passes - _STALE_AFTER
            for key in [k for k, e in self.buckets.items() if e.last_used < oldest]:
                del self.buckets[key]

    def latest_pass(self) -> List[BucketComm]:
        """The buckets of the latest backward pass counted, in the order the state holds them."""
        last = self._passes - 1
        return [e for e in self.buckets.values() if e.last_used == last]

    def _bind_bucket(self, buffer: torch.Tensor, bucket: Any) -> BucketComm:
        if buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            # Binding allocates, and may zero residuals or run collectives: kernels a graph would replay each step.
            raise RuntimeError("triton_hook: a bucket was first seen during CUDA graph capture; run eager steps "
                               "before capturing (torch's recipe for DDP: at least 11) so that every bucket binds "
                               "outside the graph, DDP's rebuilt buckets included")
        if not self._bound:  # built before init_process_group, or restored: binds here, off the per-step path
            if self.device is None and buffer.is_cuda:
                self.device = buffer.device
            self._bind_group()
        wire, (pre_scale, post_scale) = self.wire, (self.pre_scale, self.post_scale)
        if self.formats is not None:  # the profile's format for a bucket of this size (elements x 4 bytes)
            wire = self.formats[self.active_profile.format_for(buffer.numel() * 4)]
            pre_scale, post_scale = split_average(self.world_size, wire.comm_dtype)
        return bind_bucket(buffer, bucket, wire=wire, group=self.group, world_size=self.world_size,
                           backend=self.backend, pre_scale=pre_scale, post_scale=post_scale,
                           grad_stats=self.grad_stats, group_for=self._group_for, residuals=self.residuals,
                           queue=self.exchanges, nodes=self.nodes, mixed=self.formats is not None,
                           queue_all_reduce=self.formats is not None and any(
                               (w.sharded and not w.one_all_reduce(self.world_size)) or w.two_level
                               for w in self.formats.values()))

    def _group_for(self, nbytes: int) -> Tuple[Any, Optional[str]]:
        if self.active_profile is None or not self.algorithm_groups:
            return self.group, None
        algorithm = self.active_profile.algorithm_for(nbytes)
        return select_group(self.algorithm_groups, self.active_profile, nbytes), algorithm

    def held_bytes(self) -> int:
        """Bytes of communication buffers and error-feedback residuals this state holds (DDP's own bucket buffers
        not counted)."""
        held = 0
        for entry in self.buckets.values():
            if entry.exchange is not None:
                tensors = entry.exchange.held
            else:
                tensors = (entry.wire_buffer,) if entry.wire_buffer is not entry.buffer else ()
            held += sum(t.numel() * t.element_size() for t in tensors)
        return held + self.residuals.held_bytes()

    # ---- gradient statistics and telemetry (grad_stats.py, telemetry.py) -------------------------------------------

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of all averaged gradients of the latest synchronising backward (``grad_stats=True``): a 0-dim
        float32 tensor on the gradients' device, computed from the unpack's statistics without a host sync."""
        return stats.grad_norm(self._with_stats())

    def found_inf(self) -> torch.Tensor:
        """1.0 if any averaged gradient of the latest synchronising backward is inf or NaN, else 0.0 (0-dim float32,
        on the gradients' device, no host sync; ``grad_stats=True``)."""
        return stats.found_inf(self._with_stats())

    def cannot_vouch(self, model: Any, norm_type: float = 2.0) -> Optional[str]:
        """None when ``grad_norm()`` is the norm torch's ``clip_grad_norm_`` would compute over ``model``'s gradients
        (a module, or its parameters); else why not (``grad_stats.cannot_vouch``)."""
        entries = self.latest_pass()
        return stats.cannot_vouch(model, entries, self._passes - 1, self._why_no_stats(entries), norm_type)

    def _why_no_stats(self, entries: List[BucketComm]) -> Optional[str]:
        return stats.why_no_stats(self.grad_stats, self.per_parameter_calls, entries)

    def _with_stats(self) -> List[BucketComm]:
        entries = self.latest_pass()
        reason = self._why_no_stats(entries)
        if reason is not None:
            raise RuntimeError(f"no gradient statistics: {reason}")
        return entries

    def summary(self) -> Summary:
        """Per bucket of the latest backward: bytes, bytes on the wire per format, algorithm group, wire format and,
        with ``timing=True``, pack/comm/unpack times (read back now). ``print`` it for a table."""
        return summarize(self.latest_pass(), passes=self._passes, world_size=self.world_size, backend=self.backend,
                         timing=self.timing)

    # ---- error-feedback residuals (residuals.py) ------------------------------------------------------------------

    def name_parameters(self, module: torch.nn.Module) -> None:
        """Name the residuals' parameters after ``module``'s (``register`` and ``reattach`` do this with the DDP
        model's). A state shared by several models names each one's (``ResidualStore.name_parameters``)."""
        self.residuals.name_parameters(module)

    def _residual_settings(self) -> Dict[str, Any]:
        return {"wire_format": self.wire_setting}

    def state_dict(self) -> Dict[str, Any]:
        """The error-feedback residuals by parameter name (empty without error feedback), to save with the model
        and optimizer. Collective: call on every rank; each rank's dict holds its own first-stage residuals, so
        save one per rank (as a sharded optimizer's). A state not bound yet gives what was loaded into it."""
        if not self._bound:
            return self.residuals.state_dict(None, self._residual_settings())
        with self.exchanges.ordered():
            return self.residuals.state_dict(self.group, self._residual_settings())

    def all_ranks_state_dict(self) -> Dict[str, Any]:
        """``state_dict`` with every rank's first-stage residuals, the same dict on every rank: for checkpoints that
        one rank writes (Lightning's, Accelerate's). Collective; ``load_state_dict`` takes it on every rank."""
        if not self._bound:
            raise ValueError("all_ranks_state_dict needs a bound state (it gathers from every rank)")
        with self.exchanges.ordered():
            return self.residuals.all_ranks_state_dict(self.group, self._residual_settings())

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on this rank; the next buckets re-slice the residuals to their
        layout (a fresh DDP model's constructor order included). Checks everything first (format, rank and world
        size, names, sizes, dtype) and raises one ValueError naming the mismatch, leaving the state as it was; a
        state not bound yet checks the rank and world size when it binds."""
        self.residuals.load_state_dict(saved, self.group if self._bound else None, self._residual_settings())
        self.buckets.clear()


#: The options a CommState takes: its fields that are constructor arguments.
STATE_OPTIONS = tuple(f.name for f in fields(CommState) if f.init)


def check_options(options: Dict[str, Any]) -> WireFormat:
    """Check CommState options without building a state (which may bind: collectives), and give their WireFormat.

    The one check of what a combination means, for ``CommState`` and for the integrations that take its options
    where a framework is configured: unknown names are a TypeError, bad values a ValueError (a TypeError for a
    ``profile`` or ``process_group`` of the wrong kind), each naming the option and the value.
    """
    unknown = sorted(set(options) - set(STATE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown CommState options {unknown}; it takes {sorted(STATE_OPTIONS)}")
    defaults = {f.name: f.default for f in fields(CommState) if f.init}
    given = {**defaults, **options}
    wire = settings_wire(given["comm_dtype"], given["accumulate_dtype"], given["error_feedback"],
                         given["hierarchical"])
    check_profile_spec(given["profile"])
    if given["comm_dtype"] == AUTO_FORMAT and given["profile"] is None:
        raise ValueError("comm_dtype='auto' takes each bucket's wire format from a tuned profile: pass "
                         "profile='auto' (this machine's cached one) or a profile's path, not None")
    for flag in ("grad_stats", "timing"):
        if not isinstance(given[flag], bool):
            raise ValueError(f"{flag} must be True or False, got {given[flag]!r}")
    device = given["device"]
    if device is not None and not isinstance(device, torch.device):
        raise ValueError(f"device must be None or a torch.device, got {device!r}")
    group = given["process_group"]
    # new_group gives ranks outside the group NON_GROUP_MEMBER, which binding refuses, naming the rank
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and not isinstance(group,
                                                                                               dist.ProcessGroup):
        raise TypeError(f"process_group must be None or a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
    return wire


def settings_wire(comm_dtype: Any, accumulate_dtype: Any, error_feedback: Any, hierarchical: Any) -> WireFormat:
    """The WireFormat of a state's settings (``WireFormat.from_options``); for ``comm_dtype="auto"``, bfloat16's, the
    others being left unset (each bucket's format names them), else a ValueError naming the one that is set."""
    if isinstance(comm_dtype, str):
        if comm_dtype != AUTO_FORMAT:
            raise ValueError(f"comm_dtype must be a torch dtype or 'auto', got {comm_dtype!r}")
        for name, value, unset in (("accumulate_dtype", accumulate_dtype, None),
                                   ("error_feedback", error_feedback, None), ("hierarchical", hierarchical, False)):
            if value is not unset:
                raise ValueError(f"comm_dtype='auto' takes each bucket's wire format from the profile, which names "
                                 f"its sums, error feedback and levels: leave {name} unset (got {value!r})")
        return WireFormat.from_options(torch.bfloat16)
    return WireFormat.from_options(comm_dtype, accumulate_dtype, error_feedback, hierarchical)


def formats_of(profile: Any) -> Optional[Dict[str, WireFormat]]:
    """The wire formats ``profile``'s table sends buckets in, by name (the table is what the ranks' profile check
    covers); None (with a warning on every rank) when it chooses none: every bucket then travels in bfloat16."""
    choice = None if profile is None else profile.formats
    if choice is None:
        warn_once("triton_hook: comm_dtype='auto' found no profile that chooses wire formats (make one with "
                  "`ddp-triton autotune --formats ...`); every bucket travels in bfloat16", all_ranks=True)
        return None
    return {name: WireFormat.parse(name) for name in dict.fromkeys(r.format for r in choice.table)}  # digested


_default_states: Dict[int, CommState] = {}


def default_state(process_group: Any = None) -> CommState:
    """The state for a hook registered, as torch's hooks allow, with ``None`` (the default group) or a process group
    as its state: bfloat16 on the wire, NCCL's own algorithm choice. One per group, made at its first bucket."""
    group = process_group if process_group is not None else dist.group.WORLD
    state = _default_states.get(id(group))
    if state is None:
        state = _default_states[id(group)] = CommState(process_group=group, profile=None)
        logger.debug("triton_hook: a state for process group %s, bfloat16", id(group))
    return state
