"""Prepared calls (``kernels.prepare_*``): checked and compiled once, then run on the tensors each call passes.

Tier: no device. Each prepared call runs on fresh tensors at every call and must give the plain call's bits on those
tensors, in Triton's interpreter and on the torch path; a call whose tensors differ from what it was prepared for is
refused by name before anything is written. The CUDA path is checked through its launcher's arguments: with the
compiled launcher stubbed, the values a prepared call hands it are what a direct launch bound to the new tensors
would hold, and a call Triton would specialise otherwise goes through Triton's launcher.
"""

import importlib

import pytest
import torch

from bits import assert_same_bits
from interpreter import interpreter_problem
from ddp_triton import kernels
from ddp_triton.kernels import blockscale, fp8, slices
from ddp_triton.kernels.blocks import block_layout

launch_module = importlib.import_module("ddp_triton.kernels.launch")
pack_module = importlib.import_module("ddp_triton.kernels.pack")

pytestmark = pytest.mark.skipif(not kernels.uses_triton(torch.device("cpu")) or interpreter_problem() is not None,
                                reason=interpreter_problem() or "needs Triton's interpreter")

SIZES, N_RANKS, FMT = [129, 7, 0, 300], 3, torch.float8_e4m3fn
LAYOUT = block_layout(SIZES * N_RANKS, N_RANKS)  # FSDP's input: N rows of the chunks
ROW_LAYOUT = block_layout(SIZES, 1)


def _values(n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.logspace(-4, 2, n)).to(dtype)


def _rows(layout, seed):
    rows = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    blockscale.quantize_blocks(_values(layout.n_elements, seed), layout, rows, fmt=FMT)
    return rows


def _unwritten(n, dtype=torch.float32):
    """An output buffer holding 7s, which no call here writes: a call that leaves it unwritten differs."""
    return torch.full((n,), 7, dtype=dtype)


def _received(seed):
    """N ranks' rows of one shard, as an all-to-all hands them over."""
    return torch.cat([_rows(ROW_LAYOUT, seed * 10 + r) for r in range(N_RANKS)])


# name -> (prepare(*examples), tensors(seed), plain(*tensors)); every tensor is compared after the call.
CASES = {
    "pack": (lambda t, o: kernels.prepare_pack(t, o, 0.25),
             lambda s: (_values(1000, s), _unwritten(1000, torch.bfloat16)),
             lambda t, o: kernels.pack([t], o, 0.25)),
    "unpack": (lambda f, t: kernels.prepare_unpack(f, t, 3.0),
               lambda s: (_values(1000, s, torch.float16), _unwritten(1000)),
               lambda f, t: kernels.unpack(f, [t], 3.0)),
    "sum_slices": (lambda r, o: kernels.prepare_sum_slices(r, N_RANKS, o),
                   lambda s: (_values(N_RANKS * 500, s, torch.bfloat16), _unwritten(500)),
                   lambda r, o: kernels.sum_slices(r, N_RANKS, o)),
    "quantize": (lambda src, rows, res: kernels.prepare_quantize_blocks(src, LAYOUT, rows, 0.5, fmt=FMT,
                                                                        residual=res),
                 lambda s: (_values(LAYOUT.n_elements, s, torch.bfloat16),
                            _unwritten(LAYOUT.n_rows * fp8.ROW_BYTES, torch.uint8),
                            _values(LAYOUT.n_elements, s + 100) * 1e-3),
                 lambda src, rows, res: kernels.quantize_blocks(src, LAYOUT, rows, 0.5, fmt=FMT, residual=res)),
    "reduce": (lambda rec, out, res: kernels.prepare_reduce_blocks(rec, N_RANKS, out, fmt=FMT, residual=res),
               lambda s: (_received(s), _unwritten(ROW_LAYOUT.n_rows * fp8.ROW_BYTES, torch.uint8),
                          _values(ROW_LAYOUT.n_rows * 128, s + 100) * 1e-3),
               lambda rec, out, res: kernels.reduce_blocks(rec, N_RANKS, out, fmt=FMT, residual=res)),
    "dequantize": (lambda rows, dst: kernels.prepare_dequantize_blocks(rows, ROW_LAYOUT, dst, fmt=FMT),
                   lambda s: (_rows(ROW_LAYOUT, s), _unwritten(ROW_LAYOUT.n_elements, torch.bfloat16)),
                   lambda rows, dst: kernels.dequantize_blocks(rows, ROW_LAYOUT, dst, fmt=FMT)),
    "sum_blocks": (lambda rec, out: kernels.prepare_sum_blocks(rec, N_RANKS, ROW_LAYOUT, out, fmt=FMT),
                   lambda s: (_received(s), _unwritten(ROW_LAYOUT.n_elements)),
                   lambda rec, out: kernels.sum_blocks(rec, N_RANKS, ROW_LAYOUT, out, fmt=FMT)),
}


