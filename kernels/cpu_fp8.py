"""The FP8 passes on CPU tensors: the compiled ones (``blockscale_cpu.c`` through ``native_cpu``) where they build and
give the torch passes' bits, otherwise the torch passes (``torch_wire``), the reference they are checked against.

The compiled passes take one sweep where the torch passes take about ten (``native_cpu.py`` says why); on first use
in a process they run beside the torch passes on values over float32's whole range, and are not used, with a
warning, if any bit differs. Each operation is one function with the torch passes' arguments, giving the pass over
the tensors it is given as a call (``quantize_pass``, ``reduce_pass``, ``dequantize_pass``, ``sum_blocks_pass``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import native_cpu, torch_wire
from .blocks import BlockLayout
from .fp8 import BLOCK_ELEMENTS, E4M3, E5M2, ROW_BYTES, Fp8Format
from .torch_path import _converter
from .torch_wire import CHUNK_ROWS, finish_stats


def quantize_pass(src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor, scale: float, fmt: Fp8Format,
                  residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """:func:`torch_wire.quantize_pass`, compiled where it can be."""
    passes = compiled_passes(fmt)
    if passes is None:
        return torch_wire.quantize_pass(src, layout, rows, scale, fmt, residual)
    return _compiled_quantize(passes, src, layout, rows, scale, residual)


def reduce_pass(received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor, fmt: Fp8Format,
                residual: Optional[torch.Tensor]) -> Callable[[], None]:
    """:func:`torch_wire.reduce_pass`, compiled where it can be."""
    passes = compiled_passes(fmt)
    if passes is None:
        return torch_wire.reduce_pass(received, n_ranks, out_rows, fmt, residual)
    return _compiled_reduce(passes, received, n_ranks, out_rows, residual)


def dequantize_pass(rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor, fmt: Fp8Format,
                    stats: Optional[torch.Tensor], canonical_nan: bool = True) -> Callable[[], None]:
    """:func:`torch_wire.dequantize_pass`, compiled where it can be."""
    passes = compiled_passes(fmt)
    if passes is None:
        return torch_wire.dequantize_pass(rows, layout, dst, fmt, stats, canonical_nan)
    return _compiled_dequantize(passes, rows, layout, dst, stats, canonical_nan)


def sum_blocks_pass(received: torch.Tensor, n_ranks: int, layout: BlockLayout, out: torch.Tensor,
                    fmt: Fp8Format) -> Callable[[], None]:
    """:func:`torch_wire.sum_blocks_pass`, compiled where it can be."""
    passes = compiled_passes(fmt)
    if passes is None:
        return torch_wire.sum_blocks_pass(received, n_ranks, layout, out, fmt)
    return _compiled_sum_blocks(passes, received, n_ranks, layout, out)


def cpu_fp8_passes(fmt: Fp8Format = E4M3) -> str:
    """Which FP8 passes a call on CPU tensors takes now: "compiled" (``blockscale_cpu.c``) or "torch"."""
    return "compiled" if compiled_passes(fmt) is not None else "torch"


def compiled_passes(fmt: Fp8Format) -> Optional[native_cpu.WirePasses]:
    """The compiled passes of ``fmt`` where they are enabled, built and give the torch passes' bits; else None."""
    if not native_cpu.enabled():
        return None
    return _checked_compiled(fmt.dtype)


@functools.lru_cache(maxsize=None)
def _checked_compiled(dtype: torch.dtype) -> Optional[native_cpu.WirePasses]:
    fmt = E4M3 if dtype == torch.float8_e4m3fn else E5M2
    return _checked("e4m3" if fmt is E4M3 else "e5m2", lambda passes: _disagreement(passes, fmt), "FP8")


def _checked(name: str, disagreement: Callable[[native_cpu.WirePasses], Optional[str]],
             what: str) -> Optional[native_cpu.WirePasses]:
    """The library's passes of format ``name`` ("e4m3", "e5m2", "e2m1") where it builds and ``disagreement`` finds
    none of their bits other than the torch passes'; else None, warned where the bits differ (the plain-torch ``what``
    path, FP8 or E2M1, is taken). ``cpu_fp4`` shares it."""
    library = native_cpu.library()
    if library is None:
        return None
    passes = library[name]
    problem = disagreement(passes)
    if problem is not None:
        warnings.warn(f"ddp_triton: the compiled CPU {what} passes differ from the torch passes ({problem}) and are "
                      f"not used; CPU tensors take the plain-torch {what} path", RuntimeWarning, stacklevel=4)
        return None
    return passes


