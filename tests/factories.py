"""Model factories for ``autotune --e2e`` (``MODULE:FUNCTION``), importable from every test folder as ``factories``."""

import torch


def tiny_factory():
    """e2e contract: () -> (model, loss_fn(model) -> scalar loss)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def loss_fn(m):
        device = next(m.parameters()).device
        x = torch.randn(16, 32, device=device)
        return m(x).square().mean()

    return model, loss_fn
