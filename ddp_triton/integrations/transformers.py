"""``TritonCommCallback``: a Hugging Face ``Trainer`` callback that registers ``triton_hook`` on its DDP model.

    from ddp_triton.integrations.transformers import TritonCommCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[TritonCommCallback(comm_dtype=torch.bfloat16)])
    trainer.train()                       # launched with torchrun --nproc_per_node N (or accelerate launch)

The Trainer wraps the model in DDP (through Accelerate's ``prepare``) inside ``train``, after its callbacks were
given the model, and passes them the unwrapped one only: the callback registers the hook at ``on_train_begin`` on
``trainer.model_wrapped`` of the Trainer that calls it, found on the call stack with the checkpoint its training
loop resumes from (the Trainer tells its callbacks neither; the user keeps no reference to it). With error feedback
(FP8), every checkpoint the Trainer saves holds each rank's residuals, one file per rank, and
``train(resume_from_checkpoint=...)`` restores them, so a resumed run continues the one that saved it. Gradient
accumulation (DDP's ``no_sync``) and ``max_grad_norm`` clipping work as without the hook. A Trainer that runs no
DDP (one process, DeepSpeed, FSDP) is refused at ``train``, naming what it runs.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..runtime.hook import register, triton_hook
from ..runtime.state import CommState, check_options

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError:
    raise ImportError("ddp_triton.integrations.transformers needs Hugging Face Transformers, which ddp-triton does not "
                      "install: pip install transformers (or ddp-triton[hf])") from None

#: A checkpoint folder's file of one rank's residuals, ``{rank}`` being the Trainer's process index.
RESIDUALS_FILE = "ddp_triton_residuals_rank{rank}.pt"


def _as_ddp(module: Any) -> Optional[DistributedDataParallel]:
    """``module`` if it is DDP, or the DDP inside a ``torch.compile`` wrapper; else None."""
    for candidate in (module, getattr(module, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def calling_trainer(callback: Any) -> Tuple[Any, Dict[str, Any]]:
    """The Trainer whose event is calling ``callback``, and the locals of its method that called the event.

    A Trainer hands its callbacks its unwrapped model only; the caller on the stack is the Trainer (or a subclass)
    whose callback handler holds ``callback``. A RuntimeError where none is (the callback called by hand).
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and any(c is callback for c in owner.callback_handler.callbacks):
            return owner, frame.f_locals
        frame = frame.f_back
    raise RuntimeError(f"{type(callback).__name__} finds its Trainer on the call stack, and no transformers.Trainer "
                       "holding it is calling it: pass it to Trainer(callbacks=[...]) or trainer.add_callback")


def find_ddp(trainer: Any) -> DistributedDataParallel:
    """The DDP wrapper the Trainer trains, once ``train`` has prepared it; a ValueError naming what the Trainer
    runs instead (one process, DeepSpeed, FSDP, DataParallel)."""
    ddp = _as_ddp(trainer.model_wrapped)
    if ddp is not None:
        return ddp
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        runs = "DeepSpeed, which reduces gradients itself"
    elif getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        runs = "FSDP, which reduce-scatters gradients itself (ddp_triton.fsdp has FSDP's FP8 path)"
    elif isinstance(trainer.model_wrapped, torch.nn.DataParallel):
        runs = (f"one process on {args.n_gpu} GPUs in torch.nn.DataParallel; launch one process per GPU "
                "(torchrun --nproc_per_node N) for DDP")
    elif args.world_size == 1:
        runs = ("one process, where there is nothing to all-reduce; launch several: torchrun --nproc_per_node N "
                "(or accelerate launch --num_processes N, with --cpu on CPU)")
    else:
        runs = f"a {type(trainer.model_wrapped).__name__} model at world size {args.world_size}"
    raise ValueError(f"TritonCommCallback needs a Trainer running DistributedDataParallel (triton_hook is a DDP "
                     f"communication hook); this one runs {runs}")


def checkpoints_folder(trainer: Any, trial: Any) -> str:
    """Where the Trainer writes its ``checkpoint-N`` folders: ``output_dir``, or a trial's folder in it under a
    hyperparameter search (named as the Trainer names it, from the trial its training loop was given)."""
    if getattr(trainer, "hp_search_backend", None) is not None and trial is not None:
        return trainer._get_output_dir(trial=trial)
    return trainer.args.output_dir


