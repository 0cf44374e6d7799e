"""The compiled CPU passes (``kernels/blockscale_cpu.c`` through ``kernels.native_cpu``) against the torch passes.

Tier: no device, no Triton. The compiled passes serve CPU tensors wherever a C compiler builds them; the torch passes
(``DDP_TRITON_NATIVE_CPU=0``) are the fallback. Both must give the same bits for every format (FP8's two, E2M1), bucket
dtype, scale, residual, layout and rank count; E2M1's rows also those of the definition (``wire_reference.fp4_rows``) at
every value and midpoint, at scales from float32's bottom to its top (test_wire_kernels.py compares the cpu_fp8 passes,
compiled where they build, with the Triton kernels in the interpreter). The build must never load or write through a
file it does not own, and must fall back, with a warning, where no compiler or a wrong library is found.
"""

import os
import warnings

import pytest
import torch

from bits import assert_same_bits
from wire_reference import E2M1_VALUES, fp4_rows
from ddp_triton.kernels import cpu_fp4, cpu_fp8, fp4, fp8, native_cpu, torch_fp4, torch_wire
from ddp_triton.kernels.blocks import block_layout

FORMATS = [pytest.param(fp8.E4M3, id="e4m3"), pytest.param(fp8.E5M2, id="e5m2")]


@pytest.fixture
def compiled():
    """The compiled passes as every call sees them; skips where this machine cannot build them."""
    if native_cpu.library() is None:
        pytest.skip("no C compiler builds kernels/blockscale_cpu.c here")
    return True


def run_all(monkeypatch, native, fmt, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype,
            stats):
    """Quantize, reduce and dequantize (with stats) through the cpu_fp8 passes, compiled or torch."""
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
    residual = None if residual is None else residual.clone()
    shard_residual = None if shard_residual is None else shard_residual.clone()
    rows = torch.full((layout.n_rows * fp8.ROW_BYTES,), 0xAB, dtype=torch.uint8)
    cpu_fp8.quantize_pass(src, layout, rows, scale, fmt, residual)()
    out = torch.full((layout.rows_per_shard * fp8.ROW_BYTES,), 0xCD, dtype=torch.uint8)
    cpu_fp8.reduce_pass(received, ranks, out, fmt, shard_residual)()
    dst = torch.empty(layout.n_elements, dtype=dst_dtype)
    got_stats = torch.full((2,), 7.0) if stats else None
    cpu_fp8.dequantize_pass(rows, layout, dst, fmt, got_stats)()
    return rows, residual, out, shard_residual, dst, got_stats


def values(n, seed):
    return cpu_fp8._self_check_values(n, seed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("scale, with_residual", [(0.25, True), (1.0, True), (0.125, False), (1.0, False)],
                         ids=["scaled+ef", "ef", "scaled", "plain"])
@pytest.mark.parametrize("sizes", [pytest.param([128 * 40], id="whole-blocks"),
                                   pytest.param([128 * 3, 128 * torch_wire.CHUNK_ROWS + 77], id="two-steps-tail"),
                                   pytest.param([5], id="one-short-block"),
                                   pytest.param([64, 4096, 64, 300, 0, 129], id="ragged"),
                                   pytest.param([77] * 40 + [128 * torch_wire.CHUNK_ROWS], id="ragged-two-steps")])
def test_compiled_passes_give_the_torch_passes_bits(compiled, monkeypatch, fmt, src_dtype, scale, with_residual,
                                                    sizes):
    ranks = 3
    layout = block_layout(sizes, ranks)
    n = layout.n_elements
    src = values(n, seed=11).to(src_dtype)
    residual = values(n, seed=12) * 2.0**-10 if with_residual else None
    shard = layout.rows_per_shard * fp8.ROW_BYTES
    copies = []
    for r in range(ranks):
        copy = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
        torch_wire.quantize_pass(values(n, seed=20 + r), layout, copy, 1.0, fmt, None)()
        copies.append(copy[shard:2 * shard])
    received = torch.cat(copies)
    shard_residual = values(layout.rows_per_shard * 128, seed=30) * 2.0**-12 if with_residual else None
    dst_dtype = {torch.float32: torch.float32, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}[src_dtype]
    got = run_all(monkeypatch, True, fmt, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype,
                  stats=True)
    want = run_all(monkeypatch, False, fmt, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype,
                   stats=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        elif w.dtype == torch.uint8:
            assert torch.equal(g, w)
        else:
            assert_same_bits(g, w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", [pytest.param([128 * 3, 128 * torch_wire.CHUNK_ROWS + 77], id="two-steps-tail"),
                                   pytest.param([64, 4096, 64, 300, 0, 129], id="ragged"),
                                   pytest.param([77] * 40 + [128 * torch_wire.CHUNK_ROWS], id="ragged-two-steps")])
def test_compiled_sum_of_blocks_gives_the_torch_passes_bits(compiled, monkeypatch, fmt, sizes):
    """The compiled sum goes step by step through a scratch buffer of one step; the torch passes dequantize each
    rank whole: the same float32 adds in rank order, so the same bits."""
    ranks = 3
    layout = block_layout(sizes, 1)
    received = torch.empty(ranks * layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    for r, rows in enumerate(received.view(ranks, -1)):
        torch_wire.quantize_pass(values(layout.n_elements, seed=40 + r), layout, rows, 1.0, fmt, None)()
    got, want = (torch.full((layout.n_elements,), 7.0) for _ in range(2))
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "1")
    cpu_fp8.sum_blocks_pass(received, ranks, layout, got, fmt)()
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "0")
    cpu_fp8.sum_blocks_pass(received, ranks, layout, want, fmt)()
    assert_same_bits(got, want)


