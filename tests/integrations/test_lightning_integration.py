"""ddp_triton inside PyTorch Lightning: the ``TritonHook`` Callback, and a CommState given to Lightning's own
``DDPStrategy(ddp_comm_state=...)`` before any process group exists.

Tier: gloo multi-process on CPU (world size 2, spawned here), real Lightning (``lightning`` or
``pytorch_lightning``); skipped when neither is installed (.ci/run installs pytorch-lightning for this tier). The
workers join a FileStore group before ``fit`` (no port), which Lightning then uses as it is. Each worker fits the
same model from the same seed, without a hook and with one, with gradient accumulation (DDP's ``no_sync``) and
norm clipping. float32 on the wire at world size 2 is what DDP's default reduction computes (x * 0.5 is x / 2
exactly, then the same sum), so those weights are compared bit for bit.
"""

import copy
import importlib
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_triton
from dist_utils import init_gloo, run_workers
from ddp_triton.runtime.algo_groups import scoped_env


def _lightning():
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


pl = _lightning()
pytestmark = pytest.mark.skipif(pl is None, reason="PyTorch Lightning is not installed (pip install pytorch-lightning)")

WORLD = 2
SAMPLES, BATCH = 64, 4  # 8 batches per rank: 4 optimizer steps at accumulate_grad_batches=2
ACCUMULATE, CLIP = 2, 0.5


def _module_class():
    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regressor


def _loader():
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def _fit(strategy=None, callbacks=(), devices=WORLD, max_epochs=1, ckpt_path=None):
    """One fit of a fresh model from the same seed; the trained module and the Trainer."""
    module = _module_class()()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy or pl.strategies.DDPStrategy(),
                         callbacks=list(callbacks), max_epochs=max_epochs, accumulate_grad_batches=ACCUMULATE,
                         gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return module, trainer


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


def _as_rank(rank):
    """Lightning reads this process's place from the environment (as under torchrun) and launches nothing."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")


def lightning_workers(fn, *args):
    with scoped_env({"TRITON_INTERPRET": "0"}):  # the kernels' torch CPU path, as in CPU production
        run_workers(fn, WORLD, *args, timeout=180, init=False)


def _callback_worker(rank, world_size):
    from ddp_triton.integrations.lightning import TritonHook

    _as_rank(rank)
    init_gloo(rank, world_size)
    plain, plain_trainer = _fit()
    steps = plain_trainer.global_step
    assert steps == SAMPLES // (WORLD * BATCH * ACCUMULATE), "accumulation: one optimizer step per 2 batches"

    fp32 = TritonHook(comm_dtype=torch.float32)
    hooked, trainer = _fit(callbacks=[fp32])
    assert trainer.global_step == steps
    assert fp32.state.passes == steps, "the hook averaged each synchronised backward, none under no_sync"
    assert {e.wire_buffer.dtype for e in fp32.state.plans.values()} == {torch.float32}
    for p, q in zip(hooked.parameters(), plain.parameters()):
        assert torch.equal(p, q), "float32 on the wire must give DDP's own bits"

    bf16 = TritonHook()  # bfloat16 by default
    on_bf16, _ = _fit(callbacks=[bf16])
    assert bf16.state.passes == steps and {e.wire_buffer.dtype for e in bf16.state.plans.values()} == {torch.bfloat16}
    diffs = [(p - q).abs().max().item() for p, q in zip(on_bf16.parameters(), plain.parameters())]
    # bfloat16 keeps 8 bits: each averaged gradient is off by up to 2^-9 relative; after 4 SGD steps at lr 0.1 on
    # gradients below 1, the weights move less than 1e-2 from float32's, and not at all would mean no rounding.
    assert 0 < max(diffs) < 1e-2, diffs

    # A strategy that carries a hook Lightning does not register off CUDA: said, and ours is used.
    ignored = pl.strategies.DDPStrategy(ddp_comm_hook=ddp_triton.triton_hook)
    other = TritonHook(comm_dtype=torch.float32)
    with pytest.warns(UserWarning, match="did not register on cpu"):
        again, _ = _fit(strategy=ignored, callbacks=[other])
    assert other.state.passes == steps
    for p, q in zip(again.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_callback_fp32_matches_no_hook_with_accumulation_and_clipping():
    lightning_workers(_callback_worker)


def _resume_worker(rank, world_size, tmp):
    import torch.distributed as dist

    from ddp_triton.integrations.lightning import TritonHook

    _as_rank(rank)
    init_gloo(rank, world_size)
    fp8 = dict(comm_dtype=torch.float8_e4m3fn)  # error feedback on by default
    unbroken, _ = _fit(callbacks=[TritonHook(**fp8)], max_epochs=2)

    stopped, trainer = _fit(callbacks=[TritonHook(**fp8)], max_epochs=1)
    path = os.path.join(tmp, "epoch1.ckpt")
    trainer.save_checkpoint(path)  # every rank builds the checkpoint (the residuals' gather), rank 0 writes it
    saved = torch.load(path, weights_only=True)["callbacks"]
    (residuals,) = [v["residuals"] for k, v in saved.items() if "TritonHook" in k]
    assert len(residuals["first_stage_by_rank"]) == WORLD
    assert not torch.equal(*(torch.cat(list(r.values())) for r in residuals["first_stage_by_rank"])), \
        "each rank's own first stage"

    hook = TritonHook(**fp8)
    resumed, _ = _fit(callbacks=[hook], max_epochs=2, ckpt_path=path)
    for (name, p), q in zip(resumed.named_parameters(), unbroken.parameters()):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32)), f"{name} differs"

    # Resumed without the residuals, the run is another one: what the checkpoint's residuals are for.
    if rank == 0:
        checkpoint = torch.load(path, weights_only=True)
        del checkpoint["callbacks"]
        torch.save(checkpoint, path + ".bare")
    dist.barrier()
    bare, _ = _fit(callbacks=[TritonHook(**fp8)], max_epochs=2, ckpt_path=path + ".bare")
    assert any(not torch.equal(p, q) for p, q in zip(bare.parameters(), unbroken.parameters()))


def test_fp8_residuals_resume_from_a_lightning_checkpoint_bit_identically(tmp_path):
    lightning_workers(_resume_worker, str(tmp_path))


class _HookAsOnCuda:
    """Lightning's DDPStrategy registering its ddp_comm_hook the way it does on CUDA (on CPU it skips it)."""

    @staticmethod
    def make(**kwargs):
        from importlib import import_module

        distributed = import_module(pl.__name__ + ".overrides.distributed")

        class Strategy(pl.strategies.DDPStrategy):
            def _register_ddp_hooks(self):
                distributed._register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                                    ddp_comm_hook=self._ddp_comm_hook)

        return Strategy(**kwargs)


