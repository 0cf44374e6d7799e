"""Online tuning on the emulated cluster: the step of ``tune="online"`` beside each single format's, at each link rate,
the link's rate changed mid-run.

    ddp-triton autotune --model-only --topology h200-vm-1gpu --nodes 2 --inter-node-gbps 50 \\
        --formats fp32,bf16,bf16+fp32sum,fp8e4m3+ef --host-cost cpu --no-cache --out bench/out/online/fast.json
    python -m bench.cluster --nodes 2 --link 1gbit -- \\
        python -m bench.online_tuning --rates 1gbit,200mbit --profile bench/out/online/fast.json

One phase per rate of ``--rates``: the first is the cluster's own ``--link``, each later one is set mid-run by rank 0
through ``bench.cluster.control``. In each phase:

1. The online model steps alone until its tuning has chosen: from the profile in the first phase (a profile made
   for a fast link, so its own choice is the wrong one here), after the step's drift set off a re-tune in the
   later ones. The steps it took are counted.
2. Every model takes turns, ``--rounds`` rounds of ``--steps`` steps each (two untimed first): one per single
   format and the online one. The medians side by side, and online's over the fastest single format's.

Every model trains on the workload's fixed batch from the same weights (the 25.2M-parameter MLP by default). At the
end the fp32 and online models step on, untimed, until each has taken ``--loss-step`` steps: their losses there
compare the accuracy of online tuning's formats with fp32's. Rank 0 prints the
table and writes the JSON under ``--out-dir`` (default bench/out, which git ignores); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from bench.cluster.control import request_rate
from bench.common import environment, format_table, progress, save_json, sync
from bench.ddp_models import make_workload
from bench.ddp_step import init
from ddp_triton.formats import WireFormat

FORMATS = ["fp32", "bf16", "bf16+fp32sum", "fp8e4m3+ef"]
ONLINE = "online"


class Trainee:
    """One DDP model of the run, its optimizer, and the loss and time of every step it took."""

    def __init__(self, name: str, base: torch.nn.Module, loss: Any, profile: Optional[str],
                 device: torch.device, lr: float, formats: List[str]) -> None:
        self.name, self.loss_fn, self.device = name, loss, device
        self.ddp = DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None)
        if name == ONLINE:
            self.state = ddp_triton.register(self.ddp, comm_dtype="auto", tune="online", formats=formats,
                                             profile=profile)
        else:
            self.state = ddp_triton.register(self.ddp, profile=None, **WireFormat.parse(name).options())
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=lr)
        self.losses: List[float] = []

    def step(self) -> float:
        """One training step; its milliseconds."""
        sync(self.device)
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        value = self.loss_fn(self.ddp)
        value.backward()
        self.opt.step()
        sync(self.device)
        elapsed = (time.perf_counter() - start) * 1e3
        self.losses.append(float(value.detach()))
        return elapsed


def adapt(online: Trainee, limit: int) -> Dict[str, Any]:
    """Step the online model alone until a tuning that had not ended when called has ended; how many steps."""
    tuner = online.state.tuner
    before, steps, started = tuner.tunings, 0, None
    while steps < limit and (tuner.tunings == before or online.state.tuned_formats() is None):
        online.step()
        steps += 1
        if started is None and online.state.tuned_formats() is None:
            started = steps  # the pass at whose start tuning began (after drift, in a later phase)
    tuned = online.state.tuned_formats()
    return {"steps": steps, "tuning_seen_from_step": started, "ended": tuner.tunings > before,
            "formats": None if tuned is None else {i: t["format"] for i, t in tuned.items()},
            "decided_on_ms": None if tuned is None else next(iter(tuned.values()))["step_ms"]}


def take_turns(trainees: List[Trainee], rounds: int, steps: int) -> Dict[str, List[float]]:
    """Each model in turn, ``rounds`` times: two untimed steps, then ``steps`` timed ones."""
    times: Dict[str, List[float]] = {t.name: [] for t in trainees}
    for round_ in range(rounds):
        for t in trainees:
            for _ in range(2):
                t.step()
            times[t.name] += [t.step() for _ in range(steps)]
            if dist.get_rank() == 0:
                progress(f"  round {round_ + 1}/{rounds}: {t.name} median {statistics.median(times[t.name]):.1f} ms")
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", required=True, help="the link's rate per phase, comma-separated; the first is the "
                   "cluster's own --link, the later ones are set mid-run (e.g. 1gbit,200mbit)")
    p.add_argument("--profile", help="the profile the online model starts from (default: none)")
    p.add_argument("--blocks", type=int, default=3, help="MLP residual blocks of width 1024 (3: 25.2M parameters)")
    p.add_argument("--small", action="store_true", help="a smoke run: the MLP at width 128 and 2 blocks")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per model per round")
    p.add_argument("--adapt-limit", type=int, default=150, help="steps the online model may take to (re)tune")
    p.add_argument("--loss-step", type=int, default=100, help="the step whose loss is compared with fp32's")
    p.add_argument("--lr", type=float, default=3.0, help="SGD's learning rate: at 3 the MLP's loss falls by about a "
                   "third in 25 steps, so the formats' accuracy shows in it")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="the formats online tuning may choose, each also timed alone (fp32 among them: the loss is "
                        f"compared with its; default {','.join(FORMATS)})")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    rates = args.rates.split(",")
    formats = [WireFormat.parse(name).name for name in args.formats.split(",") if name]
    if "fp32" not in formats:
        p.error("--formats must include fp32 (the loss is compared with fp32's)")

    device = init()  # torchrun's job (bench.cluster's: gloo on CPU), or one of a single rank
    rank = dist.get_rank()
    if rank == 0:  # the tuner's one line per decision
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
        logging.getLogger("ddp_triton").setLevel(logging.INFO)
    work = make_workload("mlp", args.small, args.batch, None, device, dist.get_world_size(), args.blocks)
    online = Trainee(ONLINE, work.model, work.loss, args.profile, device, args.lr, formats)
    fixed = [Trainee(name, work.model, work.loss, None, device, args.lr, formats) for name in formats]
    phases = []
    for i, rate in enumerate(rates):
        if i > 0:
            if rank == 0:
                request_rate(rate)
            dist.barrier()
        if rank == 0:
            progress(f"phase {i + 1}/{len(rates)}: {rate}; the online model tunes")
        tuning = adapt(online, args.adapt_limit)
        if rank == 0:
            progress(f"  tuned after {tuning['steps']} steps: {tuning['formats']}")
        times = take_turns([*fixed, online], args.rounds, args.steps)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        best = min(formats, key=lambda name: medians[name])
        phases.append({"rate": rate, "tuning": tuning, "median_ms": medians, "best_single": best,
                       "online_over_best": medians[ONLINE] / medians[best],
                       "spread_ms": {name: [min(ts), max(ts)] for name, ts in times.items()}})
    fp32 = fixed[formats.index("fp32")]
    while len(fp32.losses) < args.loss_step or len(online.losses) < args.loss_step:  # untimed: the accuracy
        for t in (fp32, online):
            if len(t.losses) < args.loss_step:
                t.step()
    losses = {t.name: t.losses for t in (*fixed, online)}
    at = args.loss_step - 1
    loss_row = {name: (ls[at] if len(ls) > at else None) for name, ls in losses.items()}
    if rank == 0:
        rows = [[ph["rate"], ph["tuning"]["steps"], *(f"{ph['median_ms'][n]:.0f}" for n in [*formats, ONLINE]),
                 ph["best_single"], f"{ph['online_over_best']:.3f}"] for ph in phases]
        print(format_table(["link", "tuning steps", *formats, ONLINE, "best single", "online/best"], rows))
        fp32_loss, online_loss = loss_row["fp32"], loss_row[ONLINE]
        if fp32_loss is not None and online_loss is not None:
            print(f"loss at step {args.loss_step}: fp32 {fp32_loss:.6g}, online {online_loss:.6g} "
                  f"({online_loss / fp32_loss - 1:+.3%})")
        else:
            print(f"loss at step {args.loss_step}: not reached (fp32 {len(losses['fp32'])} steps, online "
                  f"{len(losses[ONLINE])})")
        path = save_json("online_tuning", {"env": {**environment(device), **work.env,
                                                   "world_size": dist.get_world_size(), "rates": rates,
                                                   "profile": args.profile, "rounds": args.rounds, "lr": args.lr,
                                                   "formats": formats,
                                                   "steps": args.steps},
                                           "phases": phases, "loss_at_step": {"step": args.loss_step, **loss_row},
                                           "losses": losses}, args.out_dir)
        print(f"wrote {path}")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
