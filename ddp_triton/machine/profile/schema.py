"""The tuning profile: which NCCL algorithm each all-reduce size should use, and the DDP bucket size.

A profile is what ``ddp-triton autotune`` writes and what the hook's state reads. It is JSON only (never pickle),
validated on load, and cached per topology under the user's cache directory so the hook finds it without flags.

Schema, version 3 (``SCHEMA_VERSION``)::

    {
      "schema_version": 3,
      "source": "model" | "measured" | "e2e",   # cost model, timed all-reduces, or timed training steps
      "world_size": 16, "nodes": 2,
      "comm_dtype": "bfloat16",                 # dtype the hook all-reduces in
      "bucket_cap_mb": 64.0,                    # DDP bucket_cap_mb to construct DDP with (see ddp_kwargs)
      "bucket_reason": "...",                   # why that bucket size
      "sweep": [                                # every size x algorithm evaluated
        {"bytes": 1024, "algorithm": "ring", "time_us": 15.0, "algbw_gbps": 0.07, "busbw_gbps": 0.13,
         "dtype": "bfloat16", "protocol": "LL"}, ...],        # dtype and protocol optional (null if unknown)
      "table": [                                # chosen ranges, contiguous from 0; max_bytes inclusive,
        {"min_bytes": 0, "max_bytes": 1482910, "algorithm": "tree", "protocol": "LL128"},   # null = no bound
        {"min_bytes": 1482911, "max_bytes": null, "algorithm": "nvls_tree", "protocol": "Simple"}],
      "topology_fingerprint": "...",            # profile_fingerprint(topology): the cache key
      "topology_name": "dgx-h100",
      "backend": "nccl" | "gloo" | "model",
      "versions": {"ddp_triton": "0.1.0", "torch": "...", "nccl": "2.21.5", ...},
      "created": "2026-11-30T12:00:00+00:00",
      "e2e": null | {...},                      # e2e mode: candidates and their step times
      "calibration": null | {                   # the cost model fitted to the measured sweep
        "algorithms": {"ring": {"latency_scale": 1.3, "bandwidth_scale": 0.95, "rms_log_error": 0.04,
                                "points": 21}, ...},
        "ranks_per_node": 8, "nodes": 1, "arch": "hopper", "intra_link": "nvlink", "backend": "nccl",
        "node_fingerprint": "..."},            # ddp_triton.machine.cost_model.Calibration
      "formats": null | {                       # the wire format per bucket size (autotune --formats)
        "source": "model" | "measured",
        "allowed": ["fp32", "bf16", "bf16+fp32sum"],   # what the user accepts (runtime names, canonical)
        "admitted": ["fp32", "bf16+fp32sum"],          # what was chosen among, after the accuracy rule
        "table": [                              # by the bucket's gradient bytes, contiguous from 0, last unbounded
          {"min_bytes": 0, "max_bytes": 741455, "format": "fp32", "reason": "256 KiB: fp32 ... (why)"}, ...],
        "rows": [{"bytes": 262144, "format": "fp32", "time_us": 80.5, "model_us": 75.0,    # model_us: null
                  "interval_us": [78.1, 83.0], "samples": 12}, ...],  # measured: time_us is the median of
                                                # samples timings, interval_us the confidence interval on it the
                                                # choice was made on (format_rule); null (or absent): a point
        "host": "...",                          # where the host cost per bucket came from
        "notes": ["bf16+fp32sum in place of bf16: ..."]},
      "notes": ["..."]
    }

A file of another schema version is refused with one line that says to re-run ``ddp-triton autotune``.

Algorithm names are ``ddp_triton.machine.cost_model.ALGORITHMS`` (ring, tree, nvls, nvls_tree).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ...dtypes import normalize_dtype
from ...formats import canonical_name
from ...safe_write import OutputError, atomic_write_text
from ..cost_model import ALGORITHMS, PROTOCOLS, Calibration
from .format_rule import TimingStats

SCHEMA_VERSION = 3
SOURCES = ("model", "measured", "e2e")
#: The hook's ``comm_dtype`` that takes each bucket's wire format from a profile's ``formats``.
AUTO_FORMAT = "auto"
BACKENDS = ("nccl", "gloo", "model")
MiB = 1 << 20

#: Default least number of buckets a model is split into, so the all-reduce of early buckets overlaps the rest of
#: backward (DDP launches a bucket's all-reduce when its last gradient is ready; one bucket would overlap nothing).
DEFAULT_MIN_BUCKETS = 4
PathLike = Union[str, "os.PathLike[str]"]


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, not JSON, invalid, another schema version, or a mismatch.

    ``path`` is the file (None when there is none), ``reason`` the message without it.
    """

    def __init__(self, message: str, path: Optional[PathLike] = None):
        self.reason = message
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


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


