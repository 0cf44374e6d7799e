"""The dtypes the kernels read and write, and how each is stored: the kernels' one dtype map.

``OUT_KIND`` picks the kernel's rounding for an output dtype; ``BITS_DTYPE`` is the integer dtype of the same width,
through which the kernels load and store raw bits (exact NaN payloads, no float conversion on the way).
"""

from __future__ import annotations

import torch

from .convert import OUT_BF16, OUT_FP16, OUT_FP32

#: Gradient and comm dtypes the kernels convert between.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Output dtype -> the kernel's rounding mode (``convert.OUT_*``).
OUT_KIND = {torch.bfloat16: OUT_BF16, torch.float16: OUT_FP16, torch.float32: OUT_FP32}

#: dtype -> the integer dtype of its width, to view a tensor's bits.
BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
