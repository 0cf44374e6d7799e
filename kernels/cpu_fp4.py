"""The E2M1 passes on CPU tensors: the compiled ones (``blockscale_cpu.c`` through ``native_cpu``) where they build and
give the torch passes' bits, otherwise the torch passes (``torch_fp4``), the reference they are checked against.

As ``cpu_fp8`` does for FP8, with its wrappers (a 16-bit bucket through a float32 scratch buffer a step at a time,
the sum of blocks as a dequantize per rank and torch's adds): on first use in a process the compiled passes run
beside the torch passes on values over float32's whole range and every E2M1 midpoint, and are not used, with a
warning, if any bit differs. Each operation is one function with the torch passes' arguments, giving the pass over
the tensors it is given as a call (``quantize_pass``, ``reduce_pass``, ``dequantize_pass``, ``sum_blocks_pass``).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from . import cpu_fp8, native_cpu, torch_fp4
from .blocks import BlockLayout
from .fp4 import GROUP_ELEMENTS, ROW_BYTES, VALUES
from .fp8 import BLOCK_ELEMENTS


def quantize_pass(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float,
                  residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """:func:`torch_fp4.quantize_pass`, compiled where it can be."""
    passes = compiled_passes()
    if passes is None:
        return torch_fp4.quantize_pass(src, layout, rows, scale, residual)
    return cpu_fp8._compiled_quantize(passes, src, layout, rows, scale, residual, ROW_BYTES)


def reduce_pass(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor,
                residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """:func:`torch_fp4.reduce_pass`, compiled where it can be."""
    passes = compiled_passes()
    if passes is None:
        return torch_fp4.reduce_pass(received, n_ranks, out_rows, residual)
    return cpu_fp8._compiled_reduce(passes, received, n_ranks, out_rows, residual, ROW_BYTES)


def dequantize_pass(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, stats: Optional[torch.Tensor],
                    canonical_nan: bool = True) -> Callable[[], None]:
    """:func:`torch_fp4.dequantize_pass`, compiled where it can be."""
    passes = compiled_passes()
    if passes is None:
        return torch_fp4.dequantize_pass(rows, layout, dst, stats, canonical_nan)
    return cpu_fp8._compiled_dequantize(passes, rows, layout, dst, stats, canonical_nan, ROW_BYTES)


def sum_blocks_pass(received: torch.Tensor, n_ranks: int, layout: BlockLayout,
                    out: torch.Tensor) -> Callable[[], None]:
    """:func:`torch_fp4.sum_blocks_pass`, compiled where it can be."""
    passes = compiled_passes()
    if passes is None:
        return torch_fp4.sum_blocks_pass(received, n_ranks, layout, out)
    return cpu_fp8._compiled_sum_blocks(passes, received, n_ranks, layout, out, ROW_BYTES)


def cpu_fp4_passes() -> str:
    """Which E2M1 passes a call on CPU tensors takes now: "compiled" (``blockscale_cpu.c``) or "torch"."""
    return "compiled" if compiled_passes() is not None else "torch"


def compiled_passes() -> Optional[native_cpu.WirePasses]:
    """The compiled E2M1 passes where they are enabled, built and give the torch passes' bits; else None."""
    if not native_cpu.enabled():
        return None
    return _checked_compiled()


@functools.lru_cache(maxsize=None)
def _checked_compiled() -> Optional[native_cpu.WirePasses]:
    return cpu_fp8._checked("e2m1", _disagreement, "E2M1")


def _self_check_values(n: int, seed: int) -> torch.Tensor:
    """``cpu_fp8``'s values over float32's whole range (zeros, -0, a block holding an infinity, one a NaN, one whose
    dequantized value overflows), and from seven blocks on, a block of every E2M1 value and midpoint, both signs,
    at scale 1 (each group's largest value 6)."""
    values = cpu_fp8._self_check_values(n, seed)
    if n >= 7 * BLOCK_ELEMENTS:
        magnitudes = torch.tensor(VALUES)
        probes = torch.cat([magnitudes, (magnitudes[1:] + magnitudes[:-1]) / 2])  # 15 a sign
        group = torch.cat([probes, -probes, torch.tensor([6.0, -0.0])])
        assert group.numel() == GROUP_ELEMENTS
        values[6 * BLOCK_ELEMENTS:7 * BLOCK_ELEMENTS] = group.repeat(BLOCK_ELEMENTS // GROUP_ELEMENTS)
    return values


def _disagreement(passes: native_cpu.WirePasses) -> Optional[str]:
    """Where the compiled passes' bits differ from the torch passes' (``cpu_fp8._passes_disagreement``, on the values
    above), or None."""
    torch_passes = cpu_fp8._PassSet(torch_fp4.quantize_pass, torch_fp4.reduce_pass, torch_fp4.dequantize_pass,
                                     torch_fp4.sum_blocks_pass)
    problem = cpu_fp8._passes_disagreement(cpu_fp8._compiled_set(passes, ROW_BYTES), torch_passes, ROW_BYTES,
                                           _self_check_values, probe_blocks=7)
    return None if problem is None else f"E2M1: {problem}"
