"""Kernel calls kept prepared and run on each call's buffers: for callers whose buffers are new at every step (FSDP).

A prepared call fixed to its tensors (``kernels.<op>.prepare(...).fixed(...)``, a DDP bucket's) holds them; FSDP
allocates a reduce-scatter's input and output anew at every step, and the output becomes the sharded gradient, so a
call fixed to them would be fixed again every step or hold a step's buffers into the next. A prepared call called
with the tensors instead (``call(*tensors)``) is checked once and compiled once per specialisation, and runs on the
tensors each call passes, holding none of them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, List

from .. import kernels

#: Kinds of call one owner keeps (a kind: its name and settings), and calls per kind (one for each shape of its
#: buffers, as after a change of a group's parameters); the least recently used go.
KINDS, SHAPES_PER_KIND = 16, 4


class PreparedCalls:
    """One owner's kernel calls (an FSDP group's, its replica hop's), each prepared at the first call of its kind,
    settings and tensor shapes, and run on every later call's own tensors."""

    def __init__(self) -> None:
        self._calls: "OrderedDict[tuple, List[kernels.PreparedCall]]" = OrderedDict()  # least recently used first
        self.prepared = 0
        """Calls prepared so far: each kind of call once while its settings and shapes stay."""

    def run(self, what: tuple, prepare: Callable[..., kernels.PreparedCall], *tensors: Any) -> None:
        """Run the call ``what`` names (its kind and every value it was prepared with: scale, layout sizes, ranks)
        on ``tensors`` (a tensor, None or a list of tensors each, as the call takes them), prepared by
        ``prepare(*tensors)`` where none is kept for tensors like them."""
        calls = self._calls.get(what)
        if calls is None:
            calls = self._calls[what] = []
            if len(self._calls) > KINDS:
                self._calls.popitem(last=False)
        else:
            self._calls.move_to_end(what)
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

    def later(self, what: tuple, prepare: Callable[..., kernels.PreparedCall], *tensors: Any) -> Callable[[], None]:
        """:meth:`run` of these, as a callable to run later (a stage of an exchange)."""
        return functools.partial(self.run, what, prepare, *tensors)
