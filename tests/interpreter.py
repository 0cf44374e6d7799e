"""Whether Triton's interpreter computes correctly on this software stack, for the tests that run kernels in it.

Read from package metadata, without importing Triton: Triton decides at decoration time whether kernels are
interpreted, and conftest.py must set ``TRITON_INTERPRET`` before anything imports them.
"""

from importlib import metadata
from typing import Optional, Tuple


def _version(package: str) -> Optional[Tuple[int, ...]]:
    try:
        text = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def interpreter_problem() -> Optional[str]:
    """Why Triton's interpreter cannot be used for bit-exact tests here, or None when it can."""
    triton, numpy = _version("triton"), _version("numpy")
    if triton is None:
        return "Triton is not installed"
    if triton < (3, 2) and numpy is not None and numpy >= (2,):
        # Seen with Triton 3.0 and 3.1: bitcasts of loaded values come back as garbage under NumPy 2.
        return (f"Triton {metadata.version('triton')}'s interpreter computes wrong bits with NumPy "
                f"{metadata.version('numpy')}; install 'numpy<2' to run the kernels in it")
    return None
