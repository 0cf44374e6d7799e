"""What every ``ddp-triton`` command shares: exit codes, the usage error, and argparse's value types.

The value types (``parse_size``, ``csv_list``, ``positive_int``, ...) are public: the benchmarks parse the same
flags with them.
"""

from __future__ import annotations

import argparse
import re
from typing import List

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
    """Bad usage or bad input: reported as ``ddp-triton: error: ...`` with exit code 2."""


class WriteFailed(Exception):
    """An output that passed its checks could not be written (disk full, say): one line, exit 1."""


def parse_size(text: str) -> int:
    """'4096', '64K', '1MiB', '1G' -> bytes (K/M/G/T are powers of 1024, as nccl-tests' -b/-e)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M, 1G)")
    value = float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes >= 1, got {text!r}")
    return int(value)


def int_at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    v = positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def csv_list(text: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items
