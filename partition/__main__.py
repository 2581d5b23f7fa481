"""Entry point: ``python -m partition layers W1.npz W2.npz ... --parts P``."""

import sys

from partition.cli import main

if __name__ == "__main__":
    sys.exit(main())
