"""ddp_triton inside torchft: ``ddp_triton.integrations.torchft.DistributedDataParallel`` under a real lighthouse.

Tier: integrations, gloo multi-process on CPU. Each test starts a real ``LighthouseServer`` in this process (port 0)
and real replica processes (``torchft_replica.py``: torchft's Manager, ProcessGroupGloo, OptimizerWrapper), kills
them for real (SIGKILL) and orders everything by the files they write (each step's line, a ready file), with
deadlines that fail the test rather than hang it. The option checks run in this process against a stand-in manager
(no lighthouse needed). Skipped without torchft (.ci/run installs it for this tier).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from doc_checks import REPO, TROUBLESHOOTING, quote_of, quoted_messages, read_doc
from framework_import import import_installed

torchft = import_installed("torchft")
pytestmark = pytest.mark.skipif(torchft is None, reason="torchft is not installed (pip install torchft)")

REPLICA = Path(__file__).with_name("torchft_replica.py")
HEARTBEAT_MS = 1000  # the lighthouse drops a replica that sent no heartbeat for this long
DEADLINE = 240.0  # seconds a whole run may take on two busy cores before the test fails (it takes 15-40)


# ---- bad input, against a stand-in manager ------------------------------------------------------------------------

def stand_in_manager(pg=True):
    from torchft.process_group import ProcessGroupDummy
    registered = {}
    return SimpleNamespace(_pg=ProcessGroupDummy(0, 1) if pg else None, _group_world_size=1,
                           register_state_dict_fn=lambda key, load, save: registered.setdefault(key, (load, save)),
                           registered=registered)


def ours():
    from ddp_triton.integrations.torchft import DistributedDataParallel
    return DistributedDataParallel


def _baby_group():
    from torchft.process_group import ProcessGroupBabyGloo
    return ProcessGroupBabyGloo()


def test_the_model_carries_its_state_and_registers_it_for_healing():
    manager = stand_in_manager()
    model = ours()(manager, nn.Linear(4, 2), comm_dtype=torch.float8_e4m3fn)
    assert model.comm_state.wire_setting == "fp8e4m3+ef"
    assert isinstance(model, torchft.ddp.DistributedDataParallel)
    load, save = manager.registered["ddp_triton"]
    assert save() == {"wire_format": "fp8e4m3+ef", "online": None}
    with pytest.raises(ValueError, match="heals from one that sends bf16"):
        load({"wire_format": "bf16", "online": None})


@pytest.mark.parametrize("make, error, words", [
    pytest.param(lambda: ours()(stand_in_manager(pg=False), nn.Linear(4, 2)), ValueError,
                 "needs a torchft Manager with a process group", id="manager-without-group"),
    pytest.param(lambda: ours()(stand_in_manager(), ours()(stand_in_manager(), nn.Linear(4, 2))), TypeError,
                 "already a DistributedDataParallel", id="already-wrapped"),
    pytest.param(lambda: ours()(stand_in_manager(), nn.Linear(4, 2), replicate_group=None), TypeError,
                 r"\['replicate_group'\] are FSDP's", id="fsdp-option"),
    pytest.param(lambda: ours()(stand_in_manager(), nn.Linear(4, 2), reshard_after_forward=True), TypeError,
                 r"\['reshard_after_forward'\] are FSDP's", id="fully-shard-keyword"),
    pytest.param(lambda: ours()(stand_in_manager(), nn.Linear(4, 2), hierarchical=True), TypeError,
                 "decides hierarchical", id="hierarchical"),
    pytest.param(lambda: ours()(stand_in_manager(), nn.Linear(4, 2), comm_dtype="auto"), ValueError,
                 "needs tune='online'", id="auto-without-online"),
    pytest.param(lambda: ours()(stand_in_manager(), nn.Linear(4, 2), comm_dtype=torch.int8), ValueError,
                 "comm_dtype", id="bad-comm-dtype"),
    pytest.param(lambda: ours()(SimpleNamespace(**{**vars(stand_in_manager()), "_pg": _baby_group()}),
                                nn.Linear(4, 2)), TypeError, "over torchft's ProcessGroupGloo only", id="baby-group"),
])
def test_bad_input_is_refused_by_name(make, error, words):
    """Each refusal names what is wrong, and docs/troubleshooting.md quotes it (as tests/dist/test_troubleshooting.py
    checks for the rest of the package, in a tier without torchft)."""
    with pytest.raises(error, match=words) as raised:
        make()
    quotes = quoted_messages(read_doc(REPO, TROUBLESHOOTING))
    assert quote_of(str(raised.value), quotes) is not None, f"{TROUBLESHOOTING} quotes no part of: {raised.value}"


def test_the_messages_a_torchft_user_meets_are_on_the_troubleshooting_page():
    """Those raised later than construction: a heal from a group with other settings, a replica group of several
    ranks without its own group."""
    quotes = quoted_messages(read_doc(REPO, TROUBLESHOOTING))
    manager = stand_in_manager()
    model = ours()(manager, nn.Linear(4, 2))
    with pytest.raises(ValueError) as healed:
        model._exchange.load_state_dict({"wire_format": "fp8e4m3+ef"})
    manager.__dict__["_group_world_size"] = 2
    with pytest.raises(ValueError) as no_group:
        ours()(manager, nn.Linear(4, 2))
    for message in (str(healed.value), str(no_group.value)):
        assert quote_of(message, quotes) is not None, f"{TROUBLESHOOTING} quotes no part of: {message}"


# ---- the step's bookkeeping, against a manager the test drives (one gloo rank, in a worker process) -----------------

class DrivenManager:
    """torchft's Manager as the hook sees it, each step started (``start_quorum``) and committed by the test."""

    def __init__(self):
        import torch.distributed as dist
        self._pg, self._quorum_id, self._step, self._errored = dist.new_group([0]), 1, 0, None
        self._group_world_size, self._quorum_future, self.participating, self.fns = 1, object(), True, {}

    def start_quorum(self):
        self._quorum_future, self._errored = object(), None

    def wait_quorum(self):
        pass

    def errored(self):
        return self._errored

    def report_error(self, error):
        self._errored = error

    def num_participants(self):
        return 1

    def is_participating(self):
        return self.participating

    def current_step(self):
        return self._step

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)


