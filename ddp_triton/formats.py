"""The wire formats: every way a gradient bucket may travel, what each name means, and the one parser of those names.

- ``fp32``/``bf16``/``fp16``: one all-reduce in that dtype (NCCL sums in it, one rounding per ring hop).
- ``bf16+fp32sum``/``fp16+fp32sum``: the bucket travels in 16 bits, but is summed in float32: an all-to-all gives
  each rank the N copies of its shard, a kernel adds them in float32 and rounds once, an all-gather returns the
  shards. Same bytes as a ring all-reduce; each element is rounded twice whatever N is. Over two ranks it is one
  all-reduce in 16 bits, the same bits (``WireFormat.one_all_reduce``).
- ``fp8e4m3``/``fp8e5m2`` (``+ef`` with error feedback): block-scaled FP8 (blocks of ``FP8_BLOCK`` elements, each
  sent with a float32 scale) through the same all-to-all and all-gather, summed in float32; with error feedback each
  rank keeps what its rounding left out (its residuals) and adds it to the next step's gradients.
- ``two-level <format>`` (``hierarchical=True``): the ranks of a node first reduce-scatter the bucket in its own
  dtype, the ranks with the same local index on every node then exchange their shard in the format (only the
  node-crossing hop is compressed), and the node all-gathers the result (``runtime/two_level.py``).

Formats are named as profiles, ``autotune --formats`` and the telemetry spell them (``WireFormat.name``), or given
as ``register``'s options (``WireFormat.from_options``). Both are read here and nowhere else, when a state or a
profile is made, never per step. Importing this module loads neither torch nor Triton (the CLI imports it);
``from_options``, ``comm_dtype`` and ``options`` import torch when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Dict, Optional, Sequence, Tuple

from .dtypes import DTYPE_SIZES, torch_dtype

#: The dtype on the wire of each format, by the short name that starts the format's name.
WIRE_DTYPES: Dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                               "fp8e4m3": "float8_e4m3fn", "fp8e5m2": "float8_e5m2"}
SIXTEEN_BIT: Tuple[str, ...] = ("bf16", "fp16")
FP8: Tuple[str, ...] = ("fp8e4m3", "fp8e5m2")
#: Elements per FP8 block (``kernels/fp8.py``'s BLOCK_ELEMENTS) and the bytes a block travels as: 128 one-byte values
#: and a float32 scale.
FP8_BLOCK = 128
FP8_BLOCK_BYTES = FP8_BLOCK + 4
#: What starts a two-level format's name (``two-level fp8e4m3+ef``); ``two-level-`` is read too.
TWO_LEVEL = "two-level "
#: Every flat format's name, in accuracy order (each also comes two-level, ``two-level <name>``).
FLAT_NAMES: Tuple[str, ...] = ("fp32", "bf16+fp32sum", "bf16", "fp16+fp32sum", "fp16", "fp8e4m3+ef", "fp8e5m2+ef",
                               "fp8e4m3", "fp8e5m2")
#: The traffic classes the cost model prices: formats that put the same bytes through the same collectives share one
#: (``fp16+fp32sum`` travels as ``bf16+fp32sum``, both FP8 formats with or without ``+ef`` as ``fp8``).
TRAFFIC: Tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16+fp32sum", "fp8")


@dataclass(frozen=True)
class WireFormat:
    """How a bucket travels: the dtype on the wire, whether the sum is float32 (all-to-all, float32 sum, all-gather),
    whether FP8's rounding errors are fed back, and whether only the hop between nodes carries the format."""

    wire: str
    """The short name of the dtype on the wire: ``fp32``, ``bf16``, ``fp16``, ``fp8e4m3`` or ``fp8e5m2``."""
    fp32_sum: bool = False
    """Summed in float32 after an all-to-all; always for FP8, never for fp32 (one all-reduce sums in float32)."""
    error_feedback: bool = False
    """FP8 only: each rank keeps the residuals its rounding left out and adds them to the next step's gradients."""
    two_level: bool = False
    """Reduced inside each node in the bucket's dtype, exchanged in this format between nodes only."""

    def __post_init__(self) -> None:
        if self.wire not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {self.wire!r}; known: {', '.join(WIRE_DTYPES)}")
        for flag in ("fp32_sum", "error_feedback", "two_level"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"wire format {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.wire in FP8 and not self.fp32_sum:
            raise ValueError(f"{self.wire}: FP8 sums are always float32 (NCCL's FP8 sum knows nothing of the scales)")
        if self.wire == "fp32" and self.fp32_sum:
            raise ValueError("fp32 sums in float32 already: one all-reduce, no +fp32sum")
        if self.error_feedback and self.wire not in FP8:
            raise ValueError(f"{self.wire}: error feedback (+ef) is for the FP8 formats only")

    # ---- what the format is ------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The format's name, as profiles, ``autotune --formats`` and the telemetry spell it."""
        name = self.wire + ("+fp32sum" if self.fp32_sum and self.wire in SIXTEEN_BIT else "")
        name += "+ef" if self.error_feedback else ""
        return TWO_LEVEL + name if self.two_level else name

    def __str__(self) -> str:
        return self.name

    @property
    def wire_dtype(self) -> str:
        """The dtype on the wire, as torch names it (``"bfloat16"``)."""
        return WIRE_DTYPES[self.wire]

    @property
    def sum_dtype(self) -> str:
        """The dtype the ranks' values are summed in (``"float32"``, or the wire dtype for one all-reduce)."""
        return "float32" if self.fp32_sum else self.wire_dtype

    @property
    def block_scaled(self) -> bool:
        """Block-scaled FP8: blocks of ``block_size`` elements, each with a float32 scale."""
        return self.wire in FP8

    @property
    def block_size(self) -> Optional[int]:
        """Elements per scaled block (``FP8_BLOCK``), or None: each element travels alone."""
        return FP8_BLOCK if self.block_scaled else None

    @property
    def bytes_per_element(self) -> float:
        """Bytes on the wire per gradient element, FP8's scales included (1.03125 for FP8)."""
        return FP8_BLOCK_BYTES / FP8_BLOCK if self.block_scaled else float(DTYPE_SIZES[self.wire_dtype])

    @property
    def sharded(self) -> bool:
        """Exchanged as all-to-all + local float32 sum + all-gather rather than one all-reduce."""
        return self.fp32_sum

    @property
    def traffic(self) -> str:
        """The ``TRAFFIC`` class that travels as this format does (what the cost model prices)."""
        if self.block_scaled:
            return "fp8"
        return "bf16+fp32sum" if self.fp32_sum else self.wire

    @property
    def rank(self) -> Tuple[int, int, int, int]:
        """Sort key, most accurate and simplest first; the one place this order is written.

        fp32, then the 16-bit formats by dtype (bf16 before fp16, which overflows where bf16 does not:
        bench.numerics), each with float32 sums before without; then FP8 with error feedback before without (what it
        owes comes back next step), each e4m3 before e5m2 (one more mantissa bit); every format flat before
        ``two-level`` (one hop, one group): the order of ``FLAT_NAMES``.
        """
        if self.wire == "fp32":
            key = (0, 0, 0)
        elif self.wire in SIXTEEN_BIT:
            key = (1, SIXTEEN_BIT.index(self.wire), 0 if self.fp32_sum else 1)
        else:
            key = (2, 0 if self.error_feedback else 1, FP8.index(self.wire))
        return key + (int(self.two_level),)

    def flat(self) -> "WireFormat":
        """The same format exchanged over all ranks at once."""
        return replace(self, two_level=False)

    def one_all_reduce(self, n_ranks: int) -> bool:
        """Whether exchanging in this format over ``n_ranks`` is, bit for bit (NaN payloads aside), one all-reduce
        in its 16-bit dtype: 16 bits with float32 sums over two ranks. The float32 sum of two 16-bit values, rounded
        once to 16 bits, is their correctly rounded 16-bit sum (rounding to float32 first cannot change the result
        when float32 holds at least 2p + 1 bits for a p-bit significand: 17 for bf16, 23 for fp16, and float32 has
        24, over both formats' exponent ranges), which is what NCCL's and gloo's sum of two 16-bit values is. So
        the all-to-all and the all-gather can be one all-reduce of the same bytes: one collective fewer."""
        return n_ranks == 2 and self.sharded and not self.block_scaled

    def chunks_keep_bits(self, ranks_per_node: int, nodes: int, node_reduce_scatter: bool = True) -> bool:
        """Whether every sum of this format's exchange gives an element the same bits wherever it lies in the
        buffer, so that a bucket cut into chunks is bit-identical to the whole one. An all-reduce of three or more
        ranks adds them in an order that depends on the element's place (gloo's ring; NCCL's algorithms); a sum of
        two does not, nor a reduce-scatter (each slot summed by its owner), nor the sharded formats' float32 sums in
        rank order. ``ranks_per_node`` 1 and ``nodes`` the world size: a flat exchange; ``node_reduce_scatter``: a
        two-level node's sum is a reduce-scatter (else an all-reduce)."""
        in_node = ranks_per_node <= 2 or node_reduce_scatter
        between = nodes <= 2 or (self.sharded and not self.one_all_reduce(nodes))
        return in_node and between

    # ---- the torch side: read once, when a bucket or an FSDP module binds -------------------------------------------

    @cached_property
    def comm_dtype(self) -> Any:
        """The torch dtype on the wire (imports torch at the first read)."""
        return torch_dtype(self.wire_dtype)

    @cached_property
    def accumulate_dtype(self) -> Any:
        """``torch.float32`` when summed in float32 after an all-to-all, else None (the all-reduce's own dtype)."""
        return torch_dtype("float32") if self.fp32_sum else None

    def options(self) -> Dict[str, Any]:
        """The ``register``/``CommState`` options that name this format (``from_options``'s inverse), leaving out
        those at their defaults."""
        opts: Dict[str, Any] = {"comm_dtype": self.comm_dtype}
        if self.block_scaled:
            opts["error_feedback"] = self.error_feedback
        elif self.fp32_sum:
            opts["accumulate_dtype"] = self.accumulate_dtype
        if self.two_level:
            opts["hierarchical"] = True
        return opts

    # ---- reading a format -------------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, name: str) -> "WireFormat":
        """The format of a name (``bf16``, ``bf16+fp32sum``, ``fp8e4m3+ef``, ``two-level fp8e4m3+ef``); ValueError
        naming the name and what is wrong. FP8 sums are always float32 (``fp8e4m3`` needs no ``+fp32sum``)."""
        if not isinstance(name, str):
            raise ValueError(f"a wire format name is a string, got {type(name).__name__}")
        text = name.strip()
        two_level = text.startswith((TWO_LEVEL, "two-level-"))
        parts = (text[len(TWO_LEVEL):] if two_level else text).split("+")
        wire, extras = parts[0], parts[1:]
        if wire not in WIRE_DTYPES or len(set(extras)) != len(extras) or not set(extras) <= {"fp32sum", "ef"}:
            raise ValueError(f"unknown wire format {name!r}; known: {', '.join(FLAT_NAMES)}, each also "
                             f"'{TWO_LEVEL}<name>'")
        if "ef" in extras and wire not in FP8:
            raise ValueError(f"wire format {name!r}: error feedback (+ef) is for the FP8 formats only")
        if "fp32sum" in extras and wire not in SIXTEEN_BIT:
            raise ValueError(f"wire format {name!r}: +fp32sum is for bf16 and fp16 (fp32 sums in float32 already, "
                             "FP8 always does)")
        return cls(wire, fp32_sum="fp32sum" in extras or wire in FP8, error_feedback="ef" in extras,
                   two_level=two_level)

    @classmethod
    def from_options(cls, comm_dtype: Any, accumulate_dtype: Any = None, error_feedback: Optional[bool] = None,
                     hierarchical: bool = False) -> "WireFormat":
        """The format of ``register``'s options (torch dtypes), or a ValueError naming the one that cannot be.

        FP8 sums in float32 whatever ``accumulate_dtype`` says, with error feedback unless ``error_feedback`` is
        False; float32 on the wire sums in float32 already (``accumulate_dtype=torch.float32`` changes nothing)."""
        import torch

        by_dtype = {getattr(torch, dtype): short for short, dtype in WIRE_DTYPES.items()}
        wire = by_dtype.get(comm_dtype) if isinstance(comm_dtype, torch.dtype) else None
        if wire is None:
            raise ValueError(f"comm_dtype must be one of torch.bfloat16, torch.float16, torch.float32, "
                             f"torch.float8_e4m3fn, torch.float8_e5m2; got {comm_dtype}")
        if accumulate_dtype not in (None, torch.float32):
            raise ValueError(f"accumulate_dtype must be None (sum in the wire dtype) or torch.float32, got "
                             f"{accumulate_dtype}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if not isinstance(hierarchical, bool):
            raise ValueError(f"hierarchical must be True or False, got {hierarchical!r}")
        if wire in FP8:
            return cls(wire, True, error_feedback is not False, hierarchical)
        if error_feedback:
            raise ValueError(f"error_feedback applies to FP8 wire formats; {comm_dtype} rounds each value once to "
                             "nearest, with nothing worth feeding back")
        return cls(wire, wire != "fp32" and accumulate_dtype is not None, False, hierarchical)


def average_factors(n_ranks: int, comm_dtype: Any, divide_by: Optional[float] = None) -> Tuple[float, float]:
    """(pre, post): the factors applied before the one rounding to ``comm_dtype`` and after the sum, together a
    division by ``divide_by`` (default: the average over ``n_ranks``). The one place the division is split, for
    DDP's buckets, FSDP's reduce-scatter and the per-parameter path alike.

    bfloat16 and float32 have float32's exponent range: all of it goes before the sum, in float32 before the single
    rounding, and nothing can overflow in the sum. float16 tops out at 65504 and loses precision below 6e-5:
    dividing by the whole world size first would push small gradients into subnormals, not dividing would let a sum
    over many ranks overflow. So float16 splits it, as a power of two near 1/sqrt(N) before: the sum grows at most
    about sqrt(N) times and gradients shrink only about sqrt(N) times before the wire (32x each at N = 1024), and a
    power of two scales exactly, so at a power-of-two world size both factors are exact and the result is what
    ``fp16_compress_hook`` gives (0.25 stays 0.25).
    """
    divide_by = float(n_ranks) if divide_by is None else divide_by
    if divide_by == 1.0:  # a plain sum
        return 1.0, 1.0
    if str(comm_dtype) == "torch.float16":
        pre = 2.0 ** -round(math.log2(n_ranks) / 2)
        return pre, 1.0 / (divide_by * pre)
    return 1.0 / divide_by, 1.0


def canonical_name(name: str) -> str:
    """The one spelling of a format's name (``"two-level-bf16"`` -> ``"two-level bf16"``); ValueError if unknown."""
    return WireFormat.parse(name).name


def traffic_of(name: str) -> str:
    """The ``TRAFFIC`` class of a flat format's name, or of a traffic class's own name (``fp8``); ValueError naming
    an unknown or two-level name (a two-level bucket is priced by its stages)."""
    if name in TRAFFIC:
        return name
    fmt = WireFormat.parse(name)
    if fmt.two_level:
        raise ValueError(f"wire format {name!r}: a two-level format has no single traffic class; price its stages "
                         "(the cost model's two_level_time_us)")
    return fmt.traffic


def preference_key(name: str) -> Tuple[int, int, int, int]:
    """``WireFormat.rank`` of a format's name: most accurate and simplest first."""
    return WireFormat.parse(name).rank


def sorted_by_preference(names: Sequence[str]) -> list:
    """``names`` in ``preference_key``'s order (most accurate and simplest first; equal keys by name)."""
    return sorted(names, key=lambda f: (preference_key(f), f))
