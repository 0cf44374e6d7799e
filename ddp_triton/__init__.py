"""ddp-triton: fused Triton kernels and topology-aware communication hooks for PyTorch DDP.

    import ddp_triton
    ddp_model.register_comm_hook(None, ddp_triton.triton_hook)   # or: ddp_triton.register(ddp_model)

The public names are imported on first use, so ``ddp-triton topo`` and ``env`` start without loading the hook
and its kernels.

Layers, each importing only those below it (``lint-imports`` checks this; contracts in pyproject.toml):

1. ``kernels`` (``ddp_triton.kernels``) and the base modules: ``log``, ``dtypes``, ``versions``, ``safe_write``
2. ``machine``: the GPU topology, the all-reduce cost model, tuning profiles; no collectives
3. ``runtime``: the hook, its state, which profile it follows, per-algorithm process groups
4. ``tune``: processes, the all-reduce sweep, DDP step timing, autotune
5. ``cli`` and ``envinfo``
"""

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "triton_hook": "ddp_triton.runtime.hook",
    "register": "ddp_triton.runtime.hook",
    "reattach": "ddp_triton.runtime.hook",
    "CommState": "ddp_triton.runtime.state",
    "clip_grad_norm_": "ddp_triton.runtime.clip",
    "ddp_kwargs": "ddp_triton.machine.profile",
}

#: Modules reached as attributes of the package: ``ddp_triton.fsdp.register(model)`` after ``import ddp_triton``.
_MODULES = ("fsdp",)

__all__ = [*_EXPORTS, *_MODULES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _MODULES:
        import importlib

        module = importlib.import_module(_EXPORTS.get(name, f"ddp_triton.{name}"))
        value = module if name in _MODULES else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddp_triton' has no attribute {name!r}")
