"""The wire formats: every way a gradient bucket may travel, what each name means, and the one parser of those names.

- ``fp32``/``bf16``/``fp16``: one all-reduce in that dtype (NCCL sums in it, one rounding per ring hop).
- ``bf16+fp32sum``/``fp16+fp32sum``: the bucket travels in 16 bits, but is summed in float32: an all-to-all gives
  each rank the N copies of its shard, a kernel adds them in float32 and rounds once, an all-gather returns the
  shards. Same bytes as a ring all-reduce; each element is rounded twice whatever N is. Over two ranks it is one
  all-reduce in 16 bits, the same bits (``WireFormat.one_all_reduce``).
- ``fp8e4m3``/``fp8e5m2`` (``+ef`` with error feedback): block-scaled FP8 (blocks of ``FP8_BLOCK`` elements, each
  sent with a float32 scale) through the same all-to-all and all-gather, summed in float32; with error feedback each
  rank keeps what its rounding left out (its residuals) and adds it to the next step's gradients.
- ``fp4e2m1`` (``+ef``, also read as ``mxfp4+ef``): the same exchange in block-scaled 4-bit E2M1 (MXFP4's element
  and scale: a power-of-two scale byte per 32 elements, 68 bytes a block of 128, half of FP8's), staged, summed and
  fed back as FP8 is; only where the link is the step's limit (its final loss: bench/RESULTS.md, H22).
- ``two-level <format>`` (``hierarchical=True``): the ranks of a node first reduce-scatter the bucket in its own
  dtype, the ranks with the same local index on every node then exchange their shard in the format (only the
  node-crossing hop is compressed), and the node all-gathers the result (``runtime/two_level.py``).

Each dtype on the wire is declared once, in ``WIRES``: its name, aliases, torch dtype, bytes, block rows and cost
class; everything else here is derived from it. Formats are named as profiles, ``autotune --formats`` and the
telemetry spell them (``WireFormat.name``), or given as ``register``'s options (``WireFormat.from_options``: a torch
dtype and flags, or the format's name as ``comm_dtype``). Both are read here and nowhere else, when a state or a
profile is made, never per step. Importing this module loads neither torch nor Triton (the CLI imports it);
``from_options``, ``comm_dtype`` and ``options`` import torch when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Dict, Optional, Sequence, Tuple

from .dtypes import torch_dtype

@dataclass(frozen=True)
class WireDtype:
    """One dtype a bucket may travel in, declared once: what every part of the package reads of it (the runtime's
    exchanges, the kernels' ``fmt``, the residuals, the cost model, the profile and the docs' tables)."""

    short: str
    """The start of the format's name (``fp8e4m3``)."""
    torch_name: str
    """torch's name of the dtype on the wire, also what the block-scaled passes take as ``fmt``."""
    element_bytes: int
    """Bytes of one element as torch stores it (float4_e2m1fn_x2: one byte holds two)."""
    bits: int
    """The class of the values' width, for the accuracy order: 32, 16, 8 or 4."""
    row_bytes: Optional[int] = None
    """Block-scaled: the bytes one block of ``BLOCK`` elements travels as (codes and scales); None: each element
    travels alone."""
    aliases: Tuple[str, ...] = ()
    """Other spellings of ``short`` that names read as (``mxfp4``)."""
    traffic: str = ""
    """The cost model's class: formats of one class put the same bytes through the same collectives and passes."""

    @property
    def block_scaled(self) -> bool:
        return self.row_bytes is not None


