"""The wire-format kernels compiled for the GPU, and the FP8 and float32-sum exchanges over NCCL at world size 1.

Tier: GPU (skipped without CUDA). The same kernels run in Triton's interpreter in kernels/test_wire_kernels.py; here
the compiled code (hardware bfloat16 rounding, no FMA contraction) must give the torch path's bits.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bits import assert_same_bits
from ddp_triton.kernels import block_layout, dequantize_blocks, fp8, quantize_blocks, reduce_blocks, sum_slices
from ddp_triton.kernels import cpu_fp8, torch_wire
from ddp_triton.runtime.residuals import RESIDUAL_DTYPE
from wire_reference import fp8_average, quantize_dequantize

pytestmark = pytest.mark.gpu

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def gradient_like(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(n, generator=gen) * 10.0 ** (i % 7 - 4) for i, n in enumerate(sizes)])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_kernels_same_bits_as_torch_path_on_cuda(fmt, dtype):
    """Quantize, reduce and dequantize with the residuals error feedback keeps (``RESIDUAL_DTYPE``): the kernels add
    them in float32 and round what is left once to their dtype, in hardware here."""
    sizes, ranks = [1000, 129, 3, 70000, 128], 3
    spec = fp8.FORMATS[fmt]
    layout = block_layout(sizes, ranks)
    x = gradient_like(sizes).to(dtype)
    residual = (gradient_like(sizes, seed=1) * 1e-3).to(RESIDUAL_DTYPE)
    rows = torch.empty(layout.n_rows * fp8.ROW_BYTES, dtype=torch.uint8)
    res = residual.clone()
    cpu_fp8.quantize_pass(x, layout, rows, 0.25, spec, res)()
    rows_gpu, res_gpu = torch.empty_like(rows).cuda(), residual.cuda()
    quantize_blocks(x.cuda(), layout, rows_gpu, 0.25, fmt=fmt, residual=res_gpu)
    assert torch.equal(rows_gpu.cpu(), rows)
    assert_same_bits(res_gpu.cpu(), res)
    per = layout.rows_per_shard
    received = rows.view(-1, fp8.ROW_BYTES)[:per].repeat(ranks, 1).reshape(-1)
    out = torch.empty(per * fp8.ROW_BYTES, dtype=torch.uint8)
    shard_res = torch.full((per * 128,), 1e-4, dtype=RESIDUAL_DTYPE)
    out_gpu, shard_res_gpu = out.cuda(), shard_res.cuda()
    cpu_fp8.reduce_pass(received, ranks, out, spec, shard_res)()
    reduce_blocks(received.cuda(), ranks, out_gpu, fmt=fmt, residual=shard_res_gpu)
    assert torch.equal(out_gpu.cpu(), out)
    assert_same_bits(shard_res_gpu.cpu(), shard_res)
    dst, dst_gpu = torch.empty(layout.n_elements, dtype=dtype), torch.empty(layout.n_elements, dtype=dtype,
                                                                            device="cuda")
    cpu_fp8.dequantize_pass(rows, layout, dst, spec, None)()
    dequantize_blocks(rows.cuda(), layout, dst_gpu, fmt=fmt)
    assert_same_bits(dst_gpu.cpu(), dst)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_slices_same_bits_as_torch_path_on_cuda(dtype):
    received = (torch.randn(8 * 100003) * 50).to(dtype)
    out = torch.empty(100003, dtype=dtype)
    torch_wire.sum_slices_pass(received, 8, out)()
    out_gpu = sum_slices(received.cuda(), 8, torch.empty(100003, dtype=dtype, device="cuda"))
    assert_same_bits(out_gpu.cpu(), out)


def test_fixed_wire_calls_take_the_direct_path_and_agree_with_plain_calls():
    sizes, ranks, per_row = [1000, 129, 3, 70000], 3, fp8.ROW_BYTES
    layout = block_layout(sizes, ranks)
    x = gradient_like(sizes).cuda()
    per = layout.rows_per_shard
    received = torch.empty(per * per_row * ranks, dtype=torch.uint8, device="cuda")
    plain, fixed = ({"rows": torch.zeros(layout.n_rows * per_row, dtype=torch.uint8, device="cuda"),
                     "res": torch.zeros_like(x), "out": torch.zeros(per * per_row, dtype=torch.uint8, device="cuda"),
                     "shard_res": torch.zeros(per * 128, device="cuda"), "dst": torch.empty_like(x),
                     "stats": torch.zeros(2, device="cuda"),
                     "sum": torch.empty(len(x) // ranks, dtype=torch.bfloat16, device="cuda")} for _ in range(2))
    slices16 = x[: len(x) // ranks * ranks].to(torch.bfloat16)
    quantize = quantize_blocks.prepare(x, layout, fixed["rows"], 0.25, residual=fixed["res"]).fixed(
        x, fixed["rows"], fixed["res"])
    reduce = reduce_blocks.prepare(received, ranks, fixed["out"], residual=fixed["shard_res"]).fixed(
        received, fixed["out"], fixed["shard_res"])
    dequantize = dequantize_blocks.prepare(fixed["rows"], layout, fixed["dst"], stats=fixed["stats"]).fixed(
        fixed["rows"], fixed["dst"], fixed["stats"])
    summed = sum_slices.prepare(slices16, ranks, fixed["sum"]).fixed(slices16, fixed["sum"])
    for step in range(2):  # the second step reads the buffers' new contents
        x.mul_(-0.5 if step else 1.0)
        quantize_blocks(x, layout, plain["rows"], 0.25, residual=plain["res"])
        quantize()
        received.copy_(plain["rows"][: per * per_row].repeat(ranks))
        reduce_blocks(received, ranks, plain["out"], residual=plain["shard_res"])
        reduce()
        dequantize_blocks(plain["rows"], layout, plain["dst"], stats=plain["stats"])
        dequantize()
        sum_slices(slices16, ranks, plain["sum"])
        summed()
        torch.cuda.synchronize()
        for name, want in plain.items():
            if want.dtype == torch.uint8:
                assert torch.equal(fixed[name], want), name
            else:
                assert_same_bits(fixed[name], want)
    assert quantize.direct and reduce.direct and dequantize.direct and summed.direct


def test_prepared_calls_take_each_calls_buffers_through_the_direct_launch(monkeypatch):
    """Prepared once, run on new buffers at every call (as FSDP hands them): the plain calls' bits on those buffers,
    every launch a direct one; a source 4 bytes past a 16-byte boundary is compiled for once, with the same bits."""
    import importlib

    from ddp_triton import kernels

    launch_module = importlib.import_module("ddp_triton.kernels.launch")
    assert launch_module._direct_launch_available(torch.device("cuda"))  # its self-check launches too: run it first
    direct, real_launch_with = [], launch_module._DirectLaunch.launch_with
    monkeypatch.setattr(launch_module._DirectLaunch, "launch_with",
                        lambda self, values: direct.append(1) or real_launch_with(self, values))

    sizes, ranks, per_row = [1000, 129, 3, 70000], 3, fp8.ROW_BYTES
    layout, row_layout = block_layout(sizes * ranks, ranks), block_layout(sizes, 1)
    n = layout.n_elements

    def buffers(seed):
        return {"src": gradient_like(sizes * ranks, seed).cuda(), "rows": torch.empty(layout.n_rows * per_row,
                dtype=torch.uint8, device="cuda"), "res": gradient_like(sizes * ranks, seed + 1).cuda() * 1e-3,
                "sum": torch.empty(row_layout.n_elements, device="cuda"),
                "packed": torch.empty(n, dtype=torch.bfloat16, device="cuda")}

    first = buffers(0)
    quantize = kernels.quantize_blocks.prepare(first["src"], layout, first["rows"], 0.25, residual=first["res"])
    add = kernels.sum_blocks.prepare(first["rows"], ranks, row_layout, first["sum"])
    pack = kernels.pack.prepare([first["src"]], first["packed"], 0.25)
    calls = [(buffers(seed), buffers(seed)) for seed in (1, 2, 3)]
    calls[-1][0]["src"] = torch.cat([torch.zeros(1, device="cuda"), calls[-1][0]["src"]])[1:]  # 4 bytes past 16
    calls.append(calls[-1])  # the same buffers again: a relaunch of the last call's values
    for got, want in calls:
        before = len(direct)
        quantize(got["src"], got["rows"], got["res"])  # the residual carried: a repeat must update it again
        add(got["rows"], got["sum"])
        pack([got["src"]], got["packed"])
        assert len(direct) == before + 3
        kernels.quantize_blocks(want["src"], layout, want["rows"], 0.25, residual=want["res"])
        kernels.sum_blocks(want["rows"], ranks, row_layout, want["sum"])
        kernels.pack([want["src"]], want["packed"], 0.25)
        torch.cuda.synchronize()
        assert torch.equal(got["rows"], want["rows"])
        for name in ("res", "sum", "packed"):
            assert_same_bits(got[name], want[name])
    assert [len(call._compiled) for call in (quantize, add, pack)] == [2, 1, 2]


@pytest.mark.parametrize("options", [dict(comm_dtype=torch.float8_e4m3fn),
                                     dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)],
                         ids=["fp8-ef", "bf16-fp32sum"])
def test_sharded_exchanges_over_nccl(nccl_world_of_one, options):
    """NCCL's all-to-all and all-gather at world size 1, through the hook, against the reference's bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.GELU(), nn.Linear(300, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 300), nn.GELU(), nn.Linear(300, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, profile=None, **options)
    x = torch.randn(32, 64, device="cuda")
    params = list(reference.parameters())
    first = [[torch.zeros_like(p, device="cpu") for p in params]]
    second = [torch.zeros_like(p, device="cpu") for p in params]
    for _ in range(3):  # the third step runs on the buckets DDP rebuilt after the first
        ddp.zero_grad()
        reference.zero_grad()
        ddp(x).square().mean().backward()
        reference(x).square().mean().backward()
        grads = [[p.grad.cpu() for p in params]]
        if options["comm_dtype"] == torch.bfloat16:
            want = [g.to(torch.bfloat16).float() for g in grads[0]]
        else:
            want = fp8_average(grads, options["comm_dtype"], first, second)
        for p, w in zip(model.parameters(), want):
            assert_same_bits(p.grad.cpu(), w)
    assert state.passes == 3


