"""``ddp_triton.profile``: the import path of tuning profiles, kept; they live in ``ddp_triton.machine.profile``."""

from .machine.profile import *  # noqa: F401,F403
from .machine.profile import __all__  # noqa: F401
