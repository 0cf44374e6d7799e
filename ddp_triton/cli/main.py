"""``ddp-triton``'s parser and entry point, and its small commands: ``topo`` (the GPU topology as ``nvidia-smi topo
-m`` prints it, or JSON), ``profile show`` (a profile in words) and ``env`` (versions and GPUs, for bug reports);
``autotune`` is ``cli/autotune.py``. Each command's ``--help`` says what it does.

Exit codes: 0 done, 2 bad usage or bad input (unknown topology, unreadable profile, impossible numbers, an output
path that is a symlink, directory, device or FIFO), 1 a failure while measuring or while writing an output that
passed its checks. Every output is checked before any is written, and written atomically (``safe_write``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn, Optional, Sequence

from .. import __version__
from ..envinfo import collect_env, format_env
from ..machine.profile import (CONFIDENCE, DEFAULT_BUDGET_S, DEFAULT_FORMATS, DEFAULT_HOST_US_PER_BUCKET,
                               DEFAULT_REL_ERROR, MIN_ROUNDS, Profile, ProfileError, profile_fingerprint)
from ..machine.topology import PRESETS, TopologyError, load_topology
from ..tune.e2e_hooks import E2E_HOOKS
from .args import (EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, WriteFailed, csv_list, fraction,
                   nonneg_float, nonneg_int, parse_size, positive_float, positive_int)
from .autotune import cmd_autotune  # torch and the tuner load only where it measures


# --------------------------------------------------------------------------------------------------------------------
# topo, profile show, env
# --------------------------------------------------------------------------------------------------------------------


def cmd_topo(args: argparse.Namespace) -> int:
    """``ddp-triton topo``: the topology as ``nvidia-smi topo -m`` shows it, with rates and fingerprint (or JSON)."""
    try:
        topo = load_topology(args.topology)
    except TopologyError as e:
        if args.topology is not None:
            raise UsageError(str(e)) from None
        # No GPU (or no NVML) is a fact about this machine, not a mistake of the user's.
        print(f"no GPU topology here: {e}", file=sys.stderr)
        if args.json:  # stdout stays JSON, and says so
            print(json.dumps({"topology": None, "error": str(e), "presets": sorted(PRESETS)}, indent=2))
        else:
            print("presets: " + ", ".join(sorted(PRESETS)))
        return EXIT_OK
    if args.json:
        print(topo.to_json())
        return EXIT_OK
    print(topo.render_matrix())
    print(f"name: {topo.name} (source: {topo.source})")
    print(f"GPUs per node: {topo.gpus_per_node} x {topo.nodes} node(s), arch {topo.arch}, "
          f"NVSwitch: {'yes' if topo.has_nvswitch else 'no'}")
    intra = topo.intra_node_gbps
    print(f"intra-node: {topo.intra_node_fabric or 'unknown'}, "
          f"{'unknown' if intra is None else f'{intra:g} GB/s'} per GPU per direction")
    inter = topo.inter_node_gbps
    print(f"inter-node: {'unknown' if inter is None else f'{inter:g} GB/s'} per node per direction")
    # The key autotune caches this topology's profiles under (the inter-node rate left out), not topo.fingerprint().
    print(f"fingerprint: {profile_fingerprint(topo)}")
    for note in topo.notes:
        print(f"note: {note}")
    return EXIT_OK


def cmd_profile_show(args: argparse.Namespace) -> int:
    """``ddp-triton profile show FILE``: a profile in words, or as validated JSON."""
    try:
        prof = Profile.load(args.file)
    except ProfileError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(prof.to_json())
    else:
        print(f"file: {args.file}")
        print(f"digest: {prof.digest()}")
        print(prof.summary())
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    """``ddp-triton env``: versions, GPUs and NVML status, for bug reports."""
    info = collect_env()
    print(json.dumps(info, indent=2, default=str) if args.json else format_env(info))
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------------
# Parser and entry point
# --------------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own: usage + message, exit 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ddp-triton", description="Topology-aware tuning for PyTorch DDP gradient all-reduce.")
    p.add_argument("--version", action="version", version=f"ddp-triton {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("topo", help="show the GPU topology (NVML, a preset, or a JSON file)",
                       description="Show the GPU topology as `nvidia-smi topo -m` does, with link rates and the "
                                   "fingerprint profiles are cached under.")
    t.add_argument("--topology", metavar="NAME|FILE", help="a preset name or a topology JSON file (default: NVML)")
    t.add_argument("--json", action="store_true", help="print the topology as JSON")
    t.set_defaults(func=cmd_topo)

    a = sub.add_parser("autotune", help="make a tuning profile (model, measured, or end to end)",
                       description="Choose the NCCL all-reduce algorithm per message size and the DDP bucket size. "
                                   "Default: time all-reduces on one process per local GPU (or in place under "
                                   "torchrun). The profile is cached where the hook looks for it.")
    mode = a.add_argument_group("mode")
    mode.add_argument("--model-only", action="store_true", help="use the cost model only (no GPU needed)")
    mode.add_argument("--calibration", metavar="PROFILE",
                      help="--model-only: apply the cost-model calibration a measured profile holds (measured on "
                           "one node, say, and predicted here for --nodes K over the inter-node link)")
    mode.add_argument("--wire-formats", action="store_true",
                      help="--model-only: also print the predicted time of each wire format (fp32, bf16, fp16, "
                           "bf16+fp32sum, fp8) per bucket size")
    mode.add_argument("--formats", nargs="?", const=",".join(DEFAULT_FORMATS), type=csv_list, metavar="LIST",
                      help="also choose the wire format per bucket size among these, comma-separated (default "
                           f"{','.join(DEFAULT_FORMATS)}: no FP8; e.g. fp8e4m3+ef or 'two-level fp8e4m3+ef' too); "
                           "the hook follows it with comm_dtype='auto'")
    mode.add_argument("--format-error", type=fraction, default=None, metavar="FRACTION",
                      help="--formats in measure mode: time each format until its median is known within this "
                           f"fraction ({CONFIDENCE * 100:.0f}%% interval; default {DEFAULT_REL_ERROR:g})")
    mode.add_argument("--format-budget", type=nonneg_float, default=None, metavar="SECONDS",
                      help="--formats in measure mode: seconds the format timings may take, all sizes together "
                           f"(each still gets its first {MIN_ROUNDS} rounds; default {DEFAULT_BUDGET_S:g})")
    mode.add_argument("--host-cost", choices=("gpu", "cpu"), default=None,
                      help="--formats with --model-only: the host cost per bucket the model adds: gpu (default) "
                           "or cpu (gloo ranks on CPU tensors)")
    mode.add_argument("--e2e", metavar="MODULE:FUNCTION",
                      help="time DDP steps of your model: FUNCTION() returns (model, loss_fn), loss_fn(model) "
                           "returns a scalar loss for one batch")
    topo = a.add_argument_group("topology")
    topo.add_argument("--topology", metavar="NAME|FILE", help="a preset name or a topology JSON file (default: NVML)")
    topo.add_argument("--nodes", type=positive_int, help="number of nodes (default: from torchrun, else 1)")
    topo.add_argument("--world-size", type=positive_int, help="ranks in all (default: nodes x GPUs per node)")
    topo.add_argument("--inter-node-gbps", type=positive_float, metavar="GBPS",
                      help="inter-node bandwidth per node per direction, GB/s (8 x 400 Gb/s = 400)")
    sw = a.add_argument_group("sweep")
    sw.add_argument("--comm-dtype", default="bfloat16",
                    help="dtype the hook all-reduces in: bfloat16 (default), float16 or float32")
    sw.add_argument("--dtypes", type=csv_list, help="dtypes to time, comma-separated (default: the comm dtype)")
    sw.add_argument("--min-bytes", type=parse_size, default=1 << 10, metavar="SIZE", help="smallest size (1K)")
    sw.add_argument("--max-bytes", type=parse_size, default=1 << 30, metavar="SIZE", help="largest size (1G)")
    sw.add_argument("--algorithms", type=csv_list, help="algorithms to time (default: what NCCL can run here)")
    sw.add_argument("--warmup", type=nonneg_int, default=None, help="warm-up iterations (5; e2e: 3 steps)")
    sw.add_argument("--iters", type=positive_int, default=20, help="timed iterations per point (20)")
    sw.add_argument("--backend", choices=("nccl", "gloo"), help="process group backend (default nccl)")
    sw.add_argument("--nproc", type=positive_int, help="local processes (default: one per GPU; gloo: 1)")
    sw.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds before the workers are killed")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")
    bk = a.add_argument_group("bucket size")
    bk.add_argument("--fraction", type=fraction, default=0.9, help="busbw fraction a bucket must reach (0.9)")
    bk.add_argument("--model-bytes", type=parse_size, help="gradient bytes of the model, to keep enough buckets")
    bk.add_argument("--min-buckets", type=positive_int, default=4, help="least buckets the model splits into (4)")
    bk.add_argument("--host-us-per-bucket", type=nonneg_float, default=DEFAULT_HOST_US_PER_BUCKET, metavar="US",
                    help="host time a bucket costs besides its all-reduce, counted against small buckets "
                         f"(python -m bench.hook_cost measures it; default {DEFAULT_HOST_US_PER_BUCKET:g}, the "
                         "H200's; 0: bandwidth alone)")
    e2e = a.add_argument_group("e2e")
    e2e.add_argument("--buckets", type=lambda s: [positive_float(x) for x in csv_list(s)],
                     help="bucket_cap_mb values to try (default: around the profile's choice, and 25)")
    e2e.add_argument("--hooks", type=csv_list, default=list(E2E_HOOKS),
                     help=f"hooks to try: {', '.join(E2E_HOOKS)}")
    e2e.add_argument("--steps", type=positive_int, default=10, help="timed steps per candidate (10)")
    out = a.add_argument_group("output")
    out.add_argument("--out", metavar="FILE", help="also write the profile here")
    out.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    out.add_argument("--nccl-tuner-csv", metavar="FILE", help="write the CSV NCCL's example tuner plugin reads")
    out.add_argument("--no-cache", action="store_true", help="do not write the profile to the cache")
    a.set_defaults(func=cmd_autotune)

    pr = sub.add_parser("profile", help="inspect profiles", description="Inspect tuning profiles.")
    prsub = pr.add_subparsers(dest="profile_command", metavar="ACTION", parser_class=_Parser)
    prsub.required = True
    show = prsub.add_parser("show", help="show a profile file", description="Show a profile file in words.")
    show.add_argument("file", metavar="FILE")
    show.add_argument("--json", action="store_true", help="print it as (validated) JSON")
    show.set_defaults(func=cmd_profile_show)

    e = sub.add_parser("env", help="versions, GPUs and NVML status for bug reports",
                       description="Versions of Python, torch, Triton and NCCL, the GPUs torch and NVML see.")
    e.add_argument("--json", action="store_true", help="print as JSON")
    e.set_defaults(func=cmd_env)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return code
    except UsageError as e:
        print(f"ddp-triton: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except WriteFailed as e:
        print(f"ddp-triton: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # the reader went away (`ddp-triton env | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return EXIT_BROKEN_PIPE
