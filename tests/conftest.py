"""Test set-up shared by every tier.

Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. Triton decides at decoration time
whether a kernel is interpreted, so the variable is set here, before any test module imports ddp_triton.kernels.
Processes spawned by the distributed tests inherit it unless a test says otherwise. Where the interpreter is known to
compute wrong bits (``interpreter.interpreter_problem``), it stays off and the tests that need it skip, saying why.
"""

import os

import pytest
import torch

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
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
