"""Wire-format kernels in block-scaled E2M1 (4-bit): quantize, reduce, dequantize and the float32 sum of blocks.

Tier: no device. The Triton kernels run in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1);
each is compared bit for bit with the CPU path training uses (``kernels.cpu_fp4``: the compiled passes of
``blockscale_cpu.c`` where they build, else torch ops; test_native_cpu.py compares the two) and both with the reference
written apart from the format's definition (``wire_reference.fp4_block``: a search for each group's scale
and the nearest E2M1 magnitude by distance, in float64).
"""

import math

import pytest
import torch

from bits import assert_same_bits
from interpreter import interpreter_problem
from wire_reference import E2M1_VALUES, fp4_rows
from ddp_triton.kernels import FP4_E2M1, blockscale, cpu_fp4, fp4, row_bytes, uses_triton
from ddp_triton.kernels.blocks import block_layout

FMT = FP4_E2M1
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
SIZES = [
    pytest.param([0], id="empty"),
    pytest.param([1], id="one-element"),
    pytest.param([128], id="one-full-block"),
    pytest.param([131], id="prime-past-a-block"),
    pytest.param([129, 7, 0, 300], id="ragged"),
    pytest.param([3] * 40, id="many-tiny"),
    pytest.param([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67], id="odd-primes"),
]