@pytest.mark.parametrize("sizes, n_shards", [([5], 1), ([128 * 3, 128 * torch_wire.CHUNK_ROWS + 77], 4),
                                             ([77] * 40 + [128 * torch_wire.CHUNK_ROWS], 3), ([0, 0], 2)])
def test_step_spans_are_the_element_ranges_of_each_steps_rows(sizes, n_shards):
    layout = block_layout(sizes, n_shards)
    table = layout.table.tolist()
    for step_rows in (1, 7, torch_wire.CHUNK_ROWS):
        want = []
        for r0 in range(0, layout.n_rows, step_rows):
            data = [(start, length) for start, length in table[r0:r0 + step_rows] if length]
            span = (data[0][0], data[-1][0] + data[-1][1]) if data else (layout.n_elements,) * 2
            want.append((r0, min(r0 + step_rows, layout.n_rows)) + span)
        assert layout.step_spans(step_rows) == tuple(want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_dequantize_keeps_or_canonicalises_nans_as_asked(compiled, monkeypatch, fmt):
    """A non-finite block arrives as NaN codes: canonical NaNs by default; without, the NaN the kernel decodes."""
    layout = block_layout([300], 1)
    src = torch.randn(300)
    src[130] = float("-inf")
    rows = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    cpu_fp8.quantize_pass(src, layout, rows, 1.0, fmt, None)()
    rows[fp8.ROW_BYTES + 3] = 0xFF  # a negative NaN code in the non-finite block
    for canonical in (True, False):
        dst = {}
        for native in (True, False):
            monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
            dst[native] = torch.empty(300)
            cpu_fp8.dequantize_pass(rows, layout, dst[native], fmt, None, canonical)()
        if canonical:
            assert_same_bits(dst[True], dst[False])
        else:  # the kernel's decoded NaN, sign kept (torch's own E5M2 decode keeps a payload bit: NaNs only agree)
            got = dst[True].view(torch.int32)
            assert torch.equal(torch.isnan(dst[True]), torch.isnan(dst[False]))
            assert torch.equal(got[:128], dst[False].view(torch.int32)[:128])
            assert ((got[128:256] & 0x7FFFFFFF) == 0x7FC00000).all()
            assert int(got[128 + 3]) < 0 and (got[128:256] < 0).sum() == 1  # only the negative code's NaN is
        assert torch.isnan(dst[True][128:256]).all() and torch.isfinite(dst[True][:128]).all()


def test_off_switch_keeps_the_torch_passes(monkeypatch):
    """DDP_TRITON_NATIVE_CPU=0: no pass asks for the library."""
    def refuse():
        raise AssertionError("the library was asked for")

    monkeypatch.setenv(native_cpu.ENV_SWITCH, "0")
    monkeypatch.setattr(native_cpu, "library", refuse)
    layout = block_layout([256], 2)
    rows = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    cpu_fp8.quantize_pass(torch.randn(256), layout, rows, 0.5, fp8.E4M3, torch.zeros(256))()
    cpu_fp8.dequantize_pass(rows, layout, torch.empty(256), fp8.E4M3, None)()
    assert cpu_fp8.cpu_fp8_passes() == "torch"


@pytest.mark.parametrize("broken", ["quantize", "reduce", "dequantize"])
def test_a_library_with_other_bits_is_refused(compiled, broken):
    """The first-use check compares every pass with the torch passes: a pass that writes other bits (here, one that
    does nothing) is named, so the calls keep the torch passes."""
    passes = native_cpu.library()["e4m3"]
    fields = {name: getattr(passes, name) for name in ("quantize", "reduce", "dequantize")}
    fields[broken] = lambda *arguments: None
    assert cpu_fp8._disagreement(native_cpu.WirePasses(**fields), fp8.E4M3) is not None
    assert cpu_fp8._disagreement(passes, fp8.E4M3) is None
    assert cpu_fp8.cpu_fp8_passes() == "compiled"


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build from nothing: an empty cache folder of this test's and the library cache cleared before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native_cpu.library.cache_clear()
    yield tmp_path / "cache" / "ddp-triton" / "native"
    native_cpu.library.cache_clear()


def test_no_compiler_warns_once_and_leaves_the_torch_passes(monkeypatch, fresh_build, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native_cpu.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_cpu.library() is None  # cached: no second warning


def test_a_failing_compiler_is_reported_with_its_message(monkeypatch, fresh_build, tmp_path):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\n"
                    "echo 'fake-cc: cannot build' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="fake-cc: cannot build"):
        assert native_cpu.library() is None
    assert not [p for p in fresh_build.iterdir()]  # no partial file left behind


def test_the_build_never_writes_through_or_loads_a_planted_link(compiled, fresh_build, tmp_path):
    """A link at the library's cached path (to a file of somebody's) is replaced by a fresh build, the linked file
    untouched; a cache folder others may write to is not used at all."""
    assert native_cpu.library() is not None
    (built,) = list(fresh_build.glob(f"{native_cpu.LIBRARY_NAME}-*.so"))
    victim = tmp_path / "victim.so"
    victim.write_bytes(b"not a library")
    built.unlink()
    built.symlink_to(victim)
    native_cpu.library.cache_clear()
    assert native_cpu.library() is not None
    assert victim.read_bytes() == b"not a library"
    assert built.is_file() and not built.is_symlink()

    native_cpu.library.cache_clear()
    os.chmod(fresh_build, 0o777)
    for old in fresh_build.iterdir():
        old.unlink()
    assert native_cpu.library() is not None
    assert not list(fresh_build.iterdir())  # built in a private temporary folder instead


def test_a_read_only_cache_builds_in_a_private_temporary_folder(compiled, fresh_build, monkeypatch, tmp_path):
    """A cache folder that cannot be made (its parent read-only here: a file stands where the folder would go)."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert native_cpu.library() is not None
    assert blocked.read_text() == "a file, not a folder"


def test_no_home_directory_builds_in_a_private_temporary_folder(compiled, fresh_build, monkeypatch):
    """Path.home() raises where no home directory is known (no $HOME, no password entry): no crash at first use."""
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(native_cpu.Path, "home", classmethod(no_home))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_cpu.library() is not None


_TEMPORARIES = """
import torch
from ddp_triton import kernels
from ddp_triton.kernels import fp8

layout = kernels.block_layout([5000], 2)
for i in range(50):
    # Every tensor but the call's own result is a temporary, freed as soon as nothing holds it: a fixed call must
    # hold them, a prepared call's work must be done with them before it returns.
    rows = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    kernels.quantize_blocks.prepare(torch.randn(5000), layout, rows, 0.5, residual=torch.zeros(5000)).fixed(
        torch.randn(5000), rows, torch.zeros(5000))()
    shard = torch.empty(layout.rows_per_shard * fp8.ROW_BYTES, dtype=torch.uint8)
    kernels.reduce_blocks.prepare(rows[: 2 * shard.numel()], 2, shard).fixed(
        torch.cat([rows[: shard.numel()]] * 2), shard, None)()
    dst = torch.empty(5000)
    kernels.dequantize_blocks.prepare(rows, layout, dst).fixed(rows.clone(), dst, None)()
    kernels.dequantize_blocks.prepare(rows, layout, torch.empty(5000, dtype=torch.bfloat16))(
        rows.clone(), torch.empty(5000, dtype=torch.bfloat16), None)
    junk = [torch.randn(4096) for _ in range(8)]  # reuses whatever was freed
    assert torch.isfinite(dst).all()
print("ok")
"""


def test_calls_on_temporaries_keep_the_tensors_they_write_alive(compiled):
    """The C functions get addresses: a fixed call made of temporaries (the one-line idiom) must not write into
    freed memory (it crashed the process, or corrupted its heap, before such calls held their tensors)."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _TEMPORARIES], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


def _in_a_process(code, env_changes):
    """Run ``code`` in a fresh interpreter (a crash or a changed float mode must not reach this one)."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", **env_changes)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)


def test_a_cached_library_cut_short_is_rebuilt_not_loaded(compiled, tmp_path):
    """A file cut short (a crash before it reached the disk, an interrupted copy) kept its name: loading it crashed
    every process with SIGBUS. Its bytes no longer match the SHA-256 recorded at build: it is built again."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    build = _in_a_process("from ddp_triton.kernels import native_cpu; print(native_cpu.library() is not None)", env)
    assert build.stdout.strip() == "True", build.stderr[-2000:]
    (built,) = list((tmp_path / "ddp-triton" / "native").glob(f"{native_cpu.LIBRARY_NAME}-*.so"))
    whole = built.read_bytes()
    with open(built, "r+b") as f:
        f.truncate(16384)
    again = _in_a_process("from ddp_triton.kernels import cpu_fp8, native_cpu\n"
                          "print(native_cpu.library() is not None, cpu_fp8.cpu_fp8_passes())", env)
    assert again.returncode == 0 and again.stdout.split() == ["True", "compiled"], (again.returncode,
                                                                                  again.stderr[-2000:])
    assert built.read_bytes() == whole


def test_a_compiler_that_turns_on_fast_math_is_not_used(compiled, tmp_path):
    """A compiler whose own settings add fast-math (as some do by default) links start-up code that flushes every
    subnormal of the process to zero: the library is refused, with a warning that says what happened."""
    import shutil

    wrapper = tmp_path / "fast-cc"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('cc') or shutil.which('gcc')} \"$@\" -ffast-math\n")
    wrapper.chmod(0o755)
    code = ("import warnings\nfrom ddp_triton.kernels import cpu_fp8, native_cpu\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    print(native_cpu.library() is None, cpu_fp8.cpu_fp8_passes())\n"
            "print('|'.join(str(w.message) for w in seen))")
    run = _in_a_process(code, {"XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": str(wrapper)})
    first, messages = run.stdout.split("\n", 1)
    assert first.split() == ["True", "torch"], run.stderr[-2000:]
    assert "turned on flush-to-zero" in messages


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_block_whose_scale_overflows_and_rows_with_other_scales(compiled, monkeypatch, fmt):
    """Two inputs where a fused multiply-add and the kernel's product-then-sum differ: a block near float32's top
    (its code times its scale overflows to inf: the residual is -inf, as in the kernel) and received rows whose scale
    is not a power of two (no honest quantize writes one; a product that is not exact). Both paths, same bits."""
    layout = block_layout([256], 1)
    src = torch.linspace(-1.0, 1.0, 256)
    src[0] = 3.3e38
    g = torch.Generator().manual_seed(0)
    received = torch.randint(0, 0x70, (2 * fp8.ROW_BYTES,), generator=g, dtype=torch.int32).to(torch.uint8)
    received.view(torch.int32).view(-1, fp8.ROW_WORDS)[:, -1].copy_(torch.tensor([1.1, 1.3]).view(torch.int32))
    results = {}
    for native in (True, False):
        monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
        residual, rows = torch.zeros(256), torch.zeros(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
        cpu_fp8.quantize_pass(src, layout, rows, 1.0, fmt, residual)()
        out, shard_residual = torch.zeros(fp8.ROW_BYTES, dtype=torch.uint8), torch.linspace(-1e-3, 1e-3, 128)
        cpu_fp8.reduce_pass(received, 2, out, fmt, shard_residual)()
        results[native] = (rows, residual.view(torch.int32), out, shard_residual.view(torch.int32))
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    assert results[True][1][0] == torch.tensor(float("-inf")).view(torch.int32)


def test_a_cache_under_a_folder_others_may_write_to_is_not_used(compiled, fresh_build, monkeypatch, tmp_path):
    """Another user could swap a folder above the cache (not sticky, writable by all) between the checks and the
    load: the library is built in a private temporary folder instead, and nothing is left in the cache."""
    open_to_all = tmp_path / "shared"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(open_to_all / "cache"))
    assert native_cpu.library() is not None
    assert not list((open_to_all / "cache" / "ddp-triton" / "native").iterdir())


