"""Error feedback with a bfloat16 residual: quantize and reduce in block-scaled FP8 (E4M3) and E2M1.

Tier: no device. Every path a CPU tensor can take gives the same bits: the Triton kernels in Triton's interpreter
(conftest.py sets TRITON_INTERPRET=1; ``blockscale``'s launchers), the compiled passes (``blockscale_cpu.c``) and
the torch passes (``torch_wire``, ``torch_fp4``). Each equals the reference written apart
(``wire_reference.error_feedback``): the residual widened to float32 and added, what is left computed in float32 as
for a float32 residual, then rounded once by torch's ``.to(torch.bfloat16)``. The values are built so that what is
left lands on bfloat16 ties, rounding both down and up to the even neighbour; a block made non-finite by its values
or by a NaN residual resets its residual to +0.
"""

import math

import pytest
import torch

from bits import assert_same_bits
from interpreter import interpreter_problem
from wire_reference import error_feedback, fp4_rows, is_fp4
from ddp_triton.kernels import FP4_E2M1, blockscale, cpu_fp4, cpu_fp8, fp8, native_cpu, row_bytes, uses_triton
from ddp_triton.kernels.blocks import block_layout

FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(FP4_E2M1, id="e2m1")]
_TRITON = uses_triton(torch.device("cpu")) and interpreter_problem() is None
#: Where the interpreter is not usable here, the CPU passes are still compared with each other and the reference.
PATHS = ["compiled", "torch"] + (["triton"] if _TRITON else [])
#: Residual bits a non-finite block leaves: +0.
ZERO = 0


def tie_values(n):
    """(x, r) of n elements: x = +-(1 + s) with s in 2^-10 * {1, 1.5, 2, 3}, r (bfloat16) = +-2^-18 * {1, 3} of the
    same sign. x + r is exact in float32 and is sent as +-1 in both formats (E4M3's step there is 1/8, E2M1's group
    scale makes it 4 of {4, 6}); what is left, s + r, is a bfloat16 tie where s < 2^-9: rounded down to the even
    neighbour with 2^-18, up with 3 * 2^-18."""
    i = torch.arange(n)
    sign = torch.where(i % 3 == 0, -1.0, 1.0)
    s = torch.tensor([1.0, 1.5, 2.0, 3.0])[(i // 2) % 4] * 2.0**-10
    r = torch.tensor([1.0, 3.0])[i % 2] * 2.0**-18
    return sign * (1.0 + s), (sign * r).to(torch.bfloat16)


def assert_ties_both_ways(left):
    """``left`` (float32) holds bfloat16 ties, some with an even and some with an odd last kept bit."""
    bits = left.view(torch.int32)
    tie = (bits & 0xFFFF) == 0x8000
    odd = (bits >> 16) & 1 == 1
    assert (tie & odd).sum() >= 16 and (tie & ~odd).sum() >= 16


def use_path(path, monkeypatch, fmt):
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "0" if path == "torch" else "1")
    if path == "compiled":
        if native_cpu.library() is None:
            pytest.skip("no C compiler builds the compiled passes here")
        # Built but refused by its self-check (it warns): the torch passes would stand in unseen.
        taken = cpu_fp4.cpu_fp4_passes() if is_fp4(fmt) else cpu_fp8.cpu_fp8_passes(fp8.FORMATS[fmt])
        assert taken == "compiled"


def quantize(path, fmt, src, layout, rows, scale, residual):
    if path == "triton":
        blockscale.quantize_blocks(src, layout, rows, scale, fmt=fmt, residual=residual)
    elif is_fp4(fmt):
        cpu_fp4.quantize_pass(src, layout, rows, scale, residual)()
    else:
        cpu_fp8.quantize_pass(src, layout, rows, scale, fp8.FORMATS[fmt], residual)()


def reduce(path, fmt, received, n_ranks, out, residual):
    if path == "triton":
        blockscale.reduce_blocks(received, n_ranks, out, fmt=fmt, residual=residual)
    elif is_fp4(fmt):
        cpu_fp4.reduce_pass(received, n_ranks, out, residual)()
    else:
        cpu_fp8.reduce_pass(received, n_ranks, out, fp8.FORMATS[fmt], residual)()


def decoded(rows, n, fmt):
    """The float32 values of ``n`` elements' rows (one tensor), through the plain dequantize."""
    out = torch.empty(n)
    blockscale.dequantize_blocks(rows, block_layout([n], 1), out, fmt=fmt)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.5], ids=["unscaled", "scaled"])
