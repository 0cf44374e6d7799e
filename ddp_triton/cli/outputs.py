"""Where ``ddp-triton autotune`` writes its profile: the cache, ``--out``, ``--nccl-tuner-csv`` and stdout.

Every output this process will write is checked before any is written (and before measuring), and each is written
atomically; a path must be new (its folders are made) or a regular file, never a symlink, directory, device or FIFO
(``ddp_triton.safe_write``). Under torchrun, rank 0 reports and writes the files; the first process of each node
writes that node's cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..machine.profile import ProfileError, cache_dir, check_cache_writable, nccl_tuner_csv_text, save_to_cache
from ..machine.topology import under_torchrun
from ..safe_write import OutputError, atomic_write_text, check_writable_target
from .args import EXIT_OK, UsageError, WriteFailed


def _writes_cache(args: argparse.Namespace) -> bool:
    """Does this process write the cache? Under torchrun, rank 0 and the first process of each other node do."""
    if args.no_cache:
        return False
    return not under_torchrun() or os.environ.get("RANK") == "0" or os.environ.get("LOCAL_RANK") == "0"


def _writes_files(args: argparse.Namespace) -> bool:
    """Does this process write --out and --nccl-tuner-csv? Rank 0 does (it reports)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


def check_outputs(args: argparse.Namespace, profile: Any = None) -> None:
    """Every output this process will write can be written: UsageError naming the first that cannot, before any is
    written (and, called without a profile, before measuring)."""
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


def emit(profile: Any, args: argparse.Namespace) -> int:
    """Write the profile where asked: cache, --out, --nccl-tuner-csv, stdout. Everything is rendered and every
    output checked before the first is written."""
    human = sys.stderr if args.json else sys.stdout
    csv_text = None
    if args.nccl_tuner_csv:
        try:
            csv_text = nccl_tuner_csv_text(profile)
        except ValueError as e:
            raise UsageError(f"--nccl-tuner-csv: {e}") from None
    check_outputs(args, profile)
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
        raise WriteFailed(f"{e}{done}") from None
    if args.json:
        print(profile.to_json())
    else:
        print(profile.summary())
    for p in written:
        print(f"wrote {p}", file=human)
    return EXIT_OK
