"""The compiled path on one GPU: kernel bits on CUDA, the prepared call fixed to its tensors (a direct launch), and
triton_hook under DDP over NCCL at world size 1.

Tier: GPU (skipped without CUDA). The same kernels' bits in Triton's interpreter are in test_kernels.py.
"""

import dataclasses
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bits import assert_same_bits, reference_pack
from ddp_triton.kernels import launch, pack, unpack
from bits import DTYPE_IDS, DTYPES, EDGE_FLOAT32, random_bit_patterns

pytestmark = pytest.mark.gpu


def test_fixed_call_takes_the_direct_path_and_agrees():
    grads = [torch.randn(n, device="cuda") for n in (5000, 17, 70000)]
    out = torch.empty(75017, dtype=torch.bfloat16, device="cuda")
    again = pack.prepare(grads, out, 0.25).fixed(grads, out)
    again()
    assert launch._direct_launch_ok, "the direct launch failed its self-check on this Triton version"
    assert again.direct
    for g in grads:
        g.mul_(-2)
    again()
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.25))


@pytest.mark.parametrize("gabv", [False, True])
def test_triton_hook_over_nccl(nccl_world_of_one, gabv):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=gabv, bucket_cap_mb=0.01)
    state = ddp_triton.register(ddp, comm_dtype=torch.bfloat16, profile=None)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # the third step runs on the buckets DDP rebuilt after the first
        ddp.zero_grad()
        reference.zero_grad()
        ddp(x).square().mean().backward()
        reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        # world size 1: the hook's result is the gradient rounded once to bfloat16
        assert_same_bits(p.grad, q.grad.to(torch.bfloat16).float())
    assert len(state.plans) >= 2
    assert all(e.exchange.stages[0].compute.direct and e.exchange.finish.direct for e in state.plans.values())


def test_triton_hook_scaled_kernels_over_nccl(nccl_world_of_one):
    """At world size 1 the division is 1: force factors so the hook runs the scaled kernels it runs at N > 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    state = ddp_triton.register(ddp, comm_dtype=torch.float16, profile=None)
    state.context = dataclasses.replace(state.context, world_size=16)  # the float16 split: 0.25 before, 0.25 after
    x = torch.randn(32, 64, device="cuda")
    ddp(x).square().mean().backward()
    reference(x).square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_same_bits(p.grad, q.grad.mul(0.25).to(torch.float16).float().mul(0.25))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=DTYPE_IDS)
def test_compiled_kernel_bits_on_cuda(src_dtype, out_dtype):
    tensors = [random_bit_patterns(n, src_dtype, seed=n).cuda() for n in (1, 4097, 100_003)]
    tensors.append(EDGE_FLOAT32.to(src_dtype).cuda())
    for scale in (1.0, 1 / 8, 1 / 3, 3.0):
        out = torch.empty(sum(t.numel() for t in tensors), dtype=out_dtype, device="cuda")
        pack(tensors, out, scale)
        expected = reference_pack([t.cpu() for t in tensors], out_dtype, scale)
        assert_same_bits(out, expected)
        back = [torch.empty_like(t) for t in tensors]
        unpack.prepare(out, back, 1 / scale).fixed(out, back, None)()
        assert_same_bits(torch.cat(back), out.cpu().float().mul(1 / scale).to(src_dtype))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_compiled_contiguous_kernel_scaled_on_cuda(out_dtype):
    """The hook's own case: one aligned bucket, scaled, full vector blocks plus a tail, every bit pattern."""
    bucket = torch.cat([EDGE_FLOAT32, random_bit_patterns(3 * 4096 + 977 - EDGE_FLOAT32.numel(), torch.float32)])
    bucket = bucket.cuda()
    for scale in (1 / 8, 1 / 3, 0.5):
        comm = torch.empty(bucket.numel(), dtype=out_dtype, device="cuda")
        pack.prepare([bucket], comm, scale).fixed([bucket], comm)()
        assert_same_bits(comm, reference_pack([bucket.cpu()], out_dtype, scale))
        back = torch.empty_like(bucket)
        stats = torch.zeros(2, device="cuda")
        unpack(comm, [back], 2.0, stats=stats)
        expected = comm.cpu().float().mul(2.0)
        assert_same_bits(back, expected)
        assert int(stats[1]) == int((~torch.isfinite(expected)).sum())


def test_more_than_2_to_the_31_elements_on_cuda():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 1000
    if free < n * 6 + (1 << 30):
        pytest.skip("not enough GPU memory")
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    src[-1000:] = 3.0
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    pack([src], out, 0.5)
    # src[-1000:] starts at index 2**31: the last element below it keeps 0.5, from 2**31 on it is 1.5
    assert out[0].item() == 0.5 and out[2**31 - 1].item() == 0.5 and out[2**31].item() == 1.5 and out[-1].item() == 1.5
    del src, out
    torch.cuda.empty_cache()


def test_misaligned_full_blocks_on_cuda():
    """Full blocks at offsets that are not multiples of 16 elements (after a 17-element tensor) take the masked
    path: on the old kernel they compiled to 16-byte accesses and faulted with a misaligned address."""
    grads = [torch.randn(n, device="cuda") for n in (3000, 17, 5000, 4096 * 3 + 1, 31)]
    total = sum(g.numel() for g in grads)
    out = torch.empty(total, dtype=torch.bfloat16, device="cuda")
    pack(grads, out, 0.125)
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.125))
    back = [torch.empty_like(g) for g in grads]
    unpack(out, back, 8.0)
    torch.cuda.synchronize()
    assert_same_bits(torch.cat(back), out.cpu().float().mul(8.0))


