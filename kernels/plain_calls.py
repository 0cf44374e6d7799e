"""Plain calls of a layout seen before: ``pack``/``unpack`` remember each layout they checked, so that a repeat skips
the full checks and the work list.

Checking GPT-2's 148 gradients and building their work list costs about 0.5 ms of host time per plain call, more
than the kernel takes on an H200. A plain call whose tensors passed the checks keeps the :class:`PreparedCall` they
were prepared as, under the call's signature: everything the checks read, read afresh from the tensors at every call
by unbound C methods mapped over the list (no Python frame per tensor):

- of each tensor: number of elements and contiguity; of the list, its length and its one device and dtype;
- of the flat buffer: the same, its device and its number of dimensions;
- the call's settings (the exact scale, as ``float.hex``: -0.0 and 0.0 are equal floats but scale to different
  bits; the kind of call).

A later call with an equal signature runs that prepared call on its own tensors, at the host cost of a prepared call
that needs no comparison: at the last call's addresses, a relaunch; at new ones, the overlap check and a work list.
A tensor changed in place (``set_``, ``resize_``, ``.data =``), another dtype's view of the same memory, or a tensor
freed and replaced shows its current metadata, and is checked in full if any of it differs. Calls with a tensor whose
metadata cannot be read, a null address (empty or meta tensors), mixed devices or dtypes, a
scale that is not a Python float, or tensors not in a list or tuple get no signature and are checked in full.

Entries hold no tensor of a caller's (a prepared call keeps none after it returns). The cache is bounded (the
oldest layout goes first) and safe to use from several threads: a repeat reads it without a lock.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .launch import KernelCall, run_call
from .prepared import PreparedCall

# Layouts a program calls plainly are few (one per call site and shape); keep the newest.
CAPACITY = 64

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
# One C call that groups a list by (device, dtype): cheaper than reading both of every tensor.
_group_by_device_and_dtype = torch._C._group_tensors_by_device_and_dtype

Signature = Tuple[tuple, tuple, tuple]
"""(head, rest, addresses): a layout is found by its head (settings, the flat buffer, the list's length, device and
dtype) and confirmed by its rest (each tensor's size and contiguity); addresses: the flat buffer's, then the
tensors'."""


def signature(settings: tuple, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> Optional[Signature]:
    """The signature of one call, or None to check it in full (see the module docstring)."""
    if type(tensors) not in (list, tuple):
        return None
    try:
        addresses = (_data_ptr(flat), *map(_data_ptr, tensors))
        if 0 in addresses:
            return None
        groups = _group_by_device_and_dtype([tensors], False)
        if len(groups) != 1:
            return None  # mixed devices or dtypes: the full checks name them
        (device_and_dtype,) = groups
        head = (settings, _numel(flat), flat.dtype, _is_contiguous(flat), flat.dim(), flat.device, len(tensors),
                device_and_dtype)
        rest = (tuple(map(_numel, tensors)), tuple(map(_is_contiguous, tensors)))
    except Exception:  # a tensor whose metadata cannot be read: the full checks say what is wrong with it
        return None
    return head, rest, addresses


class PlainCalls:
    """One operation's plain calls by layout: the prepared call of each layout seen, the oldest dropped first.
    ``names`` as :class:`PreparedCall` takes them (pack and unpack check their own overlaps: no disjointness check);
    ``flat_first`` says whether the flat buffer comes before the tensor list among the call's arguments (unpack) or
    after it (pack)."""

    def __init__(self, names: Sequence[str], flat_first: bool, capacity: int = CAPACITY) -> None:
        self._names, self._flat_first, self._capacity = tuple(names), flat_first, capacity
        self._entries: Dict[tuple, Tuple[tuple, PreparedCall]] = {}  # oldest first
        self._lock = threading.Lock()

    def run(self, settings: tuple, args: tuple, build: Callable[..., KernelCall]) -> None:
        """Run the call ``build`` makes for ``args`` (the flat buffer and the tensor list, in the operation's order):
        through the prepared call of its layout where one is kept, else checked in full, and kept."""
        flat, tensors = args if self._flat_first else args[::-1]
        sig = signature(settings, tensors, flat)
        if sig is None:
            run_call(build(*args, checked=True))
            return
        head, rest, addresses = sig
        entry = self._entries.get(head)  # one dict read: atomic, so no lock on the repeat's path
        if entry is not None and entry[0] == rest:
            entry[1].run_at(args, addresses if self._flat_first else (*addresses[1:], addresses[0]))
            return
        prepared = PreparedCall.run_new(build, self._names, args, disjoint=False)
        with self._lock:
            self._entries.pop(head, None)  # a layout of the same head is replaced, and becomes the newest
            self._entries[head] = (rest, prepared)
            if len(self._entries) > self._capacity:
                del self._entries[next(iter(self._entries))]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