@pytest.fixture(params=["interpreter", "torch path"])
def path(request, monkeypatch):
    if request.param == "torch path":
        for module in (pack_module, blockscale, slices):
            monkeypatch.setattr(module, "uses_triton", lambda device: False)
    return request.param


def _clones(tensors):
    return tuple(t.clone() for t in tensors)


def _assert_same(got, want):
    for a, b in zip(got, want):
        if a.dtype == torch.uint8:
            assert torch.equal(a, b)
        else:
            assert_same_bits(a, b)


@pytest.mark.parametrize("name", list(CASES))
def test_prepared_call_on_new_tensors_gives_the_plain_calls_bits(name, path):
    prepare, tensors, plain = CASES[name]
    call = prepare(*tensors(0))
    for seed in (1, 2):  # new tensors, new values, at every call
        given = tensors(seed)
        want = _clones(given)
        call(*given)
        plain(*want)
        _assert_same(given, want)


@pytest.mark.parametrize("name", ["quantize", "sum_blocks", "pack"])
def test_a_call_unlike_its_examples_is_refused_by_name_before_anything_is_written(name):
    prepare, tensors, _ = CASES[name]
    examples = tensors(0)
    call = prepare(*examples)
    given = tensors(1)
    before = _clones(given)
    first = given[0]
    other_dtype = torch.float16 if first.dtype != torch.float16 else torch.float32
    wrong = [
        ((first.to(other_dtype),) + given[1:], rf"{call._names[0]} is float\d+ .*prepared for"),
        ((first[:-1],) + given[1:], r"of shape \[\d+\].*prepared for"),
        ((first.view(1, -1),) + given[1:], r"of shape \[1, \d+\].*prepared for"),
        ((first, given[1][:-1]) + given[2:], rf"{call._names[1]} is .*prepared for"),
        (("not a tensor",) + given[1:], rf"{call._names[0]} must be a tensor"),
        (given[:-1], "takes"),
    ]
    if name == "quantize":
        wrong.append(((given[0], given[1], None), r"residual is None; this call was prepared for float32"))
        off_by_one = torch.empty(given[1].numel() + 1, dtype=torch.uint8)[1:]  # FP8 rows are 32-bit words
        wrong.append(((given[0], off_by_one, given[2]), r"rows is uint8 .* at an address 1 past a multiple of 4; "
                                                        r"this call was prepared for uint8 .* at an address 0"))
    for tensors_given, message in wrong:
        with pytest.raises((ValueError, TypeError), match=message):
            call(*tensors_given)
    _assert_same(given, before)


@pytest.mark.parametrize("name", ["pack", "sum_slices"])
def test_nans_left_as_the_arithmetic_makes_them_as_the_bound_form_leaves_them(name, monkeypatch):
    """canonical_nan=False (the sharded exchanges' choice) on the torch path, where it differs from canonical NaNs
    (the kernels always write canonical ones): the prepared call gives the bound call's bits, NaN payloads and signs
    included."""
    for module in (pack_module, blockscale, slices):
        monkeypatch.setattr(module, "uses_triton", lambda device: False)
    values = _values(N_RANKS * 500, 3)
    values[::7] = float("nan")
    values[3::11] = -float("nan")
    values.view(torch.int32)[5::13] = 0x7F800001  # a signalling NaN's payload
    if name == "pack":
        src, got = values, torch.empty(values.numel(), dtype=torch.bfloat16)
        want = torch.empty_like(got)
        kernels.prepare_pack(src, got, 0.5, canonical_nan=False)(src, got)
        kernels.bind_pack([src], want, 0.5, canonical_nan=False)()
    else:
        src, got = values.to(torch.bfloat16), torch.empty(500, dtype=torch.bfloat16)
        want = torch.empty_like(got)
        kernels.prepare_sum_slices(src, N_RANKS, got, canonical_nan=False)(src, got)
        kernels.bind_sum_slices(src, N_RANKS, want, canonical_nan=False)()
    canonical = torch.empty_like(got)
    if name == "pack":
        kernels.bind_pack([src], canonical, 0.5)()
    else:
        kernels.bind_sum_slices(src, N_RANKS, canonical)()
    assert not torch.equal(canonical.view(torch.int16), want.view(torch.int16))  # the flag shows in the bits
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_tensors_that_share_memory_are_refused():
    received = _values(N_RANKS * 500, 0)
    call = kernels.prepare_sum_slices(received, N_RANKS, _unwritten(500))
    with pytest.raises(ValueError, match="(received and out|out and received) overlap"):
        call(received, received[500:1000])
    with pytest.raises(ValueError, match="(received and out|out and received) overlap"):
        kernels.prepare_sum_slices(received, N_RANKS, received[:500])


