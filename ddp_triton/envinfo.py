"""What this machine runs: versions of Python, torch, NCCL, Triton, the driver, and which GPUs answer.

Benchmark results and bug reports carry this dict so that numbers can be compared across machines. It must work
everywhere, a CPU-only laptop included: every probe catches its own failure and records it instead of raising.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any, Dict, List, Optional


def _dist_version(*names: str) -> Optional[str]:
    """Installed version of the first distribution found (e.g. "triton" or nightly's "pytorch-triton")."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken installation's metadata
            continue
    return None


def _err(e: BaseException) -> str:
    try:
        msg = str(e)
    except Exception:  # pynvml's __str__ may call into NVML
        msg = ""
    name = type(e).__name__
    return f"{name}: {msg}" if msg and msg != name else name


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


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
    try:
        import torch
    except Exception as e:
        out["torch_error"] = _err(e)
        return out
    out["torch"] = getattr(torch, "__version__", None)
    out["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        import torch.distributed as dist

        out["torch_nccl_built"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        pass
    if out["torch_nccl_built"]:
        try:
            v = torch.cuda.nccl.version()
            # a (major, minor, patch) tuple in current torch, an int like 21803 in old releases
            out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:
        out["torch_error"] = _err(e)
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
        try:
            import pynvml as nvml
        except Exception as e:
            out["nvml_error"] = f"cannot import pynvml ({_err(e)}); pip install nvidia-ml-py"
            return out
    try:
        nvml.nvmlInit()
    except Exception as e:
        out["nvml_error"] = f"nvmlInit failed: {_err(e)}"
        return out
    try:
        try:
            out["driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
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
            out["nvml_error"] = f"nvmlDeviceGetCount failed: {_err(e)}"
            return out
        names: List[str] = []
        for i in range(count):
            try:
                names.append(str(_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))))
            except Exception as e:
                names.append(f"GPU {i} (name unreadable: {_err(e)})")
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
        "ddp_triton": _dist_version("ddp-triton"),
    }
    env.update(_torch_info())
    env["triton"] = _dist_version("triton", "pytorch-triton", "triton-nightly")
    env["numpy"] = _dist_version("numpy")
    env["nvidia_ml_py"] = _dist_version("nvidia-ml-py", "pynvml")
    try:
        env.update(_nvml_info(nvml))
    except Exception as e:  # a stand-in module that misbehaves beyond pynvml's API
        env.update(nvml_ok=False, nvml_error=_err(e))
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
