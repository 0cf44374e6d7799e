"""How accurately each wire format averages gradients over N ranks, simulated in one process on CPU.

    python -m bench.numerics                  # N in {2, 3, 8, 64, 96, 512, 1024}; JSON + plot in bench/out/
    python -m bench.numerics --quick          # N in {2, 8, 64}, fewer elements and steps: a smoke run
    python -m bench.numerics --out FILE.json  # elsewhere (the plot goes beside it, FILE.png)

Data: one "bucket" of six gradient-like tensors of very different scales (1e-6 to 1e2, ``TENSORS``), each element
``scale * (signal + noise_r)`` with signal and per-rank noise both Student-t with 3 degrees of freedom (heavy tails,
variance 3; the noise is drawn afresh per rank and per step, the signal is fixed). A LayerNorm-bias-like tensor of
64 elements at 1e-6 sits right after a weight at 1e2 whose size is not a multiple of 128, so that blocks cut at
the bucket's 128-element offsets put both in one block.

Schemes (the averaged gradient against the float64 mean of the same float32 gradients):

- ``torch_bf16``: torch's ``bf16_compress_hook`` (read from ``default_hooks._compress_hook``): ``buffer.to(bf16)``,
  then ``.div_(N)`` in bfloat16 (a second rounding, exact when N is a power of two), then an all-reduce sum in bf16.
- ``bf16``: this project's bf16: ``g * (1/N)`` in float32, rounded once to bf16, all-reduce sum in bf16.
- ``fp16_split``: this project's fp16: ``g * pre`` rounded to fp16 (``pre`` a power of two near 1/sqrt(N),
  ``formats.average_factors``), all-reduce sum in fp16, times ``post`` in float32.
- ``bf16+fp32sum``: ``g * (1/N)`` rounded to bf16, summed in float32 in rank order, rounded once to bf16
  (the all-to-all / sum / all-gather exchange).
- ``two-level ...`` (``hierarchical=True``), nodes of ``RANKS_PER_NODE`` = 8 ranks: ``g * (1/N)`` summed in float32
  over each node's ranks in rank order (NCCL's intra-node reduce-scatter is a ring; in float32 the order changes
  the last bits only), then the node sums exchanged between the N/8 nodes as the flat scheme does between ranks,
  without a second division: bf16 in NCCL's ring order, bf16 with float32 sums, FP8 E4M3 with blocks that follow
  the tensors inside each of the 8 parts of the bucket (``cost_model.two_level_part``). At N <= 8, one node:
  the flat scheme, as the runtime falls back to.
- ``fp8e4m3``, ``fp8e5m2``: block-scaled FP8, blocks of 128 cut per tensor, power-of-two scale per block;
  ``g * (1/N)`` quantized, dequantized and summed in float32 in rank order, the sum requantized (one step, no
  error feedback). ``fp8e4m3 bucket-offset blocks``: the same with blocks cut at 128-element offsets of the flat
  bucket, ignoring tensor boundaries.

All-reduce sums in a 16-bit dtype follow NCCL's ring order: the bucket is cut into N chunks; chunk c starts at
rank c+1 and travels around the ring (c+1, c+2, ..., c), each rank adding its own value to the partial sum it
received and rounding to the wire dtype after every addition (NCCL's ``ring allreduce``: step 0 sends chunk
``rank-1``, ``recvReduceSend`` for the next N-2 steps, the last step ends chunk c at rank c). Modelled: one channel
and one pass over the buffer, each addition exact then rounded once (``(a.float() + b.float()).to(wire)``). Not
modelled: NCCL's split of a chunk over channels and loop iterations (it changes which chunk an element belongs to,
not the order of the additions per element), tree and NVLS algorithms (other orders).

The one-step table is the median over ``--seeds`` data sets (3: whether fp16 overflows depends on the tail's draw);
non-finite results are counted per scheme.

FP8 with error feedback over ``--steps`` steps (seed 0): each rank adds its first-stage residual (what its rounding
left out last step) before quantizing, the reducing rank adds its second-stage residual before requantizing;
reported after each step are the relative L2 error of the running sum of the averaged gradients against the exact
running sum, and its drift (the error's norm in units of one step's mean-gradient norm), beside FP8 without error
feedback over the same gradients. At ``--ef-ns`` world sizes only, default 2, 8 and 64 (the first stage quantizes
N copies of the bucket every step: about 10 s per 100 steps at N = 64 on this 2-core CPU).

The FP8 and float32-sum arithmetic is the kernels' own torch path (``ddp_triton.kernels.torch_wire.quantize_rows``,
vectorised over ranks here); a self-check runs the library's launchers (``quantize_blocks``, ``reduce_blocks``,
``dequantize_blocks``, ``sum_slices``, ``pack``) through a simulated all-to-all at N = 3 for two steps with
residuals and requires the same bits (``self_check`` in the JSON).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a plain script: make `bench` and `ddp_triton` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import OUT_DIR, PLOT_MISSING, environment, format_table, progress, pyplot, write_json  # noqa: E402
from ddp_triton import kernels  # noqa: E402
from ddp_triton.kernels import torch_wire  # noqa: E402
from ddp_triton.kernels.fp8 import BLOCK_ELEMENTS, FORMATS, ROW_BYTES  # noqa: E402
from ddp_triton.formats import average_factors  # noqa: E402
from ddp_triton.runtime.chunks import pieces_within  # noqa: E402
from ddp_triton.machine.cost_model import two_level_part  # noqa: E402


#: (name, elements, scale). 10,138 elements: N = 1024 ranks are 10M float32 values, which the FP8 pipeline
#: quantizes in under a second on this CPU. The first three end on a block boundary (7808 = 61 x 128); head.weight's
#: 2112 = 16.5 blocks, so its last 64 elements share a bucket-offset block with the 64 of ln.bias.
TENSORS: Tuple[Tuple[str, int, float], ...] = (
    ("embed.weight", 3072, 1e-3),
    ("attn.weight", 2560, 1e-2),
    ("mlp.weight", 2176, 1.0),
    ("head.weight", 2112, 1e2),
    ("ln.bias", 64, 1e-6),
    ("ln.weight", 154, 1e-4),
)
QUICK_TENSORS: Tuple[Tuple[str, int, float], ...] = (
    ("embed.weight", 768, 1e-3),
    ("mlp.weight", 512, 1.0),
    ("head.weight", 576, 1e2),  # 4.5 blocks: ln.bias again shares a bucket-offset block with it
    ("ln.bias", 64, 1e-6),
)
NS = (2, 3, 8, 64, 96, 512, 1024)  # powers of two, and two that are not (where torch's div rounds)
QUICK_NS = (2, 8, 64)
EF_NS = (2, 8, 64)
QUICK_EF_NS = (2, 8)
STEPS = 100
SEEDS = 3  # the one-step table is the median over this many data sets: fp16's overflow depends on the tail's draw
TAIL_DF = 3  # Student-t degrees of freedom: heavy tails with a finite variance

SCHEMES = ("torch_bf16", "bf16", "fp16_split", "bf16+fp32sum", "fp8e4m3", "fp8e5m2", "fp8e4m3 bucket-offset blocks",
           "two-level bf16", "two-level bf16+fp32sum", "two-level fp8e4m3")
#: Ranks per node of the two-level schemes (an 8-GPU node); at N <= this they are the flat scheme (one node).
RANKS_PER_NODE = 8


# ---- data ----------------------------------------------------------------------------------------------------------


def student_t(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Student-t with TAIL_DF (=3) degrees of freedom: a normal over sqrt(chi-square_3 / 3), from four normals."""
    z = torch.randn(*shape, generator=gen)
    chi2 = torch.zeros(*shape)
    for _ in range(TAIL_DF):
        chi2.add_(torch.randn(*shape, generator=gen).square_())
    return z.div_(chi2.div_(TAIL_DF).sqrt_())


