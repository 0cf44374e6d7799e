"""The model of the machine: its GPU topology, the all-reduce cost model, and tuning profiles.

No collectives here: everything in this layer runs on one process without torch.distributed (``topology``,
``cost_model``, ``profile``).
"""
