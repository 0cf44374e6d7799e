"""The GPU topology: the data model, and where one comes from (NVML, presets, JSON files, the launcher).

- `model`: `Topology`, validated, saved and loaded as JSON, fingerprinted for the profile cache.
- `gpu`: `GPU`, one GPU's fields, link rates and architecture.
- `nvml`: `from_nvml()` reads this machine through NVML (pynvml's API), keeping what answers.
- `presets`: described machines (DGX H100, ...), `load_preset(name)`.
- `loader`: `load_topology(spec)`: a preset name, a JSON file, or NVML.
- `launch_env`: `apply_launch_env` fits a topology to the job as launched (nodes, GPUs per node); `under_torchrun`.
"""

from .gpu import GPU, TopologyError, cpu_affinity_from_words, format_cpu_ranges
from .launch_env import apply_launch_env, under_torchrun
from .loader import load_topology
from .model import LEGEND, Topology, build_matrix
from .nvml import from_nvml
from .presets import PRESETS, load_preset

__all__ = [
    "GPU",
    "LEGEND",
    "PRESETS",
    "Topology",
    "TopologyError",
    "apply_launch_env",
    "build_matrix",
    "cpu_affinity_from_words",
    "format_cpu_ranges",
    "from_nvml",
    "load_preset",
    "load_topology",
    "under_torchrun",
]
