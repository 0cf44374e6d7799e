"""The one report of software versions: what a profile records, what ``ddp-triton env`` and the benchmarks print.

Nothing here raises for a missing or broken package: an unknown version is absent (``software_versions``) or None.
torch is imported only to ask for the NCCL it was built with (package versions come from installed metadata).
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Dict, Optional, Tuple

#: Distributions that may provide each package: nightly torch ships Triton as ``pytorch-triton``.
DISTRIBUTIONS: Dict[str, Tuple[str, ...]] = {
    "ddp_triton": ("ddp-triton",),
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton", "triton-nightly"),
    "numpy": ("numpy",),
    "nvidia_ml_py": ("nvidia-ml-py", "pynvml"),
}


def package_version(key: str) -> Optional[str]:
    """Version of a package by its key in ``DISTRIBUTIONS`` ("torch", "triton", ...): that of the first of its
    distributions installed (e.g. "triton" or nightly's "pytorch-triton"), or None."""
    for name in DISTRIBUTIONS[key]:
        try:
            return importlib.metadata.version(name)
        except Exception:  # not installed (PackageNotFoundError), or a broken installation's metadata
            continue
    return None


def parse_nccl_version(v: Any) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) from torch's ``torch.cuda.nccl.version()`` (a tuple, with NCCL's version suffix as a
    fourth element when the build has one; or an int like 21805), or None."""
    if v is None:
        return None
    if isinstance(v, (tuple, list)):
        parts = [int(x) for x in v[:3]]  # a fourth element, NCCL's version suffix, is text
        return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]
    if isinstance(v, int):
        # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
        if v >= 10000:
            return (v // 10000, (v % 10000) // 100, v % 100)
        return (v // 1000, (v % 1000) // 100, v % 100)
    if isinstance(v, str):
        parts = [int(x) for x in v.split("+")[0].split(".") if x.isdigit()][:3]
        return tuple(parts + [0] * (3 - len(parts))) if parts else None  # type: ignore[return-value]
    return None


def nccl_version() -> Optional[Tuple[int, int, int]]:
    """NCCL version torch was built with, as (major, minor, patch); None in builds without NCCL (CPU wheels)."""
    try:
        import torch

        return parse_nccl_version(torch.cuda.nccl.version())
    except Exception:  # CPU builds have no torch._C._nccl_version; a broken torch has none either
        return None


def nccl_version_text() -> Optional[str]:
    """``nccl_version()`` as "2.21.5", or None."""
    v = nccl_version()
    return None if v is None else ".".join(map(str, v))


def software_versions(nccl: bool = True) -> Dict[str, str]:
    """Versions a profile records: Python, ddp-triton, torch, triton, NCCL (when torch has it); absent if unknown.

    ``nccl=False`` leaves NCCL out and torch unimported, for a profile that ran no NCCL (the cost model's).
    """
    out: Dict[str, str] = {"python": platform.python_version()}
    for key in ("ddp_triton", "torch", "triton"):
        v = package_version(key)
        if v is not None:
            out[key] = v
    text = nccl_version_text() if nccl else None
    if text is not None:
        out["nccl"] = text
    return out
