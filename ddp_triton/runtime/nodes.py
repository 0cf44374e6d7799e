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
  (``use_local_synchronization``) on a part of the world.
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


def bind_node_groups(group: Any, wire_name: str, env: Mapping[str, str] = os.environ) -> Optional[NodeGroups]:
    """The node and cross groups of ``group`` for a two-level exchange, or None (flat, with a warning).

    Collective over ``group``: every rank calls it at the same point (the state's binding).
    """
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
    global_ranks = dist.get_process_group_ranks(group)
    mine = next(k for k, ranks in enumerate(nodes) if me in ranks)
    local_index = nodes[mine].index(me)
    node_group, cross_group, gather_group = _make_groups(group, nodes, mine, local_index, global_ranks)
    # A process group orders its ranks by global rank: the cross exchange's shards follow that order, which is the
    # nodes' order only when each node's ranks are contiguous.
    node_index = dist.get_rank(cross_group)
    return NodeGroups(len(nodes), sizes[0], node_index, local_index, node_group, cross_group, gather_group,
                      _reduce_scatter_has_future(node_group, sizes[0]))


def _make_groups(group: Any, nodes: List[List[int]], mine: int, local_index: int,
                 global_ranks: List[int]) -> Tuple[Any, Any, Any]:
    """This rank's node group, cross group and gather group.

    On the default group every rank creates every group in one order (``new_group``'s own rule, and the only one
    that holds whatever subgroups the job made before). On a part of the world, the other ranks may never get here:
    each group is made by its members only (``use_local_synchronization``), which needs every member to have made
    the same groups before (torch names such a group after its ranks and the count of groups the process knows).
    """
    backend, timeout = dist.get_backend(group), group_timeout(group)
    local_size = len(nodes[0])

    def members(kind: str, index: int) -> List[int]:
        ranks = nodes[index] if kind != "cross" else [node[index] for node in nodes]
        return [global_ranks[r] for r in ranks]

    wanted = {"node": mine, "cross": local_index, "gather": mine}
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
