"""Online tuning on a GPU makes the host wait while it tunes only: after its choice, not once per step.

Tier: unit, no processes, no GPU. The tuner's CUDA calls come from ``OnlineTuner.calls``; here a recorder stands in
for them: its events run on a GPU that lags the host by ``LAG`` passes (an event is done ``LAG`` passes after it was
recorded), its device tensors are CPU tensors that flag whatever would make the host wait on a GPU (``Tensor.item``,
``.cpu()``, ``.tolist()`` of a device tensor, a copy between device and pageable memory or without
``non_blocking``, ``torch.tensor(..., device=cuda)``, ``Event.synchronize`` or ``elapsed_time`` of an event not done
yet), and a read of pinned memory before the copy into it has arrived (a wrong value, not a wait). The real CUDA calls
under ``torch.cuda.set_sync_debug_mode("error")``: tests/gpu/test_gpu_online.py.
"""

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch

from ddp_triton.runtime import online
from ddp_triton.runtime.online import OnlineTuner, TunerCalls

#: The GPU runs this many passes behind the host: every event recorded in a window is done by the next check.
LAG = 2


class _Host:
    """What the tuner reads of a CommState: the pass count, its plans, the group and the order of collectives."""

    def __init__(self):
        self.passes = 0
        self.plans = {}
        self.context = SimpleNamespace(group=None)
        self.queue = SimpleNamespace(ordered=contextlib.nullcontext)


class _Recorder(TunerCalls):
    """The CUDA calls of a world of one on a GPU ``lag`` passes behind the host; ``waits``: each call that would make
    the host wait, with the pass it was made in."""

    def __init__(self, lag=LAG):
        self.lag, self.pass_, self.t = lag, 0, 0.0
        self.waits, self.wrong_reads = [], []
        self.synced = -1  # the pass up to which the host waited for the GPU's work
        self.copied_at = -1  # the pass of the last copy into pinned memory

    def flag(self, what):
        self.waits.append((self.pass_, what))

    def done_upto(self):
        """The pass up to which the GPU has run what the host issued."""
        return max(self.pass_ - self.lag, self.synced)

    @staticmethod
    def capturing():
        return False

    def event(self):
        return _Event(self)

    @staticmethod
    def device():
        return torch.device("cuda", 0)  # a name only: nothing is allocated on it

    def tensor(self, values, device):
        if device.type == "cuda":
            self.flag("torch.tensor(..., device=cuda) from pageable memory")
            return _on(torch.tensor(values, dtype=torch.float64), _OnDevice, self)
        return torch.tensor(values, dtype=torch.float64)

    def pinned(self, n):
        return _on(torch.zeros(n, dtype=torch.float64), _Pinned, self)

    def zeros(self, n, device):
        return _on(torch.zeros(n, dtype=torch.float64), _OnDevice, self)

    @staticmethod
    def all_reduce_max(tensor, group, async_op):
        return SimpleNamespace(wait=lambda: True) if async_op else None  # NCCL's wait: a stream's, not the host's


class _Event:
    def __init__(self, recorder):
        self.recorder, self.recorded_at, self.t = recorder, recorder.pass_, recorder.t

    def query(self):
        return self.recorded_at <= self.recorder.done_upto()

    def synchronize(self):
        if not self.query():
            self.recorder.flag("Event.synchronize of an event not done")
            self.recorder.synced = self.recorded_at

    def elapsed_time(self, other):
        if not (self.query() and other.query()):
            self.recorder.flag("Event.elapsed_time of an event not done")  # CUDA raises; the host has to wait
        return 1e3 * (other.t - self.t)


def _on(tensor, kind, recorder):
    out = tensor.as_subclass(kind)
    out.recorder = recorder
    return out


