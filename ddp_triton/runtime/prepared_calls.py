"""Kernel calls kept prepared and run on each call's buffers: for callers whose buffers are new at every step (FSDP).

A bound launch (``kernels.bind_*``) holds the tensors it was bound to; FSDP allocates a reduce-scatter's input and
output anew at every step, and the output becomes the sharded gradient, so a launch bound to them would be rebound
every step or hold a step's buffers into the next. A prepared call (``kernels.prepare_*``) is checked once and
compiled once per alignment, and runs on the tensors each call passes, holding none of them.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .. import kernels
from ..kernels.lru import LRU

#: Prepared calls one owner keeps: a few kinds of call, each for the shapes of its buffers (new shapes, say after a
#: change of a group's parameters, prepare anew; the least recently used go).
CAPACITY = 16


class PreparedCalls:
    """One owner's kernel calls (an FSDP group's, its replica hop's), each prepared at the first call of its kind,
    settings and tensor shapes, and run on every later call's own tensors."""

    def __init__(self) -> None:
        self._calls: LRU[kernels.PreparedCall] = LRU(CAPACITY)
        self.prepared = 0
        """Calls prepared so far: each kind of call once while its settings and shapes stay."""

    def run(self, what: tuple, prepare: Callable[..., kernels.PreparedCall], *tensors: Optional[torch.Tensor]) -> None:
        """Run the call ``what`` names (its kind and every value it was prepared with: scale, layout sizes, ranks)
        on ``tensors``, prepared by ``prepare(*tensors)`` where none is kept for tensors like them."""
        key = (what, kernels.PreparedCall.like(tensors))
        call = self._calls.get(key)
        if call is None:
            call = prepare(*tensors)
            self._calls.put(key, call)
            self.prepared += 1
        call(*tensors)

    def later(self, what: tuple, prepare: Callable[..., kernels.PreparedCall],
              *tensors: Optional[torch.Tensor]) -> Callable[[], None]:
        """:meth:`run` of these, as a callable to run later (a stage of an exchange)."""
        return functools.partial(self.run, what, prepare, *tensors)
