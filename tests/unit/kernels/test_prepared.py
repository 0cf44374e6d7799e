"""Prepared calls (``kernels.<op>.prepare(...)``): checked and compiled once, then run on the tensors each call passes,
or fixed to tensors the caller keeps (``call.fixed(*tensors)``).

Tier: no device. Each prepared call runs on fresh tensors at every call and must give the plain call's bits on those
tensors, in Triton's interpreter and on the torch path; a call whose tensors differ from what it was prepared for is
refused by name before anything is written. A fixed call repeats on its tensors' new values with the plain call's
bits. The CUDA path is checked through its launcher's arguments: with the compiled launcher stubbed, the values a
prepared call hands it are what a direct launch for the new tensors would take, and a call Triton would specialise
otherwise goes through Triton's launcher.
"""

import gc
import importlib
import re
import weakref

import pytest
import torch

from bits import assert_same_bits
from interpreter import interpreter_problem
from ddp_triton import kernels
from ddp_triton.kernels import blockscale, fp8, slices
from ddp_triton.kernels.blocks import block_layout

launch_module = importlib.import_module("ddp_triton.kernels.launch")
pack_module = importlib.import_module("ddp_triton.kernels.pack")
prepared_module = importlib.import_module("ddp_triton.kernels.prepared")

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
    "pack": (lambda ts, o: kernels.pack.prepare(ts, o, 0.25),
             lambda s: ([_values(1000, s)], _unwritten(1000, torch.bfloat16)),
             lambda ts, o: kernels.pack(ts, o, 0.25)),
    "pack two tensors": (lambda ts, o: kernels.pack.prepare(ts, o, 0.25),
                         lambda s: ([_values(1000, s), _values(17, s + 50)], _unwritten(1017, torch.bfloat16)),
                         lambda ts, o: kernels.pack(ts, o, 0.25)),
    "unpack": (lambda f, ts, st: kernels.unpack.prepare(f, ts, 3.0, stats=st),
               lambda s: (_values(1000, s, torch.float16), [_unwritten(1000)], None),
               lambda f, ts, st: kernels.unpack(f, ts, 3.0, stats=st)),
    "unpack two tensors with stats": (lambda f, ts, st: kernels.unpack.prepare(f, ts, 3.0, stats=st),
                                      lambda s: (_values(1017, s, torch.float16), [_unwritten(1000), _unwritten(17)],
                                                 torch.zeros(2)),
                                      lambda f, ts, st: kernels.unpack(f, ts, 3.0, stats=st)),
    "sum_slices": (lambda r, o: kernels.sum_slices.prepare(r, N_RANKS, o),
                   lambda s: (_values(N_RANKS * 500, s, torch.bfloat16), _unwritten(500)),
                   lambda r, o: kernels.sum_slices(r, N_RANKS, o)),
    "quantize": (lambda src, rows, res: kernels.quantize_blocks.prepare(src, LAYOUT, rows, 0.5, fmt=FMT,
                                                                        residual=res),
                 lambda s: (_values(LAYOUT.n_elements, s, torch.bfloat16),
                            _unwritten(LAYOUT.n_rows * fp8.ROW_BYTES, torch.uint8),
                            _values(LAYOUT.n_elements, s + 100) * 1e-3),
                 lambda src, rows, res: kernels.quantize_blocks(src, LAYOUT, rows, 0.5, fmt=FMT, residual=res)),
    "reduce": (lambda rec, out, res: kernels.reduce_blocks.prepare(rec, N_RANKS, out, fmt=FMT, residual=res),
               lambda s: (_received(s), _unwritten(ROW_LAYOUT.n_rows * fp8.ROW_BYTES, torch.uint8),
                          _values(ROW_LAYOUT.n_rows * 128, s + 100) * 1e-3),
               lambda rec, out, res: kernels.reduce_blocks(rec, N_RANKS, out, fmt=FMT, residual=res)),
    "dequantize": (lambda rows, dst, st: kernels.dequantize_blocks.prepare(rows, ROW_LAYOUT, dst, fmt=FMT, stats=st),
                   lambda s: (_rows(ROW_LAYOUT, s), _unwritten(ROW_LAYOUT.n_elements, torch.bfloat16), None),
                   lambda rows, dst, st: kernels.dequantize_blocks(rows, ROW_LAYOUT, dst, fmt=FMT, stats=st)),
    "dequantize with stats": (lambda rows, dst, st: kernels.dequantize_blocks.prepare(rows, ROW_LAYOUT, dst, fmt=FMT,
                                                                                      stats=st),
                              lambda s: (_rows(ROW_LAYOUT, s), _unwritten(ROW_LAYOUT.n_elements), torch.zeros(2)),
                              lambda rows, dst, st: kernels.dequantize_blocks(rows, ROW_LAYOUT, dst, fmt=FMT,
                                                                              stats=st)),
    "sum_blocks": (lambda rec, out: kernels.sum_blocks.prepare(rec, N_RANKS, ROW_LAYOUT, out, fmt=FMT),
                   lambda s: (_received(s), _unwritten(ROW_LAYOUT.n_elements)),
                   lambda rec, out: kernels.sum_blocks(rec, N_RANKS, ROW_LAYOUT, out, fmt=FMT)),
}
#: The cases whose launches take no buffer a call makes of its own (a work table, statistics' partial sums), so
#: that their launcher values are those of the plain call on the same tensors.
ONE_KERNEL_CASES = ["pack", "unpack", "sum_slices", "quantize", "reduce", "dequantize", "sum_blocks"]