class _Recorded(torch.Tensor):
    """A tensor whose calls the recorder sees (``_OnDevice``: on the GPU; ``_Pinned``: in pinned host memory)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = next((a.recorder for a in args if isinstance(a, _Recorded) and hasattr(a, "recorder")), None)
        if recorder is not None:
            _check(recorder, func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            return args[0]
        return out


class _OnDevice(_Recorded):
    pass


class _Pinned(_Recorded):
    pass


_READS = {torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__float__}


def _check(recorder, func, args, kwargs):
    name = getattr(func, "__name__", str(func))
    if func in _READS and isinstance(args[0], _OnDevice):
        recorder.flag(f"Tensor.{name} of a device tensor")
    elif func in _READS and isinstance(args[0], _Pinned) and recorder.copied_at > recorder.done_upto():
        recorder.wrong_reads.append((recorder.pass_, "pinned memory read before the copy into it arrived"))
    elif func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        if isinstance(dst, _OnDevice) != isinstance(src, _OnDevice):  # between device and host
            host = src if isinstance(dst, _OnDevice) else dst
            if not (isinstance(host, _Pinned) and kwargs.get("non_blocking", args[2] if len(args) > 2 else False)):
                recorder.flag("a copy between device and host that waits (pageable memory, or blocking)")
            if isinstance(dst, _Pinned):
                recorder.copied_at = recorder.pass_


def _run(tuner, recorder, passes, step_ms=lambda name, p: 10.0):
    """Drive one bucket's tuner on CUDA tensors for ``passes`` passes; the pass its (latest) choice was made at."""
    host = _Host()
    for p in range(passes):
        host.passes = recorder.pass_ = p
        tuner.before_call(host, 0, 1000, True)
        name = tuner.format_of(0) or "fp32"
        recorder.t += step_ms(name, p) / 1e3
        tuner.ended(0)  # an event: the exchange's end, the pass's last
    return tuner._locked_at


def test_after_the_choice_no_step_makes_the_host_wait():
    tuner, recorder = OnlineTuner(["fp32", "bf16"]), _Recorder()
    tuner.calls = recorder
    passes = 1 + len(online.uniform_rounds(2)) + 1 + 6 * online.CHECK_EVERY
    locked_at = _run(tuner, recorder, passes)
    assert tuner.tuned() is not None and tuner.tunings == 1
    assert any(p < locked_at for p, _ in recorder.waits)  # tuning reads its timed passes at once: it may wait
    after = [(p, what) for p, what in recorder.waits if p > locked_at]
    assert after == [], after
    assert recorder.wrong_reads == []
    assert tuner._baseline == pytest.approx(10e-3)  # the checks were read, and read right: the 10 ms step
    assert tuner.late_checks == 0


def test_a_gpu_a_whole_window_behind_waits_at_the_check_rather_than_judge_apart():
    """Were the copy back not done by the next check, skipping that window on this rank while another judged it
    could re-tune one rank alone: the check waits instead, and counts it."""
    tuner, recorder = OnlineTuner(["fp32", "bf16"]), _Recorder(lag=online.CHECK_EVERY + 1)
    tuner.calls = recorder
    locked_at = _run(tuner, recorder, 1 + len(online.uniform_rounds(2)) + 1 + 4 * online.CHECK_EVERY)
    after = [what for p, what in recorder.waits if p > locked_at]
    assert after == ["Event.synchronize of an event not done"] * tuner.late_checks and tuner.late_checks == 3
    assert recorder.wrong_reads == []


def test_drift_still_re_tunes_on_a_gpu(monkeypatch):
    monkeypatch.setattr(online, "CHECK_EVERY", 3)
    monkeypatch.setattr(online, "RETUNE_SPACING", 10)
    tuner, recorder = OnlineTuner(["fp32", "bf16"]), _Recorder()
    tuner.calls = recorder
    first = 1 + len(online.uniform_rounds(2))
    _run(tuner, recorder, first + 60, step_ms=lambda name, p: 10.0 if p < first + 20 else 20.0)
    assert tuner.tunings == 2 and tuner._locked_at > first + 20
    after = [(p, what) for p, what in recorder.waits if p > tuner._locked_at]
    assert after == [], after