class Gradients:
    """Per-rank gradients of the bucket ``tensors``: ``scale * (signal + noise)``, float32 (N, n)."""

    def __init__(self, tensors: Sequence[Tuple[str, int, float]], seed: int = 0) -> None:
        self.tensors = tuple(tensors)
        self.sizes = [size for _, size, _ in tensors]
        self.n = sum(self.sizes)
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.scales = torch.cat([torch.full((size,), scale) for _, size, scale in tensors])
        self.signal = student_t((self.n,), gen)

    def step(self, n_ranks: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + n_ranks * 1009 + step + 1)
        noise = student_t((n_ranks, self.n), gen)
        return noise.add_(self.signal).mul_(self.scales)

    def slices(self) -> List[Tuple[str, slice]]:
        out, start = [], 0
        for name, size, _ in self.tensors:
            out.append((name, slice(start, start + size)))
            start += size
        return out


def rel_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def errors(approx: torch.Tensor, exact: torch.Tensor, grads: Gradients) -> Dict[str, float]:
    """Relative L2 error over the whole bucket ("all") and per tensor (inf where a value overflowed), and the
    number of non-finite results ("nonfinite")."""
    out = {"all": rel_l2(approx, exact)}
    for name, sl in grads.slices():
        out[name] = rel_l2(approx[sl], exact[sl])
    out["nonfinite"] = int((~torch.isfinite(approx)).sum())
    return out


