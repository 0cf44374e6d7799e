"""CommState: what triton_hook needs across steps, built once per DDP model.

It holds the process group, the dtype on the wire, how the division by world size is split around the all-reduce,
the autotuned per-size choice of NCCL algorithm (one process group per algorithm) and, per bucket, the
communication buffer and the bound pack/unpack launches. Memory held: one comm-dtype copy of each bucket (half the
gradients' bytes for float32 gradients sent as bfloat16), nothing when the comm dtype equals the bucket dtype,
which is sent in place.

A state pickles (``torch.save`` of a whole DDP model, ``copy.deepcopy``) as its settings alone, the way torch's
PowerSGDState does: the process group, the resolved profile, the algorithm groups, buffers and launches stay behind,
and the restored state binds again, to the default group unless given another, at its first bucket.

``profile`` is the argument as given ("auto", a path, a Profile or None); ``active_profile`` is the Profile the
state follows once bound (``profile_choice.resolve_profile``), or None when NCCL chooses.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import kernels
from ..dtypes import comm_dtypes
from ..log import logger
from ..versions import nccl_version
from .algo_groups import check_nccl_support, check_profile_agreement, make_algorithm_groups, select_group
from .profile_choice import resolve_profile

#: The dtypes the hook can all-reduce in (``ddp_triton.dtypes.COMM_DTYPE_NAMES``), as torch dtypes.
COMM_DTYPES = comm_dtypes()

ProfileSpec = Union[None, str, "os.PathLike[str]", Any]  # "auto", a path, a Profile, or None


def split_average(world_size: int, comm_dtype: torch.dtype) -> Tuple[float, float]:
    """(pre, post) factors with pre * post == 1 / world_size, applied before and after the all-reduce sum.

    bfloat16 and float32 have float32's exponent range, so all of the division goes before the all-reduce, in
    float32 before the single rounding: nothing can overflow in the sum. float16 tops out at 65504 and loses
    precision below 6e-5: dividing by the whole world size first would push small gradients into subnormals, not
    dividing would let a sum over many ranks overflow. So float16 splits the factor around the sum, as a power of
    two near 1/sqrt(N) before it: the sum grows at most about sqrt(N) times and gradients shrink only about sqrt(N)
    times before the wire (32x each at N = 1024), and a power of two scales exactly, so at a power-of-two world size
    both factors are exact and the result is what ``fp16_compress_hook`` gives (0.25 stays 0.25).
    """
    if comm_dtype == torch.float16:
        pre = 2.0 ** -round(math.log2(world_size) / 2)
        return pre, 1.0 / (world_size * pre)
    return 1.0 / world_size, 1.0


def collective_averages(backend: str, on_cuda: bool, comm_dtype: torch.dtype, bucket_dtype: torch.dtype,
                        algorithm: Optional[str]) -> bool:
    """Whether a bucket can be averaged by the collective itself (NCCL's AVG), with no kernel on either side.

    Only when it travels in its own dtype through NCCL on CUDA, not in float16 (whose division is split around
    the sum), and not over NVLS: NCCL implements a float AVG as a pre-multiplied sum, which NVLS does not run.
    """
    nvls = algorithm is not None and algorithm.startswith("nvls")
    return (backend == "nccl" and on_cuda and comm_dtype == bucket_dtype and comm_dtype != torch.float16
            and not nvls)


@dataclass
class BucketComm:
    """One bucket's buffers and launches, valid while DDP's bucket buffer stays the same memory."""

    signature: Tuple[int, int, torch.dtype]
    buffer: torch.Tensor
    comm: torch.Tensor
    pack: Callable[[], None]
    unpack: Callable[[], None]
    group: Any
    op: Any
    algorithm: Optional[str]
    last_used: int = 0
    """The state's backward-pass count when this entry was last used (stale entries are dropped)."""


# Version of what a pickled CommState holds (``CommState.__getstate__``); a newer one than this is refused.
_PICKLE_VERSION = 1

# Entries unused for this many backward passes are dropped: old buckets after DDP's rebuild, join()'s shadow
# buckets, models that stopped training. Several models sharing a state each touch theirs every step, far within.
_STALE_AFTER = 4


@dataclass
class CommState:
    """State for :func:`ddp_triton.triton_hook`.

    Build it on every rank, in the same order, after ``init_process_group`` (it may create process groups).
    """

    process_group: Any = None
    """Group the gradients are averaged over; None is the default (world) group."""
    comm_dtype: torch.dtype = torch.bfloat16
    """Dtype on the wire: bfloat16, float16 or float32."""
    profile: ProfileSpec = "auto"
    """Autotuned per-size NCCL algorithm choice: "auto" (this machine's cached profile if there is one, else NCCL's
    own choice), a path to a profile JSON (corrupt or mismatched: the cost model's), a Profile, or None (NCCL's).
    Kept as given, also when pickled; the Profile followed is ``active_profile``."""
    device: Optional[torch.device] = None
    """CUDA device for the collectives run while the state is built (profile check, algorithm groups); default the
    current device. ``register`` passes the model's, so a job that never called ``torch.cuda.set_device`` works.
    A state restored from a pickle uses its first bucket's."""
    buckets: Dict[tuple, BucketComm] = field(default_factory=dict, init=False, repr=False)
    """Per DDP bucket buffer (address, size, dtype): its communication buffer and bound launches."""
    algorithm_groups: Dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    """Algorithm -> the process group whose NCCL communicator runs it, for the algorithms ``active_profile`` uses."""
    active_profile: Any = field(default=None, init=False, repr=False)
    """The Profile this state follows, resolved from ``profile`` when the state binds; None: NCCL chooses."""

    def __post_init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("CommState needs torch.distributed to be initialised (init_process_group) first")
        if self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {self.comm_dtype}")
        self._needs_group = False
        self._passes = 0
        self._attach()

    def _attach(self) -> None:
        """Bind to the process group and resolve the profile: at construction, or at a restored state's first bucket.

        Collective (the profile agreement, algorithm groups): every rank gets here at the same point, which for a
        restored state is its first bucket, reached by every rank in the same order as DDP's backward.
        """
        group = self.averaging_group()
        if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group")
        self.group = group
        self.world_size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        # "nccl", or a mixed "cpu:gloo,cuda:nccl"; CUDA buckets then go through NCCL.
        self.backend = "nccl" if "nccl" in backend else backend
        self.pre_scale, self.post_scale = split_average(self.world_size, self.comm_dtype)
        self.active_profile = self._setup_profile(self.profile)
        self._attached = True

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
        return {"version": _PICKLE_VERSION, "comm_dtype": self.comm_dtype, "profile": self.profile,
                "on_default_group": on_default}

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        """A state that binds at its first bucket: to the default group, or to ``process_group`` if set before."""
        version = saved.get("version")
        if not isinstance(version, int) or version > _PICKLE_VERSION:
            raise ValueError(f"a CommState saved in format {version!r}; this ddp-triton reads up to {_PICKLE_VERSION}")
        self.process_group = None
        self.comm_dtype = saved["comm_dtype"]
        self.profile = saved["profile"]
        self.active_profile = None
        self.device = None  # the saving rank's device means nothing here; the first bucket's is used
        self.buckets = {}
        self.algorithm_groups = {}
        self._needs_group = not saved["on_default_group"]
        self._passes = 0
        self._attached = False

    def _setup_profile(self, spec: ProfileSpec) -> Any:
        profile = None if spec is None else resolve_profile(spec, self)
        unusable = self._unusable_here(profile)
        use_device = torch.cuda.device(self.device) if self.device is not None and self.device.type == "cuda" \
            else contextlib.nullcontext()
        # Every rank compares, whatever it was given (None included): a rank with a profile would otherwise wait
        # forever in group creation while one without it trains on. Over the whole world, because group creation
        # is too; a state of a subgroup that was given no profile creates no group and compares within its group
        # (the other ranks may never build one). A rank that cannot run the profile (its NCCL lacks an algorithm)
        # shows a digest of its own, so every rank fails here together.
        agreement_group = self.group if spec is None and self.group is not dist.group.WORLD else dist.group.WORLD
        with use_device:  # NCCL's collectives here run on the current device: make it the model's
            check_profile_agreement(profile if unusable is None else unusable, agreement_group,
                                    given=_describe_spec(spec))
            if unusable is not None:
                raise unusable.error
            if profile is not None:
                self.algorithm_groups = make_algorithm_groups(profile.algorithms(), self.group)
        return profile

    def _unusable_here(self, profile: Any) -> Optional["_UnusableProfile"]:
        """None when this rank's NCCL can run every algorithm of ``profile``; else why not."""
        if profile is None or self.backend != "nccl":
            return None
        try:
            check_nccl_support(profile.algorithms(), nccl_version())
        except RuntimeError as exc:
            return _UnusableProfile(exc)
        return None

    def bucket_comm(self, buffer: torch.Tensor) -> BucketComm:
        """This bucket's buffers and launches: made when a bucket buffer is first seen, reused while it lives."""
        if buffer.layout != torch.strided:
            raise TypeError("triton_hook does not support sparse gradients; use DDP's default reduction for them")
        signature = (buffer.data_ptr(), buffer.numel(), buffer.dtype)
        entry = self.buckets.get(signature)
        if entry is None:
            entry = self.buckets[signature] = self._bind(signature, buffer)
        entry.last_used = self._passes
        return entry

    def end_of_backward(self) -> None:
        """Called at each backward's last bucket: count the pass and, now and then, drop entries gone stale."""
        self._passes += 1
        if self._passes % _STALE_AFTER == 0:
            oldest = self._passes - _STALE_AFTER
            for signature in [k for k, e in self.buckets.items() if e.last_used < oldest]:
                del self.buckets[signature]

    def _bind(self, signature, buffer: torch.Tensor) -> BucketComm:
        if buffer.dtype not in kernels.SUPPORTED_DTYPES:
            raise TypeError(
                f"triton_hook got a bucket of dtype {buffer.dtype}; supported are float32, bfloat16 and float16"
            )
        if not self._attached:  # restored from a pickle: binds here, off the per-step path (a new bucket)
            self.device = buffer.device if buffer.is_cuda else None
            self._attach()
        group, algorithm = self._group_for(buffer.numel() * self.comm_dtype.itemsize)
        in_place = self.comm_dtype == buffer.dtype
        if collective_averages(self.backend, buffer.is_cuda, self.comm_dtype, buffer.dtype, algorithm):
            # The collective's own averaging: no kernel at all on either side.
            return BucketComm(signature, buffer, buffer, _nothing, _nothing, group, dist.ReduceOp.AVG, algorithm)
        comm = buffer if in_place else torch.empty(buffer.numel(), dtype=self.comm_dtype, device=buffer.device)
        pack = kernels.bind_pack([buffer], comm, self.pre_scale)
        unpack = kernels.bind_unpack(comm, [buffer], self.post_scale)
        return BucketComm(signature, buffer, comm, pack, unpack, group, dist.ReduceOp.SUM, algorithm)

    def _group_for(self, nbytes: int) -> Tuple[Any, Optional[str]]:
        if self.active_profile is None or not self.algorithm_groups:
            return self.group, None
        algorithm = self.active_profile.algorithm_for(nbytes)
        return select_group(self.algorithm_groups, self.active_profile, nbytes), algorithm

    def held_bytes(self) -> int:
        """Bytes of communication buffers this state holds (those that are not DDP's own bucket buffers)."""
        return sum(e.comm.numel() * e.comm.element_size() for e in self.buckets.values() if e.comm is not e.buffer)


def _describe_spec(spec: ProfileSpec) -> str:
    if spec is None or isinstance(spec, str):
        return f"profile={spec!r}"
    if isinstance(spec, os.PathLike):
        return f"profile={os.fspath(spec)!r}"
    return f"profile={type(spec).__name__}"


def _nothing() -> None:
    return None


class _UnusableProfile:
    """Stands for a profile this rank cannot run, in the ranks' comparison of profiles."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def digest(self) -> str:
        return ("unusable-" + hashlib.sha256(str(self.error).encode()).hexdigest())[:64]


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
