"""What this machine runs: versions of Python, torch, NCCL, Triton, the driver, and which GPUs answer.

Benchmark results and bug reports carry this dict so that numbers can be compared across machines. It must work
everywhere, a CPU-only laptop included: every probe catches its own failure and records it instead of raising.
"""

from __future__ import annotations

import platform
import sys
from typing import Any, Dict, List

from .log import describe_error
from .machine.topology.nvml import nvml_text
from .versions import nccl_version_text, package_version


def _torch_info() -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "torch": None,
        "torch_cuda": None,
        "torch_nccl_built": False,
        "nccl_version": None,
        "cuda_available": False,
        "cuda_devices": [],
        "torch_error": None,
    }
    try:  # here, not at the top: a torch that fails to import is a finding to report, not a crash
        import torch
    except Exception as e:
        out["torch_error"] = describe_error(e)
        return out
    out["torch"] = getattr(torch, "__version__", None)
    out["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        import torch.distributed as dist

        out["torch_nccl_built"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        pass
    if out["torch_nccl_built"]:
        out["nccl_version"] = nccl_version_text()
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:
        out["torch_error"] = describe_error(e)
    return out


def _nvml_info(nvml: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "nvml_ok": False,
        "nvml_error": None,
        "driver_version": None,
        "cuda_driver_version": None,
        "nvml_devices": [],
    }
    if nvml is None:
        try:  # here, not at the top: NVML is an optional dependency, and a failed import is a finding to report
            import pynvml as nvml
        except Exception as e:
            out["nvml_error"] = f"cannot import pynvml ({describe_error(e)}); pip install nvidia-ml-py"
            return out
    try:
        nvml.nvmlInit()
    except Exception as e:
        out["nvml_error"] = f"nvmlInit failed: {describe_error(e)}"
        return out
    try:
        try:
            out["driver_version"] = nvml_text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        try:
            v = int(nvml.nvmlSystemGetCudaDriverVersion())  # e.g. 13000 = CUDA 13.0
            out["cuda_driver_version"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            out["nvml_error"] = f"nvmlDeviceGetCount failed: {describe_error(e)}"
            return out
        names: List[str] = []
        for i in range(count):
            try:
                names.append(str(nvml_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))))
            except Exception as e:
                names.append(f"GPU {i} (name unreadable: {describe_error(e)})")
        out["nvml_devices"] = names
        out["nvml_ok"] = True
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return out


def collect_env(nvml: Any = None) -> Dict[str, Any]:
    """A flat, JSON-ready dict of versions and devices; never raises. nvml: a pynvml-like module (default pynvml)."""
    env: Dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "ddp_triton": package_version("ddp_triton"),
    }
    env.update(_torch_info())
    for key in ("triton", "numpy", "nvidia_ml_py"):
        env[key] = package_version(key)
    try:
        env.update(_nvml_info(nvml))
    except Exception as e:  # a stand-in module that misbehaves beyond pynvml's API
        env.update(nvml_ok=False, nvml_error=describe_error(e))
    return env


_LABELS = [
    ("python", "Python"),
    ("platform", "Platform"),
    ("ddp_triton", "ddp-triton"),
    ("torch", "torch"),
    ("torch_cuda", "torch built for CUDA"),
    ("torch_nccl_built", "torch built with NCCL"),
    ("nccl_version", "NCCL"),
    ("triton", "Triton"),
    ("numpy", "numpy"),
    ("nvidia_ml_py", "nvidia-ml-py"),
    ("cuda_available", "CUDA available"),
    ("cuda_devices", "CUDA devices (torch)"),
    ("torch_error", "torch error"),
    ("nvml_ok", "NVML answers"),
    ("nvml_error", "NVML error"),
    ("driver_version", "Driver"),
    ("cuda_driver_version", "CUDA driver API"),
    ("nvml_devices", "GPUs (NVML)"),
]


def format_env(d: Dict[str, Any]) -> str:
    """collect_env's dict as aligned "label: value" lines; None shows as "n/a", errors only when present."""

    def show(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, list):
            return ", ".join(map(str, v)) if v else "none"
        return str(v)

    rows = [
        (label, show(d[key])) for key, label in _LABELS if key in d and not (key.endswith("_error") and d[key] is None)
    ]
    known = {key for key, _ in _LABELS} | {"python_executable"}
    rows += [(key, show(v)) for key, v in d.items() if key not in known]
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label.ljust(width)} : {value}" for label, value in rows)
