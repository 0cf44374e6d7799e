"""The exchange queue: a bucket's exchange as stages, and the one order in which a state issues its collectives.

An exchange is a list of stages (``StagedExchange``), each a computation and an asynchronous collective, and a last
computation (``finish``, writing DDP's bucket); each wire format's exchange is built in ``wire_exchanges.py``: one
all-reduce, the sharded exchange's two stages (pack + all-to-all, sum + all-gather), or the two-level one's
(``two_level.py``: a reduce-scatter inside the node, the node-crossing stages, an all-gather inside the node). A
bucket cut into chunks (``chunks.py``) is one such exchange per chunk (``ChunkedExchange``), started in order.

Every rank must issue the collectives of a group in one order, and a gloo future's callback runs on gloo's own
thread whenever the work finishes. The ``ExchangeQueue`` keeps one rule: each group's collectives are issued in the
order the buckets started, a bucket's in stage order. Under one lock it issues a stage once the collective before it
has finished and no earlier bucket still owes a collective on the stage's group; completions call back to issue what
they unblock (never waiting, on gloo's thread), the hook queues a bucket once its first computation has run (its
first collective goes out at once unless an earlier bucket owes one on its group, and then when a completion
unblocks it: the backward never waits for an earlier bucket's collectives) and the last bucket of a backward issues
everything left (waiting without the lock, so completions keep issuing meanwhile). The sharded exchange's two
collectives share a group, giving a2a(0), ag(0), a2a(1), ag(1), ... on every rank; the two-level exchange's
reduce-scatters, cross exchanges and all-gathers are on three groups, so a bucket's reduce-scatter goes out while
the bucket before is still between nodes, and its cross exchange queues right behind that bucket's. Any error (a
failed collective, a kernel's) fails that bucket's future, so the backward fails on this rank as with one
all-reduce; one that leaves collectives unissued fails every later bucket of the state too (its peers issued them).
A collective's failure is told as ``collective_errors.py`` words it (which collective of which bucket, and that a peer
is gone), and the bucket's future fails as DDP can read it (``HookResult``).

The state's other collectives (the residuals' re-slice at a new bucket layout, ``state_dict``) go through the same
queue (``ExchangeQueue.ordered``): they are issued after every collective the pending buckets owe and before the
next bucket's, never beside a callback's collective in an order that depends on which rank was late.

Streams, for a bucket on CUDA. NCCL completes a collective's future at launch, so the queue issues every stage of a
bucket inside the hook call, and waiting for a collective (``future.wait()``) makes the *current* stream wait for
it: in the hook, the backward's. So the queue keeps one side stream per CUDA device (made at the state's first
bucket there) and runs a bucket there from its first collective on: the hook's stream records an event right after
the first computation (the pack) and the side stream waits for it; every collective is issued, and every wait for
one and every later computation runs, on the side stream; the unpack runs in the last collective's completion
callback, on the stream torch takes from its pool for it (ordered after the collective), where DDP's future (a CUDA
future, ``CudaStreams.result``) completes, so DDP's wait orders its stream after the unpack. A bucket cut into chunks
finishes on the side stream: each chunk's unpack records an event where it ran, and once all have, the side stream
waits for them, runs the exchange's ``finish`` and completes DDP's future. The backward's stream waits for nothing
the hook issued: its next kernels overlap the exchange. The waits of the last bucket's drain (and ``ordered``) are
the side stream's too. Every buffer an exchange touches is held by it for the bucket's life (made at binding, as are
the side stream and the chunks' events), so nothing allocated on one stream is freed while another still uses it.
On CPU none of this applies (``_Run``: the current stream, no events). The CUDA calls are read through
``streams``, one object, so that tests/unit/runtime/test_side_stream.py stands a recorder in for them without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Callable, Deque, Dict, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from .collective_errors import HookResult, collective_error, completed, waited


class CudaStreams:
    """The CUDA calls that keep a CUDA bucket's later stages off the backward's stream, read through one object
    (``streams``) so that a test without a GPU can stand a recorder in for them (see the module docstring)."""

    @staticmethod
    def device_of(buffer: torch.Tensor) -> Optional[torch.device]:
        """The CUDA device of a bucket's buffer; None on any other device (nothing of this applies there)."""
        return buffer.device if buffer.is_cuda else None

    @staticmethod
    def new_stream(device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    @staticmethod
    def new_event() -> Any:
        return torch.cuda.Event()

    @staticmethod
    def current_stream(device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @staticmethod
    def use(stream: Any) -> Any:
        """Make ``stream`` this thread's current one inside the ``with`` block."""
        return torch.cuda.stream(stream)

    @staticmethod
    def result(device: torch.device) -> HookResult:
        """DDP's future for a bucket on ``device``: a CUDA future, so that DDP's wait orders its stream after the
        stream current when it completes."""
        return HookResult([device])


streams = CudaStreams()
"""What the queue calls torch.cuda through; tests replace it."""


class Stage(NamedTuple):
    """One step of an exchange: a computation on this rank, then a collective issued asynchronously."""

    compute_phase: str
    """Telemetry name of the computation ("pack", "reduce", ...)."""
    compute: Callable[[], None]
    collective_phase: str
    """Telemetry name of the collective ("all_to_all", "all_gather", ...)."""
    issue: Callable[[], Any]
    """Issues the collective (``async_op=True``) and returns its Work."""
    group: Any
    """The process group the collective runs on: the queue issues each group's collectives in bucket order."""


def nothing() -> None:
    """A computation with nothing to do: a stage's or an exchange's, where the step is not needed."""


class StagedExchange:
    """One bucket's exchange as stages, each a computation and a collective, and the last computation: the first
    stage runs when the bucket is started, the others once the collective before has finished, and ``finish``
    (writing DDP's bucket) on the last collective's completion."""

    def __init__(self, buffer: torch.Tensor, stages: Sequence[Stage], finish: Callable[[], None],
                 held: Sequence[torch.Tensor], subject: str = "a bucket") -> None:
        self.buffer = buffer
        """DDP's bucket buffer."""
        self.subject = subject
        """What a failed collective's message says it carried: "bucket 3 (fp8e4m3+ef wire)"."""
        self.stages, self.finish = tuple(stages), finish
        self.held = tuple(held)
        """The buffers the exchange holds (its memory), the first what its first collective is handed."""
        self.groups_from = [frozenset(id(st.group) for st in self.stages[i:]) for i in range(len(self.stages) + 1)]
        """For each stage index, the groups of that stage and the ones after it."""

    @property
    def group(self) -> Any:
        """The group of the first collective."""
        return self.stages[0].group


class ChunkedExchange:
    """A bucket's exchange cut into chunks (``chunks.py``), each a StagedExchange over its own slice of the bucket,
    started in order through the queue (``ExchangeQueue.start``): each group's collectives go out chunk by
    chunk, so a stage works on chunk k+1 while a later one has chunk k. ``finish`` runs once every chunk finished
    (adding up the chunks' statistics)."""

    def __init__(self, buffer: torch.Tensor, chunks: Sequence[StagedExchange], finish: Callable[[], None],
                 held: Sequence[torch.Tensor]) -> None:
        self.buffer = buffer
        """DDP's bucket buffer."""
        self.chunks = tuple(chunks)
        self.finish = finish
        self.held = tuple(held)
        """The buffers the chunks hold (the memory of the exchange)."""
        self._subject = "a bucket"

    @property
    def subject(self) -> str:
        """What a failed collective's message says it carried; each chunk's names the chunk too."""
        return self._subject

    @subject.setter
    def subject(self, text: str) -> None:
        self._subject = text
        for k, chunk in enumerate(self.chunks):
            chunk.subject = f"{text}, chunk {k + 1} of {len(self.chunks)}"


class _Run:
    """One bucket's exchange in flight: the next stage to run, the Work of the collective issued last; ``watch``
    (telemetry.Watch) records its phases, or None. Its waits and kernels run on the current stream: a bucket not on
    CUDA (``_SideRun`` is a CUDA bucket's)."""

    def __init__(self, exchange: StagedExchange, result: Any, watch: Any) -> None:
        self.exchange, self.result, self.watch = exchange, result, watch
        """``result``: what the finish completes or any failure fails (``HookResult``, or a chunk's share of one)."""
        self.next = 0
        self.work: Any = None
        """The Work of the collective issued last; None until the first is issued."""
        self.computed = False
        """The next stage's computation has run (the first stage's, outside the lock, when the bucket started)."""
        self.watched = 0
        """The stage count when a completion callback was last put on ``work`` (0: none yet)."""

    def phase(self, name: str) -> Any:
        return self.watch.phase(name) if self.watch is not None else contextlib.nullcontext()

    def compute_first(self) -> None:
        """The first stage's computation (the pack), on the hook's thread and stream, when the bucket starts."""
        with self.phase(self.exchange.stages[0].compute_phase):
            self.exchange.stages[0].compute()
        self.computed = True

    def step(self) -> None:
        """Run the next stage, its collective before having finished: wait for that one (a CollectiveError naming it
        if it failed), then the stage's computation (unless ``computed`` already) and its collective."""
        if self.work is not None:
            waited(self.work.get_future(), self.exchange.stages[self.next - 1].collective_phase,
                   self.exchange.subject)
        stage = self.exchange.stages[self.next]
        if not self.computed:
            with self.phase(stage.compute_phase):
                stage.compute()
        with self.phase(stage.collective_phase):
            try:
                self.work = stage.issue()
            except RuntimeError as exc:  # a backend that fails at the issue (a peer known gone)
                raise collective_error(stage.collective_phase, self.exchange.subject, exc) from exc
        self.next += 1
        self.computed = False

    def wait_for(self, future: torch.futures.Future) -> None:
        """Wait, on this thread, until ``future`` (of the collective issued last) completes."""
        future.wait()

    @property
    def issued_all(self) -> bool:
        return self.next == len(self.exchange.stages)


class _Side:
    """A queue's side stream on one CUDA device, where its buckets' later stages wait for their collectives and run,
    so that the backward's stream never waits for one (see the module docstring)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.stream = streams.new_stream(device)
        self._in = streams.new_event()
        """Recorded on the hook's stream after a bucket's first computation, waited for by the side stream at once
        (so one event serves every bucket: each wait is enqueued before the next record)."""

    def events_in(self) -> None:
        """Order the side stream after the work the current stream has so far (the bucket's first computation)."""
        self._in.record(streams.current_stream(self.device))
        self.stream.wait_event(self._in)


class _SideRun(_Run):
    """A CUDA bucket's exchange in flight: every collective is issued, and every wait for one and every computation
    after the first runs, on the queue's side stream, which first waits for the hook's stream up to the first
    computation. The backward's stream waits for none of it; DDP's future (a CUDA future completed on a stream
    ordered after the unpack) orders whoever waits on it."""

    def __init__(self, exchange: StagedExchange, result: Any, watch: Any, side: _Side) -> None:
        super().__init__(exchange, result, watch)
        self.side = side

    def compute_first(self) -> None:
        super().compute_first()
        self.side.events_in()

    def step(self) -> None:
        with streams.use(self.side.stream):
            super().step()

    def wait_for(self, future: torch.futures.Future) -> None:
        with streams.use(self.side.stream):  # a CUDA future's wait also orders the current stream after it
            future.wait()


class _SideChunks:
    """The chunks of a CUDA bucket's exchange finishing (``ExchangeQueue._start_chunks_on``): each chunk's unpack
    records its event on the stream it ran on (its completion's); once every chunk finished, the side stream waits for
    those events and runs the exchange's ``finish``, and DDP's future completes there. The chunks finish on gloo's
    threads or inline: a lock counts them."""

    def __init__(self, exchange: ChunkedExchange, result: HookResult, side: _Side, events: Sequence[Any]) -> None:
        self.exchange, self.result, self.side, self.events = exchange, result, side, events
        self.errors: list = [None] * len(events)
        self.left = len(events)
        self.lock = threading.Lock()

    def chunk(self, k: int) -> "_ChunkResult":
        return _ChunkResult(self, k)

    def finished(self, k: int, error: Optional[BaseException]) -> None:
        """Chunk ``k`` finished (``error``: it failed); the last one finishes the bucket."""
        if error is None:
            self.events[k].record(streams.current_stream(self.side.device))
        else:
            self.errors[k] = error
        with self.lock:
            self.left -= 1
            if self.left:
                return
        failed = next((e for e in self.errors if e is not None), None)
        if failed is not None:  # the first chunk's error, in chunk order
            self.result.fail(failed)
            return
        try:
            with streams.use(self.side.stream):
                for event in self.events:
                    self.side.stream.wait_event(event)
                self.exchange.finish()
                self.result.set(self.exchange.buffer)
        except BaseException as exc:  # noqa: BLE001 - the failure reaches DDP through the bucket's future
            self.result.fail(exc)


class _ChunkResult:
    """One chunk's share of a CUDA bucket's result: set or failed once, like a HookResult."""

    __slots__ = ("chunks", "k", "done")

    def __init__(self, chunks: _SideChunks, k: int) -> None:
        self.chunks, self.k, self.done = chunks, k, False

    def set(self, _: Any) -> None:
        if not self.done:
            self.done = True
            self.chunks.finished(self.k, None)

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.done = True
            self.chunks.finished(self.k, exc)


class ExchangeQueue:
    """Issues a state's collectives in the same order on every rank (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: Deque[_Run] = collections.deque()
        """Runs with collectives left to issue, in the order their buckets started."""
        self._wanted = False
        """Set by a completion that found the lock held: whoever holds it tries again once it let go."""
        self._broken: Optional[BaseException] = None
        """The error of a bucket that failed before issuing all its collectives. Its peers issued them, so this
        rank's order no longer matches theirs: every later bucket and ``ordered`` block fails at once rather than
        pair its collectives with the wrong ones."""
        self._sides: Dict[Any, _Side] = {}
        """The side stream of each CUDA device this state's buckets are on, made at its first bucket's binding."""

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """Issue collectives of one's own inside this block: after every collective the queue has issued or owes
        (every pending bucket's remaining stages are issued first), and before any it issues next. Blocking ones
        may wait here: no completion issues a collective while the block runs."""
        try:
            with self._lock:
                self._drain()
                self._check_intact()
                yield
        finally:
            self._poke_if_wanted()

    def starter(self, exchange: Union[StagedExchange, ChunkedExchange]) -> Callable[..., torch.futures.Future]:
        """How ``exchange`` starts at every step, decided once (a plan keeps it): ``start``'s work for its kind and
        device, called as ``start(exchange, last, watch=None)``. A bucket on CUDA runs its later stages on this
        queue's side stream for its device, made here at its first bucket (binding runs inside ``ordered``: no
        lock taken)."""
        device = streams.device_of(exchange.buffer)
        chunked = isinstance(exchange, ChunkedExchange)
        if device is None:
            return self._start_chunks if chunked else self._start
        side = self._sides.get(device) or self._sides.setdefault(device, _Side(device))
        if chunked:
            return functools.partial(self._start_chunks_on, side, [streams.new_event() for _ in exchange.chunks])
        return functools.partial(self._start_on, side)

    def start(self, exchange: Union[StagedExchange, ChunkedExchange], last: bool,
              watch: Any = None) -> torch.futures.Future:
        """Start ``exchange``'s bucket; the future completes once DDP's bucket holds the mean, or fails with the
        first error (a chunked exchange's: the first failed chunk's). ``watch``: the bucket's telemetry (profiler
        ranges, timing) for this pass, or None. ``last``: the backward's last bucket, after which every pending
        stage is issued here (a chunked one's: its last chunk). A plan calls ``starter``'s choice instead."""
        return self.starter(exchange)(exchange, last, watch)

    def _start(self, exchange: StagedExchange, last: bool, watch: Any = None) -> torch.futures.Future:
        """``start`` for a bucket not on CUDA."""
        result = HookResult()
        return self._begin(_Run(exchange, result, watch), last, result)

    def _start_on(self, side: _Side, exchange: StagedExchange, last: bool, watch: Any = None) -> torch.futures.Future:
        """``start`` for a bucket on ``side``'s device."""
        result = streams.result(side.device)
        return self._begin(_SideRun(exchange, result, watch, side), last, result)

    def _begin(self, run: _Run, last: bool, result: HookResult) -> torch.futures.Future:
        """Run ``run``'s first computation, then queue it (its first collective goes out at once unless an earlier
        bucket owes one on its group)."""
        exchange = run.exchange
        try:
            # The first computation (the pack) touches this bucket's buffers only: outside the lock, so that
            # completions meanwhile issue what they unblock.
            run.compute_first()
        except Exception as exc:  # noqa: BLE001 - the failure reaches DDP through the bucket's future
            with self._lock:
                self._break(exc)
            run.result.fail(exc)
            return result.future
        try:
            with self._lock:
                try:
                    self._check_intact(exchange.subject)
                except Exception as exc:  # noqa: BLE001 - the failure reaches DDP through the bucket's future
                    run.result.fail(exc)
                    return result.future
                # Its first collective goes out now, or, where an earlier bucket still owes one on its group, once
                # that one is issued: by a completion, without holding the backward here.
                self._runs.append(run)
                if last:
                    self._drain()
                else:
                    self._advance()
                self._watch_works()
        finally:
            self._poke_if_wanted()
        return result.future

    def _start_chunks(self, exchange: ChunkedExchange, last: bool, watch: Any = None) -> torch.futures.Future:
        """``start`` for a bucket cut into chunks, not on CUDA: every chunk in order (``last`` applies to the last
        chunk); ``exchange.finish`` runs once every chunk finished."""
        result = HookResult()
        count = len(exchange.chunks)
        futures = [self._start(chunk, last and k == count - 1, watch) for k, chunk in enumerate(exchange.chunks)]

        def finish(_: torch.futures.Future) -> None:
            try:
                for future in futures:
                    future.wait()  # raises the first failed chunk's error
                exchange.finish()
                result.set(exchange.buffer)
            except BaseException as exc:  # noqa: BLE001
                result.fail(exc)

        torch.futures.collect_all(futures).then(finish)
        return result.future

    def _start_chunks_on(self, side: _Side, events: Sequence[Any], exchange: ChunkedExchange, last: bool,
                         watch: Any = None) -> torch.futures.Future:
        """``start`` for a bucket cut into chunks on ``side``'s device (``events``: one per chunk, kept by the plan):
        every chunk in order on the side stream, finished there once every chunk's unpack ran (``_SideChunks``)."""
        result = streams.result(side.device)
        chunks = _SideChunks(exchange, result, side, events)
        count = len(exchange.chunks)
        for k, chunk in enumerate(exchange.chunks):
            self._begin(_SideRun(chunk, chunks.chunk(k), watch, side), last and k == count - 1, result)
        return result.future

    # ---- progress ------------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Issue every pending stage, waiting as needed. Called with the lock held; it lets go of it while it waits
        for the earliest bucket's collective (which always lets something go out next), so that completions
        meanwhile issue what they unblock: a later bucket's collective on another group never waits for an
        earlier bucket's to finish."""
        while True:
            self._advance()
            if not self._runs:
                return
            earliest = self._runs[0]
            future = earliest.work.get_future()
            self._lock.release()
            try:
                earliest.wait_for(future)  # a CUDA bucket's on its side stream: the backward's never waits
            except Exception:  # noqa: BLE001 - the next _advance fails the bucket with this error
                pass
            finally:
                self._lock.acquire()

    def _advance(self) -> None:
        """Without waiting: every stage whose collective before has finished and whose group no earlier bucket still
        owes a collective on, bucket by bucket in order."""
        owed: set = set()
        for run in list(self._runs):
            while not run.issued_all:
                if id(run.exchange.stages[run.next].group) in owed or (
                        run.work is not None and not run.work.get_future().done()):
                    break
                if not self._step(run):
                    return  # every pending bucket failed with it
            if run.issued_all:
                self._runs.remove(run)
                self._finish_when_done(run)
            else:
                owed |= run.exchange.groups_from[run.next]

    def _step(self, run: _Run) -> bool:
        """Run ``run``'s next stage, its collective before having finished; False, with every pending bucket
        failed, on an error."""
        try:
            run.step()
        except Exception as exc:  # noqa: BLE001 - every failure must reach DDP through the bucket's future
            run.result.fail(exc)
            self._break(exc)
            return False
        return True

    def _break(self, exc: BaseException) -> None:
        """A bucket failed with collectives left unissued: fail every pending bucket and everything after."""
        if self._broken is None:
            self._broken = exc
        for run in self._runs:
            run.result.fail(self._broken_error(run.exchange.subject))
        self._runs.clear()

    def _broken_error(self, subject: str) -> RuntimeError:
        """The error of what comes after a failed exchange: it leads with that failure's own message."""
        return RuntimeError(f"{self._broken} ({subject} not exchanged: another bucket's exchange failed on this "
                            "rank first, leaving collectives its peers issued unissued here, so this state's "
                            "collectives no longer pair with theirs; the job must stop, or build a new state on new "
                            "groups)")

    def _check_intact(self, subject: str = "a collective of this state") -> None:
        if self._broken is not None:
            raise self._broken_error(subject)

    def _finish_when_done(self, run: _Run) -> None:
        """Unpack and complete ``run``'s result on its last collective's completion: on CUDA, torch runs the callback
        on a stream from its pool that waited for the collective, so the unpack runs there, and a CUDA result
        completes there (DDP's wait orders its stream after it)."""
        exchange, result = run.exchange, run.result
        unpack = run.watch.unpack(exchange.finish) if run.watch is not None else exchange.finish
        collective = exchange.stages[-1].collective_phase

        def finish(fut: torch.futures.Future) -> None:
            try:
                completed(fut, collective, exchange.subject)
                unpack()
                result.set(exchange.buffer)
            except BaseException as exc:  # noqa: BLE001
                result.fail(exc)

        run.work.get_future().then(finish)

    def _watch_works(self) -> None:
        """Have the pending runs' latest collectives call back on completion, to issue what they unblock."""
        for run in self._runs:
            if run.watched != run.next:
                run.watched = run.next
                run.work.get_future().then(lambda _: self._poke())

    def _poke(self) -> None:
        """A collective finished (gloo's thread, or inline): issue what it unblocks, never waiting for the lock."""
        self._wanted = True
        while self._wanted:
            if not self._lock.acquire(blocking=False):
                return  # the holder tries again after it let go (_poke_if_wanted)
            try:
                self._wanted = False
                self._advance()
                self._watch_works()
            except BaseException as exc:  # noqa: BLE001 - on gloo's thread nobody would see it: fail the buckets
                self._break(exc)
            finally:
                self._lock.release()

    def _poke_if_wanted(self) -> None:
        if self._wanted:
            self._poke()
