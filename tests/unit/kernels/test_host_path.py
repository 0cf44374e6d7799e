"""Plain pack/unpack check a layout once: a repeat call skips the checks, a changed tensor is checked again.

Tier: no device. The kernels run in Triton's interpreter on CPU tensors (conftest.py). Where a test needs the CUDA
path's direct launch, a recording stub stands in for it. Triton's interpreter is not thread-safe (it patches
``triton.language`` while a kernel runs), so the threaded tests run the torch path and the stubbed direct launch.
"""

import functools
import gc
import importlib
import threading
import weakref
from collections import defaultdict

import pytest
import torch

from bits import assert_same_bits, reference_pack
from interpreter import interpreter_problem
from ddp_triton.kernels import pack, torch_path, unpack, uses_triton
from ddp_triton.kernels.layouts import LayoutCache, signature

pack_module = importlib.import_module("ddp_triton.kernels.pack")

pytestmark = pytest.mark.skipif(not uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")


@pytest.fixture(autouse=True)
def fresh_layouts():
    pack_module.LAYOUTS.clear()
    yield
    pack_module.LAYOUTS.clear()


@pytest.fixture
def full_checks(monkeypatch):
    """How many calls ran the full checks (the tensor list's is the first of them)."""
    count = [0]
    original = pack_module.check_tensor_list

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(pack_module, "check_tensor_list", counting)
    return count


def tensors_of(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


def packed(tensors, out_dtype=torch.bfloat16, scale=0.5):
    out = torch.empty(sum(t.numel() for t in tensors), dtype=out_dtype)
    pack(tensors, out, scale)
    return out


# ---- a repeat call skips the checks --------------------------------------------------------------------------------


def test_repeat_call_is_checked_once_and_packs_current_values(full_checks):
    tensors = tensors_of([5, 7])
    out = torch.empty(12, dtype=torch.bfloat16)
    for step in range(3):
        for t in tensors:
            t.add_(step)
        pack(tensors, out, 0.5)
        assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))
    assert full_checks[0] == 1
    assert len(pack_module.LAYOUTS) == 1


def test_repeat_unpack_with_stats_is_checked_once(full_checks):
    flat = torch.randn(12)
    tensors = [torch.empty(5), torch.empty(7)]
    stats = torch.full((2,), -1.0)
    for _ in range(2):
        unpack(flat, tensors, 2.0, stats=stats)
        assert_same_bits(torch.cat(tensors), flat.mul(2.0))
        # float32 sums of 12 squares: far inside 1e-5 of the float64 value
        assert float(stats[0]) == pytest.approx(float(flat.double().mul(2.0).square().sum()), rel=1e-5)
    assert full_checks[0] == 1


@pytest.mark.parametrize(
    "call, scale",
    [
        pytest.param(lambda ts, out: pack((t for t in ts), out, 0.5), 0.5, id="generator"),
        pytest.param(lambda ts, out: pack(ts, out, 1), 1.0, id="int-scale"),
        pytest.param(lambda ts, out: pack(ts + [torch.empty(0)], out, 0.5), 0.5, id="null-address"),
    ],
)
def test_calls_without_a_signature_are_checked_every_time(full_checks, call, scale):
    tensors = tensors_of([5, 7])
    out = torch.empty(12, dtype=torch.bfloat16)
    call(tensors, out)
    call(tensors, out)
    assert full_checks[0] == 2 and len(pack_module.LAYOUTS) == 0
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
    pack(tensors, out, 0.5)
    change(tensors)
    with pytest.raises(error, match=words):
        pack(tensors, out, 0.5)


def test_tensor_set_to_other_memory_is_read_there():
    tensors = tensors_of([6, 9])
    out = torch.empty(15, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    replacement = torch.randn(9)
    tensors[1].set_(replacement.untyped_storage(), 0, (9,), (1,))
    pack(tensors, out, 0.5)
    assert_same_bits(out, reference_pack([tensors[0], replacement], torch.bfloat16, 0.5))


def test_freed_and_replaced_tensors_are_packed_as_they_are_now():
    tensors = tensors_of([6, 9])
    out = torch.empty(15, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    for i in range(len(tensors)):  # freed; the allocator may well give the replacement the same address
        tensors[i] = None
        tensors[i] = torch.randn(6 if i == 0 else 9, dtype=torch.float32)
    pack(tensors, out, 0.5)
    assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))


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


def test_negative_zero_scale_is_another_layout(full_checks):
    """-0.0 and 0.0 are equal floats but scale to different bits, so a pack at -0.0 after one at 0.0 is checked and
    launched as a layout of its own, and writes what a first call at -0.0 writes. (Compared with that first call, not
    with -0.0: Triton 3.8's interpreter folds a float argument of -0.0 into +0.0, which the compiled kernel, taking
    the scale at run time, does not.)"""
    tensors = [torch.full((8,), 3.0)]
    out = torch.empty(8, dtype=torch.bfloat16)
    pack(tensors, out, -0.0)
    first_at_negative_zero = out.clone()
    pack_module.LAYOUTS.clear()
    pack(tensors, out, 0.0)
    assert not torch.signbit(out.float()).any()
    checks_before = full_checks[0]
    pack(tensors, out, -0.0)
    assert full_checks[0] == checks_before + 1, "the layout of scale 0.0 was reused for -0.0"
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