def _owed(state):
    """Every residual the state holds, live and pending, by parameter name (float32 copies)."""
    saved = state.residuals.state_dict(None, {})
    return {(stage, name): t.float() for stage in ("first_stage", "second_stage") for name, t in saved[stage].items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _bookkeeping_worker(rank, world_size):
    import ddp_triton.integrations.torchft as integration
    torch.manual_seed(0)
    manager = DrivenManager()
    model = ours()(manager, nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), comm_dtype=torch.float8_e4m3fn)
    state, restores = model.comm_state, []
    restore = state.residuals.restore
    state.residuals.restore = lambda saved: (restores.append(1), restore(saved))
    batch = [torch.randn(16, 64, generator=torch.Generator().manual_seed(k)) for k in range(4)]

    def backward(k):
        model(batch[k]).pow(2).sum().backward()

    backward(0)  # step 0, committed
    manager._step += 1
    committed = _owed(state)
    assert any(t.abs().sum() > 0 for t in committed.values())
    # Two backwards in one step (accumulation without no_sync): the second keeps the first's residuals.
    manager.start_quorum()
    backward(1)
    after_one = _owed(state)
    backward(2)
    assert not restores and not _same(_owed(state), after_one), "the second backward rolled the first one back"
    manager._step += 1
    # A new quorum (another group), then the step's exchange fails: the residuals are those from before the step,
    # though the quorum change had moved them out of their layouts.
    before = _owed(state)
    manager.start_quorum()
    manager._pg, manager._quorum_id = __import__("torch.distributed").distributed.new_group([0]), 2
    hook = integration.triton_hook

    def failing(hook_state, bucket):
        hook(hook_state, bucket).wait()
        raise RuntimeError("a peer is gone")

    integration.triton_hook = failing
    backward(3)
    integration.triton_hook = hook
    assert manager._errored is not None and restores
    assert _same(_owed(state), before), "the failed step after a quorum change lost the residuals"
    # A step not committed binds afresh before the next exchange, on every group alike (torchft's commit is a vote of
    # all): after this group's failure above, and after a step that failed only elsewhere.
    regroups = []
    regroup = state.regroup
    state.regroup = lambda group: (regroups.append(group), regroup(group))
    manager.start_quorum()
    backward(1)
    assert len(regroups) == 1 and manager._errored is None
    manager.start_quorum()  # the step before was not committed (another group failed): the step does not advance
    backward(2)
    assert len(regroups) == 2
    manager._step += 1
    manager.start_quorum()  # committed: the same binding
    backward(3)
    assert len(regroups) == 2
    manager._step += 1
    # A group that takes no part sends zeros, whatever error feedback owed.
    manager.start_quorum()
    manager.participating = False
    model.zero_grad()
    backward(0)
    assert all(not p.grad.any() for p in model.parameters()), "a group taking no part sent what its residuals owed"


