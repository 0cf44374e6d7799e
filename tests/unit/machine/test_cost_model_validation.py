"""The cost model against published nccl-tests all-reduce runs, at 1 MiB, 16 MiB, 128 MiB and the largest size each
run published, each within its stated tolerance.

The reference data and their sources are bench/published/nccl_tests_allreduce.json (each run cited there; how they
were read: bench/published/nccl_allreduce_published.md). What the model is asked, written out here rather than
imported from bench/: the algorithm the run forced (NCCL_ALGO), else the (algorithm, protocol) NCCL's own estimate
picks (``nccl_choice``), timed by the model; a run whose one process drove every GPU (nccl-tests -g N) is no faster
than its smallest published time, its launch floor. ``python -m bench.cost_model_validation`` prints the same
numbers as the table in docs/autotune.md.

Tier: no device (pure Python).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ddp_triton.machine import cost_model as cm

DATA = Path(__file__).resolve().parents[3] / "bench" / "published" / "nccl_tests_allreduce.json"
SYSTEMS = json.loads(DATA.read_text())["systems"]
#: The aim at 1 MiB and above.
AIM = 1.3


def predicted_us(system: dict, nbytes: int, fabric: cm.Fabric = None) -> float:
    f = fabric if fabric is not None else cm.Fabric(**system["fabric"])
    if system["algorithms"]:
        e = cm.estimate(f, nbytes, system["algorithms"][0], "float32")
    else:
        e = cm.nccl_choice(f, nbytes, "float32", tuple(system["nccl"]) if system["nccl"] else None)
    return max(e.time_us, float(system["host_floor_us"]))


def measured_us(system: dict, nbytes: int) -> float:
    return dict((int(s), float(t)) for s, t in system["sweep"])[nbytes]


def tolerance(system: dict, nbytes: int) -> float:
    return system["tolerance"].get(str(nbytes), system["tolerance"]["default"])


POINTS = [pytest.param(s, n, id=f"{s['id']}-{n >> 20}MiB") for s in SYSTEMS for n in s["validate"]]


@pytest.mark.parametrize("system,nbytes", POINTS)
def test_model_within_tolerance_of_published_run(system, nbytes):
    ratio = measured_us(system, nbytes) / predicted_us(system, nbytes)
    tol = tolerance(system, nbytes)
    assert 1 / tol <= ratio <= tol, (system["id"], nbytes, ratio, tol)


def test_the_data_cover_what_the_issue_asks():
    required = [s for s in SYSTEMS if s["required"]]
    one_node_nvlink = {s["fabric"]["arch"] for s in required
                       if s["fabric"].get("nodes", 1) == 1 and s["fabric"]["intra_link"] == "nvlink"}
    assert {"ampere", "hopper"} <= one_node_nvlink  # two GPU generations
    assert any(s["fabric"]["intra_link"] == "pcie" for s in required)
    assert any(s["fabric"].get("nodes", 1) > 1 for s in required)
    for s in SYSTEMS:
        assert s["source"] and s["name"], s["id"]
        sizes = sorted(int(n) for n, _ in s["sweep"])
        # 1, 16 and 128 MiB, and the largest size the run published.
        assert s["validate"] == [n for n in (1 << 20, 16 << 20, 128 << 20) if n in sizes] + \
            ([sizes[-1]] if sizes[-1] > 128 << 20 else []), s["id"]
        assert s["tolerance"]["default"] == AIM
        # A size held to more than the aim says why in the run's note.
        if len(s["tolerance"]) > 1:
            assert s["note"], s["id"]


def test_required_runs_meet_the_aim_except_where_stated():
    # The stated exceptions, and no more: a change that widens a miss fails here before it fails the tolerance.
    misses = []
    for s in SYSTEMS:
        if not s["required"]:
            continue
        for n in s["validate"]:
            r = measured_us(s, n) / predicted_us(s, n)
            if max(r, 1 / r) > AIM:
                misses.append((s["id"], n >> 20))
    assert misses == [("2b", 1), ("4a", 128)]


def _mean_abs_log_error(estimate) -> float:
    errs = [abs(math.log(measured_us(s, n) / estimate(s, n))) for s in SYSTEMS for n in s["validate"]]
    return sum(errs) / len(errs)


def test_the_ramp_is_closer_than_nccls_own_estimate():
    # The same question put to NCCL's estimate alone (its pick, its time, the same floor): the ramp must be closer
    # to the published runs, and by a margin (NCCL's own estimate is about 1.4x optimistic at 16 MiB).
    def nccl_only(system, nbytes):
        f = cm.Fabric(**system["fabric"])
        alg = system["algorithms"][0] if system["algorithms"] else cm.nccl_choice(
            f, nbytes, "float32", tuple(system["nccl"]) if system["nccl"] else None).algorithm
        t = cm.nccl_protocol_time_us(f, nbytes, alg, cm.nccl_protocol(f, nbytes, alg))
        return max(t, float(system["host_floor_us"]))

    ramp, nccl = _mean_abs_log_error(predicted_us), _mean_abs_log_error(nccl_only)
    assert ramp < 0.75 * nccl, (ramp, nccl)


def test_the_readme_table_shows_these_numbers():
    # bench.cost_model_validation prints the table in docs/autotune.md; it must ask the model what this test asks.
    import sys

    repo = str(Path(__file__).resolve().parents[3])
    sys.path.insert(0, repo)
    try:
        from bench import cost_model_validation as bench
    finally:
        sys.path.remove(repo)
    rows = bench.validate(bench.load())
    assert [(r["system"], r["bytes"]) for r in rows] == [(s["id"], n) for s in SYSTEMS for n in s["validate"]]
    for r, s in zip(rows, [s for s in SYSTEMS for _ in s["validate"]]):
        assert r["model_us"] == pytest.approx(predicted_us(s, r["bytes"]), rel=1e-12)
    table = bench.markdown(bench.load(), rows, calibrated=False)
    assert table.count("\n") == len(SYSTEMS) + 1 and "**1.35**" in table
