"""A bounded map that forgets the least recently used entry first, safe to use from several threads.

The plain ``pack``/``unpack`` calls keep two: the work-list plans by tensor layout (``worklist.PLANS``) and the
checked layouts with their launches (``pack.LAYOUTS``). A job uses few layouts (one per call site and bucket), so a
few hundred entries hold every one that repeats.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, Optional, TypeVar

V = TypeVar("V")

#: Entries each cache keeps.
CAPACITY = 256


class LRU(Generic[V]):
    """key -> value, at most ``capacity`` of them; ``get`` and ``put`` make an entry the most recently used."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._entries: "OrderedDict[Hashable, V]" = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Optional[V]:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
