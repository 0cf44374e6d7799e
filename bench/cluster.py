"""Run a multi-node job on one machine: network namespaces as nodes, joined by veth links shaped with tc.

    python -m bench.cluster --nodes 2 --procs-per-node 2 --link 1gbit -- python -m bench.ddp_step --small
    python -m bench.cluster --nodes 2 --procs-per-node 1 --link 1gbit --node-env XDG_CACHE_HOME=/tmp/c/node{node} \\
        -- ddp-triton autotune --backend gloo --topology h200-vm-1gpu --inter-node-gbps 0.125
    python -m bench.cluster --check          # can this machine do it: root, iproute2, veth, bridge, tbf, netem?
    python -m bench.cluster --reap-stale     # remove what a run killed with SIGKILL left behind

What one run makes, all of it inside network namespaces it creates and named after it (``ddpt-<pid>-<6 hex>``),
so that cleanup removes exactly that and two runs never collide; nothing is added to the caller's namespace:

    <run>-sw      the switch: bridge br0 with ports p0 .. p{K-1}
    <run>-n{i}    node i: lo (up) and eth0, the veth peer of p{i}, address 10.200.0.{i+1}/24

Link: each node's eth0 is its NIC. ``--link RATE`` shapes both directions with tbf, on eth0 (what the node sends)
and on p{i} (what the switch sends to it), so a node sends and receives at RATE at most, as through a
non-blocking switch. ``--delay D`` adds a one-way delay of D to what a node sends (netem on eth0, tbf beneath it):
a round trip between two nodes takes 2 D more. sch_netem is optional in kernels; without it ``--delay`` is refused
with the reason, and rate shaping works as before.

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
way; each ``ip``/``tc`` call has a timeout; the namespaces (and with them every link) are deleted in a ``finally``
whatever happened, and the tool checks that none is left. A run killed with SIGKILL cannot clean up: its
namespaces stay until ``--reap-stale``.

Exit status: the job's (0, or the first failing rank's; 128+N for a rank killed by signal N); 2 bad usage or a
missing prerequisite (not root, no iproute2, no netem for --delay), named on one line; 1 the emulated network
could not be built or removed; 124 timeout; 130 SIGINT, 143 SIGTERM, 129 SIGHUP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Tuple

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT = 0, 1, 2, 124

#: Name prefix of everything a run creates; a run is ``ddpt-<pid>-<6 hex>``, which --reap-stale parses back.
PREFIX = "ddpt"
_RUN_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-(sw|n\d+)$")
#: The nodes' subnet. It exists only inside this run's namespaces, so it cannot clash with the machine's networks
#: or another run's (each run has its own switch namespace).
SUBNET = "10.200.0"
NODE_IF = "eth0"
BRIDGE = "br0"
#: torchrun's default port. Node 0's namespace is new and holds only this job, and the port lies below the
#: ephemeral range (32768-60999 unless changed) the job's own connections draw from: nothing else can hold it.
MASTER_PORT = 29500

#: tbf bucket: at least two 64 KiB GSO packets (a smaller bucket makes tbf split them in software), else 250 us at
#: the rate. A burst lets that many bytes through at once: 128 KiB is 1.6% of an 8 MiB message at 1 Gbit/s.
MIN_BURST_BYTES = 128 * 1024
BURST_S = 250e-6
#: tbf queue: 100 ms at the rate (TCP's windows keep it far from full; a short queue would drop and make TCP back
#: off, slower than the rate allows), capped because tc takes a 32-bit byte count.
QUEUE_S = 0.1
MAX_QUEUE_BYTES = 1 << 30

#: Seconds each ip/tc call may take.
IP_TIMEOUT_S = 20.0
#: After one rank fails, the others get this long to notice and stop before they are killed.
FAIL_GRACE_S = 5.0
#: SIGTERM, then this long, then SIGKILL.
TERM_GRACE_S = 5.0
#: Default bound on the whole job.
DEFAULT_TIMEOUT_S = 900.0

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}

#: What torchrun sets for its workers; stripped from the caller's environment so an outer launch cannot leak in.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "NODE_RANK")


class Unavailable(Exception):
    """A prerequisite is missing (privileges, iproute2, a kernel feature): exit 2 with this one line."""


class SetupError(Exception):
    """The emulated network could not be built or removed: exit 1 with this message."""


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived; raised from the handler so that every ``finally`` runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --------------------------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------------------------


def parse_rate(text: str) -> int:
    """A tc rate (``10gbit``, ``500mbit``, ``1.5gbit``; units are decimal, as in tc) in bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"link rate {text!r}: give a number and one of {', '.join(_RATE_UNITS)} (e.g. 10gbit); "
                         "tc's bps means bytes per second, so it is not accepted here")
    bits = int(round(float(m.group(1)) * _RATE_UNITS[unit]))
    if bits < 8000:
        raise ValueError(f"link rate {text!r} is below 8kbit")
    return bits


