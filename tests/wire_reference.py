"""Reference numerics of the wire formats, written from their definitions and kept apart from the code under test.

Block-scaled FP8: each tensor cut into blocks of 128 elements (its last one short); a block's scale is the smallest
power of two 2^e (e >= -126) with absmax / 2^e <= the format's largest finite value, found by a search in float64;
the codes are ``tensor.to(torch.float8_*)`` of value / 2^e. Sums are float32, in rank order. Over more than two
ranks the sum is quantized again (its own error feedback: the second residual); over two it is the result (one
all-gather of the whole rows, one rounding), from the first rank's value.

Block-scaled E2M1 (4-bit): the same blocks, a power-of-two scale per group of 32 found by a search, each value the
nearest E2M1 magnitude by distance in float64 (``fp4_block``).
"""

import math
from typing import List, Sequence, Tuple

import torch

MAX_FINITE = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
BLOCK = 128


def is_fp4(fmt) -> bool:
    """Whether ``fmt`` names block-scaled E2M1 (``torch.float4_e2m1fn_x2``, or its name where torch lacks it)."""
    return str(fmt).removeprefix("torch.") == "float4_e2m1fn_x2"


def quantize_dequantize(values: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """float32 values of one tensor -> what block-scaled FP8 (or E2M1, ``fp4_quantize_dequantize``) gives back,
    block by block (a non-finite block: NaN)."""
    if is_fp4(fmt):
        return fp4_quantize_dequantize(values)
    out = torch.empty_like(values)
    flat, result = values.reshape(-1), out.view(-1)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start:start + BLOCK]
        if not torch.isfinite(block).all():
            result[start:start + BLOCK] = float("nan")
            continue
        absmax = block.double().abs().max().item()
        e = -126
        while absmax / 2.0**e > MAX_FINITE[fmt]:
            e += 1
        result[start:start + BLOCK] = (block / 2.0**e).to(fmt).float() * 2.0**e
    return out


def fp8_average(per_rank: Sequence[Sequence[torch.Tensor]], fmt: torch.dtype, first: List[List[torch.Tensor]] = None,
                second: List[torch.Tensor] = None, scale: float = None) -> List[torch.Tensor]:
    """The average of each tensor over ranks as FP8 with float32 sums: quantize each rank's ``g / N (+ its first
    residual)``, sum the dequantized values in rank order, add the second residual, quantize again; over two ranks
    the float32 sum of the two dequantized values (the first rank's plus the second's) is the average, not quantized
    again, and the second residuals stay as they are. With residual lists given (per rank, per tensor; per tensor),
    they are updated in place, as error feedback does, each kept in bfloat16 as the runtime keeps it (``kept``).
    ``scale``: what g is multiplied by instead of 1 / N (1.0 for values already divided)."""
    n = len(per_rank)
    scale = 1.0 / n if scale is None else scale
    averaged = []
    for i in range(len(per_rank[0])):
        sents = []
        for r in range(n):
            value = per_rank[r][i].float() * scale if scale != 1.0 else per_rank[r][i].float()
            if first is not None:
                value = value + first[r][i]
            sent = quantize_dequantize(value, fmt)
            if first is not None:
                first[r][i] = kept(_left_over(value, sent))
            sents.append(sent)
        if n == 2:  # one rounding: the sum of what the two ranks sent, in float32
            averaged.append(sents[0] + sents[1])
            continue
        total = torch.zeros_like(per_rank[0][i], dtype=torch.float32)
        for sent in sents:
            total = total + sent
        if second is not None:
            total = total + second[i]
        result = quantize_dequantize(total, fmt)
        if second is not None:
            second[i] = kept(_left_over(total, result))
        averaged.append(result)
    return averaged


def kept(residual: torch.Tensor) -> torch.Tensor:
    """A float32 residual as the runtime keeps it between steps: rounded once to bfloat16 (to nearest even)."""
    return residual.to(torch.bfloat16).float()


def error_feedback(values: torch.Tensor, fmt) -> Tuple[torch.Tensor, torch.Tensor]:
    """(what one tensor's float32 ``values`` are sent as, what error feedback keeps: values - sent in float32, zero
    in a block sent as NaN), block by block in ``fmt`` (FP8 or E2M1)."""
    sent = quantize_dequantize(values, fmt)
    return sent, _left_over(values, sent)


