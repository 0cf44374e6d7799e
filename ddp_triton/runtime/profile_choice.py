"""Which profile the hook follows: the user's, this machine's cached one, or the cost model's.

The per-bucket routing by size is elsewhere: ``CommState`` asks ``algo_groups.select_group``.

The per-size algorithm choice only exists on NCCL; on other backends a profile is still checked across ranks and
recorded, and every bucket goes to the one group.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..dtypes import normalize_dtype
from ..log import logger, warn_once
from ..machine.profile import (Profile, ProfileError, find_cached_profile, load_profile, model_profile,
                               profile_fingerprint)
from ..machine.topology import Topology, TopologyError, apply_launch_env, load_topology


def _this_topology() -> Optional[Topology]:
    """This machine's topology as launched, or None when NVML cannot read it."""
    try:
        return apply_launch_env(load_topology(None))
    except (TopologyError, ValueError) as exc:
        logger.debug("no topology for the profile look-up: %s", exc)
        return None


def _model_profile(state: Any) -> Optional[Profile]:
    """The cost model's profile for this machine, or None when it cannot be modelled (no topology, no NIC rate)."""
    topology = _this_topology()
    if topology is None or state.backend != "nccl":
        return None
    try:
        return model_profile(topology, comm_dtype=normalize_dtype(state.comm_dtype))
    except ValueError as exc:  # e.g. several nodes and no inter-node rate: NVML cannot see network cards
        warn_once(f"triton_hook: no cost-model profile for this machine ({exc}); NCCL chooses", all_ranks=True)
        return None


def check_profile_spec(spec: Any) -> None:
    """Refuse, before anything is resolved, a ``profile`` argument of a kind ``resolve_profile`` does not take."""
    if spec is not None and not isinstance(spec, (str, os.PathLike, Profile)):
        raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")


def resolve_profile(spec: Any, state: Any) -> Optional[Profile]:
    """The Profile a CommState follows, or None to leave the algorithm to NCCL.

    ``spec`` is None, "auto" (the cached profile for this topology if there is one: NCCL's own choice otherwise),
    a path (a corrupt or mismatched file warns and falls back to the cost model), or a Profile (a mismatch with the
    run is an error: the caller built it).
    """
    if spec is None:
        return None
    if isinstance(spec, Profile):
        spec.check_matches(world_size=state.world_size, comm_dtype=normalize_dtype(state.comm_dtype))
        return spec
    if isinstance(spec, str) and spec == "auto":
        if state.backend != "nccl":
            return None
        topology = _this_topology()
        if topology is None:
            return None
        return find_cached_profile(profile_fingerprint(topology), state.world_size, topology.nodes,
                                   normalize_dtype(state.comm_dtype))
    if isinstance(spec, (str, os.PathLike)):
        try:
            profile = load_profile(spec)
            profile.check_matches(world_size=state.world_size, comm_dtype=normalize_dtype(state.comm_dtype), path=spec)
            return profile
        except ProfileError as exc:
            warn_once(f"triton_hook: {exc}; falling back to the cost model", all_ranks=True)
            return _model_profile(state)
    raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")
