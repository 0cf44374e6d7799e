"""The tuning profile: which NCCL algorithm each all-reduce size should use, and the DDP bucket size.

- `schema`: `Profile` and its rows, validated JSON (the schema is in its docstring), `ddp_kwargs`.
- `cache`: where profiles are cached, keyed by the hardware (`save_to_cache`, `find_cached_profile`).
- `build`: the table and bucket size from sweep rows; a profile from rows or from the cost model; calibrations.
- `formats`: the wire format per bucket size, the fastest allowed, and the accuracy rule for plain bf16.
"""

from .build import (DEFAULT_FRACTION, DEFAULT_GRAD_DTYPE, DEFAULT_HOST_US_PER_BUCKET, DEFAULT_MAX_BUCKET_MB,
                    DEFAULT_TIE_TOLERANCE, build_table,
                    cached_or_model_profile, calibrate, check_calibration_fits, choose_bucket_cap_mb,
                    fallback_profile, model_profile, node_fingerprint, profile_from_rows, rows_for_dtype)
from .cache import (cache_dir, cache_path, cache_path_of, check_cache_writable, find_cached_profile,
                    profile_fingerprint, save_to_cache)
from .formats import (DEFAULT_BUCKET_SIZES, DEFAULT_FORMATS, ERROR_RATIO_LIMIT, admitted_formats, choose_formats,
                      format_choice, model_format_choice, model_format_rows, ring_error)
from .schema import (AUTO_FORMAT, BACKENDS, DEFAULT_MIN_BUCKETS, SCHEMA_VERSION, SOURCES, SUPPORTED_SCHEMA_VERSIONS,
                     FormatChoice, FormatRange, FormatRow, MiB, Profile, ProfileError, SweepRow, TableEntry,
                     ddp_kwargs, format_bytes, load_profile, now_iso)

__all__ = [
    "AUTO_FORMAT",
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
    "model_format_rows",
    "ring_error",
    "BACKENDS",
    "DEFAULT_FRACTION",
    "DEFAULT_GRAD_DTYPE",
    "DEFAULT_HOST_US_PER_BUCKET",
    "DEFAULT_MAX_BUCKET_MB",
    "DEFAULT_MIN_BUCKETS",
    "DEFAULT_TIE_TOLERANCE",
    "MiB",
    "Profile",
    "ProfileError",
    "SCHEMA_VERSION",
    "SOURCES",
    "SUPPORTED_SCHEMA_VERSIONS",
    "SweepRow",
    "TableEntry",
    "build_table",
    "cache_dir",
    "cache_path",
    "cache_path_of",
    "cached_or_model_profile",
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
    "node_fingerprint",
    "now_iso",
    "profile_fingerprint",
    "profile_from_rows",
    "rows_for_dtype",
    "save_to_cache",
]