@pytest.fixture(params=["interpreter", "torch path"])
def path(request, monkeypatch):
    if request.param == "torch path":
        for module in (pack_module, blockscale, slices):
            monkeypatch.setattr(module, "uses_triton", lambda device: False)
    return request.param


def _clones(args):
    return tuple([t.clone() for t in a] if isinstance(a, list) else None if a is None else a.clone() for a in args)


def _flat(args):
    """The tensors of a call's arguments (None left out), the lists' spread out."""
    return [t for a in args if a is not None for t in (a if isinstance(a, list) else [a])]


def _assert_same(got, want):
    for a, b in zip(_flat(got), _flat(want)):
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


def _first_tensor(args):
    """(name, tensor) of a call's first tensor: its first argument, or the first of that argument's list."""
    return ("tensors[0]", args[0][0]) if isinstance(args[0], list) else (None, args[0])


def _with_first(args, tensor):
    first = [tensor] + args[0][1:] if isinstance(args[0], list) else tensor
    return (first,) + tuple(args[1:])


@pytest.mark.parametrize("name", ["quantize", "sum_blocks", "pack", "pack two tensors",
                                  "unpack two tensors with stats"])
def test_a_call_unlike_its_examples_is_refused_by_name_before_anything_is_written(name):
    prepare, tensors, _ = CASES[name]
    examples = tensors(0)
    call = prepare(*examples)
    given = tensors(1)
    before = _clones(given)
    first_name, first = _first_tensor(given)
    first_name = first_name or call._names[0]
    second_name, second = ((call._names[1], given[1]) if not isinstance(given[1], list)
                           else ("tensors[0]", given[1][0]))
    other_dtype = torch.float16 if first.dtype != torch.float16 else torch.float32
    wrong = [
        (_with_first(given, first.to(other_dtype)), rf"{re.escape(first_name)} is float\d+ .*prepared for"),
        (_with_first(given, first[:-1]), r"of shape \[\d+\].*prepared for"),
        (_with_first(given, first.view(1, -1)), r"of shape \[1, \d+\].*prepared for"),
        (_with_first(given, "not a tensor"), rf"{re.escape(first_name)} must be a tensor"),
        (given[:-1], "takes"),
    ]
    if isinstance(given[1], list):
        wrong.append(((given[0], [second[:-1]] + given[1][1:]) + given[2:], r"tensors\[0\] is .*prepared for"))
    else:
        wrong.append(((given[0], second[:-1]) + given[2:], rf"{second_name} is .*prepared for"))
    if name.startswith("pack"):
        n = len(given[0])
        wrong.append((([first] * (n + 1), given[1]), f"tensors holds {n + 1} tensors; this call was prepared for {n}"))
        wrong.append(((first, given[1]), "tensors must be a list or tuple of tensors"))
    if name.startswith("unpack"):
        wrong.append(((given[0], given[1], None), r"stats is None; this call was prepared for float32"))
    if name == "quantize":
        wrong.append(((given[0], given[1], None), r"residual is None; this call was prepared for float32"))
        off_by_one = torch.empty(given[1].numel() + 1, dtype=torch.uint8)[1:]  # FP8 rows are 32-bit words
        wrong.append(((given[0], off_by_one, given[2]), r"rows is uint8 .* at an address 1 past a multiple of 4; "
                                                        r"this call was prepared for uint8 .* at an address 0"))
    for tensors_given, message in wrong:
        with pytest.raises((ValueError, TypeError), match=message):
            call(*tensors_given)
        with pytest.raises((ValueError, TypeError), match=message):
            call.fixed(*tensors_given)
    _assert_same(given, before)


