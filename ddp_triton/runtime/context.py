"""What a state decided when it bound, the same on every rank: the one object every bucket's Plan is built from.

Binding is collective (``bind_context``): the ranks agree on the profile and the wire format, make the process
groups of the profile's NCCL algorithms and, for a two-level format, the node groups. What comes out is frozen: a
bucket's Plan (``plan.py``) reads its group, format and averaging from it, never from the state's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..formats import WireFormat, average_factors, sorted_by_preference
from ..log import warn_once
from ..machine.profile import AUTO_FORMAT
from .algo_groups import device_scope, fail_together, group_backend, group_rank, select_group
from .chunks import agreed_chunk_bytes
from .exchange import ExchangeQueue
from .nodes import NodeGroups, bind_node_groups
from .online import DEFAULT_ONLINE_FORMATS
from .profile_choice import bind_profile, binding_group
from .residuals import ResidualStore


@dataclass(frozen=True, eq=False)
class Context:
    """A bound state's decisions: the group, the wire formats, the profile's algorithm groups, the node groups, and
    the queue and residual store every bucket of the state shares."""

    group: Any
    """The process group gradients are averaged over."""
    world_size: int
    backend: str
    """"nccl" (also for a mixed "cpu:gloo,cuda:nccl" group: CUDA buckets go through NCCL) or the group's backend."""
    wire: WireFormat
    """Every bucket's wire format, unless ``formats`` chooses per size."""
    formats: Optional[Dict[str, WireFormat]]
    """With ``comm_dtype="auto"`` and a profile that chooses formats: each format it may choose, by name."""
    profile: Any
    """The Profile the state follows; None: NCCL chooses."""
    algorithm_groups: Dict[str, Any]
    """Algorithm -> the process group whose NCCL communicator runs it, for the algorithms ``profile`` uses."""
    nodes: Optional[NodeGroups]
    """The groups of a two-level exchange; None: flat."""
    queue: ExchangeQueue
    """The one order in which the state issues its collectives (``exchange.py``)."""
    residuals: ResidualStore
    """FP8 error-feedback residuals by parameter (``residuals.py``)."""
    grad_stats: bool
    """Whether each bucket's unpack also computes its statistics (``grad_stats.py``)."""
    chunk_bytes: Optional[int] = None
    """Bytes of a bucket per chunk (``chunks.py``; 0: no chunks), as ``DDP_TRITON_CHUNK_BYTES`` says on every rank;
    None: the cost model chooses."""

    @property
    def mixed(self) -> bool:
        """Whether buckets travel in formats of their own (a profile's per-size formats)."""
        return self.formats is not None

    @property
    def queue_all(self) -> bool:
        """Whether an all-reduce goes through the queue too: some of the mixed formats are staged, so every group's
        collectives keep one order whatever mix of formats is in flight."""
        return self.formats is not None and any(
            (w.sharded and not w.one_all_reduce(self.world_size)) or w.two_level for w in self.formats.values())

    def wire_for(self, numel: int, name: Optional[str] = None) -> Tuple[WireFormat, float, float]:
        """The wire format of a bucket of ``numel`` elements (``name``: the one online tuning gives it), and the
        factors around its sum (``average_factors``). A profile's choice that online tuning does not admit, or
        none: ``wire``."""
        if name is None and self.formats is not None and self.profile is not None:
            name = self.profile.format_for(numel * 4)
        wire = self.wire if self.formats is None or name is None else self.formats.get(name, self.wire)
        return (wire, *average_factors(self.world_size, wire.comm_dtype))

    def group_for(self, nbytes: int) -> Tuple[Any, Optional[str]]:
        """The (group, NCCL algorithm) an all-reduce of ``nbytes`` goes to; algorithm None: NCCL's own choice."""
        if self.profile is None or not self.algorithm_groups:
            return self.group, None
        return select_group(self.algorithm_groups, self.profile, nbytes), self.profile.algorithm_for(nbytes)


