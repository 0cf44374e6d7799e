"""Per-algorithm process groups, dispatch by size, and the cross-rank profile check.

Tiers: no device (environment scoping, NCCL version rules, select_group) and gloo multi-process at world size 2
(group creation with NCCL_ALGO scoped to each group's creation, dispatch of sizes to groups with real
all-reduces, profile agreement and disagreement). NCCL itself needs GPUs: the NCCL path is the same
``_create_groups`` with backend "nccl" and a CUDA warm-up.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_workers
from ddp_triton.runtime import algo_groups as ag
from ddp_triton.machine.profile import Profile, TableEntry

SENTINEL = "user-choice"


def profile(table, bucket=25.0) -> Profile:
    return Profile(source="measured", world_size=2, nodes=1, comm_dtype="float32", bucket_cap_mb=bucket,
                   table=table, backend="gloo")


TWO_ALGS = [TableEntry(0, 4096, "tree"), TableEntry(4097, None, "ring")]


# ---------------------------------------------------------------------------------------------------------------------
# No device
# ---------------------------------------------------------------------------------------------------------------------


def test_scoped_env_sets_and_restores_exactly():
    env = {"NCCL_ALGO": SENTINEL, "OTHER": "1"}
    with ag.scoped_env({"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple", "OTHER": None}, env):
        assert env == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}
    assert env == {"NCCL_ALGO": SENTINEL, "OTHER": "1"}
    with pytest.raises(RuntimeError):
        with ag.scoped_env({"NCCL_ALGO": "Ring"}, env):
            raise RuntimeError("boom")
    assert env == {"NCCL_ALGO": SENTINEL, "OTHER": "1"}  # restored on the error path too


def test_check_nccl_support():
    ag.check_nccl_support(["ring", "tree", "nvls", "nvls_tree"], (2, 21, 5), env={})
    ag.check_nccl_support(["ring", "tree"], None, env={})  # unknown version: nothing to refuse
    with pytest.raises(RuntimeError, match=r"needs NCCL >= 2\.17\.1.*2\.16\.5"):
        ag.check_nccl_support(["ring", "nvls"], (2, 16, 5), env={})
    with pytest.raises(RuntimeError, match=r"NVLSTree.*2\.18\.1"):
        ag.check_nccl_support(["nvls_tree"], (2, 17, 1), env={})
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE=0"):
        ag.check_nccl_support(["nvls"], (2, 21, 5), env={"NCCL_NVLS_ENABLE": "0"})
    with pytest.raises(ValueError, match="collnet"):
        ag.check_nccl_support(["collnet"], (2, 21, 5), env={})


def test_select_group_by_size():
    groups = {"tree": "G-tree", "ring": "G-ring"}
    p = profile(TWO_ALGS)
    assert [ag.select_group(groups, p, n) for n in (1, 4096, 4097, 1 << 30)] == \
        ["G-tree", "G-tree", "G-ring", "G-ring"]
    assert ag.select_group({"ring": "G"}, None, 123) == "G"
    with pytest.raises(ValueError, match="no group for it"):
        ag.select_group({"ring": "G-ring"}, p, 10)


def test_nccl_version_is_none_exactly_in_builds_without_cuda():
    version = ag.nccl_version()
    if torch.version.cuda is None:  # CPU wheels have no NCCL
        assert version is None
    else:  # CUDA wheels carry NCCL, GPU or not (torch 2.4's PyPI wheel reports 2.20.5 on a CPU-only machine)
        assert isinstance(version, tuple) and len(version) == 3 and version >= (2, 0, 0)


# ---------------------------------------------------------------------------------------------------------------------
# gloo, two ranks
# ---------------------------------------------------------------------------------------------------------------------


def _groups_and_dispatch(rank: int, world: int) -> None:
    # 1. make_algorithm_groups on gloo: one algorithm, every choice maps to the default group (and a warning).
    groups = ag.make_algorithm_groups(["tree", "ring"])
    assert sorted(groups) == ["ring", "tree"]
    assert all(g is dist.group.WORLD for g in groups.values())

    # 2. The NCCL mechanism, run on gloo: NCCL_ALGO set only while each group is created and first used.
    os.environ["NCCL_ALGO"] = SENTINEL
    seen = []

    def warmup(g):
        seen.append(os.environ.get("NCCL_ALGO"))
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        assert t.item() == world

    parent = dist.new_group(list(range(world)), timeout=timedelta(seconds=1234))  # not the backend's default
    made = ag._create_groups(["ring", "tree"], [list(range(world))], "gloo", warmup, parent=parent)
    assert seen == ["Ring", "Tree"]
    assert os.environ["NCCL_ALGO"] == SENTINEL
    assert made["ring"] is not made["tree"] and made["ring"] is not dist.group.WORLD
    # They keep their parent's timeout, not new_group's default (gloo's is 30 minutes).
    assert ag.group_timeout(made["ring"]) == ag.group_timeout(made["tree"]) == timedelta(seconds=1234)

    # 3. Dispatch by size to those groups, with real all-reduces of that size (fp32, sum of rank + 1: exact).
    p = profile(TWO_ALGS)
    for nbytes, alg in ((4, "tree"), (4096, "tree"), (4100, "ring"), (1 << 16, "ring")):
        g = ag.select_group(made, p, nbytes)
        assert g is made[alg], nbytes
        t = torch.full((nbytes // 4,), float(rank + 1))
        dist.all_reduce(t, group=g)
        assert bool((t == world * (world + 1) / 2).all()), nbytes

    # 4. The same profile everywhere: agreement returns its digest; no profile anywhere agrees too.
    assert ag.check_profile_agreement(p) == p.digest()
    assert ag.check_profile_agreement(None) == ag._NO_PROFILE


def _disagree(rank: int, world: int) -> None:
    mine = profile(TWO_ALGS, bucket=25.0 if rank == 0 else 50.0)  # rank 1 holds another profile
    with pytest.raises(RuntimeError) as ei:
        ag.check_profile_agreement(mine)
    msg = str(ei.value)
    assert "ranks disagree" in msg and "ranks [0]" in msg and "ranks [1]" in msg, msg
    # A profile on rank 0, none on rank 1.
    with pytest.raises(RuntimeError, match="no profile"):
        ag.check_profile_agreement(mine if rank == 0 else None)


def _replica_groups(rank: int, world: int) -> None:
    # Two replica groups, [0, 1] and [2, 3]: each rank names only its own, yet every rank must create every group.
    mine = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    rank_sets = ag.replica_rank_sets(mine)
    assert rank_sets == [(0, 1), (2, 3)]
    seen = []

    def warmup(g):
        seen.append(os.environ.get("NCCL_ALGO"))
        t = torch.full((1,), float(rank))
        dist.all_reduce(t, group=g)
        assert t.item() == sum(r for r in range(world) if r // 2 == rank // 2)  # summed within the replica only

    made = ag._create_groups(["ring", "tree"], rank_sets, "gloo", warmup, parent=mine)
    assert sorted(made) == ["ring", "tree"] and seen == ["Ring", "Tree"]
    assert dist.get_process_group_ranks(made["ring"]) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert ag.replica_rank_sets(dist.group.WORLD) == [list(range(world))]


def test_disjoint_replica_groups_are_created_on_every_rank():
    run_workers(_replica_groups, 4, timeout=60)


def test_groups_env_and_dispatch_on_gloo():
    run_workers(_groups_and_dispatch, 2, timeout=60)


def test_rank_disagreement_fails_on_every_rank_without_hanging():
    # Each worker asserts that it raised; a worker that passed the check or hung fails the test. 30 s: a hang is
    # a failure, not a slow pass.
    run_workers(_disagree, 2, timeout=30)