def _self_check_values(n: int, seed: int) -> torch.Tensor:
    """Values over float32's whole range: magnitudes from 2^-149 to 2^120 block by block, exact zeros and -0, and
    from five blocks on, a block of ties at FP8 precision, one holding an infinity, one a NaN and one a value whose
    dequantized code overflows."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen)
    exponents = torch.randint(-149, 120, (-(-n // BLOCK_ELEMENTS),), generator=gen).repeat_interleave(BLOCK_ELEMENTS)
    values = values * torch.pow(2.0, exponents[:n].double()).float()
    values[1:BLOCK_ELEMENTS:7] = 0.0
    values[2:BLOCK_ELEMENTS:11] = -0.0
    ties = torch.arange(BLOCK_ELEMENTS, dtype=torch.float32)
    halfway = torch.where(ties % 2 == 0, (2 * (ties % 8) + 1) / 16.0, (2 * (ties % 4) + 1) / 8.0)  # E4M3's, E5M2's
    if n >= 5 * BLOCK_ELEMENTS:
        values[BLOCK_ELEMENTS:2 * BLOCK_ELEMENTS] = (1.0 + halfway) * torch.where(ties % 3 == 0, -1.0, 1.0)
        values[3 * BLOCK_ELEMENTS + 5] = float("inf")
        values[4 * BLOCK_ELEMENTS + 9] = float("nan")
    if n >= 6 * BLOCK_ELEMENTS:
        values[5 * BLOCK_ELEMENTS + 3] = 3.3e38  # its block's largest code times the scale overflows to inf
    return values


def _disagreement(passes: native_cpu.WirePasses, fmt: Fp8Format) -> Optional[str]:
    """Where the compiled passes' bits differ from the torch passes' on values over float32's range
    (:func:`_passes_disagreement`), or None."""
    problem = _passes_disagreement(_compiled_set(passes, ROW_BYTES), _torch_set(fmt), ROW_BYTES, _self_check_values,
                                   probe_blocks=5)
    return None if problem is None else f"{fmt.dtype}: {problem}"


class _PassSet(NamedTuple):
    """A format's four passes with ``torch_fp4``'s arguments, each giving the pass over the tensors it is given as a
    call: the torch passes, or the compiled ones (:func:`_compiled_set`). ``cpu_fp4`` shares it."""

    quantize: Callable[..., Callable[[], None]]  # (src, layout, rows, scale, residual)
    reduce: Callable[..., Callable[[], None]]  # (received, n_ranks, out_rows, residual)
    dequantize: Callable[..., Callable[[], None]]  # (rows, layout, dst, stats, canonical_nan)
    sum_blocks: Optional[Callable[..., Callable[[], None]]] = None  # (received, n_ranks, layout, out)


def _compiled_set(passes: native_cpu.WirePasses, row_bytes: int) -> _PassSet:
    """The compiled passes of a format whose rows are ``row_bytes`` long, through this module's wrappers."""
    wrappers = (_compiled_quantize, _compiled_reduce, _compiled_dequantize, _compiled_sum_blocks)
    return _PassSet(*(functools.partial(wrapper, passes, row_bytes=row_bytes) for wrapper in wrappers))


def _torch_set(fmt: Fp8Format) -> _PassSet:
    """``torch_wire``'s passes of ``fmt`` as the first-use check compares them: not the sum of blocks, whose NaNs
    in a block that is not finite keep torch's payloads (0x7FF00000 for E4M3) where the compiled one's are
    canonical."""
    return _PassSet(
        lambda src, layout, rows, scale, residual: torch_wire.quantize_pass(src, layout, rows, scale, fmt, residual),
        lambda received, n_ranks, out, residual: torch_wire.reduce_pass(received, n_ranks, out, fmt, residual),
        lambda rows, layout, dst, stats, nan: torch_wire.dequantize_pass(rows, layout, dst, fmt, stats, nan))


