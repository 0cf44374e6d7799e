"""Buckets of one model in different wire formats, from a profile's per-size formats (``comm_dtype="auto"``).

Tier: gloo multi-process on CPU (2 and 3 ranks, spawned here), on the kernels' torch CPU path. The profile sends
buckets under 2 KB as a bf16 all-reduce, those between 10 and 25 KB as bf16 with float32 sums, and the others as
FP8 E4M3 with error feedback. DDP's first step sends the whole model in one FP8 bucket; its rebuilt buckets then
put most parameters in buckets without error feedback, where what their residuals still owe must be added once,
not dropped, while one stays in FP8 and keeps its residuals. A second DDP model of the same module on the same
state (a later run with other buckets) sends everything in FP8 again, in another order.

At every step each rank computes every rank's local gradient on a copy of the model and the average each bucket's
format defines (``wire_reference.py``; the bf16 all-reduce's result one of the orders the backend may add in, as in
``test_default_path_bits.py``), with the FP8 residuals per parameter, and the gradients DDP hands the optimizer
must be those bits.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import local_backward, local_grads, torch_path_workers
from wire_reference import float32_sum_average, fp8_average
from test_default_path_bits import assert_one_of, bf16_all_reduce_candidates
from ddp_triton.machine.profile import FormatChoice, FormatRange, Profile, TableEntry

BATCH = 12
E4M3 = torch.float8_e4m3fn
# Bucket sizes in gradient bytes: DDP's first step of a model sends all six tensors in one bucket of 30336 (FP8);
# rebuilt with bucket_cap_mb 0.0001: 272 and 1200 (bf16 all-reduce), 19264 (float32 sums), 9600 (FP8 again); with
# 25: one bucket of 30336 (FP8), its tensors in the backward's order.
TABLE = [FormatRange(0, 2047, "bf16"), FormatRange(2048, 10000, "fp8e4m3+ef"),
         FormatRange(10001, 25000, "bf16+fp32sum"), FormatRange(25001, None, "fp8e4m3+ef")]
PHASES = (0.0001, 25)  # bucket_cap_mb of each DDP model, three steps each


def mixed_profile(world_size, table=TABLE):
    formats = sorted({r.format for r in table})
    return Profile(source="model", backend="model", world_size=world_size, nodes=1, comm_dtype="bfloat16",
                   bucket_cap_mb=1.0, table=[TableEntry(0, None, "ring")],
                   formats=FormatChoice(source="model", allowed=formats, admitted=formats, table=list(table)))


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 300)
        self.b = nn.Linear(300, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def data(step):
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen)


def recording(model):
    """A hook that records each bucket's parameters (indices in ``model``) as DDP hands them, then runs ours; and
    the list it appends to."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    buckets = []

    def recording_hook(state, bucket):
        buckets.append([index[id(p)] for p in bucket.parameters()])
        return ddp_triton.triton_hook(state, bucket)

    return recording_hook, buckets


class Reference:
    """Each bucket's average by its format's definition, FP8 residuals kept per parameter and, when a parameter
    lands in a bucket without error feedback, added once to its average."""

    def __init__(self, profile, world_size):
        self.profile, self.n = profile, world_size
        self.first, self.second = {}, {}  # parameter index -> per-rank first stages; -> second stage
        self.folded = set()  # the formats that took residuals in

    def expected(self, buckets, per_rank):
        """{parameter index: (kind, values)}: kind "exact" (one result) or "one of" (a stack of candidates)."""
        out = {}
        for members in buckets:
            grad_bytes = sum(per_rank[0][i].numel() for i in members) * 4
            fmt = self.profile.format_for(grad_bytes)
            grads = [[per_rank[r][i] for i in members] for r in range(self.n)]
            if fmt == "fp8e4m3+ef":
                first = [[self.first.get(i, [torch.zeros_like(grads[0][k])] * self.n)[r]
                          for k, i in enumerate(members)] for r in range(self.n)]
                second = [self.second.get(i, torch.zeros_like(grads[0][k])) for k, i in enumerate(members)]
                averaged = fp8_average(grads, E4M3, first, second)
                for k, i in enumerate(members):
                    self.first[i] = [first[r][k] for r in range(self.n)]
                    self.second[i] = second[k]
                    out[i] = ("exact", averaged[k])
                continue
            if fmt == "bf16+fp32sum":
                results = [("exact", v) for v in float32_sum_average(grads, torch.bfloat16)]
            else:
                assert fmt == "bf16", fmt
                results = [("one of", bf16_all_reduce_candidates([grads[r][k] for r in range(self.n)]))
                           for k in range(len(members))]
            for (kind, value), i in zip(results, members):
                if i in self.first:  # owed by error feedback: every rank's first stage and the second, once
                    owed = sum(self.first.pop(i)) + self.second.pop(i)
                    value = value + owed
                    self.folded.add(fmt)
                out[i] = (kind, value)
        return out


