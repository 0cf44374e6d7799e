"""Sum the ranks' slices of a shard in float32 and round once: the reduction step of a 16-bit wire with float32 sums.

After an all-to-all, each rank holds N equal slices of its shard, one from every rank, in the wire dtype. NCCL's
ring would add them in that dtype, one rounding per hop; this adds them in float32, in rank order from the first
slice's value (so a -0.0 from every rank stays -0.0, as any sum of them does), and rounds once to the wire dtype,
so each element is rounded twice (pack, here) whatever N is.
"""

# No ``from __future__ import annotations``: Triton 3.0's interpreter needs tl.constexpr annotations as objects.
import torch

from . import _triton, torch_wire
from .convert import _convert, _load_fp32
from .dtypes import BITS_DTYPE, OUT_KIND
from .launch import Grid, KernelCall, run_call
from .pack import uses_triton
from .prepared import PreparedCall, with_prepare
from .validation import check_count, check_vector

triton, tl = _triton.triton, _triton.tl

# Elements per program: 1024 with 4 warps, 8 per thread (16-byte loads of 16-bit data).
_BLOCK = 1024
_NUM_WARPS = 4

if _triton.AVAILABLE:

    @triton.jit
    def _sum_slices_kernel(received, out, n_ranks, size, BLOCK: tl.constexpr, SRC_BF16: tl.constexpr,
                           OUT_KIND: tl.constexpr, HW_CONVERT: tl.constexpr):
        """Program i sums elements [i * BLOCK, (i + 1) * BLOCK) of every slice."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < size
        slice_start = received + offsets
        total = _load_fp32(slice_start, mask, SRC_BF16, True)
        for _ in range(1, n_ranks):
            slice_start += size  # a pointer step per slice: no rank * size product to overflow 32 bits
            total = total + _load_fp32(slice_start, mask, SRC_BF16, True)
        bits, _ = _convert(total, 1.0, False, OUT_KIND, HW_CONVERT)
        tl.store(out + offsets, bits, mask=mask)

else:  # pragma: no cover - exercised only where Triton is missing
    _sum_slices_kernel = None


def _sum_slices_call(received: torch.Tensor, n_ranks: int, out: torch.Tensor, canonical_nan: bool = True,
                     checked: bool = True) -> KernelCall:
    if checked:
        check_count(n_ranks, "n_ranks")
        check_vector(out, "out")
        check_vector(received, "received", numel=n_ranks * out.numel(), device=out.device)
        if received.dtype != out.dtype and out.dtype != torch.float32:
            raise TypeError(f"out ({out.dtype}) must be received's dtype ({received.dtype}) or float32")
    if not uses_triton(out.device):
        return KernelCall(torch_path=torch_wire.sum_slices_pass(received, n_ranks, out, canonical_nan))
    src_bf16 = received.dtype == torch.bfloat16
    args = (received.view(torch.int16) if src_bf16 else received, out.view(BITS_DTYPE[out.dtype]), n_ranks,
            out.numel())
    constexprs = dict(BLOCK=_BLOCK, SRC_BF16=src_bf16, OUT_KIND=OUT_KIND[out.dtype], HW_CONVERT=not _triton.INTERPRETER)
    grid = Grid(-(-out.numel() // _BLOCK), _NUM_WARPS)
    return KernelCall(launch=(grid, _sum_slices_kernel, args, constexprs))


def _prepare_sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor, *,
                        canonical_nan: bool = True) -> PreparedCall:
    """:func:`sum_slices` checked once for tensors like these; the returned call runs it on the tensors each call
    passes, ``call(received, out)`` (:class:`~.prepared.PreparedCall`; ``canonical_nan`` as for
    ``kernels.pack.prepare``)."""
    return PreparedCall(lambda rec, o, checked: _sum_slices_call(rec, n_ranks, o, canonical_nan, checked),
                        ("received", "out"), (received, out))


@with_prepare(_prepare_sum_slices)
def sum_slices(received: torch.Tensor, n_ranks: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` <- the sum of the ``n_ranks`` equal slices of ``received`` (1-D, ``n_ranks * out.numel()`` elements:
    float32, bfloat16 or float16), added in float32 in rank order and rounded once to ``out``'s dtype (received's, or
    float32: the sum itself, as a reduce-scatter whose result travels no further keeps it). NaNs are written as the
    canonical quiet NaN, as :func:`kernels.pack` does. Returns ``out``. ``sum_slices.prepare(received, n_ranks,
    out)``: the same, checked once, for calls that repeat it."""
    run_call(_sum_slices_call(received, n_ranks, out))
    return out
