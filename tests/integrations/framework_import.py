"""Import a training framework for the integration tier: None when it is not installed (the tier skips), its own
error when it is installed but does not import (the tier fails: a skip would hide it).

The checkout's ``kernels/`` (installed as ``ddp_triton.kernels``) lies at the repository's root, which
``python -m pytest`` puts on ``sys.path``. There it is a top-level package named ``kernels``, as Hugging Face's
hub-kernels package is; Transformers >= 5.25 imports that package when it finds one, and ours has none of its
names. So the framework is imported with the root out of ``sys.path``, as an installed ddp-triton would leave it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]


def import_installed(name: str) -> Optional[Any]:
    """Module ``name`` imported with the checkout's root out of ``sys.path``; None if it is not installed."""
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != ROOT]
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
