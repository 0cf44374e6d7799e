"""Online tuning: the job's own first steps choose each DDP bucket's wire format, and every rank chooses alike.

With ``tune="online"`` a CommState tries the formats the user admitted, in lock-step on every rank, then keeps the
fastest. The schedule is a function of the pass count (counted at each backward's last bucket), never of a clock:

- Tuning starts at pass 1 (DDP rebuilds its buckets after pass 0), or where drift asked for it (below).
- A trial is one assignment of formats to buckets: first each admitted format on every bucket, then, where the
  buckets' fastest formats differ, the mix of them. The formats' trials are interleaved in ``ROUNDS`` rounds, each
  giving every format ``WARM_PASSES`` passes that bind its plans (a switch drops them), then ``MEASURED_PASSES``
  timed ones, in accuracy order in even rounds and the reverse in odd ones: every format sees every stretch of the
  machine's load, and a steady drift within a round favours none. A timed pass gives the step (from the last
  bucket's completion to the next pass's) and each bucket's exchange (the hook's call to its future's completion;
  CUDA events on a GPU). The mix's trial follows the rounds: ``WARM_PASSES``, then ``ROUNDS * MEASURED_PASSES``
  timed passes.
- At the first bucket of the pass after a timed one, the ranks' times go through one all-reduce (MAX), issued in
  the state's one order, so every rank decides on the same numbers with no broadcast. On a GPU that pass waits for
  the timed one's events and the all-reduce (tuning only: the steady state below never waits).
- Each time taken in a round is scaled to the last round's load (``at_one_load``: by the ratio of the two rounds'
  levels, a level being the median of every time of its round), so a load that changes between rounds moves every
  format alike and decides nothing.
- The choice is the most accurate format whose median step is within the noise of the fastest median
  (``choose_within_noise``): formats a busy machine cannot tell apart are told apart by accuracy, not by chance.
  The noise is measured in the same trials (``noise_of``: their samples' spread about their own medians), at least
  ``SWITCH_TOLERANCE``, at most ``NOISE_CAP``, so that a format clearly faster always wins. A mix wins only if its
  median step is below the chosen format's by more than the noise: a format whose exchange is faster but whose
  passes hold up the step loses. The choice is then locked. Every input is an all-reduced time, so every rank
  decides alike.

Steady state: every ``CHECK_EVERY`` passes the median step of the window goes through one all-reduce (MAX), which is
read at the next check, so no rank waits on it. On a GPU nothing in it makes the host wait: the window counts only the
steps whose events are done (``Event.query``), the median goes to the device and the result comes back by
non-blocking copies through pinned host buffers made once, and an event recorded after the copy back is queried at
the next check. Were it not done by then (the GPU a whole window behind the host), the check waits for it: every
rank must judge the same windows, and a window skipped on one rank but read on another could set off a re-tune on
one rank alone, whose collectives no peer would match. When the step strays more than ``DRIFT`` from the first
window after the lock for ``DRIFT_CHECKS`` checks in a row, and ``RETUNE_SPACING`` passes have gone since tuning last
ended, tuning starts again. A bucket leaving an FP8 format with error feedback hands its residuals to its next exchange
(``residuals.take_for_fold``): nothing is lost at a switch, however often the rounds switch.
"""

from __future__ import annotations

import statistics
import time
import os
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..formats import canonical_name, sorted_by_preference
from ..log import info_rank0, warn_once
from ..machine.profile import Profile, profile_from_choice
from ..machine.profile.format_rule import SWITCH_TOLERANCE
from .collective_errors import run_collective

