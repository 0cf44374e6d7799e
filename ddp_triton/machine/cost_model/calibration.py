"""A calibration: per-algorithm factors, fitted to a measured sweep, that the model applies to its intra-node terms.

The model's constants are NCCL's (``nccl.py``) and its ramp's (``ramp.py``); a real machine differs from them by its
GPUs' clocks, its NCCL version, its launch path. ``fit.fit_calibration`` measures that difference on one node and
stores it here, per algorithm, as two factors:

* ``latency_scale`` multiplies what the model charges *inside a node* for a collective: NCCL's base latency, the
  intra-node hops, the ring's extra windows, NVLS's per-chunk synchronisation.
* ``bandwidth_scale`` multiplies the intra-node bandwidth (NVLink or PCIe; NVLS's switch throughput).

Inter-node terms (NIC bandwidth, network hops, the network's per-chunk cost) are left as modelled, so a calibration
measured on one node predicts K nodes from the inter-node link alone (``autotune --model-only --calibration``).
``nvls_tree`` runs NVLS inside each node: without a calibration of its own it takes ``nvls``'s.

This module is data and validation only (the profile schema stores a ``Calibration``); the fit is ``fit.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

#: The algorithms a calibration may name (``fabric.ALGORITHMS``, repeated here so that this module stands alone).
CALIBRATED_ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree")
#: Where an algorithm without factors of its own borrows them: NVLSTree is NVLS inside each node.
BORROWS_FROM = {"nvls_tree": "nvls"}
#: Factors outside this range are refused: a fit that lands there has fitted something other than this model (a
#: sweep of another machine, a broken measurement), and would turn every prediction made from it into nonsense.
SCALE_BOUNDS = (1e-3, 1e3)


def _scale(x: Any, name: str) -> float:
    lo, hi = SCALE_BOUNDS
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
        raise ValueError(f"calibration: {name} must be a number in [{lo:g}, {hi:g}], got {x!r}")
    return float(x)


def _from_object(cls: Any, d: Mapping[str, Any]) -> Any:
    """``cls(**d)`` for a JSON object ``d`` holding some of ``cls``'s fields; ValueError naming the unknown ones."""
    unknown = sorted(set(map(str, d)) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"calibration: unknown field(s) {', '.join(map(repr, unknown))}")
    return cls(**d)


@dataclass(frozen=True)
class AlgorithmCalibration:
    """The fitted factors of one algorithm, and how well they fit."""

    latency_scale: float = 1.0
    """Multiplies the model's intra-node latency terms."""
    bandwidth_scale: float = 1.0
    """Multiplies the model's intra-node bandwidth."""
    rms_log_error: Optional[float] = None
    """Root mean square of ln(model / measured) over the fitted points, after the fit (0.05 = about 5%)."""
    points: int = 0
    """Number of measured sizes fitted."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_scale", _scale(self.latency_scale, "latency_scale"))
        object.__setattr__(self, "bandwidth_scale", _scale(self.bandwidth_scale, "bandwidth_scale"))
        if self.rms_log_error is not None:
            r = self.rms_log_error
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
                raise ValueError(f"calibration: rms_log_error must be a finite number >= 0 or null, got {r!r}")
            object.__setattr__(self, "rms_log_error", float(r))
        if isinstance(self.points, bool) or not isinstance(self.points, int) or self.points < 0:
            raise ValueError(f"calibration: points must be an int >= 0, got {self.points!r}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AlgorithmCalibration":
        if not isinstance(d, Mapping):
            raise ValueError(f"calibration: an algorithm's entry must be an object, got {d!r}")
        return _from_object(cls, d)


@dataclass(frozen=True)
class Calibration:
    """Per-algorithm factors and the machine they were measured on."""

    algorithms: Dict[str, AlgorithmCalibration] = field(default_factory=dict)
    ranks_per_node: int = 0
    """Ranks per node of the measured sweep (0: not recorded)."""
    nodes: int = 1
    """Nodes of the measured sweep."""
    arch: str = "unknown"
    """GPU generation of the measured machine."""
    intra_link: str = "nvlink"
    """``nvlink`` or ``pcie``: what joined the GPUs of a node."""
    backend: str = "nccl"
    """What measured it (``nccl``; ``gloo`` fits NCCL's model to gloo's all-reduce, which says little)."""
    node_fingerprint: str = ""
    """The fingerprint of one node of the measured topology (``profile.build.node_fingerprint``): a calibration
    describes that kind of node; applying it to another is refused."""

    def __post_init__(self) -> None:
        if not isinstance(self.algorithms, Mapping):
            raise ValueError(f"calibration: algorithms must be an object, got {self.algorithms!r}")
        algs = {}
        for name, entry in self.algorithms.items():
            if name not in CALIBRATED_ALGORITHMS:
                raise ValueError(f"calibration: unknown algorithm {name!r}; known: {', '.join(CALIBRATED_ALGORITHMS)}")
            algs[name] = entry if isinstance(entry, AlgorithmCalibration) else AlgorithmCalibration.from_dict(entry)
        object.__setattr__(self, "algorithms", algs)
        for name in ("ranks_per_node", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "ranks_per_node" else 1):
                raise ValueError(f"calibration: {name} must be a non-negative int, got {v!r}")
        for name in ("arch", "intra_link", "backend", "node_fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"calibration: {name} must be a string, got {getattr(self, name)!r}")

    def __hash__(self) -> int:  # frozen dataclasses hash their fields; a dict field is not hashable
        return hash(tuple(sorted((k, v) for k, v in self.algorithms.items())))

    def for_algorithm(self, algorithm: str) -> AlgorithmCalibration:
        """The factors for ``algorithm``: its own, else those it borrows (nvls_tree from nvls), else 1 and 1."""
        if algorithm in self.algorithms:
            return self.algorithms[algorithm]
        source = BORROWS_FROM.get(algorithm)
        if source in self.algorithms:
            return self.algorithms[source]
        return AlgorithmCalibration()

    def summary(self) -> str:
        """One line per algorithm, for people."""
        where = f"{self.ranks_per_node} ranks x {self.nodes} node(s), {self.arch}, {self.intra_link}, {self.backend}"
        lines = [f"calibration (measured on {where}):"]
        for name in CALIBRATED_ALGORITHMS:
            if name in self.algorithms:
                a = self.algorithms[name]
                fit = "" if a.rms_log_error is None else f", rms log error {a.rms_log_error:.3f} over {a.points} sizes"
                lines.append(f"  {name:<9} latency x{a.latency_scale:.3g}, bandwidth x{a.bandwidth_scale:.3g}{fit}")
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        """Build and validate; ValueError naming what is wrong (unknown fields are refused by name)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"calibration must be an object, got {type(d).__name__}")
        return _from_object(cls, d)
