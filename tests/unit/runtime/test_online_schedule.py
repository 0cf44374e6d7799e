"""Online tuning's schedule driven pass by pass on a fake clock: a change of the machine's load during tuning must not
choose the format.

Tier: unit, no processes, no wall clock. A world of one (the all-reduce MAX leaves the times as they are) whose
clock the test moves: each pass takes its format's step time, times the machine's load at that pass, times a few
percent of fixed jitter. The tuner's clock and collective come from ``OnlineTuner.calls``, which the test replaces.
"""

import contextlib
import itertools
from types import SimpleNamespace

import pytest

from ddp_triton.runtime import online
from ddp_triton.runtime.online import OnlineTuner, TunerCalls

FOUR = ["fp32", "bf16+fp32sum", "bf16", "fp8e4m3+ef"]  # most accurate first, the trials' order
#: Per format, its step in ms on an idle machine, and the format the rule must choose there: the most accurate whose
#: step is within the noise of the fastest. "slower": fp32 and bf16 + fp32 sums are clearly (2x) slower, so bf16.
#: "alike": every format's step is the same, so fp32.
CASES = {
    "slower": ({"fp32": 100.0, "bf16+fp32sum": 100.0, "bf16": 50.0, "fp8e4m3+ef": 50.0}, "bf16"),
    "alike": ({name: 50.0 for name in FOUR}, "fp32"),
}
#: The same job's jitter at every pass, within +-3% (a quiet machine's): a fixed sequence, so the test is exact.
JITTER = [1.0 + 0.01 * d for d in (0, 3, -2, 1, -3, 2, -1)]


class _Host:
    """What the tuner reads of a CommState: the pass count, its plans (dropped at a switch), the group and the order
    of collectives."""

    def __init__(self):
        self.passes = 0
        self.plans = {}
        self.context = SimpleNamespace(group=None)
        self.queue = SimpleNamespace(ordered=contextlib.nullcontext)


class _FakeClock(TunerCalls):
    """A world of one on a clock the test moves: the all-reduce MAX of one rank's times is those times."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    @staticmethod
    def all_reduce_max(tensor, group, async_op):
        return SimpleNamespace(wait=lambda: True) if async_op else None


def _run(step_ms, load):
    """Drive one bucket's tuner until it chooses: the choice, and the format of each pass until then."""
    tuner, host, clock = OnlineTuner(list(step_ms)), _Host(), _FakeClock()
    tuner.calls = clock
    seen = []
    for p in itertools.count():
        host.passes = p
        tuner.before_call(host, 0, 1000, False)  # the pass's first (and only) bucket: the schedule moves on
        if tuner.tuned() is not None:
            return tuner.tuned()[0]["format"], seen
        name = tuner.format_of(0) or "fp32"  # before tuning: the context's own format
        seen.append(name)
        clock.t += step_ms[name] / 1e3 * load(p) * JITTER[p % len(JITTER)]
        tuner.ended(0)  # the exchange's end, the pass's last: a step is the time from one pass's end to the next's
        assert p < 200, "tuning never ended"


def _uniform_passes():
    return len(FOUR) * (online.WARM_PASSES + online.MEASURED_PASSES) * online.ROUNDS


def _sequential(monkeypatch):
    """The schedule before the rounds: each format's trial (a warm pass, four timed) one after another."""
    monkeypatch.setattr(online, "ROUNDS", 1)
    monkeypatch.setattr(online, "MEASURED_PASSES", 4)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("change, where", [
    pytest.param(2.0, 0.5, id="2x-slower-halfway"),
    pytest.param(0.5, 0.5, id="2x-faster-halfway"),  # a CPU burner that stops
    pytest.param(2.0, 1 / 3, id="2x-slower-a-third-in"),  # within a round of the interleaved schedule
    pytest.param(0.5, 1 / 3, id="2x-faster-a-third-in"),
])
def test_a_load_change_during_tuning_does_not_choose_the_format(monkeypatch, case, change, where):
    step_ms, right = CASES[case]
    at = 1 + round(where * _uniform_passes())  # tuning starts at pass 1
    choice, seen = _run(step_ms, lambda p: change if p >= at else 1.0)
    assert choice == right, (choice, seen)
    assert choice == _run(step_ms, lambda p: 1.0)[0]  # as on a machine whose load stays


@pytest.mark.parametrize("case", list(CASES))
def test_the_sequential_schedule_took_a_load_change_for_a_format(monkeypatch, case):
    """What the rounds are for: one format after another, the formats timed after the change look 2x faster or
    slower, beyond any noise, and the choice goes wrong in one direction of change or the other."""
    _sequential(monkeypatch)
    step_ms, right = CASES[case]
    at = 1 + _uniform_passes() // 2
    assert _run(step_ms, lambda p: 1.0)[0] == right  # it chooses well while the load stays
    wrong = {change: _run(step_ms, lambda p: change if p >= at else 1.0)[0] for change in (2.0, 0.5)}
    assert any(choice != right for choice in wrong.values()), wrong


def test_the_rounds_interleave_the_formats_in_alternating_order(monkeypatch):
    """Two formats, a warm pass and a timed one each per round: every format sees every stretch of the tuning, in an
    order that a steady drift within a round favours neither (forward, then backward), a function of the pass alone."""
    monkeypatch.setattr(online, "WARM_PASSES", 1)
    monkeypatch.setattr(online, "MEASURED_PASSES", 1)
    monkeypatch.setattr(online, "ROUNDS", 4)
    _, seen = _run({"fp32": 50.0, "bf16": 50.0}, lambda p: 1.0)
    a, b = "fp32", "bf16"
    assert seen == ["fp32"] + [a, a, b, b, b, b, a, a] * 2, seen  # pass 0: before tuning; the choice at pass 17
