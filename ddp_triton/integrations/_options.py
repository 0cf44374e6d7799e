"""The checks a framework integration runs on CommState options where it is configured, binding nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..runtime.profile_choice import check_profile_spec
from ..runtime.state import COMM_DTYPES, CommState

#: The options a CommState takes (its fields that are constructor arguments).
STATE_OPTIONS = frozenset(f.name for f in dataclasses.fields(CommState) if f.init)


def check_state_options(**options: Any) -> None:
    """Refuse unknown options, a comm dtype the hook cannot send and a ``profile`` of the wrong kind, now: a
    CommState built here could bind (collectives) if a process group already exists, so none is built."""
    unknown = sorted(set(options) - STATE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown CommState options {unknown}; it takes {sorted(STATE_OPTIONS)}")
    if "comm_dtype" in options and options["comm_dtype"] not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be torch.bfloat16, torch.float16 or torch.float32, got "
                         f"{options['comm_dtype']}")
    check_profile_spec(options.get("profile"))