def parse_delay(text: str) -> float:
    """A delay (``50us``, ``2ms``, ``0.1s``) in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _TIME_UNITS:
        raise ValueError(f"delay {text!r}: give a number and one of us, ms, s (e.g. 50us)")
    return float(m.group(1)) * _TIME_UNITS[unit]


@dataclass(frozen=True)
class LinkSpec:
    """One node's link to the switch, the same for every node."""

    rate_bps: int
    """Bits per second, each direction (tbf)."""
    delay_s: float = 0.0
    """One-way delay added to what a node sends (netem); 0 adds none."""
    mtu: int = 1500
    """MTU of every link (Ethernet's 1500 by default; 9000 for jumbo frames)."""

    def __post_init__(self) -> None:
        if isinstance(self.rate_bps, bool) or not isinstance(self.rate_bps, int) or self.rate_bps < 8000:
            raise ValueError(f"rate_bps must be an int >= 8000, got {self.rate_bps!r}")
        if not 0 <= self.delay_s <= 10:
            raise ValueError(f"delay_s must be within [0, 10] seconds, got {self.delay_s!r}")
        if not 576 <= self.mtu <= 65000:
            raise ValueError(f"mtu must be within [576, 65000], got {self.mtu!r}")

    @property
    def burst_bytes(self) -> int:
        return max(MIN_BURST_BYTES, int(self.rate_bps / 8 * BURST_S))

    @property
    def queue_bytes(self) -> int:
        return min(MAX_QUEUE_BYTES, self.burst_bytes + int(self.rate_bps / 8 * QUEUE_S))

    def describe(self) -> str:
        delay = f", delay {self.delay_s * 1e6:g} us one way" if self.delay_s else ", no added delay"
        return (f"{self.rate_bps / 1e9:g} Gbit/s per node per direction (tbf burst {self.burst_bytes} B){delay}, "
                f"MTU {self.mtu}")


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    """Namespaces ('nodes'), K >= 1."""
    procs_per_node: int
    """Ranks per node, P >= 1."""
    link: LinkSpec

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes must be an int within [1, 200], got {self.nodes!r}")
        if not isinstance(self.procs_per_node, int) or not 1 <= self.procs_per_node <= 256:
            raise ValueError(f"procs_per_node must be an int within [1, 256], got {self.procs_per_node!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


# --------------------------------------------------------------------------------------------------------------------
# Prerequisites
# --------------------------------------------------------------------------------------------------------------------

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


def missing_capabilities(status_text: Optional[str] = None) -> List[str]:
    """The capabilities this needs that the process lacks (from ``/proc/self/status``'s CapEff): creating a named
    network namespace mounts it (CAP_SYS_ADMIN); links, addresses and qdiscs need CAP_NET_ADMIN."""
    if status_text is None:
        try:
            status_text = Path("/proc/self/status").read_text()
        except OSError:
            return ["CAP_SYS_ADMIN", "CAP_NET_ADMIN"] if os.geteuid() != 0 else []
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status_text, re.M)
    caps = int(m.group(1), 16) if m else 0
    return [name for name, bit in (("CAP_SYS_ADMIN", CAP_SYS_ADMIN), ("CAP_NET_ADMIN", CAP_NET_ADMIN))
            if not caps >> bit & 1]


