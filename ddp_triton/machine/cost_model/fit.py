"""Calibration: fit the model's intra-node factors to a measured all-reduce sweep, per algorithm.

For each algorithm the fit finds ``latency_scale`` and ``bandwidth_scale`` (``calibration.py``) minimising

    sum over measured sizes S of (ln t_model(S) - ln t_measured(S))^2

by Levenberg-Marquardt on the logarithms of the two factors (so both stay positive). Log-time weighs a 20 us
latency-bound point and a 20 ms bandwidth-bound one alike: a relative error is what the table and the bucket choice
care about. The protocol at each size is the one NCCL picks by its own estimate, which a calibration does not
change (NCCL does not know it), so the model is smooth in the factors and two or three iterations usually do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .calibration import SCALE_BOUNDS, AlgorithmCalibration, Calibration
from .fabric import Fabric, algorithm_unavailable_reason
from .nccl import nccl_protocol
from .ramp import protocol_time_us

#: Iteration limit and step tolerance of the fit: the model is smooth in the factors, so it converges in a handful
#: of steps; 100 only bounds a pathological sweep.
MAX_ITERATIONS = 100
STEP_TOLERANCE = 1e-10
_LOG_BOUNDS = (math.log(SCALE_BOUNDS[0]), math.log(SCALE_BOUNDS[1]))

Row = Union[Mapping[str, Any], Any]


def _residuals(fabric: Fabric, algorithm: str, sizes: Sequence[int], protocols: Sequence[str],
               log_measured: Sequence[float], x: Tuple[float, float]) -> List[float]:
    """ln(model time) - ln(measured time) per size, with the log-factors ``x`` (latency, bandwidth) applied."""
    cal = Calibration(algorithms={algorithm: AlgorithmCalibration(math.exp(x[0]), math.exp(x[1]))})
    f = dataclasses.replace(fabric, calibration=cal)
    return [math.log(protocol_time_us(f, s, algorithm, p)) - m  # type: ignore[arg-type]
            for s, p, m in zip(sizes, protocols, log_measured)]


def _solve2(a: List[List[float]], b: List[float]) -> Tuple[float, float]:
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    if det == 0:
        return 0.0, 0.0
    return (b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det


def fit_algorithm(fabric: Fabric, algorithm: str, points: Iterable[Tuple[int, float]]) -> AlgorithmCalibration:
    """Factors for ``algorithm`` from measured (bytes, time_us) points on ``fabric`` (its own calibration, if any,
    is ignored). ValueError with fewer than two usable points or an algorithm the model cannot run there."""
    why = algorithm_unavailable_reason(fabric, algorithm, "float32")
    if why is not None:
        raise ValueError(f"cannot calibrate {algorithm}: {why}")
    base = dataclasses.replace(fabric, calibration=None)
    pts = sorted((int(s), float(t)) for s, t in points if s > 0 and t > 0 and math.isfinite(t))
    if len({s for s, _ in pts}) < 2:
        raise ValueError(f"cannot calibrate {algorithm}: need measured times at two sizes or more, got {len(pts)}")
    sizes = [s for s, _ in pts]
    protocols = [nccl_protocol(base, s, algorithm) for s in sizes]
    log_measured = [math.log(t) for _, t in pts]
    x = (0.0, 0.0)
    r = _residuals(base, algorithm, sizes, protocols, log_measured, x)
    cost = sum(v * v for v in r)
    damping = 1e-3
    h = 1e-6
    for _ in range(MAX_ITERATIONS):
        cols = []
        for k in range(2):
            xk = list(x)
            xk[k] += h
            rk = _residuals(base, algorithm, sizes, protocols, log_measured, (xk[0], xk[1]))
            cols.append([(a - b) / h for a, b in zip(rk, r)])
        jtj = [[sum(cols[i][n] * cols[j][n] for n in range(len(r))) for j in range(2)] for i in range(2)]
        jtr = [sum(cols[i][n] * r[n] for n in range(len(r))) for i in range(2)]
        improved = False
        while damping < 1e12:
            a = [[jtj[i][j] + (damping * jtj[i][i] if i == j else 0.0) for j in range(2)] for i in range(2)]
            step = _solve2(a, [-jtr[0], -jtr[1]])
            trial = tuple(min(_LOG_BOUNDS[1], max(_LOG_BOUNDS[0], x[k] + step[k])) for k in range(2))
            r_trial = _residuals(base, algorithm, sizes, protocols, log_measured, trial)  # type: ignore[arg-type]
            cost_trial = sum(v * v for v in r_trial)
            if cost_trial <= cost:
                moved = max(abs(trial[k] - x[k]) for k in range(2))
                x, r, cost = trial, r_trial, cost_trial  # type: ignore[assignment]
                damping = max(damping / 10, 1e-12)
                improved = moved > STEP_TOLERANCE
                break
            damping *= 10
        if not improved:
            break
    lo, hi = SCALE_BOUNDS
    return AlgorithmCalibration(latency_scale=min(hi, max(lo, math.exp(x[0]))),
                                bandwidth_scale=min(hi, max(lo, math.exp(x[1]))),
                                rms_log_error=math.sqrt(cost / len(r)), points=len(r))


def _point(row: Row) -> Tuple[str, int, float]:
    """(algorithm, bytes, time_us) of a sweep row: a profile ``SweepRow`` or a dict as profiles store them."""
    if isinstance(row, Mapping):
        return row["algorithm"], row["bytes"], row["time_us"]
    return row.algorithm, row.nbytes, row.time_us


def fit_calibration(fabric: Fabric, rows: Iterable[Row], *, backend: str = "nccl", node_fingerprint: str = "",
                    algorithms: Optional[Sequence[str]] = None) -> Calibration:
    """A calibration from measured sweep rows (profile ``SweepRow`` objects, or dicts with ``bytes``,
    ``algorithm``, ``time_us``): one fit per algorithm present with two or more sizes (or per ``algorithms``).
    Algorithms the model cannot run on ``fabric``, or with too few points, are left out. ValueError if none is
    left."""
    by_alg: dict = {}
    for row in rows:
        alg, nbytes, time_us = _point(row)
        by_alg.setdefault(alg, []).append((nbytes, time_us))
    fitted = {}
    skipped = []
    for alg in (algorithms if algorithms is not None else sorted(by_alg)):
        try:
            fitted[alg] = fit_algorithm(fabric, alg, by_alg.get(alg, []))
        except ValueError as e:
            skipped.append(str(e))
    if not fitted:
        raise ValueError("no algorithm could be calibrated: " + ("; ".join(skipped) or "no rows"))
    return Calibration(algorithms=fitted, ranks_per_node=fabric.ranks_per_node, nodes=fabric.nodes,
                       arch=fabric.arch, intra_link=fabric.intra_link, backend=backend,
                       node_fingerprint=node_fingerprint)
