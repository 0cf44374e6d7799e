"""The comm hooks e2e mode can time, by name: kept apart from ``step_timing``, which registers them and loads torch,
so that the CLI checks ``--hooks`` without loading torch.
"""

#: Hooks e2e mode can try. "allreduce": DDP's own fp32 all-reduce (no hook); "bf16_compress": torch's
#: bf16_compress_hook; "triton": ddp_triton's hook with a CommState built from the base profile.
E2E_HOOKS = ("allreduce", "bf16_compress", "triton")
