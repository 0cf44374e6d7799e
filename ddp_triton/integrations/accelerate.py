"""``register(accelerator, model)``: ``triton_hook`` on the DDP wrapper Hugging Face Accelerate's ``prepare`` made.

    from ddp_triton.integrations.accelerate import register
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    register(accelerator, model, comm_dtype=torch.bfloat16)

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own hook names: a function given there
is accepted and never registered. Call this on every process after ``prepare``; ``accelerator.accumulate`` (DDP's
``no_sync``) and ``accelerator.clip_grad_norm_`` work as without the hook.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from ..runtime.hook import register as register_on_ddp
from ..runtime.state import CommState, check_options

try:
    import accelerate  # noqa: F401  (only to fail here, clearly, where it is missing)
except ImportError:
    raise ImportError("ddp_triton.integrations.accelerate needs Hugging Face Accelerate, which ddp-triton does not "
                      "install: pip install accelerate") from None


def _as_ddp(module: Any) -> Optional[DistributedDataParallel]:
    """``module`` if it is DDP, or the DDP inside a ``torch.compile`` wrapper; else None."""
    for candidate in (module, getattr(module, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def find_ddp(accelerator: Any, model: Module) -> DistributedDataParallel:
    """The DDP wrapper ``accelerator.prepare`` made: ``model`` itself, as ``prepare`` returned it (also compiled).

    Raises ValueError saying why there is none: a single-process launch, a model other than the one ``prepare``
    returned (Accelerate keeps no link from the module it was given to its wrapper), or a distributed type other
    than DDP (FSDP, DeepSpeed, ...).
    """
    ddp = _as_ddp(model)
    if ddp is not None:
        return ddp
    kind = getattr(accelerator, "distributed_type", None)
    kind_name = getattr(kind, "name", None) or str(kind)
    if kind_name == "NO":
        raise ValueError("accelerator.prepare made no DistributedDataParallel wrapper: this is a single-process "
                         f"launch ({accelerator.num_processes} process, distributed_type NO), where there is nothing "
                         "to all-reduce. Launch several processes: accelerate launch --num_processes N (with --cpu "
                         "on CPU) or torchrun")
    if kind_name.startswith("MULTI_"):
        raise ValueError(f"this {type(model).__name__} is not wrapped in DistributedDataParallel ({kind_name}): pass "
                         "the model accelerator.prepare returned, not the one given to it")
    raise ValueError(f"Accelerate runs this model as {kind_name}, not DistributedDataParallel; triton_hook is a DDP "
                     "communication hook")


def register(accelerator: Any, model: Module, **state_options: Any) -> CommState:
    """Register ``triton_hook`` on the DDP wrapper of ``model`` that ``accelerator.prepare`` made; the CommState.

    ``state_options`` are :class:`ddp_triton.CommState`'s fields (``comm_dtype``, ``profile``, ...), the process group
    and device the model's by default. Call on every process, in the same order, after ``prepare``.
    """
    check_options(state_options)
    ddp = find_ddp(accelerator, model)
    registered = list(getattr(ddp, "_comm_hooks", ()))
    if registered:
        hook = registered[-1][0]
        raise RuntimeError(f"the DDP model already has a comm hook, {getattr(hook, '__qualname__', hook)!r} "
                           "(DistributedDataParallelKwargs(comm_hook=...)?), and DDP takes one; drop that one")
    handler = getattr(accelerator, "ddp_handler", None)
    asked = getattr(handler, "comm_hook", None)
    if callable(asked) and not hasattr(asked, "value"):  # a function, not one of Accelerate's hook names
        warnings.warn(f"DistributedDataParallelKwargs(comm_hook={getattr(asked, '__qualname__', asked)}) is ignored "
                      "by Accelerate, which maps only its own hook names; triton_hook is registered instead",
                      stacklevel=2)
    return register_on_ddp(ddp, **state_options)