def test_fixed_call_from_a_thread_without_a_current_device():
    """The direct launch goes to its tensors' device, also from a fresh thread (no current context set there)."""
    import threading

    grads = [torch.randn(n, device="cuda") for n in (5000, 17, 70000)]
    out = torch.empty(75017, dtype=torch.bfloat16, device="cuda")
    bound = pack.prepare(grads, out, 0.5).fixed(grads, out)
    bound()  # compiles the direct launch on this thread
    assert bound.direct
    out.zero_()
    torch.cuda.synchronize()
    errors = []

    def run():
        try:
            bound()
            torch.cuda.synchronize(grads[0].device)
        except Exception as exc:  # brought back to the test thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.5))


def test_concurrent_plain_packs_from_threads():
    """Plain pack() from several threads at once, each on its own tensors: every thread's bits."""
    from concurrent.futures import ThreadPoolExecutor

    layouts = [[torch.randn(n + k, device="cuda") for n in (300, 17, 4100)] for k in range(8)]

    def work(grads):
        out = torch.empty(sum(g.numel() for g in grads), dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            pack(grads, out, 0.25)
        torch.cuda.synchronize()
        return out

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, layouts))
    for grads, out in zip(layouts, results):
        assert_same_bits(out, reference_pack([g.cpu() for g in grads], torch.bfloat16, 0.25))


def test_launch_hooks_are_honoured():
    """With a Triton launch hook installed (as Proton installs one), a fixed call's direct launch gives way to
    Triton's launcher, which calls it."""
    seen = []
    hooks = launch._HOOKS
    grads = [torch.randn(n, device="cuda") for n in (4096, 300)]
    out = torch.empty(4396, dtype=torch.bfloat16, device="cuda")
    bound = pack.prepare(grads, out, 0.5).fixed(grads, out)
    bound()
    assert bound.direct
    chain = getattr(hooks, "launch_enter_hook")

    def hook(metadata):
        seen.append(metadata)

    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        hooks.launch_enter_hook = hook
    try:
        bound()
        pack(grads, out, 0.5)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            hooks.launch_enter_hook = None
    assert len(seen) == 2
    assert not launch.launch_hooks_installed()


CAPTURE_PROBE = r"""
import torch
from ddp_triton.kernels import launch, pack, unpack

grads = [torch.randn(n, device="cuda") for n in (3000, 17, 5000)]
bucket = torch.randn(8017, device="cuda")
flat = torch.empty(8017, dtype=torch.bfloat16, device="cuda")
comm = torch.empty(8017, dtype=torch.bfloat16, device="cuda")
# Compile the kernels through Triton's launcher (plain calls: not the direct launch's self-check) and fix the calls
# (which plans their work lists) before capture, as a warm-up would.
pack(grads, flat, 0.5)
unpack(flat, grads, 2.0)
pack([bucket], comm, 0.25)
pack_grads = pack.prepare(grads, flat, 0.5).fixed(grads, flat)
unpack_grads = unpack.prepare(flat, grads, 2.0).fixed(flat, grads, None)
pack_bucket = pack.prepare([bucket], comm, 0.25).fixed([bucket], comm)
flat.zero_()
for g in grads:
    g.copy_(torch.randn_like(g))
torch.cuda.synchronize()
assert launch._direct_launch_ok is None
stream = torch.cuda.Stream()
graph = torch.cuda.CUDAGraph()
with torch.cuda.stream(stream):
    with torch.cuda.graph(graph, stream=stream):
        pack_grads(); unpack_grads(); pack_bucket()  # their first calls in the process, inside capture
assert launch._direct_launch_ok is None, "the self-check ran inside capture"
for g in grads:
    g.mul_(3)
expected_flat = torch.cat(grads).mul(0.5).to(torch.bfloat16)
expected_grads = expected_flat.float().mul(2.0)
bucket.mul_(-1)
expected_comm = bucket.mul(0.25).to(torch.bfloat16)
graph.replay()
torch.cuda.synchronize()
assert torch.equal(flat.view(torch.int16), expected_flat.view(torch.int16))
assert torch.equal(torch.cat(grads), expected_grads)
assert torch.equal(comm.view(torch.int16), expected_comm.view(torch.int16))
pack_grads()  # outside capture: compiles the direct launch now
assert launch._direct_launch_ok is True and pack_grads.direct
print("ok")
"""


def test_first_call_inside_cuda_graph_capture_then_replay():
    """Fixed calls first called before the direct launch's self-check has run, inside capture (where it may not
    synchronise): the graph records Triton's launches and replays them with the right bits; outside capture the call
    goes direct. In a fresh process, so that nothing has run the self-check yet."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", CAPTURE_PROBE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_hook_fixed_calls_replay_in_a_cuda_graph():
    """The hook's kind of launch (a prepared call fixed to the bucket, direct) captured and replayed: same bits as
    eager."""
    bucket = torch.randn(3 * 4096 + 977, device="cuda")
    comm = torch.empty(bucket.numel(), dtype=torch.bfloat16, device="cuda")
    pack_bucket = pack.prepare([bucket], comm, 1 / 8).fixed([bucket], comm)
    unpack_bucket = unpack.prepare(comm, [bucket], 1.0).fixed(comm, [bucket], None)
    pack_bucket()
    unpack_bucket()
    torch.cuda.synchronize()
    assert pack_bucket.direct and unpack_bucket.direct
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            pack_bucket()
            comm.mul_(2)
            unpack_bucket()
    source = torch.randn(bucket.numel(), device="cuda")
    bucket.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(bucket, source.mul(1 / 8).to(torch.bfloat16).mul(2).float())
