"""The tuning profile: which NCCL algorithm each all-reduce size should use, and the DDP bucket size.

- `schema`: `Profile`, validated JSON (the schema is in its docstring), read and written as files; `ddp_kwargs`.
- `rows`: the rows and ranges a profile holds (sweep rows, algorithm ranges, the wire format choice), validated.
- `cache`: where profiles are cached, keyed by the hardware (`save_to_cache`, `find_cached_profile`).
- `build`: the table and bucket size from sweep rows; a profile from rows, from the cost model or from online
  tuning's choice; calibrations.
- `formats`: the wire format per bucket size among those allowed, and the substitutions (plain bf16, flat two-level).
- `format_rule`: the rule that picks a format from timings (medians, confidence intervals; the accuracy order is
  ``ddp_triton.formats``').
- `tuner_csv`: a profile's table as the CSV NCCL's example tuner plugin reads.
"""

from .build import (DEFAULT_FRACTION, DEFAULT_HOST_US_PER_BUCKET, DEFAULT_MAX_BUCKET_MB, build_table, calibrate,
                    check_calibration_fits, choose_bucket_cap_mb, fallback_profile, model_profile, node_fingerprint,
                    profile_from_choice, profile_from_rows, rows_for_dtype)
from .cache import cache_dir, cache_path, check_cache_writable, find_cached_profile, profile_fingerprint, save_to_cache
from .format_rule import (CONFIDENCE, DEFAULT_BUDGET_S, DEFAULT_REL_ERROR, MAX_ROUNDS, MIN_ROUNDS, TimingStats,
                          choose_format, decide_format, median_interval, significantly_faster)
from .formats import (DEFAULT_BUCKET_SIZES, DEFAULT_FORMATS, ERROR_RATIO_LIMIT, admitted_formats, choose_formats,
                      format_choice, model_format_choice, ring_error, runs_flat)
from .rows import FormatChoice, FormatRange, FormatRow, SweepRow, TableEntry
from .schema import (AUTO_FORMAT, DEFAULT_MIN_BUCKETS, MiB, Profile, ProfileError, ddp_kwargs, format_bytes,
                     load_profile, now_iso)
from .tuner_csv import TUNER_CSV_HEADER, TUNER_MAX_BYTES, nccl_tuner_csv_text

__all__ = [
    "AUTO_FORMAT",
    "CONFIDENCE",
    "DEFAULT_BUDGET_S",
    "DEFAULT_REL_ERROR",
    "MAX_ROUNDS",
    "MIN_ROUNDS",
    "TimingStats",
    "choose_format",
    "decide_format",
    "median_interval",
    "runs_flat",
    "significantly_faster",
    "DEFAULT_BUCKET_SIZES",
    "DEFAULT_FORMATS",
    "ERROR_RATIO_LIMIT",
    "FormatChoice",
    "FormatRange",
    "FormatRow",
    "admitted_formats",
    "choose_formats",
    "format_choice",
    "model_format_choice",
    "ring_error",
    "DEFAULT_FRACTION",
    "DEFAULT_HOST_US_PER_BUCKET",
    "DEFAULT_MAX_BUCKET_MB",
    "DEFAULT_MIN_BUCKETS",
    "MiB",
    "Profile",
    "ProfileError",
    "SweepRow",
    "TUNER_CSV_HEADER",
    "TUNER_MAX_BYTES",
    "TableEntry",
    "build_table",
    "cache_dir",
    "cache_path",
    "calibrate",
    "check_cache_writable",
    "check_calibration_fits",
    "choose_bucket_cap_mb",
    "ddp_kwargs",
    "fallback_profile",
    "find_cached_profile",
    "format_bytes",
    "load_profile",
    "model_profile",
    "nccl_tuner_csv_text",
    "node_fingerprint",
    "now_iso",
    "profile_fingerprint",
    "profile_from_choice",
    "profile_from_rows",
    "rows_for_dtype",
    "save_to_cache",
]
