"""triton_hook: a DDP communication hook that packs, all-reduces and unpacks each bucket with the fused kernels.

Drop-in for torch's ``allreduce_hook`` and ``bf16_compress_hook``::

    ddp_model.register_comm_hook(None, triton_hook)          # default group, bfloat16 on the wire
    ddp_triton.register(ddp_model, comm_dtype=torch.float16)  # or a CommState of your own

Per bucket: one kernel scales by 1/world_size in float32 and rounds once to the comm dtype, the all-reduce sums,
and, on the all-reduce's completion, one kernel casts back into DDP's bucket buffer (with
``gradient_as_bucket_view=True`` that is the gradients' own storage). Buffers and launches are bound once per
bucket and reused; nothing on this path synchronises with the host or loops over parameters.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and string annotations fail that check.
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .state import CommState, default_state


def triton_hook(state: Optional[CommState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's process group, sending it in ``state.comm_dtype``.

    ``state`` is a CommState, or, as with torch's own hooks, None (the default group) or a process group.
    """
    if not isinstance(state, CommState):
        state = default_state(state)
    buffer = bucket.buffer()
    comm = state.bucket_comm(buffer)
    if bucket.is_last():
        state.end_of_backward()
    comm.pack()
    work = dist.all_reduce(comm.comm, op=comm.op, group=comm.group, async_op=True)
    return then_unpack(work.get_future(), comm.unpack, buffer)


def then_unpack(
    reduced: torch.futures.Future, unpack: Callable[[], None], buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """A future of ``buffer`` that completes once ``reduced`` has and ``unpack`` has run, or fails with its error.

    ``Future.then`` runs its callback even when the future failed; reading the value re-raises the collective's
    error, so a failed all-reduce (a dead peer, a timeout) fails the backward on this rank instead of unpacking
    the un-reduced buffer and training on with local gradients.
    """

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises if the all-reduce failed
        # On CUDA this runs on a stream ordered after the all-reduce.
        unpack()
        return buffer

    return reduced.then(finish)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, **state_options: Any) -> CommState:
    """Build a CommState (``state_options`` as its fields) and register ``triton_hook`` on ``ddp_model``.

    The process group and device default to the model's own. Checks up front what would otherwise fail at the first bucket:
    parameters of a dtype the kernels do not convert. Call on every rank, in the same order.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    from .kernels import SUPPORTED_DTYPES

    for name, param in ddp_model.module.named_parameters():
        if param.requires_grad and param.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"parameter {name} has dtype {param.dtype}; triton_hook supports float32, bfloat16 "
                            "and float16 gradients")
    state_options.setdefault("process_group", ddp_model.process_group)
    if ddp_model.device_ids:
        state_options.setdefault("device", torch.device("cuda", ddp_model.device_ids[0]))
    state = CommState(**state_options)
    ddp_model.register_comm_hook(state, triton_hook)
    return state