# ---- E2M1 (kernels/blockscale_cpu.c through kernels.cpu_fp4) --------------------------------------------------------


def run_all_fp4(monkeypatch, native, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype):
    """Quantize, reduce, dequantize (with stats) and sum the blocks of ``received`` through the cpu_fp4 passes,
    compiled or torch."""
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
    residual = None if residual is None else residual.clone()
    shard_residual = None if shard_residual is None else shard_residual.clone()
    rows = torch.full((layout.n_rows * fp4.ROW_BYTES,), 0xAB, dtype=torch.uint8)
    cpu_fp4.quantize_pass(src, layout, rows, scale, residual)()
    out = torch.full((layout.rows_per_shard * fp4.ROW_BYTES,), 0xCD, dtype=torch.uint8)
    cpu_fp4.reduce_pass(received, ranks, out, shard_residual)()
    dst = torch.empty(layout.n_elements, dtype=dst_dtype)
    stats = torch.full((2,), 7.0)
    cpu_fp4.dequantize_pass(rows, layout, dst, stats)()
    shard_layout = block_layout([layout.rows_per_shard * 128], 1)
    summed = torch.full((shard_layout.n_elements,), 7.0)
    cpu_fp4.sum_blocks_pass(received, ranks, shard_layout, summed)()
    return rows, residual, out, shard_residual, dst, stats, summed


