"""Which profile the hook follows (the user's, this machine's cached one, or the cost model's), bound on every rank.

``bind_profile`` resolves it, checks that every rank follows the same one (and sends the same wire format), and
creates the process groups of its algorithms. The per-bucket routing by size is elsewhere: ``CommState`` asks
``algo_groups.select_group``.

The per-size algorithm choice only exists on NCCL; on other backends a profile is still checked across ranks and
recorded, and every bucket goes to the one group.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..dtypes import normalize_dtype
from ..log import logger
from ..versions import nccl_version
from ..machine.profile import AUTO_FORMAT, Profile, ProfileError, find_cached_profile, load_profile, profile_fingerprint
from ..machine.topology import Topology, TopologyError, apply_launch_env, load_topology
from .algo_groups import (check_nccl_support, check_profile_agreement, check_wire_agreement, group_ranks,
                          make_algorithm_groups)


def _this_topology() -> Optional[Topology]:
    """This machine's topology as launched, or None when NVML cannot read it."""
    try:
        return apply_launch_env(load_topology(None))
    except (TopologyError, ValueError) as exc:
        logger.debug("no topology for the profile look-up: %s", exc)
        return None


def check_profile_spec(spec: Any) -> None:
    """Refuse, before anything is resolved, a ``profile`` argument of a kind ``resolve_profile`` does not take."""
    if spec is not None and not isinstance(spec, (str, os.PathLike, Profile)):
        raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")


def resolve_profile(spec: Any, world_size: int, comm_dtype: Any, backend: str) -> Optional[Profile]:
    """The Profile a state of this world size, comm dtype (or ``"auto"``: one that chooses formats) and backend
    follows, or None to leave the algorithm to NCCL.

    ``spec`` is None, "auto" (the cached profile for this topology if there is one: NCCL's own choice otherwise,
    with a warning when the cached file cannot be used), a path or a Profile. What the user names is used or refused:
    a file that cannot be read, is not a profile, or was made for another run, and a Profile that does not match the
    run, are a ProfileError naming the file and why. Not collective: ``bind_profile`` makes every rank raise together.
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
        except ProfileError as exc:
            raise ProfileError(f"{exc.reason}; profile= names this file, so nothing stands in for it: fix the "
                               "file or the path, write it again for this job (`ddp-triton autotune --out PATH`), "
                               "or pass profile='auto' (the cached profile, else NCCL's choice)", exc.path) from None
        return profile
    raise TypeError(f"profile must be None, 'auto', a path or a Profile, got {type(spec).__name__}")


def binding_group(spec: Any, group: Any) -> Any:
    """The group whose every rank binds a state on ``group`` at the same point: the whole world (the profile's
    agreement and its algorithm groups take it), except for a state of a subgroup given no profile (``spec`` None),
    whose binding stays within its group (the other ranks may never build one)."""
    return group if spec is None and group is not dist.group.WORLD else dist.group.WORLD


def bind_profile(spec: Any, *, group: Any, world_size: int, comm_dtype: Any, backend: str,
                 wire_format: str) -> Tuple[Optional[Profile], Dict[str, Any]]:
    """The profile a state follows and the process groups of its algorithms, agreed by every rank.

    Collective: every rank compares, whatever it was given (None included): a rank with a profile would otherwise
    wait forever in group creation while one without it trains on. Over the whole world, because group creation is
    too; a state of a subgroup that was given no profile creates no group and compares within its group (the other
    ranks may never build one). A rank that cannot run the profile (its NCCL lacks an algorithm) shows a digest of
    its own, so every rank fails here together. The ranks' wire formats are compared in ``group`` as well. Before
    all that, the ranks exchange whether they could resolve their profile: a file one rank cannot use (unreadable
    there, say) is an error on every rank, raised together (``_raise_together``).
    """
    failure: Optional[Exception] = None
    try:
        profile = None if spec is None else resolve_profile(spec, world_size, comm_dtype, backend)
    except Exception as exc:  # raised below, after the ranks have compared: alone, it would leave the others waiting
        profile, failure = None, exc
    unusable = _unusable_here(profile, backend)
    agreement_group = binding_group(spec, group)
    groups: Dict[str, Any] = {}
    _raise_together(failure, agreement_group, given=_describe_spec(spec))
    check_profile_agreement(profile if unusable is None else unusable, agreement_group, given=_describe_spec(spec))
    check_wire_agreement(wire_format, group)
    if unusable is not None:
        raise unusable.error
    if profile is not None:
        groups = make_algorithm_groups(profile.algorithms(), group, made_on=profile.backend)
    return profile, groups


def _raise_together(failure: Optional[Exception], group: Any, given: str) -> None:
    """Raise on every rank of ``group`` when some rank could not resolve its profile: its own error on that rank, on
    the others a ProfileError naming the first rank that failed and its reason. One all_gather_object, issued by
    every rank whatever it holds."""
    if dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return
    reasons: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, None if failure is None else f"{type(failure).__name__}: {failure}", group=group)
    if failure is not None:
        raise failure
    failed = [(rank, reason) for rank, reason in zip(group_ranks(group), reasons)
              if reason is not None]
    if failed:
        rank, reason = failed[0]
        raise ProfileError(f"rank(s) {[r for r, _ in failed]} cannot use the profile they were given, so every rank "
                           f"stops before training (this rank was given {given}); rank {rank}: {reason}")


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
