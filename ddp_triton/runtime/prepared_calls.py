"""Kernel calls kept prepared and run on each call's buffers: for callers whose buffers are new at every step (FSDP).

A bound launch (``kernels.bind_*``) holds the tensors it was bound to; FSDP allocates a reduce-scatter's input and
output anew at every step, and the output becomes the sharded gradient, so a launch bound to them would be rebound
every step or hold a step's buffers into the next. A prepared call (``kernels.prepare_*``) is checked once and
compiled once per alignment, and runs on the tensors each call passes, holding none of them.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

import torch

from .. import kernels
from ..kernels.lru import LRU

#: Kinds of call one owner keeps (a kind: its name and settings), and calls per kind (one for each shape of its
#: buffers, as after a change of a group's parameters); the least recently used go.
KINDS, SHAPES_PER_KIND = 16, 4


class PreparedCalls:
    """One owner's kernel calls (an FSDP group's, its replica hop's), each prepared at the first call of its kind,
    settings and tensor shapes, and run on every later call's own tensors."""

    def __init__(self) -> None:
        self._calls: LRU[List[kernels.PreparedCall]] = LRU(KINDS)
        self.prepared = 0
        """Calls prepared so far: each kind of call once while its settings and shapes stay."""

    def run(self, what: tuple, prepare: Callable[..., kernels.PreparedCall], *tensors: Optional[torch.Tensor]) -> None:
        """Run the call ``what`` names (its kind and every value it was prepared with: scale, layout sizes, ranks)
        on ``tensors``, prepared by ``prepare(*tensors)`` where none is kept for tensors like them."""
        calls = self._calls.get(what)
        if calls is None:
            calls = []
            self._calls.put(what, calls)
        for i, call in enumerate(calls):
            if call.run_if_like(tensors):  # compares the tensors with the call's examples once
                if i:
                    calls.insert(0, calls.pop(i))
                return
        call = prepare(*tensors)
        calls.insert(0, call)
        del calls[SHAPES_PER_KIND:]
        self.prepared += 1
        call(*tensors)

    def later(self, what: tuple, prepare: Callable[..., kernels.PreparedCall],
              *tensors: Optional[torch.Tensor]) -> Callable[[], None]:
        """:meth:`run` of these, as a callable to run later (a stage of an exchange)."""
        return functools.partial(self.run, what, prepare, *tensors)
