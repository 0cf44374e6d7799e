"""The tuner: runs processes, times all-reduces and DDP steps, and turns the timings into profiles (``processes``,
``progress``, ``sweep``, ``step_timing``, ``autotune``; ``e2e_hooks`` names the hooks e2e mode times)."""
