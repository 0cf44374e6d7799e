"""Run a multi-node job on one machine: network namespaces as nodes, joined by veth links shaped with tc.

    python -m bench.cluster --nodes 2 --procs-per-node 2 --link 1gbit -- python -m bench.ddp_step --small
    python -m bench.cluster --check          # can this machine do it: root, iproute2, veth, bridge, tbf, netem?
    python -m bench.cluster --reap-stale     # remove what a run killed with SIGKILL left behind

One job per module, each importing only the ones below it:

    cli          the command line (``python -m bench.cluster`` runs it through ``__main__``)
    supervisor   the job: ranks started in the nodes, output, timeout, failing ranks, signals, cleanup, exit status,
                 the report of what each node's link carried
    network      the emulated network: prerequisites, namespaces, bridge, veth links, tc shaping, the links' counters,
                 their removal

This package re-exports their public names, so that ``from bench import cluster`` gives what the single module
``bench/cluster.py`` gave (``cluster.parse_rate``, ``cluster.Cluster``, ``cluster.run``, ...).
"""

from bench.cluster.cli import build_parser, check, main, reap_stale
from bench.cluster.network import (BRIDGE, BURST_S, CAP_NET_ADMIN, CAP_SYS_ADMIN, IP_TIMEOUT_S, MAX_QUEUE_BYTES,
                                   MIN_BURST_BYTES, NODE_IF, PREFIX, QUEUE_S, SUBNET, Cluster, ClusterSpec,
                                   CounterError, LinkCounters, LinkSpec, SetupError, Unavailable, check_prerequisites,
                                   find_tool, iproute2_version, list_netns, missing_capabilities, parse_delay,
                                   parse_link_counters, parse_rate, read_link_counters, reap_stale_namespaces)
from bench.cluster.supervisor import (COUNTERS, DEFAULT_TIMEOUT_S, EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE,
                                      FAIL_GRACE_S, MASTER_PORT, TERM_GRACE_S, TORCHRUN_VARS, Interrupted, Job, Proc,
                                      format_link_report, link_report, run)

__all__ = [
    # network
    "BRIDGE", "BURST_S", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "IP_TIMEOUT_S", "MAX_QUEUE_BYTES", "MIN_BURST_BYTES",
    "NODE_IF", "PREFIX", "QUEUE_S", "SUBNET", "Cluster", "ClusterSpec", "CounterError", "LinkCounters", "LinkSpec",
    "SetupError", "Unavailable", "check_prerequisites", "find_tool", "iproute2_version", "list_netns",
    "missing_capabilities", "parse_delay", "parse_link_counters", "parse_rate", "read_link_counters",
    "reap_stale_namespaces",
    # supervisor
    "COUNTERS", "DEFAULT_TIMEOUT_S", "EXIT_FAILED", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_USAGE", "FAIL_GRACE_S",
    "MASTER_PORT", "TERM_GRACE_S", "TORCHRUN_VARS", "Interrupted", "Job", "Proc", "format_link_report", "link_report",
    "run",
    # cli
    "build_parser", "check", "main", "reap_stale",
]
