"""The rows and ranges a profile holds, each validated when built: sweep rows, algorithm ranges, and the wire format
per bucket size (``FormatRow``, ``FormatRange``, ``FormatChoice``). The file layout is ``schema``'s docstring."""

from __future__ import annotations

import bisect
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ...dtypes import normalize_dtype
from ...formats import canonical_name
from ..cost_model import ALGORITHMS, PROTOCOLS
from .format_rule import TimingStats

_FORMATS_FIELDS = ("source", "allowed", "admitted", "table", "rows", "host", "notes")


def _refuse_unknown(d: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    unknown = sorted(set(map(str, d)) - set(known))
    if unknown:
        raise ValueError(f"{where}unknown field(s) {', '.join(map(repr, unknown))}")


def _refuse_unknown_in_lists(d: Mapping[str, Any], lists: Sequence[Tuple[str, Sequence[str]]], where: str) -> None:
    """``_refuse_unknown`` for every object in the lists ``d[key]``, by (key, known fields)."""
    for key, known in lists:
        entries = d.get(key)
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if isinstance(entry, Mapping):
                    _refuse_unknown(entry, known, f"{where}{key}[{i}]: ")


def _bounds(entry: Any, where: str) -> None:
    """Check a range's ``min_bytes`` and ``max_bytes`` (None: unbounded) in place."""
    entry.min_bytes = _int(entry.min_bytes, "min_bytes", where, 0)
    if entry.max_bytes is not None:
        entry.max_bytes = _int(entry.max_bytes, "max_bytes", where, entry.min_bytes)


def _check_algorithm(alg: Any, where: str) -> None:
    if alg not in ALGORITHMS:
        raise ValueError(f"{where}: unknown algorithm {alg!r}; known: {', '.join(ALGORITHMS)}")


def _check_protocol(proto: Any, where: str) -> None:
    if proto is not None and proto not in PROTOCOLS:
        raise ValueError(f"{where}: unknown protocol {proto!r}; known: {', '.join(PROTOCOLS)}")


def _finite_nonneg(x: Any, name: str, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {x!r}")
    return float(x)


def _int(x: Any, name: str, where: str, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {x!r}")
    return x


class _JsonRow:
    """What every row and range shares: its JSON object holds its fields in order, ``nbytes`` spelt ``bytes``; a
    field without a default is required (KeyError naming it), a missing optional one takes its default."""

    what = "row"
    """The row's name in error messages."""

    @classmethod
    def json_fields(cls) -> Tuple[str, ...]:
        return tuple("bytes" if f.name == "nbytes" else f.name for f in fields(cls))  # type: ignore[arg-type]

    def to_dict(self) -> Dict[str, Any]:
        values = (getattr(self, f.name) for f in fields(self))  # type: ignore[arg-type]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in zip(self.json_fields(), values)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        if not isinstance(d, Mapping):
            raise ValueError(f"{cls.what} must be an object, got {d!r}")
        kwargs = {f.name: d[key] for f, key in zip(fields(cls), cls.json_fields())  # type: ignore[arg-type]
                  if f.default is MISSING or key in d}
        return cls(**kwargs)


@dataclass
class SweepRow(_JsonRow):
    """One timed (or modelled) all-reduce: size, algorithm and what it cost."""

    nbytes: int
    """Message size in bytes (``bytes`` in JSON)."""
    algorithm: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    dtype: Optional[str] = None
    """Element type of the message; None means the profile's comm_dtype."""
    protocol: Optional[str] = None
    """NCCL protocol the model predicts; None when measured (NCCL chose)."""
    what = "sweep row"

    def __post_init__(self) -> None:
        where = self.what
        self.nbytes = _int(self.nbytes, "bytes", where, 1)
        _check_algorithm(self.algorithm, where)
        self.time_us = _finite_nonneg(self.time_us, "time_us", where)
        self.algbw_gbps = _finite_nonneg(self.algbw_gbps, "algbw_gbps", where)
        self.busbw_gbps = _finite_nonneg(self.busbw_gbps, "busbw_gbps", where)
        if self.dtype is not None:
            self.dtype = normalize_dtype(self.dtype)
        _check_protocol(self.protocol, where)


@dataclass
class TableEntry(_JsonRow):
    """Messages of ``min_bytes`` to ``max_bytes`` bytes (inclusive; None: no upper bound) use ``algorithm``."""

    min_bytes: int
    max_bytes: Optional[int]
    algorithm: str
    protocol: Optional[str] = None
    """The protocol the model expects NCCL to pick (for the tuner CSV); None when unknown."""
    what = "table entry"

    def __post_init__(self) -> None:
        _bounds(self, self.what)
        _check_algorithm(self.algorithm, self.what)
        _check_protocol(self.protocol, self.what)


def _format_name(name: Any, where: str) -> str:
    try:
        return canonical_name(name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _contiguous(ranges: Sequence[Any], what: str) -> None:
    """ValueError unless ``ranges`` (with min_bytes, max_bytes) start at 0, follow on, and end unbounded."""
    if not ranges:
        raise ValueError(f"{what} must have at least one entry")
    if ranges[0].min_bytes != 0:
        raise ValueError(f"{what} must start at 0 bytes, starts at {ranges[0].min_bytes}")
    for prev, nxt in zip(ranges, ranges[1:]):
        if prev.max_bytes is None or nxt.min_bytes != prev.max_bytes + 1:
            raise ValueError(f"{what} ranges must be contiguous: {prev.to_dict()} then {nxt.to_dict()}")
    if ranges[-1].max_bytes is not None:
        raise ValueError(f"the last {what} range must be unbounded (max_bytes null), got {ranges[-1].to_dict()}")


def size_ranges(sizes: Sequence[int], keys: Sequence[Any]) -> List[Tuple[int, Optional[int], Any, List[int]]]:
    """Contiguous ranges from 0 bytes over the evaluated ``sizes`` (ascending), one per run of equal ``keys``.

    A size between two evaluated ones a < b follows a up to floor(sqrt(a*b)) (the geometric midpoint) and b above
    it; the last range is unbounded. Each range: (min_bytes, max_bytes, key, indices of the sizes it covers).
    """
    ranges: List[Tuple[int, Optional[int], Any, List[int]]] = []
    for i, (size, key) in enumerate(zip(sizes, keys)):
        hi = math.isqrt(size * sizes[i + 1]) if i + 1 < len(sizes) else None
        if ranges and ranges[-1][2] == key:
            ranges[-1] = (ranges[-1][0], hi, key, ranges[-1][3] + [i])
        else:
            lo = 0 if not ranges else ranges[-1][1] + 1  # type: ignore[operator]
            ranges.append((lo, hi, key, [i]))
    return ranges


@dataclass
class FormatRow(_JsonRow):
    """One bucket size (gradient bytes) in one wire format: its time, measured or modelled, and the model's."""

    nbytes: int
    format: str
    time_us: float
    """The median of the timings (measured), or the modelled time."""
    model_us: Optional[float] = None
    """The cost model's time for it (wire and host); None when the model could not describe the machine."""
    interval_us: Optional[Tuple[float, float]] = None
    """The confidence interval on the median (``format_rule.median_interval``); None: a point (modelled)."""
    samples: Optional[int] = None
    """How many timings the median and interval come from; None: a point."""
    what = "format row"

    def __post_init__(self) -> None:
        where = self.what
        self.nbytes = _int(self.nbytes, "bytes", where, 1)
        self.format = _format_name(self.format, where)
        self.time_us = _finite_nonneg(self.time_us, "time_us", where)
        if self.model_us is not None:
            self.model_us = _finite_nonneg(self.model_us, "model_us", where)
        if self.interval_us is not None:
            if not isinstance(self.interval_us, (list, tuple)) or len(self.interval_us) != 2:
                raise ValueError(f"{where}: interval_us must be [low, high] or null, got {self.interval_us!r}")
            lo, hi = (_finite_nonneg(v, "interval_us", where) for v in self.interval_us)
            if not lo <= self.time_us <= hi:
                raise ValueError(f"{where}: interval_us {[lo, hi]} must hold time_us {self.time_us}")
            self.interval_us = (lo, hi)
        if self.samples is not None:
            self.samples = _int(self.samples, "samples", where, 1)

    @property
    def stats(self) -> TimingStats:
        """The timing as the format rule reads it: a point without an interval."""
        if self.interval_us is None:
            return TimingStats.point(self.time_us)
        return TimingStats(self.time_us, self.interval_us[0], self.interval_us[1], self.samples or 1)


@dataclass
class FormatRange(_JsonRow):
    """Buckets of ``min_bytes`` to ``max_bytes`` gradient bytes (inclusive; None: no bound) travel in ``format``."""

    min_bytes: int
    max_bytes: Optional[int]
    format: str
    reason: str = ""
    what = "format range"

    def __post_init__(self) -> None:
        _bounds(self, self.what)
        self.format = _format_name(self.format, self.what)
        if not isinstance(self.reason, str):
            raise ValueError(f"{self.what}: reason must be a string, got {self.reason!r}")


@dataclass
class FormatChoice:
    """The wire format per bucket size: the formats allowed, those chosen among, the ranges and the timings."""

    source: str
    """``model`` or ``measured``."""
    allowed: List[str]
    admitted: List[str]
    table: List[FormatRange]
    rows: List[FormatRow] = field(default_factory=list)
    host: str = ""
    notes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in ("model", "measured"):
            raise ValueError(f"formats: source must be 'model' or 'measured', got {self.source!r}")
        for key in ("allowed", "admitted", "notes"):
            if not isinstance(getattr(self, key), list):
                raise ValueError(f"formats: {key} must be a list, got {getattr(self, key)!r}")
        self.allowed = [_format_name(f, "formats.allowed") for f in self.allowed]
        self.admitted = [_format_name(f, "formats.admitted") for f in self.admitted]
        if not self.admitted:
            raise ValueError("formats: admitted must name at least one format")
        if not isinstance(self.table, list) or not isinstance(self.rows, list):
            raise ValueError("formats: table and rows must be lists")
        self.table = [t if isinstance(t, FormatRange) else FormatRange.from_dict(t) for t in self.table]
        self.rows = [r if isinstance(r, FormatRow) else FormatRow.from_dict(r) for r in self.rows]
        _contiguous(self.table, "formats table")
        stray = sorted({t.format for t in self.table} - set(self.admitted))
        if stray:
            raise ValueError(f"formats: the table uses {', '.join(stray)}, which admitted does not list")
        if not isinstance(self.host, str) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError("formats: host and notes must be strings")
        self._maxes = [t.max_bytes for t in self.table[:-1]]

    def format_for(self, grad_bytes: int) -> str:
        """The format of a bucket of ``grad_bytes`` gradient bytes."""
        return self.table[bisect.bisect_left(self._maxes, grad_bytes)].format

    def to_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "allowed": list(self.allowed), "admitted": list(self.admitted),
                "table": [t.to_dict() for t in self.table], "rows": [r.to_dict() for r in self.rows],
                "host": self.host, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FormatChoice":
        if not isinstance(d, Mapping):
            raise ValueError(f"formats must be null or an object, got {d!r}")
        _refuse_unknown(d, _FORMATS_FIELDS, "formats: ")
        _refuse_unknown_in_lists(d, (("table", FormatRange.json_fields()), ("rows", FormatRow.json_fields())),
                                 "formats.")
        try:
            return cls(source=d["source"], allowed=d["allowed"], admitted=d["admitted"], table=d["table"],
                       rows=d.get("rows") or [], host=d.get("host", ""), notes=d.get("notes") or [])
        except KeyError as e:
            raise ValueError(f"formats: missing field {e.args[0]!r}") from None