def _passes_disagreement(compiled: _PassSet, reference: _PassSet, row_bytes: int,
                         values: Callable[[int, int], torch.Tensor], probe_blocks: int) -> Optional[str]:
    """Where ``compiled``'s bits differ from ``reference``'s (quantize with error feedback in float32 and in bfloat16
    and at scale 1 without, a reduce over three ranks with each residual, dequantize to float32 and bfloat16 with
    canonical NaNs, and where ``reference`` has one a sum of blocks over three ranks), or None. ``values(n, seed)``
    gives the values, its probes (ties, blocks not finite) in its first ``probe_blocks`` blocks, which the layout's
    second tensor holds. ``cpu_fp4`` shares it."""
    from .blocks import block_layout

    n, ranks = 17 * BLOCK_ELEMENTS + 77, 3  # a shard of 6 blocks or more: room for every kind of block
    middle = probe_blocks * BLOCK_ELEMENTS + 3
    layout = block_layout([77, middle, n - 77 - middle], ranks)  # short blocks inside
    src = values(n, 1)
    results = []
    for passes in (compiled, reference):
        residual = values(n, 2) * 2.0**-10
        rows = torch.zeros(layout.n_rows * row_bytes, dtype=torch.uint8)
        passes.quantize(src, layout, rows, 0.5, residual)()
        received = torch.cat([rows[: layout.rows_per_shard * row_bytes]] * ranks)
        out = torch.zeros(layout.rows_per_shard * row_bytes, dtype=torch.uint8)
        shard_residual = values(layout.rows_per_shard * BLOCK_ELEMENTS, 3) * 2.0**-12
        dst, dst16 = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
        plain = torch.zeros_like(rows)  # the other quantize: scale 1, no residual
        passes.reduce(received, ranks, out, shard_residual)()
        passes.dequantize(rows, layout, dst, None, True)()
        passes.dequantize(rows, layout, dst16, None, True)()
        passes.quantize(src, layout, plain, 1.0, None)()
        # Error feedback again with bfloat16 residuals: widened to add, rounded once to store.
        residual16 = (values(n, 4) * 2.0**-10).bfloat16()
        shard16 = (values(layout.rows_per_shard * BLOCK_ELEMENTS, 5) * 2.0**-12).bfloat16()
        rows16, out16 = torch.zeros_like(rows), torch.zeros_like(out)
        passes.quantize(src, layout, rows16, 0.5, residual16)()
        passes.reduce(received, ranks, out16, shard16)()
        results.append({"quantized rows": rows, "residual": residual.view(torch.int32), "reduced rows": out,
                        "reduce's residual": shard_residual.view(torch.int32), "dequantized": dst.view(torch.int32),
                        "dequantized to bfloat16": dst16.view(torch.int16), "rows at scale 1 without residual": plain,
                        "rows with a bfloat16 residual": rows16, "bfloat16 residual": residual16.view(torch.int16),
                        "reduced rows with a bfloat16 residual": out16,
                        "reduce's bfloat16 residual": shard16.view(torch.int16)})
        if reference.sum_blocks is not None:
            summed = torch.empty(n)
            passes.sum_blocks(torch.cat([rows] * ranks), ranks, layout, summed)()
            results[-1]["sum of blocks"] = summed.view(torch.int32)
    for what, got in results[0].items():
        if not torch.equal(got, results[1][what]):
            return f"the {what}"
    return None


def _keeping(call: Callable[[], None], *tensors: Optional[torch.Tensor]) -> Callable[[], None]:
    """``call``, holding ``tensors``: the C functions get addresses, so the memory behind them must live as long
    as the pass does (as the torch passes' views keep theirs)."""
    call.keeps = tensors  # type: ignore[attr-defined]
    return call


def _residual_at(residual: Optional[torch.Tensor]) -> Tuple[Optional[int], int]:
    """(address or None, 1 for a bfloat16 residual else 0): how the C passes take a residual."""
    if residual is None:
        return None, 0
    return residual.data_ptr(), int(residual.dtype == torch.bfloat16)


def _row_spans(layout: BlockLayout) -> Tuple[Tuple[int, int, int, int], ...]:
    """(first row, end row, first element, end element) of each step of CHUNK_ROWS rows of ``layout``: the
    elements its data rows hold (empty for padding)."""
    return layout.step_spans(CHUNK_ROWS)