# ---- what the cache holds -------------------------------------------------------------------------------------------


def test_cache_is_a_bounded_lru():
    cache = LayoutCache(capacity=2)
    signatures = [(("pack", "0x1p+0", 16 * i + 16, (16 * i + 32,)), (i,)) for i in range(3)]
    for i, sig in enumerate(signatures[:2]):
        cache.put(sig, i)
    assert cache.get(signatures[0]) == 0  # now the most recent
    cache.put(signatures[2], 2)
    assert len(cache) == 2 and cache.get(signatures[1]) is None and cache.get(signatures[0]) == 0
    head, _ = signatures[0]
    assert cache.get((head, ("other metadata",))) is None, "the same addresses with other metadata must not match"


def test_module_cache_stays_within_its_capacity(monkeypatch):
    monkeypatch.setattr(pack_module, "LAYOUTS", LayoutCache(capacity=3))
    kept = []
    for n in range(1, 8):
        tensors = tensors_of([n, 3])
        kept.append((tensors, packed(tensors)))
    assert len(pack_module.LAYOUTS) == 3
    for tensors, out in kept:
        assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))


@pytest.mark.parametrize("stats", [False, True], ids=["unpack", "unpack-stats"])
def test_cache_holds_no_caller_tensors(stats):
    tensors, flat = tensors_of([5, 7]), torch.randn(12)
    out = torch.empty(12, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    unpack(flat, tensors, 2.0, stats=torch.zeros(2) if stats else None)
    watch = [weakref.ref(t) for t in (*tensors, flat, out)]
    del tensors, flat, out
    gc.collect()
    assert len(pack_module.LAYOUTS) == 2
    assert all(w() is None for w in watch), "a layout in the cache keeps a caller's tensor alive"


# ---- the CUDA path's replay, with a stub for the compiled kernel's launcher --------------------------------------


def _recording_direct_launch(calls):
    """Stands for launch._bind_direct: a launch that records the destination address it was bound to."""

    def direct_launch(plan, kernel, args, constexprs):
        return functools.partial(calls[threading.get_ident()].append, args[1].data_ptr())

    return direct_launch


def test_repeat_call_replays_the_direct_launch_unless_a_profiler_listens(monkeypatch):
    calls = defaultdict(list)
    monkeypatch.setattr(pack_module, "direct_launch", _recording_direct_launch(calls))
    tensors = tensors_of([5, 7])
    out = torch.full((12,), 7.0, dtype=torch.bfloat16)
    pack(tensors, out, 0.5)
    pack(tensors, out, 0.5)
    assert calls[threading.get_ident()] == [out.data_ptr()] * 2
    assert_same_bits(out, torch.full((12,), 7.0, dtype=torch.bfloat16))  # the stub launched nothing
    monkeypatch.setattr(pack_module, "launch_hooks_installed", lambda: True)
    pack(tensors, out, 0.5)  # through Triton's launcher, which a profiler's hook sees
    assert len(calls[threading.get_ident()]) == 2
    assert_same_bits(out, reference_pack(tensors, torch.bfloat16, 0.5))


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


def test_threads_replay_only_their_own_layouts(monkeypatch):
    calls = defaultdict(list)
    monkeypatch.setattr(pack_module, "direct_launch", _recording_direct_launch(calls))
    monkeypatch.setattr(pack_module, "LAYOUTS", LayoutCache(capacity=4))  # fewer than the layouts: evictions race
    outs = {}
    # Every thread's tensors live, and every thread runs, from the first pack to the last: a thread that ended early
    # could hand its identity, or its tensors' addresses, to another.
    together = threading.Barrier(4, timeout=60)  # a thread that fails breaks it for the others: no hang

    def work(i):
        layouts = [(tensors_of([3 + i, 5 + k], seed=i), torch.empty(8 + i + k, dtype=torch.bfloat16))
                   for k in range(3)]
        outs[threading.get_ident()] = {out.data_ptr() for _, out in layouts}
        together.wait()
        for _ in range(50):
            for tensors, out in layouts:
                pack(tensors, out, 0.5)
        together.wait()

    _in_threads(work, 4)
    assert len(calls) == 4
    for ident, ptrs in calls.items():
        assert len(ptrs) == 150 and set(ptrs) == outs[ident], "a thread replayed another thread's layout"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_threads_pack_correct_bits_on_the_torch_path(monkeypatch, dtype):
    monkeypatch.setattr(pack_module, "uses_triton", lambda device: False)
    monkeypatch.setattr(pack_module, "LAYOUTS", LayoutCache(capacity=3))

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


def test_signature_reads_current_metadata():
    t = torch.zeros(8)
    out = torch.empty(8)
    before = signature("pack", [t], out, 1.0)
    t.as_strided_((4, 2), (1, 4))
    assert signature("pack", [t], out, 1.0) != before
    assert signature("pack", [t], out, -0.0) != signature("pack", [t], out, 0.0)


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
        bound = torch_path.bind_pack([src], out, 0.3, canonical)
        bound()
        assert_same_bits(out, reference_pack([src], dst_dtype, 0.3))
    back = torch.empty(n, dtype=src_dtype)
    torch_path.bind_unpack(out, [back], 1 / 3, None)()
    assert_same_bits(back, (out.float() * (1 / 3)).to(src_dtype))
