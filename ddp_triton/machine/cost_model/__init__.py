"""Cost model of NCCL all-reduce: ring, tree, NVLS and NVLS-tree, per message size and dtype; and of the wire
formats a gradient bucket can travel in.

What it is for: ranking NCCL's algorithms per message size (which one the hook should force for a bucket of a given
size), sizing DDP buckets, and predicting machines we cannot measure (``ddp-triton autotune --model-only``), from
one node's measurement (``--calibration``) or from public figures alone.

* ``fabric``: the vocabulary: ``Fabric`` (ranks, link rates and kinds), ``Layout``, ``Estimate``, nccl-tests'
  bandwidth arithmetic, which algorithms NCCL runs where.
* ``nccl``: NCCL's own tuning model (its constants, cited there) and what NCCL derives from the topology: channels,
  chunk sizes, thresholds.
* ``ramp``: what an all-reduce really costs with the protocol NCCL picks: LL's achieved bandwidth, channels per
  size, chunk pipelining. ``estimate``, ``sweep``, ``best``, ``nccl_choice``.
* ``calibration`` and ``fit``: per-algorithm factors fitted to a measured sweep (least squares on log-time).
* ``wire``: a bucket's wire formats (one all-reduce in bf16/fp16/fp32; all-to-all plus all-gather in bf16 with
  fp32 sums, or in block-scaled FP8), their bytes and predicted time, and a bucket cut into chunks (fill plus
  drain).

Units: bytes, microseconds, GB/s (10^9 bytes per second, as nccl-tests prints).
"""

from .calibration import AlgorithmCalibration, Calibration
from .fabric import (ALGORITHMS, MIN_NCCL_VERSION, NCCL_ALGO_NAMES, PROTOCOLS, Estimate, Fabric, Layout, algbw_gbps,
                     algorithm_unavailable_reason, available_algorithms, busbw_factor, busbw_gbps, default_sizes)
from .fit import fit_algorithm, fit_calibration
from .nccl import (BASE_LATENCY_US, HW_LATENCY_US, SINGLE_RANK_US, comm_channels, graph_channels, nccl_protocol,
                   nccl_protocol_time_us, nvls_chunk_bytes)
from .nccl import _latency_us  # noqa: F401 (NCCL's latency, which the tests check by hand)
from .ramp import (AMPERE_NVLINK_STEP_US, AMPERE_RING_LL_FACTOR, NVLS_CHUNK_SYNC_US, best, estimate, nccl_choice,
                   protocol_time_us, ring_windows, sweep)
from .wire import (CPU_HOST_COST, GPU_HOST_COST, MAX_CHUNKS, MIN_CHUNK_BYTES, HostCost, all_gather_time_us,
                   all_to_all_time_us, best_chunk_count, bucket_time_us, chunk_stages_us, chunkable, chunked_time_us,
                   collectives_of, host_time_us, link_bound_chunk_count, pipelined_us, two_level_node_bytes,
                   two_level_part, two_level_time_us, wire_bytes, wire_collectives, wire_format_time_us)

__all__ = [
    # vocabulary (fabric.py)
    "ALGORITHMS", "MIN_NCCL_VERSION", "NCCL_ALGO_NAMES", "PROTOCOLS", "Estimate", "Fabric", "Layout", "algbw_gbps",
    "algorithm_unavailable_reason", "available_algorithms", "busbw_factor", "busbw_gbps", "default_sizes",
    # NCCL's own model (nccl.py)
    "BASE_LATENCY_US", "HW_LATENCY_US", "SINGLE_RANK_US", "comm_channels", "graph_channels", "nccl_protocol",
    "nccl_protocol_time_us", "nvls_chunk_bytes",
    # the ramp (ramp.py)
    "AMPERE_NVLINK_STEP_US", "AMPERE_RING_LL_FACTOR", "NVLS_CHUNK_SYNC_US", "best", "estimate", "nccl_choice",
    "protocol_time_us", "ring_windows", "sweep",
    # calibration (calibration.py, fit.py)
    "AlgorithmCalibration", "Calibration", "fit_algorithm", "fit_calibration",
    # the wire of each format's traffic (wire.py; the formats themselves are ddp_triton.formats)
    "all_gather_time_us", "all_to_all_time_us", "wire_bytes", "wire_collectives", "wire_format_time_us",
    "two_level_node_bytes", "two_level_part", "two_level_time_us",
    # a bucket's whole cost (wire.py)
    "CPU_HOST_COST", "GPU_HOST_COST", "HostCost", "bucket_time_us", "collectives_of", "host_time_us",
    # a bucket cut into chunks (wire.py)
    "MAX_CHUNKS", "MIN_CHUNK_BYTES", "best_chunk_count", "chunk_stages_us", "chunkable", "chunked_time_us",
    "link_bound_chunk_count", "pipelined_us",
]
