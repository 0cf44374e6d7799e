"""What a user reaches after a plain ``import ddp_triton``: every public name, and the ``fsdp`` module the docs call
as ``ddp_triton.fsdp.register``; each in a fresh interpreter, since an earlier import elsewhere would hide a miss."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ddp_triton

NAMES = [name for name in ddp_triton.__all__ if name != "__version__"]


def _reach(expression: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"import ddp_triton; {expression}"], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name", NAMES)
def test_every_public_name_is_reached_from_the_package(name):
    assert getattr(ddp_triton, name) is not None


def test_fsdp_register_is_reached_after_import_ddp_triton():
    done = _reach("print(ddp_triton.fsdp.register.__module__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ddp_triton.runtime.fsdp"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'hook_of_nothing'"):
        ddp_triton.hook_of_nothing  # noqa: B018