TUNE_ONLINE = "online"
#: The formats admitted when the user names none and the profile admits none: no FP8 unless the user names it.
DEFAULT_ONLINE_FORMATS: Tuple[str, ...] = ("fp32", "bf16", "bf16+fp32sum")
#: Per format and round, the untimed passes after a switch: the first binds the format's plans (and, leaving FP8 with
#: error feedback, hands its residuals on), which the timed passes must not pay.
WARM_PASSES = 1
#: Per format and round, the timed passes. One: the more the rounds, the finer the load is followed.
MEASURED_PASSES = 1
#: Rounds of every format: ROUNDS * MEASURED_PASSES = 4 timed passes per format (NOISE_SPREADS is set for four), in
#: ROUNDS * (WARM_PASSES + MEASURED_PASSES) = 8 passes per format (one format after another took 5).
ROUNDS = 4
CHECK_EVERY = 10
DRIFT = 0.2
DRIFT_CHECKS = 2
RETUNE_SPACING = 50
#: How many pooled median absolute deviations (relative) two trials' medians may differ by chance. A median of four
#: samples strays about 0.9 MAD and a difference of two medians about 1.3; the fastest of four formats of equal speed
#: is the lowest of three such differences, which 4 MAD covers about 95% of the time (Gaussian noise, simulated).
NOISE_SPREADS = 4.0
#: The noise is never taken wider than this fraction of a median: a format more than 1.67x faster (1 / 0.6) wins
#: however busy the machine, so a 2x lead (FP8 + EF's step at 200 Mbit/s is 2.5x flat bf16's on the emulated
#: cluster, README) is never taken for noise; a smaller one wins where the machine is quiet enough to show it. Not
#: lower: on two cores with a CPU burner, four samples' medians of formats of one speed were seen 1.5x apart.
NOISE_CAP = 0.4

_SUBJECT = "the online tuner's timings"
Mark = Union[float, "torch.cuda.Event"]
Assignment = Union[str, Dict[int, str]]  # one format for every bucket, or one per bucket index


def check_tune_options(tune: Any, formats: Any) -> Optional[List[str]]:
    """The canonical names of ``formats`` for ``tune`` (None: not given), or a ValueError naming the option."""
    if tune not in (None, TUNE_ONLINE):
        raise ValueError(f"tune must be None or 'online', got {tune!r}")
    if formats is None:
        return None
    if tune is None:
        raise ValueError("formats lists the wire formats online tuning chooses among: pass tune='online' with it")
    if isinstance(formats, str) or not isinstance(formats, (list, tuple)) or not formats:
        raise ValueError(f"formats must be a non-empty list of wire format names, got {formats!r}")
    names: List[str] = []
    for name in formats:
        if not isinstance(name, str):
            raise ValueError(f"formats must name wire formats as strings, got {name!r}")
        canonical = canonical_name(name)  # ValueError naming an unknown format
        if canonical in names:
            raise ValueError(f"formats names {canonical} twice ({list(formats)!r}): list each format once")
        names.append(canonical)
    return names


@dataclass
class _Trial:
    assignment: Assignment
    steps: List[float] = field(default_factory=list)
    """Seconds per step, each the slowest rank's."""
    exchanges: Dict[int, List[float]] = field(default_factory=dict)
    """Per bucket index, seconds per exchange, each the slowest rank's."""
    rounds: List[Optional[int]] = field(default_factory=list)
    """Per timed pass, the round it was taken in; None (or missing): outside the rounds (the mix's trial)."""

    @property
    def label(self) -> str:
        return self.assignment if isinstance(self.assignment, str) else "mixed"

    def in_rounds(self, times: Sequence[float]) -> List[Tuple[Optional[int], float]]:
        """``times`` (its steps, or one bucket's exchanges) with the round of each."""
        return [(r, t) for r, t in zip_longest(self.rounds[:len(times)], times)]


def uniform_rounds(n_formats: int) -> List[Tuple[int, int, bool]]:
    """Per pass from tuning's first, the uniform trials' schedule: the format (its index in accuracy order), the
    round, and whether the pass is timed. ``ROUNDS`` rounds, even ones in accuracy order, odd ones reversed; in each
    every format has ``WARM_PASSES`` passes, then ``MEASURED_PASSES`` timed."""
    passes: List[Tuple[int, int, bool]] = []
    for r in range(ROUNDS):
        for f in (range(n_formats) if r % 2 == 0 else reversed(range(n_formats))):
            passes += [(f, r, False)] * WARM_PASSES + [(f, r, True)] * MEASURED_PASSES
    return passes


