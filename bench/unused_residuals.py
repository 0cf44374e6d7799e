"""What FP8 error feedback loses on parameters that no rank used in a step, simulated in one process on CPU.

    python -m bench.unused_residuals            # N = 8 ranks, 400 steps, heads used on 50%, 10% and 1% of steps
    python -m bench.unused_residuals --json

Under ``find_unused_parameters=True`` DDP still hands the hook a bucket that holds such a parameter (as zeros on
every rank) and drops what comes back for it. With error feedback the residuals of that parameter were sent in that
exchange, so what they carried never reaches the weights: the exchange behaves for it as one step without error
feedback. Keeping them instead would need to know, while the bucket is exchanged, that no rank used the parameter,
which DDP learns only at the end of the backward.

Simulated here with ``bench.numerics.Fp8Exchange`` (the formats' reference numerics: block-scaled FP8 E4M3, float32
sums, residuals at both stages): one "head" tensor of 4096 elements, gradients ``signal + noise_r`` (Student-t,
heavy tails), used by every rank on a random fraction of steps and by none on the others. Reported: the relative L2
error of the sum of the updates applied to the head against the exact sum of its mean gradients over the steps it
was used, for three treatments of the steps it was not: ``dropped`` (what the hook does: exchanged as zeros, result
dropped), ``kept`` (not exchanged at all: residuals wait for the next use) and ``no error feedback``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import format_table, json_text  # noqa: E402
from bench.numerics import Fp8Exchange, rel_l2, student_t  # noqa: E402

SIZE = 4096
RANKS = 8
STEPS = 400
FRACTIONS = (0.5, 0.1, 0.01)
FMT = torch.float8_e4m3fn


def run(fraction: float, ranks: int = RANKS, steps: int = STEPS, seed: int = 0) -> Dict[str, float]:
    """Relative L2 error of the applied updates' sum, per treatment of the unused steps."""
    gen = torch.Generator().manual_seed(seed)
    signal = student_t((SIZE,), gen)
    treatments = {"dropped": Fp8Exchange(ranks, [SIZE], FMT, error_feedback=True),
                  "kept": Fp8Exchange(ranks, [SIZE], FMT, error_feedback=True),
                  "no error feedback": Fp8Exchange(ranks, [SIZE], FMT, error_feedback=False)}
    applied = {name: torch.zeros(SIZE, dtype=torch.float64) for name in treatments}
    exact = torch.zeros(SIZE, dtype=torch.float64)
    used_steps = 0
    for _ in range(steps):
        used = bool(torch.rand((), generator=gen) < fraction)
        if not used:
            treatments["dropped"](torch.zeros(ranks, SIZE))  # sent, then dropped by DDP
            continue
        used_steps += 1
        grads = (signal + student_t((ranks, SIZE), gen)).float()
        exact += grads.double().mean(dim=0)
        for name, exchange in treatments.items():
            applied[name] += exchange(grads).double()
    out = {name: rel_l2(total, exact) for name, total in applied.items()}
    out["used_steps"] = used_steps
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.unused_residuals", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--ranks", type=int, default=RANKS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.ranks < 2:
        parser.error("--steps must be >= 1 and --ranks >= 2")
    rows: Dict[str, Any] = {f"{fraction:g}": run(fraction, args.ranks, args.steps) for fraction in FRACTIONS}
    if args.json:
        print(json_text({"ranks": args.ranks, "steps": args.steps, "size": SIZE, "format": "fp8e4m3",
                         "by_fraction_used": rows}), end="")
        return 0
    print(f"FP8 E4M3 + error feedback, {args.ranks} ranks, {args.steps} steps, a {SIZE}-element head: relative L2 "
          "error of the sum of applied updates over the steps it was used")
    print(format_table(["used", "steps", "dropped (the hook)", "kept", "no error feedback"],
                       [[fraction, row["used_steps"], row["dropped"], row["kept"], row["no error feedback"]]
                        for fraction, row in rows.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