@pytest.mark.parametrize("name", list(CASES))
def test_a_fixed_call_repeats_on_its_tensors_new_values_with_the_plain_calls_bits(name, path):
    """What a DDP bucket runs every step: the call fixed to buffers it keeps, their values new at every step."""
    prepare, tensors, plain = CASES[name]
    given = tensors(1)
    again = prepare(*tensors(0)).fixed(*given)
    want = _clones(given)
    for step in range(3):
        fresh = tensors(10 + step)  # new values, written into the same tensors
        for got_t, want_t, new_t in zip(_flat(given), _flat(want), _flat(fresh)):
            got_t.copy_(new_t)
            want_t.copy_(new_t)
        again()
        plain(*want)
        _assert_same(given, want)


def test_pack_and_unpack_prepared_in_place_run_in_place():
    """A bucket packed into itself (in-place scaling) and the stats pass over it: the same memory is allowed for
    pack and unpack, as their plain calls allow it."""
    buffer, stats = _values(1000, 4), torch.zeros(2)
    want, want_stats = buffer.clone(), torch.zeros(2)
    kernels.pack.prepare([buffer], buffer, 0.5).fixed([buffer], buffer)()
    kernels.pack([want], want, 0.5)
    assert_same_bits(buffer, want)
    kernels.unpack.prepare(buffer, [buffer], 1.0, stats=stats)(buffer, [buffer], stats)
    kernels.unpack(want, [want], 1.0, stats=want_stats)
    assert_same_bits(buffer, want)
    assert_same_bits(stats, want_stats)
    with pytest.raises(ValueError, match="overlaps tensors"):
        kernels.pack.prepare([buffer[1:]], buffer[:-1], 0.5)


@pytest.mark.parametrize("name", ["pack", "sum_slices"])
def test_nans_left_as_the_arithmetic_makes_them_by_either_form(name, monkeypatch):
    """canonical_nan=False (the sharded exchanges' choice) on the torch path, where it differs from canonical NaNs
    (the kernels always write canonical ones): a call and a fixed call give the same bits, NaN payloads and signs
    included."""
    for module in (pack_module, blockscale, slices):
        monkeypatch.setattr(module, "uses_triton", lambda device: False)
    values = _values(N_RANKS * 500, 3)
    values[::7] = float("nan")
    values[3::11] = -float("nan")
    values.view(torch.int32)[5::13] = 0x7F800001  # a signalling NaN's payload
    if name == "pack":
        src, got = [values], torch.empty(values.numel(), dtype=torch.bfloat16)
        want, canonical = torch.empty_like(got), torch.empty_like(got)
        kernels.pack.prepare(src, got, 0.5, canonical_nan=False)(src, got)
        kernels.pack.prepare(src, want, 0.5, canonical_nan=False).fixed(src, want)()
        kernels.pack(src, canonical, 0.5)
    else:
        src, got = values.to(torch.bfloat16), torch.empty(500, dtype=torch.bfloat16)
        want, canonical = torch.empty_like(got), torch.empty_like(got)
        kernels.sum_slices.prepare(src, N_RANKS, got, canonical_nan=False)(src, got)
        kernels.sum_slices.prepare(src, N_RANKS, want, canonical_nan=False).fixed(src, want)()
        kernels.sum_slices(src, N_RANKS, canonical)
    assert not torch.equal(canonical.view(torch.int16), want.view(torch.int16))  # the flag shows in the bits
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_tensors_that_share_memory_are_refused():
    received = _values(N_RANKS * 500, 0)
    call = kernels.sum_slices.prepare(received, N_RANKS, _unwritten(500))
    with pytest.raises(ValueError, match="(received and out|out and received) overlap"):
        call(received, received[500:1000])
    with pytest.raises(ValueError, match="(received and out|out and received) overlap"):
        call.fixed(received, received[500:1000])
    with pytest.raises(ValueError, match="(received and out|out and received) overlap"):
        kernels.sum_slices.prepare(received, N_RANKS, received[:500])


