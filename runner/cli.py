"""The ``spardist`` console command: every spardist command under one name.

::

    spardist --version
    spardist run [-n NP] [--ranks-per-node R] [--hostfile F] MODULE [ARGS...]   # under mpiexec/srun
    spardist run                      # the headline job on the embedded default
    spardist hsadmm train ...         # = python -m hsadmm train ... (one process, or a rank of an
    spardist commvol predict ...      #   MPI job when started by mpiexec/srun yourself)

``spardist run`` is what ``./run_mpi.sh`` runs once ``.venv`` exists (:mod:`runner.launch`);
the other sub-commands are the packages' own ``python -m`` entry points.
"""

from __future__ import annotations

import runpy
import sys
from importlib.metadata import PackageNotFoundError, version

__all__ = ["COMMANDS", "main", "spardist_version"]

#: sub-command -> the module ``python -m`` runs for it
COMMANDS = {
    "run": "runner.launch", "hsadmm": "hsadmm", "dataparallel": "dataparallel",
    "sparse_sgd": "sparse_sgd", "partition": "partition", "models": "models",
    "commvol": "commvol", "lab": "lab", "replay": "runner.replay", "probe": "runner.probe",
}


def spardist_version() -> str:
    try:
        return version("spardist")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            argv = ["run"]      # as ./run_mpi.sh with no arguments: the headline job
        else:
            print(__doc__.strip())
            print("\ncommands: " + ", ".join(COMMANDS))
            return 0
    if argv[0] == "--version":
        print(f"spardist {spardist_version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"spardist: unknown command {cmd!r}; use one of {', '.join(COMMANDS)} "
              "(spardist --help)", file=sys.stderr)
        return 2
    # exactly what ``python -m MODULE ARGS`` does (its own error handling included)
    sys.argv = [f"spardist {cmd}", *rest]
    try:
        runpy.run_module(COMMANDS[cmd], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
