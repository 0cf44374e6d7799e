"""Wire formats: what a CommState's (comm_dtype, accumulate_dtype, error_feedback) mean, checked in one place.

- ``bf16``/``fp16``/``fp32``: one all-reduce in that dtype (NCCL sums in it, one rounding per ring hop).
- ``bf16+fp32sum``/``fp16+fp32sum``: the bucket travels in 16 bits, but is summed in float32: an all-to-all gives
  each rank the N copies of its shard, a kernel adds them in float32 and rounds once, an all-gather returns the
  shards. Same bytes as a ring all-reduce; each element is rounded twice whatever N is. Over two ranks it is one
  all-reduce in 16 bits, the same bits (``WireFormat.one_all_reduce``).
- ``fp8e4m3``/``fp8e5m2`` (``+ef`` with error feedback): block-scaled FP8 through the same all-to-all and
  all-gather, summed in float32; with error feedback each rank keeps what its rounding left out and adds it to the
  next step's gradients, at both rounding stages.

Each format also comes two-level (``hierarchical``): the ranks of a node first reduce-scatter the bucket in its own
dtype (the fast links carry it uncompressed, summed in the bucket's dtype), the ranks with the same local index on
every node then exchange their shard in the format (only the node-crossing hop is compressed), and the node
all-gathers the result (``two_level.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..machine.cost_model import parse_format

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4m3",
          torch.float8_e5m2: "fp8e5m2"}


@dataclass(frozen=True)
class WireFormat:
    """How a bucket travels: its dtype on the wire, what the sum is computed in, whether errors are fed back."""

    comm_dtype: torch.dtype
    accumulate_dtype: Optional[torch.dtype]
    """None: the all-reduce's own dtype; torch.float32: summed in float32 after an all-to-all."""
    error_feedback: bool
    hierarchical: bool = False
    """Two-level: reduced inside each node in the bucket's dtype, exchanged in this format between nodes only."""

    @property
    def sharded(self) -> bool:
        """Exchanged as all-to-all + local float32 sum + all-gather rather than one all-reduce."""
        return self.accumulate_dtype is not None and self.comm_dtype != torch.float32

    @property
    def block_scaled(self) -> bool:
        return self.comm_dtype in FP8_DTYPES

    def one_all_reduce(self, n_ranks: int) -> bool:
        """Whether exchanging in this format over ``n_ranks`` is, bit for bit (NaN payloads aside), one all-reduce
        in its 16-bit dtype: 16 bits with float32 sums over two ranks. The float32 sum of two 16-bit values, rounded
        once to 16 bits, is their correctly rounded 16-bit sum (rounding to float32 first cannot change the result
        when float32 holds at least 2p + 1 bits for a p-bit significand: 17 for bf16, 23 for fp16, and float32 has
        24, over both formats' exponent ranges), which is what NCCL's and gloo's sum of two 16-bit values is. So
        the all-to-all and the all-gather can be one all-reduce of the same bytes: one collective fewer."""
        return n_ranks == 2 and self.sharded and not self.block_scaled

    @property
    def name(self) -> str:
        name = _SHORT[self.comm_dtype]
        if self.sharded and not self.block_scaled:
            name += "+fp32sum"
        name += "+ef" if self.error_feedback else ""
        return "two-level " + name if self.hierarchical else name

    def flat(self) -> "WireFormat":
        """The same format exchanged over all ranks at once."""
        return WireFormat(self.comm_dtype, self.accumulate_dtype, self.error_feedback)


def resolve_wire_format(comm_dtype: torch.dtype, accumulate_dtype: Optional[torch.dtype] = None,
                        error_feedback: Optional[bool] = None, hierarchical: bool = False) -> WireFormat:
    """The WireFormat of a CommState's settings, or a ValueError naming the combination that cannot be."""
    known = SIXTEEN_BIT + (torch.float32,) + FP8_DTYPES
    if comm_dtype not in known:
        raise ValueError(f"comm_dtype must be one of torch.bfloat16, torch.float16, torch.float32, "
                         f"torch.float8_e4m3fn, torch.float8_e5m2; got {comm_dtype}")
    if accumulate_dtype not in (None, torch.float32):
        raise ValueError(f"accumulate_dtype must be None (sum in the wire dtype) or torch.float32, got "
                         f"{accumulate_dtype}")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")
    if not isinstance(hierarchical, bool):
        raise ValueError(f"hierarchical must be True or False, got {hierarchical!r}")
    if comm_dtype in FP8_DTYPES:
        # FP8 sums can only be taken in float32: NCCL's own FP8 sum knows nothing of the blocks' scales.
        return WireFormat(comm_dtype, torch.float32, True if error_feedback is None else error_feedback,
                          hierarchical)
    if error_feedback:
        raise ValueError(f"error_feedback applies to FP8 wire formats; {comm_dtype} rounds each value once to "
                         "nearest, with nothing worth feeding back")
    if comm_dtype == torch.float32 and accumulate_dtype is not None:
        accumulate_dtype = None  # float32 on the wire already sums in float32: one all-reduce
    return WireFormat(comm_dtype, accumulate_dtype, False, hierarchical)


_BY_SHORT = {short: dtype for dtype, short in _SHORT.items()}


def wire_format_named(name: str) -> WireFormat:
    """The WireFormat of a format's name (``WireFormat.name``, as profiles and ``autotune --formats`` spell it:
    ``bf16+fp32sum``, ``fp8e4m3+ef``, ``two-level fp8e4m3+ef``); ValueError naming what is wrong."""
    parsed = parse_format(name)
    comm_dtype = _BY_SHORT[parsed.wire]
    accumulate = torch.float32 if parsed.fp32_sum else None
    return resolve_wire_format(comm_dtype, accumulate, parsed.error_feedback if comm_dtype in FP8_DTYPES else None,
                               parsed.two_level)
