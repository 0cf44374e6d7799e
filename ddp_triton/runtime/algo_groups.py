"""One process group per NCCL all-reduce algorithm, so each bucket can go to the algorithm its size calls for.

NCCL reads ``NCCL_ALGO`` when a communicator is initialised (``ncclTopoTuneModel`` in src/graph/tuning.cc), not
once per process. So for each algorithm a profile uses we create a process group over the same ranks with
``NCCL_ALGO`` set only while its communicator comes up, force that initialisation (torch creates NCCL communicators
lazily, at the first collective), and restore the environment. ``NCCL_PROTO`` is left alone: NCCL still picks
the protocol within the algorithm.

Rules a caller must keep: every rank of the default group calls ``make_algorithm_groups`` with the same algorithms
(``torch.distributed.new_group`` is collective over the default group), and every rank must hold the same profile,
which ``check_profile_agreement`` verifies (the hook's state calls it when it is built).

Backends other than NCCL (gloo on CPU) have one all-reduce algorithm: every algorithm maps to the given group, and
a warning says so once.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..log import info_rank0, warn_once
from ..machine.cost_model import ALGORITHMS, MIN_NCCL_VERSION, NCCL_ALGO_NAMES
from ..versions import nccl_version

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps this importable where distributed is stubbed

#: Length of the digest exchanged between ranks (sha256 hex).
_DIGEST_LEN = 64
_NO_PROFILE = "no-profile".ljust(_DIGEST_LEN, "-")


def group_rank(group: ProcessGroup) -> int:
    """This rank's rank in ``group`` (-1 outside it): ``dist.get_rank``, or, for a group torch.distributed keeps no
    record of (torchft's process group of one quorum: made without ``new_group``, perhaps with no default group at
    all), the group's own ``rank()``."""
    try:
        return dist.get_rank(group)
    except (ValueError, RuntimeError):
        return group.rank()


def group_backend(group: ProcessGroup) -> str:
    """The backend of ``group`` as ``dist.get_backend`` names it, or, for a group torch.distributed keeps no record
    of (see ``group_rank``), the group's own name of its backend ("gloo", "nccl")."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return group.name()


def group_ranks(group: ProcessGroup) -> List[int]:
    """The global ranks of ``group`` by group rank (``dist.get_process_group_ranks``); for a group torch.distributed
    keeps no record of (see ``group_rank``), its own ranks, 0 to its size."""
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return list(range(group.size()))


def _canonical(algorithms: Iterable[str]) -> List[str]:
    algs = set()
    for a in algorithms:
        if a not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {a!r}; known: {', '.join(ALGORITHMS)}")
        algs.add(a)
    if not algs:
        raise ValueError("no algorithms given")
    return [a for a in ALGORITHMS if a in algs]


def check_nccl_support(algorithms: Iterable[str], version: Optional[Tuple[int, int, int]],
                       env: Mapping[str, str] = os.environ) -> None:
    """Raise RuntimeError if this NCCL cannot run one of ``algorithms`` (too old, or NVLS switched off)."""
    for a in _canonical(algorithms):
        need = MIN_NCCL_VERSION[a]
        if version is not None and tuple(version) < need:
            raise RuntimeError(
                f"the tuning profile uses all-reduce algorithm {a!r} (NCCL_ALGO={NCCL_ALGO_NAMES[a]}), which needs "
                f"NCCL >= {'.'.join(map(str, need))}; torch here has NCCL {'.'.join(map(str, version))}. "
                "Re-run `ddp-triton autotune` on this software stack.")
        if a in ("nvls", "nvls_tree") and env.get("NCCL_NVLS_ENABLE", "").strip() == "0":
            raise RuntimeError(f"the tuning profile uses {a!r} but NCCL_NVLS_ENABLE=0 switches NVLS off; unset it or "
                               "re-run `ddp-triton autotune` with it set")


@contextlib.contextmanager
def scoped_env(updates: Mapping[str, Optional[str]],
               env: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Set (or, for None, unset) variables for the duration of the block, then restore exactly what was there."""
    saved = {k: env.get(k) for k in updates}
    try:
        for k, v in updates.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                env.pop(k, None)
            else:
                env[k] = old