class OnlineTuner:
    """Chooses each bucket's format from the job's own steps (see the module docstring); one per CommState."""

    def __init__(self, formats: Optional[Sequence[str]]) -> None:
        self.formats: List[str] = []
        """The admitted formats, most accurate first: the trials' order ([] until the state binds: ``admit``)."""
        self.choice: Optional[Dict[int, str]] = None
        """The locked format per bucket index; None while tuning (or before)."""
        self.decided: Dict[int, Dict[str, Any]] = {}
        """Per bucket index: its format, elements and the medians that chose it (``CommState.tuned_formats``)."""
        self.tunings = 0
        self._start: Optional[int] = 1
        """The pass the next (or current) tuning starts at; None once locked and no re-tune is due."""
        self._trials: List[_Trial] = []
        self._schedule: List[Tuple[int, Optional[int], bool]] = []
        """Per pass of the current tuning: its trial's index, round and whether it is timed."""
        self._assignment: Optional[Assignment] = None
        self._seen_pass = -1
        self._cuda = False
        self._bytes: Dict[int, int] = {}
        """Per bucket index of the last complete pass, its elements."""
        self._filling: Dict[int, int] = {}
        self._starts: Dict[int, Mark] = {}
        self._ends: Dict[int, Mark] = {}
        self._last_end: Optional[Mark] = None
        self._locked_at = 0
        self._window: List[Tuple[Mark, Mark]] = []
        self._pending: Optional[Tuple[Any, Any]] = None
        """The last check's all-reduce, read at the next: on CPU its work and tensor, on a GPU the event recorded
        after its copy back (and None)."""
        self._check_buffers: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        """On a GPU, the steady checks' pinned host buffer in, device buffer, pinned host buffer out (made once)."""
        self.late_checks = 0
        """Steady checks whose result had not come back by the next check, which then waited for it (GPU only)."""
        self._baseline: Optional[float] = None
        self._drifted = 0
        self._restored: Optional[Dict[int, int]] = None
        self.calls = TunerCalls()
        """Its clock, CUDA and collective calls (a test stands in for them)."""
        if formats:
            self.admit(formats)

    def admit(self, formats: Sequence[str]) -> None:
        """Set the formats to choose among (the user's, else the profile's admitted set, else the defaults)."""
        names = sorted_by_preference(list(dict.fromkeys(canonical_name(f) for f in formats)))
        _refuse_stray(self.decided, names)
        self.formats = names

    # ---- the hook's calls -------------------------------------------------------------------------------------

    def format_for(self, bucket: Any) -> Optional[str]:
        """The format DDP's ``bucket`` binds in now; None: the context's own choice (before tuning starts)."""
        return None if bucket is None else self.format_of(bucket.index())

    def format_of(self, index: int) -> Optional[str]:
        """The format bucket (FSDP: group) ``index`` goes in now; None: the host's own choice."""
        assignment = self.choice if self.choice is not None and self._start is None else self._assignment
        if assignment is None:
            return None
        return assignment if isinstance(assignment, str) else assignment.get(index)

    def before_call(self, state: Any, index: int, numel: int, is_cuda: bool) -> None:
        """At every call of a bucket (FSDP: a group) ``index`` of ``numel`` elements, before its plan is looked up:
        at a pass's first, take the last pass's times and move the schedule on (which may drop every plan of
        ``state``, the host, so that the buckets bind in their next formats). The host: a CommState, or FSDP's
        ``FSDPTuning``."""
        if state.passes != self._seen_pass:
            if is_cuda and self.calls.capturing():
                raise RuntimeError("triton_hook: tune='online' times the job's steps in Python, which a CUDA graph's "
                                   "replay does not run: capture a state with a fixed format, or comm_dtype='auto' "
                                   "with the profile online tuning saved (state.save_profile)")
            self._seen_pass = state.passes
            self._cuda = is_cuda
            self._new_pass(state, state.passes)
        self._filling[index] = numel
        if self._start is not None and self._start <= state.passes:
            self._starts[index] = self._mark()

    def watch(self, future: torch.futures.Future, index: int, last: bool) -> torch.futures.Future:
        """``future``, timed: its completion is marked before what DDP waits on completes (every bucket while
        tuning, the last one otherwise)."""
        if self._start is None and not last:
            return future
        ends = self._ends

        def ended(done: torch.futures.Future) -> Any:
            ends[index] = self._mark()
            return done.value()  # a failed exchange fails what DDP waits on, as before

        return future.then(ended)

    def ended(self, index: int) -> None:
        """A call that ran its exchange to its end (FSDP's reduce-scatter) has ended: mark it."""
        self._ends[index] = self._mark()

    # ---- the schedule -----------------------------------------------------------------------------------------

    def _new_pass(self, state: Any, p: int) -> None:
        ends, starts = self._ends, self._starts
        self._ends, self._starts, self._bytes, self._filling = {}, {}, self._filling, {}
        end = self._pass_end(ends)
        steps = None if end is None or self._last_end is None else (self._last_end, end)
        self._last_end = end if end is not None else self._last_end
        if self._restored is not None:
            self._check_restored(state, p)
        if self._start is None or p < self._start:
            if self.choice is not None:
                self._steady(state, p, steps)
            return
        since = p - self._start
        if since == 0:
            self._trials = [_Trial(name) for name in self.formats]
            self._schedule = list(uniform_rounds(len(self.formats)))
        elif since <= len(self._schedule) and self._schedule[since - 1][2]:  # the pass just ended was timed
            trial, r, _ = self._schedule[since - 1]
            step = None if steps is None else self._seconds(*steps)
            exchanges = {i: self._seconds(starts[i], ends[i]) for i in sorted(ends) if i in starts}
            self._record(state, self._trials[trial], r, step, exchanges)
        if since == len(self._schedule) and len(self._trials) == len(self.formats):
            mixed = self._mixed()
            if mixed is not None:
                self._trials.append(_Trial(mixed))
                self._schedule += ([(len(self.formats), None, False)] * WARM_PASSES
                                   + [(len(self.formats), None, True)] * (ROUNDS * MEASURED_PASSES))
        if since < len(self._schedule):
            self._switch(state, self._trials[self._schedule[since][0]].assignment)
        else:
            self._decide(state, p)

    def _record(self, state: Any, trial: _Trial, r: Optional[int], step: Optional[float],
                exchanges: Dict[int, float]) -> None:
        """Combine one timed pass's times across ranks (MAX) and keep them with ``trial``, taken in round ``r``."""
        n = max(self._bytes) + 1 if self._bytes else 0
        local = [step if step is not None else 0.0] + [exchanges.get(i, 0.0) for i in range(n)]
        combined = self._all_reduce_max(state, local)
        trial.steps.append(combined[0])
        trial.rounds.append(r)
        for i in range(n):
            trial.exchanges.setdefault(i, []).append(combined[1 + i])

    def _mixed(self) -> Optional[Dict[int, str]]:
        """Each bucket's format by its exchanges (``choose_within_noise``); None when one format is every
        bucket's."""
        per_bucket = {}
        for i in sorted(self._bytes):
            samples = self._uniform(lambda t: t.exchanges.get(i, []))
            if samples:
                per_bucket[i] = choose_within_noise(samples)[0]
        return per_bucket if len(set(per_bucket.values())) > 1 else None

    def _uniform(self, times: Callable[[_Trial], List[float]]) -> Dict[str, List[float]]:
        """Per uniform trial (by format), ``times(trial)`` at the last round's load (``at_one_load``)."""
        return at_one_load({t.label: t.in_rounds(times(t)) for t in self._trials
                            if isinstance(t.assignment, str) and times(t)})

    def _decide(self, state: Any, p: int) -> None:
        uniform = self._uniform(lambda t: t.steps)
        best, noise = choose_within_noise(uniform)
        chosen: Assignment = best
        mixed = [t for t in self._trials if not isinstance(t.assignment, str) and t.steps]
        if mixed and statistics.median(mixed[0].steps) < statistics.median(uniform[best]) * (1.0 - noise):
            chosen = mixed[0].assignment
        indices = sorted(self._bytes)
        self.choice = {i: chosen if isinstance(chosen, str) else chosen[i] for i in indices}
        steps = {**uniform, **{t.label: t.steps for t in mixed}}
        steps_ms = {label: round(1e3 * statistics.median(times), 3) for label, times in steps.items()}
        exchanges = {i: {**self._uniform(lambda t: t.exchanges.get(i, [])),
                         **{t.label: t.exchanges[i] for t in mixed if t.exchanges.get(i)}} for i in indices}
        self.decided = {i: {"format": self.choice[i], "elements": self._bytes[i], "step_ms": steps_ms,
                            "noise": round(noise, 4),
                            "exchange_ms": {label: round(1e3 * statistics.median(times), 3)
                                            for label, times in exchanges[i].items()}}
                        for i in indices}
        self.tunings += 1
        self._start, self._locked_at, self._window, self._baseline, self._drifted = None, p, [], None, 0
        self._pending = None
        self._switch(state, chosen)
        shown = chosen if isinstance(chosen, str) else ", ".join(f"bucket {i}: {f}" for i, f in self.choice.items())
        info_rank0(f"ddp_triton online tuning #{self.tunings} at step {p}: {shown}; median step ms "
                   + ", ".join(f"{k} {v}" for k, v in steps_ms.items()) + f" (noise {100 * noise:.1f}%)")

    def _switch(self, state: Any, assignment: Assignment) -> None:
        if assignment != self._assignment:
            state.plans.clear()  # every bucket binds again at its next call, in its new format
        self._assignment = assignment

    def _steady(self, state: Any, p: int, steps: Optional[Tuple[Mark, Mark]]) -> None:
        """After the lock: the window's median step, combined at each check, read at the next; drift re-tunes."""
        if steps is not None:
            self._window.append(steps)
        if (p - self._locked_at) % CHECK_EVERY or p == self._locked_at:
            return
        if self._pending is not None:
            self._judge(self._read_check(), p)
        # On a GPU only the steps whose events are done count: a rank's own median may differ, the MAX is agreed.
        times = [self._elapsed(a, b) for a, b in self._window if self._done(a) and self._done(b)]
        median = statistics.median(times) if times else 0.0
        self._window = []
        self._pending = self._issue_check(state, median) if self._start is None else None

    def _judge(self, step: float, p: int) -> None:
        if step <= 0.0:
            return
        if self._baseline is None:
            self._baseline = step
            return
        self._drifted = self._drifted + 1 if abs(step / self._baseline - 1.0) > DRIFT else 0
        if self._drifted >= DRIFT_CHECKS and p - self._locked_at >= RETUNE_SPACING:
            info_rank0(f"ddp_triton online tuning: the step moved from {1e3 * self._baseline:.1f} ms to "
                       f"{1e3 * step:.1f} ms; tuning again from step {p + 1}")
            self._start, self._trials = p + 1, []

    # ---- resume and profile -----------------------------------------------------------------------------------

    def state(self) -> Optional[Dict[str, Any]]:
        """What a checkpoint keeps: the locked choice and what decided it; None while tuning."""
        if self.choice is None or self._start is not None:
            return None
        return {"formats": list(self.formats), "buckets": {str(i): dict(d) for i, d in self.decided.items()}}

    def tuned(self) -> Optional[Dict[int, Dict[str, Any]]]:
        """Per bucket index: the chosen format, its elements and the medians (ms) that decided it; None while
        tuning."""
        return None if self.choice is None or self._start is not None else {i: dict(d) for i, d in self.decided.items()}

    def profile(self, ctx: Any, bucket_cap_mb: Optional[float] = None) -> Profile:
        """The choice as a profile (``profile_from_choice``) for the state's bound context and the job's DDP
        ``bucket_cap_mb`` (None: unknown)."""
        nodes = ctx.nodes.n_nodes if ctx.nodes is not None else _nodes_from_launcher(ctx.world_size)
        return profile_from_choice(self.decided, self.formats, ctx.profile, ctx.world_size, nodes, ctx.backend,
                                   bucket_cap_mb)

    def check_saved(self, saved: Any) -> Dict[int, Dict[str, Any]]:
        """The per-bucket choice in ``saved`` (what ``state`` wrote), or a ValueError naming what is wrong."""
        if not isinstance(saved, dict) or not isinstance(saved.get("buckets"), dict) or not saved["buckets"]:
            raise ValueError(f"the saved online tuning is not what state_dict() wrote: {saved!r:.200}")
        decided = {}
        for key, entry in saved["buckets"].items():
            if not (isinstance(entry, dict) and isinstance(entry.get("format"), str)
                    and isinstance(entry.get("elements"), int) and str(key).isdigit()):
                raise ValueError(f"the saved online tuning of bucket {key!r} names no format and elements")
            decided[int(key)] = {**entry, "format": canonical_name(entry["format"])}
        if self.formats:
            _refuse_stray(decided, self.formats)
        return decided

    def lock(self, decided: Dict[int, Dict[str, Any]]) -> None:
        """Lock a checkpoint's choice (``check_saved``); checked against the buckets at the next pass."""
        self.decided = decided
        self.choice = {i: d["format"] for i, d in self.decided.items()}
        self._restored = {i: d["elements"] for i, d in self.decided.items()}
        self._start, self._assignment, self._locked_at = None, dict(self.choice), max(self._seen_pass, 0)

    def _check_restored(self, state: Any, p: int) -> None:
        """A restored choice holds only for the buckets it was made on: others (DDP regrouped) tune again."""
        if p < 2:  # DDP's buckets are final from pass 1 on
            return
        restored, self._restored = self._restored, None
        if restored != self._bytes:
            warn_once("ddp_triton online tuning: the checkpoint's choice was made on other DDP buckets "
                      f"({len(restored or {})} of them); tuning again", all_ranks=True)
            self.choice, self._start, self._trials = None, p, []

    # ---- clocks and the one collective ------------------------------------------------------------------------

    def _mark(self) -> Mark:
        return self.calls.event() if self._cuda else self.calls.now()

    def _seconds(self, a: Mark, b: Mark) -> float:
        """Seconds from ``a`` to ``b``; on a GPU this waits for both events (while tuning only)."""
        if self._cuda:
            a.synchronize()
            b.synchronize()
        return self._elapsed(a, b)

    def _elapsed(self, a: Mark, b: Mark) -> float:
        """Seconds from ``a`` to ``b``, both done (``_done``): no wait."""
        return a.elapsed_time(b) / 1e3 if self._cuda else b - a

    def _done(self, mark: Mark) -> bool:
        return mark.query() if self._cuda else True

    def _pass_end(self, ends: Dict[int, Mark]) -> Optional[Mark]:
        if not ends:
            return None
        return list(ends.values())[-1] if self._cuda else max(ends.values())  # CUDA: the last marked

    def _all_reduce_max(self, state: Any, values: List[float]) -> List[float]:
        """The ranks' maximum of each of ``values``, waited for (a timed pass's times, while tuning: on a GPU the host
        waits for the copies and the all-reduce)."""
        tensor = self.calls.tensor(values, self.calls.device() if self._cuda else torch.device("cpu"))
        with state.queue.ordered():
            run_collective("all_reduce", _SUBJECT, self.calls.all_reduce_max, tensor, state.context.group, False)
        return tensor.cpu().tolist()

    def _issue_check(self, state: Any, median: float) -> Tuple[Any, Any]:
        """Start a steady check's all-reduce (MAX) of this rank's ``median``; ``_read_check`` reads it at the next
        check. Nothing here waits for the device: on a GPU the value goes in and comes back by non-blocking copies
        through pinned host buffers, and the event recorded after the copy back says when it is there."""
        group = state.context.group
        if not self._cuda:
            tensor = self.calls.tensor([median], torch.device("cpu"))
            with state.queue.ordered():
                work = run_collective("all_reduce", _SUBJECT, self.calls.all_reduce_max, tensor, group, True)
            return work, tensor
        if self._check_buffers is None:
            self._check_buffers = (self.calls.pinned(1), self.calls.zeros(1, self.calls.device()), self.calls.pinned(1))
        host_in, on_device, host_out = self._check_buffers
        host_in.fill_(median)  # the last check's copy in has run: its event, after it, was done (_read_check)
        on_device.copy_(host_in, non_blocking=True)
        with state.queue.ordered():
            work = run_collective("all_reduce", _SUBJECT, self.calls.all_reduce_max, on_device, group, True)
        # NCCL: the current stream waits for the all-reduce, the host does not (gloo on CUDA tensors: the host waits).
        run_collective("all_reduce", _SUBJECT, work.wait)
        host_out.copy_(on_device, non_blocking=True)
        return None, self.calls.event()

    def _read_check(self) -> float:
        """The last check's all-reduced median step (see ``_issue_check``), issued a window ago."""
        work, result = self._pending
        if not self._cuda:
            run_collective("all_reduce", _SUBJECT, work.wait)  # done a window ago: no wait
            return float(result.item())
        if not result.query():  # the GPU is a window behind the host: wait, so that every rank judges this window
            self.late_checks += 1
            result.synchronize()
        return float(self._check_buffers[2].item())  # pinned host memory, there since the event is done


