"""Build the emulated network of one run: a network namespace per node and one for the switch, joined by veth links
shaped with tc, and remove it again.

What one run makes, all of it inside network namespaces it creates and named after it (``ddpt-<pid>-<6 hex>``),
so that cleanup removes exactly that and two runs never collide; nothing is added to the caller's namespace:

    <run>-sw      the switch: bridge br0 with ports p0 .. p{K-1}
    <run>-n{i}    node i: lo (up) and eth0, the veth peer of p{i}, address 10.200.0.{i+1}/24

Link: each node's eth0 is its NIC. ``--link RATE`` shapes both directions with tbf, on eth0 (what the node sends)
and on p{i} (what the switch sends to it), so a node sends and receives at RATE at most, as through a
non-blocking switch. ``--delay D`` adds a one-way delay of D to what a node sends (netem on eth0, tbf beneath it):
a round trip between two nodes takes 2 D more. sch_netem is optional in kernels; without it ``--delay`` is refused
with the reason, and rate shaping works as before.

Counters: ``Cluster.link_counters`` reads each node's eth0 counters from the kernel (``ip -s -j link``, the
64-bit counters that ``/sys/class/net/eth0/statistics`` shows inside the node), so that what a job moved between
nodes is a number the kernel counted, not one this tool computes. A veth's counters are its peer's mirrored (its
rx is the peer's tx), so eth0 and the switch's p{i} agree; eth0 is read because it is the node's own view.

Each ``ip``/``tc`` call has a timeout. ``Cluster.close`` kills whatever still runs inside the run's namespaces and
deletes them (and with them every link); a run killed with SIGKILL cannot, and ``reap_stale_namespaces`` removes
what it left. This module starts no job: bench.cluster.supervisor does, on a ``Cluster`` built here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

#: Name prefix of everything a run creates; a run is ``ddpt-<pid>-<6 hex>``, which --reap-stale parses back.
PREFIX = "ddpt"
_RUN_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-(sw|n\d+)$")
#: The nodes' subnet. It exists only inside this run's namespaces, so it cannot clash with the machine's networks
#: or another run's (each run has its own switch namespace).
SUBNET = "10.200.0"
NODE_IF = "eth0"
BRIDGE = "br0"

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

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}


class Unavailable(Exception):
    """A prerequisite is missing (privileges, iproute2, a kernel feature): exit 2 with this one line."""


class SetupError(Exception):
    """The emulated network could not be built or removed: exit 1 with this message."""


class CounterError(Exception):
    """An interface's counters could not be read, or two readings cannot be compared; the message says why."""


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
        # No multicast snooping: with it the bridge reports itself to the all-snoopers groups (IGMP and MLD, a
        # frame to every node now and then), which the nodes' counters would book as the job's traffic.
        self._in(self.switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0",
                 "mcast_snooping", "0", hint="bridges (CONFIG_BRIDGE)")
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

    def reshape(self, rate_bps: int) -> None:
        """Change every link's rate to ``rate_bps`` while the job runs (``tc qdisc change`` of each tbf; the delay
        stays): as a link shared with another job looks from the job. ``spec.link`` says the new rate after."""
        link = dataclasses.replace(self.spec.link, rate_bps=rate_bps)
        tbf = ["tbf", "rate", f"{link.rate_bps}bit", "burst", str(link.burst_bytes), "limit", str(link.queue_bytes)]
        for i, ns in enumerate(self.node_ns):
            self._tc(self.switch, "qdisc", "change", "dev", f"p{i}", "root", *tbf)
            where = ["parent", "1:1", "handle", "10:"] if link.delay_s else ["root"]
            self._tc(ns, "qdisc", "change", "dev", NODE_IF, *where, *tbf)
        self.spec = dataclasses.replace(self.spec, link=link)

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

    def link_counters(self) -> List[Union["LinkCounters", CounterError]]:
        """Each node's eth0 counters now, read in its namespace, in node order; a CounterError where they could not
        be read (the interface gone, ip failing), so that one node's trouble does not lose the others'."""
        readings: List[Union[LinkCounters, CounterError]] = []
        for ns in self.node_ns:
            try:
                readings.append(read_link_counters(self.ip, ns, NODE_IF))
            except CounterError as e:
                readings.append(e)
        return readings

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
# The interfaces' counters
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkCounters:
    """The kernel's counters of one interface at one moment (or their growth between two), as ``ip -s link`` and
    ``/sys/class/net/DEV/statistics`` show them: what crossed the device, after its qdisc, headers included."""

    ifindex: int
    """The interface's index: a different one means the interface was made anew and its counters restarted."""
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def since(self, before: "LinkCounters") -> "LinkCounters":
        """The growth of each counter from ``before`` to this reading; CounterError if the two cannot be compared
        (another interface by now, or a counter that went backwards: wrapped or reset), rather than a wrong number.

        The kernel's 64-bit counters do not wrap in practice (16 EiB), so a counter below its earlier value is
        reported, not unwrapped: nothing can tell a wrap from a reset."""
        if self.ifindex != before.ifindex:
            raise CounterError(f"the interface was replaced during the job (ifindex {before.ifindex} -> "
                               f"{self.ifindex}): its counters restarted")
        grown = {}
        for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            old, new = getattr(before, name), getattr(self, name)
            if new < old:
                raise CounterError(f"{name} went backwards ({old} -> {new}): wrapped or reset, no count")
            grown[name] = new - old
        return LinkCounters(ifindex=self.ifindex, **grown)


