"""ddp_triton inside the Hugging Face Trainer: the ``TritonCommCallback``, its wire formats and its checkpoints.

Tier: gloo multi-process on CPU (world size 2, one spawned job for every distributed case), real Transformers
(``Trainer`` on a 2-layer GPT-2 built from its config, no weights downloaded) and Accelerate, skipped when
Transformers is not installed (.ci/run installs it for this tier); plus single-process checks in this process. The
workers join a FileStore group first (no port), which the Trainer's Accelerate state then uses as it is. Every run
trains the same model from the same seed on the same tokens: gradient accumulation 2 (DDP's ``no_sync``),
``max_grad_norm`` 1.0, 40 optimizer steps. float32 on the wire at world size 2 is what DDP's default reduction
computes (x * 0.5 is x / 2 exactly, then the same sum), so those weights are compared bit for bit.
"""

import os
import shutil

import pytest
import torch

from dist_utils import run_workers
from ddp_triton.runtime.algo_groups import scoped_env
from framework_import import import_installed

transformers = import_installed("transformers")
if transformers is not None:  # its Trainer, with the checkout's root out of the way (framework_import.py)
    trainer = import_installed("transformers.trainer")
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel
    Trainer, TrainerCallback, TrainingArguments = trainer.Trainer, transformers.TrainerCallback, \
        transformers.TrainingArguments
pytestmark = pytest.mark.skipif(transformers is None, reason="Transformers is not installed (pip install transformers)")

WORLD = 2
STEPS, HALF = 40, 20
BATCH, ACCUMULATE = 2, 2  # 8 sequences per optimizer step over both ranks
SEQUENCES, LENGTH, VOCAB = 160, 16, 64  # 20 optimizer steps per epoch: the checkpoint at step 20 ends epoch 1


def make_model():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                        bos_token_id=0, eos_token_id=0,  # inside the small vocabulary
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: the loss is the weights'
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Sequences of a noisy counting pattern (next token = previous + 1 mostly), so the loss falls as it trains."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        start = torch.randint(0, VOCAB, (SEQUENCES, 1), generator=gen)
        ids = (start + torch.arange(LENGTH)) % VOCAB
        noise = torch.rand(SEQUENCES, LENGTH, generator=gen) < 0.2
        self.ids = torch.where(noise, torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=gen), ids)

    def __len__(self):
        return SEQUENCES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def stop_at(step):
    """A callback that ends training after optimizer step ``step`` (after its checkpoint is saved): an interrupted
    run. Made here, not at import, so that the module loads (and skips) without Transformers."""

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()


def arguments(out, **overrides):
    options = dict(output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATE,
                   max_grad_norm=1.0, max_steps=STEPS, learning_rate=3e-3, use_cpu=True, report_to="none",
                   save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**options, **overrides})


