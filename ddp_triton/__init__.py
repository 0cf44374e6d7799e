"""ddp-triton: fused Triton kernels and topology-aware communication hooks for PyTorch DDP."""

__version__ = "0.1.0"
