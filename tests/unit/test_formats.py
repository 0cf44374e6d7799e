"""The wire formats' one vocabulary (``ddp_triton.formats``): names read and printed, register's options both ways,
what each format is, and the errors. No processes, no device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ddp_triton.formats import (BLOCK_SCALED, FLAT_NAMES, FP8_BLOCK, FP8_BLOCK_BYTES, TRAFFIC, WIRES, WireFormat,
                                canonical_name, sorted_by_preference, traffic_format, traffic_of)
from ddp_triton.machine import cost_model as cm

ALL_NAMES = FLAT_NAMES + tuple(f"two-level {name}" for name in FLAT_NAMES)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_name_reads_and_prints_back_and_round_trips_through_the_options(name):
    fmt = WireFormat.parse(name)
    assert fmt.name == str(fmt) == name
    assert WireFormat.from_options(**fmt.options()) == fmt
    assert fmt.two_level == name.startswith("two-level ")
    assert fmt.flat().name == name.removeprefix("two-level ")


def test_spellings_that_read_as_a_format():
    assert canonical_name("two-level-bf16") == "two-level bf16"
    assert canonical_name("  fp8e4m3 ") == "fp8e4m3"
    assert canonical_name("bf16+fp32sum") == canonical_name("bf16+fp32sum")
    assert WireFormat.parse("fp8e4m3") == WireFormat("fp8e4m3", fp32_sum=True)  # FP8 always sums in float32
    assert canonical_name("mxfp4+ef") == canonical_name("e2m1+ef") == "fp4e2m1+ef"  # E2M1's aliases
    assert canonical_name("two-level mxfp4") == "two-level fp4e2m1"


@pytest.mark.parametrize("bad, match", [
    pytest.param("fp9", "unknown wire format 'fp9'; known: fp32, ", id="unknown-dtype"),
    pytest.param("bf16+fp32sum+fp32sum", "unknown wire format 'bf16\\+fp32sum\\+fp32sum'", id="repeated-suffix"),
    pytest.param("bf16+int8", "unknown wire format", id="unknown-suffix"),
    pytest.param("bf16+ef", "'bf16\\+ef': error feedback \\(\\+ef\\) is for the block-scaled formats only \\(fp8e4m3, "
                 "fp8e5m2, fp4e2m1\\)", id="ef-on-16-bit"),
    pytest.param("fp4e2m1+fp32sum", "\\+fp32sum is for bf16 and fp16", id="fp32sum-on-fp4"),
    pytest.param("fp4", "unknown wire format 'fp4'", id="fp4-is-not-a-name"),
    pytest.param("fp32+fp32sum", "'fp32\\+fp32sum': \\+fp32sum is for bf16 and fp16", id="fp32sum-on-fp32"),
    pytest.param("fp8e4m3+fp32sum", "\\+fp32sum is for bf16 and fp16", id="fp32sum-on-fp8"),
    pytest.param(3, "a wire format name is a string, got int", id="not-a-string"),
])
def test_a_bad_name_is_an_error_naming_it(bad, match):
    with pytest.raises(ValueError, match=match):
        WireFormat.parse(bad)


@pytest.mark.parametrize("kwargs, name", [
    (dict(comm_dtype=torch.float32, accumulate_dtype=torch.float32), "fp32"),  # float32 already sums in float32
    (dict(comm_dtype=torch.float16, accumulate_dtype=torch.float32, hierarchical=True), "two-level fp16+fp32sum"),
    (dict(comm_dtype=torch.float8_e5m2, accumulate_dtype=None), "fp8e5m2+ef"),  # error feedback unless False
    (dict(comm_dtype=torch.float8_e4m3fn, error_feedback=False), "fp8e4m3"),
    pytest.param(dict(comm_dtype=getattr(torch, "float4_e2m1fn_x2", None)), "fp4e2m1+ef",  # EF unless False, as FP8
                 marks=pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"),
                                          reason="torch < 2.8 has no E2M1 dtype"),
                 id="float4_e2m1fn_x2"),
    (dict(comm_dtype="fp4e2m1+ef"), "fp4e2m1+ef"),  # a format's name says it all
    (dict(comm_dtype="fp4e2m1+ef", hierarchical=True), "two-level fp4e2m1+ef"),
    (dict(comm_dtype="fp4e2m1+ef", accumulate_dtype=torch.float32, error_feedback=True), "fp4e2m1+ef"),  # agree
    (dict(comm_dtype="mxfp4"), "fp4e2m1"),
    (dict(comm_dtype="fp8e4m3+ef"), "fp8e4m3+ef"),
    (dict(comm_dtype="bf16+fp32sum"), "bf16+fp32sum"),
    (dict(comm_dtype="two-level bf16"), "two-level bf16"),
])
def test_register_options_name_a_format(kwargs, name):
    assert WireFormat.from_options(**kwargs).name == name


@pytest.mark.parametrize("kwargs, match", [
    (dict(comm_dtype="bf17"), "comm_dtype: unknown wire format 'bf17'; known: fp32, .*fp4e2m1\\+ef"),
    (dict(comm_dtype="fp4e2m1+ef", error_feedback=False), "comm_dtype='fp4e2m1\\+ef' says error feedback is on, "
                                                         "error_feedback=False"),
    (dict(comm_dtype="bf16", accumulate_dtype=torch.float32), "comm_dtype='bf16' sums in bfloat16, accumulate_dtype"),
    (dict(comm_dtype="fp4e2m1+ef", accumulate_dtype=torch.float64), "accumulate_dtype must be"),
    (dict(comm_dtype=torch.int8), "comm_dtype must be one of.*torch.float4_e2m1fn_x2, or a wire format's name.*got "
                                  "torch.int8"),
    (dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float64), "accumulate_dtype must be.*torch.float64"),
    (dict(comm_dtype=torch.bfloat16, error_feedback=True), "error_feedback applies to FP8"),
    (dict(comm_dtype=torch.float8_e4m3fn, error_feedback=1), "error_feedback must be True, False or None, got 1"),
    (dict(comm_dtype=torch.bfloat16, hierarchical="yes"), "hierarchical must be True or False, got 'yes'"),
])
def test_bad_register_options_are_an_error_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WireFormat.from_options(**kwargs)


@pytest.mark.parametrize("fields, match", [
    (dict(wire="fp8e4m3"), "FP8 sums\\) are always float32"),
    (dict(wire="fp4e2m1"), "block-scaled sums"),
    (dict(wire="fp32", fp32_sum=True), "fp32 sums in float32 already"),
    (dict(wire="bf16", error_feedback=True), "error feedback"),
    (dict(wire="int8"), "unknown wire dtype 'int8'"),
    (dict(wire="bf16", two_level=1), "two_level must be True or False, got 1"),
])
def test_a_format_that_cannot_be_is_never_built(fields, match):
    with pytest.raises(ValueError, match=match):
        WireFormat(**fields)


@pytest.mark.parametrize("name", FLAT_NAMES)
def test_what_each_format_is_agrees_with_torch_and_with_the_cost_model(name):
    fmt = WireFormat.parse(name)
    from ddp_triton import kernels

    assert fmt.comm_dtype == getattr(torch, fmt.wire_dtype, fmt.wire_dtype)  # E2M1 before torch 2.8: its name
    assert fmt.accumulate_dtype == (torch.float32 if fmt.sharded else None)
    assert fmt.sum_dtype == ("float32" if fmt.sharded or fmt.wire == "fp32" else fmt.wire_dtype)
    assert fmt.block_size == (FP8_BLOCK if fmt.wire.startswith(("fp8", "fp4")) else None)
    assert fmt.block_scaled == (fmt.block_size is not None) == (fmt.wire in BLOCK_SCALED)
    if fmt.block_scaled:  # the declared row is the kernels' row for the format's fmt (132 for FP8, 68 for E2M1)
        assert fmt.row_bytes == kernels.row_bytes(fmt.comm_dtype) == (68 if fmt.wire == "fp4e2m1" else 132)
        assert fmt.bytes_per_element == fmt.row_bytes / FP8_BLOCK
    else:
        assert fmt.bytes_per_element == torch.empty(0, dtype=fmt.comm_dtype).element_size()
    # What the cost model sends for a bucket that fills whole blocks on every rank: bytes_per_element per element.
    n, ranks = FP8_BLOCK * 4 * 3, 4
    collectives = cm.wire_collectives(n, name, ranks)
    assert {msg for _, msg in collectives} == {n * fmt.bytes_per_element}
    assert len(collectives) == (2 if fmt.sharded else 1)
    assert traffic_of(name) == fmt.traffic
    assert fmt.traffic in TRAFFIC or fmt.traffic == fmt.wire  # a class of its own is the format's own name
    assert traffic_format(name).bytes_per_element == fmt.bytes_per_element


def test_e2m1_is_the_kernels_format_staged_and_fed_back_as_fp8():
    from ddp_triton import kernels

    fp4, fp8 = WireFormat.parse("fp4e2m1+ef"), WireFormat.parse("fp8e4m3+ef")
    assert fp4.comm_dtype == kernels.FP4_E2M1  # what the passes take as fmt
    assert (fp4.sharded, fp4.error_feedback, fp4.sum_dtype) == (fp8.sharded, fp8.error_feedback, fp8.sum_dtype)
    assert fp4.bytes_per_element == 0.53125 and fp4.row_bytes == 68
    assert [fp4.chunks_keep_bits(1, n) for n in (2, 3, 4)] == [fp8.chunks_keep_bits(1, n) for n in (2, 3, 4)]
    assert fp4.chunks_keep_bits(2, 3)  # two-level: a reduce-scatter in the node, float32 sums between nodes
    assert sorted_by_preference(["fp4e2m1+ef", "fp8e5m2", "fp8e4m3+ef", "fp4e2m1"]) == [
        "fp8e4m3+ef", "fp8e5m2", "fp4e2m1+ef", "fp4e2m1"]  # below every FP8 format (bench/RESULTS.md, H22)
    assert [w.short for w in WIRES] == ["fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2", "fp4e2m1"]
    # Half of FP8's bytes in the cost model; a bucket of 100 blocks over 4 ranks pads to 100 rows.
    assert cm.wire_collectives(128 * 100, "fp4e2m1+ef", 4) == [("all_to_all", 6800), ("all_gather", 6800)]


def test_the_fp8_block_is_the_kernels_block():
    from ddp_triton.kernels.fp8 import BLOCK_ELEMENTS, ROW_BYTES

    assert (FP8_BLOCK, FP8_BLOCK_BYTES) == (BLOCK_ELEMENTS, ROW_BYTES)


def test_two_level_formats_have_no_single_traffic_class_and_unknown_names_none():
    with pytest.raises(ValueError, match="'two-level bf16': a two-level format has no single traffic class"):
        traffic_of("two-level bf16")
    with pytest.raises(ValueError, match="unknown wire format 'fp4'"):
        traffic_of("fp4")
    assert [traffic_of(t) for t in TRAFFIC] == list(TRAFFIC)


def test_accuracy_order_is_the_flat_names_then_their_two_level_forms():
    shuffled = list(reversed(ALL_NAMES))
    assert sorted_by_preference(shuffled) == [n for pair in zip(FLAT_NAMES, ALL_NAMES[len(FLAT_NAMES):])
                                               for n in pair]


def test_reading_a_format_loads_no_torch():
    code = ("import sys, ddp_triton.formats as f; f.WireFormat.parse('two-level fp8e4m3+ef').rank; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
