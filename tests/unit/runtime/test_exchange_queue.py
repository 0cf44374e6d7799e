"""The exchange queue's order rules with stand-in collectives: futures this test completes, on its own schedule.

Tier: unit, no process group. Each stand-in collective records (bucket, stage, group) when it is issued; the test
completes their futures in orders a real backend could, and checks what the queue issued.
"""

import pytest
import torch

from ddp_triton.runtime.exchange import ExchangeQueue, Stage, StagedExchange


class Work:
    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


class Recorder:
    def __init__(self):
        self.issued, self.works = [], {}

    def exchange(self, bucket, groups, fail_compute_at=None):
        """A bucket whose stage i issues on ``groups[i]``; its stage ``fail_compute_at`` computation raises."""
        def compute(i):
            def run():
                if i == fail_compute_at:
                    raise RuntimeError(f"bucket {bucket}: stage {i} failed")
            return run

        def issue(i, group):
            def run():
                work = self.works[(bucket, i)] = Work()
                self.issued.append((bucket, i, group))
                return work
            return run

        stages = [Stage(f"compute {i}", compute(i), f"collective {i}", issue(i, g), g) for i, g in enumerate(groups)]
        return StagedExchange(torch.zeros(1), stages, lambda: None, ())

    def complete(self, bucket, stage):
        self.works[(bucket, stage)].future.set_result(None)


NODE, CROSS, GATHER = "node", "cross", "gather"  # stand-ins for process groups: any hashable object works
TWO_LEVEL = [NODE, CROSS, CROSS, GATHER]


def test_each_group_in_bucket_order_whatever_finishes_first():
    rec, queue = Recorder(), ExchangeQueue()
    results = [queue.start(rec.exchange(b, TWO_LEVEL), last=False) for b in (0, 1)]
    assert rec.issued == [(0, 0, NODE), (1, 0, NODE)]  # bucket 1's node sum goes out with bucket 0's in flight
    rec.complete(1, 0)  # bucket 1's node sum finishes first: bucket 0 still owes the cross group
    assert len(rec.issued) == 2
    rec.complete(0, 0)
    assert rec.issued[-1] == (0, 1, CROSS)
    rec.complete(0, 1)  # bucket 0's all-gather between nodes, then bucket 1 may use the cross group
    assert rec.issued[-2:] == [(0, 2, CROSS), (1, 1, CROSS)]
    for bucket, stage in ((0, 2), (1, 1), (1, 2)):
        rec.complete(bucket, stage)
    assert rec.issued[-3:] == [(0, 3, GATHER), (1, 2, CROSS), (1, 3, GATHER)]
    assert not any(r.done() for r in results)
    rec.complete(1, 3)
    rec.complete(0, 3)
    assert all(r.done() and r.value() is not None for r in results)


def test_a_failed_bucket_stops_every_later_collective_of_the_state():
    """Its peers issued the collectives it did not: anything this rank issued next would pair with the wrong one."""
    rec, queue = Recorder(), ExchangeQueue()
    first = queue.start(rec.exchange(0, [CROSS, CROSS], fail_compute_at=1), last=False)
    rec.complete(0, 0)  # the completion runs bucket 0's next computation, which raises
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        first.wait()
    second = queue.start(rec.exchange(1, [CROSS, CROSS]), last=False)
    with pytest.raises(RuntimeError, match="another bucket's exchange failed on this rank"):
        second.wait()
    with pytest.raises(RuntimeError, match="another bucket's exchange failed on this rank"):
        with queue.ordered():
            pass
    assert rec.issued == [(0, 0, CROSS)]  # nothing of bucket 1's went out


def test_a_failure_fails_the_buckets_waiting_behind_it():
    rec, queue = Recorder(), ExchangeQueue()
    first = queue.start(rec.exchange(0, TWO_LEVEL, fail_compute_at=2), last=False)
    second = queue.start(rec.exchange(1, TWO_LEVEL), last=False)
    rec.complete(0, 0)
    rec.complete(1, 0)
    rec.complete(0, 1)  # bucket 0's stage 2 raises while bucket 1 waits behind it for the cross group
    for result in (first, second):
        with pytest.raises(RuntimeError):
            result.wait()
    assert rec.issued == [(0, 0, NODE), (1, 0, NODE), (0, 1, CROSS)]


def test_the_last_bucket_drains_without_holding_later_buckets_behind_earlier_ones():
    """The backward's last bucket issues everything left, but a bucket's cross-node collective goes out as soon as
    the bucket before has issued its own on that group, not once it has finished."""
    import threading
    import time

    rec, queue = Recorder(), ExchangeQueue()
    first = queue.start(rec.exchange(0, TWO_LEVEL), last=False)
    results = {}
    def drain():
        results[1] = queue.start(rec.exchange(1, TWO_LEVEL), last=True)

    draining = threading.Thread(daemon=True, target=drain)
    draining.start()

    def issued(entry):
        deadline = time.monotonic() + 10
        while entry not in rec.issued:
            assert time.monotonic() < deadline, (entry, rec.issued)
            time.sleep(0.001)

    issued((1, 0, NODE))
    rec.complete(0, 0)
    rec.complete(1, 0)
    issued((0, 1, CROSS))
    rec.complete(0, 1)
    issued((1, 1, CROSS))  # bucket 0's all-gather between nodes is still in flight
    assert not rec.works[(0, 2)].future.done()
    for bucket, stage in ((0, 2), (1, 1), (1, 2)):
        issued((bucket, stage, TWO_LEVEL[stage]))  # the draining thread issues bucket 1's stages in its own time
        rec.complete(bucket, stage)
    issued((1, 3, GATHER))
    draining.join(timeout=10)
    assert not draining.is_alive()
    rec.complete(0, 3)
    rec.complete(1, 3)
    assert first.done() and results[1].done()
    for group in (NODE, CROSS, GATHER):
        order = [(b, s) for b, s, g in rec.issued if g == group]
        assert order == sorted(order), (group, rec.issued)


def test_a_bucket_behind_an_earlier_one_on_its_group_returns_at_once():
    """The sharded exchange's two collectives share one group: a bucket started while the one before still owes its
    all-gather is queued, not waited for on the backward's thread, and goes out (in bucket order) when a
    completion unblocks it."""
    import threading

    rec, queue = Recorder(), ExchangeQueue()
    first = queue.start(rec.exchange(0, [CROSS, CROSS]), last=False)
    started = {}
    starter = threading.Thread(daemon=True, target=lambda: started.setdefault(
        1, queue.start(rec.exchange(1, [CROSS, CROSS]), last=False)))
    starter.start()
    starter.join(timeout=10)
    assert not starter.is_alive(), "the second bucket's start waited for the first bucket's collectives"
    assert rec.issued == [(0, 0, CROSS)]  # bucket 1 waits its turn: bucket 0 owes its all-gather on the group
    rec.complete(0, 0)
    assert rec.issued == [(0, 0, CROSS), (0, 1, CROSS), (1, 0, CROSS)]
    rec.complete(1, 0)
    rec.complete(0, 1)
    rec.complete(1, 1)
    assert rec.issued[-1] == (1, 1, CROSS) and first.done() and started[1].done()