def test_preparing_checks_as_a_plain_call_does():
    layout = block_layout([10], 1)
    with pytest.raises(ValueError, match="src has 9 elements"):
        kernels.quantize_blocks.prepare(torch.ones(9), layout, torch.empty(layout.n_rows * fp8.ROW_BYTES,
                                                                          dtype=torch.uint8))
    with pytest.raises(ValueError, match="n_ranks"):
        kernels.sum_slices.prepare(torch.ones(4), 0, torch.empty(4))
    with pytest.raises(ValueError, match="scale"):
        kernels.pack.prepare([torch.ones(4)], torch.empty(4, dtype=torch.bfloat16), float("nan"))
    with pytest.raises(ValueError, match="stats must be a float32 tensor of shape"):
        kernels.unpack.prepare(torch.ones(4), [torch.empty(4)], stats=torch.zeros(3))
    with pytest.raises(TypeError, match="list or tuple"):
        kernels.pack.prepare(torch.ones(4), torch.empty(4, dtype=torch.bfloat16))


def test_a_fixed_call_keeps_every_tensor_it_runs_on_alive(path):
    """The work table holds raw addresses, the torch path views: a fixed call holds every tensor it runs on, so
    that the caller may drop its own references."""

    flat = torch.randn(300)
    tensors = [torch.empty(100), torch.empty(200)]
    watch = [weakref.ref(t) for t in tensors]
    again = kernels.unpack.prepare(flat, tensors, 2.0).fixed(flat, tensors, None)
    kept = tensors[1]
    del tensors
    gc.collect()
    assert all(w() is not None for w in watch), "a tensor the fixed call runs on was freed"
    again()
    assert_same_bits(kept, flat[100:].mul(2.0))


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
    "pack": lambda ts, o: pack_module._pack_call(ts, o, 0.25, True, True),
    "unpack": lambda f, ts, st: pack_module._unpack_call(f, ts, 3.0, st, True, True),
    "sum_slices": lambda rec, out: slices._sum_slices_call(rec, N_RANKS, out),
    "quantize": lambda src, rows, res: blockscale._quantize_call(src, LAYOUT, rows, 0.5, FMT, res),
    "reduce": lambda rec, out, res: blockscale._reduce_call(rec, N_RANKS, out, FMT, res),
    "dequantize": lambda rows, dst, st: blockscale._dequantize_call(rows, ROW_LAYOUT, dst, FMT, st),
    "sum_blocks": lambda rec, out: blockscale._sum_blocks_call(rec, N_RANKS, ROW_LAYOUT, out, FMT),
}


def _expected_values(name, tensors):
    """What a direct launch bound to ``tensors`` holds: the launcher values of the plain call's kernel arguments."""
    _, kernel, args, constexprs = BUILDS[name](*tensors).launch
    return tuple(launch_module._launcher_values(kernel, args, constexprs))


@pytest.mark.parametrize("name", ONE_KERNEL_CASES + ["reduce without residual"])
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
    (src,), out = tensors(1)
    shifted = torch.cat([torch.zeros(1), src])[1:]  # the same values, 4 bytes past a 16-byte boundary
    assert src.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4
    call = prepare(*tensors(0))
    order = (shifted, src, shifted, src)  # the first call unaligned: the aligned one is compiled later
    for given in order:
        call([given], out)
    assert fallbacks == [] and [index for index, _ in recorder.launches] == [0, 1, 0, 1]
    assert [values for _, values in recorder.launches] == [_expected_values("pack", ([t], out)) for t in order]
    assert recorder.compiled[0][0] % 16 == 4 and recorder.compiled[1][0] % 16 == 0


