"""The package's one logger, and warnings that are said once.

Everything in ddp_triton logs through ``logging.getLogger("ddp_triton")``. In a job of many ranks the same
condition is met on every rank and at every step, so by default only rank 0 speaks and each message is said once
per process (``warn_once``).
"""

from __future__ import annotations

import logging
import os
from typing import Set

LOGGER_NAME = "ddp_triton"
logger = logging.getLogger(LOGGER_NAME)

_said: Set[str] = set()


def current_rank() -> int:
    """This process's global rank: from torch.distributed when initialised, else ``RANK`` from a launcher, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a broken or partial torch install must not stop a log line
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def warn_once(msg: str, *, all_ranks: bool = False) -> bool:
    """Log ``msg`` as a warning the first time it is seen in this process, on rank 0 only unless ``all_ranks``.

    Returns True when the message was emitted. Repeats (the same text) are dropped, so callers may call this on a
    per-step path without flooding the log.
    """
    if msg in _said:
        return False
    _said.add(msg)
    if not all_ranks and current_rank() != 0:
        return False
    logger.warning(msg)
    return True


def info_rank0(msg: str) -> None:
    """Log ``msg`` at INFO level on rank 0 only."""
    if current_rank() == 0:
        logger.info(msg)


def describe_error(e: BaseException) -> str:
    """An exception in one line: ``Name(message)``, or ``Name`` alone when the message says nothing more."""
    try:
        msg = str(e)
    except Exception:  # pynvml's __str__ may itself call into NVML
        msg = ""
    name = type(e).__name__
    return f"{name}({msg})" if msg and msg != name else name


def _reset_warn_once() -> None:
    """Forget which messages were said (tests only)."""
    _said.clear()
