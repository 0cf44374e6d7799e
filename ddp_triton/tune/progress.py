"""A progress bar for long measurements: one line on stderr, rank 0 only."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (rank 0 only); on a non-terminal, a line every tenth of the way."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.width = width
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1
        self._t0 = time.monotonic()

    def step(self, label: str = "") -> None:
        if not self.enabled:
            return
        self.done += 1
        frac = self.done / self.total
        fill = int(frac * self.width)
        bar = f"[{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + bar.ljust(self.width + 40))
            if self.done == self.total:
                sys.stderr.write(f"  {time.monotonic() - self._t0:.1f} s\n")
        elif int(frac * 10) != self._last_tenth:
            self._last_tenth = int(frac * 10)
            sys.stderr.write(bar + "\n")
        sys.stderr.flush()
