"""Which wire format each bucket size travels in: the format ``format_rule`` picks from the formats a user allows,
and the two substitutions the tuner makes on its own.

Accuracy is the user's choice (``autotune --formats``), with one exception: a bf16 ring sums in bf16 and rounds
at every hop, so its error grows with the ranks it crosses, while bf16 with float32 sums sends the same bytes and
rounds twice whatever the world size. Where ``ring_error`` (a seeded simulation of both sums) puts plain bf16 more
than ``ERROR_RATIO_LIMIT`` times above bf16 with float32 sums, the latter takes plain bf16's place among the
allowed formats, and the profile says why. A two-level bf16 is judged at its cross hop's size, the node count.
And a two-level format where the runtime runs it flat (one node, or one rank per node) is its flat format, named so.

Sizes here are a bucket's gradient bytes (float32 gradients: what DDP's ``bucket_cap_mb`` counts), not the bytes
on the wire: the hook looks a bucket's format up by its size before it knows how it travels.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...formats import WireFormat, canonical_name
from .. import cost_model as cm
from .format_rule import SWITCH_TOLERANCE, FormatDecision, decide_format
from .rows import FormatChoice, FormatRange, FormatRow, size_ranges
from .schema import format_bytes

#: Plain bf16 gives way to bf16 with float32 sums where its modelled error is more than this many times larger.
ERROR_RATIO_LIMIT = 2.0
#: What ``autotune --formats`` admits by default: no FP8 (its accuracy is the user's call).
DEFAULT_FORMATS: Tuple[str, ...] = ("fp32", "bf16", "bf16+fp32sum")
#: Bucket sizes (gradient bytes) the format choice is evaluated at by default: 256 KiB to 1 GiB, powers of two.
DEFAULT_BUCKET_SIZES: Tuple[int, ...] = tuple(1 << k for k in range(18, 31))

_SIM_ELEMENTS = 4096
_TAIL_DF = 3


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: integer rounding of the bits (finite values)."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _student_t(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    z = rng.standard_normal(shape)
    chi2 = (rng.standard_normal((_TAIL_DF,) + shape) ** 2).sum(axis=0) / _TAIL_DF
    return z / np.sqrt(chi2)


def ring_error(world_size: int, fp32_sum: bool, seed: int = 0) -> float:
    """Modelled relative L2 error of the bf16 average over ``world_size`` ranks: a ring summing in bf16 (rounding
    after every addition), or (``fp32_sum``) bf16 values summed in float32 and rounded once.

    Gradients as ``bench.numerics`` draws them (a fixed Student-t signal plus per-rank Student-t noise, 4096
    elements, seeded): the simulation gives 0.30% / 0.18% at 8 ranks, 0.82% / 0.16% at 64, 16% / 0.16% at 512.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    rng = np.random.default_rng(seed)
    signal = _student_t(rng, (_SIM_ELEMENTS,))
    grads = (_student_t(rng, (world_size, _SIM_ELEMENTS)) + signal).astype(np.float32)
    exact = grads.astype(np.float64).mean(axis=0)
    sent = _to_bf16(grads * np.float32(1.0 / world_size))
    total = sent[0].copy()  # from the first rank's value, in rank order
    for r in range(1, world_size):
        total = total + sent[r] if fp32_sum else _to_bf16(total + sent[r])
    result = _to_bf16(total) if fp32_sum else total
    return float(np.linalg.norm(result - exact) / np.linalg.norm(exact))


def runs_flat(world_size: int, nodes: int) -> bool:
    """Does a two-level exchange run flat on ``world_size`` ranks over ``nodes`` nodes (as the runtime's node groups
    decide: one node, or one rank per node)?"""
    return nodes <= 1 or nodes >= world_size


