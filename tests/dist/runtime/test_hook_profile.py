"""triton_hook following a tuning profile: each bucket goes to the group its size calls for, ranks must agree.

Tier: gloo multi-process on CPU. Gloo has one all-reduce algorithm, so every algorithm maps to the same group (the
choice is still made and recorded per bucket); the NCCL groups themselves are tested in test_algo_groups.py.
"""

import copy
import json
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_triton.machine.profile import (FormatChoice, FormatRange, Profile, ProfileError, TableEntry, cache_path,
                                       profile_fingerprint)
from ddp_triton.machine.topology import load_topology
from ddp_triton.runtime import profile_choice
from ddp_triton.runtime.plan import collective_averages
from ddp_helpers import (FP32_TOL, SPLIT_BYTES, assert_params_close, make_model, torch_path_workers, train_ddp,
                         train_reference, two_range_profile)

def _dispatch_worker(rank, world_size):
    model = make_model()
    reference = train_reference(copy.deepcopy(model), steps=4)
    ddp = DDP(model, bucket_cap_mb=0.002)  # buckets of a few KiB up to ~4 KiB and the larger layers alone
    profile = two_range_profile(world_size)
    state = ddp_triton.register(ddp, comm_dtype=torch.float32, profile=profile)
    assert state.profile is profile and state.context.profile is profile
    assert set(state.context.algorithm_groups) == {"ring", "tree"}
    assert all(g is state.context.group for g in state.context.algorithm_groups.values())  # gloo: one group for all
    train_ddp(ddp, rank, world_size, steps=4)
    assert_params_close(ddp.module, reference, **FP32_TOL)
    chosen = {e.wire_buffer.numel() * 4: e.algorithm for e in state.plans.values()}
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
    assert state.context.profile is not None and state.context.profile.algorithm_for(100) == "tree"
    assert state.profile == good, "the argument as given; the Profile it resolved to is active_profile"

    with pytest.raises(ProfileError, match="world_size"):  # a Profile object is the caller's: a mismatch is an error
        ddp_triton.CommState(comm_dtype=torch.float32, profile=two_range_profile(world_size + 1))
    with pytest.raises(TypeError, match="profile must be"):
        ddp_triton.CommState(profile=42)


def test_profile_files_good_and_mismatched(tmp_path):
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


def _formats_profile(world_size):
    """A profile a state with comm_dtype float32 or "auto" follows: every bucket in bf16, algorithm ring."""
    return Profile(source="model", backend="model", world_size=world_size, nodes=1, comm_dtype="float32",
                   bucket_cap_mb=1.0, table=[TableEntry(0, None, "ring")],
                   formats=FormatChoice(source="model", allowed=["bf16"], admitted=["bf16"],
                                        table=[FormatRange(0, None, "bf16")]))


def _write_profile_file(path, kind, world_size):
    """Write at ``path`` a profile file of ``kind``: usable ("good") or one way of not being usable."""
    text = _formats_profile(world_size).to_json()
    if kind == "good":
        content = text
    elif kind == "truncated":  # a copy cut short, as by a full disk or an interrupted scp
        content = text[:len(text) // 2]
    elif kind == "garbage":
        content = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
    elif kind == "not-a-profile":
        content = json.dumps([{"lr": 0.1}, {"lr": 0.01}])
    elif kind == "other-world-size":
        content = _formats_profile(world_size + 2).to_json()
    elif kind == "newer-schema":
        content = json.dumps({**json.loads(text), "schema_version": 99})
    elif kind == "schema-2":  # as written before profiles chose wire formats
        content = json.dumps({**{k: v for k, v in json.loads(text).items() if k != "formats"}, "schema_version": 2})
    elif kind == "missing":
        return
    else:
        raise AssertionError(f"unknown kind {kind!r}")
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)


def _unusable_file_worker(rank, world_size, tmp, kinds, comm_dtype, why):
    path = os.path.join(tmp, f"tuned-rank{rank}.json")  # a node-local path: each rank reads its own copy
    _write_profile_file(path, kinds[rank], world_size)
    model = make_model()
    before = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.002)
    with pytest.raises(ProfileError) as raised:
        ddp_triton.register(ddp, comm_dtype=comm_dtype, profile=path)
    message = str(raised.value)
    assert "\n" not in message, f"one line: {message!r}"
    if kinds[rank] == "good":  # the rank that could use its file names the one that could not, and why
        failed = [r for r, kind in enumerate(kinds) if kind != "good"]
        assert f"rank(s) {failed} cannot use the profile" in message, message
        assert f"was given profile={path!r}" in message, message
    else:
        assert message.startswith(f"{path}: "), message
        assert "ddp-triton autotune" in message and "profile='auto'" in message, message
    assert re.search(why, message), f"{why!r} not in {message!r}"
    assert ddp._comm_hooks == [], "nothing registered"
    for p, q in zip(ddp.module.parameters(), before.parameters()):
        assert torch.equal(p, q) and p.grad is None, "no step taken"
    # every rank left register together: the ranks are still in step for the next collective
    flag = torch.tensor([float(rank)])
    dist.all_reduce(flag)
    assert flag.item() == sum(range(world_size))


