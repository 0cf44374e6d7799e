"""The tuning profile: which NCCL algorithm each all-reduce size should use, and the DDP bucket size.

A profile is what ``ddp-triton autotune`` writes and what the hook's state reads. It is JSON only (never pickle),
validated on load, and cached per topology under the user's cache directory so the hook finds it without flags.

Schema, version 3 (``SCHEMA_VERSION``)::

    {
      "schema_version": 3,
      "source": "model" | "measured" | "e2e" | "online",   # cost model, timed all-reduces, timed training steps,
                                                           # or the formats online tuning chose in a job
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
from typing import Any, Dict, List, Mapping, Optional, Union

from ...dtypes import normalize_dtype
from ...safe_write import OutputError, atomic_write_text
from ..cost_model import ALGORITHMS, Calibration
from .rows import FormatChoice, SweepRow, TableEntry, _contiguous, _int, _refuse_unknown, _refuse_unknown_in_lists

SCHEMA_VERSION = 3
SOURCES = ("model", "measured", "e2e", "online")
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


_PROFILE_FIELDS = ("schema_version", "source", "world_size", "nodes", "comm_dtype", "bucket_cap_mb", "bucket_reason",
                   "sweep", "table", "topology_fingerprint", "topology_name", "backend", "versions", "created", "e2e",
                   "notes", "calibration", "formats")


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class Profile:
    """A tuning result: per-size algorithm table, the sweep behind it, and the DDP bucket size."""

    source: str
    """``model`` (cost model), ``measured`` (timed all-reduces), ``e2e`` (timed training steps) or ``online`` (the
    formats a job's online tuning chose on its own buckets: ``CommState.save_profile``)."""
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
            proto = f" ({t.protocol})" if t.protocol else ""
            lines.append(f"  {_range_text(t)} {t.algorithm}{proto}")
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
            lines.extend(f"  {_range_text(t)} {t.format}: {t.reason}" for t in self.formats.table)
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
        _refuse_unknown_in_lists(d, (("table", TableEntry.json_fields()), ("sweep", SweepRow.json_fields())), "")
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


def _range_text(t: Any) -> str:
    """A range's bounds, aligned for ``Profile.summary``."""
    return f"{format_bytes(t.min_bytes):>10} .. {'inf' if t.max_bytes is None else format_bytes(t.max_bytes):<10}"


def format_bytes(n: Union[int, float]) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} TiB"  # unreachable


def ddp_kwargs(profile: Union[Profile, PathLike], model: Any = None,
               min_buckets: int = DEFAULT_MIN_BUCKETS) -> Dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel(...)`` that apply the profile (DDP fixes its buckets at
    construction, so they must be passed there).

    ``profile`` is a Profile or a profile file's path, read as ``register(profile=PATH)`` reads it
    (``load_profile``: a ProfileError naming the file). With ``model`` (an ``nn.Module``), the bucket cap is also
    bounded so the model's gradients split into at least ``min_buckets`` buckets.
    """
    if isinstance(profile, (str, os.PathLike)):
        profile = load_profile(profile)
    elif not isinstance(profile, Profile):
        raise TypeError(f"ddp_kwargs takes a Profile or a profile file's path, got {type(profile).__name__}")
    mb = profile.bucket_cap_mb
    if model is not None:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if nbytes > 0:
            mb = min(mb, float(f"{nbytes / min_buckets / MiB:.4g}"))
    return {"bucket_cap_mb": mb}
