"""The command line of ``python -m bench.cluster``: parse the arguments, then run a job, ``--check`` or
``--reap-stale``.

    python -m bench.cluster --nodes 2 --procs-per-node 2 --link 1gbit -- python -m bench.ddp_step --small
    python -m bench.cluster --nodes 2 --procs-per-node 1 --link 1gbit --node-env XDG_CACHE_HOME=/tmp/c/node{node} \\
        -- ddp-triton autotune --backend gloo --topology h200-vm-1gpu --inter-node-gbps 0.125
    python -m bench.cluster --check          # can this machine do it: root, iproute2, veth, bridge, tbf, netem?
    python -m bench.cluster --reap-stale     # remove what a run killed with SIGKILL left behind

What a run builds is described in bench.cluster.network, how the job is run and bounded (and the exit status) in
bench.cluster.supervisor. Bad usage exits 2 (argparse's message), as does a missing prerequisite, named on one line,
and a ``--summary`` path that must not be written (a symlink, a directory, a device: ``ddp_triton.safe_write``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from ddp_triton.safe_write import OutputError, check_writable_target

from bench.cluster.network import (Cluster, ClusterSpec, LinkSpec, SetupError, Unavailable, check_prerequisites,
                                   iproute2_version, parse_delay, parse_rate, reap_stale_namespaces)
from bench.cluster.supervisor import DEFAULT_TIMEOUT_S, EXIT_OK, EXIT_USAGE, FAIL_GRACE_S, run

N = TypeVar("N", int, float)


def check(as_json: bool) -> int:
    """Report whether this machine can build the cluster (and add delay); 0 if it can, 2 if not."""
    report: Dict[str, object] = {"kernel": os.uname().release}
    try:
        ip, tc = check_prerequisites()
        report.update(ip=ip, tc=tc, iproute2=iproute2_version(ip))
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
    reaped = reap_stale_namespaces(ip)
    print(f"removed {len(reaped)} stale namespace(s){': ' + ', '.join(reaped) if reaped else ''}")
    return EXIT_OK


def _node_env_arg(text: str) -> Tuple[str, str]:
    """``--node-env KEY=VALUE`` as (KEY, VALUE); KEY must be a valid environment variable name."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    """An argparse type: ``kind`` of the text, refused (exit 2, naming the value) unless it is a number above 0."""

    def parse(text: str) -> N:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The options; the COMMAND after ``--`` is cut off by ``main`` before they are parsed."""
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
    p.add_argument("--summary", type=Path, metavar="FILE",
                   help="write a JSON summary: settings, qdiscs, ranks, status, and the bytes and packets each node's "
                        "link carried (link_counters); never through a symlink")
    p.add_argument("--check", action="store_true", help="say whether this machine can do it, and whether --delay can")
    p.add_argument("--json", action="store_true", help="with --check: one JSON object")
    p.add_argument("--reap-stale", action="store_true",
                   help="remove namespaces left by runs of this tool that were killed with SIGKILL")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (default: the process's), do what it asks; the exit status (bench.cluster.supervisor's)."""
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
        if args.summary is not None:
            try:  # refused now rather than after the job: a symlink, a directory, a device, an unwritable folder
                check_writable_target(args.summary)
            except OutputError as e:
                parser.error(f"--summary {e}")
        return run(spec, command, args.launcher, args.timeout, args.log_dir, args.node_env, not args.quiet,
                   args.summary, args.grace)
    except Unavailable as e:
        print(f"bench.cluster: {e}", file=sys.stderr)
        return EXIT_USAGE
