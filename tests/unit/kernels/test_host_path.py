"""A plain pack/unpack checks a layout once and keeps it: a repeat skips the checks, and a tensor changed since an
earlier call is refused as a fresh call would be, or read where it is now; so is a prepared call's. The torch path
from several threads at once.

Tier: no device. The kernels run in Triton's interpreter on CPU tensors (conftest.py). Triton's interpreter is not
thread-safe (it patches ``triton.language`` while a kernel runs), so the threaded tests run the torch path.
"""

import importlib
import threading

import pytest
import torch

from bits import assert_same_bits, reference_pack
from interpreter import interpreter_problem
from ddp_triton.kernels import pack, torch_path, unpack, uses_triton

pack_module = importlib.import_module("ddp_triton.kernels.pack")

pytestmark = pytest.mark.skipif(not uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")


def tensors_of(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


@pytest.mark.parametrize(
    "call, scale",
    [
        pytest.param(lambda ts, out: pack((t for t in ts), out, 0.5), 0.5, id="generator"),
        pytest.param(lambda ts, out: pack(ts, out, 1), 1.0, id="int-scale"),
        pytest.param(lambda ts, out: pack(ts + [torch.empty(0)], out, 0.5), 0.5, id="null-address"),
    ],
)
def test_a_generator_an_int_scale_and_an_empty_tensor_are_packed(call, scale):
    tensors = tensors_of([5, 7])
    out = torch.empty(12, dtype=torch.bfloat16)
    for _ in range(2):
        out.zero_()
        call(tensors, out)
        assert_same_bits(out, reference_pack(tensors, torch.bfloat16, scale))


# ---- a changed tensor is checked again ------------------------------------------------------------------------------


def _non_contiguous_in_place(tensors):
    tensors[1].as_strided_((4, 2), (1, 4))


def _other_dtype_view(tensors):
    tensors[1] = tensors[1].view(torch.float16)  # the very same memory


def _dtype_changed_through_data(tensors):
    tensors[1].data = tensors[1].view(torch.float16)  # same object, same address, no version bump


def _resized_in_place(tensors):
    tensors[1].resize_(4)


def _moved_to_meta(tensors):
    tensors[1] = torch.empty(8, dtype=tensors[1].dtype, device="meta")


def _made_sparse(tensors):
    tensors[1] = tensors[1].float().to_sparse()


@pytest.mark.parametrize(
    "change, error, words",
    [
        pytest.param(_non_contiguous_in_place, ValueError, "tensors\\[1\\] is not contiguous", id="as_strided_"),
        pytest.param(_other_dtype_view, TypeError, "mix dtypes", id="other-dtype-same-address"),
        pytest.param(_dtype_changed_through_data, TypeError, "mix dtypes", id="dtype-changed-through-data"),
        pytest.param(_resized_in_place, ValueError, "out has 16 elements but the tensors hold 12", id="resize_"),
        pytest.param(_moved_to_meta, ValueError, "tensors\\[1\\] is on meta", id="meta"),
        pytest.param(_made_sparse, TypeError, "layout", id="sparse"),
    ],
)
def test_changed_tensor_is_refused_as_a_fresh_call_would_be(change, error, words):
    tensors = tensors_of([8, 8], torch.bfloat16)
    out = torch.empty(16, dtype=torch.bfloat16)
    prepared = pack.prepare(tensors, out, 0.5)
    pack(tensors, out, 0.5)
    prepared(tensors, out)
    change(tensors)
    with pytest.raises(error, match=words):
        pack(tensors, out, 0.5)
    with pytest.raises((TypeError, ValueError), match=r"tensors\[1\] (is|must be|has layout)"):  # named
        prepared(tensors, out)


def test_tensor_set_to_other_memory_is_read_there():
    tensors = tensors_of([6, 9])
    out = torch.empty(15, dtype=torch.bfloat16)
    prepared = pack.prepare(tensors, out, 0.5)
    pack(tensors, out, 0.5)
    prepared(tensors, out)
    replacement = torch.randn(9)
    tensors[1].set_(replacement.untyped_storage(), 0, (9,), (1,))
    for run in (pack, prepared):
        out.zero_()
        run(tensors, out, 0.5) if run is pack else run(tensors, out)
        assert_same_bits(out, reference_pack([tensors[0], replacement], torch.bfloat16, 0.5))


def test_freed_and_replaced_tensors_are_packed_as_they_are_now():
    tensors = tensors_of([6, 9])
    out = torch.empty(15, dtype=torch.bfloat16)
    prepared = pack.prepare(tensors, out, 0.5)
    pack(tensors, out, 0.5)
    prepared(tensors, out)
    for i in range(len(tensors)):  # freed; the allocator may well give the replacement the same address
        tensors[i] = None
        tensors[i] = torch.randn(6 if i == 0 else 9, dtype=torch.float32)
    for run in (pack, prepared):
        out.zero_()
        run(tensors, out, 0.5) if run is pack else run(tensors, out)
        assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))


