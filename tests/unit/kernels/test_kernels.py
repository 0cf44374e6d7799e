"""pack / unpack: bit-exactness, layouts, in-place use and bad input.

Tier: no device. The Triton kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
conftest.py), and the plain-torch CPU path is checked against the same reference and against the kernel, bit for bit.
The compiled kernel's bits on CUDA are checked in test_gpu.py.
"""

import math

import pytest
import torch

from bits import DTYPE_IDS, DTYPES, EDGE_FLOAT32, assert_same_bits, bits, random_bit_patterns, reference_pack
from interpreter import interpreter_problem
from ddp_triton.kernels import pack, torch_path, unpack, uses_triton
from ddp_triton.kernels.worklist import build_plan, segments


SHAPES = [
    pytest.param([], id="no-tensors"),
    pytest.param([(0,)], id="zero-size"),
    pytest.param([(1,)], id="one-element"),
    pytest.param([(7,), (13, 3), (0,), (31,)], id="odd-primes"),
    pytest.param([(2049,), (4097,)], id="not-a-multiple-of-block"),
    pytest.param([(1 + i % 5,) for i in range(300)], id="300-tiny"),
    pytest.param([(3,), (40000,), (2, 5)], id="one-much-larger"),
]

pytestmark = pytest.mark.skipif(not uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")


def make(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).mul(3).to(dtype) for s in shapes]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_matches_reference_bits(src_dtype, out_dtype, shapes):
    tensors = make(shapes, src_dtype)
    expected = reference_pack(tensors, out_dtype, 1 / 8)
    for run in (pack, lambda ts, o, s: torch_path.pack_pass(ts, o, s)()):
        out = torch.full((expected.numel(),), 7.0, dtype=out_dtype)
        result = run(tensors, out, 1 / 8)
        assert result is None or result is out
        assert_same_bits(out, expected)


@pytest.mark.parametrize("scale", [1 / n for n in range(1, 9)] + [3.0, 1e-3, 0.1, 1e30, 0.0, -0.5])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_every_scale_and_bit_pattern(src_dtype, out_dtype, scale):
    edges = EDGE_FLOAT32.to(src_dtype)
    tensors = [random_bit_patterns(3000, src_dtype), edges, random_bit_patterns(517, src_dtype, seed=1)]
    expected = reference_pack(tensors, out_dtype, scale)
    out = torch.empty(expected.numel(), dtype=out_dtype)
    pack(tensors, out, scale)
    assert_same_bits(out, expected)
    torch_out = torch.empty_like(out)
    torch_path.pack_pass(tensors, torch_out, scale)()
    assert torch.equal(bits(torch_out), bits(out)), "torch path and Triton kernel differ, NaN bits included"


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=DTYPE_IDS)
def test_unpack_matches_reference_bits(flat_dtype, dst_dtype, shapes):
    total = sum(math.prod(s) for s in shapes)
    flat = torch.cat([EDGE_FLOAT32.to(flat_dtype), random_bit_patterns(total, flat_dtype)])[:total].contiguous()
    for run in (unpack, lambda f, ts, s: torch_path.unpack_pass(f, ts, s, None)()):
        tensors = [torch.full(s, 5.0, dtype=dst_dtype) for s in shapes]
        run(flat, tensors, 0.25)
        position = 0
        for t in tensors:
            n = t.numel()
            expected = flat[position : position + n].float().mul(0.25).to(dst_dtype).view(t.shape)
            assert_same_bits(t, expected)
            position += n