@pytest.mark.parametrize("options", [dict(), dict(comm_dtype=torch.float8_e4m3fn), dict(comm_dtype="fp4e2m1+ef")],
                         ids=["bf16-fp32sum", "fp8-ef", "fp4e2m1-ef"])
def test_fsdp_reduce_scatter_over_nccl_same_bits_as_on_cpu(nccl_world_of_one, options):
    """FSDP2 with ours at world size 1 on CUDA (FSDP calls no reduce-scatter there), then our reduce-scatter called
    as FSDP calls it, over NCCL: the CUDA kernels and NCCL's all-to-all give the CPU path's bits (that path is
    checked against the formats' definitions at 2 and 3 gloo ranks in tests/dist/runtime/test_fsdp.py). The
    block-scaled formats' residual is the one error feedback keeps, in bfloat16 (``residuals.RESIDUAL_DTYPE``)."""
    import ddp_triton.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.GELU(), nn.Linear(300, 8)).cuda()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    state = ddp_triton.fsdp.register(model, **options)
    model(torch.randn(32, 64, device="cuda")).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    comm = next(c for c in state.comms if c.chunk_sizes())
    sizes = comm.chunk_sizes()
    flat = gradient_like(sizes)
    on_gpu = torch.empty(sum(sizes), device="cuda")
    comm(on_gpu, flat.cuda(), dist.group.WORLD, dist.ReduceOp.AVG)
    # The CPU path of the same call: a gloo group of one in this process is not available, so the formats' own
    # definitions at one rank stand in: bf16 rounding, or FP8 / E2M1 blocks that follow the chunks (one rank's sum is
    # its dequantized value as it is, -0.0 included: sum_blocks starts from the first rank's value).
    if options:
        want = torch.cat([quantize_dequantize(part, state.wire.comm_dtype) for part in flat.split(sizes)])
        # What the rounding left out, kept for the next step: computed in float32, stored rounded once to bfloat16.
        assert comm.residual.dtype == RESIDUAL_DTYPE
        assert_same_bits(comm.residual.cpu(), (flat - want).to(RESIDUAL_DTYPE))
    else:
        want = flat.to(torch.bfloat16).float()
    assert_same_bits(on_gpu.cpu(), want)
