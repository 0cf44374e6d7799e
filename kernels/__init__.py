"""Triton kernels and their launchers, installed as ``ddp_triton.kernels``.

They know nothing of torch.distributed: they flatten, scale and cast gradient buckets (``pack``) and go back
(``unpack``), one pass each way, bit-exact on GPU, in Triton's interpreter and on the plain-torch CPU path. The
wire formats add block-scaled FP8 and, with ``fmt=FP4_E2M1``, block-scaled 4-bit E2M1 (``quantize_blocks``,
``reduce_blocks``, ``dequantize_blocks``, and ``sum_blocks`` for a sum kept in float32; ``row_bytes(fmt)`` the size of
a block's row) and a float32 sum of the ranks' slices (``sum_slices``).

Each operation is one callable with two forms: ``pack(tensors, out, scale)``, a plain call checked in full (for
one-off use; ``pack`` and ``unpack`` check a layout once and keep it, ``plain_calls.py``), and ``pack.prepare(tensors, out, scale)``, a :class:`PreparedCall` checked and compiled once
for tensors like these, for the hot path. A prepared call runs on the tensors each call passes, ``call(tensors,
out)``, compared with its examples (an FSDP group's new buffers every step); or, fixed to tensors its caller keeps,
``call.fixed(tensors, out)()`` runs with no check at all (a DDP bucket's step). On CPU tensors each takes the torch
path (and the compiled C passes for FP8 and E2M1), unless Triton's interpreter is on.
"""

from ._triton import INTERPRETER
from ._triton import version_tuple as triton_version
from .dtypes import SUPPORTED_DTYPES
from .blocks import BlockLayout, block_layout
from .blockscale import dequantize_blocks, quantize_blocks, reduce_blocks, row_bytes, sum_blocks
from .fp4 import E2M1 as FP4_E2M1
from .pack import pack, unpack, uses_triton
from .prepared import PreparedCall
from .slices import sum_slices

__all__ = ["pack", "unpack", "quantize_blocks", "reduce_blocks", "dequantize_blocks", "sum_blocks", "sum_slices",
           "row_bytes", "FP4_E2M1",
           "PreparedCall", "BlockLayout", "block_layout", "SUPPORTED_DTYPES", "INTERPRETER", "triton_version",
           "uses_triton"]
