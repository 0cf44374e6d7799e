"""The runtime: what runs inside training.

- ``hook``: ``triton_hook``, ``register``, ``reattach``; ``clip``: ``clip_grad_norm_`` from the state's statistics
- ``state``: ``CommState``, a model's settings and what they bound; ``pickled``: what its pickle holds
- ``context``: what a state decided when it bound; ``plan``: one bucket's path, decided when it binds
- ``wire_exchanges``, ``two_level``, ``chunks``: each format's stages; ``exchange``: the one order of collectives
- ``residuals``: FP8 error-feedback residuals per parameter, and their checkpoints
- ``online``: online tuning (each bucket's format chosen by the job's own steps); ``options``: the options' check
- ``profile_choice``: which tuning profile to follow, bound on every rank; ``algo_groups``: one process group per
  NCCL algorithm, the ranks' agreements; ``nodes``: the node groups of a two-level exchange
- ``grad_stats``: the gradient norm and what the state vouches for; ``telemetry``: profiler ranges, bytes on the
  wire, timings, the summary; ``collective_errors``: a failed collective's message
- ``fsdp``, ``fsdp_state``, ``prepared_calls``: the wire formats as FSDP2's reduce-scatter, its kernels prepared
  per group; ``fsdp_online``: its online tuning
"""