def test_preparing_checks_as_a_plain_call_does():
    layout = block_layout([10], 1)
    with pytest.raises(ValueError, match="src has 9 elements"):
        kernels.prepare_quantize_blocks(torch.ones(9), layout, torch.empty(layout.n_rows * fp8.ROW_BYTES,
                                                                          dtype=torch.uint8))
    with pytest.raises(ValueError, match="n_ranks"):
        kernels.prepare_sum_slices(torch.ones(4), 0, torch.empty(4))
    with pytest.raises(ValueError, match="scale"):
        kernels.prepare_pack(torch.ones(4), torch.empty(4, dtype=torch.bfloat16), float("nan"))


# ---- the CUDA path, its compiled launcher stubbed ------------------------------------------------------------------


class _Recorder:
    """Stands for compiling a kernel and for its launcher: records which arguments each compile was for and the
    argument values of every launch, by compile."""

    def __init__(self):
        self.compiled = []  # the launcher values of the arguments each compile was for
        self.launches = []  # (compile index, values)

    def compile(self, plan, kernel, args, constexprs, device):
        index = len(self.compiled)
        self.compiled.append(tuple(launch_module._launcher_values(kernel, args, constexprs)))
        direct = launch_module._DirectLaunch(None, lambda *a: self.launches.append((index, a[9:])), 0, None,
                                             plan.n_items, 0, self.compiled[-1])
        direct.current_device, direct.current_stream = int, abs  # C builtins: device 0, stream 0
        return direct


@pytest.fixture
def stubbed_cuda(monkeypatch):
    """CPU tensors take the path a CUDA device would, down to compiling: the compile and its launcher record
    instead of running; Triton's own launcher (the fallback) records too, and runs the kernel in the interpreter."""
    recorder = _Recorder()
    fallbacks = []
    monkeypatch.setattr(launch_module, "_can_launch_directly", lambda plan, args: plan.n_items > 0)
    monkeypatch.setattr(launch_module, "_compile_direct", recorder.compile)
    monkeypatch.setattr(launch_module, "_direct_launch_ok", True)  # its self-check passed (it needs a GPU)
    real_launch = launch_module.launch

    def launch(plan, kernel, args, constexprs):
        fallbacks.append(args)
        real_launch(plan, kernel, args, constexprs)

    monkeypatch.setattr(launch_module, "launch", launch)
    return recorder, fallbacks


BUILDS = {  # each case's plain KernelCall, checked, for the given tensors
    "pack": lambda t, o: pack_module._one_tensor_call(t, o, 0.25, True, True, True),
    "unpack": lambda f, t: pack_module._one_tensor_call(t, f, 3.0, False, True, True),
    "sum_slices": lambda rec, out: slices._sum_slices_call(rec, N_RANKS, out),
    "quantize": lambda src, rows, res: blockscale._quantize_call(src, LAYOUT, rows, 0.5, FMT, res),
    "reduce": lambda rec, out, res: blockscale._reduce_call(rec, N_RANKS, out, FMT, res),
    "dequantize": lambda rows, dst: blockscale._dequantize_call(rows, ROW_LAYOUT, dst, FMT, None),
    "sum_blocks": lambda rec, out: blockscale._sum_blocks_call(rec, N_RANKS, ROW_LAYOUT, out, FMT),
}


def _expected_values(name, tensors):
    """What a direct launch bound to ``tensors`` holds: the launcher values of the plain call's kernel arguments."""
    _, kernel, args, constexprs = BUILDS[name](*tensors).launch
    return tuple(launch_module._launcher_values(kernel, args, constexprs))