def _mixed_worker(rank, world_size):
    profile = mixed_profile(world_size)
    model = Three()
    state = ddp_triton.CommState(comm_dtype="auto", profile=profile)
    recording_hook, buckets = recording(model)

    reference = Reference(profile, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen_formats = set()
    step = 0
    for bucket_cap_mb in PHASES:
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        ddp.register_comm_hook(state, recording_hook)
        for _ in range(3):
            x, y = data(step)
            per_rank = [local_grads(model, [(x, y)], r, world_size) for r in range(world_size)]
            buckets.clear()
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            expected = reference.expected(buckets, per_rank)
            assert sorted(expected) == list(range(6)), (step, buckets)
            for i, p in enumerate(model.parameters()):
                kind, value = expected[i]
                if kind == "exact":
                    assert torch.equal(p.grad.view(torch.int32), value.contiguous().view(torch.int32)), \
                        f"parameter {i} at step {step} ({buckets})"
                else:
                    assert_one_of(p.grad, value, f"parameter {i} at step {step}")
            seen_formats |= {b.wire_format for b in state.summary().buckets}
            opt.step()
            step += 1
    assert seen_formats == {"bfloat16", "fp8e4m3+ef", "bf16+fp32sum"}, seen_formats  # telemetry names dtypes
    assert reference.folded == {"bf16", "bf16+fp32sum"}, reference.folded  # as the phases intend
    assert not state.residuals.pending_first and not state.residuals.pending_second  # nothing left unplaced


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_formats_match_the_reference_as_parameters_change_buckets(world_size):
    torch_path_workers(_mixed_worker, world_size)


def _resume_worker(rank, world_size, tmp):
    """Three steps, then a DDP model with DDP's first-step bucket again for three more: unbroken (the same state
    carries on) or through a checkpoint of model, optimizer and residuals into a fresh state. The same bits."""
    profile = mixed_profile(world_size)

    def train(model, ddp, opt, steps):
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            local_backward(ddp, x, y, rank, world_size)
            opt.step()

    def fresh():
        model = Three()
        ddp = DDP(model, bucket_cap_mb=0.0001)
        state = ddp_triton.register(ddp, comm_dtype="auto", profile=profile)
        return model, ddp, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, ddp, state, opt = fresh()
    train(model, ddp, opt, range(3))
    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp_triton.register(ddp, state=state)
    train(model, ddp, opt, range(3, 6))
    unbroken = [p.detach().clone() for p in model.parameters()]

    model, ddp, state, opt = fresh()
    train(model, ddp, opt, range(3))
    saved = state.state_dict()
    assert saved["wire_format"] == "auto"
    assert sorted(saved["first_stage"]) == ["a.weight"]  # the one parameter in an FP8 bucket; the rest folded in
    assert saved["first_stage"]["a.weight"].abs().sum() > 0
    path = f"{tmp}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": saved}, path)
    model, ddp, state, opt = fresh()
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    state.load_state_dict(checkpoint["hook"])
    train(model, ddp, opt, range(3, 6))
    for (name, p), q in zip(model.named_parameters(), unbroken):
        assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32)), f"{name} differs after resuming"
    # A checkpoint of one fixed format does not load into a state of per-bucket formats: the format is named.
    fixed = ddp_triton.register(DDP(Three()), comm_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="wire_format='auto', this state has 'fp8e4m3\\+ef'"):
        fixed.load_state_dict(checkpoint["hook"])


def test_mixed_formats_resume_from_a_checkpoint_bit_identically(tmp_path):
    torch_path_workers(_resume_worker, 3, str(tmp_path))


def _fallback_and_disagreement_worker(rank, world_size):
    # No profile with formats found ("auto" on gloo finds none): every rank warns and sends bf16 (one all-reduce per
    # bucket). A file named by the user that chooses no formats is refused instead (test_hook_profile.py).
    state = ddp_triton.register(DDP(Three()), comm_dtype="auto", profile="auto")
    assert state.context.formats is None and state.wire.name == "bf16"
    # The formats a state binds are those its table uses (what the ranks' profile check covers), not every one the
    # profile admitted: an unused two-level format binds no node groups.
    unused = mixed_profile(world_size)
    unused.formats.admitted.append("two-level bf16")
    state = ddp_triton.register(DDP(Three()), comm_dtype="auto", profile=unused)
    assert set(state.context.formats) == {"bf16", "fp8e4m3+ef", "bf16+fp32sum"} and state.context.nodes is None
    # A table of all-reduce formats only: nothing is staged, so the all-reduces need no queue and take the direct
    # path; with a staged format among them they go through the queue.
    for table, queued in (([FormatRange(0, 2047, "bf16"), FormatRange(2048, None, "fp32")], False), (TABLE, True)):
        ddp = DDP(Three(), bucket_cap_mb=0.0001)
        state = ddp_triton.register(ddp, comm_dtype="auto", profile=mixed_profile(world_size, table))
        for _ in range(2):
            x, y = data(0)
            nn.functional.mse_loss(ddp(x), y).backward()
        all_reduces = [e for e in state.plans.values() if "fp8" not in e.record.wire_format
                       and "fp32sum" not in e.record.wire_format]
        assert all_reduces and all((e.queue is not None) == queued for e in all_reduces), (table, queued)
    # Ranks given profiles that choose differently fail together, before any bucket.
    table = TABLE if rank == 0 else [FormatRange(0, None, "bf16")]
    with pytest.raises(RuntimeError, match="profile"):
        ddp_triton.register(DDP(Three()), comm_dtype="auto", profile=mixed_profile(world_size, table))


