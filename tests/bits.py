"""Comparing tensors by bit pattern, and the float64-free torch reference the kernels promise to match."""

from typing import Sequence

import torch

BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
CANONICAL_NAN = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS_DTYPE[t.dtype])


def reference_pack(tensors: Sequence[torch.Tensor], out_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The expression pack promises to equal, bit for bit (NaNs aside)."""
    if not tensors:
        return torch.empty(0, dtype=out_dtype)
    return torch.cat([t.flatten().float() for t in tensors]).mul(scale).to(out_dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits wherever expected is a number; NaN exactly where expected is NaN, as the canonical quiet NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"
    a, e = bits(actual), bits(expected)
    mismatch = (a != e) & ~nan
    if mismatch.any():
        i = int(mismatch.nonzero()[0])
        raise AssertionError(
            f"{int(mismatch.sum())} of {a.numel()} elements differ; first at {i}: "
            f"got {actual.flatten()[i].item()!r} (0x{int(a.flatten()[i]) & 0xFFFFFFFF:x}), "
            f"want {expected.flatten()[i].item()!r} (0x{int(e.flatten()[i]) & 0xFFFFFFFF:x})"
        )
    if nan.any():
        canonical = torch.full_like(a[nan], CANONICAL_NAN[actual.dtype])
        assert torch.equal(a[nan], canonical.to(a.dtype)), "NaNs are not the canonical quiet NaN"