def parse_link_counters(text: str, dev: str) -> LinkCounters:
    """``ip -s -j link show dev DEV``'s output as LinkCounters; CounterError naming what is missing from it."""
    try:
        links: Any = json.loads(text)
    except ValueError:
        raise CounterError(f"`ip -s -j link show dev {dev}` printed no JSON (an iproute2 without -j?): "
                           f"{text.strip()[:200]!r}") from None
    link = next((entry for entry in links if isinstance(entry, dict) and entry.get("ifname") == dev), None) \
        if isinstance(links, list) else None
    if link is None:
        raise CounterError(f"`ip -s -j link show dev {dev}` did not list {dev}")
    stats = link.get("stats64") or link.get("stats")  # "stats" where the kernel gave only the 32-bit counters
    try:
        return LinkCounters(ifindex=int(link["ifindex"]), tx_bytes=int(stats["tx"]["bytes"]),
                            rx_bytes=int(stats["rx"]["bytes"]), tx_packets=int(stats["tx"]["packets"]),
                            rx_packets=int(stats["rx"]["packets"]))
    except (KeyError, TypeError, ValueError):
        raise CounterError(f"`ip -s -j link show dev {dev}` gave no byte and packet counters") from None


def read_link_counters(ip: str, ns: str, dev: str) -> LinkCounters:
    """The counters of ``dev`` in namespace ``ns`` now, through netlink (``ip -n NS -s -j link show dev DEV``):
    no process enters the namespace and no sysfs is mounted. CounterError saying why they could not be read."""
    try:
        out = _sh([ip, "-n", ns, "-s", "-j", "link", "show", "dev", dev], check=False)
    except (SetupError, OSError) as e:
        raise CounterError(str(e)) from None
    if out.returncode != 0:
        raise CounterError(f"`ip -n {ns} -s -j link show dev {dev}` failed: {(out.stderr or out.stdout).strip()}")
    return parse_link_counters(out.stdout, dev)


# --------------------------------------------------------------------------------------------------------------------
# What a run killed with SIGKILL left behind
# --------------------------------------------------------------------------------------------------------------------


def reap_stale_namespaces(ip: str) -> List[str]:
    """Delete the namespaces named by this tool whose run is gone (its process no longer exists), killing what still
    runs inside them first; the names deleted."""
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
    return reaped


def iproute2_version(ip: str) -> str:
    """``ip -V``'s line (which iproute2 builds the network), for --check's report."""
    return _sh([ip, "-V"], check=False).stdout.strip()