_PROFILE_FIELDS = ("schema_version", "source", "world_size", "nodes", "comm_dtype", "bucket_cap_mb", "bucket_reason",
                   "sweep", "table", "topology_fingerprint", "topology_name", "backend", "versions", "created", "e2e",
                   "notes", "calibration", "formats")
_FORMATS_FIELDS = ("source", "allowed", "admitted", "table", "rows", "host", "notes")
_FORMAT_RANGE_FIELDS = ("min_bytes", "max_bytes", "format", "reason")
_FORMAT_ROW_FIELDS = ("bytes", "format", "time_us", "model_us", "interval_us", "samples")
_TABLE_FIELDS = ("min_bytes", "max_bytes", "algorithm", "protocol")
_SWEEP_FIELDS = ("bytes", "algorithm", "time_us", "algbw_gbps", "busbw_gbps", "dtype", "protocol")


# --------------------------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------------------------


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


@dataclass
class SweepRow:
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

    def __post_init__(self) -> None:
        where = "sweep row"
        self.nbytes = _int(self.nbytes, "bytes", where, 1)
        _check_algorithm(self.algorithm, where)
        self.time_us = _finite_nonneg(self.time_us, "time_us", where)
        self.algbw_gbps = _finite_nonneg(self.algbw_gbps, "algbw_gbps", where)
        self.busbw_gbps = _finite_nonneg(self.busbw_gbps, "busbw_gbps", where)
        if self.dtype is not None:
            self.dtype = normalize_dtype(self.dtype)
        _check_protocol(self.protocol, where)

    def to_dict(self) -> Dict[str, Any]:
        return {"bytes": self.nbytes, "algorithm": self.algorithm, "time_us": self.time_us,
                "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps, "dtype": self.dtype,
                "protocol": self.protocol}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SweepRow":
        if not isinstance(d, Mapping):
            raise ValueError(f"sweep row must be an object, got {d!r}")
        return cls(nbytes=d["bytes"], algorithm=d["algorithm"], time_us=d["time_us"], algbw_gbps=d["algbw_gbps"],
                   busbw_gbps=d["busbw_gbps"], dtype=d.get("dtype"), protocol=d.get("protocol"))


@dataclass
class TableEntry:
    """Messages of ``min_bytes`` to ``max_bytes`` bytes (inclusive; None: no upper bound) use ``algorithm``."""

    min_bytes: int
    max_bytes: Optional[int]
    algorithm: str
    protocol: Optional[str] = None
    """The protocol the model expects NCCL to pick (for the tuner CSV); None when unknown."""

    def __post_init__(self) -> None:
        where = "table entry"
        _bounds(self, where)
        _check_algorithm(self.algorithm, where)
        _check_protocol(self.protocol, where)

    def to_dict(self) -> Dict[str, Any]:
        return {"min_bytes": self.min_bytes, "max_bytes": self.max_bytes, "algorithm": self.algorithm,
                "protocol": self.protocol}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TableEntry":
        if not isinstance(d, Mapping):
            raise ValueError(f"table entry must be an object, got {d!r}")
        return cls(min_bytes=d["min_bytes"], max_bytes=d["max_bytes"], algorithm=d["algorithm"],
                   protocol=d.get("protocol"))


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


