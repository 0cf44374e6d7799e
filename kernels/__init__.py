"""Triton kernels and their launchers, installed as ``ddp_triton.kernels``.

They know nothing of torch.distributed: they flatten, scale and cast gradient buckets (``pack``) and go back
(``unpack``), one pass each way, bit-exact on GPU, in Triton's interpreter and on the plain-torch CPU path.
"""

from .pack import bind_pack, bind_unpack, pack, unpack, uses_triton
from .validation import SUPPORTED_DTYPES

__all__ = ["pack", "unpack", "bind_pack", "bind_unpack", "uses_triton", "SUPPORTED_DTYPES"]
