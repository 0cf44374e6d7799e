"""Whether Triton's interpreter computes correctly on this software stack, for the tests that run kernels in it.

Read from package metadata, without importing Triton: Triton decides at decoration time whether kernels are
interpreted, and conftest.py must set ``TRITON_INTERPRET`` before anything imports them.
"""

from importlib import metadata, util
from typing import Optional, Tuple


# Distributions that install the ``triton`` module: PyPI's, and the builds PyTorch's nightly indexes ship.
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


def _installed(*distributions: str) -> Optional[str]:
    """The version text of the first of ``distributions`` that is installed, or None."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def interpreter_problem() -> Optional[str]:
    """Why Triton's interpreter cannot be used for bit-exact tests here, or None when it can."""
    triton, numpy = _installed(*TRITON_DISTRIBUTIONS), _installed("numpy")
    if triton is None:
        if util.find_spec("triton") is None:
            return "Triton is not installed"
        return None  # importable, but from no distribution we know: no known problem
    if _major_minor(triton) < (3, 2) and numpy is not None and _major_minor(numpy) >= (2,):
        # Seen with Triton 3.0 and 3.1: bitcasts of loaded values come back as garbage under NumPy 2.
        return (f"Triton {triton}'s interpreter computes wrong bits with NumPy {numpy}; install 'numpy<2' to run "
                "the kernels in it")
    return None