def test_a_seen_layout_at_new_addresses_still_refuses_an_overlap():
    """A repeat of a layout skips the checks its signature covers, not the overlap check: addresses change."""
    pack(tensors_of([6, 9]), torch.empty(15), 0.5)
    shared = torch.randn(24)
    with pytest.raises(ValueError, match="overlaps tensors\\[1\\]"):
        pack([shared[:6], shared[6:15]], shared[9:], 0.5)  # float32 15 into 15: the same layout as above


def test_a_repeat_plain_call_checks_once_and_gives_each_calls_bits(monkeypatch):
    """A plain call of a layout seen before skips the full checks (the layout's signature covers what they read),
    and packs and unpacks the tensors it is given now, at the same addresses or new ones."""
    checks = []
    real_check = pack_module.check_tensor_list
    monkeypatch.setattr(pack_module, "check_tensor_list", lambda *a: checks.append(1) or real_check(*a))
    first, second = tensors_of([6, 9, 1], seed=1), tensors_of([6, 9, 1], seed=2)
    out = torch.empty(16, dtype=torch.bfloat16)
    back = [torch.empty(6), torch.empty(9), torch.empty(1)]
    for tensors in (first, first, second, first):
        pack(tensors, out, 0.5)
        assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))
        unpack(out, back, 2.0)
        assert_same_bits(torch.cat(back), out.float().mul(2.0))
    assert len(checks) == 2  # one pack layout and one unpack layout


def test_out_viewed_with_another_dtype_of_the_same_size():
    tensors = tensors_of([6, 9])
    out = torch.empty(15, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    as_half = out.view(torch.float16)
    pack(tensors, as_half, 0.5)
    assert_same_bits(as_half, reference_pack(tensors, torch.float16, 0.5))


def test_out_reshaped_is_refused():
    tensors = tensors_of([6, 10])
    out = torch.empty(16, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    with pytest.raises(ValueError, match="1-D"):
        pack(tensors, out.view(4, 4), 0.5)


def test_negative_zero_scale_after_a_positive_zero():
    """-0.0 and 0.0 are equal floats but scale to different bits: a pack at -0.0 after one at 0.0 writes what a
    first call at -0.0 writes. (Compared with that first call, not with -0.0: Triton 3.8's interpreter folds a float
    argument of -0.0 into +0.0, which the compiled kernel, taking the scale at run time, does not.)"""
    tensors = [torch.full((8,), 3.0)]
    out = torch.empty(8, dtype=torch.bfloat16)
    pack(tensors, out, -0.0)
    first_at_negative_zero = out.clone()
    pack(tensors, out, 0.0)
    assert not torch.signbit(out.float()).any()
    pack(tensors, out, -0.0)
    assert_same_bits(out, first_at_negative_zero)


def test_stats_are_checked_at_every_call():
    flat = torch.randn(12)
    tensors = [torch.empty(5), torch.empty(7)]
    unpack(flat, tensors, 2.0, stats=torch.zeros(2))
    with pytest.raises(ValueError, match="stats must be a float32 tensor of shape"):
        unpack(flat, tensors, 2.0, stats=torch.zeros(3))
    with pytest.raises(ValueError, match="stats is on meta"):
        unpack(flat, tensors, 2.0, stats=torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="stats must be contiguous"):
        unpack(flat, tensors, 2.0, stats=torch.zeros(4)[::2])


# ---- the torch path from threads, and its chunks --------------------------------------------------------------------


def _in_threads(work, n_threads):
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_threads_pack_correct_bits_on_the_torch_path(monkeypatch, dtype):
    monkeypatch.setattr(pack_module, "uses_triton", lambda device: False)

    def work(i):
        tensors = tensors_of([2 + i, 9, 4], dtype, seed=i)
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16)
        back = [torch.empty_like(t) for t in tensors]
        for step in range(40):
            for t in tensors:
                t.add_(1)
            pack(tensors, flat, 0.5)
            assert_same_bits(flat, reference_pack(tensors, torch.bfloat16, 0.5))
            unpack(flat, back, 2.0)
            assert_same_bits(torch.cat(back), flat.float().mul(2.0).to(dtype))

    _in_threads(work, 4)


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32-bf16", "fp32-fp16", "fp16-fp32", "bf16-bf16"])
def test_torch_path_scales_through_float32_chunks_with_one_rounding(src_dtype, dst_dtype):
    """The CPU path's product goes through a float32 scratch buffer, chunk by chunk (CHUNK elements): across chunk
    boundaries and a short last chunk, the bits are still the float32 product rounded once."""
    n = 2 * torch_path.CHUNK + 17
    src = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e3).to(src_dtype)
    out = torch.empty(n, dtype=dst_dtype)
    for canonical in (True, False):
        torch_path.pack_pass([src], out, 0.3, canonical)()
        assert_same_bits(out, reference_pack([src], dst_dtype, 0.3))
    back = torch.empty(n, dtype=src_dtype)
    torch_path.unpack_pass(out, [back], 1 / 3, None)()
    assert_same_bits(back, (out.float() * (1 / 3)).to(src_dtype))