def find_tool(name: str) -> Optional[str]:
    """``ip``/``tc`` on PATH, or in the sbin folders a non-root PATH often lacks."""
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def check_prerequisites() -> Tuple[str, str]:
    """The paths of ``ip`` and ``tc``; Unavailable naming what is missing."""
    missing = missing_capabilities()
    if missing:
        raise Unavailable(f"bench.cluster needs root: creating network namespaces and links takes "
                          f"{' and '.join(missing)}, which this process (uid {os.geteuid()}) lacks; run it as root "
                          "(e.g. sudo -E env PATH=\"$PATH\" python -m bench.cluster ...)")
    tools = {name: find_tool(name) for name in ("ip", "tc")}
    absent = [name for name, path in tools.items() if path is None]
    if absent:
        raise Unavailable(f"bench.cluster needs iproute2's {' and '.join(absent)}, not found on PATH or in /usr/sbin, "
                          "/sbin (Debian/Ubuntu: apt-get install -y iproute2)")
    return tools["ip"], tools["tc"]  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------------------------
# ip / tc
# --------------------------------------------------------------------------------------------------------------------


def _sh(argv: Sequence[str], check: bool = True, timeout: float = IP_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SetupError(f"`{' '.join(argv)}` took more than {timeout:g} s") from None
    if check and out.returncode != 0:
        raise SetupError(f"`{' '.join(argv)}` failed: {(out.stderr or out.stdout).strip()}")
    return out


def list_netns(ip: str) -> List[str]:
    """Names of the named network namespaces (``ip netns list``, without the ``(id: N)`` suffix)."""
    out = _sh([ip, "netns", "list"])
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _kernel_hint(stderr: str, what: str) -> str:
    if "Unknown device type" in stderr or "qdisc kind is unknown" in stderr:
        return f" (this kernel, {os.uname().release}, lacks {what})"
    return ""


class Cluster:
    """K node namespaces and a switch namespace, made on ``__enter__`` (or ``create``) and removed on ``close``.

    Everything is named after the run (``name``); ``close`` kills what still runs in those namespaces (only this
    run's processes can be there) and deletes them, which deletes their links. ``close`` is idempotent and bounded.
    """

    def __init__(self, spec: ClusterSpec, ip: str = "ip", tc: str = "tc"):
        self.spec = spec
        self.ip, self.tc = ip, tc
        self.name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.name}-sw"
        self.node_ns = [f"{self.name}-n{i}" for i in range(spec.nodes)]
        self.created: List[str] = []  # namespaces in the order made; close() deletes exactly these
        self.netem: Optional[bool] = None

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def master_addr(self) -> str:
        return self.address(0)

    # ---- building

    def __enter__(self) -> "Cluster":
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns_add(self, ns: str) -> None:
        self.created.append(ns)  # first: a signal right after the add must not leave it unrecorded
        out = _sh([self.ip, "netns", "add", ns], check=False)
        if out.returncode != 0:
            self.created.remove(ns)
            raise SetupError(f"`ip netns add {ns}` failed: {out.stderr.strip()}"
                             f"{_kernel_hint(out.stderr, 'network namespaces (CONFIG_NET_NS)')}")

    def _in(self, ns: str, *argv: str, hint: str = "") -> None:
        out = _sh([self.ip, "-n", ns, *argv], check=False)
        if out.returncode != 0:
            raise SetupError(f"`ip -n {ns} {' '.join(argv)}` failed: {out.stderr.strip()}"
                             f"{_kernel_hint(out.stderr, hint) if hint else ''}")

    def _tc(self, ns: str, *argv: str, hint: str = "") -> subprocess.CompletedProcess:
        out = _sh([self.tc, "-n", ns, *argv], check=False)
        if out.returncode != 0:
            raise SetupError(f"`tc -n {ns} {' '.join(argv)}` failed: {out.stderr.strip()}"
                             f"{_kernel_hint(out.stderr, hint) if hint else ''}")
        return out

    def probe_netem(self) -> bool:
        """Can this kernel add delay (sch_netem)? Tried on the switch namespace's loopback, then removed."""
        if self.netem is None:
            out = _sh([self.tc, "-n", self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                      check=False)
            self.netem = out.returncode == 0
            if self.netem:
                _sh([self.tc, "-n", self.switch, "qdisc", "del", "dev", "lo", "root"], check=False)
        return self.netem

    def create(self) -> None:
        link = self.spec.link
        self._netns_add(self.switch)
        if link.delay_s and not self.probe_netem():
            raise Unavailable(f"--delay needs the kernel's netem qdisc (sch_netem, CONFIG_NET_SCH_NETEM), which this "
                              f"kernel ({os.uname().release}) lacks; rate shaping (tbf) works without it: drop --delay")
        self._in(self.switch, "link", "set", "lo", "up")
        self._in(self.switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0",
                 hint="bridges (CONFIG_BRIDGE)")
        self._in(self.switch, "link", "set", BRIDGE, "addrgenmode", "none")
        self._in(self.switch, "link", "set", BRIDGE, "mtu", str(link.mtu), "up")
        for i, ns in enumerate(self.node_ns):
            self._netns_add(ns)
            port = f"p{i}"
            # Made in the switch namespace with its peer straight in the node's: never in the caller's namespace.
            self._in(self.switch, "link", "add", port, "mtu", str(link.mtu), "type", "veth", "peer", "name", NODE_IF,
                     "mtu", str(link.mtu), "netns", ns, hint="veth (CONFIG_VETH)")
            for where, dev in ((self.switch, port), (ns, NODE_IF)):
                self._in(where, "link", "set", dev, "addrgenmode", "none")  # no IPv6 chatter on the links
            self._in(self.switch, "link", "set", port, "master", BRIDGE)
            self._in(self.switch, "link", "set", port, "up")
            self._in(ns, "link", "set", "lo", "up")
            self._in(ns, "addr", "add", f"{self.address(i)}/24", "dev", NODE_IF)
            self._in(ns, "link", "set", NODE_IF, "up")
            self._shape(self.switch, port, delay_s=0.0)  # switch -> node: rate only
            self._shape(ns, NODE_IF, delay_s=link.delay_s)  # node -> switch: rate, and the one-way delay

    def _shape(self, ns: str, dev: str, delay_s: float) -> None:
        link = self.spec.link
        tbf = ["tbf", "rate", f"{link.rate_bps}bit", "burst", str(link.burst_bytes), "limit", str(link.queue_bytes)]
        if delay_s:
            # netem delays, tbf beneath it shapes (tc-netem(8)'s recipe); netem's own queue holds what is in flight
            # over the delay at the rate, in packets of at least an MTU, with room to spare.
            in_flight = int(link.rate_bps / 8 * delay_s / link.mtu) + 1
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_s * 1e6:.0f}us",
                     "limit", str(max(10000, 4 * in_flight)), hint="sch_netem (CONFIG_NET_SCH_NETEM)")
            self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf, hint="sch_tbf")
        else:
            self._tc(ns, "qdisc", "add", "dev", dev, "root", *tbf, hint="sch_tbf (CONFIG_NET_SCH_TBF)")

    def qdiscs(self) -> Dict[str, str]:
        """``tc qdisc show`` of every shaped device, for the record."""
        shown = {}
        for i, ns in enumerate(self.node_ns):
            for where, dev, label in ((ns, NODE_IF, f"n{i}/{NODE_IF}"), (self.switch, f"p{i}", f"sw/p{i}")):
                shown[label] = _sh([self.tc, "-n", where, "qdisc", "show", "dev", dev], check=False).stdout.strip()
        return shown

    # ---- removing

    def close(self) -> List[str]:
        """Kill whatever still runs in this run's namespaces, delete them; the names that could not be deleted."""
        for _ in range(3):
            pids = set()
            for ns in self.created:
                out = _sh([self.ip, "netns", "pids", ns], check=False)
                pids |= {int(p) for p in out.stdout.split() if p.isdigit()}
            pids.discard(os.getpid())
            if not pids:
                break
            for pid in pids:  # inside this run's namespaces: only this run's processes
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for ns in reversed(self.created):
            _sh([self.ip, "netns", "del", ns], check=False)
        left = set(list_netns(self.ip)) if self.created else set()
        remaining = [ns for ns in self.created if ns in left]
        self.created = remaining
        return remaining


