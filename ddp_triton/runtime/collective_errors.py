"""A failed collective, told alike on every path: which collective of what failed, and that a peer is gone.

When a rank dies (or its host, or the network to it), the collectives its peers are in fail: gloo with a read or
write error ("Connection reset by peer", "Connection closed by peer"), NCCL with a remote error or an abort, either
with a timeout where the peer hangs instead. Every place that waits on one of our collectives (the bucket's
all-reduce, the exchange queue's stages, FSDP's reduce-scatter) translates its error here into a
``CollectiveError``, so that every wire format fails with one message: the collective and what it carried ("all_gather
of bucket 3 (fp8e4m3+ef wire)"), that the connection to a peer was lost, and the backend's own words. NCCL's futures
complete when the work is queued on the GPU and never carry its failure: there a lost peer shows as the watchdog of
torch's NCCL process group ending the process, after NCCL's remote error or the group's timeout, and this message
only where issuing a collective raises (docs/troubleshooting.md says what a user sees and which settings speed it).

A hook's result must fail as torch's own futures do: ``Future.set_exception`` from Python stores the exception as the
future's value (raised only when Python reads it), and DDP's reducer, in C++, reads that value as the bucket's tensor
("Unable to cast <the error> to Tensor"). ``HookResult`` completes DDP's future through ``Future.then`` instead,
whose callback raising is an error of the future itself, which DDP re-raises from the backward.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

_TIMED_OUT = ("timed out", "timeout")
_LOST = ("peer", "connection", "socket", "broken pipe", "read error", "write error", "closed", "reset", "remote",
         "abort")


class CollectiveError(RuntimeError):
    """A collective failed on this rank: its message names the collective and says whether a peer is gone."""


def collective_error(collective: str, subject: str, cause: BaseException) -> CollectiveError:
    """The error of ``collective`` (a phase name: "all_to_all", "cross_all_gather", ...) of ``subject`` ("bucket 3
    (fp8e4m3+ef wire)") that failed with ``cause``; ``cause`` itself where it already is one."""
    if isinstance(cause, CollectiveError):
        return cause
    said = str(cause).strip() or type(cause).__name__
    lowered = said.lower()
    where = f"ddp_triton: {_spelled(collective)} of {subject}"
    if any(word in lowered for word in _TIMED_OUT):
        what = (f"{where} timed out: a peer is gone or stuck (its process died or hangs, or its host or the network "
                "to it failed)")
    elif any(word in lowered for word in _LOST):
        what = (f"{where} failed: the connection to a peer was lost, so a peer is gone (its process died, or its "
                "host or the network to it failed)")
    else:
        what = f"{where} failed: a peer may be gone, or the backend failed on this rank"
    return CollectiveError(f"{what}. Training stops on this rank, as on the others; restart the job (from a "
                           f"checkpoint). The backend said: {said}")


def _spelled(collective: str) -> str:
    """A phase name as the message says it: the cross group's collectives of a two-level exchange run between
    nodes."""
    if collective.startswith("cross_"):
        return collective[len("cross_"):] + " between nodes"
    return collective


def waited(future: torch.futures.Future, collective: str, subject: str) -> Any:
    """``future.wait()`` of a collective's future (on CUDA, ordering the current stream after it), its failure as
    a ``CollectiveError``."""
    try:
        return future.wait()
    except Exception as exc:  # noqa: BLE001 - whatever the backend raised is this collective's failure
        raise collective_error(collective, subject, exc) from exc


def completed(future: torch.futures.Future, collective: str, subject: str) -> Any:
    """``future.value()`` of a completed collective's future (in its ``then`` callback), its failure as a
    ``CollectiveError``."""
    try:
        return future.value()
    except Exception as exc:  # noqa: BLE001 - whatever the backend raised is this collective's failure
        raise collective_error(collective, subject, exc) from exc


def run_collective(collective: str, subject: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a blocking collective (or the issue of an asynchronous one), its backend's failure
    (a RuntimeError: torch's distributed errors all are) as a ``CollectiveError``."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as exc:
        raise collective_error(collective, subject, exc) from exc


class HookResult:
    """The future DDP waits on for one bucket, completed with the bucket or failed from any thread, so that DDP sees
    a failed future (see the module docstring). ``future`` is what the hook returns."""

    __slots__ = ("_gate", "_error", "future")

    def __init__(self, devices: Optional[List[torch.device]] = None) -> None:
        self._gate: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        self._error: Optional[BaseException] = None
        self.future = self._gate.then(self._deliver)

    def _deliver(self, gate: torch.futures.Future) -> Any:
        if self._error is not None:
            raise self._error
        return gate.value()

    def done(self) -> bool:
        return self._gate.done()

    def set(self, value: Any) -> None:
        """Complete with ``value`` (DDP's bucket)."""
        self._gate.set_result(value)

    def fail(self, exc: BaseException) -> None:
        """Fail with ``exc``, unless already completed or failed."""
        if not self._gate.done():
            self._error = exc
            self._gate.set_result(None)
