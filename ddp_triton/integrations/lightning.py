"""``TritonHook``: a PyTorch Lightning Callback that registers ``triton_hook`` on the strategy's DDP model.

    from ddp_triton.integrations.lightning import TritonHook
    trainer = Trainer(strategy="ddp", callbacks=[TritonHook(comm_dtype=torch.bfloat16)])

Lightning's own ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a hook only on CUDA; the Callback
registers at fit start, after the strategy has wrapped the model in DDP, on any device (gloo on CPU included). Works
with either package, ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``: the Callback is one of both.
With error feedback (FP8), the Callback's state in Lightning's checkpoint holds every rank's residuals, so a run
resumed from it (``fit(ckpt_path=...)``) continues the one that saved it.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from ..runtime.hook import register, triton_hook
from ..runtime.state import CommState, check_options


def _frameworks() -> List[Any]:
    """The Lightning packages installed: ``lightning.pytorch`` and/or ``pytorch_lightning``."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(__import__(name, fromlist=["Callback"]))
        except ImportError:
            continue
    if not found:
        raise ImportError("ddp_triton.integrations.lightning needs PyTorch Lightning, which ddp-triton does not "
                          "install: pip install lightning (or pytorch-lightning)")
    return found


_FRAMEWORKS = _frameworks()
_CALLBACKS = tuple(pl.Callback for pl in _FRAMEWORKS)
_DDP_STRATEGIES = tuple(pl.strategies.DDPStrategy for pl in _FRAMEWORKS)


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


class TritonHook(*_CALLBACKS):  # type: ignore[misc]  # a Callback of each Lightning package installed
    """Register ``triton_hook`` on the DDP model of Lightning's DDP strategy at fit start.

    ``comm_dtype`` and ``state_options`` are :class:`ddp_triton.CommState`'s fields (``profile``,
    ``process_group``); the process group and device default to the model's. ``state`` is the CommState once fit
    has started (``state.passes`` counts the averaged backward passes). Gradient accumulation (``no_sync``) and
    clipping work as without the hook. A strategy that is not DDP is refused, naming it; a ``ddp_comm_hook`` the
    strategy carries as well is warned about (Lightning registers it on CUDA only: there the model can hold just one).
    """

    def __init__(self, comm_dtype: torch.dtype = torch.bfloat16, **state_options: Any) -> None:
        super().__init__()
        check_options(dict(comm_dtype=comm_dtype, **state_options))  # fails where the Trainer is configured
        self.state_options = dict(comm_dtype=comm_dtype, **state_options)
        self.state: Optional[CommState] = None
        self._restored: Optional[Dict[str, Any]] = None  # residuals from a checkpoint, until the state exists

    def state_dict(self) -> Dict[str, Any]:
        """The error-feedback residuals of every rank, for Lightning's checkpoint (which rank 0 alone writes; every
        rank builds it, so the gather is collective as it must be). Empty without error feedback."""
        if self.state is None or not self.state.keeps_residuals:
            return {}
        return {"residuals": self.state.all_ranks_state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take the residuals of a checkpoint: Lightning restores Callbacks before fit start, so they are loaded
        into the state when it is registered there (each rank takes its own first stage)."""
        self._restored = state_dict.get("residuals")
        self._load_restored()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        model = getattr(strategy, "model", None)
        if not isinstance(strategy, _DDP_STRATEGIES) or not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"TritonHook needs Lightning's DDP strategy (strategy='ddp', 'ddp_spawn' or DDPStrategy(...)) with "
                f"a DistributedDataParallel model; this Trainer runs {type(strategy).__name__} on a "
                f"{type(model).__name__} model (one process, FSDP or DeepSpeed have no DDP comm hook)")
        carried = getattr(strategy, "_ddp_comm_hook", None)
        registered = list(getattr(model, "_comm_hooks", ()))
        if registered:
            hook, state = registered[-1]
            if hook is triton_hook:  # the strategy registered ours (on CUDA): keep it
                warnings.warn("TritonHook: the strategy already registered triton_hook with its ddp_comm_state; "
                              "keeping that one (drop the Callback or the strategy's ddp_comm_hook)", stacklevel=2)
                self.state = state if isinstance(state, CommState) else None
                self._load_restored()
                return
            raise RuntimeError(
                f"TritonHook: the DDP model already has a comm hook, {_hook_name(hook)} (the strategy's "
                "ddp_comm_hook, registered by Lightning on CUDA), and DDP takes one; drop one of the two")
        if carried is not None:
            warnings.warn(
                f"TritonHook: the strategy also carries ddp_comm_hook={_hook_name(carried)}, which Lightning did not "
                f"register on {strategy.root_device.type}; TritonHook registers triton_hook instead", stacklevel=2)
        self.state = register(model, **self.state_options)
        self._load_restored()

    def _load_restored(self) -> None:
        if self._restored is not None and self.state is not None:
            self.state.load_state_dict(self._restored)
            self._restored = None
