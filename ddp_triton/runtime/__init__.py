"""The runtime: what runs inside training. The hook, its per-model state, which profile it follows, and one
process group per NCCL algorithm (``hook``, ``state``, ``profile_choice``, ``algo_groups``)."""