# --------------------------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Proc:
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
    return 128 - returncode if returncode < 0 else returncode


def _clean_env(extra: Dict[str, str]) -> Dict[str, str]:
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

    def wait(self, deadline: float) -> Optional[int]:
        """Pump output until every process has exited (None at the deadline). The job's exit status."""
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


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


class _Signals:
    """While active: SIGINT/SIGTERM/SIGHUP raise Interrupted. ``hold()``: they are only remembered (cleanup must not
    be cut short); the first one is kept in ``pending``."""

    def __init__(self):
        self.saved = {}
        self.pending: Optional[int] = None

    def __enter__(self):
        for s in _SIGNALS:
            self.saved[s] = signal.signal(s, _raise_interrupted)
        return self

    def hold(self):
        def remember(signum, frame):
            if self.pending is None:
                self.pending = signum

        for s in _SIGNALS:
            signal.signal(s, remember)

    def __exit__(self, *exc):
        for s, h in self.saved.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------------


def run(spec: ClusterSpec, command: Sequence[str], launcher: str = "torchrun", timeout_s: float = DEFAULT_TIMEOUT_S,
        log_dir: Optional[Path] = None, node_env: Sequence[Tuple[str, str]] = (), echo: bool = True,
        summary: Optional[Path] = None, grace_s: float = FAIL_GRACE_S) -> int:
    """Build the cluster, run the job, remove everything; the exit status (module docstring)."""
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
                job = Job(cluster, command, launcher, log_dir, node_env, echo, grace_s)
                job.start()
                status = job.wait(start + timeout_s)
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
            left = cluster.close()
            if left:
                say(f"could not delete namespace(s) {', '.join(left)}: remove them with `ip netns del NAME`")
                status = status or EXIT_FAILED
            if signals.pending is not None and status in (None, 0):
                status = 128 + signals.pending
    if reason:
        say(reason)
    if job is not None:
        info["ranks"] = [{"label": p.label, "node": p.node, "returncode": p.popen.returncode, "log": str(p.log_path)}
                         for p in job.procs]
    info.update(status=status, seconds=round(time.monotonic() - start, 3), reason=reason or None)
    if summary is not None:
        summary.write_text(json.dumps(info, indent=1))
    return EXIT_FAILED if status is None else status


