"""``python -m ddp_triton.cli``: the ``ddp-triton`` command (under torchrun: ``torchrun ... -m ddp_triton.cli``)."""

import sys

from .main import main

sys.exit(main())
