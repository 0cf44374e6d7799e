"""Layouts that plain ``pack``/``unpack`` calls have already checked, so that a repeat call skips the checks.

Checking GPT-2's 148 gradients costs about 0.7 ms of host time per call, more than the kernel takes on an H200.
A call whose tensors passed the checks is remembered under its signature, and a later call with an equal
signature goes straight to the launch prepared for it. The signature is everything the checks and the launch read:

- of each tensor: address, number of elements, dtype, contiguity and device;
- of the flat buffer: the same and its number of dimensions;
- the exact scale (as ``float.hex``: -0.0 and 0.0 are equal floats but scale to different bits) and the call's
  kind (pack, unpack, unpack with stats).

It is read afresh from the tensors at every call, so a tensor changed in place (``set_``, ``resize_``,
``as_strided_``, ``.data =``), another dtype's view of the same memory, or a tensor freed and replaced shows its
current metadata and is checked again if any of it differs. Layout needs no field of its own: tensors that are not
strided have no data pointer (sparse and mkldnn tensors raise when asked, nested jagged ones give 0), and calls with
a tensor that cannot be read, a null address (empty or meta tensors), a scale that is not a Python float, or tensors
not in a list or tuple get no signature: they are checked in full every time.

Entries hold no tensors, only what the launch needs (the plan, the compiled kernel's launcher, a stats scratch
buffer of their own). The cache is an :class:`~.lru.LRU`: bounded, safe to use from several threads.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .lru import CAPACITY, LRU

# Unbound methods raise TypeError for anything that is not a tensor; map() calls them without a Python frame per
# tensor, which is most of what a signature of 148 tensors costs.
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
_dim = torch.Tensor.dim
_dtype = attrgetter("dtype")
_device = attrgetter("device")

Signature = Tuple[tuple, tuple]
"""(head, rest): the cache finds an entry by its head (kind, scale, addresses) and confirms it by the rest."""


def signature(kind: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: Any) -> Optional[Signature]:
    """The signature of one call, or None when the call is to be checked in full (see the module docstring)."""
    if type(scale) is not float or type(tensors) not in (list, tuple):
        return None
    try:
        flat_ptr = _data_ptr(flat)
        ptrs = tuple(map(_data_ptr, tensors))
        if not flat_ptr or not all(ptrs):
            return None
        rest = (_numel(flat), flat.dtype, _is_contiguous(flat), _dim(flat), flat.device,
                tuple(map(_numel, tensors)), tuple(map(_dtype, tensors)), tuple(map(_is_contiguous, tensors)),
                tuple(map(_device, tensors)))
    except Exception:  # a tensor whose metadata cannot be read: the full checks say what is wrong with it
        return None
    return (kind, scale.hex(), flat_ptr, ptrs), rest


class LayoutCache:
    """signature -> the launch prepared for it, in an :class:`~.lru.LRU` by the signature's head, confirmed by its
    rest (an entry whose tensors' metadata changed is not returned)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._entries: LRU[Tuple[tuple, Callable]] = LRU(capacity)

    def get(self, sig: Signature) -> Optional[Callable]:
        """The launch stored under ``sig``, or None when there is none or its tensors' metadata differ."""
        head, rest = sig
        entry = self._entries.get(head)
        if entry is None or entry[0] != rest:
            return None
        return entry[1]

    def put(self, sig: Signature, launch: Callable) -> None:
        """Remember ``launch`` for ``sig``, replacing any entry with the same head."""
        head, rest = sig
        self._entries.put(head, (rest, launch))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
