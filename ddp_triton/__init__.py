"""ddp-triton: fused Triton kernels and topology-aware communication hooks for PyTorch DDP.

    import ddp_triton
    ddp_model.register_comm_hook(None, ddp_triton.triton_hook)   # or: ddp_triton.register(ddp_model)
"""

__version__ = "0.1.0"

from .hook import register, triton_hook
from .profile import ddp_kwargs
from .state import CommState

__all__ = ["triton_hook", "register", "CommState", "ddp_kwargs", "__version__"]
