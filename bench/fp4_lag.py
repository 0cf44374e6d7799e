"""Where 4-bit E2M1 + error feedback's lag on ``bench.quality``'s char model comes from, at 4 ranks.

    python -m bench.fp4_lag            # ~3 minutes on one thread; a table on stdout, JSON under bench/out/
    python -m bench.fp4_lag --quick    # a smoke run: a few steps, the quick char model

``bench.fp4_candidates``'s one-process simulation of the sharded exchange (it gives ``bench.quality``'s real-rank
losses to 5 digits), with the residuals in bfloat16 as the runtime keeps them, E2M1 with an E8M0 scale per 32 (the
shipped format), 300 steps. Each row changes one thing against ``e2m1+ef``:

- ``adam v from exact``: the optimizer's first moment takes what was sent, its second moment the float32 average the
  ranks meant to send (AdamW written out; ``fp32 by hand`` is that AdamW fed the float32 average for both, a check
  that it is torch's);
- ``one rounding``: the reducing rank's float32 sum used as it is, without the second (requantizing) rounding;
- ``exact <name>``: the parameters whose names contain it sent without rounding, the rest in E2M1.

Final loss: the ranks' training loss averaged over the last 20 steps, against fp32 averaging's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import fp4_candidates as fc  # noqa: E402
from bench.common import OUT_DIR, environment, format_table, progress, write_json  # noqa: E402
from bench.quality import CharTask  # noqa: E402

RANKS = 4
STEPS = 300
SHIPPED = fc.Candidate("e2m1", 32, "e8m0")
#: Parameters of the char model sent exactly, one group a row: attention's input projection (query, key, value),
#: its output projection, the feed-forward layers, embeddings, the output layer, biases and norms.
EXACT_GROUPS = ("in_proj", "out_proj", "linear", "token,position", "head", "bias,norm")


class SplitAdamW:
    """AdamW (torch's defaults, ``lr``) whose first moment reads ``p.grad`` and second moment another gradient; each
    gradient clipped to norm 1 by its own norm, as the runs clip theirs."""

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.moments: Dict[int, List[torch.Tensor]] = {}

    def __call__(self, params: List[torch.nn.Parameter], second_moment_of: torch.Tensor, step: int) -> None:
        b1, b2 = self.betas
        t = step + 1
        clip = lambda norm: min(1.0, 1.0 / (float(norm) + 1e-6))  # noqa: E731 (clip_grad_norm_'s factor)
        sent_clip = clip(torch.stack([p.grad.norm() for p in params]).norm())
        other_clip = clip(second_moment_of.norm())
        offset = 0
        with torch.no_grad():
            for p in params:
                other = second_moment_of[offset:offset + p.numel()].view_as(p) * other_clip
                offset += p.numel()
                m, v = self.moments.setdefault(id(p), [torch.zeros_like(p), torch.zeros_like(p)])
                p.mul_(1 - self.lr * self.weight_decay)
                m.mul_(b1).add_(p.grad * sent_clip, alpha=1 - b1)
                v.mul_(b2).addcmul_(other, other, value=1 - b2)
                denominator = (v / (1 - b2 ** t)).sqrt().add_(self.eps)
                p.addcdiv_(m / (1 - b1 ** t), denominator, value=-self.lr)
                p.grad = None


def rows(quick: bool) -> Dict[str, Dict[str, Any]]:
    task = CharTask(quick)
    steps = fc.QUICK_STEPS["char"] if quick else STEPS
    e2m1 = lambda g: fc.quantize(g, SHIPPED)  # noqa: E731
    runs: Dict[str, Dict[str, Any]] = {
        "fp32": dict(q=None),
        "fp32 by hand": dict(q=None, optimizer_step=SplitAdamW(task.lr)),
        "e2m1+ef": dict(q=e2m1),
        "e2m1+ef, adam v from exact": dict(q=e2m1, optimizer_step=SplitAdamW(task.lr)),
        "e2m1+ef, one rounding": dict(q=e2m1, second_stage=False),
    }
    for group in EXACT_GROUPS:
        runs[f"e2m1+ef, exact {group}"] = dict(q=e2m1, exact=lambda name, group=group: any(
            part in name for part in group.split(",")))
    out: Dict[str, Dict[str, Any]] = {}
    for name, options in runs.items():
        started = time.perf_counter()
        losses = fc.train(task, options.pop("q"), RANKS, steps, residual_dtype=torch.bfloat16, **options)
        out[name] = {"final_loss": fc._final(losses)}
        progress(f"{name}: final loss {out[name]['final_loss']:.5f} ({time.perf_counter() - started:.0f} s)")
    for row in out.values():
        row["vs_fp32"] = row["final_loss"] / out["fp32"]["final_loss"] - 1.0
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fp4_lag", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps, the quick char model")
    p.add_argument("--out", default=None, help="JSON path (default bench/out/fp4_lag.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    table = rows(args.quick)
    out = Path(args.out) if args.out else OUT_DIR / "fp4_lag.json"
    write_json(out, {"env": environment(torch.device("cpu")), "ranks": RANKS, "quick": args.quick, "rows": table,
                     "runtime_s": round(time.perf_counter() - started, 1)})
    print(format_table(["run", "final loss", "vs fp32"],
                       [[name, f"{r['final_loss']:.5f}", f"{100 * r['vs_fp32']:+.2f}%"] for name, r in table.items()]))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
