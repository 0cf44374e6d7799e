"""ddp_triton inside Hugging Face Accelerate: ``ddp_triton.integrations.accelerate.register`` after ``prepare``.

Tier: gloo multi-process on CPU (world size 2, spawned here), real Accelerate (``Accelerator(cpu=True)``, as
``accelerate launch --cpu`` makes it), skipped when it is not installed (.ci/run installs it for this tier); plus a
single-process check in this process. The workers join a FileStore group first (no port), which Accelerate then
uses as it is. Each worker trains the same model from the same seed without a hook and with one, with
``accelerator.accumulate`` (DDP's ``no_sync``) and ``accelerator.clip_grad_norm_``. float32 on the wire at world size
2 is what DDP's default reduction computes (x * 0.5 is x / 2 exactly, then the same sum): compared bit for bit.
"""

import os

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ddp_triton
from ddp_helpers import make_model
from dist_utils import run_workers
from framework_import import import_installed
from ddp_triton.runtime.algo_groups import scoped_env

accelerate = import_installed("accelerate")
pytestmark = pytest.mark.skipif(accelerate is None, reason="Accelerate is not installed (pip install accelerate)")

WORLD = 2
SAMPLES, BATCH = 64, 4  # 8 batches per process: 4 optimizer steps at 2 accumulation steps
ACCUMULATE, CLIP = 2, 0.5


def make_loader():
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def train(accelerator, model, optimizer, loader):
    """Accelerate's loop with accumulation and clipping; the number of optimizer steps taken."""
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                steps += 1
            optimizer.step()
            optimizer.zero_grad()
    return steps


def prepared(accelerator):
    model = make_model()
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader())


def _worker(rank, world_size):
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import DistributedDataParallelKwargs

    from ddp_triton.integrations.accelerate import find_ddp, register

    # What `accelerate launch --cpu --num_processes 2` gives each process.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    # Accelerate's own way to pass a hook, tried first as a user would: it maps its own hook names only.
    handler = DistributedDataParallelKwargs(comm_hook=ddp_triton.triton_hook)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE, kwargs_handlers=[handler])
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == world_size

    plain, plain_opt, plain_loader = prepared(accelerator)
    assert isinstance(plain, DDP) and plain._comm_hooks == [], "Accelerate ignored the function it was given"
    plain_steps = train(accelerator, plain, plain_opt, plain_loader)
    assert plain_steps == SAMPLES // (WORLD * BATCH * ACCUMULATE)

    model, opt, loader = prepared(accelerator)
    assert find_ddp(accelerator, model) is model
    assert find_ddp(accelerator, torch.compile(model)) is model  # what prepare returns with a dynamo backend set
    with pytest.raises(ValueError, match="pass the model accelerator.prepare returned"):
        find_ddp(accelerator, model.module)  # the module prepare was given: Accelerate keeps no link to its wrapper
    with pytest.warns(UserWarning, match="ignored by Accelerate"):
        state = register(accelerator, model, comm_dtype=torch.float32)
    assert state.bound and state.context.world_size == world_size
    assert train(accelerator, model, opt, loader) == plain_steps
    assert state.passes == plain_steps, "the hook averaged each synchronised backward, none under no_sync"
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q), "float32 on the wire must give DDP's own bits"

    with pytest.raises(RuntimeError, match="already has a comm hook, 'triton_hook'"):
        register(accelerator, model)  # DDP takes one hook
    with pytest.raises(ValueError, match="pass the model accelerator.prepare returned"):
        register(accelerator, make_model())

    # FP8 with error feedback, as CommState takes it: trains, with residuals to save.
    fp8_model, fp8_opt, fp8_loader = prepared(accelerator)
    with pytest.warns(UserWarning, match="ignored by Accelerate"):
        fp8 = register(accelerator, fp8_model, comm_dtype=torch.float8_e5m2)
    assert fp8.wire.name == "fp8e5m2+ef"
    assert train(accelerator, fp8_model, fp8_opt, fp8_loader) == plain_steps
    assert fp8.state_dict()["first_stage"]


def test_register_after_prepare_fp32_matches_no_hook_with_accumulation_and_clipping():
    with scoped_env({"TRITON_INTERPRET": "0"}):  # the kernels' torch CPU path, as in CPU production
        run_workers(_worker, WORLD, timeout=180)


def test_a_single_process_launch_has_no_ddp_wrapper():
    import torch.distributed as dist
    from accelerate import Accelerator

    from ddp_triton.integrations.accelerate import register

    if dist.is_initialized() or any(v in os.environ for v in ("WORLD_SIZE", "LOCAL_RANK")):
        pytest.skip("this process is already part of a distributed launch")
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(make_model())
    with pytest.raises(ValueError, match="single-process launch"):
        register(accelerator, model)
    with pytest.raises(ValueError, match="comm_dtype"):  # the options are checked before the launch is
        register(accelerator, model, comm_dtype=torch.float64)
    with pytest.raises(ValueError, match="error_feedback applies to FP8"):
        register(accelerator, model, comm_dtype=torch.bfloat16, error_feedback=True)
    with pytest.raises(ValueError, match="single-process launch"):  # FP8 is an option CommState takes
        register(accelerator, model, comm_dtype=torch.float8_e5m2)
