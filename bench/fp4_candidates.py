"""Which 4-bit block-scaled wire format to build: candidates measured on gradients and in simulated training.

    python -m bench.fp4_candidates            # every candidate; JSON under bench/out/, a table on stdout (~10 min)
    python -m bench.fp4_candidates --quick    # a smoke run: few steps, small char model
    python -m bench.fp4_candidates --out FILE.json

Each candidate sends a tensor's 128-element blocks (blocks cut per tensor, as FP8's ``BlockLayout``) as 4-bit values
with a scale per group of ``group`` elements, at most 0.57 bytes an element with the scales (FP8's row: 1.03):

- values: ``e2m1`` (the OCP MX / NVFP4 element: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and signs; nearest, ties to even) or
  ``int4`` (symmetric integers -7..7, nearest, ties to even);
- scale: ``e8m0`` (one byte, a power of two: the smallest 2^e that fits the group's absmax under the largest value),
  ``fp32`` (absmax / largest value, one float32 per 128-element block: groups of 128 only), or ``e4m3`` (NVFP4's
  one-byte E4M3 scale per 16, under a power-of-two E8M0 scale per 128-element block that fits the largest group
  scale under 448; the element rounding clamps at the largest value);
- ``+H``: the block rotated by the orthonormal 128 x 128 Hadamard matrix before quantizing, rotated back after.

Measured:

1. Relative error ``||Q(g) - g|| / ||g||`` of one quantization, no error feedback: on ``bench.numerics``'s
   gradient-like bucket (six tensors of scales 1e-6 to 1e2, Student-t tails; one rank's gradient, seed 0) and on
   real gradients of ``bench.quality``'s two models (rank 0's float32 gradient at three steps of the fp32 run below;
   the mean over those steps).
2. Training, simulated data parallelism in one process: N = 2 and 4 ranks, each with ``bench.quality``'s batch of
   its rank and step, the same initial weights and optimizer (AdamW, clip to norm 1). The averaged gradient is what
   the sharded FP8 exchange computes with error feedback: each rank quantizes ``g / N + r1`` (its own residual r1
   <- value - dequantized), the reducing rank sums the dequantized values in float32 in rank order from +0, adds its
   residual r2, requantizes (r2 <- total - dequantized), and every rank uses the dequantized result. The same
   arithmetic in float32 here for every candidate (torch ops; the bits of the kernels are not the point). Compared:
   fp32 averaging and FP8 E4M3 with error feedback (``kernels.torch_wire.quantize_rows``, the kernels' own torch
   path), one candidate without error feedback. Final loss: the ranks' training loss averaged over the last 20 steps.

Noise: ``fp32 other order`` is fp32 averaging summed in reverse rank order: the same arithmetic up to float32's last
bits, so its final loss against fp32's is how far a trajectory moves by rounding alone.

Bytes: a row is padded to whole 32-bit words, as the kernels read and write rows (FP8's too): 64 code bytes and the
scales rounded up to a multiple of 4 bytes.

Pick: the lowest mean of |final loss / fp32's - 1| over the four runs (two models x N = 2, 4: training as fp32 does,
``bench.quality``'s criterion; a loss below fp32's on the small seed model is noise, as the run without error
feedback shows); candidates within the tie margin of it tie (the largest |final loss / fp32's - 1| of ``fp32 other
order`` over the four runs, at least ``MIN_TIE``), and among those the simplest wins (no rotation, then scale e8m0 <
fp32 < e4m3, then e2m1 < int4 as the MX/NVFP4 element hardware converts natively), then the fewest bytes, then the
lowest relative error on the char model's gradients. ``--rank FILE.json`` applies the rule to a saved run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import OUT_DIR, environment, format_table, progress, write_json  # noqa: E402
from bench.numerics import TENSORS, Gradients  # noqa: E402
from bench.quality import CharTask, SeedTask  # noqa: E402
from ddp_triton.kernels import block_layout, torch_wire  # noqa: E402
from ddp_triton.kernels.fp8 import E4M3  # noqa: E402

BLOCK = 128
#: The magnitudes of E2M1 by code (0-7), and the midpoints between neighbours with which way a tie goes (to the even
#: code): a value rounds up past a midpoint, and at it only to an even code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
LARGEST = {"e2m1": 6.0, "int4": 7.0}
SCALE_BYTES = {"e8m0": 1, "fp32": 4, "e4m3": 1}
#: The least tie margin (final loss / fp32's - 1): a quarter percent of the loss, 1/8 of FP8's target (2%,
#: bench.quality.TARGETS). A first run of this script had groups of 32 train 0.3-0.4% worse than groups of 64 on the
#: char model (more scales cannot be systematically worse): differences that small are the draw of the rounding.
MIN_TIE = 0.0025
STEPS = {"seed": 300, "char": 200}  # char: 200, not 300, to keep the whole run near 10 minutes on a shared 2-core CPU
QUICK_STEPS = {"seed": 20, "char": 10}
LAST = 20
NS = (2, 4)
GRADIENT_STEPS = (0, 100, 199)  # the fp32 run's steps whose rank-0 gradients measure the relative error


@dataclass(frozen=True)
class Candidate:
    values: str
    group: int
    scale: str
    hadamard: bool = False

    @property
    def name(self) -> str:
        return f"{self.values} g{self.group} {self.scale}" + (" +H" if self.hadamard else "")

    @property
    def bytes_per_element(self) -> float:
        """A row's bytes over 128: the codes, then the scales (E4M3's with the E8M0 over them), padded to words."""
        scales = SCALE_BYTES[self.scale] * (BLOCK // self.group) + (1 if self.scale == "e4m3" else 0)
        return (BLOCK // 2 + -(-scales // 4) * 4) / BLOCK


CANDIDATES: Tuple[Candidate, ...] = (
    Candidate("e2m1", 16, "e8m0"), Candidate("e2m1", 32, "e8m0"), Candidate("e2m1", 64, "e8m0"),
    Candidate("e2m1", 128, "e8m0"), Candidate("e2m1", 128, "fp32"), Candidate("e2m1", 16, "e4m3"),
    Candidate("int4", 16, "e8m0"), Candidate("int4", 32, "e8m0"), Candidate("int4", 128, "fp32"),
    Candidate("int4", 16, "e4m3"),
    Candidate("e2m1", 32, "e8m0", True), Candidate("int4", 32, "e8m0", True), Candidate("e2m1", 128, "fp32", True),
)
#: The candidate also trained without error feedback, to show what error feedback does at 4 bits.
NO_EF = Candidate("e2m1", 32, "e8m0")


def hadamard(n: int = BLOCK) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


_H = hadamard()


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (|x| <= 6) to the nearest E2M1 value, ties to the even code."""
    a = x.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
            + (a >= 3.5).int() + (a > 5.0).int())
    return torch.tensor(E2M1_VALUES)[code.long()].copysign(x)