@pytest.mark.parametrize("kinds, comm_dtype, why", [
    pytest.param(("truncated",) * 2, "auto", r"not valid JSON \(.*line \d+ column \d+", id="truncated"),
    pytest.param(("truncated",) * 2, torch.float32, r"not valid JSON \(.*line \d+ column \d+", id="truncated-fp32"),
    pytest.param(("garbage",) * 2, "auto", r"not a JSON profile: not UTF-8", id="garbage"),
    pytest.param(("not-a-profile",) * 2, "auto", r"a profile must be a JSON object, got list", id="not-a-profile"),
    pytest.param(("other-world-size",) * 2, "auto", r"world_size=4, this run has 2", id="other-world-size"),
    pytest.param(("other-world-size",) * 2, torch.float32, r"world_size=4, this run has 2",
                 id="other-world-size-fp32"),
    pytest.param(("newer-schema",) * 2, "auto", r"schema_version 99; this ddp-triton reads schema_version 3 only",
                 id="newer-schema"),
    pytest.param(("schema-2",) * 2, torch.float32, r"schema_version 2; this ddp-triton reads schema_version 3 only: "
                 r"re-run `ddp-triton autotune`", id="schema-2"),
    pytest.param(("good", "missing"), "auto", r"cannot read profile: No such file", id="missing-on-rank-1"),
    pytest.param(("good", "truncated"), torch.float32, r"not valid JSON", id="truncated-on-rank-1"),
    pytest.param(("missing", "good"), "auto", r"cannot read profile: No such file", id="missing-on-rank-0"),
])
def test_a_named_profile_file_that_cannot_be_used_fails_every_rank_before_any_step(tmp_path, kinds, comm_dtype,
                                                                                      why):
    torch_path_workers(_unusable_file_worker, 2, str(tmp_path), kinds, comm_dtype, why)


def _formats_without_a_table_worker(rank, world_size, tmp):
    path = os.path.join(tmp, "plain.json")
    if rank == 0:
        two_range_profile(world_size).save(path)
    dist.barrier()
    # comm_dtype="auto" asks the file for wire formats; a file that chooses none is refused, not sent in bf16
    with pytest.raises(ProfileError, match="chooses no wire formats"):
        ddp_triton.register(DDP(make_model()), comm_dtype="auto", profile=path)


def test_a_named_profile_without_formats_is_refused_for_comm_dtype_auto(tmp_path):
    torch_path_workers(_formats_without_a_table_worker, 2, str(tmp_path))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _broken_cache_worker(rank, world_size, tmp, kind):
    # gloo never reads the cache ("auto" is an NCCL matter): bind as an NCCL state on this machine's topology would
    topology = load_topology("dgx-h100")
    profile_choice._this_topology = lambda: topology
    os.environ["XDG_CACHE_HOME"] = os.path.join(tmp, f"cache-rank{rank}")
    cached = cache_path(profile_fingerprint(topology), world_size, topology.nodes, "float32")
    cached.parent.mkdir(parents=True)
    _write_profile_file(cached, kind, world_size)
    records = _Records()
    logging.getLogger("ddp_triton").addHandler(records)
    profile, groups = profile_choice.bind_profile("auto", group=dist.group.WORLD, world_size=world_size,
                                                  comm_dtype=torch.float32, backend="nccl", wire_format="fp32")
    assert profile is None and groups == {}, "a cache that cannot be used leaves the choice to NCCL"
    if rank == 0:  # rank 0 speaks
        assert any("ignoring cached profile" in m and str(cached) in m for m in records.messages), records.messages
    # and the default, "auto", trains
    ddp = DDP(make_model())
    state = ddp_triton.register(ddp, comm_dtype=torch.float32)
    train_ddp(ddp, rank, world_size, steps=2)
    assert state.profile == "auto" and state.passes == 2


@pytest.mark.parametrize("kind", ["truncated", "other-world-size"])
def test_a_broken_cache_for_profile_auto_still_warns_and_trains(tmp_path, kind):
    torch_path_workers(_broken_cache_worker, 2, str(tmp_path), kind)


def _profile_object_on_one_rank_worker(rank, world_size):
    # rank 1 built its Profile for another world size: it must not raise alone while rank 0 waits in the agreement
    profile = two_range_profile(world_size if rank == 0 else world_size + 2)
    expected = r"world_size=4, this run has 2" if rank == 1 else r"rank\(s\) \[1\] cannot use the profile"
    with pytest.raises(ProfileError, match=expected):
        ddp_triton.register(DDP(make_model()), comm_dtype=torch.float32, profile=profile)


def test_a_profile_object_that_does_not_match_on_one_rank_fails_every_rank():
    torch_path_workers(_profile_object_on_one_rank_worker, 2, timeout=60)
