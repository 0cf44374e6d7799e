"""Supervise one job on a built cluster: start its ranks in the node namespaces, pump their output, stop them at a
timeout, a failing rank or a signal, and remove the network whatever happened.

Ranks: P per node, with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR = node 0's
eth0 address, MASTER_PORT, TORCHELASTIC_*), and GLOO_SOCKET_IFNAME=eth0 (likewise NCCL_ and TP_SOCKET_IFNAME) so
gloo binds the node's link. Ranks of one node reach each other at their own eth0 address, which the kernel routes
over the namespace's loopback: only traffic between nodes crosses the shaped links.

- ``--launcher torchrun`` (default): the real multi-node path, one ``torchrun --nnodes K --node-rank i
  --nproc-per-node P --master-addr ... --no-python COMMAND`` per node (static rendezvous on node 0). Each rank's
  output is kept under ``--log-dir`` (torchrun's own per-rank files) and echoed, prefixed with its node.
- ``--launcher env``: this tool starts the ranks itself with the same variables (no elastic agent: about two
  seconds less per node, and the command need not use torch). Each rank's output goes to ``rank<r>.log``.

Bounded and clean: the job ends at ``--timeout`` (exit 124); when a rank fails the others get ``--grace``
seconds (5) to stop and are then killed; each process starts its own process group, killed as a group (SIGTERM,
then SIGKILL), and whatever still runs inside the run's namespaces is killed before they are deleted; ranks also
die with this tool (PR_SET_PDEATHSIG) if it is killed outright. SIGINT, SIGTERM and SIGHUP end the job the same
way; the namespaces (and with them every link) are deleted in a ``finally`` whatever happened, and the tool checks
that none is left. A run killed with SIGKILL cannot clean up: its namespaces stay until ``--reap-stale``.

Link counters: each node's eth0 counters are read from the kernel just before the job's processes start and just
after they have ended or been killed; the run's summary gives what each node sent and received in between (bytes
and packets, and the totals), on stderr as a table and in ``--summary``'s JSON under ``link_counters``. Only the
job runs in a node's namespace, so that is the job's traffic between nodes, headers, ARP and handshakes included. A
node whose counters could not be read or compared is listed with the reason and left out of the totals.

Exit status: the job's (0, or the first failing rank's; 128+N for a rank killed by signal N); 2 bad usage or a
missing prerequisite (not root, no iproute2, no netem for --delay), named on one line; 1 the emulated network
could not be built or removed, or ``--summary`` could not be written; 124 timeout; 130 SIGINT, 143 SIGTERM, 129
SIGHUP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ddp_triton.safe_write import OutputError, atomic_write_text

from bench.cluster.control import ENV as CONTROL_ENV
from bench.cluster.control import LinkControl
from bench.cluster.network import (NODE_IF, Cluster, ClusterSpec, CounterError, LinkCounters, SetupError, Unavailable,
                                   check_prerequisites, parse_rate)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124

#: torchrun's default port. Node 0's namespace is new and holds only this job, and the port lies below the
#: ephemeral range (32768-60999 unless changed) the job's own connections draw from: nothing else can hold it.
MASTER_PORT = 29500

#: After one rank fails, the others get this long to notice and stop before they are killed.
FAIL_GRACE_S = 5.0
#: SIGTERM, then this long, then SIGKILL.
TERM_GRACE_S = 5.0
#: Default bound on the whole job.
DEFAULT_TIMEOUT_S = 900.0

#: What torchrun sets for its workers; stripped from the caller's environment so an outer launch cannot leak in.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "NODE_RANK")


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived; raised from the handler so that every ``finally`` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --------------------------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One process the job started (a torchrun per node, or a rank), with its output pipe and its log."""

    label: str
    """``n{i}`` (torchrun: one per node) or ``r{rank}`` (env launcher)."""
    node: int
    popen: subprocess.Popen
    log_path: Path
    log: IO[bytes]
    buffer: bytes = b""
    open: bool = True

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the process leads its own group


