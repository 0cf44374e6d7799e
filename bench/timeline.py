"""A timeline of one DDP step's exchange on rank 0: when each bucket's hook was called, when each stage of each of
its chunks computed, was issued and completed, and when the backward returned; saved as JSON and drawn as a PNG.

    python -m bench.cluster ... -- python -m bench.ddp_step ... --timeline      # one recorded step per variant
    python -m bench.timeline bench/out/timeline-<variant>-<time>.json           # draw its PNG again

``bench.ddp_step --timeline`` records one step of each triton variant after its timed ones (the plans bound, DDP's
buckets rebuilt), on every rank; rank 0 saves what it saw. Each bucket's ``Plan.run`` and its exchange's stages are
wrapped for that step only (bench code: the runtime has no recording of its own), so the step pays a few
microseconds per stage for the clock. The exposed exchange is the time from the backward's last bucket reaching the
hook (its last gradient computed: the backward's last operation done) to the backward's return; beside it the
link-byte time of that bucket's cross-node exchange, its bytes through one node's link (``cost_model``'s
``two_level_node_bytes``) at ``--link-mbit``, and the link-byte time of every chunk still to cross when the last
bucket reached the hook (the earlier buckets' too, where the backward was shorter than their time on the link).

The plot: one row per bucket and stage (the node sum, each collective between nodes, the gather; the flat formats'
collectives), a bar from each chunk's issue to its completion (chunks in alternating shades, numbered), thin bars
for computations, and lines at the last bucket's hook call and at the backward's return. Needs matplotlib (the
``bench`` extra); without it the JSON alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PLOT_MISSING, progress, pyplot, save_json  # noqa: E402


class Recorder:
    """Wraps a state's plans (``Plan.run``) and their exchanges' stages to note times (``time.perf_counter``,
    seconds) for one step; ``restore`` puts everything back."""

    def __init__(self, state: Any) -> None:
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self.lock = threading.Lock()
        self.events: List[Dict[str, Any]] = []
        self.hooks: List[Dict[str, Any]] = []
        self.undo: List[Callable[[], None]] = []
        for plan in list(state.plans.values()):
            self._wrap_plan(plan)

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def note(self, **event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def _wrap_plan(self, plan: Any) -> None:
        index = plan.record.index
        run = plan.run

        def timed_run(last: bool) -> Any:
            self.hooks.append({"bucket": index, "last": last, "ms": self.now(), "elements": plan.buffer.numel(),
                               "wire_format": plan.record.wire_format})
            future = run(last)
            future.then(lambda _: self.note(bucket=index, chunk=None, row="bucket done", kind="done",
                                            start=self.now(), end=self.now()))
            return future

        object.__setattr__(plan, "run", timed_run)
        self.undo.append(lambda: object.__delattr__(plan, "run"))
        exchange = plan.exchange
        chunks = getattr(exchange, "chunks", (exchange,))
        if plan.queue is None:
            return  # one all-reduce, issued by the plan: its hook call and completion only
        for k, chunk in enumerate(chunks):
            self._wrap_chunk(index, k if len(chunks) > 1 else 0, chunk)

    def _wrap_chunk(self, index: Any, k: int, chunk: Any) -> None:
        stages, finish = chunk.stages, chunk.finish
        wrapped = []
        for stage in stages:
            wrapped.append(stage._replace(compute=self._timed(index, k, stage.compute_phase, stage.compute),
                                          issue=self._issued(index, k, stage.collective_phase, stage.issue)))
        chunk.stages = tuple(wrapped)
        chunk.finish = self._timed(index, k, "unpack", finish)

        def restore() -> None:
            chunk.stages, chunk.finish = stages, finish

        self.undo.append(restore)

    def _timed(self, index: Any, k: int, name: str, call: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            start = self.now()
            call()
            self.note(bucket=index, chunk=k, row=name, kind="compute", start=start, end=self.now())

        return timed

    def _issued(self, index: Any, k: int, name: str, issue: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            start = self.now()
            work = issue()
            work.get_future().then(lambda _: self.note(bucket=index, chunk=k, row=name, kind="collective",
                                                       start=start, end=self.now()))
            return work

        return timed

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


def record_step(state: Any, zero_grad: Callable[[], None], forward: Callable[[], Any],
                after: Callable[[], None]) -> Dict[str, Any]:
    """One step with ``state``'s plans recorded: ``zero_grad()``, ``forward()`` (the loss), its backward timed,
    ``after()`` (clip, optimizer). Returns the events, the hook calls and the backward's start and end (ms)."""
    recorder = Recorder(state)
    try:
        zero_grad()
        loss = forward()
        start = recorder.now()
        loss.backward()
        end = recorder.now()
        after()
    finally:
        recorder.restore()
    return {"events": sorted(recorder.events, key=lambda e: e["start"]), "hooks": recorder.hooks,
            "backward_start": start, "backward_end": end, "origin_unix_s": recorder.wall0}


def last_hook_unix_s(recorded: Dict[str, Any]) -> Optional[float]:
    """When the backward's last bucket reached the hook, in the machine's wall clock (which every rank of the
    emulated cluster shares), or None."""
    last = [h["ms"] for h in recorded["hooks"] if h["last"]]
    return recorded["origin_unix_s"] + last[-1] / 1e3 if last else None