def test_the_step_bookkeeping_accumulation_a_failure_after_a_quorum_change_and_a_group_taking_no_part():
    """The hook's state across steps: a second backward in one step, a failed step right after the quorum changed
    (its residuals back where they were), and a group that is not participating (zeros on the wire)."""
    from dist_utils import run_workers
    run_workers(_bookkeeping_worker, 1)


# ---- real replica groups under a real lighthouse ------------------------------------------------------------------

class Job:
    """A lighthouse and replica processes writing into ``out``; every process is killed at the end, whatever
    happened."""

    def __init__(self, out: Path, groups: int, ranks: int, min_replicas: int, **options):
        from torchft._torchft import LighthouseServer
        self.out, self.groups, self.ranks, self.options = out, groups, ranks, options
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=5000,
                                           heartbeat_timeout_ms=HEARTBEAT_MS)
        self.procs = {}
        self.min_replicas = min_replicas
        self.restart_crashed, self.crashes = options.get("impl") == "torchft", 0
        self.started = time.monotonic()

    def start(self, replica: int, barrier: bool = True, **extra):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPLICA.parents[2]),
                                                                          os.environ.get("PYTHONPATH")]))}
        env.pop("TRITON_INTERPRET", None)  # the CPU kernels (their bits are tested elsewhere): 10x faster steps
        (self.out / f"store{replica}").unlink(missing_ok=True)  # a restart's ranks meet on its new store only
        for rank in range(self.ranks):
            args = [sys.executable, str(REPLICA), "--lighthouse", self.lighthouse.address(), "--replica",
                    str(replica), "--rank", str(rank), "--ranks", str(self.ranks), "--out", str(self.out),
                    "--min-replicas", str(self.min_replicas)]
            if barrier:
                args += ["--barrier", str(self.groups * self.ranks)]
            for key, value in {**self.options, **extra}.items():
                args += [f"--{key.replace('_', '-')}", str(value)]
            log = open(self.out / f"stdout{replica}_{rank}_{len(self.procs)}.txt", "w")
            self.procs[(replica, rank, len(self.procs))] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                                             env=env)

    def lines(self, replica: int, rank: int = 0):
        path = self.out / f"r{replica}_{rank}.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what, condition):
        while not condition():
            self.check_time(what)
            self.supervise()
            time.sleep(0.05)

    def supervise(self):
        """Restart a replica that crashed, where the job says so (torchft 0.2's own DDP raises from its comm hook when
        a peer dies: its replicas are restarted, as torchft's own tests restart theirs)."""
        if not self.restart_crashed:
            return
        for (replica, rank, _), proc in list(self.procs.items()):
            if proc.poll() not in (None, 0, -signal.SIGKILL) and not getattr(proc, "restarted", False):
                proc.restarted = True
                self.crashes += 1
                self.start(replica, barrier=False)

    def check_time(self, what):
        crashed = {key: proc.returncode for key, proc in self.procs.items()
                   if proc.poll() not in (None, 0, -signal.SIGKILL) and not self.restart_crashed}
        if crashed:
            raise AssertionError(f"{what}: replicas {crashed} failed; their output is in {self.out}")
        if time.monotonic() - self.started > DEADLINE:
            raise AssertionError(f"{what}: not within {DEADLINE} s; the replicas' output is in {self.out}")

    def kill_group(self, replica: int):
        for (r, _, _), proc in self.procs.items():
            if r == replica and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    def finish(self):
        while any(proc.poll() is None for proc in self.procs.values()):
            self.check_time("the replicas to finish")
            self.supervise()
            time.sleep(0.1)

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()


