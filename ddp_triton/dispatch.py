"""Which profile the hook follows: the user's, this machine's cached one, or the cost model's.

The per-size algorithm choice only exists on NCCL; on other backends a profile is still checked across ranks and
recorded, and every bucket goes to the one group.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .log import logger, warn_once
from .profile import Profile, ProfileError, find_cached_profile, load_profile, profile_fingerprint

_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, as profiles spell dtypes."""
    return _DTYPE_NAMES[str(dtype)]


def _this_topology(state: Any):
    from .topology import TopologyError, apply_launch_env, load_topology

    try:
        return apply_launch_env(load_topology(None))
    except (TopologyError, ValueError) as exc:
        logger.debug("no topology for the profile look-up: %s", exc)
        return None


def _model_profile(state: Any) -> Optional[Profile]:
    """The cost model's profile for this machine, or None when it cannot be modelled (no topology, no NIC rate)."""
    topology = _this_topology(state)
    if topology is None or state.backend != "nccl":
        return None
    from .autotune import model_profile

    try:
        return model_profile(topology, comm_dtype=dtype_name(state.comm_dtype))
    except ValueError as exc:  # e.g. several nodes and no inter-node rate: NVML cannot see network cards
        warn_once(f"triton_hook: no cost-model profile for this machine ({exc}); NCCL chooses", all_ranks=True)
        return None


def resolve_profile(spec: Any, state: Any) -> Optional[Profile]:
    """The Profile a CommState follows, or None to leave the algorithm to NCCL.

    ``spec`` is None, "auto" (the cached profile for this topology if there is one: NCCL's own choice otherwise),
    a path (a corrupt or mismatched file warns and falls back to the cost model), or a Profile (a mismatch with the
    run is an error: the caller built it).
    """
    if spec is None:
        return None
    if isinstance(spec, Profile):
        spec.check_matches(world_size=state.world_size, comm_dtype=dtype_name(state.comm_dtype))
        return spec
    if isinstance(spec, str) and spec == "auto":
        if state.backend != "nccl":
            return None
        topology = _this_topology(state)
        if topology is None:
            return None
        return find_cached_profile(profile_fingerprint(topology), state.world_size, topology.nodes,
                                   dtype_name(state.comm_dtype))
    if isinstance(spec, (str, os.PathLike)):
        try:
            profile = load_profile(spec)
            profile.check_matches(world_size=state.world_size, comm_dtype=dtype_name(state.comm_dtype), path=spec)
            return profile
        except ProfileError as exc:
            warn_once(f"triton_hook: {exc}; falling back to the cost model", all_ranks=True)
            return _model_profile(state)
    raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")
