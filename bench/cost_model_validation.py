"""The cost model against published nccl-tests all-reduce results: the validation table in docs/autotune.md.

    python -m bench.cost_model_validation              # markdown table: measured, model, ratio per size
    python -m bench.cost_model_validation --calibrated # ... and the ratio after calibrating on each run's sweep
    python -m bench.cost_model_validation --json       # the same numbers as JSON

The data and their sources are bench/published/nccl_tests_allreduce.json (how each was read:
bench/published/nccl_allreduce_published.md). For each run the model predicts what NCCL does there: the algorithm
forced with NCCL_ALGO, else the (algorithm, protocol) NCCL's own estimate picks, timed by the model
(``cost_model.nccl_choice``); where one process drove all GPUs (nccl-tests -g N) no collective is faster than the
run's smallest published time (its launch floor). The ratio is measured / model. tests/unit/machine/
test_cost_model_validation.py holds the same numbers to their tolerances. ``--calibrated`` fits the model to the
run's own sweep above its floor (``cost_model.fit_calibration``): in-sample, it shows what a one-node calibration
leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, json_text  # noqa: E402
from ddp_triton.machine import cost_model as cm  # noqa: E402

DATA = Path(__file__).resolve().parent / "published" / "nccl_tests_allreduce.json"


def load(path: Path = DATA) -> List[Dict[str, Any]]:
    """The published systems, as the JSON file has them."""
    return json.loads(path.read_text())["systems"]


def fabric_of(system: Dict[str, Any], calibration: Optional[cm.Calibration] = None) -> cm.Fabric:
    return cm.Fabric(calibration=calibration, **system["fabric"])


def predict_us(system: Dict[str, Any], nbytes: int, fabric: Optional[cm.Fabric] = None) -> cm.Estimate:
    """What the model says the run took at ``nbytes``: NCCL's choice (or the forced algorithm), no faster than the
    run's launch floor."""
    f = fabric if fabric is not None else fabric_of(system)
    if system["algorithms"]:
        e = cm.estimate(f, nbytes, system["algorithms"][0], "float32")
    else:
        version = tuple(system["nccl"]) if system["nccl"] else None
        e = cm.nccl_choice(f, nbytes, "float32", version)
    floor = float(system["host_floor_us"])
    return dataclasses.replace(e, time_us=max(e.time_us, floor)) if e.time_us < floor else e


def calibrate(system: Dict[str, Any]) -> cm.Calibration:
    """The model fitted to the run's own sweep, above twice its launch floor, per algorithm the run used."""
    f = fabric_of(system)
    floor = float(system["host_floor_us"])
    rows = []
    for nbytes, t in system["sweep"]:
        if t > 2 * floor:
            alg = predict_us(system, nbytes, f).algorithm
            rows.append({"bytes": nbytes, "algorithm": alg, "time_us": t})
    return cm.fit_calibration(f, rows)


def validate(systems: List[Dict[str, Any]], calibrated: bool = False) -> List[Dict[str, Any]]:
    """One entry per (system, validated size): measured, model, ratio (and the calibrated ones)."""
    out = []
    for system in systems:
        measured = {int(s): float(t) for s, t in system["sweep"]}
        cal = fabric_of(system, calibrate(system)) if calibrated else None
        for nbytes in system["validate"]:
            e = predict_us(system, nbytes)
            row = {"system": system["id"], "bytes": nbytes, "measured_us": measured[nbytes], "model_us": e.time_us,
                   "ratio": measured[nbytes] / e.time_us, "algorithm": e.algorithm, "protocol": e.protocol,
                   "tolerance": system["tolerance"].get(str(nbytes), system["tolerance"]["default"])}
            if cal is not None:
                row["calibrated_us"] = predict_us(system, nbytes, cal).time_us
                row["calibrated_ratio"] = measured[nbytes] / row["calibrated_us"]
            out.append(row)
    return out


def _us(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def markdown(systems: List[Dict[str, Any]], rows: List[Dict[str, Any]], calibrated: bool) -> str:
    """The validation table (docs/autotune.md): a row per system, a cell per validated size ("measured / model =
    ratio")."""
    table = []
    for system in systems:
        cells = {r["bytes"]: r for r in rows if r["system"] == system["id"]}
        sizes = system["validate"]
        out = []
        for target in (1 << 20, 16 << 20, 128 << 20, None):
            n = target if target is not None else max(sizes)
            r = cells.get(n)
            if r is None or (target is None and n in (1 << 20, 16 << 20, 128 << 20)):
                out.append("-")
                continue
            cell = f"{_us(r['measured_us'])} / {_us(r['model_us'])} = **{r['ratio']:.2f}**"
            if target is None:
                cell = f"{_size(n)}: {cell}"
            if calibrated:
                cell += f" (cal. {r['calibrated_ratio']:.2f})"
            out.append(cell)
        worst = max(max(r["ratio"], 1 / r["ratio"]) for r in cells.values())
        version = ".".join(map(str, system["nccl"])) if system["nccl"] else "?"
        table.append([f"{system['id']} {system['name']}", version, *out, f"{worst:.2f}x"])
    return format_table(["run", "NCCL", "1 MiB, us", "16 MiB", "128 MiB", "largest", "worst"], table)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cost_model_validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrated", action="store_true", help="also fit each run's own sweep and show the ratio")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    systems = load()
    rows = validate(systems, calibrated=args.calibrated)
    if args.json:
        print(json_text(rows), end="")
    else:
        print(markdown(systems, rows, args.calibrated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