@pytest.fixture
def job(tmp_path):
    made = []

    def make(**kwargs):
        made.append(Job(tmp_path / f"job{len(made)}", **kwargs))
        made[-1].out.mkdir()
        return made[-1]

    yield make
    for j in made:
        j.close()


def run_with_a_group_killed(job, impl, groups, ranks, steps=60, kill_at=20, min_replicas=2, comm="fp8e4m3+ef"):
    """Train ``steps`` steps; SIGKILL every rank of the last replica group once it has committed ``kill_at`` steps,
    start it again 3 s later. Returns the job once every process has finished. Until the restarted group has
    committed a step, every step waits 0.5 s (the file ``pace``), so that the others are still training when it is
    back, however long its start takes on busy cores; then they run at full speed."""
    j = job(groups=groups, ranks=ranks, min_replicas=min_replicas, impl=impl, steps=steps, comm=comm, pace=0.5)
    (j.out / "pace").write_text("1")
    for replica in range(groups):
        j.start(replica)
    victim = groups - 1
    j.wait_for(f"replica {victim} to commit {kill_at} steps",
               lambda: any(line.get("after", 0) >= kill_at for line in j.lines(victim)))
    j.kill_group(victim)
    j.killed_at = time.time()
    time.sleep(3.0)  # the schedule under test: restarted 3 s later
    j.start(victim, barrier=False)
    j.wait_for(f"replica {victim} to commit a step after its restart",
               lambda: any(line.get("committed") and line["t"] > j.killed_at for line in j.lines(victim)))
    (j.out / "pace").unlink()
    j.finish()
    failed = {key: proc.returncode for key, proc in j.procs.items()
              if proc.returncode not in (0, -signal.SIGKILL) and not getattr(proc, "restarted", False)}
    assert not failed, f"replicas exited with errors {failed}; output in {j.out}"
    return j


def final_loss(j, groups, ranks):
    losses = [line["loss"] for g in range(groups) for r in range(ranks) for line in j.lines(g, r)[-11:-1]]
    return sum(losses) / len(losses)


