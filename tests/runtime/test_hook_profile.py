"""triton_hook following a tuning profile: each bucket goes to the group its size calls for, ranks must agree.

Tier: gloo multi-process on CPU. Gloo has one all-reduce algorithm, so every algorithm maps to the same group (the
choice is still made and recorded per bucket); the NCCL groups themselves are tested in test_algo_groups.py.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.machine.profile import Profile, ProfileError, TableEntry
from ddp_triton.runtime.bucket import collective_averages
from ddp_helpers import (FP32_TOL, SPLIT_BYTES, assert_params_close, make_model, torch_path_workers, train_ddp,
                         train_reference, two_range_profile)

def _dispatch_worker(rank, world_size):
    model = make_model()
    reference = train_reference(copy.deepcopy(model), steps=4)
    ddp = DDP(model, bucket_cap_mb=0.002)  # buckets of a few KiB up to ~4 KiB and the larger layers alone
    profile = two_range_profile(world_size)
    state = ddp_triton.register(ddp, comm_dtype=torch.float32, profile=profile)
    assert state.profile is profile and state.active_profile is profile
    assert set(state.algorithm_groups) == {"ring", "tree"}
    assert all(g is state.group for g in state.algorithm_groups.values())  # gloo: one group for all
    train_ddp(ddp, rank, world_size, steps=4)
    assert_params_close(ddp.module, reference, **FP32_TOL)
    chosen = {e.wire_buffer.numel() * 4: e.algorithm for e in state.buckets.values()}
    assert set(chosen.values()) == {"ring", "tree"}, f"sizes {chosen} should straddle the split"
    for nbytes, algorithm in chosen.items():
        assert algorithm == ("tree" if nbytes <= SPLIT_BYTES else "ring")


def test_buckets_follow_the_profile_by_size():
    torch_path_workers(_dispatch_worker, 2)


def _disagreement_worker(rank, world_size):
    profile = two_range_profile(world_size, split=SPLIT_BYTES + rank)  # each rank holds a different table
    with pytest.raises(RuntimeError, match="ranks disagree on the tuning profile"):
        ddp_triton.CommState(comm_dtype=torch.float32, profile=profile)


def test_ranks_disagreeing_on_the_profile_all_fail():
    torch_path_workers(_disagreement_worker, 2)


def _files_worker(rank, world_size, tmp):
    good = os.path.join(tmp, "good.json")
    if rank == 0:
        two_range_profile(world_size).save(good)
    dist.barrier()
    state = ddp_triton.CommState(comm_dtype=torch.float32, profile=good)
    assert state.active_profile is not None and state.active_profile.algorithm_for(100) == "tree"
    assert state.profile == good, "the argument as given; the Profile it resolved to is active_profile"

    corrupt = os.path.join(tmp, "corrupt.json")
    with open(corrupt, "w") as f:
        f.write("{ not json")
    # a corrupt file warns and falls back to the cost model, which needs NCCL: no profile on gloo
    state = ddp_triton.CommState(comm_dtype=torch.float32, profile=corrupt)
    assert state.active_profile is None and state.algorithm_groups == {}
    assert state.profile == corrupt

    with pytest.raises(ProfileError, match="world_size"):  # a Profile object is the caller's: a mismatch is an error
        ddp_triton.CommState(comm_dtype=torch.float32, profile=two_range_profile(world_size + 1))
    with pytest.raises(TypeError, match="profile must be"):
        ddp_triton.CommState(profile=42)


def test_profile_files_good_corrupt_and_mismatched(tmp_path):
    torch_path_workers(_files_worker, 2, str(tmp_path))


@pytest.mark.parametrize(
    "backend, on_cuda, comm, bucket, algorithm, averages",
    [
        pytest.param("nccl", True, torch.float32, torch.float32, None, True, id="nccl-fp32-in-place"),
        pytest.param("nccl", True, torch.bfloat16, torch.bfloat16, "ring", True, id="nccl-bf16-ring"),
        # NCCL's float AVG is a pre-multiplied sum, which NVLS does not run: pre-scale and SUM instead
        pytest.param("nccl", True, torch.float32, torch.float32, "nvls", False, id="nvls"),
        pytest.param("nccl", True, torch.float32, torch.float32, "nvls_tree", False, id="nvls-tree"),
        pytest.param("nccl", True, torch.float16, torch.float16, None, False, id="fp16-split-division"),
        pytest.param("nccl", True, torch.bfloat16, torch.float32, None, False, id="cast-needs-the-kernel"),
        pytest.param("nccl", False, torch.float32, torch.float32, None, False, id="cpu-tensors"),
        pytest.param("gloo", False, torch.float32, torch.float32, None, False, id="gloo"),
    ],
)
def test_when_the_collective_averages(backend, on_cuda, comm, bucket, algorithm, averages):
    assert collective_averages(backend, on_cuda, comm, bucket, algorithm) is averages


def _unusable_worker(rank, world_size):
    from ddp_triton.runtime import profile_choice

    if rank == 1:  # this rank's NCCL cannot run the profile (patched in this worker process only)
        profile_choice._unusable_here = lambda profile, backend: profile_choice._UnusableProfile(
            RuntimeError("the tuning profile uses 'nvls', which needs NCCL >= 2.17.1"))
    with pytest.raises(RuntimeError, match="ranks disagree on the tuning profile"):
        ddp_triton.CommState(comm_dtype=torch.float32, profile=two_range_profile(world_size))


def test_a_rank_that_cannot_run_the_profile_fails_every_rank():
    torch_path_workers(_unusable_worker, 2)


def test_unusable_profile_detected_on_nccl(monkeypatch):
    from ddp_triton.runtime.profile_choice import _unusable_here

    nvls = Profile(source="model", backend="model", world_size=2, nodes=1, comm_dtype="float32", bucket_cap_mb=1.0,
                   table=[TableEntry(0, None, "nvls")])
    assert _unusable_here(nvls, "nccl") is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLS switched off on this rank
    unusable = _unusable_here(nvls, "nccl")
    assert unusable is not None and "NCCL_NVLS_ENABLE" in str(unusable.error) and len(unusable.digest()) == 64
    assert _unusable_here(nvls, "gloo") is None  # gloo runs no NCCL algorithm


def _mixed_specs_worker(rank, world_size, tmp, specs):
    paths = {name: os.path.join(tmp, f"{name}.json") for name in ("a", "b")}
    if rank == 0:
        two_range_profile(world_size).save(paths["a"])
        two_range_profile(world_size, split=SPLIT_BYTES * 2).save(paths["b"])
    dist.barrier()
    spec = specs[rank]
    spec = paths.get(spec, spec)
    os.environ["XDG_CACHE_HOME"] = os.path.join(tmp, "empty-cache")  # "auto" finds nothing cached
    with pytest.raises(RuntimeError, match="ranks disagree on the tuning profile") as raised:
        ddp_triton.CommState(comm_dtype=torch.float32, profile=spec)
    assert f"was given profile={spec!r}" in str(raised.value)


@pytest.mark.parametrize("specs", [
    pytest.param(("a", None), id="file-vs-none"),
    pytest.param((None, "a"), id="none-vs-file"),
    pytest.param(("a", "auto"), id="file-vs-auto-without-cache"),
    pytest.param(("a", "b"), id="two-different-files"),
])
def test_ranks_given_different_profile_arguments_all_fail(tmp_path, specs):
    torch_path_workers(_mixed_specs_worker, 2, str(tmp_path), specs)


def _file_vs_default_hook_worker(rank, world_size, tmp):
    path = os.path.join(tmp, "a.json")
    if rank == 0:
        two_range_profile(world_size, comm_dtype="bfloat16").save(path)
    dist.barrier()
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    with pytest.raises(RuntimeError, match="ranks disagree on the tuning profile"):
        if rank == 0:
            ddp_triton.register(ddp, comm_dtype=torch.bfloat16, profile=path)
        else:  # torch's way: the default state, no profile, built at the first bucket
            ddp.register_comm_hook(None, ddp_triton.triton_hook)
            ddp(torch.randn(4, 8)).sum().backward()


def test_a_profile_on_one_rank_and_the_default_hook_on_another_fail_together(tmp_path):
    torch_path_workers(_file_vs_default_hook_worker, 2, str(tmp_path))
