"""Where profiles are cached and how they are found: keyed by the hardware, world size, nodes and dtype.

``autotune`` writes the cache (``save_to_cache``); the hook's ``profile="auto"`` reads it (``find_cached_profile``).
The cache file's name is the key: ``profile-<fingerprint>-w<world>-n<nodes>-<dtype>.json`` under
``$XDG_CACHE_HOME/ddp-triton``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Optional

from ...dtypes import normalize_dtype
from ...log import warn_once
from ...safe_write import OutputError, atomic_write_text, check_writable_folder, check_writable_target
from .schema import AUTO_FORMAT, Profile, ProfileError

def cache_dir() -> Path:
    """Where profiles are cached: ``$XDG_CACHE_HOME/ddp-triton``, else ``~/.cache/ddp-triton``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddp-triton"


def profile_fingerprint(topo: Any) -> str:
    """The topology key of profiles: ``topo.fingerprint()`` with the inter-node rate left out.

    NVML cannot see NICs, so the topology the hook reads has no inter-node rate, while ``autotune --model-only
    --inter-node-gbps`` sets one; keying on the machine alone lets the hook find that profile.
    """
    if getattr(topo, "inter_node_gbps", None) is None:
        return topo.fingerprint()
    return dataclasses.replace(topo, inter_node_gbps=None).fingerprint()


def cache_path(fingerprint: str, world_size: int, nodes: int, comm_dtype: str) -> Path:
    """The cache file for one (topology, world size, nodes, dtype); ``comm_dtype`` ``"auto"``: the profile that
    chooses the wire format per bucket size (``autotune --formats``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", fingerprint or "unknown")[:80]
    kind = "formats" if comm_dtype == AUTO_FORMAT else normalize_dtype(comm_dtype)
    return cache_dir() / f"profile-{safe}-w{int(world_size)}-n{int(nodes)}-{kind}.json"


def cache_path_of(profile: Profile) -> Optional[Path]:
    """The cache file ``save_to_cache`` writes ``profile`` to; None without a fingerprint. A profile that chooses
    wire formats is kept apart from the per-dtype ones: it serves the hook's ``comm_dtype="auto"``."""
    if not profile.topology_fingerprint:
        return None
    kind = AUTO_FORMAT if profile.formats is not None else profile.comm_dtype
    return cache_path(profile.topology_fingerprint, profile.world_size, profile.nodes, kind)


def check_cache_writable(profile: Optional[Profile] = None) -> None:
    """ProfileError unless the cache can be written: its folder is a directory (or can be made) and, given
    ``profile``, its file there is new or a regular file. Writes nothing."""
    try:
        path = cache_path_of(profile) if profile is not None else None
        if path is not None:
            check_writable_target(path)
        else:
            check_writable_folder(cache_dir())
    except OutputError as e:
        raise ProfileError(f"cannot write the profile cache: {e.reason}", e.path) from None


def save_to_cache(profile: Profile) -> Optional[Path]:
    """Write ``profile`` where ``find_cached_profile`` looks for it; None (nothing written) without a fingerprint."""
    path = cache_path_of(profile)
    if path is None:
        return None
    try:
        return atomic_write_text(path, profile.to_json() + "\n")
    except OutputError as e:
        raise ProfileError(f"cannot write the profile cache: {e.reason}", e.path) from None


def find_cached_profile(fingerprint: str, world_size: int, nodes: int, comm_dtype: str) -> Optional[Profile]:
    """The cached profile for this setup, or None: absent, or unusable (then warn once and let the caller model)."""
    path = cache_path(fingerprint, world_size, nodes, comm_dtype)
    if not path.exists():
        return None
    try:
        prof = Profile.load(path)
        prof.check_matches(fingerprint=fingerprint, world_size=world_size, nodes=nodes, comm_dtype=comm_dtype,
                           path=path)
    except ProfileError as e:
        warn_once(f"ignoring cached profile: {e}; falling back to the cost model "
                  f"(rerun `ddp-triton autotune` to replace it)")
        return None
    return prof
