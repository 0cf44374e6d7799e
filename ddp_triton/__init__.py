"""ddp-triton: fused Triton kernels and topology-aware communication hooks for PyTorch DDP.

    import ddp_triton
    ddp_model.register_comm_hook(None, ddp_triton.triton_hook)   # or: ddp_triton.register(ddp_model)

The public names are imported on first use, so ``ddp-triton topo`` and ``env`` start without loading the hook
and its kernels.
"""

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "triton_hook": "ddp_triton.hook",
    "register": "ddp_triton.hook",
    "reattach": "ddp_triton.hook",
    "CommState": "ddp_triton.state",
    "ddp_kwargs": "ddp_triton.profile",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddp_triton' has no attribute {name!r}")
