"""Which ranks share a node, agreed by every rank: the groups a two-level exchange runs on.

A rank's node is what torchrun says (``GROUP_RANK``, the node's rank in the job, set for every worker it starts) or
else the host's name. Every rank of the averaging group hands in its node's name (as a digest, so names of any
length fit one all-gather), so every rank computes the same partition from the same list and they decide together:

- nodes of different sizes: a ValueError on every rank (the shards would differ in size between nodes);
- one node, or one rank per node: the flat exchange, with a warning (a two-level exchange would add a hop and save
  nothing: all links are the node's own, or every rank is its node);
- otherwise ``NodeGroups``: the node's group (its ranks, in rank order), the cross group (the ranks with this
  rank's local index on every node, nodes ordered by their lowest rank) and a second group of the node's ranks for
  the all-gathers: made by every rank in one order on the default group, by their members only
  (``use_local_synchronization``) on a part of the world. Where the default group is bound to a device, torch
  splits every new group from its communicator, collective over the world: a part of the world's groups are then
  made by every rank of the world (all of them bind together when the state has a profile), or not at all (flat).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..log import warn_once
from .algo_groups import agree_on_group_count, collective_device, gather_text, group_timeout


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in the two-level exchange, and the three groups it runs on."""

    n_nodes: int
    local_size: int
    """Ranks per node."""
    node_index: int
    """This rank's rank in the cross group: which shard of the cross exchange it owns (the node's place in the order
    of the nodes' lowest ranks when each node's ranks are contiguous, as torchrun makes them)."""
    local_index: int
    """This rank's place in its node (rank order): its rank in the node group, and the shard it owns."""
    node_group: Any
    """The node's ranks: the reduce-scatter (or the all-reduce) of each bucket."""
    cross_group: Any
    gather_group: Any
    """The node's ranks again, for the all-gathers: a group of their own, so that a bucket's all-gather never waits
    in line behind the next bucket's reduce-scatter, nor the other way round (each group keeps bucket order)."""
    reduce_scatter: bool = True
    """Whether the node group's reduce-scatter gives a Work with a future (NCCL's does; gloo's has none, or no
    reduce-scatter at all in older torch): without, the node sums by an all-reduce of the whole bucket."""


def node_name(env: Mapping[str, str] = os.environ) -> str:
    """This process's node: ``node <GROUP_RANK>`` under torchrun, else ``host <hostname>``."""
    group_rank = env.get("GROUP_RANK", "").strip()
    if group_rank:
        return f"node {group_rank}"
    return f"host {socket.gethostname()}"


def partition(names: List[str]) -> List[List[int]]:
    """The positions of ``names`` grouped by name, groups in the order of their first position."""
    by_name: Dict[str, List[int]] = {}
    for position, name in enumerate(names):
        by_name.setdefault(name, []).append(position)
    return list(by_name.values())


def bind_node_groups(group: Any, wire_name: Optional[str], world_binds: bool = False,
                     env: Mapping[str, str] = os.environ) -> Optional[NodeGroups]:
    """The node and cross groups of ``group`` for a two-level exchange in ``wire_name``, or None (flat, with a
    warning). ``wire_name`` None: the state sends no two-level format, and only takes its part where making the
    groups takes the whole world.

    Collective over ``group``: every rank calls it at the same point (the state's binding). Where the default group
    is bound to a device and ``group`` is a part of the world, torch makes each new group's communicator by splitting
    the default group's, which every rank of the world must join: then, if every rank of the world binds here
    (``world_binds``), all of them make every rank's groups together; if not, the state goes flat, with a warning.
    """
    split = splits_over_world(group)
    if split and not world_binds:
        if wire_name is not None and dist.get_rank(group) == 0:
            warn_once(f"triton_hook: hierarchical=True on a process group of {dist.get_world_size(group)} of the "
                      f"{dist.get_world_size()} ranks while the default group is bound to a device "
                      "(init_process_group(device_id=...)): torch makes every new group by splitting the default "
                      "group's communicator, which all ranks must join, and with profile=None only this group's ranks "
                      f"bind here, so buckets go flat ({wire_name} over the group's ranks). Leave profile at 'auto' "
                      "(every rank of the world then binds together), or init without device_id", all_ranks=True)
        return None
    layout = None
    try:
        layout = None if wire_name is None else _layout(group, wire_name, env)
    finally:  # an error too: the other ranks of the world would wait for this one in the groups' making
        if split and layout is None:
            _make_over_world({})
    if layout is None:
        return None
    nodes, mine, local_index = layout
    global_ranks = dist.get_process_group_ranks(group)
    node_group, cross_group, gather_group = _make_groups(group, nodes, mine, local_index, global_ranks, split)
    # A process group orders its ranks by global rank: the cross exchange's shards follow that order, which is the
    # nodes' order only when each node's ranks are contiguous.
    node_index = dist.get_rank(cross_group)
    return NodeGroups(len(nodes), len(nodes[0]), node_index, local_index, node_group, cross_group, gather_group,
                      _reduce_scatter_has_future(node_group, len(nodes[0])))