#: Elements per scaled block, for every block-scaled format (``kernels/fp8.py``'s BLOCK_ELEMENTS).
BLOCK = 128
#: Every dtype on the wire, in accuracy order. Block-scaled FP8: a block travels as 128 one-byte codes and a float32
#: scale (132 bytes); E2M1 (``kernels/fp4.py``): 128 four-bit codes, two to a byte, and a power-of-two E8M0 scale byte
#: per 32 elements (68 bytes; chosen in bench/RESULTS.md, H22).
WIRES: Tuple[WireDtype, ...] = (
    WireDtype("fp32", "float32", 4, 32, traffic="fp32"),
    WireDtype("bf16", "bfloat16", 2, 16, traffic="bf16"),
    WireDtype("fp16", "float16", 2, 16, traffic="fp16"),
    WireDtype("fp8e4m3", "float8_e4m3fn", 1, 8, row_bytes=BLOCK + 4, traffic="fp8"),
    WireDtype("fp8e5m2", "float8_e5m2", 1, 8, row_bytes=BLOCK + 4, traffic="fp8"),
    WireDtype("fp4e2m1", "float4_e2m1fn_x2", 1, 4, row_bytes=BLOCK // 2 + BLOCK // 32, aliases=("mxfp4", "e2m1"),
              traffic="fp4e2m1"),
)
_BY_SHORT: Dict[str, WireDtype] = {w.short: w for w in WIRES}
_ALIASES: Dict[str, str] = {alias: w.short for w in WIRES for alias in w.aliases}

#: The dtype on the wire of each format, by the short name that starts the format's name.
WIRE_DTYPES: Dict[str, str] = {w.short: w.torch_name for w in WIRES}
SIXTEEN_BIT: Tuple[str, ...] = tuple(w.short for w in WIRES if w.bits == 16)
FP8: Tuple[str, ...] = tuple(w.short for w in WIRES if w.bits == 8)
#: Every block-scaled wire (FP8 and E2M1): summed in float32, error feedback allowed.
BLOCK_SCALED: Tuple[str, ...] = tuple(w.short for w in WIRES if w.block_scaled)
#: Elements per FP8 block (``kernels/fp8.py``'s BLOCK_ELEMENTS) and the bytes a block travels as: 128 one-byte values
#: and a float32 scale.
FP8_BLOCK = BLOCK
FP8_BLOCK_BYTES = _BY_SHORT["fp8e4m3"].row_bytes
#: What starts a two-level format's name (``two-level fp8e4m3+ef``); ``two-level-`` is read too.
TWO_LEVEL = "two-level "
#: Every flat format's name, in accuracy order (each also comes two-level, ``two-level <name>``).
FLAT_NAMES: Tuple[str, ...] = ("fp32", "bf16+fp32sum", "bf16", "fp16+fp32sum", "fp16", "fp8e4m3+ef", "fp8e5m2+ef",
                               "fp8e4m3", "fp8e5m2", "fp4e2m1+ef", "fp4e2m1")
#: The traffic classes the cost model prices by their names (``traffic_of``), each standing for the format named
#: beside it, whose properties it is priced by: formats that put the same bytes through the same collectives share
#: one (``fp16+fp32sum`` travels as ``bf16+fp32sum``, both FP8 formats with or without ``+ef`` as ``fp8``). A format
#: of its own class, as ``fp4e2m1``, is priced by its own name.
TRAFFIC_FORMATS: Dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16+fp32sum": "bf16+fp32sum",
                                   "fp8": "fp8e4m3"}
TRAFFIC: Tuple[str, ...] = tuple(TRAFFIC_FORMATS)
_EF_WIRES = ", ".join(BLOCK_SCALED)


