"""The ``ddp-triton`` command (``ddp_triton.cli:main``, or ``python -m ddp_triton.cli``).

- `main`: the parser, the entry point, and the small commands (``topo``, ``profile show``, ``env``).
- `autotune`: ``ddp-triton autotune``: its checks, then the cost model or the measuring workers.
- `outputs`: where autotune's profile goes (cache, ``--out``, ``--nccl-tuner-csv``, stdout), checked first.
- `args`: exit codes, the usage error, argparse's value types (the benchmarks use them too).
"""

from .args import parse_size
from .main import build_parser, main

__all__ = ["build_parser", "main", "parse_size"]