def test_quantize_rounds_the_residual_once_on_every_path(monkeypatch, fmt, scale):
    sizes = [3 * 128, 77, 133]  # whole blocks, then short ones
    layout = block_layout(sizes, 2)
    x, r = tie_values(layout.n_elements)
    x = x / scale  # exact: x * scale gives back the tie values
    x[128 + 3] = math.inf  # block 1 is not finite through its values...
    r[256 + 7] = math.nan  # ...block 2 through its residual
    tiny = torch.randn(77, generator=torch.Generator().manual_seed(0)) * 2.0**-128
    x[384:461], r[384:461] = 0.0, tiny.to(torch.bfloat16)  # the second tensor: bfloat16 subnormals, widened exactly
    results = {}
    for path in PATHS:
        use_path(path, monkeypatch, fmt)
        rows = torch.full((layout.n_rows * row_bytes(fmt),), 0xAB, dtype=torch.uint8)
        residual = r.clone()
        quantize(path, fmt, x, layout, rows, scale, residual)
        results[path] = rows, residual
    rows, residual = results[PATHS[0]]
    for path in PATHS[1:]:
        assert torch.equal(results[path][0], rows), path
        assert torch.equal(results[path][1].view(torch.int16), residual.view(torch.int16)), path
    value = x * scale + r.float()
    sent, left = zip(*(error_feedback(part, fmt) for part in value.split(sizes)))
    sent, left = torch.cat(sent), torch.cat(left)
    assert_ties_both_ways(left)
    assert torch.equal(residual.view(torch.int16), left.to(torch.bfloat16).view(torch.int16))
    assert (residual[128:384].view(torch.int16) == ZERO).all()
    got = torch.empty(layout.n_elements)
    blockscale.dequantize_blocks(rows, layout, got, fmt=fmt)
    assert_same_bits(got, sent)


def fp8_row(block, fmt):
    """One FP8 row from its definition: codes ``block / 2^k`` by torch's rounding (exact for the values used
    here), then the scale 2^k as float32; NaN codes and scale 1 for a non-finite block."""
    if not torch.isfinite(block).all():
        codes, scale = torch.full((128,), fp8.NAN_CODE, dtype=torch.uint8), 1.0
    else:
        absmax = block.abs().max().item()
        scale = 2.0 ** math.floor(math.log2(absmax)) if absmax > 0 else 1.0
        codes = (block / scale).to(fmt).view(torch.uint8)
    return torch.cat([codes, torch.tensor([scale], dtype=torch.float32).view(torch.uint8)])


