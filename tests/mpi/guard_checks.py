"""How :func:`runner.run.main_guard` reports failures of a multi-rank job.

``python -m mpi4py guard_checks.py lone``: rank 1 alone fails while rank 0 waits in a
collective: rank 1's message is printed once and the job ends (no hang).
``python -m mpi4py guard_checks.py distinct OUT``: every rank starts a run in OUT, then rank 0
fails with one message and the others with another (a ``RuntimeError``, with its traceback):
each message is printed once, naming its ranks; the in-progress metrics are removed.
"""

import sys

from mpi4py import MPI

from runner.errors import main_guard
from runner.options import CommonConfig
from runner.run import start_run


@main_guard
def main(argv):
    comm = MPI.COMM_WORLD
    if argv[0] == "lone":
        if comm.rank == 1:
            raise ValueError("lone failure on rank 1")
        comm.barrier()  # rank 0 waits here until the job is aborted
        return 0
    start_run(CommonConfig(out=argv[1]), system="guard", method="distinct")
    if comm.rank == 0:
        raise ValueError("first kind")
    raise RuntimeError("second kind")


if __name__ == "__main__":
    main(sys.argv[1:])
