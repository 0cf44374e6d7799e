"""triton_hook: a DDP communication hook that packs, all-reduces and unpacks each bucket with the fused kernels.

Drop-in for torch's ``allreduce_hook`` and ``bf16_compress_hook``::

    ddp_model.register_comm_hook(None, triton_hook)          # default group, bfloat16 on the wire
    ddp_triton.register(ddp_model, comm_dtype=torch.float16)  # or a CommState of your own

Per bucket: one kernel scales by 1/world_size in float32 and rounds once to the comm dtype, the all-reduce sums,
and, on the all-reduce's completion, one kernel casts back into DDP's bucket buffer (with
``gradient_as_bucket_view=True`` that is the gradients' own storage). Buffers and launches are bound once per
bucket and reused (a Plan, ``plan.py``); nothing on this path synchronises with the host or loops over parameters,
except with ``grad_stats=True``: noting which gradients the statistics cover loops over the bucket's parameters
once per pass on the host (``grad_stats.py``).

Under ``torch.compile`` with compiled autograd and ``torch._dynamo.config.optimize_ddp = "python_reducer"``, DDP
calls the hook once per parameter with ``(param.grad, param)`` and traces it; that call averages the gradient in
place with plain torch ops and a functional all-reduce, to the same bits (see ``average_grad``).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and string annotations fail that check.
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler

from ..formats import average_factors
from ..kernels import SUPPORTED_DTYPES
from ..log import logger
from .grad_stats import note_bucket
from .state import STALE_AFTER, CommState, check_options
from .telemetry import watch as watch_bucket


def triton_hook(state: Optional[CommState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's process group, sending it in ``state.comm_dtype``.

    ``state`` is a CommState, or, as with torch's own hooks, None (the default group) or a process group.
    ``bucket`` may also be the ``(grad, param)`` pair DDP's Python reducer passes (see ``average_grad``).
    Everything but the pass count, the statistics' note and the profiler check was decided when the bucket bound
    (its Plan, ``plan.py``).
    """
    if isinstance(bucket, tuple):
        return average_grad(state, bucket[0])
    if not isinstance(state, CommState):
        state = default_state(state)
    buffer = bucket.buffer()
    tuner = state.tuner
    if tuner is not None:  # online tuning: at a pass's first bucket, its schedule may switch formats
        tuner.before_call(state, bucket.index(), buffer.numel(), buffer.is_cuda)
    plan = state.plans.get(id(buffer))
    if plan is None or (plan.residuals is not None and not plan.residuals.alive):
        plan = state.plan_for(buffer, bucket)  # new, or its residuals moved to another layout: bind (again)
    plan.record.last_used = state.passes
    last = bucket.is_last()
    if last:
        state.passes += 1
        if state.passes % STALE_AFTER == 0:
            state.drop_stale_plans()
    if state.grad_stats:
        note_bucket(plan, last, state.latest_pass)  # which gradients the pass's statistics cover (grad_stats.py)
    # A profiler recording (torch's Python flag, or this thread's state) or state.timing: ranges and timing marks
    # around the bucket's phases (telemetry.py); otherwise the plain path, with no call to decide it.
    watch = None
    if state.timing or getattr(_profiler, "_is_profiler_enabled", False) or torch.autograd._profiler_enabled():
        watch = watch_bucket(state.timing, plan)
    sent = plan.run(last) if watch is None else plan.run_watched(last, watch)
    return sent if tuner is None else tuner.watch(sent, bucket.index(), last)


