"""The rule that picks a wire format from timing samples (``machine.profile.format_rule``), on synthetic samples: the
interval on a median, noise that never moves the choice off the more accurate format, a clear win that does, one
format kept over neighbouring sizes, determinism. Tier: no device."""

import math
import random

import numpy as np
import pytest

from ddp_triton.formats import preference_key, sorted_by_preference
from ddp_triton.machine.profile import (FormatRow, TimingStats, admitted_formats, choose_format, choose_formats,
                                        decide_format, median_interval)

# The order of the accuracy table (README, docs/formats.md), most accurate first (bf16 + fp32 sums, bf16; fp16
# overflows; FP8 with error feedback before without), flat before two-level.
ACCURACY_ORDER = ["fp32", "two-level fp32", "bf16+fp32sum", "bf16", "two-level bf16", "fp16+fp32sum", "fp16",
                  "fp8e4m3+ef", "two-level fp8e4m3+ef", "fp8e5m2+ef", "fp8e4m3", "fp8e5m2"]


def _noisy(rng: np.random.Generator, median_us: float, n: int, spread: float = 0.25) -> list:
    """``n`` timings around ``median_us``: log-normal, with a one-in-ten tail of 2-4x (a rank descheduled)."""
    t = median_us * np.exp(rng.normal(0.0, spread, n))
    tail = rng.random(n) < 0.1
    t[tail] *= rng.uniform(2.0, 4.0, tail.sum())
    return t.tolist()


def _coverage(n: int, k: int) -> float:
    """P(k-th smallest <= median <= k-th largest) of n samples from a continuous distribution, by enumeration."""
    below = sum(math.comb(n, i) for i in range(k)) / 2 ** n
    return 1.0 - 2.0 * below


def test_the_accuracy_order_is_one_sort_key():
    shuffled = ACCURACY_ORDER[:]
    random.Random(3).shuffle(shuffled)
    assert sorted_by_preference(shuffled) == ACCURACY_ORDER
    assert sorted(shuffled, key=preference_key) == ACCURACY_ORDER


@pytest.mark.parametrize("n, k", [pytest.param(5, 1, id="five-min-max"), pytest.param(9, 2, id="nine"),
                                  pytest.param(20, 6, id="twenty"), pytest.param(100, 40, id="hundred")])
def test_the_median_interval_is_the_widest_order_statistics_that_reach_95_percent(n, k):
    samples = [float(i) for i in range(n, 0, -1)]  # n..1, unsorted on purpose
    s = median_interval(samples)
    assert (s.lo_us, s.hi_us, s.samples) == (float(k), float(n - k + 1), n)
    assert s.median_us == (n + 1) / 2
    # k is the largest rank that covers the median 95% of the time (five samples: none does, min..max is the most).
    if n > 5:
        assert _coverage(n, k) >= 0.95 > _coverage(n, k + 1)
    else:
        assert _coverage(n, 1) < 0.95


def test_the_median_interval_covers_the_true_median_as_promised():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        s = median_interval(rng.lognormal(0.0, 0.5, 20).tolist())  # true median 1.0
        hits += s.lo_us <= 1.0 <= s.hi_us
    # 95.9% promised at n=20 (the 6th to the 15th); 2000 draws: a standard error of 0.45%, so 94% is 4 of them below.
    assert hits / 2000 >= 0.94


def test_noise_within_the_interval_never_leaves_the_more_accurate_format():
    rng = np.random.default_rng(1)
    fastest_was_other = 0
    for _ in range(300):
        samples = {"fp32": _noisy(rng, 1000.0, 15), "bf16": _noisy(rng, 1000.0, 15),
                   "fp8e4m3+ef": _noisy(rng, 1000.0, 15)}
        medians = {f: float(np.median(t)) for f, t in samples.items()}
        fastest_was_other += min(medians, key=medians.get) != "fp32"
        decision = choose_format(samples)
        assert decision.format == "fp32" and not decision.switched, decision.reason
    # The noise is real: the fastest median (what the tuner chose before) was another format in most draws.
    assert fastest_was_other > 150


def test_a_win_inside_the_noise_keeps_the_accurate_format_and_a_clear_win_switches():
    base = [100.0, 104.0, 108.0, 112.0, 116.0, 120.0, 124.0]
    overlapping = [t - 15.0 for t in base]  # 13% faster medians, but its interval reaches into fp32's
    d = choose_format({"fp32": base, "bf16": overlapping})
    assert d.format == "fp32" and "fastest bf16 97 us [85, 109] is within the noise" in d.reason
    clear = [t * 0.5 for t in base]
    d = choose_format({"fp32": base, "bf16": clear})
    assert d.format == "bf16" and d.switched
    assert d.reason == "bf16 56 us [50, 62] beats fp32 112 us [100, 124] (the most accurate allowed) beyond the noise"


def test_a_clear_win_goes_to_the_most_accurate_of_the_formats_tied_with_the_fastest():
    rng = np.random.default_rng(2)
    samples = {"fp32": _noisy(rng, 2000.0, 30, 0.05), "bf16": _noisy(rng, 1010.0, 30, 0.05),
               "fp8e4m3+ef": _noisy(rng, 1000.0, 30, 0.05)}
    d = choose_format(samples)
    assert d.format == "bf16" and "fastest fp8e4m3+ef" in d.reason and "within its noise" in d.reason
    # Had FP8 been clearly faster than bf16 too, FP8.
    samples["fp8e4m3+ef"] = _noisy(rng, 500.0, 30, 0.05)
    assert choose_format(samples).format == "fp8e4m3+ef"


