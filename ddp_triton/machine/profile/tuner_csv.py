"""A profile's table as the CSV of NCCL's example tuner plugin: a function of the profile alone, which
``autotune --model-only --nccl-tuner-csv`` writes without loading torch.
"""

from __future__ import annotations

from .schema import Profile

#: NCCL's tuner plugin matches sizes with size_t; this is SIZE_MAX on 64-bit, "no upper bound".
TUNER_MAX_BYTES = (1 << 64) - 1
TUNER_CSV_HEADER = "collective,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks"


def nccl_tuner_csv_text(profile: Profile) -> str:
    """The table as the CSV of NCCL's example tuner plugin (plugins/tuner/example, ``NCCL_TUNER_CONFIG_FILE``).

    One ``allreduce`` row per range: ``collective,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks``
    with channels -1 (NCCL's choice) and the profile's nodes and world size. The plugin needs a protocol per row;
    a range without one (measured without a topology to model protocols) is a ValueError.
    """
    missing = [t for t in profile.table if t.protocol is None]
    if missing:
        raise ValueError(f"{len(missing)} of the profile's ranges have no protocol (measured without a topology); "
                         "NCCL's tuner CSV needs one per row: re-run autotune with --topology")
    lines = [f"# ddp-triton {profile.source} profile {profile.digest()[:16]}, {profile.created}",
             f"# {TUNER_CSV_HEADER}"]
    for t in profile.table:
        hi = TUNER_MAX_BYTES if t.max_bytes is None else t.max_bytes
        lines.append(f"allreduce,{t.min_bytes},{hi},{t.algorithm},{t.protocol.lower()},-1,"  # type: ignore[union-attr]
                     f"{profile.nodes},{profile.world_size}")
    return "\n".join(lines) + "\n"
