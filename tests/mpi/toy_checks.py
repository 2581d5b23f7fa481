"""A made-up system that is only a plan and its bindings (:class:`test_call_record.
ToyStrategy`), registered as a data-parallel method and trained by the one trainer:
``python -m mpi4py toy_checks.py train --method toy ARGS``."""

import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])      # tests/ (the toy plan)

from test_call_record import ToyStrategy

from dataparallel.strategy import register
from dataparallel.train import main

if __name__ == "__main__":
    register(ToyStrategy)
    main(sys.argv[1:])
