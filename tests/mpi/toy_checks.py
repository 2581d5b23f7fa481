"""A made-up system that is only a plan and its bindings (``tests/substrate/test_call_record.py``:
``ToyStrategy``), registered as a data-parallel method and trained by the one trainer:
``python -m mpi4py toy_checks.py train --method toy ARGS``."""

import sys

TESTS = __file__.rsplit("/", 2)[0]
# the checkout first (tests/models/ must not shadow models/), then the helpers and the toy plan
sys.path[:0] = [TESTS.rsplit("/", 1)[0], TESTS, TESTS + "/substrate"]

from test_call_record import ToyStrategy

from dataparallel.strategy import register
from dataparallel.train import main

if __name__ == "__main__":
    register(ToyStrategy)
    main(sys.argv[1:])
