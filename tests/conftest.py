"""Test set-up shared by every tier.

Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. Triton decides at decoration time
whether a kernel is interpreted, so the variable is set here, before any test module imports ddp_triton.kernels.
Processes spawned by the distributed tests inherit it unless a test says otherwise. Where the interpreter is known to
compute wrong bits (``interpreter.interpreter_problem``), it stays off and the tests that need it skip, saying why.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from interpreter import interpreter_problem

if not torch.cuda.is_available() and interpreter_problem() is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    problem = interpreter_problem()
    return f"Triton interpreter: {'unusable: ' + problem if problem else 'usable'}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not the keyword: every test under tests/gpu/ has "gpu" among its keywords (its folder's name),
        # those that need no device too (test_gpu_capture's refusals).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def nccl_world_of_one():
    """A one-rank NCCL process group on GPU 0 for the GPU tier (DDP over NCCL at world size 1), destroyed after."""
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
