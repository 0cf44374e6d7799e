"""Training quality per wire format: real DDP on gloo ranks (CPU), the same data and initial weights for each format.

    python -m bench.quality                   # 2 ranks, both models, every format; JSON + plot in bench/out/
    python -m bench.quality --world-size 4    # 2 to 4 ranks
    python -m bench.quality --quick           # a smoke run: tiny models, a few steps

Default: 300 steps per model and format, about 5 minutes at 2 ranks on a shared 2-core CPU (7 at 4 ranks).

Models:

- ``seed``: the example's model (``examples/train.py``): Linear(32, 256) - GELU - Linear(256, 256) - GELU -
  Linear(256, 10), 76k parameters, on the example's synthetic data (a fixed random teacher labels random inputs),
  batch 64 per rank, AdamW lr 3e-3, gradients clipped to norm 1.
- ``char``: a character-level transformer (2 pre-LayerNorm blocks of width 64, 137k parameters, ``CHAR_MODEL``)
  on bytes of Python standard-library source files (``CORPUS_FILES``, read from this interpreter's stdlib: no
  download; their sha256 is in the JSON), batch 16 x 64 tokens per rank, AdamW lr 2e-3, gradients clipped to norm 1.

Formats (``ddp_triton.register(ddp, profile=None, ...)`` with): ``fp32`` (comm_dtype=float32: one float32
all-reduce), ``bf16`` (one bf16 all-reduce), ``bf16+fp32sum`` (accumulate_dtype=float32), ``fp8e4m3+ef``
(float8_e4m3fn, error feedback on) and ``fp8e4m3`` (error_feedback=False), ``fp4e2m1+ef`` and ``fp4e2m1`` (4-bit
E2M1, with and without error feedback), the two-level forms; and FSDP2
(``fully_shard`` on the whole model, ``FSDP_FORMATS``): its float32 and ``reduce_dtype=torch.bfloat16``
reduce-scatters, and ours through ``ddp_triton.fsdp.register`` (bf16 with float32 sums, FP8 and E2M1 with error
feedback).
Each run starts from the same weights (``torch.manual_seed``) and sees the same batches (drawn from a generator
seeded by step and rank), so the runs differ only by what the wire does to the gradients.

Final loss: the training loss averaged over ranks and over the last ``--last`` steps; also a held-out loss at the
end (the seed model: 2048 held-out samples; the char model: 32 windows from the last 10% of the corpus). Bytes on
the wire per step: counted by the state (``state.summary()``: the bytes of each tensor handed to a collective in the
latest backward, per wire format: the all-reduce's buffer, or for the sharded formats the all-to-all's send
buffer, FP8 scales and padding included), beside what the same gradients take in float32; the all-gather's shard,
which the state does not count, is listed from the exchange's buffers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import ddp_triton  # noqa: E402
from bench.common import OUT_DIR, PLOT_MISSING, environment, format_table, progress, pyplot, write_json  # noqa: E402
from ddp_triton.formats import WireFormat  # noqa: E402
from ddp_triton.tune.processes import leave_process_group  # noqa: E402
from examples.train import synthetic_dataset  # noqa: E402


#: The DDP formats, each with ``register``'s options that name it. The two-level ones (hierarchical=True): the ranks
#: are 2 nodes (GROUP_RANK = rank // (N/2)); at 2 ranks, one rank per node, they run flat.
FORMATS: Dict[str, Dict[str, Any]] = {
    name: WireFormat.parse(name).options() for name in
    ("fp32", "bf16", "bf16+fp32sum", "fp8e4m3+ef", "fp8e4m3", "two-level bf16", "two-level bf16+fp32sum",
     "two-level fp8e4m3+ef", "fp4e2m1+ef", "fp4e2m1", "two-level fp4e2m1+ef")}
#: FSDP2 instead of DDP (``fully_shard`` on the model; the same data, weights and optimizer): its own float32 and
#: ``reduce_dtype=torch.bfloat16`` reduce-scatters, and ours (``ddp_triton.fsdp.register`` with these options).
FSDP_FORMATS: Dict[str, Optional[Dict[str, Any]]] = {
    "fsdp fp32": None,
    "fsdp bf16 reduce_dtype": None,
    "fsdp bf16+fp32sum": WireFormat.parse("bf16+fp32sum").options(),
    "fsdp fp8e4m3+ef": WireFormat.parse("fp8e4m3+ef").options(),
    "fsdp fp4e2m1+ef": WireFormat.parse("fp4e2m1+ef").options(),
}
#: The targets: final loss within this fraction of fp32's (DDP's fp32 run).
TARGETS = {"bf16+fp32sum": 0.005, "fp8e4m3+ef": 0.02, "two-level bf16+fp32sum": 0.005, "two-level fp8e4m3+ef": 0.02,
           "fsdp bf16+fp32sum": 0.005, "fsdp fp8e4m3+ef": 0.02, "fp4e2m1+ef": 0.01, "two-level fp4e2m1+ef": 0.01,
           "fsdp fp4e2m1+ef": 0.01}

#: A fixed selection of the standard library's own sources (present in every CPython 3.9+), 215 KB on 3.11.
CORPUS_FILES = ("argparse.py", "textwrap.py", "shlex.py", "string.py", "fnmatch.py", "heapq.py", "bisect.py",
                "functools.py")
#: The character model: 2 pre-LayerNorm blocks of width 64, 4 heads, context 64, bytes as tokens: 0.13M parameters.
#: Width 96 (0.28M) took 0.33 s a step (fp32) to 0.54 s (FP8) on this shared 2-core machine, 15 minutes for the
#: five formats; width 64 and 300 steps per model keep the whole default run near 10 minutes.
CHAR_MODEL = {"width": 64, "heads": 4, "layers": 2, "context": 64, "batch": 16, "lr": 2e-3}
QUICK_CHAR_MODEL = {"width": 32, "heads": 2, "layers": 1, "context": 32, "batch": 4, "lr": 2e-3}
STEPS = {"seed": 300, "char": 300}
QUICK_STEPS = {"seed": 12, "char": 6}
LAST = 20  # final loss: mean of the last 20 steps' training loss


# ---- models and data ------------------------------------------------------------------------------------------------


def seed_model(features: int = 32, hidden: int = 256, classes: int = 10) -> nn.Module:
    """examples/train.py's model, as built there."""
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, classes))