def check(as_json: bool) -> int:
    """Report whether this machine can build the cluster (and add delay); 0 if it can, 2 if not."""
    report: Dict[str, object] = {"kernel": os.uname().release}
    try:
        ip, tc = check_prerequisites()
        report.update(ip=ip, tc=tc, iproute2=_sh([ip, "-V"], check=False).stdout.strip())
        spec = ClusterSpec(2, 1, LinkSpec(10**9))
        with Cluster(spec, ip, tc) as c:
            report["netem"] = c.probe_netem()
        report["ok"], report["reason"] = True, None
    except (Unavailable, SetupError) as e:
        report["ok"], report["reason"] = False, str(e)
    if as_json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
        if report.get("ok") and not report.get("netem"):
            print("note: no sch_netem in this kernel: --link works, --delay is refused")
    return EXIT_OK if report["ok"] else EXIT_USAGE


def reap_stale() -> int:
    """Delete namespaces named by this tool whose run is gone (its process no longer exists)."""
    ip, _ = check_prerequisites()
    reaped = []
    for ns in list_netns(ip):
        m = _RUN_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"bench.cluster" in cmdline or b"cluster.py" in cmdline or pid == os.getpid():
                continue  # that run is still going: its namespaces are its own
        except OSError:
            pass
        for p in _sh([ip, "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh([ip, "netns", "del", ns], check=False)
        reaped.append(ns)
    print(f"removed {len(reaped)} stale namespace(s){': ' + ', '.join(reaped) if reaped else ''}")
    return EXIT_OK


def _node_env_arg(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.cluster",
        usage="python -m bench.cluster --nodes K --procs-per-node P --link RATE [--delay D] [options] -- COMMAND...\n"
              "       python -m bench.cluster --check | --reap-stale",
        description="Run COMMAND as a K-node job on this machine: network namespaces as nodes, joined through a "
                    "bridge by veth links shaped with tc, P ranks per node with torchrun's environment. Needs root.")
    p.add_argument("--nodes", type=_positive(int), help="number of nodes (namespaces)")
    p.add_argument("--procs-per-node", type=_positive(int), default=1, help="ranks per node (1)")
    p.add_argument("--link", metavar="RATE", help="each node's link rate per direction: 1gbit, 10gbit, 500mbit")
    p.add_argument("--delay", metavar="D", help="one-way delay added to what each node sends: 50us, 2ms "
                                                "(needs sch_netem in the kernel)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of the links (1500)")
    p.add_argument("--launcher", choices=("torchrun", "env"), default="torchrun",
                   help="torchrun: one torchrun --nnodes K per node (default); env: start the ranks directly with "
                        "torchrun's variables")
    p.add_argument("--timeout", type=_positive(float), default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before the job is killed (exit 124; default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--grace", type=float, default=FAIL_GRACE_S, metavar="SECONDS",
                   help=f"after a rank fails, the others are killed this much later ({FAIL_GRACE_S:g})")
    p.add_argument("--log-dir", type=Path, help="where each rank's output is kept (default: a new temporary folder)")
    p.add_argument("--node-env", type=_node_env_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="set KEY for every rank of a node; {node} becomes the node's index "
                        "(e.g. XDG_CACHE_HOME=/tmp/c/node{node}: a cache per node)")
    p.add_argument("--quiet", action="store_true", help="do not echo the ranks' output (still in the logs)")
    p.add_argument("--summary", type=Path, metavar="FILE", help="write a JSON summary: settings, qdiscs, ranks, status")
    p.add_argument("--check", action="store_true", help="say whether this machine can do it, and whether --delay can")
    p.add_argument("--json", action="store_true", help="with --check: one JSON object")
    p.add_argument("--reap-stale", action="store_true",
                   help="remove namespaces left by runs of this tool that were killed with SIGKILL")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.check:
            return check(args.json)
        if args.reap_stale:
            return reap_stale()
        if args.nodes is None or args.link is None or not command:
            parser.error("--nodes, --link and a COMMAND after -- are required")
        try:
            link = LinkSpec(parse_rate(args.link), parse_delay(args.delay) if args.delay else 0.0, args.mtu)
            spec = ClusterSpec(args.nodes, args.procs_per_node, link)
        except ValueError as e:
            parser.error(str(e))
        if not 0 <= args.grace <= 600:
            parser.error(f"--grace {args.grace:g} must be within [0, 600] seconds")
        return run(spec, command, args.launcher, args.timeout, args.log_dir, args.node_env, not args.quiet,
                   args.summary, args.grace)
    except Unavailable as e:
        print(f"bench.cluster: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