def _lazy_strategy_worker(rank, world_size):
    import torch.distributed as dist

    from ddp_triton.integrations.lightning import TritonHook

    _as_rank(rank)
    assert not dist.is_initialized()
    # What the user writes, before anything distributed exists: Lightning's own strategy arguments.
    state = ddp_triton.CommState(comm_dtype=torch.float32)
    strategy = pl.strategies.DDPStrategy(ddp_comm_state=state, ddp_comm_hook=ddp_triton.triton_hook)
    assert not state.bound
    init_gloo(rank, world_size)
    plain, plain_trainer = _fit()
    assert not state.bound, "a state the strategy holds but never registered stays unbound (Lightning on CPU)"
    _fit(strategy=strategy)
    assert not state.bound and state.passes == 0, "Lightning registers ddp_comm_hook on CUDA only"

    # Lightning's CUDA path, on CPU: the lazy state binds at its first bucket, inside fit.
    state = ddp_triton.CommState(comm_dtype=torch.float32)
    as_on_cuda = _HookAsOnCuda.make(ddp_comm_state=state, ddp_comm_hook=ddp_triton.triton_hook)
    hooked, trainer = _fit(strategy=as_on_cuda)
    assert state.bound and state.context.group is dist.group.WORLD and state.context.world_size == WORLD
    assert state.passes == trainer.global_step == plain_trainer.global_step
    for p, q in zip(hooked.parameters(), plain.parameters()):
        assert torch.equal(p, q)

    # The Callback beside a strategy that registered triton_hook itself: says so and keeps the strategy's state.
    state = ddp_triton.CommState(comm_dtype=torch.float32)
    both = TritonHook(comm_dtype=torch.float32)
    with pytest.warns(UserWarning, match="already registered triton_hook"):
        _fit(strategy=_HookAsOnCuda.make(ddp_comm_state=state, ddp_comm_hook=ddp_triton.triton_hook),
             callbacks=[both])
    assert both.state is state and state.passes == plain_trainer.global_step

    # ... and beside another hook there: DDP takes one, so it refuses, naming it.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with pytest.raises(RuntimeError, match="already has a comm hook, allreduce_hook"):
        _fit(strategy=_HookAsOnCuda.make(ddp_comm_hook=allreduce_hook), callbacks=[TritonHook()])


def test_lazy_comm_state_in_lightnings_ddp_strategy():
    lightning_workers(_lazy_strategy_worker)


def test_callback_refuses_a_strategy_without_ddp():
    from ddp_triton.integrations.lightning import TritonHook

    with pytest.raises(TypeError, match="TritonHook needs Lightning's DDP strategy.*SingleDeviceStrategy"):
        _fit(strategy="auto", callbacks=[TritonHook()], devices=1)


def test_callback_checks_its_options_where_it_is_built():
    from ddp_triton.integrations.lightning import TritonHook

    with pytest.raises(ValueError, match="comm_dtype"):
        TritonHook(comm_dtype=torch.float64)
    # exactly what CommState takes, checked by the same function
    TritonHook(comm_dtype=torch.float8_e4m3fn)
    TritonHook(comm_dtype=torch.float8_e5m2, error_feedback=False, grad_stats=True)
    TritonHook(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)
    with pytest.raises(ValueError, match="error_feedback applies to FP8"):
        TritonHook(comm_dtype=torch.bfloat16, error_feedback=True)
    with pytest.raises(ValueError, match="accumulate_dtype must be"):
        TritonHook(comm_dtype=torch.float8_e4m3fn, accumulate_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_stats must be True or False, got 'no'"):
        TritonHook(grad_stats="no")
    with pytest.raises(TypeError, match="unknown CommState options"):
        TritonHook(bucket_cap_mb=25)
    hook = TritonHook(comm_dtype=torch.float16, profile=None)
    assert isinstance(hook, pl.Callback) and hook.state is None
    assert copy.deepcopy(hook).state_options == {"comm_dtype": torch.float16, "profile": None}