class CharTransformer(nn.Module):
    """A small causal transformer over bytes: token and position embeddings, pre-LN blocks, a LayerNorm, a head."""

    def __init__(self, width: int, heads: int, layers: int, context: int, vocab: int = 256, **_: Any) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.token(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def corpus() -> Dict[str, Any]:
    """The bytes of CORPUS_FILES from this interpreter's standard library, and their digest."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in CORPUS_FILES)
    return {"bytes": data, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
            "files": list(CORPUS_FILES), "python": sysconfig.get_python_version()}  # whose standard library


class SeedTask:
    """The example's classifier on the example's synthetic data."""

    name = "seed"

    def __init__(self, quick: bool) -> None:
        x, y = synthetic_dataset(16384).tensors
        self.train_x, self.train_y = x[:-2048], y[:-2048]
        self.eval_x, self.eval_y = x[-2048:], y[-2048:]
        self.batch, self.lr = 64, 3e-3

    def model(self) -> nn.Module:
        return seed_model()

    def batch_for(self, step: int, rank: int):
        gen = torch.Generator().manual_seed(1_000_003 * step + rank)
        idx = torch.randint(0, self.train_x.shape[0], (self.batch,), generator=gen)
        return self.train_x[idx], self.train_y[idx]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(self.eval_x), self.eval_y))


class CharTask:
    """Next-byte prediction on standard-library sources; the last 10% of the bytes are held out."""

    name = "char"

    def __init__(self, quick: bool) -> None:
        self.config = dict(QUICK_CHAR_MODEL if quick else CHAR_MODEL)
        data = corpus()
        self.info = {k: v for k, v in data.items() if k != "bytes"}
        tokens = torch.frombuffer(bytearray(data["bytes"]), dtype=torch.uint8).long()
        split = int(len(tokens) * 0.9)
        self.train, self.held_out = tokens[:split], tokens[split:]
        self.context, self.batch, self.lr = self.config["context"], self.config["batch"], self.config["lr"]
        gen = torch.Generator().manual_seed(7)
        starts = torch.randint(0, len(self.held_out) - self.context - 1, (32,), generator=gen)
        self.eval_windows = torch.stack([self.held_out[s:s + self.context + 1] for s in starts.tolist()])

    def model(self) -> nn.Module:
        return CharTransformer(**self.config)

    def batch_for(self, step: int, rank: int):
        gen = torch.Generator().manual_seed(1_000_003 * step + rank)
        starts = torch.randint(0, len(self.train) - self.context - 1, (self.batch,), generator=gen)
        return torch.stack([self.train[s:s + self.context + 1] for s in starts.tolist()])

    def loss(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        logits = model(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(self.loss(model, self.eval_windows))


TASKS = {"seed": SeedTask, "char": CharTask}


# ---- one training run on every rank ---------------------------------------------------------------------------------


def wire_bytes(state: Any) -> Dict[str, Any]:
    """Bytes on the wire of the latest backward, as the state counted them, and the all-gather shards it does not."""
    summary = state.summary()
    gathered = sum(e.exchange.collective_bytes()[1] for e in state.latest_pass()
                   if hasattr(e.exchange, "collective_bytes"))
    return {"per_step": summary.wire_bytes_per_step, "fp32_per_step": summary.fp32_bytes_per_step,
            "ratio_to_fp32": summary.wire_bytes_per_step / summary.fp32_bytes_per_step,
            "between_nodes_per_step": summary.between_nodes_bytes_per_step,
            "buckets": [{"index": b.index, "elements": b.elements, "wire_format": b.wire_format,
                         "bytes": b.wire_bytes} for b in summary.buckets],
            "all_gather_shard_per_step": gathered, "headline": summary.headline()}


def fsdp_model(model: nn.Module, fmt: str, world_size: int) -> nn.Module:
    """``model`` sharded with FSDP2 over every rank (one FSDP group: the whole model), with ``fmt``'s reduce-scatter."""
    import ddp_triton.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    if fmt == "fsdp bf16 reduce_dtype":
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    else:
        fully_shard(model, mesh=mesh)
    if FSDP_FORMATS[fmt] is not None:
        ddp_triton.fsdp.register(model, **FSDP_FORMATS[fmt])
    return model


def no_wire_bytes() -> Dict[str, Any]:
    """What an FSDP run reports for the bytes no state counted there."""
    return {"per_step": None, "fp32_per_step": None, "ratio_to_fp32": None, "between_nodes_per_step": None,
            "buckets": [], "all_gather_shard_per_step": None, "headline": "not counted (FSDP2)"}


def train(task: Any, fmt: str, steps: int, rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights for every format
    model = task.model()
    if fmt in FSDP_FORMATS:
        ddp, state = fsdp_model(model, fmt, world_size), None
    else:
        ddp = DDP(model, gradient_as_bucket_view=True)
        state = ddp_triton.register(ddp, profile=None, **FORMATS[fmt])
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=task.lr)
    losses = torch.zeros(steps, dtype=torch.float64)
    started = time.perf_counter()
    for step in range(steps):
        loss = task.loss(ddp, task.batch_for(step, rank))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.item()
    elapsed = time.perf_counter() - started
    dist.all_reduce(losses)  # one collective at the end: the mean over ranks of each step's loss
    losses /= world_size
    if state is None:  # FSDP2: the model's parameters are its shards; the held-out loss wants them whole
        eval_loss = task.eval_loss(ddp)  # collective: every rank evaluates
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor counts its whole parameter
    else:
        eval_loss, parameters = task.eval_loss(model), sum(p.numel() for p in model.parameters())
    return {"losses": [round(v, 5) for v in losses.tolist()], "eval_loss": round(eval_loss, 5),
            "seconds": round(elapsed, 1), "wire_format": fmt if state is None else state.wire.name,
            "wire_bytes": no_wire_bytes() if state is None else wire_bytes(state), "parameters": parameters}


def worker(rank: int, world_size: int, store_path: str, out_path: str, models: List[str], formats: List[str],
           steps: Dict[str, int], last: int, quick: bool) -> None:
    torch.set_num_threads(1)  # one core per rank; two threads per rank on 2 busy cores only wait on each other
    os.environ["GROUP_RANK"] = str(rank // max(1, world_size // 2))  # two nodes, for the two-level formats
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results: Dict[str, Any] = {}
    for name in models:
        task = TASKS[name](quick)
        results[name] = {"runs": {}, "steps": steps[name], **({"corpus": task.info} if name == "char" else {})}
        if name == "char":
            results[name]["config"] = task.config
        for fmt in formats:
            run = train(task, fmt, steps[name], rank, world_size)
            results[name]["runs"][fmt] = run
            if rank == 0:
                progress(f"{name} {fmt}: final loss {_final(run['losses'], last):.4f} ({run['seconds']} s)")
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    leave_process_group()
    sys.stdout.flush()
    # Done and reported: skip the interpreter's teardown of torch and gloo, which took 6 s of a quick run's 38 here.
    os._exit(0)


@contextlib.contextmanager
def _environ(**values: str):
    """Set environment variables for the processes started inside (spawned workers copy the environment)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(results: Dict[str, Any], last: int) -> Dict[str, Any]:
    """Per model and format: final loss (mean of the last ``last`` steps), its difference from fp32's, the target."""
    out: Dict[str, Any] = {}
    for name, model in results.items():
        rows = {}
        base = model["runs"].get("fp32")
        base_final = _final(base["losses"], last) if base else None
        for fmt, run in model["runs"].items():
            final = _final(run["losses"], last)
            ratio = run["wire_bytes"]["ratio_to_fp32"]
            row = {"final_loss": round(final, 5), "eval_loss": run["eval_loss"],
                   "wire_bytes_per_step": run["wire_bytes"]["per_step"],
                   "ratio_to_fp32_bytes": None if ratio is None else round(ratio, 4),
                   "between_nodes_per_step": run["wire_bytes"]["between_nodes_per_step"]}
            if base_final is not None:
                row["vs_fp32"] = round(final / base_final - 1.0, 5)
                row["eval_vs_fp32"] = round(run["eval_loss"] / base["eval_loss"] - 1.0, 5)
                if fmt in TARGETS:
                    row["target"] = TARGETS[fmt]
                    row["met"] = abs(row["vs_fp32"]) <= TARGETS[fmt]
            rows[fmt] = row
        out[name] = rows
    return out


def _final(losses: List[float], last: int) -> float:
    tail = losses[-last:]
    return sum(tail) / len(tail)


def plot(data: Dict[str, Any], path: Path) -> Optional[str]:
    """Loss curves per model (smoothed over ``last`` steps); None, or why not, without matplotlib."""
    plt = pyplot()
    if plt is None:
        return PLOT_MISSING
    models = list(data["results"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    window = max(1, min(data["config"]["last"], 10))
    for axis, name in zip(axes[0], models):
        for fmt, run in data["results"][name]["runs"].items():
            losses = torch.tensor(run["losses"])
            smooth = losses.unfold(0, window, 1).mean(dim=1) if len(losses) >= window else losses
            axis.plot(range(window, window + len(smooth)), smooth.tolist(), label=fmt,
                      linestyle="--" if fmt == "fp8e4m3" else "-")
        axis.set(xlabel="step", ylabel=f"training loss (mean over ranks, {window}-step average)",
                 title=f"{name} model, {data['config']['world_size']} gloo ranks")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Training loss per wire format on 2-4 gloo ranks (CPU), and bytes on the "
                                            "wire per step counted by the state")
    p.add_argument("--quick", action="store_true", help="tiny models, a few steps: a smoke run")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks, 2 to 4 (default 2)")
    p.add_argument("--models", default="seed,char", help="comma-separated: seed, char")
    p.add_argument("--formats", default=",".join([*FORMATS, *FSDP_FORMATS]),
                   help="comma-separated: " + ", ".join([*FORMATS, *FSDP_FORMATS]))
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: seed 300, char 300)")
    p.add_argument("--last", type=int, default=None, help=f"final loss: mean of the last steps (default {LAST})")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/out/quality.json; bench/results/ holds the recorded runs); the plot "
                        "beside it")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    formats = [f for f in args.formats.split(",") if f]
    bad = [m for m in models if m not in TASKS] + [f for f in formats if f not in FORMATS and f not in FSDP_FORMATS]
    if bad or not 2 <= args.world_size <= 4 or not models or not formats:
        p.error(f"unknown models/formats {bad}, or world size {args.world_size} outside 2-4")
    steps = {m: args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS)[m] for m in models}
    last = args.last if args.last is not None else (3 if args.quick else LAST)
    if min(steps.values()) < 1 or last < 1:
        p.error(f"steps and --last must be >= 1, got {steps}, {last}")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_tmp = os.path.join(tmp, "results.json")
        # The workers take the torch path of the kernels on CPU tensors (Triton's interpreter would be far too slow).
        with _environ(TRITON_INTERPRET="0"):
            mp.spawn(worker, args=(args.world_size, os.path.join(tmp, "store"), out_tmp, models, formats, steps,
                                   last, args.quick), nprocs=args.world_size, join=True)
        results = json.loads(Path(out_tmp).read_text())
    elapsed = time.perf_counter() - started

    summary = summarize(results, last)
    out = Path(args.out) if args.out else OUT_DIR / "quality.json"
    data = {"env": {**environment(torch.device("cpu")), "threads_per_rank": 1, "backend": "gloo"},
            "config": {"quick": args.quick, "world_size": args.world_size, "steps": steps, "last": last,
                       "formats": formats, "targets": TARGETS},
            "summary": summary, "results": results, "runtime_s": round(elapsed, 1)}
    write_json(out, data, allow_nan=False)

    for name, rows in summary.items():
        model = results[name]
        params = next(iter(model["runs"].values()))["parameters"]
        print(f"\n{name} model ({params} parameters), {args.world_size} gloo ranks, {steps[name]} steps; final loss = "
              f"mean training loss of the last {last} steps:")
        table = []
        for fmt, row in rows.items():
            run = model["runs"][fmt]
            table.append([fmt, f"{row['final_loss']:.4f}", _pct(row.get("vs_fp32")), f"{row['eval_loss']:.4f}",
                          _pct(row.get("eval_vs_fp32")), _target(row), row["wire_bytes_per_step"] or "-",
                          "-" if row["ratio_to_fp32_bytes"] is None else f"{row['ratio_to_fp32_bytes']:.3f}",
                          row["between_nodes_per_step"] if row["between_nodes_per_step"] is not None else "-",
                          run["wire_bytes"]["all_gather_shard_per_step"] or "-", run["seconds"]])
        print(format_table(["format", "final loss", "vs fp32", "held-out loss", "vs fp32", "target",
                            "bytes/step (state)", "x fp32 bytes", "between nodes", "all-gather shard bytes",
                            "train s"], table))
    message = None if args.no_plot else plot(data, out.with_suffix(".png"))
    print(f"\nsaved {out}" + ("" if args.no_plot or message else f" and {out.with_suffix('.png')}"))
    if message:
        print(message)
    print(f"runtime {elapsed:.1f} s")
    return 0


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:+.2f}%"


def _target(row: Dict[str, Any]) -> str:
    if "target" not in row:
        return "-"
    return f"±{row['target'] * 100:g}%: {'met' if row['met'] else 'not met'}"


if __name__ == "__main__":
    sys.exit(main())
