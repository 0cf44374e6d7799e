"""The check of a CommState's options: what a combination means, as a WireFormat, or an error naming the option.

One check for ``CommState`` and for the integrations that take its options where a framework is configured
(Lightning's strategy, Accelerate's kwargs, the Trainer's callback), so a bad option fails there, not at train.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Union

import torch
import torch.distributed as dist

from ..formats import WireFormat
from ..machine.profile import AUTO_FORMAT
from .online import check_tune_options
from .profile_choice import check_profile_spec

ProfileSpec = Union[None, str, "os.PathLike[str]", Any]  # "auto", a path, a Profile, or None


def check(options: Dict[str, Any], defaults: Dict[str, Any]) -> WireFormat:
    """The WireFormat of ``options`` (the others at ``defaults``). Unknown names are a TypeError, bad values a
    ValueError (a TypeError for a ``profile`` or ``process_group`` of the wrong kind), each naming the option."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"unknown CommState options {unknown}; it takes {sorted(defaults)}")
    given = {**defaults, **options}
    wire = settings_wire(given["comm_dtype"], given["accumulate_dtype"], given["error_feedback"],
                         given["hierarchical"])
    check_profile_spec(given["profile"])
    check_tune_options(given["tune"], given["formats"])
    if given["tune"] is not None and given["comm_dtype"] != AUTO_FORMAT:
        raise ValueError(f"tune={given['tune']!r} chooses each bucket's wire format: pass comm_dtype='auto' with it "
                         f"(got comm_dtype={given['comm_dtype']!r})")
    if given["comm_dtype"] == AUTO_FORMAT and given["profile"] is None and given["tune"] is None:
        raise ValueError("comm_dtype='auto' takes each bucket's wire format from a tuned profile: pass "
                         "profile='auto' (this machine's cached one) or a profile's path, not None, or tune='online'")
    for flag in ("grad_stats", "timing"):
        if not isinstance(given[flag], bool):
            raise ValueError(f"{flag} must be True or False, got {given[flag]!r}")
    device = given["device"]
    if device is not None and not isinstance(device, torch.device):
        raise ValueError(f"device must be None or a torch.device, got {device!r}")
    group = given["process_group"]
    # new_group gives ranks outside the group NON_GROUP_MEMBER, which binding refuses, naming the rank
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and not isinstance(group,
                                                                                               dist.ProcessGroup):
        raise TypeError(f"process_group must be None or a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
    return wire


def settings_wire(comm_dtype: Any, accumulate_dtype: Any, error_feedback: Any, hierarchical: Any) -> WireFormat:
    """The WireFormat of a state's options (``WireFormat.from_options``: a torch dtype, or a format's name such as
    ``"fp4e2m1+ef"``); for ``comm_dtype="auto"``, bfloat16's, the others being left unset (each bucket's format
    names them), else a ValueError naming the one that is set."""
    if comm_dtype == AUTO_FORMAT:
        for name, value, unset in (("accumulate_dtype", accumulate_dtype, None),
                                   ("error_feedback", error_feedback, None), ("hierarchical", hierarchical, False)):
            if value is not unset:
                raise ValueError(f"comm_dtype='auto' takes each bucket's wire format from the profile, which names "
                                 f"its sums, error feedback and levels: leave {name} unset (got {value!r})")
        return WireFormat.from_options(torch.bfloat16)
    return WireFormat.from_options(comm_dtype, accumulate_dtype, error_feedback, hierarchical)