def bind_context(group: Any, *, profile: Any, comm_dtype: Any, wire: WireFormat, device: Optional[torch.device],
                 queue: ExchangeQueue, residuals: ResidualStore, grad_stats: bool,
                 online: Optional[List[str]] = None) -> Context:
    """Bind a state's settings to ``group`` (collective: every rank at the same point). ``profile`` is the argument
    as given, ``comm_dtype`` the setting (a dtype or "auto"), ``wire`` the settings' format; ``online``: with
    ``tune="online"``, the formats the user admitted ([]: the profile's admitted set, else the defaults).

    All of it runs with ``device`` (the model's) as the current CUDA device: every collective here, and the NCCL
    communicator each brings up, goes to the model's GPU whatever device the script made current.
    """
    if group is dist.GroupMember.NON_GROUP_MEMBER or group_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group")
    with device_scope(device):
        return _bind(group, profile, comm_dtype, wire, queue, residuals, grad_stats, online)


def _bind(group: Any, profile: Any, comm_dtype: Any, wire: WireFormat, queue: ExchangeQueue,
          residuals: ResidualStore, grad_stats: bool, online: Optional[List[str]]) -> Context:
    """``bind_context``'s work, under the model's device."""
    world_size = dist.get_world_size(group)
    backend = group_backend(group).lower()
    backend = "nccl" if "nccl" in backend else backend
    loaded, here = residuals.loaded_from, (group_rank(group), world_size)
    fail_together(None if loaded is None or loaded == here else
                  f"the residuals loaded into this state are rank {loaded[0]} of {loaded[1]}'s; it binds as rank "
                  f"{here[0]} of {here[1]}: load each rank's own file", group)
    wire_setting = AUTO_FORMAT if comm_dtype == AUTO_FORMAT else wire.name
    if online is not None:  # the ranks must admit the same formats: compared with the setting
        wire_setting += " tune=online " + ",".join(online)
    # The profile is looked up by the dtype on the wire (a format's name as comm_dtype names one too)
    dtype = AUTO_FORMAT if comm_dtype == AUTO_FORMAT else wire.wire_dtype
    active, algorithm_groups = bind_profile(profile, group=group, world_size=world_size, comm_dtype=dtype,
                                            backend=backend, wire_format=wire_setting)
    if online is not None:  # before tuning, a bucket the profile does not place goes in the most accurate format
        formats = {name: WireFormat.parse(name) for name in sorted_by_preference(online_formats(online, active))}
        wire = next(iter(formats.values()))
    else:
        formats = formats_of(active) if comm_dtype == AUTO_FORMAT else None  # the ranks agreed on the profile
    two_level = [w for w in (formats or {wire.name: wire}).values() if w.two_level]
    # Called without a two-level format too: where making node groups takes the whole world, every rank takes part.
    nodes = bind_node_groups(group, two_level[0].flat().name if two_level else None,
                             world_binds=binding_group(profile, group) is dist.group.WORLD)
    if two_level and nodes is None:  # one node, one rank per node, or no groups to be had: the ranks go flat together
        wire = wire.flat()
        formats = None if formats is None else {name: w.flat() for name, w in formats.items()}
    return Context(group, world_size, backend, wire, formats, active, algorithm_groups, nodes, queue, residuals,
                   grad_stats, agreed_chunk_bytes(group))


def online_formats(given: List[str], profile: Any) -> List[str]:
    """The formats online tuning chooses among: the user's, else the profile's admitted set, else the defaults."""
    if given:
        return given
    if profile is not None and profile.formats is not None:
        return list(profile.formats.admitted)
    return list(DEFAULT_ONLINE_FORMATS)


def formats_of(profile: Any) -> Optional[Dict[str, WireFormat]]:
    """The wire formats ``profile``'s table sends buckets in, by name; None (with a warning on every rank) when it
    chooses none: every bucket then travels in bfloat16."""
    choice = None if profile is None else profile.formats
    if choice is None:
        warn_once("triton_hook: comm_dtype='auto' found no profile that chooses wire formats (make one with "
                  "`ddp-triton autotune --formats ...`); every bucket travels in bfloat16", all_ranks=True)
        return None
    return {name: WireFormat.parse(name) for name in dict.fromkeys(r.format for r in choice.table)}
