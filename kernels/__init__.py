"""Triton kernels and their launchers (installed as ``ddp_triton.kernels``; knows nothing of torch.distributed)."""
