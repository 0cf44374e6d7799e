"""Where a bucket is cut into chunks (``runtime/chunks.py``): on block boundaries, every part at the same targets.

Tier: no process group."""

import pytest

from ddp_triton import kernels
from ddp_triton.runtime.chunks import (CHUNK_BYTES_ENV, boundaries, chunk_bytes_setting, chunk_count, cuts,
                                       element_boundaries, pieces_within)
from ddp_triton.formats import WireFormat
from ddp_triton.machine import cost_model as cm


def _blocks(sizes, start, end):
    """The (start, length) of each block of the part [start, end) of a bucket of tensors of ``sizes``."""
    layout = kernels.block_layout(pieces_within(sizes, start, end), 1)
    return [tuple(row) for row in layout.table[: layout.n_blocks].tolist()]


@pytest.mark.parametrize("sizes, parts, count", [
    pytest.param((1850, 37, 1517, 41, 328, 8), 2, 10, id="odd-sizes"),
    pytest.param((8, 328, 41, 1517, 37, 1850), 2, 10, id="odd-sizes-reversed"),
    pytest.param((4096,), 2, 3, id="one-tensor"),
    pytest.param((5, 7, 300, 1, 1, 999), 3, 7, id="three-parts"),
    pytest.param((36,), 2, 4, id="smaller-than-a-part"),
    pytest.param((131,), 1, 64, id="more-chunks-than-blocks"),
])
def test_every_chunk_holds_whole_blocks_of_its_part(sizes, parts, count):
    n = sum(sizes)
    part = -(-(-(-n // 128)) // parts) * 128
    lengths = [min(n, (j + 1) * part) - min(n, j * part) for j in range(parts)]
    allowed = [boundaries(kernels.block_layout(pieces_within(sizes, j * part, j * part + length), 1))
               for j, length in enumerate(lengths)]
    offsets, slots = cuts(allowed, part, count)
    assert 1 <= len(slots) <= count and sum(slots) >= part
    for j, c in enumerate(offsets):
        assert c[0] == 0 and c[-1] == lengths[j] and c == sorted(c) and len(c) == len(slots) + 1
        # The part's blocks, chunk by chunk: exactly the blocks of the whole part, in order.
        whole = _blocks(sizes, j * part, j * part + lengths[j])
        cut = [(a + s, length) for a, b in zip(c, c[1:]) for s, length in _blocks(sizes, j * part + a, j * part + b)]
        assert cut == whole
        assert all(b - a <= slot for a, b, slot in zip(c, c[1:], slots))
    assert all(any(c[k + 1] > c[k] for c in offsets) for k in range(len(slots)))  # no chunk empty everywhere


def test_one_chunk_is_the_unchunked_part():
    offsets, slots = cuts([element_boundaries(1000), element_boundaries(24)], 1024, 1)
    assert offsets == [[0, 1000], [0, 24]] and slots == [1024]


def test_the_setting():
    assert chunk_bytes_setting({}) is None
    assert chunk_bytes_setting({CHUNK_BYTES_ENV: " 4096 "}) == 4096
    for bad in ("1k", "-1", "1.5"):
        with pytest.raises(ValueError, match=f"{CHUNK_BYTES_ENV} must be a whole number of bytes"):
            chunk_bytes_setting({CHUNK_BYTES_ENV: bad})
    fp8 = WireFormat.parse("two-level fp8e4m3+ef")
    assert chunk_count(1 << 20, 4, fp8, 2, 2, False, 0) == 1
    assert chunk_count(1 << 20, 4, fp8, 2, 2, False, 1 << 20) == 4
    assert chunk_count(1 << 20, 4, fp8, 2, 2, True, None) == 1  # CUDA: no in-node rate known here
    assert chunk_count(1 << 18, 4, fp8, 2, 2, False, None) == 1  # 1 MiB: under the floor
    assert chunk_count(25 << 18, 4, fp8, 2, 2, False, None) > 1


def test_the_cost_models_chunks_only_where_the_sums_do_not_depend_on_an_elements_place():
    """gloo's (and NCCL's) all-reduce adds an element's ranks in an order that depends on its place in the buffer,
    which chunks change: over 3 or more ranks the bits would differ from whole buckets', so the default keeps whole
    buckets there. A reduce-scatter, a sum of two values and the sharded formats' float32 sums in rank order do not
    depend on it. The setting, which the user names, still cuts."""
    big = 25 << 18  # 25 MiB of float32: chunked where chunks are bit-identical
    bf16, fp8 = WireFormat.parse("two-level bf16"), WireFormat.parse("two-level fp8e4m3+ef")
    assert chunk_count(big, 4, bf16, 2, 2, False, None) > 1  # 2 nodes: the cross all-reduce adds two values
    assert chunk_count(big, 4, bf16, 2, 3, False, None) == 1  # 3 nodes: a cross all-reduce of three
    assert chunk_count(big, 4, fp8, 2, 3, False, None) > 1  # FP8 between nodes: all-to-all, sums in rank order
    assert chunk_count(big, 4, fp8, 3, 2, False, None, node_reduce_scatter=True) > 1
    assert chunk_count(big, 4, fp8, 3, 2, False, None, node_reduce_scatter=False) == 1  # a node all-reduce of three
    assert chunk_count(big, 4, bf16, 2, 3, False, 1 << 20) == 25  # the setting
    assert chunk_count(big, 4, bf16, 2, 2, False, 1024) == cm.MAX_CHUNKS  # a tiny setting: no 25,600 chunks
    assert chunk_count(big, 4, WireFormat.parse("fp8e4m3+ef"), 1, 4, False, None) > 1  # flat FP8
