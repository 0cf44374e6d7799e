"""The topology of the job at hand: nodes and GPUs per node as the launcher (torchrun) set them, and whether a
launcher started this process (``under_torchrun``).

NVML sees one node; the launcher's environment (WORLD_SIZE, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES) says how many
nodes take part and which GPUs of each the job uses.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import List, Mapping, Optional, Tuple

from .gpu import GPU, _check_float, _is_int
from .model import Topology


def under_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """Is this process one rank of a launcher's (torchrun's) job: ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set?"""
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _env_int(env: Mapping[str, str], key: str) -> Optional[int]:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{key}={raw!r} must be >= 1")
    return value


def apply_launch_env(
    topo: Topology,
    *,
    nodes: Optional[int] = None,
    world_size: Optional[int] = None,
    inter_node_gbps: Optional[float] = None,
    env: Mapping[str, str] = os.environ,
) -> Topology:
    """The topology of the job at hand: node count and GPUs per node as the launcher set them.

    nodes: the argument, else WORLD_SIZE / LOCAL_WORLD_SIZE from env (torchrun sets both), else topo.nodes.
    world_size: the argument, else WORLD_SIZE, else nodes x GPUs per node. It must equal nodes x GPUs per node,
    or be smaller, with the same number of ranks on every node: then only that many GPUs per node are kept
    (those of CUDA_VISIBLE_DEVICES when it names enough of them by index, else the first ones) and renumbered
    0..k-1 as CUDA sees them. Returns a new Topology; ValueError on numbers that do not fit.
    """
    env_ws = _env_int(env, "WORLD_SIZE")
    env_lws = _env_int(env, "LOCAL_WORLD_SIZE")
    applied: List[str] = []

    if nodes is not None:
        if not _is_int(nodes) or nodes < 1:
            raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
        applied.append(f"nodes={nodes} (argument)")
    elif env_ws is not None and env_lws is not None:
        if env_ws % env_lws:
            raise ValueError(
                f"WORLD_SIZE={env_ws} is not a multiple of LOCAL_WORLD_SIZE={env_lws}: nodes must run the same "
                "number of ranks"
            )
        nodes = env_ws // env_lws
        applied.append(f"nodes={nodes} from WORLD_SIZE={env_ws} / LOCAL_WORLD_SIZE={env_lws}")
    else:
        nodes = topo.nodes

    if world_size is not None:
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    elif env_ws is not None:
        world_size = env_ws
    else:
        world_size = nodes * topo.gpus_per_node

    have = topo.gpus_per_node
    if world_size % nodes:
        raise ValueError(f"world size {world_size} does not split evenly over {nodes} node(s)")
    per_node = world_size // nodes
    if per_node > have:
        raise ValueError(
            f"world size {world_size} over {nodes} node(s) needs {per_node} GPUs per node, but topology "
            f"{topo.name!r} has {have}; pass nodes= (or set LOCAL_WORLD_SIZE) to match the launch"
        )
    if env_lws is not None and env_lws != per_node:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={env_lws} disagrees with world size {world_size} over {nodes} node(s) "
            f"({per_node} ranks per node)"
        )

    gpus = copy.deepcopy(topo.gpus)
    matrix = [list(row) for row in topo.matrix]
    if per_node < have:
        keep = list(range(per_node))
        visible = _visible_indices(env.get("CUDA_VISIBLE_DEVICES"), have)
        if visible is not None and len(visible) >= per_node:
            keep = visible[:per_node]
            applied.append(f"GPUs {keep} kept (CUDA_VISIBLE_DEVICES), renumbered 0-{per_node - 1}")
        else:
            applied.append(f"first {per_node} of {have} GPUs kept ({per_node} ranks per node)")
        gpus, matrix = _select_gpus(gpus, matrix, keep)

    rate = topo.inter_node_gbps
    if inter_node_gbps is not None:
        rate = _check_float("inter_node_gbps", inter_node_gbps)
        applied.append(f"inter_node_gbps={rate} (argument)")
    notes = list(topo.notes)
    if applied:
        notes.append("launch: " + "; ".join(applied))
    if nodes > 1 and rate is None:
        notes.append(f"{nodes} nodes but inter-node bandwidth unknown: pass inter_node_gbps")
    return dataclasses.replace(topo, gpus=gpus, matrix=matrix, nodes=nodes, inter_node_gbps=rate, notes=notes)


def _visible_indices(raw: Optional[str], have: int) -> Optional[List[int]]:
    """CUDA_VISIBLE_DEVICES as a list of distinct GPU indices < have; None when unset or not plain indices (UUIDs)."""
    if not raw:
        return None
    try:
        idx = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        return None
    if not idx or len(set(idx)) != len(idx) or any(i < 0 or i >= have for i in idx):
        return None
    return idx


def _select_gpus(gpus: List[GPU], matrix: List[List[str]], keep: List[int]) -> Tuple[List[GPU], List[List[str]]]:
    new_index = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        g = gpus[old]
        g.index = new_index[old]
        g.nvlink_peers = {new_index[p]: n for p, n in g.nvlink_peers.items() if p in new_index}
        g.p2p = {new_index[p]: s for p, s in g.p2p.items() if p in new_index}
        out.append(g)
    return out, [[matrix[a][b] for b in keep] for a in keep]