def test_no_profile_with_formats_falls_back_to_bf16_and_disagreeing_ranks_fail_together():
    torch_path_workers(_fallback_and_disagreement_worker, 2)


@pytest.mark.parametrize("options, match", [
    (dict(comm_dtype="auto", profile=None), "profile='auto'"),
    (dict(comm_dtype="auto", accumulate_dtype=torch.float32), "leave accumulate_dtype unset"),
    (dict(comm_dtype="auto", hierarchical=True), "leave hierarchical unset"),
    (dict(comm_dtype="fastest"), "comm_dtype: unknown wire format 'fastest'; known: fp32, "),
])
def test_auto_options_that_cannot_be_are_refused_by_name(options, match):
    from ddp_triton.runtime.state import check_options

    with pytest.raises(ValueError, match=match):
        check_options(options)


def test_an_auto_state_pickles_as_its_settings():
    import pickle

    state = ddp_triton.CommState(comm_dtype="auto", profile="auto")  # no process group yet: settings only
    again = pickle.loads(pickle.dumps(state))
    assert again.comm_dtype == "auto" and again.profile == "auto" and again.wire_setting == "auto"
    assert again.context is None


TWO_LEVEL_TABLE = [FormatRange(0, 2047, "bf16+fp32sum"), FormatRange(2048, None, "two-level fp8e4m3+ef")]


def _two_level_mixed_worker(rank, world_size):
    """4 ranks on 2 nodes (GROUP_RANK): small buckets in bf16 with float32 sums, the others two-level FP8 with error
    feedback. DDP's first step sends all six tensors two-level; its rebuilt buckets send four of them flat, which
    must take in what their two-level residuals still owe (every node's first stage and the second)."""
    import os

    from wire_reference import two_level_average

    os.environ["GROUP_RANK"] = str(rank // 2)
    profile = mixed_profile(world_size, TWO_LEVEL_TABLE)
    model = Three()
    state = ddp_triton.CommState(comm_dtype="auto", profile=profile)
    assert state.context.nodes is not None and (state.context.nodes.n_nodes, state.context.nodes.local_size) == (2, 2)
    recording_hook, buckets = recording(model)

    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(state, recording_hook)
    plain = copy.deepcopy(model)
    params = list(plain.parameters())
    first = {}  # parameter index -> per-node first stage (flat); second: -> flat
    second = {}
    folded = set()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for step in range(3):
        x, y = data(step)
        per_rank = [local_grads(plain, [(x, y)], r, world_size) for r in range(world_size)]
        buckets.clear()
        opt.zero_grad()
        local_backward(ddp, x, y, rank, world_size)
        for members in buckets:
            sizes = [params[i].numel() for i in members]
            fmt = profile.format_for(sum(sizes) * 4)
            if fmt == "two-level fp8e4m3+ef":
                flat = [torch.cat([g[i].reshape(-1) for i in members]) for g in per_rank]
                f = [torch.cat([first.get(i, torch.zeros(2, params[i].numel()))[k] for i in members]) for k in range(2)]
                s = torch.cat([second.get(i, torch.zeros(params[i].numel())) for i in members])
                averaged = two_level_average(flat, sizes, 2, E4M3, True, f, s)
                offset = 0
                for i, size in zip(members, sizes):
                    part = slice(offset, offset + size)
                    first[i] = torch.stack([f[k][part] for k in range(2)])
                    second[i] = s[part].clone()
                    params[i].grad = averaged[part].view_as(params[i]).clone()
                    offset += size
            else:
                averaged = float32_sum_average([[g[i] for i in members] for g in per_rank], torch.bfloat16)
                for i, value in zip(members, averaged):
                    if i in first:  # owed: every node's first stage and the second, once
                        owed = first.pop(i).sum(dim=0) + second.pop(i)
                        value = value + owed.view_as(value)
                        folded.add(i)
                    params[i].grad = value.view_as(params[i]).clone()
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p.grad.view(torch.int32), params[i].grad.contiguous().view(torch.int32)), \
                f"parameter {i} at step {step} ({buckets})"
        opt.step()
        plain_opt.step()
    assert folded, "no parameter moved from a two-level FP8 bucket to one without error feedback"


def test_mixed_formats_with_a_two_level_one_match_the_reference():
    torch_path_workers(_two_level_mixed_worker, 4)
