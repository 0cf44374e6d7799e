"""What a pickled CommState holds: its options alone (as torch's PowerSGDState does), in one format, never converted.

``torch.save`` of a whole DDP model and ``copy.deepcopy`` pickle the hook's state; the copy binds again at its
first bucket. A pickle of any other format is refused with what to do instead.
"""

from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist

from ..log import logger

PICKLE_VERSION = 5
PICKLED = ("version", "comm_dtype", "profile", "on_default_group", "accumulate_dtype", "error_feedback",
           "hierarchical", "grad_stats", "timing", "tune", "formats")
OPTIONS = tuple(name for name in PICKLED if name not in ("version", "on_default_group"))


def pickled_options(state: Any) -> Dict[str, Any]:
    """``state``'s options, and whether it averages over the default group (a restored state needs its group)."""
    on_default = (not state.needs_group if state.process_group is None
                  else dist.is_initialized() and state.process_group == dist.group.WORLD)
    if state.residuals.layouts or state.residuals.pending_first:
        logger.warning("triton_hook: a pickled CommState leaves its error-feedback residuals behind; save them "
                       "with state.state_dict() on every rank")
    return {**{name: getattr(state, name) for name in OPTIONS}, "version": PICKLE_VERSION,
            "on_default_group": on_default}


def restore_options(state: Any, saved: Any) -> bool:
    """Set ``state``'s options from ``saved`` (``pickled_options``), its group and device unset (the first bucket's
    are used); whether it needs a group set before it binds. A pickle of another format is refused, saying what to
    do instead."""
    version = saved.get("version") if isinstance(saved, dict) else None
    if version != PICKLE_VERSION or sorted(saved) != sorted(PICKLED):
        raise ValueError(f"a CommState pickled in format {version!r} by another ddp-triton; this one reads format "
                         f"{PICKLE_VERSION} only: make the state anew with ddp_triton.register(ddp_model, ...) "
                         "(and load a saved model from its state_dict, not from a pickle)")
    for name in OPTIONS:
        setattr(state, name, saved[name])
    state.process_group, state.device = None, None
    return not saved["on_default_group"]
