"""Make ``python -m bench.cluster`` run the command line (bench.cluster.cli) and exit with its status."""

import sys

from bench.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
