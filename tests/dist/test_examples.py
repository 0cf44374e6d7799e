"""The examples run end to end: two gloo ranks started by torchrun (``--standalone``: a free port), a short run.

Tier: CPU, subprocesses. The loss must fall and the run must say what it sent; the checkpoints go to a temporary
folder.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script, *args, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "examples" / script), "--samples", "2048", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], run.stdout
    return run.stdout


def _has_fsdp2_custom_collectives():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_custom_reduce_scatter")


@pytest.mark.skipif(not _has_fsdp2_custom_collectives(), reason="this torch's FSDP2 takes no custom reduce-scatter")
@pytest.mark.parametrize("comm_dtype, wire", [("bf16", "bf16+fp32sum"), ("fp8", "fp8e4m3+ef")])
def test_fsdp_example_trains_and_saves_each_ranks_shard(comm_dtype, wire, tmp_path):
    out = torchrun("train_fsdp.py", "--comm-dtype", comm_dtype, "--checkpoint-dir", str(tmp_path / "ck"),
                   tmp_path=tmp_path)
    assert f"FSDP2 with {wire} on the wire" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["rank0.pt", "rank1.pt"]


def test_ddp_example_trains(tmp_path):
    out = torchrun("train.py", "--checkpoint", str(tmp_path / "example.pt"), tmp_path=tmp_path)
    assert "triton_hook bf16" in out and (tmp_path / "example.pt").exists()
