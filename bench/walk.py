"""The walk of one bucket at a step: every call into the project's code, in order, with its module.

    python -m bench.walk                       # the plain bf16 bucket (the default hook)
    python -m bench.walk --wire fp8e4m3+ef

What it records: DDP at world size 1 on gloo (CPU tensors), one Linear layer, so one bucket; after two steps
(DDP rebuilds its buckets after the first, the hook binds its plan at the next), a third step's backward runs under
``sys.setprofile``. gloo completes a collective's future on a thread of its own, started before the profile
function was set, which it does not see; where the work is done by the time the hook attaches its callback, the
callback runs inline and is seen. So it records ten backwards and prints each distinct walk, the most calls
first, with how many backwards took it (every fourth pass the hook also drops plans gone stale). Each Python call whose
code lies in ``ddp_triton/`` or ``kernels/`` is a project call, listed in call order with its depth below the
first. That is the path someone changing the code has to read; docs/architecture.md shows it.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import List, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import ddp_triton  # noqa: E402
from ddp_triton.formats import WireFormat  # noqa: E402
from bench.common import one_rank_gloo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROJECT = (str(ROOT / "ddp_triton") + "/", str(ROOT / "kernels") + "/")


def record_walk(wire: str, width: int = 256, tries: int = 10) -> List[List[Tuple[int, str, str]]]:
    """Each of ``tries`` backwards' walk: (depth, module path relative to the checkout, function) of each project
    call, in order (see the module docstring)."""
    model = torch.nn.parallel.DistributedDataParallel(nn.Linear(width, width))
    ddp_triton.register(model, profile=None, **WireFormat.parse(wire).options())
    x = torch.randn(8, width)
    for _ in range(2):
        model(x).sum().backward()
    return [_one_backward(model(x).sum()) for _ in range(tries)]


def _one_backward(loss: torch.Tensor) -> List[Tuple[int, str, str]]:
    calls: List[Tuple[int, str, str]] = []
    depth = {"value": 0}
    lock = threading.Lock()

    def profiler(frame, event, arg):  # noqa: ARG001 - the signature sys.setprofile calls
        filename = frame.f_code.co_filename
        if not filename.startswith(PROJECT):
            return
        with lock:
            if event == "call":
                calls.append((depth["value"], str(Path(filename).relative_to(ROOT)), frame.f_code.co_qualname))
                depth["value"] += 1
            elif event == "return":
                depth["value"] -= 1

    threading.setprofile(profiler)
    sys.setprofile(profiler)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wire", default="bf16", help="the wire format's name (default bf16; e.g. fp8e4m3+ef)")
    args = parser.parse_args(argv)
    with one_rank_gloo():
        walks = record_walk(args.wire)
    distinct = {}
    for walk in walks:
        distinct.setdefault(tuple(walk), 0)
        distinct[tuple(walk)] += 1
    for walk, count in sorted(distinct.items(), key=lambda item: -len(item[0])):
        modules = sorted({module for _, module, _ in walk})
        print(f"{count} of {len(walks)} backwards:")
        for depth, module, function in walk:
            print(f"{'  ' * depth}{module}: {function}")
        print(f"{len(walk)} project calls in {len(modules)} modules: {', '.join(modules)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