def _force_init(group: ProcessGroup, device: torch.device) -> None:
    """Run one tiny all-reduce on ``group`` and wait for it: NCCL communicators are created at first use."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_timeout(group: ProcessGroup) -> Optional[timedelta]:
    """The collective timeout ``group`` was created with, or None where this torch does not say."""
    device = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
    try:
        return group._get_backend(torch.device(device)).options._timeout
    except (AttributeError, RuntimeError):  # private API: absent or shaped otherwise in some torch version
        return None


def _create_groups(algorithms: Sequence[str], rank_sets: Sequence[List[int]], backend: str,
                   warmup: Callable[[ProcessGroup], None], parent: ProcessGroup) -> Dict[str, ProcessGroup]:
    """For each algorithm, a new group over each of ``rank_sets`` (every rank creates every group, in the same
    order, as new_group requires) with NCCL_ALGO set while it is created and first used; returns this rank's.

    The groups take ``parent``'s timeout: new_group's default is the backend's (10 minutes for NCCL), not the one
    the user gave init_process_group, and a job that needs longer would time out in our groups alone.
    """
    me = dist.get_rank()
    timeout = group_timeout(parent)
    agree_on_group_count(dist.group.WORLD)
    groups: Dict[str, ProcessGroup] = {}
    for a in algorithms:
        name = NCCL_ALGO_NAMES[a]
        with scoped_env({"NCCL_ALGO": name}):
            for ranks in rank_sets:
                group = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
                if me not in ranks:
                    continue
                try:
                    warmup(group)
                except Exception as e:
                    raise RuntimeError(
                        f"could not bring up the communicator for all-reduce algorithm {a!r} (NCCL_ALGO={name}): "
                        f"{e}. NCCL may not support it on this machine (NVLS needs NVSwitch, Hopper or later and a "
                        "driver with multicast); re-run `ddp-triton autotune` here.") from e
                groups[a] = group
    return groups


def replica_rank_sets(process_group: ProcessGroup) -> List[List[int]]:
    """The rank lists of ``process_group`` as every rank holds it, gathered over the world, distinct, in order.

    With one DDP replica group per set of ranks ([0, 1] on some ranks, [2, 3] on others), each rank only knows its
    own; new_group must still be called by every rank for every group, in the same order.
    """
    ranks = dist.get_process_group_ranks(process_group)
    if len(ranks) == dist.get_world_size():
        return [ranks]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ranks)
    return sorted({tuple(r) for r in gathered}, key=lambda r: (r[0], r))


def make_algorithm_groups(algorithms: Iterable[str], process_group: Optional[ProcessGroup] = None,
                          made_on: Optional[str] = None) -> Dict[str, ProcessGroup]:
    """A process group per algorithm over the ranks of ``process_group`` (default: the whole world).

    NCCL: each group's communicator is initialised with ``NCCL_ALGO`` set to that algorithm; RuntimeError when NCCL
    is too old for one of them or cannot bring it up. Other backends: every algorithm maps to ``process_group``
    itself (one algorithm there), with a warning once, unless ``made_on`` (the backend the profile was made on) is
    this one: such a profile recorded the one algorithm it had and chose none. Must be called by all ranks of the
    default group, with the same ``algorithms``; ranks may pass different (disjoint) process groups, as replica
    groups are.
    """
    algs = _canonical(algorithms)
    pg = process_group if process_group is not None else dist.group.WORLD
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" not in backend:  # "nccl", or mixed ones such as "cpu:gloo,cuda:nccl"
        if made_on != backend:
            warn_once(f"backend {backend!r} has one all-reduce algorithm: the profile's choice of "
                      f"{', '.join(algs)} by size is recorded, but every bucket uses the same process group")
        return {a: pg for a in algs}
    check_nccl_support(algs, nccl_version())
    rank_sets = replica_rank_sets(pg)
    device = torch.device("cuda", torch.cuda.current_device())
    groups = _create_groups(algs, rank_sets, "nccl", lambda g: _force_init(g, device), parent=pg)
    info_rank0(f"created NCCL groups for all-reduce algorithms {', '.join(algs)} over {len(rank_sets)} replica "
               f"group(s) of {len(rank_sets[0])} ranks")
    return groups


def select_group(groups: Mapping[str, ProcessGroup], profile: Any, nbytes: int) -> ProcessGroup:
    """The group an all-reduce of ``nbytes`` should use under ``profile`` (None profile: the only group)."""
    if profile is None:
        if len(groups) != 1:
            raise ValueError(f"no profile to choose among groups {sorted(groups)}")
        return next(iter(groups.values()))
    alg = profile.algorithm_for(nbytes)
    try:
        return groups[alg]
    except KeyError:
        raise ValueError(f"the profile picks {alg!r} for {nbytes} bytes but there is no group for it "
                         f"(groups: {sorted(groups)}); build groups from profile.algorithms()") from None


def device_scope(device: Optional[torch.device]) -> Any:
    """A block in which ``device`` is the current CUDA device (nothing for None or a CPU device): the tensors
    ``collective_device`` places, and the NCCL communicators their collectives bring up, then go to that GPU, not
    to GPU 0 of a script that moved its model to its GPU without ``torch.cuda.set_device``."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