def _compiled_quantize(passes: native_cpu.WirePasses, src: torch.Tensor, layout: BlockLayout, rows: torch.Tensor,
                       scale: float, residual: Optional[torch.Tensor],
                       row_bytes: int = ROW_BYTES) -> Callable[[], None]:
    """The compiled quantize, any layout (its block table says where each row's elements are): one call for a
    float32 bucket; a 16-bit one is widened step by step into a float32 scratch buffer that stays in cache (the
    kernel widens, then multiplies). ``row_bytes``: the format's (``cpu_fp4`` shares these wrappers)."""
    apply_scale = int(scale != 1.0)
    residual_at, residual_bf16 = _residual_at(residual)
    table = layout.table
    if src.dtype == torch.float32:
        arguments = (src.data_ptr(), 0, table.data_ptr(), layout.n_rows, scale, apply_scale, residual_at,
                     residual_bf16, rows.data_ptr())
        return _keeping(lambda: passes.quantize(*arguments), src, rows, residual, table)
    wide = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=src.device)
    steps = [(src[e0:e1], wide[: e1 - e0], (wide.data_ptr(), e0, table.data_ptr() + 16 * r0, r1 - r0, scale,
                                            apply_scale, residual_at, residual_bf16, rows.data_ptr() + row_bytes * r0))
             for r0, r1, e0, e1 in _row_spans(layout)]

    def run() -> None:
        for part, widened, arguments in steps:
            widened.copy_(part)
            passes.quantize(*arguments)

    return _keeping(run, src, rows, residual, wide, table)


def _compiled_reduce(passes: native_cpu.WirePasses, received: torch.Tensor, n_ranks: int, out_rows: torch.Tensor,
                     residual: Optional[torch.Tensor], row_bytes: int = ROW_BYTES) -> Callable[[], None]:
    arguments = (received.data_ptr(), out_rows.numel() // row_bytes, n_ranks, *_residual_at(residual),
                 out_rows.data_ptr())
    return _keeping(lambda: passes.reduce(*arguments), received, out_rows, residual)


def _compiled_dequantize(passes: native_cpu.WirePasses, rows: torch.Tensor, layout: BlockLayout, dst: torch.Tensor,
                         stats: Optional[torch.Tensor], canonical_nan: bool,
                         row_bytes: int = ROW_BYTES) -> Callable[[], None]:
    """The compiled dequantize, any layout: straight into a float32 bucket; into a 16-bit one through a float32
    scratch buffer, step by step, rounded once by torch's conversion."""
    table = layout.table
    if dst.dtype == torch.float32:
        arguments = (rows.data_ptr(), table.data_ptr(), layout.n_blocks, dst.data_ptr(), 0, int(canonical_nan))

        def direct() -> None:
            passes.dequantize(*arguments)
            finish_stats(stats, dst)

        return _keeping(direct, rows, dst, table)
    values = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=dst.device)
    steps = [((rows.data_ptr() + row_bytes * r0, table.data_ptr() + 16 * r0, min(r1, layout.n_blocks) - r0,
               values.data_ptr(), e0, 0), _converter(dst[e0:e1], values[: e1 - e0], 1.0, canonical_nan))
             for r0, r1, e0, e1 in _row_spans(layout) if e1 > e0]

    def through_scratch() -> None:
        for arguments, store in steps:
            passes.dequantize(*arguments)
            store()
        finish_stats(stats, dst)

    return _keeping(through_scratch, rows, dst, values, table)


def _compiled_sum_blocks(passes: native_cpu.WirePasses, received: torch.Tensor, n_ranks: int, layout: BlockLayout,
                         out: torch.Tensor, row_bytes: int = ROW_BYTES) -> Callable[[], None]:
    """The compiled sum of blocks, step by step: each step's rows of the first rank dequantized into ``out``, each
    further rank's into a scratch buffer that stays in cache, and added there (no scratch of ``out``'s size)."""
    table, rank_bytes = layout.table, layout.n_rows * row_bytes
    values = torch.empty(min(CHUNK_ROWS, layout.n_rows) * BLOCK_ELEMENTS, dtype=torch.float32, device=out.device)
    steps = []
    for r0, r1, e0, e1 in _row_spans(layout):
        if e1 == e0:
            continue
        rows = min(r1, layout.n_blocks) - r0
        at = [(received.data_ptr() + rank * rank_bytes + row_bytes * r0, table.data_ptr() + 16 * r0, rows)
              for rank in range(n_ranks)]
        steps.append((at, e0, out[e0:e1], values[: e1 - e0]))

    def run() -> None:
        for at, e0, part_out, part_values in steps:
            passes.dequantize(*at[0], out.data_ptr(), 0, 0)
            for rows_at in at[1:]:
                passes.dequantize(*rows_at, values.data_ptr(), e0, 0)
                part_out.add_(part_values)

    return _keeping(run, received, out, values, table)