# ---- 16-bit schemes: NCCL's ring order ------------------------------------------------------------------------------


def ring_sum(values: torch.Tensor) -> torch.Tensor:
    """NCCL ring all-reduce of ``values`` (N, n) in their dtype: chunk c of N is summed c+1, c+2, ..., c (mod N),
    rounding to the dtype after every addition."""
    n_ranks, n = values.shape
    chunk = -(-n // n_ranks)
    start = (torch.arange(n) // chunk + 1) % n_ranks
    columns = torch.arange(n)
    total = values[start, columns]
    for k in range(1, n_ranks):
        addend = values[(start + k) % n_ranks, columns]
        total = (total.float() + addend.float()).to(values.dtype)
    return total


def torch_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16_compress_hook: buffer.to(bf16).div_(N), all-reduce (sum) in bf16, copy back into the float32 bucket."""
    n_ranks = x.shape[0]
    return ring_sum(x.to(torch.bfloat16).div_(n_ranks)).float()


def ours_16bit(x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """The hook's all-reduce path: pack (x * pre in float32, one rounding), ring sum in the wire dtype, unpack."""
    pre, post = average_factors(x.shape[0], wire)
    total = ring_sum((x * pre).to(wire)).float()
    return total if post == 1.0 else total * post


def float32_sum(x: torch.Tensor, wire: torch.dtype = torch.bfloat16, scale: Optional[float] = None) -> torch.Tensor:
    """The sharded exchange: x / N (or x * ``scale``) rounded to the wire dtype, float32 sum in rank order, one
    rounding."""
    sent = (x * (1.0 / x.shape[0] if scale is None else scale)).to(wire)
    total = sent[0].float()  # from the first rank's value, as the kernel
    for r in range(1, x.shape[0]):
        total = total + sent[r].float()
    return total.to(wire).float()


# ---- block-scaled FP8 -----------------------------------------------------------------------------------------------


def to_rows(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """(..., n) -> (..., rows, 128): each tensor of ``sizes`` cut into its own blocks, its last one zero-padded."""
    parts, start = [], 0
    for size in sizes:
        part = x[..., start:start + size]
        parts.append(F.pad(part, (0, (-size) % BLOCK_ELEMENTS)))
        start += size
    rows = torch.cat(parts, dim=-1)
    return rows.view(*x.shape[:-1], -1, BLOCK_ELEMENTS)


def from_rows(rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    flat = rows.reshape(*rows.shape[:-2], -1)
    parts, start = [], 0
    for size in sizes:
        parts.append(flat[..., start:start + size])
        start += -(-size // BLOCK_ELEMENTS) * BLOCK_ELEMENTS
    return torch.cat(parts, dim=-1)


class Fp8Exchange:
    """Block-scaled FP8 with float32 sums over N simulated ranks, optionally with error feedback at both stages.

    ``sizes``: the tensors' sizes (blocks per tensor), or ``[n]`` for blocks at the bucket's 128-element offsets."""

    def __init__(self, n_ranks: int, sizes: Sequence[int], fmt: torch.dtype, error_feedback: bool,
                 scale: Optional[float] = None) -> None:
        self.n_ranks, self.sizes, self.spec = n_ranks, list(sizes), FORMATS[fmt]
        self.scale = 1.0 / n_ranks if scale is None else scale
        rows = sum(-(-s // BLOCK_ELEMENTS) for s in sizes)
        self.first = torch.zeros(n_ranks, rows, BLOCK_ELEMENTS) if error_feedback else None
        self.second = torch.zeros(rows, BLOCK_ELEMENTS) if error_feedback else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        values = to_rows(x * self.scale if self.scale != 1.0 else x, self.sizes)  # src * scale, then + residual
        if self.first is not None:
            values = values + self.first
        n_ranks, rows = values.shape[:2]
        _, _, sent, finite = torch_wire.quantize_rows(values.view(-1, BLOCK_ELEMENTS), self.spec)
        sent = sent.view(n_ranks, rows, BLOCK_ELEMENTS)
        if self.first is not None:
            self.first = (values - sent).masked_fill(~finite.view(n_ranks, rows, 1), 0.0)
        total = torch.zeros(rows, BLOCK_ELEMENTS)
        for r in range(n_ranks):  # float32, rank order, as reduce_blocks
            total = total + sent[r]
        if self.second is not None:
            total = total + self.second
        _, _, result, finite = torch_wire.quantize_rows(total, self.spec)
        if self.second is not None:
            self.second = (total - result).masked_fill(~finite[:, None], 0.0)
        return from_rows(result, self.sizes)


def fp8_one_step(x: torch.Tensor, sizes: Sequence[int], fmt: torch.dtype) -> torch.Tensor:
    return Fp8Exchange(x.shape[0], sizes, fmt, error_feedback=False)(x)


# ---- two-level: float32 sums inside the node, the format between nodes -----------------------------------------------


def node_sums(x: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """(N, n) -> (N / L, n): each node's sum of ``g * (1/N)`` in float32, its ranks in order."""
    n_ranks = x.shape[0]
    if n_ranks % ranks_per_node:
        raise ValueError(f"N={n_ranks} is not a whole number of nodes of {ranks_per_node} ranks")
    scaled = (x * (1.0 / n_ranks)).view(n_ranks // ranks_per_node, ranks_per_node, -1)
    total = scaled[:, 0].clone()
    for r in range(1, ranks_per_node):
        total += scaled[:, r]
    return total


def two_level_pieces(sizes: Sequence[int], ranks_per_node: int) -> List[int]:
    """The tensors' pieces inside each of the bucket's parts, in order: the FP8 blocks of a two-level exchange."""
    n = sum(sizes)
    part = two_level_part(n, ranks_per_node)
    return [size for j in range(ranks_per_node) for size in pieces_within(sizes, min(j * part, n),
                                                                            min((j + 1) * part, n))]


class TwoLevel:
    """The two-level form of a scheme: at N <= L the flat scheme (one node), else node sums then ``between`` over
    the nodes (already divided by N)."""

    def __init__(self, flat: Any, between: Any, ranks_per_node: int) -> None:
        self.flat, self.between, self.ranks_per_node = flat, between, ranks_per_node

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.ranks_per_node:
            return self.flat(x)
        return self.between(node_sums(x, self.ranks_per_node))


def two_level_schemes(n_ranks: int, sizes: Sequence[int], ranks_per_node: int,
                      error_feedback: bool = False) -> Dict[str, TwoLevel]:
    """The two-level bf16, bf16 + float32 sums and FP8 E4M3 averages of N ranks' (N, n) gradients."""
    nodes = max(1, n_ranks // ranks_per_node)
    pieces = two_level_pieces(sizes, ranks_per_node)
    fp8 = Fp8Exchange(nodes, pieces, torch.float8_e4m3fn, error_feedback, scale=1.0)
    return {
        "two-level bf16": TwoLevel(lambda x: ours_16bit(x, torch.bfloat16),
                                   lambda sums: ring_sum(sums.to(torch.bfloat16)).float(), ranks_per_node),
        "two-level bf16+fp32sum": TwoLevel(float32_sum, lambda sums: float32_sum(sums, scale=1.0), ranks_per_node),
        "two-level fp8e4m3": TwoLevel(Fp8Exchange(n_ranks, sizes, torch.float8_e4m3fn, error_feedback), fp8,
                                      ranks_per_node),
    }


# ---- self-check against the library's launchers ---------------------------------------------------------------------


def _library_fp8(per_rank: torch.Tensor, sizes: Sequence[int], fmt: torch.dtype, first: List[torch.Tensor],
                 second: List[torch.Tensor]) -> torch.Tensor:
    """One step of the real exchange's kernels (blockscale launchers) through a simulated all-to-all/all-gather."""
    n_ranks = per_rank.shape[0]
    layout = kernels.block_layout(list(sizes), n_ranks)
    shard_bytes = layout.rows_per_shard * ROW_BYTES
    sends = []
    for r in range(n_ranks):
        send = torch.empty(layout.n_rows * ROW_BYTES, dtype=torch.uint8)
        kernels.quantize_blocks(per_rank[r].clone(), layout, send, 1.0 / n_ranks, fmt=fmt, residual=first[r])
        sends.append(send)
    shards = []
    for s in range(n_ranks):  # the all-to-all: rank s gets shard s of every rank's rows, in rank order
        recv = torch.cat([sends[r][s * shard_bytes:(s + 1) * shard_bytes] for r in range(n_ranks)])
        shard = torch.empty(shard_bytes, dtype=torch.uint8)
        kernels.reduce_blocks(recv, n_ranks, shard, fmt=fmt, residual=second[s])
        shards.append(shard)
    out = torch.empty(layout.n_elements)
    kernels.dequantize_blocks(torch.cat(shards), layout, out, fmt=fmt)  # the all-gather, then the unpack
    return out


def self_check(grads: Gradients, n_ranks: int = 3, steps: int = 2) -> Dict[str, Any]:
    """The vectorised simulation against the library's launchers: same bits, or the benchmark says it is wrong."""
    fmt = torch.float8_e4m3fn
    layout = kernels.block_layout(grads.sizes, n_ranks)
    first = [torch.zeros(grads.n) for _ in range(n_ranks)]
    second = [torch.zeros(layout.rows_per_shard * BLOCK_ELEMENTS) for _ in range(n_ranks)]
    sim = Fp8Exchange(n_ranks, grads.sizes, fmt, error_feedback=True)
    fp8_same = True
    for step in range(steps):
        x = grads.step(n_ranks, 10_000 + step)
        got = sim(x)
        ref = _library_fp8(x, grads.sizes, fmt, first, second)
        fp8_same &= torch.equal(got.view(torch.int32), ref.view(torch.int32))
        fp8_same &= all(torch.equal(from_rows(sim.first[r], grads.sizes), first[r]) for r in range(n_ranks))
        flat_second = torch.cat(second).view(-1, BLOCK_ELEMENTS)[: sim.second.shape[0]]
        fp8_same &= torch.equal(sim.second, flat_second)
    x = grads.step(n_ranks, 20_000)
    packed = torch.empty(n_ranks * grads.n, dtype=torch.bfloat16)
    for r in range(n_ranks):
        kernels.pack([x[r].clone()], packed[r * grads.n:(r + 1) * grads.n], 1.0 / n_ranks)
    pack_same = torch.equal(packed.view(n_ranks, -1), (x * (1.0 / n_ranks)).to(torch.bfloat16))
    summed = kernels.sum_slices(packed, n_ranks, torch.empty(grads.n, dtype=torch.bfloat16)).float()
    sum_same = torch.equal(summed, float32_sum(x))
    return {"world_size": n_ranks, "fp8_steps": steps, "fp8_with_residuals_bit_exact": bool(fp8_same),
            "pack_bit_exact": bool(pack_same), "sum_slices_bit_exact": bool(sum_same)}


# ---- the runs -------------------------------------------------------------------------------------------------------


def one_step(grads: Gradients, n_ranks: int) -> Dict[str, Dict[str, float]]:
    x = grads.step(n_ranks, 0)
    exact = x.double().mean(dim=0)
    results = {
        "torch_bf16": torch_bf16(x),
        "bf16": ours_16bit(x, torch.bfloat16),
        "fp16_split": ours_16bit(x, torch.float16),
        "bf16+fp32sum": float32_sum(x),
        "fp8e4m3": fp8_one_step(x, grads.sizes, torch.float8_e4m3fn),
        "fp8e5m2": fp8_one_step(x, grads.sizes, torch.float8_e5m2),
        "fp8e4m3 bucket-offset blocks": fp8_one_step(x, [grads.n], torch.float8_e4m3fn),
        **{name: scheme(x) for name, scheme in two_level_schemes(n_ranks, grads.sizes, RANKS_PER_NODE).items()},
    }
    return {scheme: errors(value, exact, grads) for scheme, value in results.items()}


def running_sum(grads: Gradients, n_ranks: int, steps: int) -> Dict[str, List[float]]:
    """After each step, the running sum of averaged gradients (FP8 E4M3, with and without error feedback) against
    the exact running sum: its relative L2 error ("<scheme>"), the same for the smallest tensor ("small <scheme>"),
    and the error's L2 norm in units of one step's exact average gradient norm ("drift <scheme>")."""
    exchanges = {"fp8e4m3+ef": Fp8Exchange(n_ranks, grads.sizes, torch.float8_e4m3fn, error_feedback=True),
                 "fp8e4m3": Fp8Exchange(n_ranks, grads.sizes, torch.float8_e4m3fn, error_feedback=False),
                 "two-level fp8e4m3+ef": two_level_schemes(n_ranks, grads.sizes, RANKS_PER_NODE,
                                                           error_feedback=True)["two-level fp8e4m3"]}
    small = dict(grads.slices())[min(grads.tensors, key=lambda t: t[2])[0]]
    exact = torch.zeros(grads.n, dtype=torch.float64)
    sums = {name: torch.zeros(grads.n, dtype=torch.float64) for name in exchanges}
    curves: Dict[str, List[float]] = {f"{kind}{name}": [] for kind in ("", "small ", "drift ") for name in exchanges}
    step_norms = 0.0
    for step in range(steps):
        x = grads.step(n_ranks, 1 + step)
        mean = x.double().mean(dim=0)
        exact += mean
        step_norms += float(mean.norm())
        for name, exchange in exchanges.items():
            total = sums[name]
            total += exchange(x).double()
            curves[name].append(rel_l2(total, exact))
            curves["small " + name].append(rel_l2(total[small], exact[small]))
            curves["drift " + name].append(float((total - exact).norm()) / (step_norms / (step + 1)))
    return curves


def _sig(value: float, digits: int = 4) -> Any:
    """4 significant digits; a non-finite value as its name ("inf", "nan"): strict JSON has no infinity."""
    if isinstance(value, int):
        return value
    return float(f"{value:.{digits}g}") if math.isfinite(value) else str(value)


def _value(value: Any) -> float:
    return float(value)  # "inf" -> inf


def _over_seeds(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per key, the median over seeds of the errors (upper median: an inf in half the seeds shows); non-finite
    values summed, and in how many seeds any appeared."""
    out: Dict[str, Any] = {}
    for key in results[0]:
        if key == "nonfinite":
            out[key] = sum(r[key] for r in results)
            out["seeds_with_nonfinite"] = sum(1 for r in results if r[key])
        else:
            values = sorted(_value(r[key]) for r in results)
            out[key] = _sig(values[len(values) // 2])
    return out


def plot(data: Dict[str, Any], path: Path) -> Optional[str]:
    """A PNG beside the JSON; None, and a message, without matplotlib."""
    plt = pyplot()
    if plt is None:
        return PLOT_MISSING
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    ns = data["world_sizes"]
    small = min(data["config"]["tensors"], key=lambda t: t[2])
    for axis, key, title in ((left, "all", "whole bucket"), (middle, small[0], f"{small[0]} (scale {small[2]:g})")):
        for scheme in SCHEMES:
            errs = [_value(data["one_step"][str(n)][scheme][key]) for n in ns]
            axis.plot([n for n, e in zip(ns, errs) if math.isfinite(e)], [e for e in errs if math.isfinite(e)],
                      marker="x" if scheme == "torch_bf16" else "o", linestyle="--" if scheme == "torch_bf16" else "-",
                      label=scheme + ("" if all(map(math.isfinite, errs)) else " (inf where missing)"))
        axis.set(xscale="log", yscale="log", xlabel="world size N", ylabel="relative L2 error vs float64",
                 title=f"averaged gradient, one step: {title}")
    left.legend(fontsize=7)
    for n, curves in data["running_sum"].items():
        steps = range(1, len(curves["fp8e4m3+ef"]) + 1)
        right.plot(steps, curves["drift fp8e4m3+ef"], label=f"fp8e4m3 + EF, N={n}")
        right.plot(steps, curves["drift fp8e4m3"], linestyle="--", label=f"fp8e4m3, N={n}")
    right.set(yscale="log", xlabel="step", ylabel="|running sum error| / |one step's mean gradient|",
              title="FP8 E4M3: error of the running sum (drift)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=64)
    plt.close(fig)
    return None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Relative error of the averaged gradient per wire format and world size "
                                            "(simulated in one process, NCCL's ring order for 16-bit sums)")
    p.add_argument("--quick", action="store_true",
                   help="N in {2, 8, 64} (running sum at 2 and 8), a smaller bucket, 10 steps: a smoke run")
    p.add_argument("--ns", default=None, help="comma-separated world sizes (default: 2,3,8,64,96,512,1024)")
    p.add_argument("--ef-ns", default=None, help="world sizes of the running-sum study (default: 2,8,64)")
    p.add_argument("--steps", type=int, default=None, help="steps of the running-sum study (default 100)")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/out/numerics.json; bench/results/ holds the recorded runs); the plot "
                        "beside it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, restored on return)")
    p.add_argument("--seeds", type=int, default=None,
                   help="data sets (seeds) of the one-step table, which reports their median (default 3; quick 1)")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    # One thread by default: these tensors are 10^4-10^7 elements, and on a shared 2-core machine two OpenMP threads
    # made the FP8 steps 10-20x slower (threads waiting on each other), not faster.
    torch.set_num_threads(args.threads)
    try:
        return _run(p, args)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (the smoke test) keeps its own setting


def _run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    started = time.perf_counter()
    grads = Gradients(QUICK_TENSORS if args.quick else TENSORS)
    ns = [int(v) for v in args.ns.split(",")] if args.ns else list(QUICK_NS if args.quick else NS)
    ef_ns = [int(v) for v in args.ef_ns.split(",")] if args.ef_ns else list(QUICK_EF_NS if args.quick else EF_NS)
    steps = args.steps if args.steps is not None else (10 if args.quick else STEPS)
    if args.seeds is None:
        args.seeds = 1 if args.quick else SEEDS
    if any(n < 2 for n in ns + ef_ns) or steps < 1 or args.seeds < 1:
        p.error(f"world sizes must be >= 2, steps and seeds >= 1, got {ns}, {ef_ns}, {steps}, {args.seeds}")

    check = self_check(grads)
    if not all(v for k, v in check.items() if k.endswith("bit_exact")):
        print(f"self-check FAILED: the simulation differs from the library's kernels: {check}", file=sys.stderr)
        return 1

    per_seed: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]] = {}
    for seed in range(args.seeds):
        seed_grads = grads if seed == 0 else Gradients(grads.tensors, seed=seed)
        per_seed[str(seed)] = {}
        for n in ns:
            t0 = time.perf_counter()
            per_seed[str(seed)][str(n)] = {s: {k: _sig(v) for k, v in e.items()}
                                           for s, e in one_step(seed_grads, n).items()}
            progress(f"seed {seed}, N={n}: one step of every scheme in {time.perf_counter() - t0:.1f} s")
    small = min(grads.tensors, key=lambda t: t[2])[0]
    one = {str(n): {s: _over_seeds([per_seed[k][str(n)][s] for k in per_seed]) for s in SCHEMES} for n in ns}
    runs = {}
    for n in ef_ns:
        t0 = time.perf_counter()
        runs[str(n)] = {k: [_sig(v) for v in c] for k, c in running_sum(grads, n, steps).items()}
        progress(f"N={n}: {steps} steps of FP8 with and without error feedback in {time.perf_counter() - t0:.1f} s")

    headers = ["scheme"] + [f"N={n}" for n in ns]
    table_all = format_table(headers, [[s] + [one[str(n)][s]["all"] for n in ns] for s in SCHEMES])
    table_small = format_table(headers, [[s] + [one[str(n)][s][small] for n in ns] for s in SCHEMES])
    tensor_names = [t[0] for t in grads.tensors]
    table_worst = format_table(headers, [[s] + [max((one[str(n)][s][t] for t in tensor_names), key=_value)
                                                for n in ns] for s in SCHEMES])
    table_nonfinite = format_table(headers, [[s] + [f"{one[str(n)][s]['nonfinite']} in "
                                                    f"{one[str(n)][s]['seeds_with_nonfinite']}/{args.seeds}"
                                                    for n in ns] for s in SCHEMES
                                             if any(one[str(n)][s]["nonfinite"] for n in ns)])
    marks = sorted({m for m in (1, 10, steps) if m <= steps})
    ef_rows = []
    for n in ef_ns:
        c = runs[str(n)]
        for name in ("fp8e4m3+ef", "fp8e4m3", "two-level fp8e4m3+ef"):
            ef_rows.append([n, name] + [c[name][m - 1] for m in marks] + [c["small " + name][steps - 1]]
                           + [c["drift " + name][m - 1] for m in marks])
    table_ef = format_table(["N", "scheme"] + [f"rel. error after {m}" for m in marks]
                            + [f"{small} after {steps}"] + [f"drift after {m}" for m in marks], ef_rows)

    elapsed = time.perf_counter() - started
    out = Path(args.out) if args.out else OUT_DIR / "numerics.json"
    data = {
        "env": {**environment(torch.device("cpu")), "threads": torch.get_num_threads()},
        "config": {"quick": args.quick, "tensors": [list(t) for t in grads.tensors], "elements": grads.n,
                   "distribution": f"scale * (signal + noise), both Student-t df={TAIL_DF}; noise per rank and step",
                   "ring": "NCCL ring order, N chunks, chunk c summed from rank c+1, rounding after each addition",
                   "steps": steps, "seeds": args.seeds,
                   "one_step": "median over seeds; nonfinite: summed over seeds; running_sum: seed 0"},
        "world_sizes": ns,
        "schemes": list(SCHEMES),
        "one_step": one,
        "one_step_per_seed": {seed: {n: {s: {k: v for k, v in e.items() if k in ("all", small, "nonfinite")}
                                          for s, e in by_n.items()} for n, by_n in runs_of_seed.items()}
                              for seed, runs_of_seed in per_seed.items()},
        "running_sum": runs,
        "self_check": check,
        "runtime_s": round(elapsed, 1),
    }
    write_json(out, data, allow_nan=False)

    print(f"\nRelative L2 error of the averaged gradient vs float64, whole bucket (one step, median of {args.seeds} "
          f"seed{'s' if args.seeds > 1 else ''}):\n" + table_all)
    print(f"\n... of the smallest tensor, {small} (scale {min(t[2] for t in grads.tensors):g}):\n" + table_small)
    print("\n... of the worst tensor:\n" + table_worst)
    if any(one[str(n)][s]["nonfinite"] for n in ns for s in SCHEMES):
        print(f"\nNon-finite averaged values (of {grads.n} per seed; overflow on the wire), in how many seeds:\n"
              + table_nonfinite)
    print("\nFP8 E4M3, the running sum of averaged gradients vs the exact running sum: relative L2 error, and drift "
          "(the error's norm in units of one step's average gradient norm):\n" + table_ef)
    print(f"\nself-check against the library's kernels at N={check['world_size']}: bit-exact")
    message = None if args.no_plot else plot(data, out.with_suffix(".png"))
    print(f"saved {out}" + ("" if args.no_plot or message else f" and {out.with_suffix('.png')}"))
    if message:
        print(message)
    print(f"runtime {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
