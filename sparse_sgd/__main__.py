"""Entry point: ``python -m sparse_sgd {train,infer,partition,generate} ...``."""

import sys

from sparse_sgd.cli import main

if __name__ == "__main__":
    sys.exit(main())
