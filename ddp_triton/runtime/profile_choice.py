"""Which profile the hook follows (the user's, this machine's cached one, or the cost model's), bound on every rank.

``bind_profile`` resolves it, checks that every rank follows the same one (and sends the same wire format), and
creates the process groups of its algorithms. The per-bucket routing by size is elsewhere: ``CommState`` asks
``algo_groups.select_group``.

The per-size algorithm choice only exists on NCCL; on other backends a profile is still checked across ranks and
recorded, and every bucket goes to the one group.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..dtypes import normalize_dtype
from ..log import logger, warn_once
from ..versions import nccl_version
from ..machine.profile import (AUTO_FORMAT, Profile, ProfileError, find_cached_profile, load_profile, model_profile,
                               profile_fingerprint)
from ..machine.topology import Topology, TopologyError, apply_launch_env, load_topology
from .algo_groups import check_nccl_support, check_profile_agreement, check_wire_agreement, make_algorithm_groups


def _this_topology() -> Optional[Topology]:
    """This machine's topology as launched, or None when NVML cannot read it."""
    try:
        return apply_launch_env(load_topology(None))
    except (TopologyError, ValueError) as exc:
        logger.debug("no topology for the profile look-up: %s", exc)
        return None


def _model_profile(backend: str, comm_dtype: str) -> Optional[Profile]:
    """The cost model's profile for this machine, or None when it cannot be modelled (no topology, no NIC rate)."""
    topology = _this_topology()
    if topology is None or backend != "nccl" or comm_dtype == AUTO_FORMAT:  # the model chooses no formats alone
        return None
    try:
        return model_profile(topology, comm_dtype=comm_dtype)
    except ValueError as exc:  # e.g. several nodes and no inter-node rate: NVML cannot see network cards
        warn_once(f"triton_hook: no cost-model profile for this machine ({exc}); NCCL chooses", all_ranks=True)
        return None


def check_profile_spec(spec: Any) -> None:
    """Refuse, before anything is resolved, a ``profile`` argument of a kind ``resolve_profile`` does not take."""
    if spec is not None and not isinstance(spec, (str, os.PathLike, Profile)):
        raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")


def resolve_profile(spec: Any, world_size: int, comm_dtype: Any, backend: str) -> Optional[Profile]:
    """The Profile a state of this world size, comm dtype (or ``"auto"``: one that chooses formats) and backend
    follows, or None to leave the algorithm to NCCL.

    ``spec`` is None, "auto" (the cached profile for this topology if there is one: NCCL's own choice otherwise),
    a path (a corrupt or mismatched file warns and falls back to the cost model), or a Profile (a mismatch with the
    run is an error: the caller built it).
    """
    dtype = AUTO_FORMAT if comm_dtype == AUTO_FORMAT else normalize_dtype(comm_dtype)
    if spec is None:
        return None
    if isinstance(spec, Profile):
        spec.check_matches(world_size=world_size, comm_dtype=dtype)
        return spec
    if isinstance(spec, str) and spec == "auto":
        if backend != "nccl":
            return None
        topology = _this_topology()
        if topology is None:
            return None
        return find_cached_profile(profile_fingerprint(topology), world_size, topology.nodes, dtype)
    if isinstance(spec, (str, os.PathLike)):
        try:
            profile = load_profile(spec)
            profile.check_matches(world_size=world_size, comm_dtype=dtype, path=spec)
            return profile
        except ProfileError as exc:
            warn_once(f"triton_hook: {exc}; falling back to the cost model", all_ranks=True)
            return _model_profile(backend, dtype)
    raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")


def bind_profile(spec: Any, *, group: Any, world_size: int, comm_dtype: Any, backend: str,
                 wire_format: str, device: Optional[torch.device]) -> Tuple[Optional[Profile], Dict[str, Any]]:
    """The profile a state follows and the process groups of its algorithms, agreed by every rank.

    Collective: every rank compares, whatever it was given (None included): a rank with a profile would otherwise
    wait forever in group creation while one without it trains on. Over the whole world, because group creation is
    too; a state of a subgroup that was given no profile creates no group and compares within its group (the other
    ranks may never build one). A rank that cannot run the profile (its NCCL lacks an algorithm) shows a digest of
    its own, so every rank fails here together. The ranks' wire formats are compared in ``group`` as well.
    """
    profile = None if spec is None else resolve_profile(spec, world_size, comm_dtype, backend)
    unusable = _unusable_here(profile, backend)
    use_device = torch.cuda.device(device) if device is not None and device.type == "cuda" \
        else contextlib.nullcontext()
    agreement_group = group if spec is None and group is not dist.group.WORLD else dist.group.WORLD
    groups: Dict[str, Any] = {}
    with use_device:  # NCCL's collectives here run on the current device: make it the model's
        check_profile_agreement(profile if unusable is None else unusable, agreement_group,
                                given=_describe_spec(spec))
        check_wire_agreement(wire_format, group)
        if unusable is not None:
            raise unusable.error
        if profile is not None:
            groups = make_algorithm_groups(profile.algorithms(), group)
    return profile, groups


def _unusable_here(profile: Optional[Profile], backend: str) -> Optional["_UnusableProfile"]:
    """None when this rank's NCCL can run every algorithm of ``profile``; else why not."""
    if profile is None or backend != "nccl":
        return None
    try:
        check_nccl_support(profile.algorithms(), nccl_version())
    except RuntimeError as exc:
        return _UnusableProfile(exc)
    return None


def _describe_spec(spec: Any) -> str:
    if spec is None or isinstance(spec, str):
        return f"profile={spec!r}"
    if isinstance(spec, os.PathLike):
        return f"profile={os.fspath(spec)!r}"
    return f"profile={type(spec).__name__}"


class _UnusableProfile:
    """Stands for a profile this rank cannot run, in the ranks' comparison of profiles."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def digest(self) -> str:
        return ("unusable-" + hashlib.sha256(str(self.error).encode()).hexdigest())[:64]
