"""What the DDP tests share: a small model and its data, per-rank batch slices, the full-batch reference, and
workers on the kernels' torch CPU path.

The model is an MLP of Linear(IN, HIDDEN) - Tanh - Linear(HIDDEN, HIDDEN) - Tanh - Linear(HIDDEN, OUT) (its weights
from a seed), the data BATCH rows of normal inputs and targets per step (from a seed per step). Each of N ranks
trains on rows [r * BATCH/N, (r + 1) * BATCH/N), so N ranks together see the batch one process sees.
"""

import copy
import re

import torch
import torch.nn as nn

from ddp_triton.machine.profile import Profile, TableEntry
from dist_utils import run_workers
from ddp_triton.runtime.algo_groups import scoped_env

BATCH = 16
IN, HIDDEN, OUT = 8, 32, 4

# float32 on the wire: the only differences from one process are the order of float32 additions (a mean of N
# partial means against one mean), a few ulps per step; after 6 SGD steps at lr 0.1 that stays below 1e-5.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def torch_path_workers(fn, world_size, *args, timeout=120):
    """Workers on the kernels' torch CPU path, as in CPU production (they read TRITON_INTERPRET at import)."""
    with scoped_env({"TRITON_INTERPRET": "0"}):
        run_workers(fn, world_size, *args, timeout=timeout)


def make_model(seed=0, dtype=torch.float32, widths=(IN, HIDDEN, HIDDEN, OUT)):
    """Linear layers of ``widths`` with Tanh between them, weights from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def make_data(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=gen).to(dtype), torch.randn(BATCH, OUT, generator=gen).to(dtype)


def local_slice(tensor, rank, world_size):
    per = tensor.shape[0] // world_size
    return tensor[rank * per : (rank + 1) * per]


def local_backward(model, x, y, rank, world_size):
    """Backward of the loss on this rank's slice of the batch."""
    nn.functional.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()


def local_grads(model, batches, rank, world_size):
    """This rank's gradients of ``batches`` ((x, y) pairs, accumulated as under no_sync) on a copy of ``model``,
    without DDP; zeros where a parameter took none."""
    copy_ = copy.deepcopy(model)
    copy_.zero_grad(set_to_none=True)
    for x, y in batches:
        local_backward(copy_, x, y, rank, world_size)
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in copy_.parameters()]


def step(ddp, rank, world_size, data_step, set_to_none=True):
    """zero_grad, then this rank's backward on step ``data_step``'s batch (no optimizer step)."""
    ddp.zero_grad(set_to_none=set_to_none)
    x, y = make_data(data_step)
    local_backward(ddp, x, y, rank, world_size)


def train_reference(model, steps, lr=0.1, dtype=torch.float32):
    """One process, the full batch: what N ranks on B/N samples each must reproduce."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        x, y = make_data(s, dtype)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def train_ddp(ddp_model, rank, world_size, steps, lr=0.1, dtype=torch.float32):
    opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for s in range(steps):
        x, y = make_data(s, dtype)
        opt.zero_grad()
        local_backward(ddp_model, x, y, rank, world_size)
        opt.step()


def assert_params_close(model, reference, atol, rtol):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), atol=atol, rtol=rtol, msg=name)


class TwoDtypes(nn.Module):
    """A float32 layer then a bfloat16 one: DDP gives each dtype its own buckets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(IN, HIDDEN)
        self.second = nn.Linear(HIDDEN, OUT).to(torch.bfloat16)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)).to(self.second.weight.dtype)).float()


class Branchy(nn.Module):
    """A trunk and a branch used only while ``use_branch`` (on some steps or ranks): DDP must be told to find unused
    parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(IN, OUT)
        self.branch = nn.Linear(IN, OUT)
        self.use_branch = True

    def forward(self, x):
        out = self.trunk(x)
        return out + self.branch(x) if self.use_branch else out


SPLIT_BYTES = 4096  # buckets of up to 4 KiB on the wire take "tree", larger ones "ring"


def two_range_profile(world_size, comm_dtype="float32", split=SPLIT_BYTES):
    return Profile(source="model", backend="model", world_size=world_size, nodes=1, comm_dtype=comm_dtype,
                   bucket_cap_mb=1.0, table=[TableEntry(0, split, "tree"), TableEntry(split + 1, None, "ring")])


#: How a collective's failure names a lost peer (collective_errors.py's words).
LOST_PEER = "failed: the connection to a peer was lost, so a peer is gone"


def peer_death_problem(who, step, seconds, message, told, kill_at, fail_seconds):
    """What is wrong with a survivor's report after its peer died at step ``kill_at``, or None: it must fail at that
    step or the next (``step`` None: it trained on alone), within ``fail_seconds``, with a message matching ``told``.
    ``who`` names the survivor (and its case) in the problem."""
    if step is None:
        return f"{who}: trained on alone after its peer died"
    if not kill_at <= step <= kill_at + 1:
        return f"{who}: failed at step {step}, the peer died at {kill_at}: {message}"
    if not seconds < fail_seconds:
        return f"{who}: failed {seconds:.1f} s after its peer died"
    if not re.search(told, message, re.DOTALL):
        return f"{who}: unclear message {message!r}"
    return None
