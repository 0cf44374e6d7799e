"""The models bench.ddp_step trains (an MLP and a GPT-2-shaped transformer) and the workload around each: the model,
its fixed batch, its loss and how the results name it.

- ``mlp`` (default): 12 blocks of Linear(1024, 4096) - GELU - Linear(4096, 1024), 100.7M parameters, batch 64,
  loss the mean square of the output. ``--small``: width 128, 2 blocks.
- ``gpt2``: a decoder-only transformer of GPT-2 small's shape (12 layers, d_model 768, 12 heads, MLP 3072, vocab
  50257, context 1024, pre-LayerNorm, tanh GELU, attention through ``scaled_dot_product_attention(is_causal=True)``,
  learned positions, input embedding and LM head tied as in GPT-2: 124.4M parameters), cross-entropy of the next
  token on random token ids, batch 8 x 1024 tokens. On CUDA the forward and the loss run under
  ``torch.autocast(dtype=torch.bfloat16)``, the usual mixed precision: parameters, gradients and so the DDP buckets
  stay float32. ``--small``: 2 layers, d_model 64, 4 heads, MLP 256, vocab 256, 32 tokens, batch 2 (seconds on CPU).
  ``--batch`` and ``--seq`` (at most the context) set other sizes.

``--backward-ms`` (the MLP only) puts a stall after each Linear whose backward sleeps its share of that many
milliseconds: a backward of a GPU's length that leaves the host's cores free, as a GPU's does, for the exchange's
passes and gloo's threads. Without it, on a CPU the backward's matmuls and the exchange share the same cores.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_model(width: int, blocks: int, backward_ms: float = 0.0) -> nn.Module:
    """The MLP: ``blocks`` times Linear(width, 4 width) - GELU - Linear(4 width, width); with ``backward_ms``, a
    ``Stall`` after each Linear, the backward's sleep split evenly between them."""
    stall = backward_ms / (2 * blocks)
    layers: List[nn.Module] = []
    for _ in range(blocks):
        up, down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        layers += [up, Stall(stall), nn.GELU(), down, Stall(stall)] if backward_ms else [up, nn.GELU(), down]
    return nn.Sequential(*layers)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms: float) -> torch.Tensor:
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.ms / 1e3)
        return grad, None


class Stall(nn.Module):
    """The identity, whose backward sleeps ``ms`` milliseconds: compute time that holds no core."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.ms)


@dataclasses.dataclass(frozen=True)
class Gpt2Config:
    """The shape of a GPT-2-style decoder; the defaults are GPT-2 small's."""

    layers: int = 12
    d_model: int = 768
    heads: int = 12
    mlp: int = 3072
    vocab: int = 50257
    context: int = 1024


GPT2_SMALL = Gpt2Config()
#: ``--small --model gpt2``: the same code at a size a CPU runs in seconds.
GPT2_SMOKE = Gpt2Config(layers=2, d_model=64, heads=4, mlp=256, vocab=256, context=32)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, SDPA with ``is_causal=True``, output projection."""

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Gpt2Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with GPT-2's tanh GELU."""

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.mlp, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt2(nn.Module):
    """A GPT-2-shaped decoder-only LM in plain torch.nn: token and learned position embeddings, pre-LN blocks, a
    final LayerNorm and an LM head tied to the token embedding (as GPT-2's): token ids (b, t) -> logits (b, t, vocab).

    No buffers, so DDP has nothing to broadcast before each forward. Weights are initialised as GPT-2's (normal,
    std 0.02, zero biases), which keeps the random-token loss and its gradients in a realistic range.
    """

    def __init__(self, cfg: Gpt2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Gpt2Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, one gradient, one place in DDP's buckets
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than the context {self.cfg.context}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


@dataclasses.dataclass
class Workload:
    """What the benchmark trains: the model every variant copies, its loss, and how the results name it."""

    model: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    """The loss of one step of the given (DDP) model on the workload's fixed batch; the caller runs backward."""
    title: str
    """The RESULTS.md section's title."""
    stem: str
    """The saved JSON's name: ``ddp_step`` for the MLP (as before), ``ddp_step_gpt2`` for GPT-2."""
    env: Dict[str, Any]
    """What the output's env adds: model, parameters, batch and, for GPT-2, tokens and autocast."""


def make_workload(model: str, small: bool, batch: Optional[int], seq: Optional[int], device: torch.device,
                  world: int, blocks: Optional[int] = None, backward_ms: float = 0.0) -> Workload:
    """Build ``model`` ("mlp" or "gpt2") on ``device`` with its batch (random inputs, seed 0); ``blocks``: the
    MLP's residual blocks (default 12); ``backward_ms``: the MLP's stalls in the backward, in all."""
    torch.manual_seed(0)
    if model == "mlp":
        width, blocks = (128, 2) if small else (1024, 12 if blocks is None else blocks)
        batch = 64 if batch is None else batch
        base = make_model(width, blocks, backward_ms).to(device)
        params = sum(q.numel() for q in base.parameters())
        x = torch.randn(batch, width, device=device)
        stalls = f", {backward_ms:g} ms of stalls in the backward" if backward_ms else ""
        title = f"bench/ddp_step.py (world size {world}, {params / 1e6:.1f}M parameters, batch {batch}{stalls})"
        return Workload(base, lambda m: m(x).float().square().mean(), title, "ddp_step",
                        {"model": "mlp", "parameters": params, "batch": batch, "backward_ms": backward_ms})
    if model != "gpt2":
        raise ValueError(f"unknown model {model}")
    if backward_ms:
        raise ValueError("backward_ms stalls the MLP's backward only")
    cfg = GPT2_SMOKE if small else GPT2_SMALL
    batch = (2 if small else 8) if batch is None else batch
    seq = cfg.context if seq is None else seq
    if not 0 < seq <= cfg.context:
        raise ValueError(f"--seq {seq}: the model's context is {cfg.context} tokens")
    base = Gpt2(cfg).to(device)
    params = sum(q.numel() for q in base.parameters())  # the tied head counts once, as in GPT-2's 124M
    tokens = torch.randint(cfg.vocab, (batch, seq + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = device.type == "cuda"

    def loss(m: nn.Module) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = m(inputs)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    precision = "bf16 autocast" if autocast else "float32"
    title = (f"bench/ddp_step.py --model gpt2 (world size {world}, {params / 1e6:.1f}M parameters, batch {batch} x "
             f"{seq} tokens, {precision})")
    return Workload(base, loss, title, "ddp_step_gpt2",
                    {"model": "gpt2", "parameters": params, "batch": batch, "seq": seq,
                     "gpt2_config": dataclasses.asdict(cfg), "tied_embeddings": True,
                     "autocast": "bfloat16" if autocast else None})
