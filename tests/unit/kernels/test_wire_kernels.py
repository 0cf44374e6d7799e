"""Wire-format kernels: block-scaled FP8 (quantize, reduce, dequantize) and the float32 sum of slices.

Tier: no device. The Triton kernels run in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1);
each is compared bit for bit with the CPU path training uses (``kernels.cpu_fp8``: the compiled passes where they
build, else the torch passes of ``kernels.torch_wire``; ``torch_wire`` for the sum of slices), and both with
references written here from the format's definition: ``tensor.to(torch.float8_*)`` for the rounding, a power-of-two
scale per tensor block, float32 sums in rank order.
"""

import pytest
import torch

from bits import assert_same_bits, bits
from interpreter import interpreter_problem
from ddp_triton.kernels import blockscale, cpu_fp8, fp8, slices, torch_wire, uses_triton
from ddp_triton.kernels.blocks import block_layout

FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
SIZES = [
    pytest.param([1], id="one-element"),
    pytest.param([128], id="one-full-block"),
    pytest.param([129, 7, 0, 300], id="ragged"),
    pytest.param([3] * 40, id="many-tiny"),
]

pytestmark = pytest.mark.skipif(not uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")


def gradient_like(sizes, dtype, seed=0):
    """Tensors of very different scales (1e-6 .. 1e2) with heavy tails, flat in one bucket."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i, n in enumerate(sizes):
        t = torch.distributions.StudentT(2.0).sample((n,)) if n else torch.empty(0)
        parts.append(t * 10.0 ** ((i * 7) % 9 - 6) * torch.rand(1, generator=gen))
    return torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype)


def rows_for(layout, rows=None):
    return torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8) if rows is None else rows


def split(rows):
    grid = rows.view(-1, fp8.ROW_BYTES)
    return grid[:, :128], rows.view(torch.int32).view(-1, fp8.ROW_WORDS)[:, -1].view(torch.float32)


# ---- the FP8 rounding itself --------------------------------------------------------------------------------------


def all_finite_values(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(fmt).float()
    return values[torch.isfinite(values)].unique()


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_rounds_like_torch_at_every_tie(fmt):
    """Every representable value, every midpoint between neighbours (ties to even) and one float32 step either side
    of each midpoint, in blocks whose largest value is the format's maximum (so the scale is exactly 1)."""
    spec = fp8.FORMATS[fmt]
    values = all_finite_values(fmt)
    mid = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mid, torch.nextafter(mid, torch.tensor(-1e9)), torch.nextafter(mid, torch.tensor(1e9))])
    probes = probes[probes.abs() <= spec.max_finite]
    per_block = 127
    pad = (-probes.numel()) % per_block
    probes = torch.cat([probes, torch.zeros(pad)]).view(-1, per_block)
    blocks = torch.cat([probes, torch.full((probes.shape[0], 1), spec.max_finite)], dim=1).reshape(-1)
    layout = block_layout([blocks.numel()], 1)
    rows = rows_for(layout)
    blockscale.quantize_blocks(blocks, layout, rows, fmt=fmt)
    codes, scales = split(rows)
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(codes.reshape(-1), blocks.to(fmt).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoding_every_code(fmt):
    """All 256 codes, at scale 1, back to float32 exactly (NaN codes as NaN)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    layout = block_layout([128, 128], 1)
    rows = torch.zeros(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    grid_codes, scales = split(rows)
    grid_codes.copy_(codes.view(2, 128))
    scales.fill_(1.0)
    out = torch.empty(256)
    blockscale.dequantize_blocks(rows, layout, out, fmt=fmt)
    assert_same_bits(out, codes.view(fmt).float())


# ---- quantize: the scale, per-tensor blocks, residuals ------------------------------------------------------------


def reference_quantize(x, sizes, scale, fmt):
    """Blocks cut per tensor, each scaled by the smallest power of two that fits its absmax under the maximum."""
    spec = fp8.FORMATS[fmt]
    codes, scales, dequantized = [], [], []
    start = 0
    for n in sizes:
        for offset in range(0, n, 128):
            block = x[start + offset: start + min(n, offset + 128)].double() * scale
            absmax = block.abs().max().item()
            e = -126
            while absmax / 2.0**e > spec.max_finite:
                e += 1
            q = (block / 2.0**e).float().to(fmt)
            codes.append(torch.cat([q.view(torch.uint8), torch.zeros(128 - block.numel(), dtype=torch.uint8)]))
            scales.append(2.0**e)
            dequantized.append(q.double() * 2.0**e)
        start += n
    return codes, scales, torch.cat(dequantized) if dequantized else torch.empty(0, dtype=torch.float64)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", SIZES)
def test_quantize_matches_the_definition(fmt, sizes):
    x = gradient_like(sizes, torch.float32)
    layout = block_layout(sizes, 3)
    rows = rows_for(layout)
    blockscale.quantize_blocks(x, layout, rows, 0.25, fmt=fmt)
    codes, scales = split(rows)
    want_codes, want_scales, _ = reference_quantize(x, sizes, 0.25, fmt)
    assert layout.n_rows % 3 == 0 and layout.n_blocks == len(want_codes)
    for i, (c, s) in enumerate(zip(want_codes, want_scales)):
        assert torch.equal(codes[i], c), f"block {i}"
        assert scales[i].item() == s, f"block {i}"
    assert not codes[layout.n_blocks:].any(), "padding rows carry no codes"


def test_a_small_tensor_keeps_its_own_scale():
    """A bias of 1e-6 after a weight of 1e3: blocks per tensor keep the bias exact to FP8's precision, where a block
    cut at bucket offsets would flush it to zero under the weight's scale."""
    sizes = [100, 10]
    x = torch.cat([torch.full((100,), 1e3), torch.full((10,), 1e-6)])
    layout = block_layout(sizes, 1)
    rows = rows_for(layout)
    blockscale.quantize_blocks(x, layout, rows)
    out = torch.empty_like(x)
    blockscale.dequantize_blocks(rows, layout, out)
    assert torch.allclose(out[100:], x[100:], rtol=2**-4)  # E4M3 keeps 3 mantissa bits: 1/16 relative error
    assert (out[100:] != 0).all()


@pytest.mark.parametrize("sizes", [(0,), (5,), (128,), (129, 0, 3), (256, 128, 1, 0, 0, 300), (1000, 7, 130, 8192)])
@pytest.mark.parametrize("shards", [1, 3])
def test_block_positions_place_each_element_in_its_blocks_row(sizes, shards):
    """positions(): element e of the bucket sits at row * 128 + (e - the row's first element), its row the block
    table's row that holds it; padding rows hold none."""
    layout = block_layout(list(sizes), shards)
    want = []
    for row, (start, length) in enumerate(layout.table.tolist()):
        want.extend(row * 128 + i for i in range(length))
    assert layout.positions().tolist() == want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", SIZES[2:])  # ragged and many tiny: every block shape the others have
def test_quantize_with_residual_same_bits_as_torch_path(fmt, dtype, sizes):
    x = gradient_like(sizes, dtype)
    layout = block_layout(sizes, 2)
    residual = gradient_like(sizes, torch.float32, seed=1) * 1e-3
    rows, rows_ref = rows_for(layout), rows_for(layout)
    res, res_ref = residual.clone(), residual.clone()
    blockscale.quantize_blocks(x, layout, rows, 0.5, fmt=fmt, residual=res)
    cpu_fp8.quantize_pass(x, layout, rows_ref, 0.5, fp8.FORMATS[fmt], res_ref)()
    assert torch.equal(rows, rows_ref)
    assert_same_bits(res, res_ref)
    # The residual is what the rounding left out: value = dequantized + residual, in float64 up to float32 rounding.
    out = torch.empty(layout.n_elements)
    blockscale.dequantize_blocks(rows, layout, out, fmt=fmt)
    value = x.double() * 0.5 + residual.double()
    assert torch.allclose(out.double() + res.double(), value, rtol=2**-23, atol=0)


def test_a_non_finite_block_is_sent_as_nan_and_its_residual_reset():
    sizes = [128, 128]
    x = torch.ones(256)
    x[5] = float("inf")
    layout = block_layout(sizes, 1)
    for path in ("triton", "torch"):
        rows, residual = rows_for(layout), torch.full((256,), 0.5)
        if path == "triton":
            blockscale.quantize_blocks(x, layout, rows, residual=residual)
        else:
            cpu_fp8.quantize_pass(x, layout, rows, 1.0, fp8.E4M3, residual)()
        codes, scales = split(rows)
        assert (codes[0] == fp8.NAN_CODE).all() and scales[0].item() == 1.0, path
        assert (residual[:128] == 0).all() and not (residual[128:] == 0.5).all(), path
        out = torch.empty(256)
        blockscale.dequantize_blocks(rows, layout, out)
        assert torch.isnan(out[:128]).all() and torch.isfinite(out[128:]).all(), path


# ---- reduce -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_ranks", [1, 3, 4])
@pytest.mark.parametrize("residual", [False, True], ids=["no-ef", "ef"])
def test_reduce_same_bits_as_torch_path_and_sums_in_rank_order(fmt, n_ranks, residual):
    sizes = [300, 5, 128]
    layout = block_layout(sizes, n_ranks)
    per_rank = layout.rows_per_shard
    # What every rank sent for this rank's shard: rows quantized from different gradients.
    received = torch.empty(n_ranks * per_rank * fp8.ROW_BYTES, dtype=torch.uint8)
    for rank in range(n_ranks):
        rows = rows_for(layout)
        blockscale.quantize_blocks(gradient_like(sizes, torch.float32, seed=rank), layout, rows, fmt=fmt)
        mine = rows.view(-1, fp8.ROW_BYTES)[:per_rank]  # shard 0's rows
        received.view(n_ranks, per_rank, fp8.ROW_BYTES)[rank].copy_(mine)
    r0 = torch.randn(per_rank * 128) * 1e-4 if residual else None
    out, out_ref = torch.empty(per_rank * fp8.ROW_BYTES, dtype=torch.uint8), torch.empty(per_rank * fp8.ROW_BYTES,
                                                                                          dtype=torch.uint8)
    res = None if r0 is None else r0.clone()
    res_ref = None if r0 is None else r0.clone()
    blockscale.reduce_blocks(received, n_ranks, out, fmt=fmt, residual=res)
    cpu_fp8.reduce_pass(received, n_ranks, out_ref, fp8.FORMATS[fmt], res_ref)()
    assert torch.equal(out, out_ref)
    if residual:
        assert_same_bits(res, res_ref)
    # Independently: the float32 rank-order sum, requantized, is what was written.
    codes, scales = split(received)
    total = torch.zeros(per_rank, 128)
    for rank in range(n_ranks):
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        total = total + codes[part].view(fmt).float() * scales[part, None]
    if r0 is not None:
        total = total + r0.view(per_rank, 128)
    want_codes, want_scales, _, _ = torch_wire.quantize_rows(total, fp8.FORMATS[fmt])
    got_codes, got_scales = split(out)
    assert torch.equal(got_codes, want_codes) and torch.equal(got_scales, want_scales)


# ---- sum of the ranks' rows, kept in float32 ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_ranks", [1, 3, 4])
@pytest.mark.parametrize("sizes, n_shards", [
    pytest.param([1], 1, id="one-element"), pytest.param([128], 1, id="one-full-block"),
    pytest.param([129, 7, 0, 300], 1, id="ragged"), pytest.param([3] * 40, 1, id="many-tiny"),
    pytest.param([300, 5], 4, id="padding-rows"), pytest.param([], 1, id="empty"),
    pytest.param([0], 2, id="empty-tensor-two-shards")])
def test_sum_blocks_adds_the_ranks_values_in_float32_in_rank_order(fmt, n_ranks, sizes, n_shards):
    """Padding rows (a layout cut for shards) and empty layouts included; each rank's slice is ``n_rows`` rows."""
    layout = block_layout(sizes, n_shards)
    step = layout.n_rows * fp8.ROW_BYTES
    received = torch.empty(n_ranks * step, dtype=torch.uint8)
    for rank in range(n_ranks):
        blockscale.quantize_blocks(gradient_like(sizes, torch.float32, seed=rank), layout,
                                   received[rank * step:(rank + 1) * step], fmt=fmt)
    if layout.n_elements:  # a -0.0 from every rank stays -0.0: the sum starts from the first rank's value
        received.view(n_ranks, layout.n_rows, fp8.ROW_BYTES)[:, 0, 0] = 0x80
    out, out_ref = torch.full((layout.n_elements,), float("nan")), torch.empty(layout.n_elements)
    blockscale.sum_blocks(received, n_ranks, layout, out, fmt=fmt)
    cpu_fp8.sum_blocks_pass(received, n_ranks, layout, out_ref, fp8.FORMATS[fmt])()
    assert_same_bits(out, out_ref)
    # Independently: each rank's codes times its block's scale, added in float32 in rank order, in the tensors' places.
    codes, scales = split(received)
    total = None
    for rank in range(n_ranks):
        part = slice(rank * layout.n_rows, (rank + 1) * layout.n_rows)
        values = codes[part].view(fmt).float() * scales[part, None]
        total = values if total is None else total + values
    want = torch.cat([total[row, :length] for row, (_, length) in enumerate(layout.table.tolist()) if length]) \
        if layout.n_elements else torch.empty(0)
    assert_same_bits(out, want)
    if layout.n_elements:
        assert out.view(torch.int32)[0].item() == -2**31  # -0.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_sum_blocks_adds_in_rank_order_not_any_order(fmt):
    """1 + 2^-24 + 2^-24 in rank order is 1 (each add a tie, to even); added last to first it would be 1 + 2^-23."""
    layout = block_layout([128], 1)
    step = layout.n_rows * fp8.ROW_BYTES
    received = torch.empty(3 * step, dtype=torch.uint8)
    for rank, value in enumerate((1.0, 2.0 ** -24, 2.0 ** -24)):
        block = torch.zeros(128)
        block[0] = value
        blockscale.quantize_blocks(block, layout, received[rank * step:(rank + 1) * step], fmt=fmt)
    for run in (blockscale.sum_blocks, lambda *a, fmt: cpu_fp8.sum_blocks_pass(*a, fp8.FORMATS[fmt])()):
        out = torch.empty(128)
        run(received, 3, layout, out, fmt=fmt)
        assert out[0].item() == 1.0 and torch.equal(out[1:], torch.zeros(127))


@pytest.mark.parametrize("fmt", FORMATS)
def test_sum_blocks_keeps_nan_and_inf_where_the_sum_has_them(fmt):
    """A NaN is a NaN (its bits are the arithmetic's, as an all-reduce's); infinities add as floats do."""
    layout = block_layout([256], 1)
    step = layout.n_rows * fp8.ROW_BYTES
    received = torch.empty(2 * step, dtype=torch.uint8)
    for rank in range(2):
        blockscale.quantize_blocks(gradient_like([256], torch.float32, seed=rank), layout,
                                   received[rank * step:(rank + 1) * step], fmt=fmt)
    nan_code = int(torch.tensor([float("nan")]).to(fmt).view(torch.uint8))
    received.view(2, layout.n_rows, fp8.ROW_BYTES)[1, 0, 5] = nan_code  # one NaN from rank 1
    want_nan = torch.zeros(256, dtype=torch.bool)
    want_nan[5] = True
    if fmt == torch.float8_e5m2:  # e5m2 has infinities: +inf from one rank and -inf from the other make a NaN
        received.view(2, layout.n_rows, fp8.ROW_BYTES)[0, 1, 9] = 0x7C
        received.view(2, layout.n_rows, fp8.ROW_BYTES)[1, 1, 9] = 0xFC
        want_nan[128 + 9] = True
    for run in (blockscale.sum_blocks, lambda *a, fmt: cpu_fp8.sum_blocks_pass(*a, fp8.FORMATS[fmt])()):
        out = torch.empty(256)
        run(received, 2, layout, out, fmt=fmt)
        assert torch.equal(torch.isnan(out), want_nan)


def test_sum_blocks_refuses_a_buffer_of_the_wrong_size_by_name():
    layout = block_layout([300], 1)
    received = torch.zeros(2 * layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="received"):
        blockscale.sum_blocks(received, 3, layout, torch.empty(300))
    with pytest.raises(ValueError, match="out"):
        blockscale.sum_blocks(received, 2, layout, torch.empty(299))
    with pytest.raises((TypeError, ValueError), match="out"):
        blockscale.sum_blocks(received, 2, layout, torch.empty(300, dtype=torch.bfloat16))


# ---- dequantize ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_same_bits_as_torch_path_with_stats(fmt, dtype):
    sizes = [129, 7, 0, 300]
    layout = block_layout(sizes, 2)
    rows = rows_for(layout)
    blockscale.quantize_blocks(gradient_like(sizes, torch.float32), layout, rows, fmt=fmt)
    out, out_ref = torch.empty(layout.n_elements, dtype=dtype), torch.empty(layout.n_elements, dtype=dtype)
    stats, stats_ref = torch.empty(2), torch.empty(2)
    blockscale.dequantize_blocks(rows, layout, out, fmt=fmt, stats=stats)
    cpu_fp8.dequantize_pass(rows, layout, out_ref, fp8.FORMATS[fmt], stats_ref)()
    assert_same_bits(out, out_ref)
    # Both paths sum squares in a different order: float32 summation error over a few hundred terms.
    assert torch.allclose(stats, stats_ref, rtol=1e-5)
    assert stats[0].item() == pytest.approx(out.double().square().sum().item(), rel=1e-5)


# ---- sum of slices ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_ranks,size", [(1, 5), (3, 1), (4, 2500)])
def test_sum_slices_adds_in_float32_in_rank_order(dtype, n_ranks, size):
    gen = torch.Generator().manual_seed(3)
    received = (torch.randn(n_ranks * size, generator=gen) * 100).to(dtype)
    if size > 10:
        received[7] = float("nan")
    received.view(n_ranks, size)[:, 0] = -0.0  # every rank's -0.0 sums to -0.0, as an all-reduce of them does
    out, out_ref = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
    slices.sum_slices(received, n_ranks, out)
    torch_wire.sum_slices_pass(received, n_ranks, out_ref)()
    assert_same_bits(out, out_ref)
    total = received[:size].float()
    for rank in range(1, n_ranks):
        total = total + received[rank * size: (rank + 1) * size].float()
    assert_same_bits(out, total.to(dtype))
    assert bits(out)[0].item() == bits(torch.tensor([-0.0], dtype=dtype)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_slices_into_float32_keeps_the_sum_unrounded(dtype):
    n_ranks, size = 3, 2500
    gen = torch.Generator().manual_seed(4)
    received = (torch.randn(n_ranks * size, generator=gen) * 100).to(dtype)
    out, out_ref = torch.empty(size), torch.empty(size)
    slices.sum_slices(received, n_ranks, out)
    torch_wire.sum_slices_pass(received, n_ranks, out_ref)()
    total = received[:size].float()
    for rank in range(1, n_ranks):
        total = total + received[rank * size: (rank + 1) * size].float()
    assert_same_bits(out, total)
    assert_same_bits(out_ref, total)
    assert not torch.equal(total, total.to(dtype).float())  # a rounding to the wire dtype would have shown


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_by_name():
    layout = block_layout([10], 1)
    rows = rows_for(layout)
    with pytest.raises(ValueError, match="fp8 format"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, fmt=torch.float16)
    with pytest.raises(ValueError, match="src has 9 elements"):
        blockscale.quantize_blocks(torch.ones(9), layout, rows)
    with pytest.raises(ValueError, match="rows has"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows[:-4])
    with pytest.raises(ValueError, match="rows must be 4-byte aligned"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows_for(block_layout([200], 1))[2:2 + rows.numel()])
    with pytest.raises(TypeError, match="src must be a tensor, got list"):
        blockscale.quantize_blocks([1.0] * 10, layout, rows)
    with pytest.raises(ValueError, match="scale must be finite"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, float("inf"))
    with pytest.raises(TypeError, match="n_ranks must be a positive int, got str"):
        slices.sum_slices(torch.ones(4), "2", torch.empty(2))
    with pytest.raises(TypeError, match="residual has dtype float16"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, residual=torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="n_ranks"):
        blockscale.reduce_blocks(rows, 0, rows)
    with pytest.raises(ValueError, match="received has"):
        blockscale.reduce_blocks(rows, 2, rows)
    with pytest.raises(ValueError, match="stats"):
        blockscale.dequantize_blocks(rows, layout, torch.empty(10), stats=torch.empty(3))
    with pytest.raises(TypeError, match=r"out \(torch.bfloat16\) must be received's dtype \(torch.float32\) or"):
        slices.sum_slices(torch.ones(4), 2, torch.empty(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="n_shards"):
        block_layout([3], 0)
    with pytest.raises(ValueError, match="sizes"):
        block_layout([-1], 1)


# ---- fixed prepared calls (what the hook's exchanges run every step) -----------------------------------------------


def _fp8_round_trip(calls, src, layout, n_ranks, fmt):
    """Quantize, reduce the same rows as if every rank sent them, dequantize with stats: every output, as run by
    ``calls`` (the plain functions or their prepared calls fixed to the tensors), over two steps with new bucket
    contents between."""
    rows, shard = rows_for(layout), torch.empty(layout.rows_per_shard * fp8.ROW_BYTES, dtype=torch.uint8)
    received = torch.empty(layout.rows_per_shard * fp8.ROW_BYTES * n_ranks, dtype=torch.uint8)
    residual, shard_residual = torch.zeros(src.numel()), torch.zeros(layout.rows_per_shard * 128)
    dst, stats = torch.empty_like(src), torch.zeros(2)
    quantize, reduce, dequantize = calls(src, layout, rows, received, shard, residual, shard_residual, dst, stats,
                                         n_ranks, fmt)
    outputs = []
    for step in range(2):
        src.mul_(-0.5 if step else 1.0)  # the same buffers, new values: a fixed call must read them afresh
        quantize()
        received.copy_(rows[: shard.numel()].repeat(n_ranks))
        reduce()
        dequantize()
        outputs += [t.clone() for t in (rows, shard, residual, shard_residual, dst, stats)]
    return outputs


def _plain(src, layout, rows, received, shard, residual, shard_residual, dst, stats, n_ranks, fmt):
    return (lambda: blockscale.quantize_blocks(src, layout, rows, 0.5, fmt=fmt, residual=residual),
            lambda: blockscale.reduce_blocks(received, n_ranks, shard, fmt=fmt, residual=shard_residual),
            lambda: blockscale.dequantize_blocks(rows, layout, dst, fmt=fmt, stats=stats))


def _fixed(src, layout, rows, received, shard, residual, shard_residual, dst, stats, n_ranks, fmt):
    return (blockscale.quantize_blocks.prepare(src, layout, rows, 0.5, fmt=fmt, residual=residual).fixed(
                src, rows, residual),
            blockscale.reduce_blocks.prepare(received, n_ranks, shard, fmt=fmt, residual=shard_residual).fixed(
                received, shard, shard_residual),
            blockscale.dequantize_blocks.prepare(rows, layout, dst, fmt=fmt, stats=stats).fixed(rows, dst, stats))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fixed_fp8_calls_repeat_the_plain_calls_bit_for_bit(fmt):
    sizes, n_ranks = [129, 7, 300], 3
    layout = block_layout(sizes, n_ranks)
    src = gradient_like(sizes, torch.float32)
    plain = _fp8_round_trip(_plain, src.clone(), layout, n_ranks, fmt)
    fixed = _fp8_round_trip(_fixed, src.clone(), layout, n_ranks, fmt)
    for a, b in zip(plain, fixed):
        if a.dtype == torch.uint8:  # rows: codes and scales
            assert torch.equal(b, a)
        else:
            assert_same_bits(b, a)
    assert plain[-1][0] > 0 and not torch.equal(plain[4], plain[10])  # stats written; step 2 saw the new values


def test_fixed_sums_repeat_the_plain_calls_and_bad_input_is_refused_when_prepared():
    received = torch.randn(3 * 50).to(torch.bfloat16)
    plain, fixed = torch.empty(50, dtype=torch.bfloat16), torch.empty(50, dtype=torch.bfloat16)
    run = slices.sum_slices.prepare(received, 3, fixed).fixed(received, fixed)
    for _ in range(2):
        received.mul_(3.0)
        slices.sum_slices(received, 3, plain)
        run()
        assert_same_bits(fixed, plain)
    with pytest.raises(ValueError, match="received has"):
        slices.sum_slices.prepare(received, 2, fixed)
    layout = block_layout([300, 5], 1)
    rows = torch.empty(3 * layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    values = gradient_like([300, 5] * 3, torch.float32)
    plain, fixed = torch.empty(305), torch.empty(305)
    run = blockscale.sum_blocks.prepare(rows, 3, layout, fixed).fixed(rows, fixed)
    for step in range(2):  # new rows each time: the fixed call reads them where they are
        blockscale.quantize_blocks(values * (step + 1), block_layout([300, 5] * 3, 3), rows)
        blockscale.sum_blocks(rows, 3, layout, plain)
        run()
        assert_same_bits(fixed, plain)
    with pytest.raises(ValueError, match="received"):
        blockscale.sum_blocks.prepare(rows, 2, layout, fixed)
    layout = block_layout([10], 1)
    with pytest.raises(ValueError, match="src has 9 elements"):
        blockscale.quantize_blocks.prepare(torch.ones(9), layout, rows_for(layout))
    with pytest.raises(ValueError, match="n_ranks"):
        blockscale.reduce_blocks.prepare(rows_for(layout), 0, rows_for(layout))
    with pytest.raises(ValueError, match="stats"):
        blockscale.dequantize_blocks.prepare(rows_for(layout), layout, torch.empty(10), stats=torch.empty(3))


# ---- the CPU passes, step by step over blocks (CHUNK_ROWS), against whole-grid definitions ------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", [pytest.param([7 * torch_wire.CHUNK_ROWS * 64 + 77], id="aligned"),
                                   pytest.param([1000, torch_wire.CHUNK_ROWS * 128 + 3], id="scattered")])
def test_cpu_passes_across_their_steps(fmt, sizes):
    """The CPU passes go CHUNK_ROWS blocks at a time (the aligned layout: its shard too spans two steps, with a
    short last step and padding rows; a layout whose first tensor ends inside a block takes the scattered path): the
    same bits as the whole grid at once, by quantize_rows and decode_rows, with a float32 sum in rank order started
    at +0.0."""
    spec, ranks = fp8.FORMATS[fmt], 3
    layout = block_layout(sizes, ranks)
    x = gradient_like(sizes, torch.float32, seed=5)
    x[7] = -0.0  # a signed zero through every stage
    residual = gradient_like(sizes, torch.float32, seed=6) * 1e-3
    rows, res = rows_for(layout), residual.clone()
    cpu_fp8.quantize_pass(x, layout, rows, 0.25, spec, res)()
    grid = torch.zeros(layout.n_rows * 128)
    grid.index_copy_(0, layout.positions(), x * 0.25 + residual)
    codes, scales, dequantized, _ = torch_wire.quantize_rows(grid.view(-1, 128), spec)
    got_codes, got_scales = split(rows)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    left = (grid.view(-1, 128) - dequantized).view(-1).index_select(0, layout.positions())
    assert_same_bits(res, left)

    # reduce: every rank's copy of shard 1 (different per rank), with a second-stage residual
    shard_rows = layout.rows_per_shard
    copies = [rows_for(layout) for _ in range(ranks)]
    for r, copy in enumerate(copies):
        cpu_fp8.quantize_pass(gradient_like(sizes, torch.float32, seed=10 + r), layout, copy, 1.0, spec, None)()
    part = slice(shard_rows * fp8.ROW_BYTES, 2 * shard_rows * fp8.ROW_BYTES)
    received = torch.cat([copy[part] for copy in copies])
    second = gradient_like([shard_rows * 128], torch.float32, seed=20) * 1e-3
    out, second_got = torch.empty(shard_rows * fp8.ROW_BYTES, dtype=torch.uint8), second.clone()
    cpu_fp8.reduce_pass(received, ranks, out, spec, second_got)()
    total = torch.zeros(shard_rows, 128)
    for copy in copies:
        total = total + torch_wire.decode_rows(*split(copy[part]), spec)
    total = total + second.view(shard_rows, 128)
    codes, scales, dequantized, _ = torch_wire.quantize_rows(total, spec)
    assert torch.equal(split(out)[0], codes) and torch.equal(split(out)[1], scales)
    assert_same_bits(second_got, (total - dequantized).view(-1))

    # dequantize into a bfloat16 bucket, and the float32 sum of 16-bit slices
    dst = torch.empty(layout.n_elements, dtype=torch.bfloat16)
    cpu_fp8.dequantize_pass(rows, layout, dst, spec, None)()
    values = torch_wire.decode_rows(*split(rows), spec).view(-1).index_select(0, layout.positions())
    assert_same_bits(dst, values.to(torch.bfloat16))
    slices16 = x.to(torch.bfloat16)[: (layout.n_elements // ranks) * ranks]
    summed = torch.empty(layout.n_elements // ranks, dtype=torch.bfloat16)
    torch_wire.sum_slices_pass(slices16, ranks, summed)()
    expected = torch.zeros(summed.numel())
    for r in range(ranks):
        expected = expected + slices16[r * summed.numel():(r + 1) * summed.numel()].float()
    assert_same_bits(summed, expected.to(torch.bfloat16))


@pytest.mark.parametrize("native", ["1", "0"], ids=["compiled", "torch-ops"])
def test_a_block_whose_scale_overflows_gives_the_kernels_residual(monkeypatch, native):
    """Code times scale overflows to inf near float32's top: the kernel's residual is -inf; both CPU paths agree."""
    monkeypatch.setenv("DDP_TRITON_NATIVE_CPU", native)
    layout = block_layout([256], 1)
    src = torch.linspace(-1.0, 1.0, 256)
    src[0] = 3.3e38
    got, want = {}, {}
    for out, run in ((got, cpu_fp8.quantize_pass), (want, None)):
        residual, rows = torch.zeros(256), rows_for(layout)
        if run is None:
            blockscale.quantize_blocks(src, layout, rows, 1.0, fmt=torch.float8_e4m3fn, residual=residual)
        else:
            run(src, layout, rows, 1.0, fp8.E4M3, residual)()
        out.update(rows=rows, residual=residual)
    assert torch.equal(got["rows"], want["rows"])
    assert torch.equal(got["residual"].view(torch.int32), want["residual"].view(torch.int32))
    assert want["residual"][0] == float("-inf")
