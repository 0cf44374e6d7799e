"""The summary's rounding report: what a block-scaled bucket's quantization lost, measured on sampled passes.

Checked against the reference's quantization (``wire_reference``) of the same gradients, on 3 gloo ranks whose
gradients differ: at the first pass nothing is owed yet, so what each rank meant to send is its gradients / N.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_triton
from ddp_helpers import IN, OUT, local_grads, make_data, step, torch_path_workers
from wire_reference import quantize_dequantize
from ddp_triton.formats import WireFormat
from ddp_triton.runtime import telemetry


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 40), nn.GELU(), nn.Linear(40, OUT))


def _expected(model, rank, world_size, fmt):
    """(|rounding|, |meant|) of this rank's first pass, from the reference: per tensor, its own blocks."""
    lost = meant = 0.0
    for g in local_grads(model, [make_data(0)], rank, world_size):
        share = g.float().reshape(-1) * (1.0 / world_size)
        lost += (quantize_dequantize(share, fmt) - share).double().square().sum().item()
        meant += share.double().square().sum().item()
    return lost ** 0.5, meant ** 0.5


def _rounding_worker(rank, world_size, name):
    telemetry.ROUNDING_EVERY = 2  # a bucket's passes 1 and 3 measure
    wire = WireFormat.parse(name)
    model = _model()
    lost, meant = _expected(model, rank, world_size, wire.comm_dtype)
    ddp = DDP(model, bucket_cap_mb=25)
    state = ddp_triton.register(ddp, comm_dtype=name)
    step(ddp, rank, world_size, 0)
    (bucket,) = state.summary().buckets
    assert bucket.rounding_pass == 1
    # The rounding as kept (in bfloat16: each element within 2^-9 of it) against the reference's, in float32.
    assert bucket.rounding_error == pytest.approx(lost / meant, rel=2e-3), (bucket.rounding_error, lost / meant)
    if wire.error_feedback:
        # Nothing was owed before: all it owes now is the first pass's rounding; bfloat16 residuals of every element
        # (first stage) and of this rank's shard of rows (second stage).
        assert bucket.residual_norm == pytest.approx(bucket.rounding_error, rel=1e-5)
        (plan,) = state.plans.values()
        rows = plan.residuals.layouts[0].rows_per_shard
        assert bucket.residual_bytes == 2 * (sum(p.numel() for p in model.parameters()) + rows * 128)
    else:
        assert bucket.residual_norm is None and bucket.residual_bytes is None
    # DDP's rebuilt bucket measures at its own first and third pass: the state's second and fourth.
    for k in (1, 2, 3):
        step(ddp, rank, world_size, k)
        (bucket,) = state.summary().buckets
        assert bucket.rounding_pass == (2 if k < 3 else 4), (k, str(state.summary()))
    text = str(state.summary())
    assert 0 < bucket.rounding_error < (0.2 if wire.wire == "fp4e2m1" else 0.05), text
    assert "rounding (rel.)" in text and "every 2th" in text, text


@pytest.mark.parametrize("name", ["fp4e2m1+ef", "fp4e2m1", "fp8e4m3+ef"])
def test_summary_reports_the_measured_rounding(name):
    torch_path_workers(_rounding_worker, 3, name)


def _no_rounding_worker(rank, world_size):
    ddp = DDP(_model())
    state = ddp_triton.register(ddp, comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
    step(ddp, rank, world_size, 0)
    summary = state.summary()
    assert all(b.rounding_error is None and b.rounding_pass is None for b in summary.buckets)
    assert "rounding" not in str(summary)


def test_formats_without_blocks_report_no_rounding():
    torch_path_workers(_no_rounding_worker, 3)
