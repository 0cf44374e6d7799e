"""The runtime: what runs inside training.

- ``hook``: ``triton_hook``, ``register``, ``reattach``; ``clip``: ``clip_grad_norm_`` from the state's statistics
- ``state``: ``CommState``, a model's settings and what it builds (the bucket cache, residuals, its binding)
- ``bucket``: one bucket's path, decided when it binds: its buffers, bound kernels, collective and completion
- ``exchange``: the all-to-all / sum / all-gather exchanges of the formats summed in float32, in one order
- ``residuals``: FP8 error-feedback residuals per parameter, and their checkpoints
- ``wire``: what a wire format's settings mean; ``profile_choice``: which tuning profile to follow, bound on every
  rank; ``grad_stats``: the gradient norm and what the state vouches for; ``telemetry``: profiler ranges, bytes on
  the wire, timings, the summary; ``algo_groups``: one process group per NCCL algorithm, the ranks' agreements
"""
