"""Triton kernels and their launchers, installed as ``ddp_triton.kernels``.

They know nothing of torch.distributed: they flatten, scale and cast gradient buckets (``pack``) and go back
(``unpack``), one pass each way, bit-exact on GPU, in Triton's interpreter and on the plain-torch CPU path.
"""

from ._triton import INTERPRETER
from ._triton import version_tuple as triton_version
from .dtypes import SUPPORTED_DTYPES
from .pack import bind_pack, bind_unpack, pack, unpack, uses_triton

__all__ = ["pack", "unpack", "bind_pack", "bind_unpack", "uses_triton", "SUPPORTED_DTYPES", "INTERPRETER",
           "triton_version"]