def _exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _clean_env(extra: Dict[str, str]) -> Dict[str, str]:
    """This process's environment without an outer launch's variables, the node's link for the collectives, then
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update({"GLOO_SOCKET_IFNAME": NODE_IF, "NCCL_SOCKET_IFNAME": NODE_IF, "TP_SOCKET_IFNAME": NODE_IF,
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _set_pdeathsig() -> None:
    """In the child before exec: die with this process, even if it is SIGKILLed and cannot clean up."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Job:
    """The ranks of one job on a cluster: started, their output pumped to logs and the terminal, bounded in time."""

    def __init__(self, cluster: Cluster, command: Sequence[str], launcher: str, log_dir: Path,
                 node_env: Sequence[Tuple[str, str]] = (), echo: bool = True, grace_s: float = FAIL_GRACE_S):
        self.cluster, self.command, self.launcher = cluster, list(command), launcher
        self.log_dir, self.node_env, self.echo, self.grace_s = log_dir, list(node_env), echo, grace_s
        self.procs: List[Proc] = []
        self.failed: Optional[Proc] = None

    def _node_env(self, node: int) -> Dict[str, str]:
        return {k: v.replace("{node}", str(node)) for k, v in self.node_env}

    def _spawn(self, label: str, node: int, argv: List[str], env: Dict[str, str], log_name: str) -> None:
        log_path = self.log_dir / log_name
        log = open(log_path, "wb")
        popen = subprocess.Popen([self.cluster.ip, "netns", "exec", self.cluster.node_ns[node], *argv], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_set_pdeathsig)
        os.set_blocking(popen.stdout.fileno(), False)
        self.procs.append(Proc(label, node, popen, log_path, log))

    def start(self) -> None:
        spec = self.cluster.spec
        k, p = spec.nodes, spec.procs_per_node
        if self.launcher == "torchrun":
            for i in range(k):
                argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={k}", f"--node-rank={i}",
                        f"--nproc-per-node={p}", f"--master-addr={self.cluster.master_addr}",
                        f"--master-port={MASTER_PORT}", "--max-restarts=0", f"--rdzv-id={self.cluster.name}",
                        f"--log-dir={self.log_dir / f'node{i}'}", "--redirects=3", "--tee=3", "--no-python",
                        *self.command]
                self._spawn(f"n{i}", i, argv, _clean_env(self._node_env(i)), f"node{i}.log")
            return
        for i in range(k):
            for local in range(p):
                rank = i * p + local
                env = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(k * p),
                       "LOCAL_WORLD_SIZE": str(p), "GROUP_RANK": str(i), "GROUP_WORLD_SIZE": str(k),
                       "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(k * p), "ROLE_NAME": "default",
                       "MASTER_ADDR": self.cluster.master_addr, "MASTER_PORT": str(MASTER_PORT),
                       "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                       "TORCHELASTIC_RUN_ID": self.cluster.name,
                       # no agent hosts a store: rank 0's init_process_group does, as without torchrun
                       "TORCHELASTIC_USE_AGENT_STORE": "False",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
                if p > 1 and "OMP_NUM_THREADS" not in os.environ:
                    env["OMP_NUM_THREADS"] = "1"  # torchrun's rule for several processes per node
                env.update(self._node_env(i))
                self._spawn(f"r{rank}", i, list(self.command), _clean_env(env), f"rank{rank}.log")

    def _emit(self, proc: Proc, data: bytes, final: bool = False) -> None:
        proc.log.write(data)
        if not self.echo:
            return
        proc.buffer += data
        *lines, proc.buffer = proc.buffer.split(b"\n")
        if final and proc.buffer:
            lines, proc.buffer = lines + [proc.buffer], b""
        if lines:
            prefix = f"[{proc.label}] ".encode()
            sys.stdout.buffer.write(b"".join(prefix + line + b"\n" for line in lines))
            sys.stdout.buffer.flush()

    def _pump(self, sel: selectors.BaseSelector, wait_s: float) -> None:
        for key, _ in sel.select(timeout=wait_s):
            proc: Proc = key.data
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if data:
                self._emit(proc, data)
            else:
                sel.unregister(key.fd)
                proc.open = False
                self._emit(proc, b"", final=True)

    def wait(self, deadline: float, poll: Optional[Callable[[], Optional[str]]] = None) -> Optional[int]:
        """Pump output until every process has exited (None at the deadline). The job's exit status. ``poll``:
        called between reads (the link-rate control), a line to print when it did something."""
        sel = selectors.DefaultSelector()
        for proc in self.procs:
            sel.register(proc.popen.stdout.fileno(), selectors.EVENT_READ, proc)
        kill_at: Optional[float] = None
        drain_until: Optional[float] = None
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return None
                running = [p for p in self.procs if p.popen.poll() is None]
                if self.failed is None:
                    self.failed = next((p for p in self.procs if p.popen.returncode not in (None, 0)), None)
                    if self.failed is not None and running:
                        kill_at = now + self.grace_s
                if kill_at is not None and now >= kill_at and running:
                    self.terminate()
                    kill_at = None
                if not running:
                    # All exited. A child one of them left behind may still hold its pipe: read on briefly.
                    if not sel.get_map():
                        break
                    drain_until = drain_until or now + 2.0
                    if now >= drain_until:
                        break
                self._pump(sel, min(0.2, max(0.0, deadline - now)))
                said = poll() if poll is not None else None
                if said:
                    print(f"[cluster] {said}", file=sys.stderr, flush=True)
        finally:
            sel.close()
        if self.failed is not None:
            return _exit_status(self.failed.popen.returncode)
        return max((_exit_status(p.popen.returncode) for p in self.procs), default=0)

    def terminate(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after TERM_GRACE_S. Bounded."""
        for sig, grace in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 2.0)):
            alive = [p for p in self.procs if self._group_alive(p)]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p.pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + grace
            while time.monotonic() < end and any(self._group_alive(p) for p in alive):
                for p in alive:
                    p.popen.poll()
                time.sleep(0.05)

    @staticmethod
    def _group_alive(p: Proc) -> bool:
        p.popen.poll()
        try:
            os.killpg(p.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def close(self) -> None:
        """Stop what still runs, keep what it wrote last, close pipes and logs."""
        self.terminate()
        for p in self.procs:
            fd = p.popen.stdout.fileno()
            for _ in range(1024):  # bounded: 64 MiB at most of output left unread
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                self._emit(p, data)
            self._emit(p, b"", final=True)
            p.popen.stdout.close()
            p.log.close()
            if p.popen.poll() is None:
                try:
                    p.popen.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass


# --------------------------------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------------------------------

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, frame: Optional[FrameType]) -> None:
    raise Interrupted(signum)


class _Signals:
    """While active: SIGINT/SIGTERM/SIGHUP raise Interrupted. ``hold()``: they are only remembered (cleanup must not
    be cut short); the first one is kept in ``pending``."""

    def __init__(self) -> None:
        self.saved: Dict[int, Any] = {}
        self.pending: Optional[int] = None

    def __enter__(self) -> "_Signals":
        for s in _SIGNALS:
            self.saved[s] = signal.signal(s, _raise_interrupted)
        return self

    def hold(self) -> None:
        def remember(signum: int, frame: Optional[FrameType]) -> None:
            if self.pending is None:
                self.pending = signum

        for s in _SIGNALS:
            signal.signal(s, remember)

    def __exit__(self, *exc: object) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------------------------------
# What the links carried
# --------------------------------------------------------------------------------------------------------------------

#: The counters reported per node and in the totals, as named in the JSON.
COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
#: One node's counters at one moment, or why they could not be read.
Reading = Union[LinkCounters, CounterError]


def link_report(cluster: Cluster, before: Sequence[Reading], after: Sequence[Reading]) -> Dict[str, Any]:
    """What each node's link carried during the job, from the kernel's counters read before its processes started
    and after they ended: per node the growth of each counter (or why there is none), and the totals over the nodes
    that could be read, so that every claim about traffic between nodes rests on the kernel's count."""
    nodes: List[Dict[str, Any]] = []
    total = dict.fromkeys(COUNTERS, 0)
    for node, (old, new) in enumerate(zip(before, after)):
        entry: Dict[str, Any] = {"node": node, "namespace": cluster.node_ns[node], "interface": NODE_IF}
        try:
            if isinstance(old, CounterError):
                raise CounterError(f"before the job: {old}")
            if isinstance(new, CounterError):
                raise CounterError(f"after the job: {new}")
            grown = new.since(old)
        except CounterError as e:
            entry.update(dict.fromkeys(COUNTERS), error=str(e))
        else:
            entry.update({name: getattr(grown, name) for name in COUNTERS}, error=None)
            for name in COUNTERS:
                total[name] += entry[name]
        nodes.append(entry)
    return {"interface": NODE_IF, "read_in": "each node's network namespace",
            "source": f"the kernel's 64-bit interface counters (ip -n NODE -s -j link show dev {NODE_IF}; "
                      f"/sys/class/net/{NODE_IF}/statistics inside the node)",
            "window": "read just before the job's processes started and just after they ended or were killed",
            "nodes": nodes,
            "total": {**total, "nodes_counted": sum(e["error"] is None for e in nodes), "nodes": len(nodes)}}


def format_link_report(report: Dict[str, Any]) -> List[str]:
    """The link report as lines of a table for the terminal: a row per node, then the totals."""
    lines = [f"what each node's link carried during the job, as the kernel counted it ({report['interface']}, read "
             "in each node):",
             f"  {'node':<6}{'interface':<11}{'tx bytes':>15}{'tx packets':>12}{'rx bytes':>15}{'rx packets':>12}"]

    def row(label: str, interface: str, counts: Dict[str, Any]) -> str:
        return (f"  {label:<6}{interface:<11}{counts['tx_bytes']:>15,}{counts['tx_packets']:>12,}"
                f"{counts['rx_bytes']:>15,}{counts['rx_packets']:>12,}")

    for entry in report["nodes"]:
        label = f"n{entry['node']}"
        if entry["error"] is None:
            lines.append(row(label, entry["interface"], entry))
        else:
            lines.append(f"  {label:<6}{entry['interface']:<11}not counted: {entry['error']}")
    total = report["total"]
    partial = total["nodes_counted"] < total["nodes"]
    lines.append(row("total", f"({total['nodes_counted']} of {total['nodes']})" if partial else "", total))
    return lines


def _read_counters(cluster: Cluster) -> List[Reading]:
    """``cluster.link_counters()``, never raising: this runs during cleanup, which must go on to remove the
    namespaces whatever a reading does."""
    try:
        return cluster.link_counters()
    except Exception as e:
        return [CounterError(f"could not read the counters: {e}") for _ in cluster.node_ns]


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


def run(spec: ClusterSpec, command: Sequence[str], launcher: str = "torchrun", timeout_s: float = DEFAULT_TIMEOUT_S,
        log_dir: Optional[Path] = None, node_env: Sequence[Tuple[str, str]] = (), echo: bool = True,
        summary: Optional[Path] = None, grace_s: float = FAIL_GRACE_S) -> int:
    """Build the cluster, run the job, remove everything; the exit status (module docstring). ``summary``, if given,
    is written atomically and never through a symlink (``ddp_triton.safe_write``)."""
    ip, tc = check_prerequisites()
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="ddpt-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[cluster] {msg}", file=sys.stderr, flush=True)

    status: Optional[int] = None
    reason = ""
    cluster = Cluster(spec, ip, tc)
    job: Optional[Job] = None
    info: Dict[str, object] = {}
    before: Optional[List[Reading]] = None
    report: Optional[Dict[str, Any]] = None
    signals = _Signals()
    start = time.monotonic()
    with signals:
        try:
            try:
                cluster.create()
                info = {"run": cluster.name, "nodes": spec.nodes, "procs_per_node": spec.procs_per_node,
                        "link": dataclasses.asdict(spec.link), "master_addr": cluster.master_addr,
                        "master_port": MASTER_PORT, "launcher": launcher, "log_dir": str(log_dir),
                        "qdiscs": cluster.qdiscs()}
                say(f"{cluster.name}: {spec.nodes} node(s) x {spec.procs_per_node} rank(s), {spec.link.describe()}; "
                    f"logs in {log_dir}")
                control = LinkControl(log_dir / "link-control", cluster.reshape, parse_rate)
                job = Job(cluster, command, launcher, log_dir, [*node_env, (CONTROL_ENV, str(control.path))], echo,
                          grace_s)
                before = _read_counters(cluster)
                job.start()
                status = job.wait(start + timeout_s, control.poll)
                if status is None:
                    status, reason = EXIT_TIMEOUT, f"timed out after {timeout_s:g} s: killed"
                elif job.failed is not None:
                    reason = f"{job.failed.label} exited with status {status}; the others were stopped"
            except Interrupted as e:
                status, reason = 128 + e.signum, f"{signal.Signals(e.signum).name}: stopped"
            except Unavailable:
                raise
            except (SetupError, OSError) as e:
                status, reason = EXIT_FAILED, f"setup failed: {e}"
        finally:
            signals.hold()
            if job is not None:
                job.close()
            if before is not None:
                report = link_report(cluster, before, _read_counters(cluster))
            left = cluster.close()
            if left:
                say(f"could not delete namespace(s) {', '.join(left)}: remove them with `ip netns del NAME`")
                status = status or EXIT_FAILED
            if signals.pending is not None and status in (None, 0):
                status = 128 + signals.pending
    if reason:
        say(reason)
    if report is not None:
        for line in format_link_report(report):
            say(line)
    info["link_counters"] = report
    if job is not None:
        info["ranks"] = [{"label": p.label, "node": p.node, "returncode": p.popen.returncode, "log": str(p.log_path)}
                         for p in job.procs]
    info.update(status=status, seconds=round(time.monotonic() - start, 3), reason=reason or None)
    if summary is not None:
        try:
            atomic_write_text(summary, json.dumps(info, indent=1) + "\n")
        except OutputError as e:
            say(f"could not write the summary: {e}")
            status = status or EXIT_FAILED
    return EXIT_FAILED if status is None else status