def _power_of_two_at_least(r: torch.Tensor) -> torch.Tensor:
    """The smallest 2^e >= r (e clamped to [-126, 126]); 1 where r is 0."""
    mantissa, exponent = torch.frexp(r)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-126, 126)
    return torch.where(r > 0, torch.pow(2.0, e.double()).float(), torch.ones_like(r))


def quantize(grid: torch.Tensor, c: Candidate) -> torch.Tensor:
    """float32 blocks (R, 128) -> what candidate ``c`` gives back (dequantized)."""
    x = grid @ _H if c.hadamard else grid
    largest = LARGEST[c.values]
    groups = x.view(x.shape[0], BLOCK // c.group, c.group)
    absmax = groups.abs().amax(dim=2, keepdim=True)
    if c.scale == "e8m0":
        scale = _power_of_two_at_least(absmax / largest)
    elif c.scale == "fp32":
        scale = absmax / largest
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # 0 also where absmax / largest underflows
    else:  # E4M3 per group under a power of two per block that fits the block's largest group scale under 448
        wanted = absmax / largest
        outer = _power_of_two_at_least(wanted.amax(dim=1, keepdim=True) / 448.0)
        scale = (wanted / outer).to(torch.float8_e4m3fn).float() * outer
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (groups / scale).clamp(-largest, largest)
    q = _round_e2m1(scaled) if c.values == "e2m1" else torch.round(scaled)
    out = (q * scale).view_as(x)
    return out @ _H.T if c.hadamard else out


def fp8_quantize(grid: torch.Tensor) -> torch.Tensor:
    return torch_wire.quantize_rows(grid.contiguous(), E4M3)[2]


class Grid:
    """A model's gradients as FP8's block grid: each tensor its own 128-element blocks, zero past its end."""

    def __init__(self, sizes: Sequence[int]) -> None:
        layout = block_layout(list(sizes), 1)
        self.rows, self.positions = layout.n_rows, layout.positions()
        self.mask = torch.zeros(self.rows * BLOCK, dtype=torch.bool)
        self.mask[self.positions] = True
        self.mask = self.mask.view(self.rows, BLOCK)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(self.rows * BLOCK)
        grid.index_copy_(0, self.positions, flat)
        return grid.view(self.rows, BLOCK)

    def flat(self, grid: torch.Tensor) -> torch.Tensor:
        return grid.reshape(-1).index_select(0, self.positions)


def relative_error(grid: Grid, flat: torch.Tensor, q) -> float:
    g = grid.of(flat)
    return float((q(g) - g).double().norm() / g.double().norm())


def train(task: Any, q, n_ranks: int, steps: int, error_feedback: bool = True,
          keep: Optional[Dict[int, torch.Tensor]] = None, reverse: bool = False, *,
          residual_dtype: torch.dtype = torch.float32, second_stage: bool = True,
          exact: Optional[Callable[[str], bool]] = None, optimizer_step: Any = None) -> List[float]:
    """Per-step mean training loss over the ranks of one simulated data-parallel run; ``q`` None: fp32 averaging
    (``reverse``: summed in reverse rank order). ``keep``: filled with rank 0's flat gradient at ``GRADIENT_STEPS``.

    For ``bench.fp4_lag``'s questions: ``residual_dtype`` rounds the residuals at every store, as the runtime keeps
    them; ``second_stage`` False uses the float32 sum as it is, without the second rounding; ``exact`` names the
    parameters (by name) sent without rounding; ``optimizer_step(params, exact_average, step)`` replaces the clip
    and AdamW step, given the float32 average the ranks meant to send."""
    torch.manual_seed(0)
    model = task.model()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grid = Grid([p.numel() for p in params])
    optimizer = torch.optim.AdamW(params, lr=task.lr)
    if exact is not None and q is not None:
        unrounded = grid.of(torch.cat([torch.full((p.numel(),), float(exact(name))) for name, p in named])) > 0
        rounding = q

        def q(g: torch.Tensor) -> torch.Tensor:
            return torch.where(unrounded, g, rounding(g))
    stored = (lambda t: t) if residual_dtype == torch.float32 else (lambda t: t.to(residual_dtype).float())
    first = [torch.zeros(grid.rows, BLOCK) for _ in range(n_ranks)]
    second = torch.zeros(grid.rows, BLOCK)
    losses = []
    for step in range(steps):
        total_loss, grads = 0.0, []
        for rank in range(n_ranks):
            loss = task.loss(model, task.batch_for(step, rank))
            flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
            grads.append(flat)
            total_loss += loss.item()
            if keep is not None and rank == 0 and step in GRADIENT_STEPS:
                keep[step] = flat.clone()
        losses.append(total_loss / n_ranks)
        if q is None:
            order = grads[::-1] if reverse else grads
            average = order[0] * (1.0 / n_ranks)
            for g in order[1:]:
                average = average + g * (1.0 / n_ranks)
        else:
            total = torch.zeros(grid.rows, BLOCK)
            for rank, g in enumerate(grads):
                value = grid.of(g * (1.0 / n_ranks))
                if error_feedback:
                    value = value + first[rank]
                sent = q(value)
                if error_feedback:
                    first[rank] = stored((value - sent) * grid.mask)  # padding never feeds back
                total = total + sent
            if second_stage:
                if error_feedback:
                    total = total + second
                result = q(total)
                if error_feedback:
                    second = stored((total - result) * grid.mask)
            else:
                result = total
            average = grid.flat(result)
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if optimizer_step is not None:
            meant = grads[0] * (1.0 / n_ranks)
            for g in grads[1:]:
                meant = meant + g * (1.0 / n_ranks)
            optimizer_step(params, meant, step)
            continue
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _final(losses: Sequence[float], last: int = LAST) -> float:
    tail = losses[-last:]
    return sum(tail) / len(tail)


def tie_margin(rows: Dict[str, Dict[str, Any]]) -> float:
    return max(MIN_TIE, max(abs(v) for v in rows["fp32 other order"]["vs_fp32"].values()))


def choose(rows: Dict[str, Dict[str, Any]]) -> str:
    """The pick by the rule in the module's docstring."""
    scored = {name: row for name, row in rows.items() if row.get("candidate") is not None}
    distance = {name: sum(abs(v) for v in row["vs_fp32"].values()) / len(row["vs_fp32"])
                for name, row in scored.items()}
    best = min(d for d in distance.values() if math.isfinite(d))
    tied = [row for name, row in scored.items() if distance[name] <= best + tie_margin(rows)]  # NaN never ties
    order = {"e8m0": 0, "fp32": 1, "e4m3": 2}
    tied.sort(key=lambda r: (r["candidate"]["hadamard"], order[r["candidate"]["scale"]],
                             r["candidate"]["values"] != "e2m1", r["bytes_per_element"], r["relative_error"]["char"]))
    return tied[0]["name"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fp4_candidates", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps, the quick char model")
    p.add_argument("--out", default=None, help="JSON path (default bench/out/fp4_candidates.json)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared 2-core machine)")
    p.add_argument("--rank", default=None, help="apply the pick's rule to a saved JSON instead of running")
    args = p.parse_args(argv)
    if args.rank:
        rows = json.loads(Path(args.rank).read_text())["rows"]
        for row in rows.values():
            if row["candidate"] is not None:
                row["bytes_per_element"] = Candidate(**row["candidate"]).bytes_per_element
        print(f"pick: {choose(rows)}")
        return 0
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    steps = QUICK_STEPS if args.quick else STEPS
    tasks = {"seed": SeedTask(args.quick), "char": CharTask(args.quick)}
    schemes: Dict[str, Tuple[Any, bool, Optional[Candidate]]] = {
        "fp32": (None, True, None), "fp32 other order": (None, True, None), "fp8e4m3+ef": (fp8_quantize, True, None)}
    for c in CANDIDATES:
        schemes[c.name + " +ef"] = ((lambda g, c=c: quantize(g, c)), True, c)
    schemes[NO_EF.name + " no-ef"] = ((lambda g: quantize(g, NO_EF)), False, None)

    finals: Dict[str, Dict[str, float]] = {name: {} for name in schemes}
    kept: Dict[str, Dict[int, torch.Tensor]] = {}
    for model, task in tasks.items():
        for n in NS:
            for name, (q, ef, _) in schemes.items():
                t0 = time.perf_counter()
                keep = kept.setdefault(model, {}) if name == "fp32" and n == NS[0] else None
                losses = train(task, q, n, steps[model], ef, keep, reverse=name == "fp32 other order")
                finals[name][f"{model} N={n}"] = _final(losses)
                progress(f"{model} N={n} {name}: final loss {_final(losses):.4f} ({time.perf_counter() - t0:.1f} s)")

    numerics = Gradients(TENSORS)
    numerics_flat = numerics.step(1, 0)[0]
    numerics_grid = Grid(numerics.sizes)
    grids = {model: Grid([p.numel() for p in task.model().parameters()]) for model, task in tasks.items()}

    def errors(q) -> Dict[str, float]:
        out = {"numerics": relative_error(numerics_grid, numerics_flat, q)}
        for model, grads in kept.items():
            out[model] = sum(relative_error(grids[model], g, q) for g in grads.values()) / len(grads)
        return out

    runs = list(next(iter(finals.values())))
    rows: Dict[str, Dict[str, Any]] = {}
    for name, (q, ef, c) in schemes.items():
        vs = {run: finals[name][run] / finals["fp32"][run] - 1.0 for run in runs}
        mean_abs = sum(abs(v) for v in vs.values()) / len(vs)
        rows[name] = {"name": name, "candidate": None if c is None else {"values": c.values, "group": c.group,
                                                                           "scale": c.scale, "hadamard": c.hadamard},
                      "bytes_per_element": {"fp32": 4.0, "fp32 other order": 4.0, "fp8e4m3+ef": 132 / 128}.get(
                          name, (c or NO_EF).bytes_per_element),
                      "relative_error": {} if q is None else errors(q), "final_loss": finals[name],
                      "vs_fp32": vs, "mean_vs_fp32": sum(vs.values()) / len(vs), "mean_abs_vs_fp32": mean_abs}
    pick = choose(rows)
    headers = ["scheme", "B/elem", "rel.err numerics", "rel.err seed", "rel.err char"] + \
        [f"{run} vs fp32" for run in runs] + ["mean |vs fp32|"]
    table = format_table(headers, [
        [name, round(r["bytes_per_element"], 4)] + [r["relative_error"].get(k) for k in ("numerics", "seed", "char")]
        + [f"{100 * r['vs_fp32'][run]:+.2f}%" for run in runs] + [f"{100 * r['mean_abs_vs_fp32']:.2f}%"]
        for name, r in rows.items()])
    fp32_row = "fp32 final loss: " + ", ".join(f"{run} {finals['fp32'][run]:.4f}" for run in runs)
    elapsed = time.perf_counter() - started
    out = Path(args.out) if args.out else OUT_DIR / "fp4_candidates.json"
    write_json(out, {"env": {**environment(torch.device("cpu")), "threads": torch.get_num_threads()},
                     "config": {"quick": args.quick, "steps": steps, "ns": list(NS), "last": LAST,
                                "tie": tie_margin(rows), "gradient_steps": list(GRADIENT_STEPS)},
                     "rows": rows, "pick": pick, "runtime_s": round(elapsed, 1)})
    print(table)
    print(fp32_row)
    print(f"pick: {pick} (lowest mean |vs fp32| within {100 * tie_margin(rows):.2f}% of the best, then the simplest, "
          "then fewest bytes)")
    print(f"saved {out}; runtime {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