def test_a_switch_needs_more_than_the_tolerance_even_with_tight_intervals():
    tight = {"fp32": TimingStats(100.0, 99.9, 100.1, 200), "bf16": TimingStats(98.0, 97.9, 98.1, 200)}
    assert decide_format(tight).format == "fp32"  # disjoint, but 2% < 3%
    assert decide_format(tight, tolerance=0.01).format == "bf16"


def _rows(size, **stats):
    return [FormatRow(size, f.replace("_", "+"), s.median_us, None, (s.lo_us, s.hi_us), s.samples)
            for f, s in stats.items()]


def test_neighbouring_sizes_keep_one_format_unless_the_difference_is_significant():
    fp8 = "fp8e4m3_ef"
    rows = (_rows(1 << 20, fp32=TimingStats(200, 190, 210, 20), **{fp8: TimingStats(100, 95, 105, 20)})
            # fp32 a little faster, inside the noise: FP8 stays
            + _rows(1 << 21, fp32=TimingStats(195, 180, 215, 20), **{fp8: TimingStats(205, 190, 220, 20)})
            # fp32 clearly faster: back to fp32
            + _rows(1 << 22, fp32=TimingStats(200, 190, 210, 20), **{fp8: TimingStats(300, 280, 320, 20)}))
    ranges = choose_formats(rows)
    assert [r.format for r in ranges] == ["fp8e4m3+ef", "fp32"]
    assert ranges[0].max_bytes == math.isqrt((1 << 21) * (1 << 22))
    assert "2 MiB: fp8e4m3+ef 205 us [190, 220] (kept from the previous size)" in ranges[0].reason
    # Alone, the middle size would go to the more accurate fp32: only the neighbour keeps FP8 there.
    middle = {r.format: r.stats for r in rows if r.nbytes == 1 << 21}
    assert decide_format(middle).format == "fp32"
    assert decide_format(middle, incumbent="fp8e4m3+ef").format == "fp8e4m3+ef"


def test_the_decision_is_a_function_of_the_timings_alone():
    rng = np.random.default_rng(4)
    samples = {"fp8e4m3+ef": _noisy(rng, 700.0, 25), "bf16": _noisy(rng, 700.0, 25), "fp32": _noisy(rng, 1500.0, 25)}
    first = choose_format(samples)
    for seed in range(5):
        order = list(samples)
        random.Random(seed).shuffle(order)
        shuffled = {f: random.Random(seed).sample(samples[f], len(samples[f])) for f in order}
        assert choose_format(shuffled) == first
    # Equal medians fall to the accuracy order, whatever the dict order.
    equal = {"fp8e4m3+ef": TimingStats.point(50.0), "bf16": TimingStats.point(50.0), "fp32": TimingStats.point(90.0)}
    assert decide_format(equal).format == decide_format(dict(reversed(list(equal.items())))).format == "bf16"


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda: choose_format({}), "no format timings", id="nothing"),
    pytest.param(lambda: choose_format({"fp32": []}), "'fp32': no timing samples", id="no-samples"),
    pytest.param(lambda: choose_format({"fp32": [1.0, float("nan")]}), "finite", id="nan"),
    pytest.param(lambda: choose_format({"fp9": [1.0]}), "unknown wire format", id="bad-name"),
    pytest.param(lambda: median_interval([1.0], confidence=1.0), "confidence", id="confidence"),
    pytest.param(lambda: decide_format({"fp32": TimingStats.point(1.0)}, tolerance=-0.1), "tolerance",
                 id="tolerance"),
    pytest.param(lambda: TimingStats(10.0, 11.0, 12.0, 3), "lo <= median <= hi", id="median-outside"),
    pytest.param(lambda: FormatRow(1 << 20, "fp32", 10.0, None, (11.0, 12.0), 3), "must hold time_us",
                 id="row-interval-outside"),
])
def test_bad_timings_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_measured_row_keeps_its_interval_through_json():
    row = FormatRow(1 << 20, "bf16", 10.0, None, (9.0, 12.5), 17)
    again = FormatRow.from_dict(row.to_dict())
    assert again == row and again.to_dict()["interval_us"] == [9.0, 12.5]
    assert again.stats == TimingStats(10.0, 9.0, 12.5, 17)
    assert FormatRow(1 << 20, "bf16", 10.0).stats == TimingStats.point(10.0)  # a modelled row: a point


def test_a_two_level_format_that_runs_flat_is_admitted_as_its_flat_format():
    allowed = ["fp32", "bf16", "fp8e4m3+ef", "two-level fp8e4m3+ef"]
    admitted, why = admitted_formats(allowed, 2, 1)  # one node of two ranks
    assert admitted == ["fp32", "bf16", "fp8e4m3+ef"]
    assert why["fp8e4m3+ef"].startswith("in place of two-level fp8e4m3+ef: on one node of 2 ranks")
    assert admitted_formats(["two-level bf16"], 4, 4)[0] == ["bf16"]  # one rank per node: flat as well
    assert admitted_formats(["two-level bf16"], 4, 2)[0] == ["two-level bf16"]  # 2 x 2: two levels
    # Flat, then the bf16 rule at the whole world: 64 ranks on one node, both reasons kept.
    admitted, why = admitted_formats(["two-level bf16"], 64, 1)
    assert admitted == ["bf16+fp32sum"]
    assert "in place of two-level bf16" in why["bf16+fp32sum"] and "in place of bf16" in why["bf16+fp32sum"]