def collective_device(pg: ProcessGroup) -> torch.device:
    """Where a tensor for a collective on ``pg`` lives: the current CUDA device on NCCL, else the CPU."""
    if "nccl" in group_backend(pg).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_group_count(pg: ProcessGroup) -> None:
    """Give every rank of ``pg`` the largest count of process groups any of them holds, before they make groups.

    torch names a new group after that count (its members must agree on the name to meet). From torch 2.14 a group
    made with ``use_local_synchronization`` by some ranks only advances the count on those ranks, so a group made
    afterwards by all of them gets a different name on each side and its creation waits forever. Raising a count
    only skips names. One all-reduce over ``pg``, issued by every rank; nothing where torch keeps no such count.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    count = getattr(world, "group_count", None)
    if type(count) is not int or dist.get_world_size(pg) == 1:
        return
    largest = torch.tensor([count], dtype=torch.int64, device=collective_device(pg))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=pg)
    world.group_count = int(largest.item())


def check_profile_agreement(profile: Any, process_group: Optional[ProcessGroup] = None, given: str = "") -> str:
    """Verify every rank holds the same profile (or none); RuntimeError on every rank if not. Returns the digest.

    Exchanges a fixed-size digest tensor with all_gather (works on gloo and NCCL, no pickling), so every rank sees
    the same list and all of them fail together instead of some waiting on a collective the others never reach.
    ``given`` (what this rank was asked to use, e.g. "profile=None") goes into the error.
    """
    pg = process_group if process_group is not None else dist.group.WORLD
    digest = profile.digest() if profile is not None else _NO_PROFILE
    if len(digest) != _DIGEST_LEN:
        raise ValueError(f"profile digest must be {_DIGEST_LEN} characters, got {digest!r}")
    if dist.get_world_size(pg) == 1:
        return digest
    digests = gather_text(digest, pg)
    if len(set(digests)) > 1:
        ranks = group_ranks(pg)
        by_digest: Dict[str, List[int]] = {}
        for r, d in zip(ranks, digests):
            by_digest.setdefault(d, []).append(r)
        parts = "; ".join(f"ranks {rs}: {'no profile' if d == _NO_PROFILE else d[:16]}"
                          for d, rs in by_digest.items())
        mine = f"; rank {dist.get_rank()} was given {given}" if given else ""
        raise RuntimeError(
            f"ranks disagree on the tuning profile ({parts}{mine}). Every rank must use the same profile (same file "
            "or cache, same topology, the same profile argument), or buckets would go to different algorithms and "
            "hang.")
    return digest


def check_wire_agreement(wire_format: str, process_group: ProcessGroup) -> None:
    """Verify every rank of the group sends in the same wire format; RuntimeError on every rank if not. Ranks that
    disagree would issue different collectives (an all-reduce against an all-to-all) and hang or abort in them."""
    if dist.get_world_size(process_group) == 1:
        return
    names = [n.rstrip() for n in gather_text(wire_format[:_DIGEST_LEN].ljust(_DIGEST_LEN), process_group)]
    if len(set(names)) > 1:
        ranks = group_ranks(process_group)
        parts = "; ".join(f"rank {r}: {n}" for r, n in zip(ranks, names))
        raise RuntimeError(f"ranks disagree on the wire format ({parts}): give every rank the same comm_dtype, "
                           "accumulate_dtype and error_feedback")


def fail_together(problem: Optional[str], process_group: ProcessGroup) -> None:
    """Raise ValueError on every rank of the group if any rank has a ``problem`` (its own words where it has one):
    a rank that failed alone would leave the others waiting in their next collective."""
    if dist.get_world_size(process_group) == 1:
        if problem is not None:
            raise ValueError(problem)
        return
    flags = gather_text("1" if problem is not None else "0", process_group)
    if problem is not None:
        raise ValueError(problem)
    failed = [r for r, flag in zip(group_ranks(process_group), flags) if flag == "1"]
    if failed:
        raise ValueError(f"rank(s) {failed} failed to bind this state (their error says why); every rank stops")


def gather_text(text: str, pg: ProcessGroup) -> List[str]:
    """Every rank's ``text`` (ASCII, the same length on every rank), through one all_gather of bytes."""
    mine = torch.tensor(list(text.encode("ascii")), dtype=torch.uint8, device=collective_device(pg))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, mine, group=pg)
    return [bytes(t.cpu().tolist()).decode("ascii", "replace") for t in gathered]
