"""Changing the emulated links' rate while a job runs: a rank asks, the supervisor reshapes every link and answers.

The supervisor gives every rank ``DDPT_LINK_CONTROL``, a path in the run's log folder. A rank (one is enough)
calls ``request_rate("200mbit")``: it writes ``<path>.request`` holding ``<serial> <rate>`` and waits for
``<path>.done`` to hold the same serial. The supervisor polls the request while it pumps the job's output,
reshapes every link (``Cluster.reshape``: the tbf rate of both ends of each node's link) and writes the answer:
``<serial> ok <rate>`` or ``<serial> error <why>``. A job that changes the rate mid-run sees what a link shared
with another job looks like from inside it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

ENV = "DDPT_LINK_CONTROL"
POLL_S = 0.05


def request_rate(rate: str, timeout_s: float = 60.0) -> None:
    """Ask the supervisor of this bench.cluster job to set every link to ``rate`` (``1gbit``, ``200mbit``); returns
    once it is set. RuntimeError when the job was not started by bench.cluster, or the supervisor refused."""
    path = os.environ.get(ENV)
    if not path:
        raise RuntimeError(f"{ENV} is not set: the link's rate can change only in a job bench.cluster runs")
    request, done = Path(path + ".request"), Path(path + ".done")
    serial = 1 + (int(done.read_text().split()[0]) if done.exists() else 0)
    partial = Path(path + ".request.partial")
    partial.write_text(f"{serial} {rate}\n")
    partial.replace(request)  # the supervisor never reads half a request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = done.read_text().split(maxsplit=2) if done.exists() else []
        if answer and int(answer[0]) == serial:
            if answer[1] != "ok":
                raise RuntimeError(f"bench.cluster could not set the links to {rate}: {' '.join(answer[2:])}")
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"bench.cluster did not set the links to {rate} within {timeout_s:g} s")


class LinkControl:
    """The supervisor's side: ``poll`` reshapes the links when a request is waiting, and says what it did."""

    def __init__(self, path: Path, reshape: Callable[[int], None], parse_rate: Callable[[str], int]) -> None:
        self.path, self.reshape, self.parse_rate = path, reshape, parse_rate

    def poll(self) -> Optional[str]:
        """Serve a waiting request; a line for the log, or None when there was none."""
        request = Path(str(self.path) + ".request")
        try:
            text = request.read_text()
        except FileNotFoundError:
            return None
        request.unlink()
        parts = text.split()
        if len(parts) != 2 or not parts[0].isdigit():
            return f"ignored a malformed link-rate request {text.strip()!r}"
        serial, rate = parts
        try:
            self.reshape(self.parse_rate(rate))
            answer, said = f"{serial} ok {rate}", f"links set to {rate}"
        except Exception as e:  # noqa: BLE001 - told to the job, which raises it
            answer, said = f"{serial} error {e}", f"could not set the links to {rate}: {e}"
        partial = Path(str(self.path) + ".done.partial")
        partial.write_text(answer + "\n")
        partial.replace(Path(str(self.path) + ".done"))
        return said
