"""The test workers (dist_utils) import the kernels as a freshly spawned process with the test's environment would.

Tier: gloo multi-process. Workers are forked from servers that imported the project ahead of time; Triton and the
kernels read TRITON_INTERPRET when kernels are decorated, so a worker must come from the server that imported them
with the test's value of it, in whatever order the tests ask.
"""

import pytest
import torch

from ddp_triton.runtime.algo_groups import scoped_env
from dist_utils import WorkerError, run_workers
from interpreter import interpreter_problem


def _kernels_interpreted(rank, world_size, expected):
    import dist_utils
    from triton.runtime.interpreter import InterpretedFunction

    from ddp_triton.kernels import convert, uses_triton

    assert "ddp_triton.kernels" in dist_utils.PRELOADED, "the worker's server did not import the project"
    assert uses_triton(torch.device("cpu")) == expected, f"the project's switch: expected {expected}"
    interpreted = isinstance(convert._contiguous_convert_kernel, InterpretedFunction)
    assert interpreted == expected, f"Triton's decoration: expected {expected}"


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_workers_run_the_kernels_as_the_test_set_the_interpreter():
    for setting, interpreted in [("0", False), ("1", True), ("0", False), (None, False), ("1", True)]:
        with scoped_env({"TRITON_INTERPRET": setting}):
            run_workers(_kernels_interpreted, 2, interpreted)
    with scoped_env({"TRITON_INTERPRET": "1"}), pytest.raises(WorkerError, match="expected False"):
        run_workers(_kernels_interpreted, 2, False)  # the check itself can fail