def test_an_int_triton_makes_a_constant_goes_through_tritons_launcher(stubbed_cuda):
    recorder, fallbacks = stubbed_cuda
    received, out = _values(500, 0), _unwritten(500)
    call = kernels.sum_slices.prepare(received, 1, out)  # one rank: an int 1 among the arguments
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
    assert len(fallbacks) == 1 and recorder.compiled == [] and call._compiled == {}
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


def test_a_plain_pack_of_a_seen_layout_relaunches_at_the_same_addresses_and_keeps_no_tensor(stubbed_cuda, monkeypatch):
    """The plain call's repeat on a GPU: no check and no work list at the last call's addresses, only the direct
    launch; a work list at new ones; and nothing of the caller's kept alive between calls."""
    recorder, fallbacks = stubbed_cuda
    plans = []
    real_plan = pack_module.build_plan
    monkeypatch.setattr(pack_module, "build_plan", lambda *a: plans.append(1) or real_plan(*a))
    sizes = [300, 7, 129]  # three runs: a work list
    first, second = [_values(n, 1) for n in sizes], [_values(n, 2) for n in sizes]
    out = torch.empty(sum(sizes), dtype=torch.bfloat16)
    for given in (first, first, second, second, first):
        kernels.pack(given, out, 0.25)
    assert len(plans) == 3 and fallbacks == [] and len(recorder.compiled) == 1
    launched = [values for _, values in recorder.launches]
    expected = [_expected_values("pack", (given, out)) for given in (first, first, second, second, first)]
    table = 2  # the work table's address, which is each plan's own: the rest are the call's tensors and settings
    assert [v[:table] + v[table + 1:] for v in launched] == [v[:table] + v[table + 1:] for v in expected]
    assert launched[0] == launched[1] and launched[2] == launched[3]  # a relaunch, table and all
    watch = [weakref.ref(t) for t in first + [out]]
    del first, second, given, out
    gc.collect()
    assert all(w() is None for w in watch), "a plain call kept a tensor of its caller's"


@pytest.mark.parametrize("name", ONE_KERNEL_CASES)
def test_a_fixed_call_compiles_at_its_first_call_then_relaunches_its_values(name, stubbed_cuda, monkeypatch):
    """A DDP bucket's kind of call: built once when fixed, compiled at its first call, then the same values every
    call; Triton's launcher while a launch hook listens, the direct launch again once it stops."""
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES[name]
    given = tensors(1)
    call = prepare(*tensors(0))
    builds = []
    real_build = call._build
    call._build = lambda *a, **k: builds.append(1) or real_build(*a, **k)
    again = call.fixed(*given)
    fallbacks.clear()  # making FP8 rows launched the quantize kernel
    assert recorder.compiled == [] and builds == [1]
    for _ in range(3):
        again()
    assert builds == [1] and fallbacks == [] and len(recorder.compiled) == 1
    assert recorder.launches == [(0, _expected_values(name, given))] * 3
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: True)
    again()
    assert len(fallbacks) == 1 and len(recorder.launches) == 3  # a profiler sees Triton's launcher
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: False)
    again()
    assert len(fallbacks) == 1 and len(recorder.launches) == 4 and len(recorder.compiled) == 1


def test_a_fixed_call_inside_cuda_graph_capture_before_the_self_check_then_direct(stubbed_cuda, monkeypatch):
    """Fixed before capture, first called inside it before the direct launch's self-check could run: Triton's
    launcher (which the graph records), and the first call outside capture compiles and goes direct."""
    recorder, fallbacks = stubbed_cuda
    prepare, tensors, _ = CASES["sum_slices"]
    given = tensors(1)
    again = prepare(*tensors(0)).fixed(*given)
    monkeypatch.setattr(launch_module, "_direct_launch_ok", None)
    monkeypatch.setattr(launch_module, "_capturing", lambda: True)
    again()
    again()
    assert len(fallbacks) == 2 and recorder.compiled == []
    monkeypatch.setattr(launch_module, "_capturing", lambda: False)
    monkeypatch.setattr(launch_module, "_direct_launch_available", lambda device: True)
    again()
    again()
    assert len(fallbacks) == 2 and len(recorder.compiled) == 1
    assert recorder.launches == [(0, _expected_values("sum_slices", given))] * 2
