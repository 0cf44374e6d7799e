"""Which GPU ``register`` binds a DDP model's state on: the model's, whether DDP was given ``device_ids`` or not.

Tier: no device. CUDA parameters are stood in for by objects with a CUDA ``device`` (DDP is not built: the choice
reads only ``device_ids`` and the module's parameters).
"""

from types import SimpleNamespace

import pytest
import torch

from ddp_triton.runtime.hook import model_cuda_device


def _ddp(device_ids, *devices):
    params = [SimpleNamespace(device=torch.device(d)) for d in devices]
    return SimpleNamespace(device_ids=device_ids, module=SimpleNamespace(parameters=lambda: iter(params)))


@pytest.mark.parametrize("ddp, expected", [
    pytest.param(_ddp([3], "cuda:3", "cuda:3"), torch.device("cuda", 3), id="device_ids"),
    pytest.param(_ddp(None, "cuda:1", "cuda:1"), torch.device("cuda", 1), id="no-device_ids"),
    pytest.param(_ddp(None, "cpu"), None, id="cpu"),
    pytest.param(_ddp(None, "cuda:0", "cuda:1"), None, id="spread-over-gpus"),
    pytest.param(_ddp(None), None, id="no-parameters"),
])
def test_the_state_binds_on_the_models_gpu_not_the_current_one(ddp, expected):
    """``DDP(model)`` on cuda:1 leaves ``device_ids`` None, and a script that only did ``model.to(local_rank)``
    leaves the current device at 0: the binding's collectives must still go to cuda:1."""
    assert model_cuda_device(ddp) == expected