def assert_all_same(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        elif w.dtype in (torch.uint8, torch.int32):  # rows; float32 bits, NaNs included
            assert torch.equal(g, w)
        else:
            assert_same_bits(g, w)


def fp4_received(layout, ranks, seed):
    """What ``ranks`` ranks sent for one shard: rows quantized by the torch passes from values over float32's range."""
    shard = layout.rows_per_shard * fp4.ROW_BYTES
    copies = []
    for r in range(ranks):
        copy = torch.empty(layout.n_rows * fp4.ROW_BYTES, dtype=torch.uint8)
        torch_fp4.quantize_pass(cpu_fp4._self_check_values(layout.n_elements, seed + r), layout, copy, 1.0, None)()
        copies.append(copy[:shard])
    return torch.cat(copies)


FP4_SIZES = [pytest.param([128 * 40], id="whole-blocks"),
             pytest.param([128 * 3, 128 * torch_wire.CHUNK_ROWS + 77], id="two-steps-tail"),
             pytest.param([5], id="one-short-block"),
             pytest.param([0], id="empty"),
             pytest.param([2, 3, 5, 7, 11, 13, 127, 131, 257], id="odd-primes"),
             pytest.param([64, 4096, 64, 300, 0, 129], id="ragged"),
             pytest.param([77] * 40 + [128 * torch_wire.CHUNK_ROWS], id="ragged-two-steps")]
FP4_SCALES = pytest.mark.parametrize("scale, with_residual", [(0.25, True), (1.0, True), (0.125, False), (1.0, False)],
                                     ids=["scaled+ef", "ef", "scaled", "plain"])


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@FP4_SCALES
@pytest.mark.parametrize("sizes", FP4_SIZES)
def test_compiled_e2m1_passes_give_the_torch_passes_bits(compiled, monkeypatch, src_dtype, scale, with_residual,
                                                         sizes):
    compare_e2m1_passes(monkeypatch, 3, src_dtype, scale, with_residual, sizes)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@FP4_SCALES
@pytest.mark.parametrize("sizes", FP4_SIZES[2:6])
def test_compiled_e2m1_passes_give_the_torch_passes_bits_over_other_rank_counts(compiled, monkeypatch, ranks, scale,
                                                                                 with_residual, sizes):
    compare_e2m1_passes(monkeypatch, ranks, torch.float32, scale, with_residual, sizes)


def compare_e2m1_passes(monkeypatch, ranks, src_dtype, scale, with_residual, sizes):
    layout = block_layout(sizes, ranks)
    n = layout.n_elements
    src = cpu_fp4._self_check_values(n, seed=11).to(src_dtype)
    residual = cpu_fp4._self_check_values(n, seed=12) * 2.0**-10 if with_residual else None
    received = fp4_received(layout, ranks, seed=20)
    shard_residual = (cpu_fp4._self_check_values(layout.rows_per_shard * 128, seed=30) * 2.0**-12
                      if with_residual else None)
    dst_dtype = {torch.float32: torch.float32, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}[src_dtype]
    got = run_all_fp4(monkeypatch, True, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype)
    want = run_all_fp4(monkeypatch, False, src, layout, scale, residual, ranks, received, shard_residual, dst_dtype)
    assert_all_same(got, want)


def e2m1_probe_blocks():
    """Every E2M1 value, every midpoint and one float32 step either side of each, both signs, in groups of 31 probes
    and their largest value 6, scaled by 2^k from the bottom of float32's range (probes go subnormal) to its top (a
    group's 4 * 2^126 and 6 * 2^126 overflow when dequantized); then a zero block, a -0 block, a block of
    subnormals, and blocks with +inf, -inf and NaN in one group each."""
    values = torch.tensor(E2M1_VALUES)
    mid = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mid, torch.nextafter(mid, torch.tensor(-1.0)), torch.nextafter(mid, torch.tensor(9.0))])
    probes = torch.cat([probes, -probes])
    per_group = fp4.GROUP_ELEMENTS - 1
    probes = torch.cat([probes, torch.full(((-probes.numel()) % (per_group * 4),), -0.0)]).view(-1, per_group)
    groups = torch.cat([probes, torch.full((probes.shape[0], 1), 6.0)], dim=1).reshape(-1)
    blocks = [groups * 2.0**k for k in (-149, -140, -126, -60, -1, 0, 1, 60, 120, 125)]
    blocks.append(groups * 0.6 * 2.0**126)  # largest 3.6 * 2^126: scale byte 253 (2^126), code 6 overflows to inf
    special = torch.zeros(6, 128)
    special[1] = -0.0
    special[2] = torch.linspace(-1.0, 1.0, 128) * 2.0**-130
    special[3, 40], special[4, 100], special[5, 3] = float("inf"), float("-inf"), float("nan")
    return torch.cat(blocks + [special.reshape(-1)])


