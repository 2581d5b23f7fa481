"""``python -m dataparallel train ...`` (see :mod:`dataparallel.train`)."""

import sys

from runner.errors import main_guard

from .train import main

if __name__ == "__main__":
    sys.exit(main_guard(main)())