def rows_of(values, fmt):
    """The rows of whole blocks of exactly representable ``values``, written from the format's definition."""
    if is_fp4(fmt):
        rows, _ = fp4_rows(values, [128] * (values.numel() // 128))
        return torch.tensor(list(b"".join(rows)), dtype=torch.uint8)
    return torch.cat([fp8_row(block, fmt) for block in values.view(-1, 128)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reduce_rounds_the_residual_once_on_every_path(monkeypatch, fmt):
    per_rank, n_ranks = 5, 3
    n = per_rank * 128
    ties, r = tie_values(n)
    ones = torch.where(ties < 0, -1.0, 1.0)
    ranks = [ones, ties - ones, torch.zeros(n)]  # each exact in either format; their sum in rank order is ties
    ranks[2][2 * 128 + 9] = math.inf  # row 2 comes from rank 2 as a non-finite block
    r[3 * 128 + 1] = math.nan  # row 3's residual makes it non-finite
    ones[4 * 128:] = ranks[1][4 * 128:] = 0.0  # row 4: the residual alone, subnormals among it
    r[4 * 128:] = (torch.randn(128, generator=torch.Generator().manual_seed(1)) * 2.0**-128).to(torch.bfloat16)
    received = torch.cat([rows_of(v, fmt) for v in ranks])
    results = {}
    for path in PATHS:
        use_path(path, monkeypatch, fmt)
        out = torch.full((per_rank * row_bytes(fmt),), 0xCD, dtype=torch.uint8)
        residual = r.clone()
        reduce(path, fmt, received, n_ranks, out, residual)
        results[path] = out, residual
    out, residual = results[PATHS[0]]
    for path in PATHS[1:]:
        assert torch.equal(results[path][0], out), path
        assert torch.equal(results[path][1].view(torch.int16), residual.view(torch.int16)), path
    total = torch.zeros(n)
    for values in ranks:
        total = total + values  # float32, in rank order from +0 (what each rank's row decodes to)
    total = total + r.float()
    sent, left = error_feedback(total, fmt)
    assert_ties_both_ways(left)
    assert torch.equal(residual.view(torch.int16), left.to(torch.bfloat16).view(torch.int16))
    assert (residual[2 * 128:4 * 128].view(torch.int16) == ZERO).all()
    assert_same_bits(decoded(out, n, fmt), sent)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prepared_calls_fix_the_residuals_dtype(fmt):
    sizes = [200, 56]
    layout = block_layout(sizes, 2)
    x, r = tie_values(layout.n_elements)
    rows = torch.zeros(layout.n_rows * row_bytes(fmt), dtype=torch.uint8)
    shard = torch.zeros(layout.rows_per_shard * row_bytes(fmt), dtype=torch.uint8)
    shard_residual = r[: layout.rows_per_shard * 128].clone()
    plain_rows, plain_shard = rows.clone(), shard.clone()
    plain_residual, plain_shard_residual = r.clone(), shard_residual.clone()
    blockscale.quantize_blocks(x, layout, plain_rows, 0.5, fmt=fmt, residual=plain_residual)
    blockscale.reduce_blocks(plain_rows, 2, plain_shard, fmt=fmt, residual=plain_shard_residual)
    residual = r.clone()
    quantize_call = blockscale.quantize_blocks.prepare(x, layout, rows, 0.5, fmt=fmt, residual=residual)
    quantize_call.fixed(x, rows, residual)()
    reduce_call = blockscale.reduce_blocks.prepare(rows, 2, shard, fmt=fmt, residual=shard_residual)
    reduce_call(rows, shard, shard_residual)
    assert torch.equal(rows, plain_rows) and torch.equal(shard, plain_shard)
    assert torch.equal(residual.view(torch.int16), plain_residual.view(torch.int16))
    assert torch.equal(shard_residual.view(torch.int16), plain_shard_residual.view(torch.int16))
    with pytest.raises(ValueError, match="residual is float32 .* prepared for bfloat16"):
        quantize_call(x, rows, r.float())
    with pytest.raises(ValueError, match="residual is bfloat16 .* prepared for float32"):
        blockscale.reduce_blocks.prepare(rows, 2, shard, fmt=fmt, residual=shard_residual.float()).fixed(
            rows, shard, shard_residual)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad, error, message", [
    pytest.param(torch.zeros(256, dtype=torch.float16), TypeError,
                 "residual has dtype float16; supported dtypes are float32, bfloat16", id="float16"),
    pytest.param(torch.zeros(256, dtype=torch.float64), TypeError, "residual has dtype float64", id="float64"),
    pytest.param(torch.zeros(255, dtype=torch.bfloat16), ValueError, "residual has 255 elements, expected 256",
                 id="short"),
    pytest.param(torch.zeros(2, 128, dtype=torch.bfloat16), ValueError, "residual must be 1-D", id="2-d"),
    pytest.param(torch.zeros(256, dtype=torch.bfloat16, device="meta"), ValueError, "residual is on meta",
                 id="meta")])
def test_a_residual_of_another_dtype_size_or_device_is_refused_before_anything_is_written(fmt, bad, error,
                                                                                          message):
    layout = block_layout([256], 1)
    rows = torch.full((layout.n_rows * row_bytes(fmt),), 0xAB, dtype=torch.uint8)
    with pytest.raises(error, match=message):
        blockscale.quantize_blocks(torch.ones(256), layout, rows, fmt=fmt, residual=bad)
    with pytest.raises(error, match=message):
        blockscale.quantize_blocks.prepare(torch.ones(256), layout, rows, fmt=fmt, residual=bad)
    received = torch.zeros(2 * row_bytes(fmt), dtype=torch.uint8)
    with pytest.raises(error, match=message):
        blockscale.reduce_blocks(received, 1, rows, fmt=fmt, residual=bad)
    assert (rows == 0xAB).all()
