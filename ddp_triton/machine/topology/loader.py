"""Where a topology comes from: a preset name, a JSON file, or this machine through NVML."""

from __future__ import annotations

import os
from typing import Any, Union

from . import nvml as nvml_reader
from .gpu import TopologyError
from .model import Topology
from .presets import PRESETS, load_preset


def load_topology(spec: Union[str, os.PathLike[str], None] = None, *, nvml: Any = None) -> Topology:
    """spec: a preset name, the path of a JSON file, or None / "nvml" to read this machine through NVML."""
    names = ", ".join(sorted(PRESETS))
    if spec is None or spec == "nvml":
        try:
            return nvml_reader.from_nvml(nvml)
        except TopologyError as e:
            raise TopologyError(
                f"{e}. Cannot read the GPU topology of this machine: pass --topology with a preset ({names}) "
                "or the path of a JSON file written by Topology.save"
            ) from e
    spec = os.fspath(spec)
    if spec in PRESETS:
        return load_preset(spec)
    if os.path.exists(spec) or spec.endswith(".json") or os.sep in spec:
        return Topology.load(spec)
    raise TopologyError(f"unknown topology {spec!r}: no preset of that name ({names}) and no such file")
