"""The dtype vocabulary: names as profiles and the CLI spell them, bytes per element, and the hook's comm dtypes.

Every part of ddp_triton speaks of dtypes through this module: ``normalize_dtype`` turns a torch dtype, its name
or a short alias into the one spelling (``"bfloat16"``), ``dtype_size`` gives its bytes, ``COMM_DTYPE_NAMES`` are
the dtypes the hook can all-reduce in. Importing it loads neither torch nor Triton (the CLI imports it for every
command); ``torch_dtype`` imports torch when called. The kernels' own map from torch dtype to kernel output kind
is in ``kernels/dtypes.py`` (the kernels import nothing of ddp_triton).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

#: Bytes per element of the dtypes a gradient all-reduce may use (torch names without the ``torch.`` prefix).
DTYPE_SIZES: Dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float4_e2m1fn_x2": 1,  # two E2M1 values a byte, as torch stores them
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16", "long": "int64", "int": "int32"}

#: dtypes the hook can all-reduce in, in the order it names them; sweeps (``--dtypes``) may time others.
COMM_DTYPE_NAMES: Tuple[str, ...] = ("bfloat16", "float16", "float32")


def normalize_dtype(dtype: Any) -> str:
    """Canonical dtype name (``"bfloat16"``) from a torch dtype, its name, or a short alias (``"bf16"``)."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    return name


def dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``."""
    return DTYPE_SIZES[normalize_dtype(dtype)]


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a name or alias (``"bf16"`` -> ``torch.bfloat16``); imports torch."""
    import torch

    return getattr(torch, normalize_dtype(dtype))
