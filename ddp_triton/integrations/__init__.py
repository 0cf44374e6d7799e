"""ddp-triton inside training frameworks that wrap DDP themselves.

- ``ddp_triton.integrations.lightning``: ``TritonHook``, a PyTorch Lightning Callback
- ``ddp_triton.integrations.accelerate``: ``register(accelerator, model)`` for Hugging Face Accelerate
- ``ddp_triton.integrations.transformers``: ``TritonCommCallback``, a Hugging Face Trainer callback
- ``ddp_triton.integrations.torchft``: ``DistributedDataParallel``, torchft's fault-tolerant DDP with our exchange

Each module imports its framework, which ddp-triton does not depend on: importing one without its framework
installed raises an ImportError saying what to install. This package imports neither.
"""
