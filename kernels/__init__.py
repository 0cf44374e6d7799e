"""Triton kernels and their launchers, installed as ``ddp_triton.kernels``.

They know nothing of torch.distributed: they flatten, scale and cast gradient buckets (``pack``) and go back
(``unpack``), one pass each way, bit-exact on GPU, in Triton's interpreter and on the plain-torch CPU path. The
wire formats add block-scaled FP8 (``quantize_blocks``, ``reduce_blocks``, ``dequantize_blocks``, and
``sum_blocks`` for a sum kept in float32) and a float32 sum of the ranks' slices (``sum_slices``), each with a
``bind_`` form that checks once and replays the launch on the same tensors, and a ``prepare_`` form that checks and
compiles once and runs on the tensors each call passes (for buffers allocated anew at every call).
"""

from ._triton import INTERPRETER
from ._triton import version_tuple as triton_version
from .dtypes import SUPPORTED_DTYPES
from .blocks import BlockLayout, block_layout
from .blockscale import (bind_dequantize_blocks, bind_quantize_blocks, bind_reduce_blocks, bind_sum_blocks,
                         dequantize_blocks, prepare_dequantize_blocks, prepare_quantize_blocks, prepare_reduce_blocks,
                         prepare_sum_blocks, quantize_blocks, reduce_blocks, sum_blocks)
from .launch import PreparedCall
from .pack import bind_pack, bind_unpack, pack, prepare_pack, prepare_unpack, unpack, uses_triton
from .slices import bind_sum_slices, prepare_sum_slices, sum_slices

__all__ = ["pack", "unpack", "bind_pack", "bind_unpack", "uses_triton", "SUPPORTED_DTYPES", "INTERPRETER",
           "triton_version", "BlockLayout", "block_layout", "quantize_blocks", "reduce_blocks", "dequantize_blocks",
           "sum_blocks", "sum_slices", "bind_quantize_blocks", "bind_reduce_blocks", "bind_dequantize_blocks",
           "bind_sum_blocks", "bind_sum_slices", "PreparedCall", "prepare_pack", "prepare_unpack",
           "prepare_quantize_blocks", "prepare_reduce_blocks", "prepare_dequantize_blocks", "prepare_sum_blocks",
           "prepare_sum_slices"]