def admitted_formats(allowed: Sequence[str], world_size: int, nodes: int) -> Tuple[List[str], Dict[str, str]]:
    """The formats the tuner chooses among, and for each that stands in for another, why: each name canonical
    (ValueError on an unknown one); a two-level format that runs flat here (``runs_flat``) as its flat format; and
    plain bf16 (flat, or two-level across ``nodes``) replaced by bf16 with float32 sums where ``ring_error`` puts it
    more than ``ERROR_RATIO_LIMIT`` times worse."""
    if not allowed:
        raise ValueError("no wire formats allowed: name at least one")
    names: List[str] = []
    for name in allowed:
        canonical = canonical_name(name)
        if canonical not in names:
            names.append(canonical)
    flat = runs_flat(world_size, nodes)
    shape = f"one node of {world_size} ranks" if nodes <= 1 else f"one rank on each of {nodes} nodes"
    reasons: Dict[str, List[str]] = {}
    out: List[str] = []
    for name in names:
        fmt = WireFormat.parse(name)
        why: List[str] = []
        if fmt.two_level and flat:
            fmt = fmt.flat()
            why.append(f"in place of {name}: on {shape} a two-level exchange runs flat, as {fmt.name}")
            name = fmt.name
        if fmt.wire == "bf16" and not fmt.fp32_sum:
            ranks = nodes if fmt.two_level else world_size
            plain, summed = ring_error(ranks, False), ring_error(ranks, True)
            if plain > ERROR_RATIO_LIMIT * summed:
                replacement = WireFormat("bf16", fp32_sum=True, two_level=fmt.two_level).name
                why.append(f"in place of {name}: a bf16 ring over {ranks} ranks is modelled at {plain:.2%} relative "
                           f"error against {summed:.2%} with float32 sums (more than {ERROR_RATIO_LIMIT:g}x; the "
                           "same bytes on the wire)")
                name = replacement
        if name not in out:
            out.append(name)
        for text in why:
            if text not in reasons.setdefault(name, []):
                reasons[name].append(text)
    return out, {name: "; ".join(texts) for name, texts in reasons.items()}


def choose_formats(rows: Sequence[FormatRow], tolerance: float = SWITCH_TOLERANCE,
                   replaced: Optional[Mapping[str, str]] = None) -> List[FormatRange]:
    """Contiguous ranges of the format ``format_rule.decide_format`` picks per size, from the smallest size up, each
    size's baseline the previous size's choice (a format is kept over neighbouring sizes unless another beats it
    beyond the noise); a size between two evaluated ones follows the nearer in log scale, as ``build_table`` does
    for algorithms. Each range's reason names the times it was chosen on, and ``replaced[format]`` why a format
    stands where another was allowed."""
    by_size: Dict[int, Dict[str, FormatRow]] = {}
    for r in rows:
        by_size.setdefault(r.nbytes, {})[r.format] = r
    if not by_size:
        raise ValueError("no format timings to choose from")
    sizes = sorted(by_size)
    decisions: List[FormatDecision] = []
    for size in sizes:
        incumbent = decisions[-1].format if decisions else None
        decisions.append(decide_format({f: row.stats for f, row in by_size[size].items()}, incumbent, tolerance))
    ranges: List[FormatRange] = []
    for lo, hi, fmt, evaluated in size_ranges(sizes, [d.format for d in decisions]):
        ends = (evaluated[0], evaluated[-1]) if len(evaluated) > 1 else (evaluated[0],)
        reason = "; ".join(f"{format_bytes(sizes[i])}: {decisions[i].reason}" for i in ends)
        if fmt in (replaced or {}):
            reason += f"; {replaced[fmt]}"  # type: ignore[index]
        ranges.append(FormatRange(lo, hi, fmt, reason))
    return ranges


def format_choice(source: str, allowed: Sequence[str], rows: Sequence[FormatRow], replaced: Mapping[str, str],
                  host: str) -> FormatChoice:
    """The profile's ``formats``: the ranges chosen from ``rows`` (timed or modelled in the admitted formats)."""
    admitted = list(dict.fromkeys(r.format for r in rows))  # in the rows' order
    return FormatChoice(source=source, allowed=[canonical_name(f) for f in allowed], admitted=admitted,
                        table=choose_formats(rows, replaced=replaced), rows=list(rows), host=host,
                        notes=[f"{name} {why}" for name, why in replaced.items()])


def model_format_choice(fabric: cm.Fabric, allowed: Sequence[str], sizes: Sequence[int] = DEFAULT_BUCKET_SIZES,
                        host: cm.HostCost = cm.GPU_HOST_COST) -> FormatChoice:
    """The cost model's choice among ``allowed`` on ``fabric`` (after the accuracy rule), per bucket size (gradient
    bytes, float32), from each format's wire and host time."""
    admitted, replaced = admitted_formats(allowed, fabric.world_size, fabric.nodes)
    rows = []
    for size in sizes:
        for name in admitted:
            t = cm.bucket_time_us(fabric, max(1, size // 4), name, host)
            rows.append(FormatRow(size, name, t, t))
    return format_choice("model", allowed, rows, replaced, host.source)