def fit(out, callbacks=(), resume=None, **overrides):
    """A fresh model trained by a fresh Trainer; the model."""
    model = make_model()
    trainer = Trainer(model=model, args=arguments(out, **overrides), train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return model


@torch.no_grad()
def final_loss(model):
    """The trained model's loss on every sequence: the same number on every rank (DDP keeps the weights equal)."""
    model.eval()
    ids = Tokens().ids
    return model(input_ids=ids, labels=ids).loss.item()


def bits(model):
    return [p.detach().clone().view(torch.int32) for p in model.parameters()]


def same_bits(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _worker(rank, world_size, tmp):
    import torch.distributed as dist

    from ddp_triton.integrations.transformers import RESIDUALS_FILE, TritonCommCallback

    # What `torchrun --nproc_per_node 2` gives each process; the Trainer's Accelerate state reads it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")

    def out(name):
        return os.path.join(tmp, name)

    plain = fit(out("plain"))
    plain_loss = final_loss(plain)
    assert plain_loss < 0.9 * final_loss(make_model()), "the runs compared below must train"

    fp32 = TritonCommCallback(comm_dtype=torch.float32)
    hooked = fit(out("fp32"), [fp32])
    assert fp32.state.passes == STEPS, "the hook averaged each synchronised backward, none under no_sync"
    assert same_bits(bits(hooked), bits(plain)), "float32 on the wire must give DDP's own bits"

    for options in (dict(comm_dtype=torch.bfloat16), dict(comm_dtype=torch.bfloat16, accumulate_dtype=torch.float32)):
        callback = TritonCommCallback(**options)
        model = fit(out("bf16"), [callback])
        assert callback.state.passes == STEPS
        assert not same_bits(bits(model), bits(plain)), f"{callback.state.wire_setting} must round"
        # bfloat16 keeps 8 bits: each averaged gradient is off by up to 2^-9 relative, and Adam follows the
        # gradient's direction: measured 3e-5 relative after 40 steps (both formats). Gradients dropped or not
        # averaged across ranks move it by percents.
        drift = abs(final_loss(model) - plain_loss) / plain_loss
        assert drift < 1e-3, (callback.state.wire_setting, drift)

    # FP8 (E4M3, error feedback on by default), uninterrupted: the run the resumed ones must be.
    fp8 = dict(comm_dtype=torch.float8_e4m3fn)
    unbroken_hook = TritonCommCallback(**fp8)
    unbroken = fit(out("fp8"), [unbroken_hook])
    assert unbroken_hook.state.wire_setting == "fp8e4m3+ef" and unbroken_hook.state.passes == STEPS
    # E4M3 keeps 3 mantissa bits (6% relative at worst) under a per-block scale, and the residuals carry what it
    # drops into the next step: measured 7e-5 relative after 40 steps.
    drift = abs(final_loss(unbroken) - plain_loss) / plain_loss
    assert drift < 1e-2, drift

    # Interrupted at step 20, after its checkpoint: each rank's residuals are in the checkpoint folder.
    fit(out("half"), [TritonCommCallback(**fp8), stop_at(HALF)], save_strategy="steps", save_steps=HALF)
    checkpoint = os.path.join(out("half"), f"checkpoint-{HALF}")
    files = [os.path.join(checkpoint, RESIDUALS_FILE.format(rank=r)) for r in range(world_size)]
    assert all(os.path.isfile(f) for f in files), os.listdir(checkpoint)
    saved = [torch.load(f, weights_only=True) for f in files]
    assert [s["rank"] for s in saved] == list(range(world_size))
    assert not torch.equal(*(torch.cat([t.view(-1) for t in s["first_stage"].values()]) for s in saved)), \
        "each rank saves its own first stage"

    resumed_hook = TritonCommCallback(**fp8)
    resumed = fit(out("resumed"), [resumed_hook], resume=checkpoint)
    assert resumed_hook.state.passes == STEPS - HALF
    assert same_bits(bits(resumed), bits(unbroken)), "resumed with its residuals, the run is the unbroken one"

    # The same checkpoint without the residuals: said, and the run is another one (what the files are for).
    bare = out("bare")
    if rank == 0:
        shutil.copytree(checkpoint, bare)
        for r in range(world_size):
            os.remove(os.path.join(bare, RESIDUALS_FILE.format(rank=r)))
    dist.barrier()
    with pytest.warns(UserWarning, match="holds no error-feedback residuals"):
        other = fit(out("resumed-bare"), [TritonCommCallback(**fp8)], resume=bare)
    assert not same_bits(bits(other), bits(unbroken))


def test_callback_wire_formats_and_an_fp8_resume_from_a_trainer_checkpoint(tmp_path):
    with scoped_env({"TRITON_INTERPRET": "0"}):  # the kernels' torch CPU path, as in CPU production
        run_workers(_worker, WORLD, str(tmp_path), timeout=300)


def test_a_single_process_trainer_is_refused(tmp_path):
    import torch.distributed as dist

    from ddp_triton.integrations.transformers import TritonCommCallback

    if dist.is_initialized() or any(v in os.environ for v in ("WORLD_SIZE", "LOCAL_RANK")):
        pytest.skip("this process is already part of a distributed launch")
    with pytest.raises(ValueError, match="comm_dtype"):  # the options are checked where the Trainer is configured
        TritonCommCallback(comm_dtype=torch.float64)
    with pytest.raises(ValueError, match="error_feedback applies to FP8"):
        TritonCommCallback(comm_dtype=torch.bfloat16, error_feedback=True)
    model = make_model()
    before = bits(model)
    trainer = Trainer(model=model, args=arguments(str(tmp_path)), train_dataset=Tokens(),
                      callbacks=[TritonCommCallback()])
    with pytest.raises(ValueError, match="this one runs one process, where there is nothing to all-reduce"):
        trainer.train()
    assert same_bits(bits(model), before), "refused before any step"


def test_called_outside_a_trainer():
    from transformers import TrainerControl, TrainerState

    from ddp_triton.integrations.transformers import TritonCommCallback

    callback = TritonCommCallback()
    with pytest.raises(RuntimeError, match="no transformers.Trainer holding it is calling it"):
        callback.on_train_begin(arguments("unused"), TrainerState(), TrainerControl())
