"""Entry point: ``python -m partition radixnet ...``."""

import sys

from partition.cli import main

if __name__ == "__main__":
    sys.exit(main())