def check_survival(j, groups, ranks, steps):
    victim = groups - 1
    step_times = []
    for g in range(victim):
        lines = [line for line in j.lines(g) if "after" in line]
        times = [line["t"] for line in lines]
        step_times += [b - a for a, b in zip(times, times[1:])]
    normal = sorted(step_times)[len(step_times) // 2]
    for g in range(victim):
        lines = [line for line in j.lines(g) if "after" in line]
        gaps = [b["t"] - a["t"] for a, b in zip(lines, lines[1:])]
        # the survivors never stop: a gap is at most the lighthouse dropping the dead group plus one step (and the
        # step itself: a median step, doubled for the two cores this machine shares with the replicas)
        assert max(gaps) <= HEARTBEAT_MS / 1000 + 2 * normal + 1.0, (g, max(gaps), normal)
        assert lines[-1]["after"] == steps
    restarted = [line for line in j.lines(victim) if "after" in line and line["t"] > j.killed_at]
    assert any(line["committed"] and line["participants"] == groups for line in restarted), \
        "the restarted group never took part again"
    heal = next(line["t"] for line in restarted if line["committed"])
    params = [torch.load(j.out / f"r{g}_{r}.pt") for g in range(groups) for r in range(ranks)]
    for other in params[1:]:
        for name, value in params[0].items():
            assert torch.equal(value, other[name]), f"{name} differs between replica groups"
    return heal - j.killed_at


def test_three_groups_fp8_survive_a_kill_and_match_torchfts_loss(job):
    """3 groups x 1 rank, FP8 + error feedback, one group SIGKILLed at step 20 and back 3 s later; against torchft's
    own DDP (float32) under the same schedule."""
    ours_job = run_with_a_group_killed(job, "ours", groups=3, ranks=1)
    back_after = check_survival(ours_job, 3, 1, 60)
    theirs = run_with_a_group_killed(job, "torchft", groups=3, ranks=1)  # its crashed replicas restarted
    ours_loss, their_loss = final_loss(ours_job, 3, 1), final_loss(theirs, 3, 1)
    # 2%: the issue's bound; FP8 with error feedback follows float32's trajectory that closely on this model
    assert abs(ours_loss - their_loss) <= 0.02 * their_loss, (ours_loss, their_loss)
    print(f"healed group took part again {back_after:.1f} s after the kill; loss {ours_loss:.5f} vs torchft's "
          f"{their_loss:.5f} (its replicas crashed and were restarted {theirs.crashes} times)")


def test_two_groups_of_two_ranks_survive_a_whole_group_killed(job):
    """2 groups x 2 ranks (float32 inside the group, FP8 + error feedback between groups), group 1 killed whole."""
    j = run_with_a_group_killed(job, "ours", groups=2, ranks=2, steps=40, kill_at=15, min_replicas=1)
    check_survival(j, 2, 2, 40)


def test_a_peer_lost_inside_the_hook_throws_the_step_away_and_rolls_the_residuals_back(job):
    """Group 2 SIGKILLs itself in its backward of step 5, its first bucket sent and its last not: the survivors'
    exchange fails, no one commits that step, and their residuals after it are the ones before it."""
    j = job(groups=3, ranks=1, min_replicas=2, impl="ours", steps=10, comm="fp8e4m3+ef")
    for replica in range(2):
        j.start(replica)
    j.start(2, die_in_hook=5)
    j.wait_for("the victim to die", lambda: j.procs[(2, 0, 2)].poll() is not None)
    assert j.procs[(2, 0, 2)].returncode == -signal.SIGKILL
    assert all(line["before"] < 5 for line in j.lines(2) if "before" in line)  # it committed nothing of step 5
    j.finish()
    for g in range(2):
        lines = [line for line in j.lines(g) if "before" in line]
        thrown = [line for line in lines if line["before"] == 5 and not line["committed"]]
        assert thrown and thrown[0]["errored"], f"group {g} did not see the exchange fail: {lines}"
        first = thrown[0]
        assert first["res_before"] != "" and first["res_after"] == first["res_before"], first
        assert lines[-1]["after"] == 10


def test_the_example_trains_two_replica_groups(tmp_path):
    """examples/torchft_train.py as its docstring runs it (torchrun per replica group, a lighthouse), briefly."""
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000)
    example = REPLICA.parents[2] / "examples" / "torchft_train.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = []
    try:
        for group in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(example),
                 "--comm", "fp8", "--steps", "20", "--hidden", "32", "--min-replicas", "2"],
                env={**env, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "REPLICA_GROUP_ID": str(group)},
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [proc.communicate(timeout=DEADLINE)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    for group, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output[-3000:]
        assert f"group {group} step 20: loss" in output and "fp8e4m3+ef between groups" in output, output[-3000:]
