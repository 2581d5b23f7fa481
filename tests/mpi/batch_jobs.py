"""Several jobs in one MPI launch: ``python -m mpi4py batch_jobs.py JOBS.json``.

``JOBS.json`` holds ``{"mark": MARK, "jobs": [[name, module, argv], ...]}``; each job runs
as ``python -m module argv`` would (its ``__main__``, through :mod:`runpy`; a ``module`` ending in ``.py`` is a script of
``tests/mpi`` run as ``python script argv``), one after the other in this process, the way
``commvol.compare`` runs the headline's systems.  Launching the ranks and importing the
packages once instead of once per job is most of an MPI test's time on a small box.  The
first job that exits non-zero ends the launch with its status, naming the job.  Rank 0 prints
``MARK NAME`` before each job (``mpi_helpers.JobBatch`` splits the output there).
"""

import json
import runpy
import sys
from pathlib import Path

from mpi4py import MPI

if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    for name, module, argv in spec["jobs"]:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{spec['mark']}{name}", flush=True)
        sys.argv = [module, *argv]
        try:
            if module.endswith(".py"):
                sys.argv[0] = str(Path(__file__).with_name(module))
                runpy.run_path(sys.argv[0], run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
        if code not in (0, None):
            print(f"batch job {name!r} (python -m {module} {' '.join(argv)}) exited {code}",
                  file=sys.stderr)
            sys.exit(code if isinstance(code, int) else 1)
        MPI.COMM_WORLD.Barrier()