def _left_over(value: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """value - sent, block by block; zero for a block sent as NaN (a non-finite block resets its residual)."""
    left = value - sent
    flat, sent_flat = left.view(-1), sent.reshape(-1)
    for start in range(0, flat.numel(), BLOCK):
        if torch.isnan(sent_flat[start:start + BLOCK]).any():
            flat[start:start + BLOCK] = 0.0
    return left


def float32_sum_average(per_rank: Sequence[Sequence[torch.Tensor]], wire: torch.dtype,
                        scale: float = None) -> List[torch.Tensor]:
    """The average with 16 bits on the wire and float32 sums: round g / N (or g * ``scale``) to the wire dtype, sum
    in float32 in rank order from the first rank's value, round the sum once to the wire dtype."""
    n = len(per_rank)
    scale = 1.0 / n if scale is None else scale
    out = []
    for i in range(len(per_rank[0])):
        total = (per_rank[0][i].float() * scale).to(wire).float()
        for r in range(1, n):
            total = total + (per_rank[r][i].float() * scale).to(wire).float()
        out.append(total.to(wire).float())
    return out


def two_level_average(per_rank: Sequence[torch.Tensor], sizes: Sequence[int], local_size: int, fmt: torch.dtype,
                      float32_sums: bool, first: List[torch.Tensor] = None,
                      second: torch.Tensor = None, nodes: Sequence[Sequence[int]] = None) -> torch.Tensor:
    """The two-level average of one bucket (``per_rank``: each rank's flat float32 bucket, ranks node by node,
    ``local_size`` per node; ``sizes``: its tensors' element counts in bucket order), from the definition:

    each rank's bucket times 1 / N, summed over its node in float32 in rank order; the node's sum cut into
    ``local_size`` parts of whole 128-element blocks (ceil(blocks / local_size) each); each part averaged over the
    nodes in the wire format with the part's tensor pieces as the tensors: FP8 block-scaled with float32 sums (error
    feedback with ``first``, per node a bucket-length tensor, and ``second``, bucket-length, updated in place), 16
    bits with float32 sums, or (``float32_sums`` False) summed in the wire dtype in node order. ``nodes``: each
    node's ranks (default: ``local_size`` consecutive ranks each); ``first`` follows that order of nodes.
    """
    n_ranks, n = len(per_rank), per_rank[0].numel()
    members = nodes if nodes is not None else [range(k * local_size, (k + 1) * local_size)
                                               for k in range(n_ranks // local_size)]
    nodes = len(members)
    node_sums = []
    for ranks in members:
        total = torch.zeros(n, dtype=torch.float32)
        for r in sorted(ranks):
            total = total + per_rank[r].float() * (1.0 / n_ranks)
        node_sums.append(total)
    part = max(1, -(-(-(-n // BLOCK)) // local_size)) * BLOCK
    out = torch.empty(n, dtype=torch.float32)
    for j in range(local_size):
        start, end = min(j * part, n), min((j + 1) * part, n)
        pieces, offset = [], 0
        for size in sizes:
            low, high = max(start, offset), min(end, offset + size)
            if high > low:
                pieces.append(slice(low, high))
            offset += size
        values = [[node_sums[k][p] for p in pieces] for k in range(nodes)]
        if fmt in MAX_FINITE or is_fp4(fmt):
            firsts = [[first[k][p].clone() for p in pieces] for k in range(nodes)] if first is not None else None
            seconds = [second[p].clone() for p in pieces] if second is not None else None
            averaged = fp8_average(values, fmt, firsts, seconds, scale=1.0)
            for i, p in enumerate(pieces):
                if first is not None:
                    for k in range(nodes):
                        first[k][p] = firsts[k][i]
                    second[p] = seconds[i]
        elif float32_sums:
            averaged = float32_sum_average(values, fmt, scale=1.0)
        else:
            averaged = []
            for i in range(len(pieces)):
                total = torch.zeros_like(values[0][i], dtype=fmt)
                for k in range(nodes):
                    total = (total.float() + values[k][i].to(fmt).float()).to(fmt)
                averaged.append(total.float())
        for p, value in zip(pieces, averaged):
            out[p] = value
    return out


# ---- block-scaled E2M1 (4-bit), from its definition ------------------------------------------------------------------

#: E2M1's magnitudes by code 0-7; codes 8-15 are their negatives (sign bit 8).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GROUP = 32


def e2m1_code(q: float) -> int:
    """The E2M1 code of a float64 ``q`` with |q| <= 6: the nearest magnitude, a tie to the even code; the sign bit
    is the value's own (-0.0 is code 8)."""
    distances = [abs(abs(q) - m) for m in E2M1_VALUES]
    best = min(distances)
    candidates = [code for code, d in enumerate(distances) if d == best]
    code = candidates[0] if len(candidates) == 1 else next(c for c in candidates if c % 2 == 0)
    return code | (8 if math.copysign(1.0, q) < 0 else 0)


def fp4_block(values: Sequence[float]) -> Tuple[List[int], List[int], List[float]]:
    """(codes, scale bytes, dequantized as float64) of one block of up to 128 float32 values, zero past its end:
    per group of 32, the smallest 2^e (e in [-126, 126]) with absmax / 2^e <= 6, found by a search in float64, sent
    as the byte e + 127; a block with a non-finite value is sent as codes 0 and every scale byte 0xFF (NaN)."""
    block = [float(v) for v in values] + [0.0] * (BLOCK - len(values))
    if not all(math.isfinite(v) for v in block):
        return [0] * BLOCK, [0xFF] * (BLOCK // FP4_GROUP), [math.nan] * BLOCK
    codes, scales, dequantized = [], [], []
    for g in range(0, BLOCK, FP4_GROUP):
        group = block[g:g + FP4_GROUP]
        absmax = max(abs(v) for v in group)
        e = -126
        while absmax / 2.0**e > 6.0 and e < 126:
            e += 1
        scales.append(e + 127)
        for v in group:
            code = e2m1_code(v / 2.0**e)
            codes.append(code)
            dequantized.append(math.copysign(E2M1_VALUES[code & 7], -1.0 if code & 8 else 1.0) * 2.0**e)
    return codes, scales, dequantized


def fp4_rows(values: torch.Tensor, sizes: Sequence[int]) -> Tuple[List[bytes], List[float]]:
    """Each block's row as bytes (codes two to a byte, element 2i in the low nibble, then the scale bytes) and the
    dequantized values of the tensors (float64, inf where 6 * 2^126 overflows float32), blocks cut per tensor."""
    rows, dequantized, start = [], [], 0
    flat = values.reshape(-1).tolist()
    for n in sizes:
        for offset in range(0, n, BLOCK):
            part = flat[start + offset:start + min(n, offset + BLOCK)]
            codes, scales, deq = fp4_block(part)
            rows.append(bytes(codes[i] | (codes[i + 1] << 4) for i in range(0, BLOCK, 2)) + bytes(scales))
            dequantized += [float(torch.tensor(d, dtype=torch.float64).float()) for d in deq[:len(part)]]
        start += n
    return rows, dequantized


def fp4_quantize_dequantize(values: torch.Tensor) -> torch.Tensor:
    """float32 values of one tensor -> what block-scaled E2M1 gives back (``fp4_block``'s rule, on whole tensors at
    once for the distributed tests): blocks of 128 (the last one short, as if zero-padded), per group of 32 the
    smallest 2^e (e in [-126, 126]) with absmax / 2^e <= 6 by a search in float64, each value the nearest E2M1
    magnitude by distance in float64, ties to the even code, the sign kept; a non-finite block comes back NaN."""
    flat = values.reshape(-1).double()
    n = flat.numel()
    padded = torch.zeros(-(-n // BLOCK) * BLOCK, dtype=torch.float64)
    padded[:n] = flat
    groups = padded.view(-1, FP4_GROUP)
    absmax = groups.abs().amax(dim=1)
    e = torch.full_like(absmax, -126.0)
    while True:
        grow = (absmax / torch.exp2(e) > 6.0) & (e < 126)
        if not grow.any():
            break
        e = e + grow.double()
    q = groups / torch.exp2(e)[:, None]
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    distance = (q.abs()[..., None] - magnitudes).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    even = torch.arange(len(E2M1_VALUES)) % 2 == 0
    code = (nearest.int() * 2 + (nearest & even).int()).argmax(dim=-1)  # among the nearest, the even code
    out = torch.copysign(magnitudes[code], q) * torch.exp2(e)[:, None]
    finite = torch.isfinite(padded.view(-1, BLOCK)).all(dim=1)
    out = out.view(-1, BLOCK).masked_fill(~finite[:, None], math.nan)
    return out.reshape(-1)[:n].float().view_as(values)
