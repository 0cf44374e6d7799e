"""The package layout: ``kernels/`` is installed as ``ddp_triton.kernels`` from a built wheel, not as ``kernels``.

Tier: no device. Builds the wheel with the installed setuptools (no network), then imports from its files alone.
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setuptools_builds_wheels_offline() -> bool:
    """setuptools builds wheels itself from 70.1; older ones need the ``wheel`` package beside them."""
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) if p.isdigit() else 0 for p in setuptools.__version__.split(".")[:2])
    if version >= (70, 1):
        return True
    try:
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _setuptools_builds_wheels_offline(),
                    reason="no offline wheel build here: needs setuptools >= 70.1 or the wheel package")
def test_wheel_maps_kernels_into_the_package(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("ddp_triton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddp_triton/kernels/convert.py" in names and "ddp_triton/runtime/hook.py" in names
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "ddp_triton").rglob("*.py")}
    missing = sorted(p for p in on_disk if p not in names)
    assert not missing, f"modules left out of the wheel (pyproject's packages list): {missing}"
    assert "ddp_triton/kernels/blockscale_cpu.c" in names, "the compiled CPU passes' source (package-data) is left out"
    assert not any(n.startswith("kernels/") for n in names), "a top-level `kernels` package would clash on PyPI"
    assert any(n.endswith("entry_points.txt") for n in names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), TRITON_INTERPRET="0")
    probe = ("import ddp_triton.kernels as k, ddp_triton; from ddp_triton.kernels import native_cpu; "
             "print(k.__file__); print(ddp_triton.triton_hook.__name__); "
             "print(all(s.is_file() for s in native_cpu.SOURCES))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    kernels_file, hook_name, has_source = run.stdout.split()
    assert Path(kernels_file).is_relative_to(site) and hook_name == "triton_hook" and has_source == "True"
