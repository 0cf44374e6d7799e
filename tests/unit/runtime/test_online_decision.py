"""Online tuning's decision on synthetic trial times: the most accurate format within the noise of the fastest.

Tier: unit, no processes, no clocks. The tuner's trials are filled with made-up step times (milliseconds, as the
all-reduce hands them to every rank) and ``OnlineTuner._decide`` runs on them as it does after the last timed pass.
"""

import itertools

import pytest

from ddp_triton.formats import sorted_by_preference
from ddp_triton.runtime import online
from ddp_triton.runtime.online import NOISE_CAP, NOISE_SPREADS, OnlineTuner, _Trial, choose_within_noise, noise_of

FOUR = ["fp32", "bf16+fp32sum", "bf16", "fp8e4m3+ef"]
#: Relative offsets of a trial's four samples from its median (their median distance from it: 4%), as the steps of a
#: small job on a busy 2-core machine: noise 4 x 4% = 16%.
BUSY = (-0.06, -0.02, 0.02, 0.06)
#: The same on a quiet machine (median distance 0.65%): noise 2.6%, under the floor.
QUIET = (-0.01, -0.003, 0.003, 0.01)


class _Host:
    """What ``_decide`` touches of a CommState: its plans, dropped when the assignment changes."""

    def __init__(self):
        self.plans = {"a plan": None}


def _samples(median_ms, offsets):
    return [median_ms * (1.0 + d) / 1e3 for d in offsets]


def _decide(medians_ms, offsets=BUSY, mixed_ms=None, order=None):
    """The tuner's choice (per bucket) after trials of these median steps, two buckets, in trial order ``order``."""
    tuner = OnlineTuner(list(medians_ms))
    names = order or list(medians_ms)
    tuner._trials = [_Trial(name, _samples(medians_ms[name], offsets), {0: [1e-3], 1: [1e-3]}) for name in names]
    if mixed_ms is not None:
        tuner._trials.append(_Trial({0: "fp32", 1: "fp8e4m3+ef"}, _samples(mixed_ms, offsets), {0: [1e-3], 1: [1e-3]}))
    tuner._bytes = {0: 1000, 1: 2000}
    host = _Host()
    tuner._decide(host, 30)
    assert host.plans == {} and tuner._start is None  # locked, every bucket to bind again in its format
    return tuner.choice, tuner.decided


@pytest.mark.parametrize("fastest", FOUR)
def test_formats_within_the_noise_choose_the_most_accurate_whichever_is_fastest(fastest):
    # Each run of the same job on a busy machine sees another format fastest by a few percent: the choice stays.
    medians = {name: 100.0 if name == fastest else 104.0 + i for i, name in enumerate(FOUR)}
    choice, decided = _decide(medians)
    assert choice == {0: "fp32", 1: "fp32"}, decided
    assert decided[0]["noise"] == pytest.approx(NOISE_SPREADS * 0.04)  # the samples' median distance: 2% and 6%


def test_the_most_accurate_of_those_within_the_noise_when_the_most_accurate_is_not():
    # fp32 is clearly slower; bf16 + fp32 sums, bf16 and FP8 are within the noise of each other.
    choice, _ = _decide({"fp32": 200.0, "bf16+fp32sum": 104.0, "bf16": 101.0, "fp8e4m3+ef": 100.0})
    assert set(choice.values()) == {"bf16+fp32sum"}


def test_a_quiet_machine_still_takes_a_format_a_few_percent_faster():
    # The emulated cluster at 1 Gbit/s: FP8 + EF 515 ms, bf16 and bf16 + fp32 sums 558, fp32 1235 (bench/RESULTS.md).
    medians = {"fp32": 1235.0, "bf16+fp32sum": 558.0, "bf16": 558.0, "fp8e4m3+ef": 515.0}
    choice, decided = _decide(medians, offsets=QUIET)
    assert set(choice.values()) == {"fp8e4m3+ef"}
    assert decided[0]["noise"] == pytest.approx(online.SWITCH_TOLERANCE)


@pytest.mark.parametrize("ratio", [2.0, 1.7], ids=["2x", "1.7x"])
def test_however_noisy_the_machine_a_clearly_faster_format_wins(ratio):
    wild = (-0.5, -0.3, 0.3, 0.8)  # spread far beyond the cap
    medians = {"fp32": 100.0 * ratio, "bf16+fp32sum": 100.0 * ratio, "bf16": 100.0 * ratio, "fp8e4m3+ef": 100.0}
    choice, decided = _decide(medians, offsets=wild)
    assert set(choice.values()) == {"fp8e4m3+ef"}
    assert decided[0]["noise"] == NOISE_CAP


@pytest.mark.parametrize("mixed_ms, wins", [(95.0, False), (50.0, True)], ids=["within-the-noise", "2x"])
def test_a_mix_wins_only_beyond_the_noise(mixed_ms, wins):
    choice, _ = _decide({name: 100.0 for name in FOUR}, mixed_ms=mixed_ms)
    assert choice == ({0: "fp32", 1: "fp8e4m3+ef"} if wins else {0: "fp32", 1: "fp32"})


def test_the_decision_depends_on_the_times_alone_not_their_order():
    medians = {"fp32": 103.0, "bf16+fp32sum": 100.0, "bf16": 102.0, "fp8e4m3+ef": 101.0}
    choices = {repr(_decide(medians, order=list(order))[0]) for order in itertools.permutations(FOUR)}
    assert choices == {repr({0: "fp32", 1: "fp32"})}


def test_the_accuracy_order_is_the_formats_own():
    # fp16 and FP8 without error feedback too: the order comes from ddp_triton.formats, not a list here.
    names = ["fp8e4m3", "fp16", "fp8e4m3+ef", "bf16", "fp16+fp32sum", "bf16+fp32sum", "fp32"]
    assert sorted_by_preference(names) == ["fp32", "bf16+fp32sum", "bf16", "fp16+fp32sum", "fp16", "fp8e4m3+ef",
                                           "fp8e4m3"]
    times = {name: [1.0] for name in names}  # all alike: the most accurate
    assert choose_within_noise(times) == ("fp32", online.SWITCH_TOLERANCE)
    del times["fp32"], times["bf16+fp32sum"]
    assert choose_within_noise(times)[0] == "bf16"


def test_the_noise_is_the_pooled_median_spread_within_its_bounds():
    assert noise_of({"a": [1.0, 1.0, 1.0, 1.0]}) == online.SWITCH_TOLERANCE
    # One long stall in one trial does not widen the noise: the median of the pooled distances ignores it.
    stalled = {"a": _samples(100.0, BUSY), "b": _samples(100.0, BUSY[:3] + (3.0,))}
    assert noise_of(stalled) == pytest.approx(NOISE_SPREADS * 0.04)
    assert noise_of({"a": [1.0, 2.0, 3.0, 10.0]}) == NOISE_CAP
    with pytest.raises(ValueError, match="no trial times"):
        choose_within_noise({"fp32": []})
