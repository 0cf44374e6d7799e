"""``ddp-triton``: look at the topology, make and show tuning profiles, report the environment.

Subcommands:

* ``topo``: the GPU topology (NVML, a preset or a JSON file) as ``nvidia-smi topo -m`` prints it, or JSON (with
  none found, ``--json`` prints an object with ``topology`` null, the ``error`` and the ``presets``).
* ``autotune``: make a profile. ``--model-only`` from the cost model (no GPU needed); by default by timing
  all-reduces (one process per local GPU, or in place under ``torchrun`` for several nodes; ``--backend gloo
  --nproc N`` times CPU processes); ``--e2e MODULE:FUNCTION`` by timing DDP steps of your model. The profile goes
  to the cache the hook reads, and to ``--out`` / stdout (``--json``) / ``--nccl-tuner-csv`` on request.
* ``profile show FILE``: a profile in words (or ``--json``).
* ``env``: versions of Python, torch, Triton and NCCL, the GPUs torch and NVML see: what a bug report needs.

Exit codes: 0 done, 2 bad usage or bad input (unknown topology, unreadable profile, impossible numbers, an output
path that is a symlink, directory, device or FIFO), 1 a failure while measuring or while writing an output that
passed its checks. Every output is checked before any is written, and written atomically (``safe_write``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, List, NoReturn, Optional, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE

#: dtypes the hook can all-reduce in (``ddp_triton.state.COMM_DTYPES``, spelled as profiles spell them; not
#: imported from there, which would load Triton for every command). ``--dtypes`` may time others.
HOOK_COMM_DTYPES = ("bfloat16", "float16", "float32")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
    """Bad usage or bad input: reported as ``ddp-triton: error: ...`` with exit code 2."""


def parse_size(text: str) -> int:
    """'4096', '64K', '1MiB', '1G' -> bytes (K/M/G/T are powers of 1024, as nccl-tests' -b/-e)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M, 1G)")
    value = float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes >= 1, got {text!r}")
    return int(value)


def _int_at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def _fraction(text: str) -> float:
    v = _positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def _csv_list(text: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


# --------------------------------------------------------------------------------------------------------------------
# topo
# --------------------------------------------------------------------------------------------------------------------


def _load_topo(spec: Optional[str]) -> Any:
    from .topology import TopologyError, load_topology

    try:
        return load_topology(spec)
    except TopologyError as e:
        raise UsageError(str(e)) from None


def cmd_topo(args: argparse.Namespace) -> int:
    from .topology import TopologyError, load_topology

    try:
        topo = load_topology(args.topology)
    except TopologyError as e:
        if args.topology is not None:
            raise UsageError(str(e)) from None
        # No GPU (or no NVML) is a fact about this machine, not a mistake of the user's.
        from .topology import PRESETS

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
    print(f"fingerprint: {topo.fingerprint()}")
    for note in topo.notes:
        print(f"note: {note}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------------
# autotune
# --------------------------------------------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _launch_topology(args: argparse.Namespace, world_size: Optional[int], required: bool) -> Any:
    """The topology as launched (nodes, ranks per node), or None when it is unknown and not required."""
    from .topology import TopologyError, apply_launch_env, load_topology

    try:
        topo = load_topology(args.topology)
    except TopologyError as e:
        if required or args.topology is not None:
            raise UsageError(str(e)) from None
        from .log import warn_once

        warn_once(f"topology unknown ({e}); the profile gets no fingerprint, so the hook will not find it in the "
                  "cache: pass --topology, and use --out to keep it")
        return None
    _check_world_fits(topo, args, world_size)
    try:
        return apply_launch_env(topo, nodes=args.nodes, world_size=world_size, inter_node_gbps=args.inter_node_gbps)
    except (TopologyError, ValueError) as e:
        raise UsageError(str(e)) from None


def _check_world_fits(topo: Any, args: argparse.Namespace, world_size: Optional[int]) -> None:
    """A world size the topology's GPUs per node cannot hold over the nodes given, named in the flags' words (the
    library's own error speaks of its ``nodes=`` argument). Node counts from the launcher are left to it."""
    if world_size is None or (args.nodes is None and "LOCAL_WORLD_SIZE" in os.environ):
        return
    nodes = args.nodes if args.nodes is not None else topo.nodes
    have = topo.gpus_per_node
    if world_size % nodes or world_size // nodes <= have:
        return
    fits = next(n for n in range(-(-world_size // have), world_size + 1) if world_size % n == 0)
    given = f"--nodes {args.nodes}" if args.nodes is not None else f"{nodes} node(s)"
    other = " (or a smaller --world-size)" if args.world_size is not None else ""
    raise UsageError(f"world size {world_size} over {given} needs {world_size // nodes} GPUs per node, but topology "
                     f"{topo.name!r} has {have}: pass --nodes {fits}{other}")


def _sizes(args: argparse.Namespace, comm_dtype: str) -> List[int]:
    from .cost_model import default_sizes, dtype_size

    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    try:
        sizes = default_sizes(args.min_bytes, args.max_bytes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if sizes[-1] < dtype_size(comm_dtype):
        raise UsageError(f"--max-bytes {args.max_bytes} is less than one {comm_dtype} element")
    return sizes


def _check_tuner_csv(args: argparse.Namespace, topo: Any, backend: str) -> None:
    """Before measuring: can the measured profile become NCCL's tuner CSV? It needs the cost model's protocol per
    range, hence an NCCL measurement and a topology the model can describe."""
    if not args.nccl_tuner_csv:
        return
    if backend != "nccl":
        raise UsageError(f"--nccl-tuner-csv needs NCCL's protocols; backend {backend} has none (use --backend nccl, "
                         "or --model-only)")
    if topo is None:
        raise UsageError("--nccl-tuner-csv needs a protocol per range, guessed by the cost model from the topology: "
                         "pass --topology")
    from .cost_model import Fabric

    try:
        Fabric.from_topology(topo)
    except ValueError as e:
        raise UsageError(f"--nccl-tuner-csv needs the cost model's protocols: {e}") from None


class _WriteFailed(Exception):
    """An output that passed its checks could not be written (disk full, say): one line, exit 1."""


def _writes_cache(args: argparse.Namespace) -> bool:
    """Does this process write the cache? Under torchrun, rank 0 and the first process of each other node do."""
    if args.no_cache:
        return False
    return not _under_torchrun() or os.environ.get("RANK") == "0" or os.environ.get("LOCAL_RANK") == "0"


def _writes_files(args: argparse.Namespace) -> bool:
    """Does this process write --out and --nccl-tuner-csv? Rank 0 does (it reports)."""
    return not _under_torchrun() or os.environ.get("RANK") == "0"


def _check_outputs(args: argparse.Namespace, profile: Any = None) -> None:
    """Every output this process will write can be written: UsageError naming the first that cannot, before any is
    written (and, called without a profile, before measuring). A path must be new (its folders are made) or a
    regular file: never a symlink, directory, device or FIFO (``ddp_triton.safe_write``)."""
    from .profile import ProfileError, cache_dir, check_cache_writable
    from .safe_write import OutputError, check_writable_target

    if _writes_cache(args):
        try:
            check_cache_writable(profile)
        except ProfileError as e:
            xdg = os.environ.get("XDG_CACHE_HOME")
            where = f"XDG_CACHE_HOME={xdg}" if xdg else f"the cache is {cache_dir()}"
            raise UsageError(f"{e} ({where}; or pass --no-cache)") from None
    if not _writes_files(args):
        return
    named = [(flag, path) for flag, path in (("--out", args.out), ("--nccl-tuner-csv", args.nccl_tuner_csv))
             if path is not None]
    for flag, path in named:
        try:
            check_writable_target(path)
        except OutputError as e:
            raise UsageError(f"{flag} {e}") from None
    if len(named) == 2 and os.path.abspath(named[0][1]) == os.path.abspath(named[1][1]):
        raise UsageError(f"--out and --nccl-tuner-csv name the same file {named[0][1]}")


def _emit(profile: Any, args: argparse.Namespace) -> int:
    """Write the profile where asked: cache, --out, --nccl-tuner-csv, stdout. Everything is rendered and every
    output checked before the first is written."""
    from .autotune import nccl_tuner_csv_text
    from .profile import ProfileError, save_to_cache
    from .safe_write import OutputError, atomic_write_text

    human = sys.stderr if args.json else sys.stdout
    csv_text = None
    if args.nccl_tuner_csv:
        try:
            csv_text = nccl_tuner_csv_text(profile)
        except ValueError as e:
            raise UsageError(f"--nccl-tuner-csv: {e}") from None
    _check_outputs(args, profile)
    written = []
    try:
        if not args.no_cache:
            cached = save_to_cache(profile)
            if cached is not None:
                written.append(cached)
            else:
                print("not cached: no topology fingerprint", file=human)
        if args.out:
            written.append(profile.save(args.out))
        if csv_text is not None:
            written.append(atomic_write_text(args.nccl_tuner_csv, csv_text))
    except (ProfileError, OutputError) as e:
        done = f" (written before it: {', '.join(map(str, written))})" if written else ""
        raise _WriteFailed(f"{e}{done}") from None
    if args.json:
        print(profile.to_json())
    else:
        print(profile.summary())
    for p in written:
        print(f"wrote {p}", file=human)
    return EXIT_OK


def _common_profile_kwargs(args: argparse.Namespace) -> dict:
    return {"fraction": args.fraction, "model_bytes": args.model_bytes, "min_buckets": args.min_buckets}


def cmd_autotune(args: argparse.Namespace) -> int:
    from . import cost_model as cm

    try:
        comm_dtype = cm.normalize_dtype(args.comm_dtype)
        dtypes = [cm.normalize_dtype(d) for d in args.dtypes] if args.dtypes else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if comm_dtype not in HOOK_COMM_DTYPES:
        raise UsageError(f"--comm-dtype {args.comm_dtype}: the hook all-reduces in {', '.join(HOOK_COMM_DTYPES)} "
                         "only (--dtypes may time others)")
    if args.algorithms:
        bad = [a for a in args.algorithms if a not in cm.ALGORITHMS]
        if bad:
            raise UsageError(f"unknown algorithm(s) {bad}; known: {', '.join(cm.ALGORITHMS)}")
    from .measure import E2E_HOOKS

    bad_hooks = [h for h in args.hooks if h not in E2E_HOOKS]
    if bad_hooks:
        raise UsageError(f"unknown hook(s) {bad_hooks}; known: {', '.join(E2E_HOOKS)}")
    modes = [m for m, on in (("--model-only", args.model_only), ("--e2e", args.e2e)) if on]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} exclude each other")
    _check_outputs(args)  # before modelling or measuring: an output that cannot be written fails now
    if args.model_only:
        return _autotune_model(args, comm_dtype)
    return _autotune_distributed(args, comm_dtype, dtypes)


def _autotune_model(args: argparse.Namespace, comm_dtype: str) -> int:
    from .autotune import model_profile

    topo = _launch_topology(args, args.world_size, required=True)
    try:
        prof = model_profile(topo, comm_dtype=comm_dtype, sizes=_sizes(args, comm_dtype),
                             **_common_profile_kwargs(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return _emit(prof, args)


def _autotune_distributed(args: argparse.Namespace, comm_dtype: str, dtypes: Optional[List[str]]) -> int:
    import torch
    import torch.distributed as dist

    from .autotune import e2e_worker, fallback_profile, measure_worker, model_profile, share_profile
    from .measure import init_in_place, leave_process_group, spawn_local
    from .profile import Profile

    backend = args.backend
    if backend is None:
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise UsageError("no CUDA GPU with NCCL here: use --model-only (with --topology), or --backend gloo "
                             "--nproc N to time CPU processes")
        backend = "nccl"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA GPUs; none are visible")
    if args.algorithms and not args.e2e:
        if backend != "nccl" and args.algorithms != ["ring"]:
            raise UsageError(f"backend {backend} has one all-reduce algorithm (recorded as ring); "
                             f"cannot sweep {','.join(args.algorithms)}")
        if backend == "nccl":
            from .algo_groups import check_nccl_support, nccl_version

            try:
                check_nccl_support(args.algorithms, nccl_version())
            except RuntimeError as e:
                raise UsageError(str(e)) from None
    torchrun = _under_torchrun()
    if torchrun:
        nproc = None
        world = int(os.environ["WORLD_SIZE"])
    else:
        nproc = args.nproc or (torch.cuda.device_count() if backend == "nccl" else 1)
        if backend == "nccl" and nproc > torch.cuda.device_count():
            raise UsageError(f"--nproc {nproc} but only {torch.cuda.device_count()} GPUs are visible")
        world = nproc
    if args.world_size is not None and args.world_size != world:
        raise UsageError(f"--world-size {args.world_size} does not match the {world} processes that will run "
                         "(set --nproc, or the launcher's world size)")
    topo = _launch_topology(args, world, required=False)
    sizes = _sizes(args, comm_dtype)
    if args.e2e:
        from .measure import load_factory
        from .profile import find_cached_profile, profile_fingerprint

        try:
            load_factory(args.e2e)  # fail here, with exit 2, rather than in every worker
        except ValueError as e:
            raise UsageError(str(e)) from None
        base = None
        if topo is not None:
            base = find_cached_profile(profile_fingerprint(topo), topo.world_size, topo.nodes, comm_dtype)
            if base is None:
                try:
                    base = model_profile(topo, comm_dtype=comm_dtype, sizes=sizes, **_common_profile_kwargs(args))
                except ValueError:
                    base = None
        if base is None:
            base = fallback_profile(world, topo.nodes if topo is not None else 1, comm_dtype, backend)
        if args.nccl_tuner_csv and any(t.protocol is None for t in base.table):
            raise UsageError("--nccl-tuner-csv needs a protocol per range; the base profile e2e mode starts from "
                             "has none (no topology the cost model can describe, or a cached profile measured "
                             "without one): pass --topology (and --inter-node-gbps for several nodes), or make the "
                             "CSV with --model-only")
        config = {"factory": args.e2e, "base": base.to_dict(), "bucket_mbs": args.buckets,
                  "hooks": args.hooks, "warmup": args.warmup if args.warmup is not None else 3,
                  "steps": args.steps}
        worker, fn_path = e2e_worker, "ddp_triton.autotune:e2e_worker"
    else:
        _check_tuner_csv(args, topo, backend)
        config = {"topology": topo.to_dict() if topo is not None else None, "sizes": sizes,
                  "algorithms": args.algorithms, "comm_dtype": comm_dtype, "dtypes": dtypes,
                  "warmup": args.warmup if args.warmup is not None else 5, "iters": args.iters,
                  "progress": not args.no_progress, **_common_profile_kwargs(args)}
        worker, fn_path = measure_worker, "ddp_triton.autotune:measure_worker"
    # Usage was checked above: from here on, any error (ValueError included) is a failure while measuring.
    try:
        if torchrun or nproc == 1:
            created = init_in_place(backend)
            try:
                result = worker(config)
                if torchrun:  # rank 0's profile, cached on every node for the hook's profile="auto"
                    result, _ = share_profile(result, cache=not args.no_cache)
            except BaseException:
                if created:
                    dist.destroy_process_group()  # no barrier: the other ranks may never reach one
                raise
            if created:
                leave_process_group()
            if torchrun and int(os.environ["RANK"]) != 0:
                return EXIT_OK  # rank 0 reports
        else:
            result = spawn_local(fn_path, nproc, backend, (config,), timeout_s=args.timeout)
    except ImportError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # a failure while measuring: report it whole, exit 1
        print(f"ddp-triton: autotune failed: {e.__class__.__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return _emit(Profile.from_dict(result), args)


# --------------------------------------------------------------------------------------------------------------------
# profile show, env
# --------------------------------------------------------------------------------------------------------------------


def cmd_profile_show(args: argparse.Namespace) -> int:
    from .profile import Profile, ProfileError

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
    from .envinfo import collect_env, format_env

    info = collect_env()
    print(json.dumps(info, indent=2, default=str) if args.json else format_env(info))
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own: usage + message, exit 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

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
    mode.add_argument("--e2e", metavar="MODULE:FUNCTION",
                      help="time DDP steps of your model: FUNCTION() returns (model, loss_fn), loss_fn(model) "
                           "returns a scalar loss for one batch")
    topo = a.add_argument_group("topology")
    topo.add_argument("--topology", metavar="NAME|FILE", help="a preset name or a topology JSON file (default: NVML)")
    topo.add_argument("--nodes", type=_positive_int, help="number of nodes (default: from torchrun, else 1)")
    topo.add_argument("--world-size", type=_positive_int, help="ranks in all (default: nodes x GPUs per node)")
    topo.add_argument("--inter-node-gbps", type=_positive_float, metavar="GBPS",
                      help="inter-node bandwidth per node per direction, GB/s (8 x 400 Gb/s = 400)")
    sw = a.add_argument_group("sweep")
    sw.add_argument("--comm-dtype", default="bfloat16",
                    help="dtype the hook all-reduces in: bfloat16 (default), float16 or float32")
    sw.add_argument("--dtypes", type=_csv_list, help="dtypes to time, comma-separated (default: the comm dtype)")
    sw.add_argument("--min-bytes", type=parse_size, default=1 << 10, metavar="SIZE", help="smallest size (1K)")
    sw.add_argument("--max-bytes", type=parse_size, default=1 << 30, metavar="SIZE", help="largest size (1G)")
    sw.add_argument("--algorithms", type=_csv_list, help="algorithms to time (default: what NCCL can run here)")
    sw.add_argument("--warmup", type=_nonneg_int, default=None, help="warm-up iterations (5; e2e: 3 steps)")
    sw.add_argument("--iters", type=_positive_int, default=20, help="timed iterations per point (20)")
    sw.add_argument("--backend", choices=("nccl", "gloo"), help="process group backend (default nccl)")
    sw.add_argument("--nproc", type=_positive_int, help="local processes (default: one per GPU; gloo: 1)")
    sw.add_argument("--timeout", type=_positive_float, default=3600.0, help="seconds before the workers are killed")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")
    bk = a.add_argument_group("bucket size")
    bk.add_argument("--fraction", type=_fraction, default=0.9, help="busbw fraction a bucket must reach (0.9)")
    bk.add_argument("--model-bytes", type=parse_size, help="gradient bytes of the model, to keep enough buckets")
    bk.add_argument("--min-buckets", type=_positive_int, default=4, help="least buckets the model splits into (4)")
    e2e = a.add_argument_group("e2e")
    e2e.add_argument("--buckets", type=lambda s: [_positive_float(x) for x in _csv_list(s)],
                     help="bucket_cap_mb values to try (default: around the profile's choice, and 25)")
    e2e.add_argument("--hooks", type=_csv_list, default=["allreduce", "bf16_compress", "triton"],
                     help="hooks to try: allreduce, bf16_compress, triton")
    e2e.add_argument("--steps", type=_positive_int, default=10, help="timed steps per candidate (10)")
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
    except _WriteFailed as e:
        print(f"ddp-triton: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # the reader went away (`ddp-triton env | head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