class TunerCalls:
    """Every clock, CUDA and collective call the online tuner makes, in one small object, so that a test can stand
    in for it: a fake clock drives the schedule without a wall clock, and a recorder of the CUDA calls, with no GPU,
    flags any that would make the host wait."""

    @staticmethod
    def now() -> float:
        """The host's clock, in seconds (marks on CPU tensors)."""
        return time.perf_counter()

    @staticmethod
    def capturing() -> bool:
        """Whether the current CUDA stream is being captured into a graph."""
        return torch.cuda.is_current_stream_capturing()

    @staticmethod
    def event() -> Any:
        """A timing CUDA event, recorded on the current stream (marks on CUDA tensors)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def device() -> torch.device:
        """The current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def tensor(values: List[float], device: torch.device) -> torch.Tensor:
        """``values`` as a float64 tensor on ``device``, copied from pageable memory (on a GPU the host waits)."""
        return torch.tensor(values, dtype=torch.float64, device=device)

    @staticmethod
    def pinned(n: int) -> torch.Tensor:
        """``n`` float64 in pinned host memory, which copies to and from a GPU need not wait for."""
        return torch.zeros(n, dtype=torch.float64, pin_memory=True)

    @staticmethod
    def zeros(n: int, device: torch.device) -> torch.Tensor:
        """``n`` float64 on ``device``."""
        return torch.zeros(n, dtype=torch.float64, device=device)

    @staticmethod
    def all_reduce_max(tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        """The ranks' elementwise maximum of ``tensor``, in place; its work when ``async_op``."""
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def at_one_load(samples: Mapping[str, Sequence[Tuple[Optional[int], float]]]) -> Dict[str, List[float]]:
    """Each trial's times, given with the round each was taken in, as at the last round's load: a time of round r
    times the last round's level over round r's, a round's level being the median of every time taken in it (every
    format's, so the formats' own speeds do not move it). A time taken outside the rounds (round None) is kept.

    The rounds interleave the formats, so a load that changes between rounds moves each round's level and every
    format's times with it: scaled, it decides nothing. The last round's, because the mix's trial follows it. A
    function of the all-reduced times alone: every rank scales alike."""
    by_round: Dict[int, List[float]] = {}
    for times in samples.values():
        for r, t in times:
            if r is not None:
                by_round.setdefault(r, []).append(t)
    levels = {r: statistics.median(times) for r, times in by_round.items()}
    last = levels[max(levels)] if levels else 0.0
    return {name: [t * last / levels[r] if r is not None and levels[r] > 0 else t for r, t in times]
            for name, times in samples.items()}


def noise_of(samples: Mapping[str, Sequence[float]]) -> float:
    """By what fraction two of these trials' medians may differ by chance: ``NOISE_SPREADS`` times the median of
    every sample's relative distance from its own trial's median, within [``SWITCH_TOLERANCE``, ``NOISE_CAP``].

    Pooled over the trials, because four samples say little of their own spread; the median, because a busy
    machine's stalls are rare and long. Not each trial's min..max interval: that of four samples is wider than the
    differences that matter (a format 15% faster would stay within it)."""
    deviations = [abs(s / m - 1.0) for times in samples.values() if times
                  for m in (statistics.median(times),) if m > 0 for s in times]
    spread = statistics.median(deviations) if deviations else 0.0
    return min(NOISE_CAP, max(SWITCH_TOLERANCE, NOISE_SPREADS * spread))


def choose_within_noise(samples: Mapping[str, Sequence[float]]) -> Tuple[str, float]:
    """The most accurate format whose median time is within the noise of the fastest median (``fastest >= median *
    (1 - noise)``), and that noise (``noise_of``); ``samples``: each format's times (at least one format with one).

    Accuracy is the formats' own order (``formats.sorted_by_preference``: fp32, then 16 bits with float32 sums
    before without, then FP8 with error feedback). A function of the times alone: ranks given the same all-reduced
    times choose alike."""
    medians = {name: statistics.median(times) for name, times in samples.items() if times}
    if not medians:
        raise ValueError("no trial times to choose a format from")
    noise = noise_of(samples)
    fastest = min(medians.values())
    return next(f for f in sorted_by_preference(list(medians)) if medians[f] * (1.0 - noise) <= fastest), noise


def _nodes_from_launcher(world_size: int) -> int:
    """Nodes of a flat job, from the launcher's LOCAL_WORLD_SIZE (torchrun's); 1 when it does not say."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        return 1
    return world_size // local if 0 < local <= world_size and world_size % local == 0 else 1


def _refuse_stray(decided: Dict[int, Dict[str, Any]], names: Sequence[str]) -> None:
    stray = sorted({d["format"] for d in decided.values()} - set(names))
    if stray:
        raise ValueError(f"the saved online tuning chose {', '.join(stray)}, which this state does not admit "
                         f"(formats={list(names)})")


def tuned_choice(tuner: Optional[OnlineTuner], method: str = "tuned_formats") -> Optional[Dict[int, Dict[str, Any]]]:
    """``CommState.tuned_formats``: the tuner's choice, None while tuning; without online tuning, a ValueError that
    names ``method``, the CommState method called."""
    if tuner is None:
        raise ValueError(f"{method}: this state does not tune online (register it with tune='online')")
    return tuner.tuned()


def save_tuned_profile(tuner: Optional[OnlineTuner], ctx: Any, path: Any, bucket_cap_mb: Optional[float] = None) -> Any:
    """``CommState.save_profile``: write the choice as a profile (``profile_from_choice``) of the job's DDP
    ``bucket_cap_mb`` (None: unknown); returns its path."""
    if tuned_choice(tuner, "save_profile") is None or ctx is None:
        raise ValueError("save_profile: online tuning has not chosen yet (it chooses in the job's first steps)")
    return tuner.profile(ctx, bucket_cap_mb).save(path)