pytestmark = pytest.mark.skipif(not uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")


def gradient_like(sizes, dtype=torch.float32, seed=0):
    """Tensors of very different scales (1e-6 .. 1e2) with heavy tails, flat in one bucket."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i, n in enumerate(sizes):
        t = torch.randn(n, generator=gen) / torch.rand(n, generator=gen).clamp_min(0.05)
        parts.append(t * 10.0 ** ((i * 7) % 9 - 6))
    return torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype)


def rows_for(layout, n=1):
    return torch.zeros(n * layout.n_rows * fp4.ROW_BYTES, dtype=torch.uint8)


def row_list(rows):
    return [bytes(r) for r in rows.view(-1, fp4.ROW_BYTES).tolist()]


def both_paths(run_triton, run_torch, *outputs):
    """Run the Triton kernel and the torch path on copies of ``outputs``; return both sets."""
    got = [o.clone() if o is not None else None for o in outputs]
    want = [o.clone() if o is not None else None for o in outputs]
    run_triton(*got)
    run_torch(*want)
    return got, want


def assert_same(got, want):
    for a, b in zip(got, want):
        if a is None:
            continue
        if a.dtype == torch.uint8:
            assert torch.equal(a, b)
        else:
            assert_same_bits(a, b)


# ---- the format ---------------------------------------------------------------------------------------------------


def test_a_row_is_half_of_fp8s_bytes_and_whole_words():
    assert row_bytes(FMT) == fp4.ROW_BYTES == 64 + 128 // fp4.GROUP_ELEMENTS
    assert row_bytes(FMT) % 4 == 0 and row_bytes(FMT) / row_bytes(torch.float8_e4m3fn) <= 0.52
    assert row_bytes() == row_bytes(torch.float8_e5m2) == 132


def test_rounding_at_every_value_and_midpoint():
    """Every E2M1 value, every midpoint (ties to the even code) and one float32 step either side of each, both signs,
    in groups whose largest value is 6 (scale exactly 1)."""
    values = torch.tensor(E2M1_VALUES)
    mid = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mid, torch.nextafter(mid, torch.tensor(-1.0)), torch.nextafter(mid, torch.tensor(9.0)),
                        torch.tensor([-0.0, 1e-30, 2.0 ** -149])])
    probes = torch.cat([probes, -probes])
    per_group = fp4.GROUP_ELEMENTS - 1
    groups_per_block = 128 // fp4.GROUP_ELEMENTS
    probes = torch.cat([probes, torch.zeros((-probes.numel()) % (per_group * groups_per_block))]).view(-1, per_group)
    blocks = torch.cat([probes, torch.full((probes.shape[0], 1), 6.0)], dim=1).reshape(-1)
    sizes = [blocks.numel()]
    layout = block_layout(sizes, 1)
    want, deq = fp4_rows(blocks, sizes)
    for run in (lambda r: blockscale.quantize_blocks(blocks, layout, r, fmt=FMT),
                lambda r: cpu_fp4.quantize_pass(blocks, layout, r, 1.0, None)()):
        rows = rows_for(layout)
        run(rows)
        assert row_list(rows)[:layout.n_blocks] == want
        assert all(b == 127 for row in want for b in row[64:]), "scale 2^0 throughout"
    out = torch.empty(blocks.numel())
    blockscale.dequantize_blocks(rows, layout, out, fmt=FMT)
    assert_same_bits(out, torch.tensor(deq, dtype=torch.float32))


@pytest.mark.parametrize("scale_byte", [1, 100, 127, 200, 253, 0xFF])
def test_decoding_every_code(scale_byte):
    """All 16 codes in every nibble position, at a scale byte from 2^-126 to 2^126 and NaN's 0xFF."""
    layout = block_layout([128], 1)
    codes = torch.arange(128) % 16
    rows = rows_for(layout)
    grid = rows.view(-1, fp4.ROW_BYTES)
    grid[0, :64] = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
    grid[0, 64:] = scale_byte
    want = torch.tensor([math.copysign(E2M1_VALUES[c & 7], -1.0 if c & 8 else 1.0) * 2.0 ** (scale_byte - 127)
                         for c in codes.tolist()], dtype=torch.float32)
    if scale_byte == 0xFF:
        want = torch.full((128,), float("nan"))
    for run in (lambda o: blockscale.dequantize_blocks(rows, layout, o, fmt=FMT),
                lambda o: cpu_fp4.dequantize_pass(rows, layout, o, None)()):
        out = torch.empty(128)
        run(out)
        assert_same_bits(out, want)


# ---- quantize ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_shards", [1, 3])
@pytest.mark.parametrize("sizes", SIZES)
def test_quantize_matches_the_definition(sizes, n_shards):
    x = gradient_like(sizes)
    layout = block_layout(sizes, n_shards)
    want, deq = fp4_rows(x * 0.25, sizes)
    got, ref = both_paths(lambda r: blockscale.quantize_blocks(x, layout, r, 0.25, fmt=FMT),
                          lambda r: cpu_fp4.quantize_pass(x, layout, r, 0.25, None)(), rows_for(layout))
    assert_same(got, ref)
    assert layout.n_rows % n_shards == 0 and row_list(got[0])[:layout.n_blocks] == want
    assert not got[0].view(-1, fp4.ROW_BYTES)[layout.n_blocks:, :64].any(), "padding rows carry no codes"
    out = torch.empty(layout.n_elements)
    blockscale.dequantize_blocks(got[0], layout, out, fmt=FMT)
    assert_same_bits(out, torch.tensor(deq, dtype=torch.float32))


def test_extreme_magnitudes_match_the_definition():
    """Subnormals, float32's largest values (a group whose dequantized 4 * 2^126 overflows to inf), exact zeros and
    -0.0, block by block at magnitudes 2^-149 to 2^127."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12 * 128, generator=gen)
    exponents = torch.arange(-149, 127, 23)[:12].repeat_interleave(128)
    x = x * torch.pow(2.0, exponents.double()).float()
    x[5:128:9] = 0.0
    x[6:128:13] = -0.0
    x[200] = 2.0 ** -149
    x[-1] = 3.3e38
    layout = block_layout([x.numel()], 1)
    want, deq = fp4_rows(x + 0.0, [x.numel()])  # what is quantized: x plus the residual, 0 (-0.0 + 0.0 is +0.0)
    got, ref = both_paths(lambda r, res: blockscale.quantize_blocks(x, layout, r, fmt=FMT, residual=res),
                          lambda r, res: cpu_fp4.quantize_pass(x, layout, r, 1.0, res)(),
                          rows_for(layout), torch.zeros(x.numel()))
    assert_same(got, ref)
    assert row_list(got[0]) == want
    assert got[1][-1].item() == float("-inf")  # x - inf: the residual of a group whose dequantized value overflowed
    assert math.isinf(deq[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [SIZES[4], SIZES[5], SIZES[6]])
def test_quantize_with_residual_same_bits_on_both_paths(dtype, sizes):
    x = gradient_like(sizes, dtype)
    layout = block_layout(sizes, 2)
    residual = gradient_like(sizes, seed=1) * 1e-2
    got, ref = both_paths(lambda r, res: blockscale.quantize_blocks(x, layout, r, 0.5, fmt=FMT, residual=res),
                          lambda r, res: cpu_fp4.quantize_pass(x, layout, r, 0.5, res)(),
                          rows_for(layout), residual)
    assert_same(got, ref)
    value = x.float() * 0.5 + residual  # the float32 value the kernel quantizes
    want, deq = fp4_rows(value, sizes)
    assert row_list(got[0])[:layout.n_blocks] == want
    # The residual is what the rounding left out: the dequantized value plus it is the value, to float32 rounding.
    assert torch.allclose(torch.tensor(deq) + got[1].double(), value.double(), rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_block_is_sent_as_nan_and_its_residual_reset(bad):
    x = torch.ones(3 * 128)
    x[128:256] = 0.0  # an all-zero block between: scale 2^-126, codes 0
    x[5] = bad
    layout = block_layout([384], 1)
    residual = torch.full((384,), 0.25)
    residual[128:256] = 0.0
    got, ref = both_paths(lambda r, res: blockscale.quantize_blocks(x, layout, r, fmt=FMT, residual=res),
                          lambda r, res: cpu_fp4.quantize_pass(x, layout, r, 1.0, res)(),
                          rows_for(layout), residual)
    assert_same(got, ref)
    rows, residual = got
    grid = rows.view(-1, fp4.ROW_BYTES)
    assert not grid[0, :64].any() and (grid[0, 64:] == fp4.NAN_SCALE).all()
    assert not grid[1, :64].any() and (grid[1, 64:] == 1).all()
    assert (residual[:256] == 0).all() and (residual[256:] == 0.25).all()  # 1.25 is a tie: to 1.0, the even code
    out = torch.empty(384)
    blockscale.dequantize_blocks(rows, layout, out, fmt=FMT)
    assert torch.isnan(out[:128]).all() and torch.isfinite(out[128:]).all()
    assert (out[128:256] == 0).all() and (out[256:] == 1.0).all()


# ---- reduce ---------------------------------------------------------------------------------------------------------


def received_rows(sizes, layout, n_ranks, shard=0):
    """What every rank sent for one rank's shard: rows quantized from different gradients, rank after rank."""
    per_rank = layout.rows_per_shard
    received = torch.empty(n_ranks * per_rank * fp4.ROW_BYTES, dtype=torch.uint8)
    for rank in range(n_ranks):
        rows = rows_for(layout)
        cpu_fp4.quantize_pass(gradient_like(sizes, seed=rank), layout, rows, 1.0, None)()
        mine = rows.view(-1, fp4.ROW_BYTES)[shard * per_rank:(shard + 1) * per_rank]
        received.view(n_ranks, per_rank, fp4.ROW_BYTES)[rank].copy_(mine)
    return received


def test_rows_are_written_within_their_bytes():
    """Quantize and reduce write whole rows and nothing past the last: bytes after it keep their value. (Triton 3.0's
    interpreter stored a row's one scale word twice, the second past the row: heap corruption at the buffer's end.)"""
    sizes = [131]
    layout = block_layout(sizes, 1)
    n = layout.n_rows * fp4.ROW_BYTES
    x = gradient_like(sizes)
    guarded = torch.full((n + 64,), 0xAB, dtype=torch.uint8)
    blockscale.quantize_blocks(x, layout, guarded[:n], 0.25, fmt=FMT)
    assert (guarded[n:] == 0xAB).all(), "quantize wrote past its rows"
    received = guarded[:n].clone()
    shard = torch.full((n + 64,), 0xAB, dtype=torch.uint8)
    blockscale.reduce_blocks(received, 1, shard[:n], fmt=FMT)
    assert (shard[n:] == 0xAB).all(), "reduce wrote past its rows"


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("residual", [False, True], ids=["no-ef", "ef"])
def test_reduce_sums_in_rank_order_and_requantizes(n_ranks, residual):
    sizes = [300, 5, 128, 61]
    layout = block_layout(sizes, n_ranks)
    per_rank = layout.rows_per_shard
    received = received_rows(sizes, layout, n_ranks)
    r0 = gradient_like([per_rank * 128], seed=9) * 1e-4 if residual else None
    got, ref = both_paths(lambda o, res: blockscale.reduce_blocks(received, n_ranks, o, fmt=FMT, residual=res),
                          lambda o, res: cpu_fp4.reduce_pass(received, n_ranks, o, res)(),
                          torch.empty(per_rank * fp4.ROW_BYTES, dtype=torch.uint8), r0)
    assert_same(got, ref)
    # Independently: the reference's values of each rank's rows, added in float32 in rank order from +0, requantized.
    total = torch.zeros(per_rank * 128)
    for rank in range(n_ranks):
        part = received.view(n_ranks, -1)[rank]
        total = total + reference_values(part)
    if r0 is not None:
        total = total + r0
    want, deq = fp4_rows(total, [128] * per_rank)
    assert row_list(got[0]) == want
    if residual:
        assert_same_bits(got[1], total - torch.tensor(deq, dtype=torch.float32))


def reference_values(rows):
    """float32 values of rows, decoded from the definition (codes two to a byte, scale 2^(byte - 127))."""
    out = []
    for row in rows.view(-1, fp4.ROW_BYTES).tolist():
        codes = [c for byte in row[:64] for c in (byte & 15, byte >> 4)]
        scales = row[64:]
        for i, c in enumerate(codes):
            s = scales[i // fp4.GROUP_ELEMENTS]
            out.append(math.nan if s == 0xFF else
                       math.copysign(E2M1_VALUES[c & 7], -1.0 if c & 8 else 1.0) * 2.0 ** (s - 127))
    return torch.tensor(out, dtype=torch.float32)


def test_reduce_of_a_nan_row_sends_nan_and_resets_the_residual():
    layout = block_layout([256], 2)
    received = received_rows([256], layout, 2)
    received.view(2, -1, fp4.ROW_BYTES)[1, 0, 64:] = fp4.NAN_SCALE  # rank 1's row 0 overflowed
    got, ref = both_paths(lambda o, res: blockscale.reduce_blocks(received, 2, o, fmt=FMT, residual=res),
                          lambda o, res: cpu_fp4.reduce_pass(received, 2, o, res)(),
                          torch.empty(fp4.ROW_BYTES, dtype=torch.uint8), torch.full((128,), 0.5))
    assert_same(got, ref)
    assert (got[0][64:] == fp4.NAN_SCALE).all() and (got[1] == 0).all()


# ---- sum of the ranks' rows, kept in float32 -----------------------------------------------------------------------


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("sizes, n_shards", [
    pytest.param([1], 1, id="one-element"), pytest.param([129, 7, 0, 300], 1, id="ragged"),
    pytest.param([3] * 40, 1, id="many-tiny"), pytest.param([300, 5], 4, id="padding-rows"),
    pytest.param([], 1, id="empty"), pytest.param([0], 2, id="empty-tensor-two-shards")])
def test_sum_blocks_adds_the_ranks_values_in_float32_in_rank_order(n_ranks, sizes, n_shards):
    layout = block_layout(sizes, n_shards)
    step = layout.n_rows * fp4.ROW_BYTES
    received = torch.empty(n_ranks * step, dtype=torch.uint8)
    for rank in range(n_ranks):
        cpu_fp4.quantize_pass(gradient_like(sizes, seed=rank), layout, received[rank * step:(rank + 1) * step], 1.0,
                              None)()
    if layout.n_elements:  # a -0.0 from every rank stays -0.0: the sum starts from the first rank's value
        received.view(n_ranks, layout.n_rows, fp4.ROW_BYTES)[:, 0, 0] &= 0xF0
        received.view(n_ranks, layout.n_rows, fp4.ROW_BYTES)[:, 0, 0] |= 8
    got, ref = both_paths(lambda o: blockscale.sum_blocks(received, n_ranks, layout, o, fmt=FMT),
                          lambda o: cpu_fp4.sum_blocks_pass(received, n_ranks, layout, o)(),
                          torch.full((layout.n_elements,), float("nan")))
    assert_same(got, ref)
    total = None
    for rank in range(n_ranks):
        values = reference_values(received[rank * step:(rank + 1) * step]).view(-1, 128)
        total = values if total is None else total + values
    want = torch.cat([total[row, :length] for row, (_, length) in enumerate(layout.table.tolist()) if length]) \
        if layout.n_elements else torch.empty(0)
    assert_same_bits(got[0], want)
    if layout.n_elements:
        assert got[0].view(torch.int32)[0].item() == -2**31  # -0.0


def test_sum_blocks_adds_in_rank_order_not_any_order():
    """1 + 2^-24 + 2^-24 in rank order is 1 (each add a tie, to even); added last to first it would be 1 + 2^-23."""
    layout = block_layout([128], 1)
    step = layout.n_rows * fp4.ROW_BYTES
    received = torch.empty(3 * step, dtype=torch.uint8)
    for rank, value in enumerate((1.0, 2.0 ** -24, 2.0 ** -24)):
        block = torch.zeros(128)
        block[0] = value
        blockscale.quantize_blocks(block, layout, received[rank * step:(rank + 1) * step], fmt=FMT)
    for run in (lambda o: blockscale.sum_blocks(received, 3, layout, o, fmt=FMT),
                lambda o: cpu_fp4.sum_blocks_pass(received, 3, layout, o)()):
        out = torch.empty(128)
        run(out)
        assert out[0].item() == 1.0 and torch.equal(out[1:], torch.zeros(127))


# ---- dequantize ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_same_bits_on_both_paths_with_stats(dtype):
    sizes = [129, 7, 0, 300]
    layout = block_layout(sizes, 2)
    rows = rows_for(layout)
    cpu_fp4.quantize_pass(gradient_like(sizes), layout, rows, 1.0, None)()
    for sent_nan in (False, True):
        if sent_nan:
            rows.view(-1, fp4.ROW_BYTES)[2, 64:] = fp4.NAN_SCALE  # the 7-element tensor's block sent as non-finite
        got, ref = both_paths(lambda o, st: blockscale.dequantize_blocks(rows, layout, o, fmt=FMT, stats=st),
                              lambda o, st: cpu_fp4.dequantize_pass(rows, layout, o, st)(),
                              torch.empty(layout.n_elements, dtype=dtype), torch.empty(2))
        assert_same_bits(got[0], ref[0])
        assert_same_bits(got[0], reference_values(rows).view(-1, 128)[:layout.n_blocks].reshape(-1).index_select(
            0, layout.positions()).to(dtype))
        assert got[1][1].item() == ref[1][1].item() == (7 if sent_nan else 0)
        if sent_nan:
            assert math.isnan(got[1][0].item()) and math.isnan(ref[1][0].item())
        else:
            # Both paths sum squares in a different order: float32 summation error over a few hundred terms.
            assert torch.allclose(got[1], ref[1], rtol=1e-5)
            assert got[1][0].item() == pytest.approx(got[0].double().square().sum().item(), rel=1e-5)


# ---- prepared calls -------------------------------------------------------------------------------------------------


def test_fixed_calls_repeat_the_plain_calls_bit_for_bit():
    sizes, n_ranks = [129, 7, 300], 3
    layout = block_layout(sizes, n_ranks)
    outputs = {}
    for form in ("plain", "fixed"):
        src = gradient_like(sizes)
        rows, shard = rows_for(layout), torch.empty(layout.rows_per_shard * fp4.ROW_BYTES, dtype=torch.uint8)
        received = torch.empty(n_ranks * shard.numel(), dtype=torch.uint8)
        residual, shard_residual = torch.zeros(src.numel()), torch.zeros(layout.rows_per_shard * 128)
        dst, stats, summed = torch.empty_like(src), torch.zeros(2), torch.empty(src.numel())
        all_rows = torch.cat([rows] * n_ranks)
        if form == "plain":
            calls = (lambda: blockscale.quantize_blocks(src, layout, rows, 0.5, fmt=FMT, residual=residual),
                     lambda: blockscale.reduce_blocks(received, n_ranks, shard, fmt=FMT, residual=shard_residual),
                     lambda: blockscale.dequantize_blocks(rows, layout, dst, fmt=FMT, stats=stats),
                     lambda: blockscale.sum_blocks(all_rows, n_ranks, layout, summed, fmt=FMT))
        else:
            calls = (blockscale.quantize_blocks.prepare(src, layout, rows, 0.5, fmt=FMT, residual=residual).fixed(
                         src, rows, residual),
                     blockscale.reduce_blocks.prepare(received, n_ranks, shard, fmt=FMT,
                                                      residual=shard_residual).fixed(received, shard, shard_residual),
                     blockscale.dequantize_blocks.prepare(rows, layout, dst, fmt=FMT, stats=stats).fixed(
                         rows, dst, stats),
                     blockscale.sum_blocks.prepare(all_rows, n_ranks, layout, summed, fmt=FMT).fixed(all_rows, summed))
        quantize, reduce, dequantize, sum_blocks = calls
        results = []
        for step in range(2):
            src.mul_(-0.5 if step else 1.0)  # the same buffers, new values: a fixed call must read them afresh
            quantize()
            received.copy_(rows[: shard.numel()].repeat(n_ranks))
            all_rows.copy_(rows.repeat(n_ranks))
            reduce()
            dequantize()
            sum_blocks()
            results += [t.clone() for t in (rows, shard, residual, shard_residual, dst, stats, summed)]
        outputs[form] = results
    assert_same(outputs["fixed"], outputs["plain"])
    assert outputs["plain"][5][0] > 0 and not torch.equal(outputs["plain"][4], outputs["plain"][11])


# ---- bad input ------------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_by_name():
    layout = block_layout([10], 1)
    rows = rows_for(layout)
    with pytest.raises(ValueError, match="wire format"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, fmt="float4")
    with pytest.raises(ValueError, match="wire format"):
        row_bytes(torch.int8)
    with pytest.raises(ValueError, match=r"rows has 132 elements, expected 68"):
        blockscale.quantize_blocks(torch.ones(10), layout, torch.zeros(132, dtype=torch.uint8), fmt=FMT)
    with pytest.raises(ValueError, match="src has 9 elements"):
        blockscale.quantize_blocks(torch.ones(9), layout, rows, fmt=FMT)
    with pytest.raises(ValueError, match="rows must be 4-byte aligned"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows_for(block_layout([200], 1))[2:2 + rows.numel()],
                                   fmt=FMT)
    with pytest.raises(TypeError, match="residual has dtype float16"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, fmt=FMT,
                                   residual=torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="scale must be finite"):
        blockscale.quantize_blocks(torch.ones(10), layout, rows, float("nan"), fmt=FMT)
    with pytest.raises(ValueError, match="out has 70 bytes, not whole 68-byte rows"):
        blockscale.reduce_blocks(rows, 1, torch.zeros(70, dtype=torch.uint8), fmt=FMT)
    with pytest.raises(ValueError, match="received has"):
        blockscale.reduce_blocks(rows, 2, rows.clone(), fmt=FMT)
    with pytest.raises(ValueError, match="residual has 100 elements"):
        blockscale.reduce_blocks(rows, 1, rows.clone(), fmt=FMT, residual=torch.zeros(100))
    with pytest.raises(ValueError, match="received"):
        blockscale.sum_blocks(rows, 2, layout, torch.empty(10), fmt=FMT)
    with pytest.raises(ValueError, match="stats"):
        blockscale.dequantize_blocks(rows, layout, torch.empty(10), fmt=FMT, stats=torch.empty(3))
    with pytest.raises(ValueError, match="rows has"):
        blockscale.dequantize_blocks.prepare(rows[:-4], layout, torch.empty(10), fmt=FMT)
