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
import warnings
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
    library = native_cpu.library()
    if library is None:
        return None
    passes = library["e2m1"]
    problem = _disagreement(passes)
    if problem is not None:
        warnings.warn(f"ddp_triton: the compiled CPU E2M1 passes differ from the torch passes ({problem}) and are "
                      "not used; CPU tensors take the plain-torch E2M1 path", RuntimeWarning, stacklevel=3)
        return None
    return passes


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
    """Where the compiled passes' bits differ from the torch passes' (quantize with error feedback in float32 and in
    bfloat16 and at scale 1 without, a reduce over three ranks with each residual, dequantize to float32 and
    bfloat16, a sum of blocks over three ranks), or None."""
    from .blocks import block_layout

    n, ranks = 17 * BLOCK_ELEMENTS + 77, 3  # a shard of 6 blocks or more: room for every kind of block
    layout = block_layout([77, 7 * BLOCK_ELEMENTS + 3, n - 7 * BLOCK_ELEMENTS - 80], ranks)  # short blocks inside
    src = _self_check_values(n, seed=1)
    results = []
    for native in (True, False):
        residual = _self_check_values(n, seed=2) * 2.0**-10
        rows = torch.zeros(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
        if native:
            cpu_fp8._compiled_quantize(passes, src, layout, rows, 0.5, residual, ROW_BYTES)()
        else:
            torch_fp4.quantize_pass(src, layout, rows, 0.5, residual)()
        received = torch.cat([rows[: layout.rows_per_shard * ROW_BYTES]] * ranks)
        out = torch.zeros(layout.rows_per_shard * ROW_BYTES, dtype=torch.uint8)
        shard_residual = _self_check_values(layout.rows_per_shard * BLOCK_ELEMENTS, seed=3) * 2.0**-12
        dst, dst16, summed = torch.empty(n), torch.empty(n, dtype=torch.bfloat16), torch.empty(n)
        plain = torch.zeros_like(rows)  # the other quantize: scale 1, no residual
        all_rows = torch.cat([rows] * ranks)
        if native:
            cpu_fp8._compiled_reduce(passes, received, ranks, out, shard_residual, ROW_BYTES)()
            cpu_fp8._compiled_dequantize(passes, rows, layout, dst, None, True, ROW_BYTES)()
            cpu_fp8._compiled_dequantize(passes, rows, layout, dst16, None, True, ROW_BYTES)()
            cpu_fp8._compiled_quantize(passes, src, layout, plain, 1.0, None, ROW_BYTES)()
            cpu_fp8._compiled_sum_blocks(passes, all_rows, ranks, layout, summed, ROW_BYTES)()
        else:
            torch_fp4.reduce_pass(received, ranks, out, shard_residual)()
            torch_fp4.dequantize_pass(rows, layout, dst, None, True)()
            torch_fp4.dequantize_pass(rows, layout, dst16, None, True)()
            torch_fp4.quantize_pass(src, layout, plain, 1.0, None)()
            torch_fp4.sum_blocks_pass(all_rows, ranks, layout, summed)()
        # Error feedback again with bfloat16 residuals: widened to add, rounded once to store.
        residual16 = (_self_check_values(n, seed=4) * 2.0**-10).bfloat16()
        shard16 = (_self_check_values(layout.rows_per_shard * BLOCK_ELEMENTS, seed=5) * 2.0**-12).bfloat16()
        rows16, out16 = torch.zeros_like(rows), torch.zeros_like(out)
        if native:
            cpu_fp8._compiled_quantize(passes, src, layout, rows16, 0.5, residual16, ROW_BYTES)()
            cpu_fp8._compiled_reduce(passes, received, ranks, out16, shard16, ROW_BYTES)()
        else:
            torch_fp4.quantize_pass(src, layout, rows16, 0.5, residual16)()
            torch_fp4.reduce_pass(received, ranks, out16, shard16)()
        bf16_results = {"rows with a bfloat16 residual": rows16, "bfloat16 residual": residual16.view(torch.int16),
                        "reduced rows with a bfloat16 residual": out16,
                        "reduce's bfloat16 residual": shard16.view(torch.int16)}
        results.append({"quantized rows": rows, "residual": residual.view(torch.int32), "reduced rows": out,
                        "reduce's residual": shard_residual.view(torch.int32), "dequantized": dst.view(torch.int32),
                        "dequantized to bfloat16": dst16.view(torch.int16), "rows at scale 1 without residual": plain,
                        "sum of blocks": summed.view(torch.int32), **bf16_results})
    for what, got in results[0].items():
        if not torch.equal(got, results[1][what]):
            return f"E2M1: the {what}"
    return None