def test_compiled_e2m1_rounds_every_value_and_midpoint_at_every_scale(compiled, monkeypatch):
    """The rows of the definition (wire_reference.fp4_rows, a search in float64) and the torch passes' residual."""
    x = e2m1_probe_blocks()
    sizes = [x.numel() - 200, 200]  # the last block of the first tensor short
    layout = block_layout(sizes, 1)
    want_rows, _ = fp4_rows(x + 0.0, sizes)  # what is quantized: x plus the residual, 0 (-0.0 + 0.0 is +0.0)
    results = {}
    for native in (True, False):
        monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
        rows = torch.empty(layout.n_rows * fp4.ROW_BYTES, dtype=torch.uint8)
        residual = torch.zeros(x.numel())
        cpu_fp4.quantize_pass(x, layout, rows, 1.0, residual)()
        results[native] = (rows, residual)
        assert [bytes(r) for r in rows.view(-1, fp4.ROW_BYTES).tolist()] == want_rows
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1].view(torch.int32), results[False][1].view(torch.int32))
    assert (results[True][1] == float("-inf")).any(), "a value whose dequantized code overflows: residual -inf"


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_compiled_e2m1_decodes_every_code_and_scale_byte(compiled, monkeypatch, ranks):
    """Rows of random bytes (every code in both nibbles, every scale byte 0-255: 0 scales to zero, 254 and 253
    overflow, 0xFF is NaN), reduced over ``ranks`` ranks with a residual, dequantized to each dtype with stats and
    summed: the torch passes' bits; float32 values as the definition decodes them."""
    g = torch.Generator().manual_seed(ranks)
    rows_per_rank = 300
    received = torch.randint(0, 256, (ranks * rows_per_rank * fp4.ROW_BYTES,), generator=g,
                             dtype=torch.int32).to(torch.uint8)
    received.view(-1, fp4.ROW_BYTES)[:256, -1] = torch.arange(256, dtype=torch.uint8)  # every scale byte
    layout = block_layout([(rows_per_rank - 2) * 128 + 78, 50], 1)  # two short blocks
    results = {}
    for native in (True, False):
        monkeypatch.setenv(native_cpu.ENV_SWITCH, "1" if native else "0")
        out, residual = torch.empty(rows_per_rank * fp4.ROW_BYTES, dtype=torch.uint8), torch.zeros(rows_per_rank * 128)
        cpu_fp4.reduce_pass(received, ranks, out, residual)()
        got = [out, residual]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            dst, stats = torch.empty(layout.n_elements, dtype=dtype), torch.empty(2)
            cpu_fp4.dequantize_pass(received[: layout.n_rows * fp4.ROW_BYTES], layout, dst, stats)()
            got += [dst, stats]
        summed = torch.empty(layout.n_elements)
        cpu_fp4.sum_blocks_pass(received, ranks, layout, summed)()
        results[native] = got + [summed.view(torch.int32)]  # inf + -inf: the arithmetic's NaN, the same bits
    assert_all_same(results[True], results[False])
    # The definition's values, but for scale byte 0 (2^-127, never sent: scales are 2^-126 to 2^126), which every
    # path decodes as the float32 of bits 0 << 23, zero.
    codes = received[: rows_per_rank * fp4.ROW_BYTES].view(-1, fp4.ROW_BYTES)
    nibbles = torch.stack([codes[:, :64] & 15, codes[:, :64] >> 4], dim=2).reshape(-1, 128).long()
    scale_bytes = codes[:, 64:].long().repeat_interleave(fp4.GROUP_ELEMENTS, dim=1)
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float64)[nibbles & 7]
    want = torch.where(nibbles >= 8, -magnitudes, magnitudes) * torch.pow(2.0, scale_bytes.double() - 127)
    want = torch.where(scale_bytes == 0xFF, float("nan"), want.float()).masked_fill_(scale_bytes == 0, 0.0)
    want = torch.where(nibbles >= 8, -want.abs(), want)
    assert_same_bits(results[True][2], want.reshape(-1).index_select(0, layout.positions()))


