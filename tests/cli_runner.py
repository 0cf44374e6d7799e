"""The ``ddp-triton`` command line run as a user runs it, in a subprocess, for the CLI tests of every tier.

``env`` is a fixture: a test module that imports it gets it. It gives this process and its subprocesses a private
XDG_CACHE_HOME, so the cache they write is the test's, and no launcher variables, so no run takes itself for a rank.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The environment of a CLI subprocess, also set on this process for the CLI run in process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    e = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    for k in LAUNCH_VARIABLES:
        e.pop(k, None)
        monkeypatch.delenv(k, raising=False)
    return e


def cli(env, *args, cwd=None, timeout=120):
    """``python -m ddp_triton.cli *args`` from the checkout (or ``cwd``); its exit code and output, as text."""
    return subprocess.run([sys.executable, "-m", "ddp_triton.cli", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)