@pytest.mark.parametrize("comm_dtype", DTYPES, ids=DTYPE_IDS)
def test_round_trip_through_a_bucket(comm_dtype):
    grads = make([(1000,), (3, 7), (1,)], torch.float32, seed=3)
    flat = torch.empty(sum(g.numel() for g in grads), dtype=comm_dtype)
    pack(grads, flat, 0.5)
    back = [torch.empty_like(g) for g in grads]
    unpack(flat, back, 2.0)
    for g, b in zip(grads, back):
        assert_same_bits(b, g.mul(0.5).to(comm_dtype).float().mul(2.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_in_place_on_bucket_views(dtype):
    """DDP's bucket views are neighbours in one buffer: packing the buffer into itself scales in place."""
    buffer = torch.randn(5000).to(dtype)
    original = buffer.clone()
    views = [buffer[0:1000].view(10, 100), buffer[1000:1001], buffer[1001:5000]]
    pack(views, buffer, 1 / 3)
    assert_same_bits(buffer, original.float().mul(1 / 3).to(dtype))
    unpack(buffer, views, 3.0)
    assert_same_bits(buffer, original.float().mul(1 / 3).to(dtype).float().mul(3.0).to(dtype))


def test_neighbouring_views_become_one_segment():
    buffer = torch.zeros(10000)
    views = [buffer[:100], buffer[100:4000], buffer[4000:]]
    assert segments(views) == [(buffer.data_ptr(), 10000)]
    scattered = [torch.zeros(100), torch.zeros(5)]
    assert len(segments(scattered)) == 2
    plan = build_plan(views, torch.empty(10000, dtype=torch.bfloat16), True, torch.device("cpu"))
    assert plan.table is None, "one run takes the contiguous kernel, with no table"
    assert plan.n_items == math.ceil(10000 / plan.block)
    plan = build_plan(scattered, torch.empty(105), True, torch.device("cpu"))
    assert plan.table is not None and plan.n_items == 2


class _FakeTensor:
    """Address and size only: enough to plan a layout too large to allocate here."""

    def __init__(self, ptr, numel, element_size=2):
        self._ptr, self._numel, self._element_size = ptr, numel, element_size

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def element_size(self):
        return self._element_size


def test_work_list_offsets_are_64_bit():
    n = 2**31 + 4096 * 3 + 5  # more elements than an int32 can index
    base = 1 << 40
    tensors = [_FakeTensor(base, 16), _FakeTensor(base + 2**33, n)]
    plan = build_plan(tensors, _FakeTensor(1 << 44, n + 16), True, torch.device("cpu"))
    table = plan.table
    assert table.dtype == torch.int64
    assert int(table[:, 2].sum()) == n + 16
    last = table[-1]
    assert int(last[0]) + int(last[2]) == 2**33 // 2 + n  # source offset in elements past 2**31
    assert int(last[1]) + int(last[2]) == n + 16


@pytest.mark.parametrize("layout", ["two-tensors", "one-bucket"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_unpack_stats_sum_of_squares_and_nonfinite(path, layout):
    def run(flat, tensors, scale, stats):
        if path == "kernel":
            unpack(flat, tensors, scale, stats=stats)
        else:
            torch_path.unpack_pass(flat, tensors, scale, stats)()

    flat = torch.randn(9000, dtype=torch.float32)
    if layout == "two-tensors":  # the work-list kernel
        tensors = [torch.empty(4000, dtype=torch.bfloat16), torch.empty(5000, dtype=torch.bfloat16)]
    else:  # views of one buffer: the contiguous kernel
        bucket = torch.empty(9000, dtype=torch.bfloat16)
        tensors = [bucket[:4000], bucket[4000:]]
    stats = torch.full((2,), -1.0)
    run(flat, tensors, 0.5, stats)
    expected = torch.cat(tensors).double().square().sum()  # of the values stored, after rounding
    # float32 accumulation of 9000 positive terms: relative error far below 1e-5
    assert float(stats[0]) == pytest.approx(float(expected), rel=1e-5)
    assert float(stats[1]) == 0.0

    flat[[5, 100, 8000]] = torch.tensor([math.inf, math.nan, -math.inf])
    run(flat, tensors, 0.5, stats)
    assert float(stats[1]) == 3.0
    assert not math.isfinite(float(stats[0]))


def test_fixed_prepared_call_repeats_with_new_values():
    grads = make([(300,), (70,)], torch.float32)
    flat = torch.empty(370, dtype=torch.bfloat16)
    again = pack.prepare(grads, flat, 0.5).fixed(grads, flat)
    again()
    assert_same_bits(flat, reference_pack(grads, torch.bfloat16, 0.5))
    for g in grads:
        g.mul_(-3)
    again()
    assert_same_bits(flat, reference_pack(grads, torch.bfloat16, 0.5))
    back = [torch.empty_like(g) for g in grads]
    unpack.prepare(flat, back, 2.0).fixed(flat, back, None)()
    assert_same_bits(torch.cat(back), flat.float().mul(2.0))


# ---- bad input --------------------------------------------------------------------------------------------------


def _out(n=10, dtype=torch.bfloat16):
    return torch.empty(n, dtype=dtype)


@pytest.mark.parametrize(
    "tensors, out, scale, error, words",
    [
        pytest.param([torch.zeros(10, dtype=torch.float64)], _out(), 1.0, TypeError, "float64", id="float64-source"),
        pytest.param([torch.zeros(10, dtype=torch.int32)], _out(), 1.0, TypeError, "int32", id="int-source"),
        pytest.param([torch.zeros(10)], _out(dtype=torch.float64), 1.0, TypeError, "out has dtype", id="float64-out"),
        pytest.param([torch.zeros(5), torch.zeros(5, dtype=torch.float16)], _out(), 1.0, TypeError, "mix dtypes",
                     id="mixed-dtypes"),
        pytest.param([torch.zeros(5), torch.zeros(5, device="meta")], _out(), 1.0, ValueError,
                     r"tensors\[1\] is on meta", id="mixed-devices"),
        pytest.param([torch.zeros(5, device="meta")], torch.empty(5, dtype=torch.bfloat16, device="meta"), 1.0,
                     ValueError, r"tensors\[0\] is on meta; the kernels convert CPU or CUDA", id="all-on-meta"),
        pytest.param([torch.zeros(10)], torch.empty(10, dtype=torch.bfloat16, device="meta"), 1.0, ValueError,
                     "out is on meta", id="out-elsewhere"),
        pytest.param([torch.zeros(10)], _out(11), 1.0, ValueError, "11 elements", id="out-too-big"),
        pytest.param([torch.zeros(10)], _out(9), 1.0, ValueError, "9 elements", id="out-too-small"),
        pytest.param([torch.zeros(10)], torch.empty(2, 5, dtype=torch.bfloat16), 1.0, ValueError, "1-D",
                     id="out-2d"),
        pytest.param([torch.zeros(10)], torch.empty(20, dtype=torch.bfloat16)[::2], 1.0, ValueError, "contiguous",
                     id="out-strided"),
        pytest.param([torch.zeros(4, 5).t()], _out(20), 1.0, ValueError, "not contiguous", id="source-transposed"),
        pytest.param([torch.zeros(10).to_sparse()], _out(), 1.0, TypeError, "layout", id="sparse-source"),
        pytest.param(torch.zeros(10), _out(), 1.0, TypeError, "list or tuple", id="bare-tensor"),
        pytest.param([[1.0, 2.0]], _out(2), 1.0, TypeError, "not a tensor", id="python-list"),
        pytest.param([torch.zeros(10)], _out(), math.nan, ValueError, "finite", id="nan-scale"),
        pytest.param([torch.zeros(10)], _out(), torch.tensor(0.5), TypeError, "Python float", id="tensor-scale"),
        pytest.param([torch.zeros(10)], "out", 1.0, TypeError, "must be a tensor", id="out-not-tensor"),
    ],
)
def test_pack_rejects_bad_input(tensors, out, scale, error, words):
    with pytest.raises(error, match=words):
        pack(tensors, out, scale)


def test_pack_refuses_partial_overlap():
    buffer = torch.zeros(100)
    with pytest.raises(ValueError, match="overlaps tensors\\[0\\]"):
        pack([buffer[10:60]], buffer[0:50], 0.5)
    with pytest.raises(ValueError, match="overlaps"):
        pack([buffer[:50]], buffer.view(torch.bfloat16)[:50], 1.0)  # same bytes, other dtype: not in place


def test_unpack_refuses_overlapping_destinations():
    buffer = torch.zeros(100)
    with pytest.raises(ValueError, match="overlap in memory"):
        unpack(torch.zeros(80), [buffer[:40], buffer[30:70]], 1.0)


def test_unpack_rejects_bad_stats():
    with pytest.raises(ValueError, match="stats"):
        unpack(torch.zeros(10), [torch.zeros(10)], 1.0, stats=torch.zeros(3))