class TritonCommCallback(TrainerCallback):
    """Register ``triton_hook`` on the Trainer's DDP model when training begins; save and restore its residuals.

    ``comm_dtype`` and ``state_options`` are :class:`ddp_triton.CommState`'s fields (``accumulate_dtype``,
    ``profile``, ``process_group``, ...), as ``ddp_triton.register`` takes them; the process group and device
    default to the model's. ``state`` is the CommState once training has begun (``state.passes`` counts the
    averaged backward passes). A DDP model that already carries another comm hook is refused (DDP takes one).
    """

    def __init__(self, comm_dtype: Any = torch.bfloat16, **state_options: Any) -> None:
        self.state_options = dict(comm_dtype=comm_dtype, **state_options)
        check_options(self.state_options)  # fails where the Trainer is configured, not at train
        self.state: Optional[CommState] = None
        self._checkpoints: Optional[str] = None  # the folder the Trainer saves checkpoints in, once it trains

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, caller = calling_trainer(self)
        ddp = find_ddp(trainer)
        resumed_from = caller.get("resume_from_checkpoint")
        if state.global_step > 0 and not isinstance(resumed_from, (str, os.PathLike)):
            raise RuntimeError(f"TritonCommCallback: the Trainer resumed at step {state.global_step} and its "
                               f"checkpoint folder is not known here (got {resumed_from!r}): the residuals could "
                               "not be restored")
        registered = list(getattr(ddp, "_comm_hooks", ()))
        if registered:
            hook, held = registered[-1]
            if hook is not triton_hook or self.state is None or held is not self.state:
                whose = "with a state of its own" if hook is triton_hook else "registered by someone else"
                raise RuntimeError(f"TritonCommCallback: the DDP model already has a comm hook, {_hook_name(hook)} "
                                   f"({whose}), and DDP takes one; drop that one")
            # train() again with the same Trainer: its model keeps this callback's hook and state
        else:
            self.state = register(ddp, **self.state_options)
        self._checkpoints = checkpoints_folder(trainer, caller.get("trial"))
        if resumed_from is not None:
            self._restore(os.fspath(resumed_from), args.process_index)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's residuals into the checkpoint folder the Trainer just wrote (every rank gets here, as
        ``state_dict`` needs: it is collective)."""
        if self.state is None or not self.state.keeps_residuals:
            return
        saved = self.state.state_dict()
        path = os.path.join(self._checkpoints or args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
                            RESIDUALS_FILE.format(rank=args.process_index))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        torch.save(saved, partial)
        os.replace(partial, path)  # a reader sees the whole file or none

    def _restore(self, folder: str, rank: int) -> None:
        """Load this rank's residuals from ``folder``; every rank agrees on the outcome first (one gather), so a
        checkpoint that fails on one rank stops all of them instead of leaving the others waiting."""
        path = os.path.join(folder, RESIDUALS_FILE.format(rank=rank))
        found, problem = os.path.isfile(path), None
        if found and self.state.keeps_residuals:
            try:
                self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # unreadable, or saved by another run: the message says which
                problem = f"{path}: {e}"
        group = self.state.averaging_group()
        outcomes: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(outcomes, (rank, found, problem), group=group)
        problems = [p for _, _, p in outcomes if p is not None]
        if problems:
            raise ValueError(f"TritonCommCallback cannot restore the residuals of checkpoint {folder}: {problems[0]}")
        missing = [r for r, has, _ in outcomes if not has]
        if not self.state.keeps_residuals:
            if len(missing) < len(outcomes):
                warnings.warn(f"TritonCommCallback: checkpoint {folder} holds error-feedback residuals, which this "
                              f"run ({self.state.wire_setting}, no error feedback) does not use", stacklevel=3)
            return
        if len(missing) == len(outcomes):
            warnings.warn(f"TritonCommCallback: checkpoint {folder} holds no error-feedback residuals (saved without "
                          f"this callback, or without FP8): the {self.state.wire_setting} residuals start from zero, "
                          "and the run is not the one that saved it", stacklevel=3)
            return
        if missing:
            raise ValueError(f"TritonCommCallback: checkpoint {folder} holds the residuals of some ranks only (none "
                             f"for ranks {missing}, of {RESIDUALS_FILE}): it was saved at another world size, or "
                             "files are missing")
