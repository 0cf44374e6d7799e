"""Online tuning for FSDP2: each FSDP group's reduce-scatter in the format the job's own steps chose (``online.py``).

``ddp_triton.fsdp.register(model, comm_dtype="auto", tune="online", formats=[...])`` gives every FSDP module a
``TunedReduceScatter``: one ``WireReduceScatter`` per admitted format (``fsdp.py`` makes them), and the call goes
to the one the tuner assigns the group now. FSDP issues its reduce-scatters in one order on every rank, each run to
its end, so the tuner's timings need no queue: a pass begins when a group is called again, and a group's exchange
is its call (CUDA events around it on a GPU). A group leaving an FP8 format with error feedback adds what its residuals
still owe to its next input; one FP8 format hands them to another.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional, Set

import torch
import torch.distributed as dist

from ..formats import WireFormat
from .online import OnlineTuner

try:  # torch >= 2.9 has FSDP2's custom collectives (``fsdp.register`` refuses an older torch)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - depends on the torch installed
    _ReduceScatterBase = object  # type: ignore[assignment,misc]


class FSDPTuning:
    """What the tuner reads of an FSDP job (``OnlineTuner``'s host, as a ``CommState`` is DDP's): the pass count,
    the group the ranks' timings are combined over, and the order of collectives, which FSDP keeps itself."""

    def __init__(self, group: Any, formats: Dict[str, WireFormat]) -> None:
        self.passes = 0
        self.plans: Dict[int, Any] = {}  # nothing is bound per format outside the groups' own calls
        self.context = _Bound(group, formats)
        self.queue = _InFSDPsOrder()
        self.seen: Set[int] = set()

    def called(self, index: int) -> None:
        """Group ``index`` is called: a second call of any group begins the next pass."""
        if index in self.seen:
            self.passes += 1
            self.seen = set()
        self.seen.add(index)


class _Bound:
    def __init__(self, group: Any, formats: Dict[str, WireFormat]) -> None:
        self.group, self.formats = group, formats


class _InFSDPsOrder:
    """FSDP issues each group's reduce-scatter in one order on every rank, run to its end: nothing to order."""

    @staticmethod
    def ordered() -> Any:
        return contextlib.nullcontext()


class TunedReduceScatter(_ReduceScatterBase):  # type: ignore[misc,valid-type]
    """One FSDP module's reduce-scatter in the format online tuning gives its group (see the module docstring)."""

    def __init__(self, comms: Dict[str, Any], index: int, tuner: OnlineTuner,
                 host: FSDPTuning) -> None:
        self.comms, self.index, self.tuner, self.host = comms, index, tuner, host
        self.module = next(iter(comms.values())).module
        self.current: Optional[Any] = None
        """The format's reduce-scatter of the latest call (FP8's residuals live there)."""

    @property
    def calls(self) -> int:
        """Reduce-scatters run, in every format."""
        return sum(comm.calls for comm in self.comms.values())

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """FP8 with error feedback: what this rank's rounding still owes (``FSDPCommState.state_dict``)."""
        return None if self.current is None else self.current.residual

    @residual.setter
    def residual(self, value: Optional[torch.Tensor]) -> None:
        fp8 = [c for c in self.comms.values() if c.wire.error_feedback]
        for comm in fp8:
            comm.residual = None
        if value is not None and fp8:
            self.current = self.current if self.current in fp8 else fp8[0]
            self.current.residual = value

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Optional[Any]:
        self.host.called(self.index)
        self.tuner.before_call(self.host, self.index, input_tensor.numel(), input_tensor.is_cuda)
        name = self.tuner.format_of(self.index) or next(iter(self.comms))
        comm = self.comms[name]
        if comm is not self.current:
            self._hand_over(comm, input_tensor, op, dist.get_world_size(group))
        self.current = comm
        result = comm(output_tensor, input_tensor, group, op, async_op)
        self.tuner.ended(self.index)
        return result

    def _hand_over(self, comm: Any, input_tensor: torch.Tensor, op: Any, n: int) -> None:
        """What the last format's error feedback still owes: to the next FP8 format's residuals, or, in units of
        the input, added to this input (it leaves FP8)."""
        owed = None if self.current is None else self.current.residual
        if owed is None:
            return
        self.current.residual = None
        if comm.wire.error_feedback:
            comm.residual = owed
        else:  # FP8's residuals are in units of the scaled input (input / the divide factor)
            input_tensor.add_(owed.float().mul(comm.divide_factor(op, n)).to(input_tensor.dtype))  # scaled in float32
