"""The rule that picks a bucket's wire format from timings: keep the more accurate, simpler format unless another is
faster beyond the noise of the measurement.

A format's timings become its median and a distribution-free confidence interval on that median (``median_interval``:
order statistics, ``CONFIDENCE`` or, from too few samples, the widest they give). ``decide_format`` is the rule, one
function of those intervals, deterministic: the baseline is the format kept from before (the neighbouring bucket
size's choice, or a running tuner's current format), else the first in accuracy order (``formats.preference_key``);
it stands unless the fastest format beats it *significantly*: both its interval lies wholly below the baseline's and
its median is more than ``tolerance`` below. Then the choice is the first in preference order of the formats that
beat the baseline significantly and that the fastest does not beat significantly. Timings without spread (the cost
model's) are points: the rule then reduces to "switch when more than ``tolerance`` faster".

Pure: no processes, no clocks, no torch; ``choose_format`` takes raw samples, the profile's rows keep the intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, Mapping, Optional, Sequence

from ...formats import sorted_by_preference

#: Coverage of a median's interval. Below six samples no pair of order statistics reaches it: min..max then
#: (93.75% at five samples).
CONFIDENCE = 0.95
#: A format displaces the baseline only when its median is also more than this fraction below the baseline's:
#: intervals from many quiet samples can be narrower than any difference worth a less accurate format.
SWITCH_TOLERANCE = 0.03

#: How many timings of each format the rule gets per bucket size (``tune.format_timing``): at least MIN_ROUNDS (five
#: samples: a median interval of min..max, 94% coverage), at most MAX_ROUNDS (the interval on the median of 100 is
#: the 40th to the 61st sample).
MIN_ROUNDS = 5
MAX_ROUNDS = 100
#: A size's rounds stop once every format's median is known within this fraction (the interval's half-width).
DEFAULT_REL_ERROR = 0.05
#: Seconds the timings of all sizes may take together (each size still gets its warm-up and first MIN_ROUNDS).
DEFAULT_BUDGET_S = 60.0


@dataclass(frozen=True)
class TimingStats:
    """A format's timings at one bucket size: the median and the interval on it, microseconds."""

    median_us: float
    lo_us: float
    hi_us: float
    samples: int
    """How many timings (1 for a point: a modelled time, or a single measurement)."""

    def __post_init__(self) -> None:
        for key in ("median_us", "lo_us", "hi_us"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"timing stats: {key} must be a finite number >= 0, got {v!r}")
        if not self.lo_us <= self.median_us <= self.hi_us:
            raise ValueError(f"timing stats: need lo <= median <= hi, got {self.lo_us}, {self.median_us}, "
                             f"{self.hi_us}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"timing stats: samples must be an int >= 1, got {self.samples!r}")

    @classmethod
    def point(cls, time_us: float) -> "TimingStats":
        """A time without spread (the cost model's)."""
        return cls(time_us, time_us, time_us, 1)

    @property
    def relative_error(self) -> float:
        """The interval's larger half-width as a fraction of the median (0 for a point or a zero median)."""
        if self.median_us <= 0:
            return 0.0
        return max(self.median_us - self.lo_us, self.hi_us - self.median_us) / self.median_us

    def text(self) -> str:
        if self.samples == 1:
            return f"{self.median_us:.0f} us"
        return f"{self.median_us:.0f} us [{self.lo_us:.0f}, {self.hi_us:.0f}]"


def _order_statistic_rank(n: int, confidence: float) -> int:
    """The largest k (1-based) whose interval, the k-th smallest to the k-th largest of n samples, holds the median
    with probability >= ``confidence``; 1 (min..max) when none does."""
    alpha = Fraction(1.0 - confidence)
    k, below = 1, 1  # below: 2**n * P(Binomial(n, 1/2) <= k - 1), the chance the median lies under the k-th smallest
    while k + 1 <= (n + 1) // 2:
        nxt = below + math.comb(n, k)
        if Fraction(2 * nxt, 2 ** n) > alpha:  # the interval at k + 1 would miss the median too often
            break
        k, below = k + 1, nxt
    return k


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> TimingStats:
    """The median of ``samples`` and a distribution-free interval on it: the k-th smallest and k-th largest sample,
    k the largest with coverage >= ``confidence`` (binomial order statistics), or min..max when none reaches it."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    values = sorted(float(s) for s in samples)
    if not values:
        raise ValueError("no timing samples")
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"timing samples must be finite and >= 0, got {list(samples)!r}")
    n = len(values)
    mid = n // 2
    median = values[mid] if n % 2 else 0.5 * (values[mid - 1] + values[mid])
    k = _order_statistic_rank(n, confidence)
    return TimingStats(median, values[k - 1], values[n - k], n)


@dataclass(frozen=True)
class FormatDecision:
    """What ``decide_format`` chose, and why, in words that name the times it was chosen on."""

    format: str
    reason: str
    switched: bool
    """Whether the choice displaced the baseline (a significant win)."""


def significantly_faster(a: TimingStats, b: TimingStats, tolerance: float = SWITCH_TOLERANCE) -> bool:
    """Is ``a`` faster than ``b`` beyond the noise: its interval wholly below ``b``'s and its median more than
    ``tolerance`` below?"""
    return a.hi_us < b.lo_us and a.median_us < b.median_us * (1.0 - tolerance)


def decide_format(stats: Mapping[str, TimingStats], incumbent: Optional[str] = None,
                  tolerance: float = SWITCH_TOLERANCE) -> FormatDecision:
    """The format to use from each format's ``TimingStats`` (see the module docstring for the rule).

    ``incumbent``: the format kept from before (a neighbouring size's choice, a running tuner's); ignored when it has
    no timings here. Deterministic: ties fall to the accuracy order (``formats.preference_key``), never to dict order.
    """
    if not stats:
        raise ValueError("no format timings to choose from")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    for name, s in stats.items():
        if not isinstance(s, TimingStats):
            raise ValueError(f"timings of {name!r} must be TimingStats, got {type(s).__name__}")
    order = sorted_by_preference(list(stats))
    fastest = min(order, key=lambda f: stats[f].median_us)  # min keeps the first of equals: the preferred one
    kept = incumbent is not None and incumbent in stats
    base = incumbent if kept else order[0]
    role = "kept from the previous size" if kept else "the most accurate allowed"
    if not significantly_faster(stats[fastest], stats[base], tolerance):
        if fastest == base:
            why = f"{base} {stats[base].text()} ({role}), the fastest"
        else:
            why = (f"{base} {stats[base].text()} ({role}); fastest {fastest} {stats[fastest].text()} is within the "
                   "noise")
        return FormatDecision(base, why, False)
    better = [f for f in order if significantly_faster(stats[f], stats[base], tolerance)
              and not significantly_faster(stats[fastest], stats[f], tolerance)]
    choice = better[0]
    why = f"{choice} {stats[choice].text()} beats {base} {stats[base].text()} ({role}) beyond the noise"
    if choice != fastest:
        why += f"; fastest {fastest} {stats[fastest].text()} is within its noise"
    return FormatDecision(choice, why, True)


def choose_format(samples: Mapping[str, Sequence[float]], incumbent: Optional[str] = None,
                  tolerance: float = SWITCH_TOLERANCE, confidence: float = CONFIDENCE) -> FormatDecision:
    """``decide_format`` on raw timings: microseconds per exchange, by format name (each at least one sample)."""
    stats: Dict[str, TimingStats] = {}
    for name, values in samples.items():
        try:
            stats[name] = median_interval(values, confidence)
        except ValueError as e:
            raise ValueError(f"format {name!r}: {e}") from None
    return decide_format(stats, incumbent, tolerance)