@dataclass
class FormatRow:
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

    def __post_init__(self) -> None:
        where = "format row"
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

    def to_dict(self) -> Dict[str, Any]:
        return {"bytes": self.nbytes, "format": self.format, "time_us": self.time_us, "model_us": self.model_us,
                "interval_us": None if self.interval_us is None else list(self.interval_us),
                "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FormatRow":
        if not isinstance(d, Mapping):
            raise ValueError(f"format row must be an object, got {d!r}")
        return cls(nbytes=d["bytes"], format=d["format"], time_us=d["time_us"], model_us=d.get("model_us"),
                   interval_us=d.get("interval_us"), samples=d.get("samples"))


@dataclass
class FormatRange:
    """Buckets of ``min_bytes`` to ``max_bytes`` gradient bytes (inclusive; None: no bound) travel in ``format``."""

    min_bytes: int
    max_bytes: Optional[int]
    format: str
    reason: str = ""

    def __post_init__(self) -> None:
        where = "format range"
        _bounds(self, where)
        self.format = _format_name(self.format, where)
        if not isinstance(self.reason, str):
            raise ValueError(f"{where}: reason must be a string, got {self.reason!r}")

    def to_dict(self) -> Dict[str, Any]:
        return {"min_bytes": self.min_bytes, "max_bytes": self.max_bytes, "format": self.format,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FormatRange":
        if not isinstance(d, Mapping):
            raise ValueError(f"format range must be an object, got {d!r}")
        return cls(min_bytes=d["min_bytes"], max_bytes=d["max_bytes"], format=d["format"],
                   reason=d.get("reason", ""))


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
        _refuse_unknown_in_lists(d, (("table", _FORMAT_RANGE_FIELDS), ("rows", _FORMAT_ROW_FIELDS)), "formats.")
        try:
            return cls(source=d["source"], allowed=d["allowed"], admitted=d["admitted"], table=d["table"],
                       rows=d.get("rows") or [], host=d.get("host", ""), notes=d.get("notes") or [])
        except KeyError as e:
            raise ValueError(f"formats: missing field {e.args[0]!r}") from None


# --------------------------------------------------------------------------------------------------------------------
# The profile
# --------------------------------------------------------------------------------------------------------------------


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class Profile:
    """A tuning result: per-size algorithm table, the sweep behind it, and the DDP bucket size."""

    source: str
    """``model`` (cost model), ``measured`` (timed all-reduces) or ``e2e`` (timed training steps)."""
    world_size: int
    nodes: int
    comm_dtype: str
    """dtype the hook all-reduces in (``bfloat16``, ``float32``...)."""
    bucket_cap_mb: float
    """DDP ``bucket_cap_mb`` (MiB of gradients per bucket)."""
    table: List[TableEntry]
    """Chosen algorithm per size range, contiguous from 0 bytes, last range unbounded."""
    sweep: List[SweepRow] = field(default_factory=list)
    """Every (size, algorithm) evaluated."""
    bucket_reason: str = ""
    """Why ``bucket_cap_mb`` has its value."""
    topology_fingerprint: str = ""
    topology_name: str = ""
    backend: str = "nccl"
    """Backend measured on (``nccl``, ``gloo``), or ``model``."""
    versions: Dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    e2e: Optional[Dict[str, Any]] = None
    """e2e mode: the candidates timed and the winner."""
    notes: List[str] = field(default_factory=list)
    calibration: Optional[Calibration] = None
    """The cost model's factors fitted to this profile's measured sweep (measure mode), or carried by a model profile
    made with ``--calibration``; None otherwise."""
    formats: Optional[FormatChoice] = None
    """The wire format per bucket size (``autotune --formats``); None: every bucket in the hook's own format."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version!r} is not {SCHEMA_VERSION}")
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            self.calibration = Calibration.from_dict(self.calibration)
        if self.formats is not None and not isinstance(self.formats, FormatChoice):
            self.formats = FormatChoice.from_dict(self.formats)
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _int(self.world_size, "world_size", "profile", 1)
        _int(self.nodes, "nodes", "profile", 1)
        if self.world_size % self.nodes:
            raise ValueError(f"world_size {self.world_size} is not a multiple of nodes {self.nodes}")
        self.comm_dtype = normalize_dtype(self.comm_dtype)
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) \
                or not math.isfinite(self.bucket_cap_mb) or self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, got {self.bucket_cap_mb!r}")
        self.bucket_cap_mb = float(self.bucket_cap_mb)
        self.sweep = [r if isinstance(r, SweepRow) else SweepRow.from_dict(r) for r in self.sweep]
        self.table = [t if isinstance(t, TableEntry) else TableEntry.from_dict(t) for t in self.table]
        _contiguous(self.table, "table")
        if not isinstance(self.versions, dict):
            raise ValueError(f"versions must be an object, got {self.versions!r}")
        if not isinstance(self.notes, list) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(f"notes must be a list of strings, got {self.notes!r}")
        if self.e2e is not None and not isinstance(self.e2e, dict):
            raise ValueError(f"e2e must be null or an object, got {self.e2e!r}")
        self._maxes = [t.max_bytes for t in self.table[:-1]]

    # -- queries --------------------------------------------------------------------------------------------------

    def algorithm_for(self, nbytes: int) -> str:
        """The algorithm for an all-reduce of ``nbytes`` bytes (a bisect over the table: cheap on the step path)."""
        return self.table[bisect.bisect_left(self._maxes, nbytes)].algorithm

    def format_for(self, grad_bytes: int) -> Optional[str]:
        """The wire format (runtime name) of a bucket of ``grad_bytes`` gradient bytes; None: the profile chooses
        none (the hook's own)."""
        return None if self.formats is None else self.formats.format_for(grad_bytes)

    def algorithms(self) -> List[str]:
        """Algorithms the table uses, in canonical order (the order process groups are created in)."""
        used = {t.algorithm for t in self.table}
        return [a for a in ALGORITHMS if a in used]

    def digest(self) -> str:
        """sha256 of what changes behaviour on a rank: sizes, dtype, bucket size and table (not timestamps)."""
        key = {"schema_version": self.schema_version, "world_size": self.world_size, "nodes": self.nodes,
               "comm_dtype": self.comm_dtype, "bucket_cap_mb": self.bucket_cap_mb,
               "table": [t.to_dict() for t in self.table],
               "formats": None if self.formats is None else [t.to_dict() for t in self.formats.table]}
        return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def check_matches(self, *, fingerprint: Optional[str] = None, world_size: Optional[int] = None,
                      nodes: Optional[int] = None, comm_dtype: Optional[str] = None,
                      path: Optional[PathLike] = None) -> None:
        """Raise ProfileError naming the first field that differs from what the caller runs with. ``comm_dtype``
        ``"auto"`` (a hook that takes each bucket's format from the profile) asks for a profile with ``formats``."""
        if comm_dtype == AUTO_FORMAT:
            if self.formats is None:
                raise ProfileError("the profile chooses no wire formats (comm_dtype='auto' needs one made with "
                                   "`ddp-triton autotune --formats ...`)", path)
            comm_dtype = None
        wanted = {"topology_fingerprint": fingerprint, "world_size": world_size, "nodes": nodes,
                  "comm_dtype": None if comm_dtype is None else normalize_dtype(comm_dtype)}
        for name, want in wanted.items():
            if want is not None and getattr(self, name) != want:
                raise ProfileError(f"profile is for {name}={getattr(self, name)!r}, this run has {want!r}", path)

    def summary(self) -> str:
        """A few lines for people: where it came from, the ranges, the bucket size."""
        lines = [f"profile: source={self.source} backend={self.backend} world_size={self.world_size} "
                 f"nodes={self.nodes} comm_dtype={self.comm_dtype}",
                 f"topology: {self.topology_name or '?'} ({self.topology_fingerprint or 'no fingerprint'})",
                 f"created: {self.created}",
                 "algorithm by all-reduce size:"]
        for t in self.table:
            hi = "inf" if t.max_bytes is None else format_bytes(t.max_bytes)
            proto = f" ({t.protocol})" if t.protocol else ""
            lines.append(f"  {format_bytes(t.min_bytes):>10} .. {hi:<10} {t.algorithm}{proto}")
        lines.append(f"bucket_cap_mb: {self.bucket_cap_mb:g}  ({self.bucket_reason})" if self.bucket_reason
                     else f"bucket_cap_mb: {self.bucket_cap_mb:g}")
        lines.append(f"DDP arguments: {ddp_kwargs(self)}")
        if self.e2e:
            lines.append(f"e2e winner: {self.e2e.get('winner')}")
        if self.calibration is not None:
            lines.append(self.calibration.summary())
        if self.formats is not None:
            lines.append(f"wire format by bucket size ({self.formats.source}; allowed: "
                         f"{', '.join(self.formats.allowed)}):")
            for t in self.formats.table:
                hi = "inf" if t.max_bytes is None else format_bytes(t.max_bytes)
                lines.append(f"  {format_bytes(t.min_bytes):>10} .. {hi:<10} {t.format}: {t.reason}")
            lines.extend(f"  note: {n}" for n in self.formats.notes)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    # -- (de)serialisation ----------------------------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        return {"schema_version": self.schema_version, "source": self.source, "world_size": self.world_size,
                "nodes": self.nodes, "comm_dtype": self.comm_dtype, "bucket_cap_mb": self.bucket_cap_mb,
                "bucket_reason": self.bucket_reason, "sweep": [r.to_dict() for r in self.sweep],
                "table": [t.to_dict() for t in self.table], "topology_fingerprint": self.topology_fingerprint,
                "topology_name": self.topology_name, "backend": self.backend, "versions": dict(self.versions),
                "created": self.created, "e2e": self.e2e,
                "calibration": None if self.calibration is None else self.calibration.to_dict(),
                "formats": None if self.formats is None else self.formats.to_dict(), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
        """Build and validate; ValueError (KeyError/TypeError turned into ValueError) on bad content. A field the
        schema does not have (a misspelt one, say), at the top or in a table or sweep entry, is refused by name, as
        topology files refuse theirs, and so is any schema version but this one (older files are not converted)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a profile must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if isinstance(version, bool) or version != SCHEMA_VERSION:
            raise ProfileError(f"a profile of schema_version {version!r}; this ddp-triton reads schema_version "
                               f"{SCHEMA_VERSION} only: re-run `ddp-triton autotune` to write it again")
        _refuse_unknown(d, _PROFILE_FIELDS, "")
        _refuse_unknown_in_lists(d, (("table", _TABLE_FIELDS), ("sweep", _SWEEP_FIELDS)), "")
        notes = d.get("notes") or []
        try:
            return cls(
                source=d["source"], world_size=d["world_size"], nodes=d["nodes"], comm_dtype=d["comm_dtype"],
                bucket_cap_mb=d["bucket_cap_mb"], table=list(d["table"]), sweep=list(d.get("sweep") or []),
                bucket_reason=str(d.get("bucket_reason", "")),
                topology_fingerprint=str(d.get("topology_fingerprint", "")),
                topology_name=str(d.get("topology_name", "")), backend=d.get("backend", "nccl"),
                versions=dict(d.get("versions") or {}), created=str(d.get("created", "")), e2e=d.get("e2e"),
                notes=list(notes) if isinstance(notes, list) else notes, calibration=d.get("calibration"),
                formats=d.get("formats"))
        except KeyError as e:
            raise ValueError(f"missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"malformed field: {e}") from None

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, path: Optional[PathLike] = None) -> "Profile":
        """Parse; ProfileError naming ``path`` on anything wrong."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ProfileError("not valid JSON (nested too deeply)", path) from None
        except ValueError as e:  # JSONDecodeError, or an integer of too many digits
            raise ProfileError(f"not valid JSON ({e})", path) from None
        try:
            return cls.from_dict(data)
        except ProfileError as e:
            raise ProfileError(e.reason, e.path or path) from None
        except RecursionError:
            raise ProfileError("invalid profile: nested too deeply", path) from None
        except ValueError as e:
            raise ProfileError(f"invalid profile: {e}", path) from None

    def save(self, path: PathLike) -> Path:
        """Write atomically (temp file + rename, so a reader never sees half a file); returns the path.

        ``path`` must be a new path (missing folders are made) or a regular file: a symlink, directory, device or
        FIFO there is refused with ProfileError naming it, and nothing is written (``ddp_triton.safe_write``)."""
        try:
            return atomic_write_text(path, self.to_json() + "\n")
        except OutputError as e:
            raise ProfileError(f"cannot write profile: {e.reason}", e.path) from None

    @classmethod
    def load(cls, path: PathLike) -> "Profile":
        """Read and validate ``path``; ProfileError naming the file on any problem."""
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise ProfileError(f"cannot read profile: {e.strerror or e}", path) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProfileError(f"not a JSON profile: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})",
                               path) from None
        return cls.from_json(text, path)


def load_profile(path: PathLike) -> Profile:
    """``Profile.load``: read and validate a profile file (ProfileError naming it on failure)."""
    return Profile.load(path)


def format_bytes(n: Union[int, float]) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} TiB"  # unreachable


def ddp_kwargs(profile: Profile, model: Any = None, min_buckets: int = DEFAULT_MIN_BUCKETS) -> Dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel(...)`` that apply the profile (DDP fixes its buckets at
    construction, so they must be passed there).

    With ``model`` (an ``nn.Module``), the bucket cap is also bounded so the model's gradients split into at least
    ``min_buckets`` buckets.
    """
    mb = profile.bucket_cap_mb
    if model is not None:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if nbytes > 0:
            mb = min(mb, float(f"{nbytes / min_buckets / MiB:.4g}"))
    return {"bucket_cap_mb": mb}
