"""Comparing tensors by bit pattern, and the float64-free torch reference the kernels promise to match."""

import math
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


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def random_bit_patterns(n, dtype, seed=0):
    """Every bit pattern is equally likely: NaNs, infinities, subnormals and both zeros all turn up."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        raw = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    else:
        raw = torch.randint(-(2**15), 2**15, (n,), generator=gen, dtype=torch.int64).to(torch.int16)
    return raw.view(dtype)


def float32_from_bits(values):
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


# Values at the edges of rounding: ties to even in bfloat16 and float16, overflow to infinity, subnormals.
EDGE_FLOAT32 = torch.cat(
    [
        torch.tensor(
            [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 3.4028235e38, -3.4028235e38, 1.1754944e-38,
             1e-45, -1e-45, 1e-40, 65504.0, 65519.0, 65520.0, 1e5, 6e-8, 2.98e-8, 5.96e-8, 1e-5, 0.1, 1 / 3]
        ),
        float32_from_bits(
            [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
             0x7F800001, 0xFFC00001, 0x00008000, 0x00018000, 0x807FFFFF, 0x3F801000, 0x3F803000]
        ),
    ]
)