def average_grad(state: Any, grad: torch.Tensor) -> Any:
    """Average one parameter's gradient in place: the call DDP's Python reducer makes under compiled autograd.

    That call is traced into the backward graph, so no bound launches or state built on first use: the group and
    comm dtype come from the state's settings (a None or process-group state: bfloat16, as in ``triton_hook``), and
    plain torch ops give the kernels' numerics: scale in float32, one rounding to the comm dtype, sum through
    torch's functional all-reduce (what torch's compress hooks use there), scale back in float32 and round once
    into the gradient. Same bits as the bucket path on the same gradient (a NaN stays NaN, its payload is not
    made canonical; summation order within the all-reduce is the backend's). Where the bucket path leaves the
    average to NCCL (float32 buckets sent as float32), this path scales and sums instead, which is how NCCL
    averages. The per-size algorithm groups of a profile are not used: every gradient goes to the state's group,
    where Inductor may bucket the all-reduces. No gradient statistics either: once a CommState has been called
    here, its ``grad_norm()`` and ``found_inf()`` refuse and ``ddp_triton.clip_grad_norm_`` is torch's.

    Returns the gradient while being traced, as torch's hooks do; called eagerly, a completed future of it.
    """
    if isinstance(state, CommState):
        if isinstance(state.comm_dtype, str):
            raise ValueError("comm_dtype='auto' chooses a format per DDP bucket; compiled autograd's Python reducer "
                             "calls the hook per parameter: give the state a fixed comm_dtype there")
        group, comm_dtype = state.averaging_group(), state.comm_dtype
        state.per_parameter_calls = True  # no gradient statistics on this path: grad_norm() refuses
    else:
        group, comm_dtype = (state if state is not None else dist.group.WORLD), torch.bfloat16
    if grad.layout != torch.strided:
        raise TypeError("triton_hook does not support sparse gradients; use DDP's default reduction for them")
    if grad.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"triton_hook got a gradient of dtype {grad.dtype}; supported are float32, bfloat16 and "
                        "float16")
    # Here, not at the top: only this compiled-autograd path needs torch's functional collectives (a private
    # module that registers its own ops on import); the bucket path never loads it.
    from torch.distributed import _functional_collectives as fcol

    pre, post = average_factors(group.size(), comm_dtype)
    summed = fcol.all_reduce((grad.float() * pre).to(comm_dtype), "sum", group)
    grad.copy_(summed if post == 1.0 else summed.float() * post)
    if torch.compiler.is_compiling():
        return grad
    done = torch.futures.Future()
    done.set_result(grad)
    return done


def reattach(ddp_model: torch.nn.parallel.DistributedDataParallel) -> Any:
    """Register ``triton_hook`` again, with the state it carried, on a DDP model that was unpickled.

    torch rebuilds DDP's reducer when a model is unpickled (``torch.load`` of a whole model, ``copy.deepcopy``)
    and does not register the model's comm hooks on the new one, ours and torch's alike: without this call the
    restored model trains with DDP's default float32 all-reduce. Call on every rank; returns the state.
    """
    carried = [entry for entry in getattr(ddp_model, "_comm_hooks", ()) if entry[0] is triton_hook]
    if not carried:
        raise ValueError("this model carries no triton_hook; register one with ddp_triton.register")
    before = list(ddp_model._comm_hooks)
    entry = carried[-1]
    ddp_model._comm_hooks.remove(entry)  # register_comm_hook records it again
    try:
        ddp_model.register_comm_hook(entry[1], triton_hook)
    except Exception:  # e.g. the reducer still has its hook (torch allows one): leave the model as it was
        ddp_model._comm_hooks[:] = before
        raise
    if isinstance(entry[1], CommState):
        entry[1].follow_model(ddp_model)  # the unpickled model's parameters (for state_dict()) and buckets
    return entry[1]


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, state: Optional[CommState] = None,
             **state_options: Any) -> CommState:
    """Build a CommState (``state_options`` as its fields) and register ``triton_hook`` on ``ddp_model``.

    The process group and device default to the model's own. Checks up front what would otherwise fail at the first
    bucket: parameters of a dtype the kernels do not convert. Call on every rank, in the same order.
    Or pass a ``state`` of your own, e.g. one built before ``init_process_group``: it binds here, to the model's
    group and device where it was given none.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    for name, param in ddp_model.module.named_parameters():
        if param.requires_grad and param.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"parameter {name} has dtype {param.dtype}; triton_hook supports float32, bfloat16 "
                            "and float16 gradients")
    if state is not None and state_options:
        raise TypeError(f"register takes a state or state options, not both (got {sorted(state_options)})")
    if state is None:
        check_options(state_options)  # CommState(**) would meet a misspelt option as Python's TypeError
    state_options.setdefault("process_group", ddp_model.process_group)
    device = model_cuda_device(ddp_model)
    if device is not None:
        state_options.setdefault("device", device)
    if state is None:
        state = CommState(**state_options)
    else:
        state.bind(state_options["process_group"], state_options.get("device"))
    state.follow_model(ddp_model)
    ddp_model.register_comm_hook(state, triton_hook)
    return state


def model_cuda_device(ddp_model: Any) -> Optional[torch.device]:
    """The GPU a DDP model lives on, where the binding's collectives must run: its ``device_ids[0]``, else
    (``DDP(model)`` without device_ids) the one CUDA device of its parameters; None for a CPU model or one spread over
    devices. Not the current device, which a script that only did ``model.to(local_rank)`` leaves at GPU 0."""
    if ddp_model.device_ids:
        return torch.device("cuda", ddp_model.device_ids[0])
    devices = {p.device for p in ddp_model.module.parameters()}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return None


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
