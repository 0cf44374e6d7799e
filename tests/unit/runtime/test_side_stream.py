"""A CUDA bucket's staged exchange never makes the backward's stream wait for a collective, modelled without a GPU.

Tier: unit, no process group, no device. A recorder stands in for torch.cuda's streams and events (``exchange.streams``)
and for NCCL: each stand-in collective completes at launch, as NCCL's futures do, and its future's ``wait()`` makes
the recorder's current stream wait for it, its ``then`` runs the callback on a pool stream that waited for it (torch's
CUDA futures). Every kernel call, event, wait, collective and the completion of DDP's future is a node of a graph of
what runs after what; the test reads that graph. The exchanges are the real ones of each staged format (flat and
two-level, whole and cut into chunks) on CPU tensors, their collectives replaced by the stand-ins and their kernels
by recorded calls, started through a ``Plan`` as the hook starts them.
"""

import contextlib

import pytest
import torch

from ddp_triton.formats import WireFormat
from ddp_triton.kernels import block_layout
from ddp_triton.runtime import exchange as exchange_module
from ddp_triton.runtime.collective_errors import HookResult
from ddp_triton.runtime.exchange import ChunkedExchange, ExchangeQueue
from ddp_triton.runtime.nodes import NodeGroups
from ddp_triton.runtime.plan import Plan
from ddp_triton.runtime.residuals import ResidualStore
from ddp_triton.runtime.telemetry import BucketRecord
from ddp_triton.runtime.two_level import two_level_exchange
from ddp_triton.runtime.wire_exchanges import (block_fp8_exchange, chunked_fp8_exchange, float32_sum_exchange,
                                               fp8_chunk_layouts)

WORLD, NODE, CROSS, GATHER = "world", "node", "cross", "gather"  # stand-ins for process groups
RANKS = 4  # flat: more than two ranks, so the 16-bit formats with float32 sums stage
SIZES = (1000, 700, 129, 300)  # the bucket's parameters


class Op:
    """Something a stream runs (a kernel, a wait, an event's record) or a collective, after the ops in ``after``."""

    def __init__(self, kind, label, after):
        self.kind, self.label, self.after = kind, label, [op for op in after if op is not None]

    def __repr__(self):
        return f"{self.kind} {self.label}"

    def ancestors(self):
        """Every op this one runs after, directly or through others."""
        seen, found, todo = set(), [], list(self.after)
        while todo:
            op = todo.pop()
            if id(op) not in seen:
                seen.add(id(op))
                found.append(op)
                todo.extend(op.after)
        return found


class Stream:
    def __init__(self, name):
        self.name, self.last, self.ops = name, None, []

    def add(self, kind, label, *after):
        op = Op(kind, f"{label} on {self.name}", [self.last, *after])
        self.last = op
        self.ops.append(op)
        return op

    def wait_event(self, event):
        self.add("wait", f"for event recorded {event.op}", event.op)

    def __repr__(self):
        return self.name


class Event:
    def __init__(self, recorder):
        self.recorder, self.op = recorder, None

    def record(self, stream=None):
        self.op = (stream or self.recorder.current).add("record", "event")


class Future:
    """NCCL's future of a collective: complete at launch, CUDA-aware."""

    def __init__(self, recorder, collective):
        self.recorder, self.collective = recorder, collective

    def done(self):
        return True

    def value(self):
        return None

    def wait(self):
        self.recorder.current.add("wait", f"for {self.collective}", self.collective)

    def then(self, callback):
        pool = self.recorder.stream("pool stream")
        pool.add("wait", f"for {self.collective}", self.collective)
        with self.recorder.use(pool):
            callback(self)


class Work:
    def __init__(self, future):
        self.future = future

    def get_future(self):
        return self.future


