"""``ddp_triton.topology``: the import path of the GPU topology, kept; it lives in ``ddp_triton.machine.topology``."""

from .machine.topology import *  # noqa: F401,F403
from .machine.topology import __all__  # noqa: F401