@pytest.mark.parametrize("name", list(CASES) + ["reduce without residual"])
def test_direct_launch_takes_each_calls_addresses_compiled_once(name, stubbed_cuda):
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES[name.split()[0]]
    if name == "reduce without residual":
        tensors = (lambda make: lambda s: make(s)[:2] + (None,))(tensors)
    call = prepare(*tensors(0))
    calls = [tensors(seed) for seed in (1, 2, 3)]
    fallbacks.clear()  # making FP8 rows to sum launched the quantize kernel
    for given in calls:
        call(*given)
    assert fallbacks == [] and len(recorder.compiled) == 1
    assert recorder.launches == [(0, _expected_values(name.split()[0], given)) for given in calls]
    assert recorder.launches[0] != recorder.launches[1]  # new addresses: not the first call's


def test_each_alignment_is_compiled_once_at_its_first_call(stubbed_cuda):
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES["pack"]
    src, out = tensors(1)
    shifted = torch.cat([torch.zeros(1), src])[1:]  # the same values, 4 bytes past a 16-byte boundary
    assert src.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4
    call = prepare(*tensors(0))
    order = (shifted, src, shifted, src)  # the first call unaligned: the aligned one is compiled later
    for given in order:
        call(given, out)
    assert fallbacks == [] and [index for index, _ in recorder.launches] == [0, 1, 0, 1]
    assert [values for _, values in recorder.launches] == [_expected_values("pack", (t, out)) for t in order]
    assert recorder.compiled[0][0] % 16 == 4 and recorder.compiled[1][0] % 16 == 0


def test_an_int_triton_makes_a_constant_goes_through_tritons_launcher(stubbed_cuda):
    recorder, fallbacks = stubbed_cuda
    received, out = _values(500, 0), _unwritten(500)
    call = kernels.prepare_sum_slices(received, 1, out)  # one rank: an int 1 among the arguments
    for _ in range(2):
        call(received, out)
        assert_same_bits(out, received)
    assert recorder.compiled == [] and len(fallbacks) == 2


@pytest.mark.parametrize("why", ["a launch hook listens", "the direct launch failed its self-check"])
def test_tritons_launcher_where_the_direct_launch_must_not_be_used(stubbed_cuda, monkeypatch, why):
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES["sum_slices"]
    call = prepare(*tensors(0))
    if why == "a launch hook listens":
        monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: True)
    else:
        monkeypatch.setattr(launch_module, "_direct_launch_ok", False)
    call(*tensors(1))
    call(*tensors(2))
    assert recorder.launches == [] and len(fallbacks) == 2


def test_inside_cuda_graph_capture_before_the_self_check_tritons_launcher_then_a_compile(stubbed_cuda, monkeypatch):
    """The self-check synchronises, which capture forbids: a call captured before it ran goes through Triton's
    launcher (which the graph records) and compiles nothing; the first call outside capture compiles."""
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES["sum_slices"]
    call = prepare(*tensors(0))
    monkeypatch.setattr(launch_module, "_direct_launch_ok", None)
    monkeypatch.setattr(launch_module, "_capturing", lambda: True)
    call(*tensors(1))
    assert len(fallbacks) == 1 and recorder.compiled == [] and call._by_alignment == {}
    monkeypatch.setattr(launch_module, "_capturing", lambda: False)
    monkeypatch.setattr(launch_module, "_direct_launch_available", lambda device: True)
    call(*tensors(2))
    assert len(fallbacks) == 1 and len(recorder.compiled) == 1 and len(recorder.launches) == 1


def test_a_repeat_call_at_the_same_addresses_relaunches_without_building_its_arguments(stubbed_cuda, monkeypatch):
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES["quantize"]
    call = prepare(*tensors(0))
    first, second = tensors(1), tensors(2)
    builds = []
    real_build = call._build
    call._build = lambda *a, **k: builds.append(1) or real_build(*a, **k)
    for given in (first, first, second, first, first):
        call(*given)
    assert len(builds) == 3 and fallbacks == []  # a build for each change of addresses only
    assert recorder.launches == [(0, _expected_values("quantize", given))
                                 for given in (first, first, second, first, first)]
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: True)
    call(*first)
    assert len(fallbacks) == 1 and len(recorder.launches) == 5  # a profiler sees Triton's launcher, as always
