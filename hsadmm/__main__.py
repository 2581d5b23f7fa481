"""``python -m hsadmm train ...`` (see :mod:`hsadmm.train`)."""

import sys

from runner.errors import main_guard

from .train import main

if __name__ == "__main__":
    sys.exit(main_guard(main)())
