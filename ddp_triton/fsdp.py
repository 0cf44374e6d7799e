"""``ddp_triton.fsdp``: the wire formats as FSDP2's reduce-scatter (``register``); it lives in
``ddp_triton.runtime.fsdp``."""

from .runtime.fsdp import FSDPCommState, WireReduceScatter, register  # noqa: F401

__all__ = ["FSDPCommState", "WireReduceScatter", "register"]
