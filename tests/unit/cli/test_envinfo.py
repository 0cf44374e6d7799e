"""collect_env / format_env: versions and devices, on a machine with or without GPU and NVML.

Tier: no device. NVML is played by the stand-ins of tests/nvml_fakes.py; the default-pynvml test accepts either
answer, so it passes on a GPU machine too.
"""

import importlib.metadata
import json
import platform

import numpy
import pytest
import torch

import nvml_fakes
from ddp_triton import envinfo, versions
from ddp_triton.envinfo import collect_env, format_env

KEYS = {
    "python",
    "platform",
    "torch",
    "torch_cuda",
    "torch_nccl_built",
    "nccl_version",
    "triton",
    "numpy",
    "nvidia_ml_py",
    "cuda_available",
    "cuda_devices",
    "nvml_ok",
    "nvml_error",
    "driver_version",
}


def line(text: str, label: str) -> str:
    """The value printed beside a label."""
    found = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.split(":", 1)[0].strip() == label]
    assert len(found) == 1, (label, text)
    return found[0]


def test_versions_and_shape():
    env = collect_env(nvml=nvml_fakes.unavailable())
    assert KEYS <= set(env)
    assert env["python"] == platform.python_version()
    assert env["torch"] == torch.__version__
    assert env["torch_cuda"] == torch.version.cuda
    assert env["numpy"] == numpy.__version__
    assert env["nvidia_ml_py"] == importlib.metadata.version("nvidia-ml-py")
    json.dumps(env)  # goes into benchmark result files as is


def test_without_nvml():
    env = collect_env(nvml=nvml_fakes.unavailable())
    assert env["nvml_ok"] is False
    assert "nvmlInit" in env["nvml_error"] and "LibraryNotFound" in env["nvml_error"]
    assert env["driver_version"] is None and env["nvml_devices"] == []
    text = format_env(env)
    assert line(text, "NVML answers") == "no"
    assert "LibraryNotFound" in line(text, "NVML error")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_without_cuda():
    env = collect_env(nvml=nvml_fakes.unavailable())
    assert env["cuda_available"] is False and env["cuda_devices"] == []
    assert line(format_env(env), "CUDA available") == "no"
    if not env["torch_nccl_built"]:
        assert env["nccl_version"] is None


def test_with_fake_nvml():
    fake = nvml_fakes.h200_vm()
    env = collect_env(nvml=fake)
    assert env["nvml_ok"] is True and env["nvml_error"] is None
    assert env["driver_version"] == "580.159.04"
    assert env["cuda_driver_version"] is None  # the reading did not record it: the fake says NotSupported
    assert env["nvml_devices"] == ["NVIDIA H200"]
    assert fake.calls["nvmlShutdown"] == 1
    text = format_env(env)
    assert line(text, "Driver") == "580.159.04"
    assert line(text, "GPUs (NVML)") == "NVIDIA H200"
    assert "NVML error" not in text


def test_fake_nvml_bytes_and_cuda_driver():
    env = collect_env(nvml=nvml_fakes.dgx_h100())
    assert env["cuda_driver_version"] == "13.0"
    assert env["nvml_devices"] == ["NVIDIA H100 80GB HBM3"] * 8
    env = collect_env(nvml=nvml_fakes.nvlink_bridged_pcie())  # old pynvml: bytes
    assert env["driver_version"] == "580.159.04" and env["nvml_devices"][0] == "NVIDIA H100 PCIe"


@pytest.mark.parametrize(
    "nvml",
    [
        pytest.param(object(), id="no-functions"),
        pytest.param(nvml_fakes.FakeNVML([], init_error=RuntimeError("boom")), id="init-raises-anything"),
        pytest.param(
            nvml_fakes.FakeNVML([], count_error=nvml_fakes.nvml_error(nvml_fakes.pynvml.NVML_ERROR_UNKNOWN)),
            id="count-fails",
        ),
        pytest.param(nvml_fakes.bare(2), id="names-only"),
    ],
)
def test_never_raises(nvml):
    env = collect_env(nvml=nvml)
    assert isinstance(env["nvml_ok"], bool)
    if not env["nvml_ok"]:
        assert env["nvml_error"]
    assert format_env(env)


def test_default_nvml_answers_or_says_why():
    env = collect_env()
    if env["nvml_ok"]:
        assert env["nvml_devices"]
    else:
        assert env["nvml_error"]


def test_triton_missing(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if "triton" in name:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(versions.importlib.metadata, "version", version)
    env = collect_env(nvml=nvml_fakes.unavailable())
    assert env["triton"] is None
    assert line(format_env(env), "Triton") == "n/a"