class Recorder:
    """``exchange.streams`` on a machine with one pretend GPU, recording what each stream runs after what."""

    def __init__(self):
        self.streams = []
        self.compute = self.current = self.stream("compute stream")
        self.group_last = {}
        self.kernels, self.collectives, self.results = {}, {}, []

    # ---- the calls exchange.py makes through its ``streams`` object --------------------------------------------

    def device_of(self, buffer):
        return "cuda:0"  # every bucket is on the pretend GPU

    def new_stream(self, device):
        return self.stream("side stream")

    def new_event(self):
        return Event(self)

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def result(self, device):
        return RecordedResult(self)

    # ---- the rest of the pretend GPU ----------------------------------------------------------------------------

    def stream(self, name):
        stream = Stream(f"{name} {len(self.streams)}")
        self.streams.append(stream)
        return stream

    # ---- stand-ins for the exchange's kernels and collectives --------------------------------------------------

    def kernel(self, key, call):
        def run():
            self.kernels[key] = self.current.add("kernel", key)
            call()
        return run

    def issue(self, key, group):
        def run():
            # NCCL's stream waits for the current stream at the issue, and runs its group's collectives in order.
            collective = Op("collective", f"{key} on {group}", [self.current.last, self.group_last.get(group)])
            self.collectives[key] = self.group_last[group] = collective
            return Work(Future(self, collective))
        return run

    def backward_kernel(self, label):
        """What the backward runs next on its stream, after the hook returned."""
        return self.compute.add("kernel", f"backward {label}")


class RecordedResult(HookResult):
    """DDP's future as a CUDA future: completing it records an event on the current stream, which DDP waits for."""

    __slots__ = ("recorder",)

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def set(self, value):
        self.recorder.results.append(self.recorder.current.add("record", "DDP's future completed"))
        super().set(value)


def recorded(exchange, rec, tag):
    """``exchange`` with its kernels recorded and its collectives the stand-ins, keyed by ``tag`` (bucket, chunk)."""
    if isinstance(exchange, ChunkedExchange):
        for k, chunk in enumerate(exchange.chunks):
            recorded(chunk, rec, (*tag, k))
        exchange.finish = rec.kernel((*tag, "finish"), exchange.finish)
        return exchange
    exchange.stages = tuple(
        stage._replace(compute=rec.kernel((*tag, "compute", i), stage.compute),
                       issue=rec.issue((*tag, "collective", i), stage.group))
        for i, stage in enumerate(exchange.stages))
    exchange.finish = rec.kernel((*tag, "finish"), exchange.finish)
    return exchange


def bucket(seed):
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(seed))


def flat(name, chunks):
    wire = WireFormat.parse(name)

    def build(buffer):
        if not wire.block_scaled:
            return float32_sum_exchange(buffer, wire, WORLD, RANKS, 1 / RANKS, 1.0, None)
        if chunks == 1:
            layout = block_layout(SIZES, RANKS)
            residual = (torch.zeros(layout.n_elements), torch.zeros(layout.rows_per_shard * 128)) \
                if wire.error_feedback else None
            return block_fp8_exchange(buffer, wire, layout, WORLD, RANKS, 1 / RANKS, residual, None)
        offsets, layouts = fp8_chunk_layouts(SIZES, RANKS, chunks)
        assert len(layouts) == chunks
        return chunked_fp8_exchange(buffer, wire, offsets, layouts, WORLD, RANKS, 1 / RANKS, None,
                                    torch.zeros(2))
    return build


def two_level(name, chunks, reduce_scatter=True):
    wire = WireFormat.parse(name)
    nodes = NodeGroups(n_nodes=3, local_size=2, node_index=0, local_index=1, node_group=NODE, cross_group=CROSS,
                       gather_group=GATHER, reduce_scatter=reduce_scatter)

    def build(buffer):
        exchange, _, _ = two_level_exchange(buffer, tuple(range(len(SIZES))), SIZES, wire, nodes, WORLD, 1 / 6, 1.0,
                                            torch.zeros(2), ResidualStore(), chunks)
        assert isinstance(exchange, ChunkedExchange) == (chunks > 1)
        return exchange
    return build