def test_compiled_e2m1_library_with_other_bits_is_refused(compiled):
    """As for FP8: a pass that writes other bits (one that does nothing) is named by the first-use check."""
    passes = native_cpu.library()["e2m1"]
    fields = {name: getattr(passes, name) for name in ("quantize", "reduce", "dequantize")}
    for broken in fields:
        changed = dict(fields, **{broken: lambda *arguments: None})
        assert cpu_fp4._disagreement(native_cpu.WirePasses(**changed)) is not None
    assert cpu_fp4._disagreement(passes) is None
    assert cpu_fp4.cpu_fp4_passes() == "compiled"


def test_off_switch_keeps_the_torch_e2m1_passes(monkeypatch):
    def refuse():
        raise AssertionError("the library was asked for")

    monkeypatch.setenv(native_cpu.ENV_SWITCH, "0")
    monkeypatch.setattr(native_cpu, "library", refuse)
    layout = block_layout([256], 2)
    rows = torch.empty(layout.n_rows * fp4.ROW_BYTES, dtype=torch.uint8)
    cpu_fp4.quantize_pass(torch.randn(256), layout, rows, 0.5, torch.zeros(256))()
    cpu_fp4.dequantize_pass(rows, layout, torch.empty(256), None)()
    assert cpu_fp4.cpu_fp4_passes() == "torch"
