"""Triton, if installed, and whether its interpreter is on (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - Triton ships Linux wheels only
    triton = None
    tl = None
    AVAILABLE = False


# Triton decides at decoration time whether @triton.jit functions run in its interpreter, so this is read once,
# when the kernels are imported; setting the variable later has no effect on them.
INTERPRETER = AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def version_tuple() -> tuple:
    """Triton's version as integers, (0,) when Triton is missing."""
    if not AVAILABLE:
        return (0,)
    parts = []
    for piece in triton.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_INTERPRETER_LOCK = threading.Lock()


def serialized():
    """A context that runs one interpreted launch at a time: Triton's interpreter keeps the launch's grid position
    in process-wide state, so two threads' launches (a hook's pack, a collective's callback unpacking) corrupt
    each other there. Compiled launches need no lock: a no-op context."""
    return _INTERPRETER_LOCK if INTERPRETER else contextlib.nullcontext()