CASES = [
    pytest.param(flat("bf16+fp32sum", 1), id="bf16+fp32sum"),
    pytest.param(flat("fp16+fp32sum", 1), id="fp16+fp32sum"),
    pytest.param(flat("fp8e4m3+ef", 1), id="fp8e4m3+ef"),
    pytest.param(flat("fp8e5m2", 1), id="fp8e5m2"),
    pytest.param(flat("fp8e4m3", 3), id="fp8e4m3-chunks"),
    pytest.param(two_level("two-level bf16", 1), id="two-level-bf16"),
    pytest.param(two_level("two-level bf16+fp32sum", 1), id="two-level-bf16+fp32sum"),
    pytest.param(two_level("two-level fp8e4m3", 1), id="two-level-fp8e4m3"),
    pytest.param(two_level("two-level fp8e4m3", 1, reduce_scatter=False), id="two-level-fp8e4m3-node-all-reduce"),
    pytest.param(two_level("two-level bf16", 3), id="two-level-bf16-chunks"),
    pytest.param(two_level("two-level bf16+fp32sum", 3), id="two-level-bf16+fp32sum-chunks"),
    pytest.param(two_level("two-level fp8e4m3", 3), id="two-level-fp8e4m3-chunks"),
]


def runs_of(exchange, tag):
    """(tag, StagedExchange) of each run: the exchange itself, or each of its chunks."""
    if isinstance(exchange, ChunkedExchange):
        return [((*tag, k), chunk) for k, chunk in enumerate(exchange.chunks)]
    return [(tag, exchange)]


@pytest.mark.parametrize("build", CASES)
def test_the_backward_stream_never_waits_for_a_collective(monkeypatch, build):
    """Three buckets of one backward (the last drains the queue), each followed by the backward's next kernel."""
    rec = Recorder()
    monkeypatch.setattr(exchange_module, "streams", rec)
    queue = ExchangeQueue()
    exchanges, futures = [], []
    for b in range(3):
        buffer = bucket(b)
        exchange = recorded(build(buffer), rec, (b,))
        plan = Plan(buffer, exchange, queue, exchange.held[0], None, None, None, None,
                    BucketRecord(b, "staged", {}, 2))
        futures.append(plan.run(last=b == 2))
        rec.backward_kernel(f"after bucket {b}")
        exchanges.append(exchange)

    for op in rec.compute.ops:
        waited_for = [a for a in op.ancestors() if a.kind == "collective"]
        assert not waited_for, f"the backward's stream runs {op} after the hook's collectives {waited_for}"

    # What it must still wait for: each stage's kernel after the collective before it, each collective after its
    # stage's kernel, the unpack after the last collective, and DDP's future after every unpack.
    for b, exchange in enumerate(exchanges):
        assert futures[b].done() and futures[b].value() is exchange.buffer
        runs = runs_of(exchange, (b,))
        for tag, run in runs:
            for i in range(len(run.stages)):
                after = set(map(id, rec.collectives[(*tag, "collective", i)].ancestors()))
                assert id(rec.kernels[(*tag, "compute", i)]) in after, (tag, i)
                if i:
                    earlier = rec.collectives[(*tag, "collective", i - 1)]
                    assert earlier in rec.kernels[(*tag, "compute", i)].ancestors(), (tag, i)
            assert rec.collectives[(*tag, "collective", len(run.stages) - 1)] in rec.kernels[
                (*tag, "finish")].ancestors(), tag
        unpacks = [rec.kernels[(*tag, "finish")] for tag, _ in runs]
        if isinstance(exchange, ChunkedExchange):
            unpacks.append(rec.kernels[(b, "finish")])
        assert any(all(unpack in done.ancestors() for unpack in unpacks) for done in rec.results), \
            f"DDP's future for bucket {b} completes before its unpack: {rec.results}"