def splits_over_world(group: Any) -> bool:
    """Whether making a group of ``group``'s ranks takes every rank of the world: the default group is bound to a
    device (``init_process_group(device_id=...)``), so torch splits each new group's communicator from its
    communicator (ncclCommSplit, collective over the world), and ``group`` is only a part of the world."""
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    return bound and dist.get_world_size(group) < dist.get_world_size()


def _layout(group: Any, wire_name: str, env: Mapping[str, str]) -> Optional[Tuple[List[List[int]], int, int]]:
    """The nodes of ``group`` (ranks of ``group`` by node), this rank's node and its place in it; None where the
    nodes make no two-level exchange (warned), a ValueError where they are of different sizes. Collective over
    ``group``: one all-gather, the same outcome on every rank."""
    digest = hashlib.sha256(node_name(env).encode()).hexdigest()
    nodes = partition(gather_text(digest, group))
    sizes = sorted({len(ranks) for ranks in nodes})
    if len(sizes) > 1:
        counts = ", ".join(str(len(ranks)) for ranks in nodes)
        raise ValueError(f"hierarchical=True needs the same number of ranks on every node; the {len(nodes)} nodes "
                         f"have {counts} ranks (nodes from GROUP_RANK, else the host name)")
    if len(nodes) == 1 or sizes[0] == 1:
        shape = "one node" if len(nodes) == 1 else "one rank per node"
        warn_once(f"triton_hook: hierarchical=True on {shape} ({len(nodes)} x {sizes[0]} ranks): the two-level "
                  f"exchange would add a hop and save nothing, so buckets go flat ({wire_name} over all ranks)")
        return None
    me = dist.get_rank(group)
    mine = next(k for k, ranks in enumerate(nodes) if me in ranks)
    return nodes, mine, nodes[mine].index(me)


def _make_groups(group: Any, nodes: List[List[int]], mine: int, local_index: int,
                 global_ranks: List[int], split: bool) -> Tuple[Any, Any, Any]:
    """This rank's node group, cross group and gather group.

    On the default group every rank creates every group in one order (``new_group``'s own rule, and the only one
    that holds whatever subgroups the job made before). On a part of the world, the other ranks may never get here:
    each group is made by its members only (``use_local_synchronization``), which needs every member to have made
    the same groups before (torch names such a group after its ranks and the count of groups the process knows);
    unless ``split`` (``splits_over_world``): then every rank of the world makes every rank's groups.
    """
    backend, timeout = dist.get_backend(group), group_timeout(group)
    local_size = len(nodes[0])

    def members(kind: str, index: int) -> List[int]:
        ranks = nodes[index] if kind != "cross" else [node[index] for node in nodes]
        return [global_ranks[r] for r in ranks]

    wanted = {"node": mine, "cross": local_index, "gather": mine}
    if split:
        made = _make_over_world({kind: members(kind, index) for kind, index in wanted.items()}, backend, timeout)
        return made["node"], made["cross"], made["gather"]
    made: Dict[str, Any] = {}
    agree_on_group_count(group)
    if len(global_ranks) == dist.get_world_size():
        for kind, count in (("node", len(nodes)), ("cross", local_size), ("gather", len(nodes))):
            for index in range(count):
                created = dist.new_group(members(kind, index), backend=backend, timeout=timeout)
                if index == wanted[kind]:
                    made[kind] = created
    else:
        for kind in ("node", "cross", "gather"):
            made[kind] = dist.new_group(members(kind, wanted[kind]), backend=backend, timeout=timeout,
                                        use_local_synchronization=True)
    return made["node"], made["cross"], made["gather"]


def _make_over_world(wanted: Dict[str, List[int]], backend: Any = None, timeout: Any = None) -> Dict[str, Any]:
    """Every rank's node, cross and gather groups, made by every rank of the world in one order (each kind's rank
    lists sorted); returns this rank's. ``wanted``: this rank's groups (kind -> global ranks), empty where its
    state makes none. Collective over the world: one all-gather of what each rank wants, then the groups."""
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wanted)
    agree_on_group_count(dist.group.WORLD)
    made: Dict[str, Any] = {}
    for kind in ("node", "cross", "gather"):
        for ranks in sorted({tuple(asked[kind]) for asked in everyone if kind in asked}):
            # A group's members all bind one state here, so they pass it the same backend and timeout.
            created = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if list(ranks) == wanted.get(kind):
                made[kind] = created
    return made


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
    """The asynchronous reduce-scatter into one tensor (torch >= 2.12 names it ``reduce_scatter_single``)."""
    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return call(output, input, group=group, async_op=True)


def _reduce_scatter_has_future(group: Any, size: int) -> bool:
    """Whether a reduce-scatter on ``group`` runs and completes a future. Collective over ``group``: one tiny
    reduce-scatter, the same outcome on every rank (the same torch and backend)."""
    device = collective_device(group)
    out = torch.zeros(1, device=device)
    try:
        work = reduce_scatter_single(out, torch.zeros(size, device=device), group)
    except (RuntimeError, NotImplementedError, ValueError):  # this backend has no reduce-scatter here
        return False
    work.wait()
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True