def summarize(recorded: Dict[str, Any], node_bytes: Callable[[int], Optional[int]],
              link_mbit: Optional[float]) -> Dict[str, Any]:
    """The exposed exchange (backward end minus the last bucket's hook call); given each bucket's bytes through a
    node's link (``node_bytes(elements)``) and the link's rate, the last bucket's link-byte time, and the link-byte
    time of every chunk whose cross-node exchange was still to finish at the last hook call (a bucket's bytes shared
    evenly by its chunks): the least a link of that rate could have left exposed."""
    last = [h for h in recorded["hooks"] if h["last"]]
    if not last or "backward_end" not in recorded:
        return {}
    at = last[-1]["ms"]
    out: Dict[str, Any] = {"exposed_ms": recorded["backward_end"] - at, "last_bucket_elements": last[-1]["elements"]}
    if not link_mbit or node_bytes(last[-1]["elements"]) is None:
        return out
    per_ms = link_mbit * 1e6 / 8 / 1e3  # bytes a millisecond
    out["last_bucket_link_ms"] = node_bytes(last[-1]["elements"]) / per_ms
    out["exposed_over_link"] = out["exposed_ms"] / out["last_bucket_link_ms"]
    crossed: Dict[Any, Dict[Any, float]] = {}
    for e in recorded["events"]:
        if e["kind"] == "collective" and e["row"].startswith("cross_"):
            chunks = crossed.setdefault(e["bucket"], {})
            chunks[e["chunk"]] = max(chunks.get(e["chunk"], 0.0), e["end"])
    pending = 0.0
    for h in recorded["hooks"]:
        done = crossed.get(h["bucket"], {})
        if done:
            late = sum(1 for end in done.values() if end > at)
            pending += node_bytes(h["elements"]) * late / len(done) / per_ms
    out["pending_link_ms"] = pending
    if pending:
        out["exposed_over_pending_link"] = out["exposed_ms"] / pending
    return out


def peers_lag_ms(own: Optional[float], every_rank: List[Optional[float]]) -> Optional[float]:
    """How long after this rank the last of ``every_rank`` reached its last hook (``last_hook_unix_s``), in ms: the
    part of the exposed exchange this rank spent waiting for a peer's backward, not for the exchange."""
    known = [t for t in every_rank if t is not None]
    return None if own is None or not known else max(0.0, (max(known) - own) * 1e3)


def plot(payload: Dict[str, Any], path: Path) -> Optional[str]:
    """Draw the timeline of ``payload`` (what ``record_step`` returned, with ``variant``) into ``path``; None, or
    why there is no plot."""
    plt = pyplot()
    if plt is None:
        return PLOT_MISSING
    events = [e for e in payload["events"] if e["kind"] != "done"]
    rows = list(dict.fromkeys((e["bucket"], e["row"]) for e in events))
    order = {row: i for i, row in enumerate(sorted(rows, key=lambda r: (-(r[0] or 0), _stage_rank(r[1]))))}
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.32 * len(order) + 1.5)))
    for e in events:
        y = order[(e["bucket"], e["row"])]
        shade = ("tab:blue", "tab:cyan") if e["kind"] == "collective" else ("tab:orange", "gold")
        height = 0.7 if e["kind"] == "collective" else 0.35
        ax.barh(y, max(e["end"] - e["start"], 0.05), left=e["start"], height=height,
                color=shade[(e["chunk"] or 0) % 2], edgecolor="black", linewidth=0.3)
        if e["kind"] == "collective" and e["end"] - e["start"] > 0:
            ax.text(e["start"], y, str(e["chunk"]), fontsize=5, va="center")
    for h in payload["hooks"]:
        ax.axvline(h["ms"], color="grey", linewidth=0.4, linestyle=":")
    last = [h for h in payload["hooks"] if h["last"]]
    if last:
        ax.axvline(last[-1]["ms"], color="red", linewidth=1.0, label="last bucket's hook (backward compute done)")
    if "backward_end" in payload:
        ax.axvline(payload["backward_end"], color="black", linewidth=1.0, label="backward returns")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"bucket {b}: {r}" for (b, r), _ in sorted(order.items(), key=lambda kv: kv[1])],
                       fontsize=7)
    summary = payload.get("summary", {})
    title = f"{payload.get('variant', '')}: rank 0, one step (issued to completed; chunks numbered)"
    if "exposed_ms" in summary:
        title += f"; exposed {summary['exposed_ms']:.0f} ms"
        if "last_bucket_link_ms" in summary:
            title += (f", last bucket's link-byte time {summary['last_bucket_link_ms']:.0f} ms "
                      f"({summary['exposed_over_link']:.2f}x)")
        if summary.get("pending_link_ms"):
            title += (f", still to cross at the last hook {summary['pending_link_ms']:.0f} ms "
                      f"({summary['exposed_over_pending_link']:.2f}x)")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms since the step began")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


_STAGES = ("pack", "all_reduce", "reduce_scatter", "cross_pack", "cross_all_reduce", "cross_all_to_all",
           "cross_reduce", "cross_all_gather", "cross_unpack", "all_to_all", "reduce", "all_gather", "unpack")


def _stage_rank(name: str) -> int:
    return _STAGES.index(name) if name in _STAGES else len(_STAGES)


def save(variant: str, payload: Dict[str, Any], out_dir: Optional[Path]) -> Path:
    """Save ``payload`` as ``timeline-<variant>-<time>.json`` and its plot beside it; returns the JSON's path."""
    path = save_json(f"timeline-{variant}", {"variant": variant, **payload}, out_dir)
    message = plot({"variant": variant, **payload}, path.with_suffix(".png"))
    progress(message or f"timeline of {variant}: {path} and {path.with_suffix('.png')}")
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="draw the PNG of a timeline JSON that bench.ddp_step --timeline saved")
    p.add_argument("json", type=Path)
    args = p.parse_args(argv)
    payload = json.loads(args.json.read_text())
    message = plot(payload, args.json.with_suffix(".png"))
    print(message or f"saved {args.json.with_suffix('.png')}")
    return 2 if message else 0


if __name__ == "__main__":
    sys.exit(main())