@dataclass(frozen=True)
class WireFormat:
    """How a bucket travels: the dtype on the wire, whether the sum is float32 (all-to-all, float32 sum, all-gather),
    whether a block-scaled format's rounding errors are fed back, and whether only the hop between nodes carries the
    format."""

    wire: str
    """The short name of the dtype on the wire: ``fp32``, ``bf16``, ``fp16``, ``fp8e4m3``, ``fp8e5m2`` or
    ``fp4e2m1`` (``WIRES``)."""
    fp32_sum: bool = False
    """Summed in float32 after an all-to-all; always for the block-scaled formats, never for fp32 (one all-reduce
    sums in float32)."""
    error_feedback: bool = False
    """Block-scaled only: each rank keeps the residuals its rounding left out and adds them to the next step's
    gradients."""
    two_level: bool = False
    """Reduced inside each node in the bucket's dtype, exchanged in this format between nodes only."""

    def __post_init__(self) -> None:
        if self.wire not in WIRE_DTYPES:
            raise ValueError(f"unknown wire dtype {self.wire!r}; known: {', '.join(WIRE_DTYPES)}")
        for flag in ("fp32_sum", "error_feedback", "two_level"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"wire format {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.wire in BLOCK_SCALED and not self.fp32_sum:
            raise ValueError(f"{self.wire}: block-scaled sums (FP8 sums) are always float32 (NCCL's sum knows "
                             "nothing of the scales)")
        if self.wire == "fp32" and self.fp32_sum:
            raise ValueError("fp32 sums in float32 already: one all-reduce, no +fp32sum")
        if self.error_feedback and self.wire not in BLOCK_SCALED:
            raise ValueError(f"{self.wire}: error feedback (+ef) is for the block-scaled formats only ({_EF_WIRES})")

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
    def dtype(self) -> WireDtype:
        """The declaration of the dtype on the wire (``WIRES``)."""
        return _BY_SHORT[self.wire]

    @property
    def block_scaled(self) -> bool:
        """Block-scaled (FP8, E2M1): blocks of ``block_size`` elements, each a row of ``row_bytes`` with its scales."""
        return self.dtype.block_scaled

    @property
    def block_size(self) -> Optional[int]:
        """Elements per scaled block (``BLOCK``), or None: each element travels alone."""
        return BLOCK if self.block_scaled else None

    @property
    def row_bytes(self) -> Optional[int]:
        """Bytes of one block's row on the wire (132 for FP8, 68 for E2M1: ``kernels.row_bytes(fmt)``), or None."""
        return self.dtype.row_bytes

    @property
    def bytes_per_element(self) -> float:
        """Bytes on the wire per gradient element, scales included (1.03125 for FP8, 0.53125 for E2M1)."""
        row = self.dtype.row_bytes
        return row / BLOCK if row is not None else float(self.dtype.element_bytes)

    @property
    def sharded(self) -> bool:
        """Exchanged as all-to-all + local float32 sum + all-gather rather than one all-reduce."""
        return self.fp32_sum

    @property
    def traffic(self) -> str:
        """The cost model's class of this format (``TRAFFIC_FORMATS``, or a class of its own): what travels alike."""
        if self.fp32_sum and not self.block_scaled:
            return "bf16+fp32sum"
        return self.dtype.traffic

    @property
    def rank(self) -> Tuple[int, int, int, int]:
        """Sort key, most accurate and simplest first; the one place this order is written.

        fp32, then the 16-bit formats by dtype (bf16 before fp16, which overflows where bf16 does not:
        bench.numerics), each with float32 sums before without; then FP8 with error feedback before without (what it
        owes comes back next step), each e4m3 before e5m2 (one more mantissa bit); then 4-bit E2M1, with error
        feedback before without (its final loss is within 0.7% of fp32's where FP8 E4M3's is within 0.16%:
        bench/RESULTS.md, H22); every format flat before ``two-level`` (one hop, one group): the order of
        ``FLAT_NAMES``.
        """
        width = (32, 16, 8, 4).index(self.dtype.bits)
        same_width = [w.short for w in WIRES if w.bits == self.dtype.bits]
        if not self.block_scaled:
            key = (width, same_width.index(self.wire), 0 if self.fp32_sum or self.wire == "fp32" else 1)
        else:
            key = (width, 0 if self.error_feedback else 1, same_width.index(self.wire))
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

    def one_all_gather(self, n_ranks: int) -> bool:
        """Whether exchanging in this format over ``n_ranks`` is one all-gather of every rank's whole rows and a
        float32 sum of them in rank order: the block-scaled formats over two ranks. Each rank then sends the one
        peer's copy of its rows, the bytes of the all-to-all and the all-gather together, in one collective and
        with no second rounding (no requantized sum); over more ranks it would send N/2 times the bytes."""
        return n_ranks == 2 and self.block_scaled

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
        """The torch dtype on the wire, which the block-scaled passes also take as their ``fmt`` (imports torch at
        the first read). E2M1: ``torch.float4_e2m1fn_x2`` where this torch has it (2.8 on), else its name, as
        ``kernels.FP4_E2M1`` is."""
        import torch

        return getattr(torch, self.wire_dtype, self.wire_dtype)

    @cached_property
    def accumulate_dtype(self) -> Any:
        """``torch.float32`` when summed in float32 after an all-to-all, else None (the all-reduce's own dtype)."""
        return torch_dtype("float32") if self.fp32_sum else None

    def options(self) -> Dict[str, Any]:
        """The ``register``/``CommState`` options that name this format (``from_options``'s inverse), leaving out
        those at their defaults."""
        import torch

        # A dtype this torch lacks (float4_e2m1fn_x2 before 2.8) is named by the format's own name instead.
        dtype = self.comm_dtype if isinstance(self.comm_dtype, torch.dtype) else self.flat().name
        opts: Dict[str, Any] = {"comm_dtype": dtype}
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
        """The format of a name (``bf16``, ``bf16+fp32sum``, ``fp8e4m3+ef``, ``fp4e2m1+ef``, ``two-level
        fp8e4m3+ef``; a wire's alias for its short name, ``mxfp4+ef``); ValueError naming the name and what is wrong.
        Block-scaled sums are always float32 (``fp8e4m3`` needs no ``+fp32sum``)."""
        if not isinstance(name, str):
            raise ValueError(f"a wire format name is a string, got {type(name).__name__}")
        text = name.strip()
        two_level = text.startswith((TWO_LEVEL, "two-level-"))
        parts = (text[len(TWO_LEVEL):] if two_level else text).split("+")
        wire, extras = _ALIASES.get(parts[0], parts[0]), parts[1:]
        if wire not in WIRE_DTYPES or len(set(extras)) != len(extras) or not set(extras) <= {"fp32sum", "ef"}:
            raise ValueError(f"unknown wire format {name!r}; known: {', '.join(FLAT_NAMES)}, each also "
                             f"'{TWO_LEVEL}<name>'")
        if "ef" in extras and wire not in BLOCK_SCALED:
            raise ValueError(f"wire format {name!r}: error feedback (+ef) is for the block-scaled formats only "
                             f"({_EF_WIRES})")
        if "fp32sum" in extras and wire not in SIXTEEN_BIT:
            raise ValueError(f"wire format {name!r}: +fp32sum is for bf16 and fp16 (fp32 sums in float32 already, "
                             "the block-scaled formats always do)")
        return cls(wire, fp32_sum="fp32sum" in extras or wire in BLOCK_SCALED, error_feedback="ef" in extras,
                   two_level=two_level)

    @classmethod
    def from_options(cls, comm_dtype: Any, accumulate_dtype: Any = None, error_feedback: Optional[bool] = None,
                     hierarchical: bool = False) -> "WireFormat":
        """The format of ``register``'s options, or a ValueError naming the one that cannot be.

        ``comm_dtype`` is a torch dtype or any format's name (``"fp4e2m1+ef"``, ``"bf16+fp32sum"``, as ``parse``
        reads it), which then says its sums and error feedback itself: ``accumulate_dtype`` and ``error_feedback``
        may only agree with it, and ``hierarchical=True`` makes it two-level. From a dtype: the block-scaled formats
        sum in float32 whatever ``accumulate_dtype`` says, with error feedback unless ``error_feedback`` is False;
        float32 on the wire sums in float32 already (``accumulate_dtype=torch.float32`` changes nothing)."""
        import torch

        if accumulate_dtype not in (None, torch.float32):
            raise ValueError(f"accumulate_dtype must be None (sum in the wire dtype) or torch.float32, got "
                             f"{accumulate_dtype}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if not isinstance(hierarchical, bool):
            raise ValueError(f"hierarchical must be True or False, got {hierarchical!r}")
        if isinstance(comm_dtype, str):
            return cls._from_name(comm_dtype, accumulate_dtype, error_feedback, hierarchical)
        by_dtype = {getattr(torch, w.torch_name): w.short for w in WIRES if hasattr(torch, w.torch_name)}
        wire = by_dtype.get(comm_dtype) if isinstance(comm_dtype, torch.dtype) else None
        if wire is None:
            raise ValueError(f"comm_dtype must be one of {', '.join(f'torch.{w.torch_name}' for w in WIRES)}, or a "
                             f"wire format's name ({', '.join(FLAT_NAMES)}); got {comm_dtype}")
        if wire in BLOCK_SCALED:
            return cls(wire, True, error_feedback is not False, hierarchical)
        if error_feedback:
            raise ValueError(f"error_feedback applies to FP8 and E2M1 wire formats; {comm_dtype} rounds each value "
                             "once to nearest, with nothing worth feeding back")
        return cls(wire, wire != "fp32" and accumulate_dtype is not None, False, hierarchical)

    @classmethod
    def _from_name(cls, name: str, accumulate_dtype: Any, error_feedback: Optional[bool],
                   hierarchical: bool) -> "WireFormat":
        """``from_options`` for a ``comm_dtype`` that names the format: the other options may only agree."""
        try:
            fmt = cls.parse(name)
        except ValueError as exc:
            raise ValueError(f"comm_dtype: {exc}") from None
        if accumulate_dtype is not None and not (fmt.fp32_sum or fmt.wire == "fp32"):
            raise ValueError(f"comm_dtype={name!r} sums in {fmt.wire_dtype}, accumulate_dtype says float32: name "
                             f"the format '{fmt.wire}+fp32sum', or leave accumulate_dtype None")
        if error_feedback is not None and error_feedback != fmt.error_feedback:
            raise ValueError(f"comm_dtype={name!r} says error feedback is {'on' if fmt.error_feedback else 'off'}, "
                             f"error_feedback={error_feedback}: leave error_feedback None (the name says it)")
        return replace(fmt, two_level=True) if hierarchical else fmt


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
    """The cost model's class of a flat format's name (``WireFormat.traffic``), or of a class's own name (``fp8``);
    ValueError naming an unknown or two-level name (a two-level bucket is priced by its stages)."""
    if name in TRAFFIC_FORMATS:
        return name
    fmt = WireFormat.parse(name)
    if fmt.two_level:
        raise ValueError(f"wire format {name!r}: a two-level format has no single traffic class; price its stages "
                         "(the cost model's two_level_time_us)")
    return fmt.traffic


def traffic_format(name: str) -> WireFormat:
    """The flat format the cost model prices a class or a format's name by (``TRAFFIC_FORMATS``: ``fp8`` is
    ``fp8e4m3``; ``fp16+fp32sum`` travels, and is priced, as ``bf16+fp32sum``); ValueError as ``traffic_of``."""
    return WireFormat.parse(TRAFFIC_FORMATS.get(traffic_of(name), traffic_of(name)))


def preference_key(name: str) -> Tuple[int, int, int, int]:
    """``WireFormat.rank`` of a format's name: most accurate and simplest first."""
    return WireFormat.parse(name).rank


def sorted_by_preference(names: Sequence[str]) -> list:
    """``names`` in ``preference_key``'s order (most accurate and simplest first; equal keys by name)."""
    return sorted(names, key=lambda f: (preference_key(f), f))
