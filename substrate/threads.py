"""Each rank caps its own compute threads, however it was launched.

``run_mpi.sh`` sets ``OMP_NUM_THREADS`` and friends to ``cores // ranks`` for the ranks it
starts; a rank started by a plain ``mpiexec`` or ``srun`` inherits nothing, so its BLAS and Numba
pools would each take every core of the node, ranks would oversubscribe the node many times over,
and the ``cpu`` compute source (thread CPU time with one BLAS thread, process CPU time with
more) would read a different clock: the same job simulated twenty-fold slower.  So
every run caps its pools itself (:func:`cap_threads`, called by
:func:`runner.run.start_run`) at ``cores // ranks on this node`` (``cores``: the CPUs this
process may run on), unless the environment already says how many threads to use, and
``summary.json`` records the result.
"""

from __future__ import annotations

import os
import sys

__all__ = ["THREAD_VARS", "blas_threads", "cap_threads", "usable_cores"]

#: the variables that size the BLAS / OpenMP / Numba pools
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def blas_threads() -> int | None:
    """Largest thread count of the BLAS/OpenMP pools loaded in this process (threadpoolctl), or
    ``None`` when it cannot be read."""
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        return None
    info = threadpool_info()
    return max((int(p.get("num_threads", 1)) for p in info), default=1)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: a Slurm or cgroup cpuset, ``taskset``),
    else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cap_threads(ranks_on_node: int, cores: int | None = None, apply: bool = True) -> dict:
    """Cap this rank's BLAS/OpenMP (``threadpoolctl``) and Numba pools at ``cores //
    ranks_on_node`` (at least 1), unless one of :data:`THREAD_VARS` is already set (a
    launcher's or the user's choice, kept).

    ``apply=False`` decides without touching the environment or the pools (tests).

    Returns ``{"threads", "set_by", "ranks_on_node", "cores", "blas_threads"}`` for
    ``summary.json``.
    """
    cores = usable_cores() if cores is None else int(cores)
    ranks_on_node = max(1, int(ranks_on_node))
    given = {v: os.environ[v] for v in THREAD_VARS if os.environ.get(v, "").strip()}
    if given:
        first = next(iter(given.values()))
        n = int(first) if first.isdigit() and int(first) > 0 else None
        set_by = "environment (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
    else:
        n = max(1, cores // ranks_on_node)
        set_by = f"spardist: {cores} usable cores // {ranks_on_node} ranks on this node"
    if given or not apply:
        return {"threads": n, "set_by": set_by, "ranks_on_node": ranks_on_node,
                "cores": cores, "blas_threads": None if not apply else _blas()}
    # the pools already loaded are capped in place; the environment is left alone (a library
    # caller's subprocesses keep theirs) except for Numba when it is not loaded yet (it reads
    # NUMBA_NUM_THREADS when it starts)
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = str(n)
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        threadpool_limits(limits=n)
    except ImportError:  # pragma: no cover - a dependency of spardist
        pass
    numba = sys.modules.get("numba")
    if numba is not None:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return {"threads": n, "set_by": set_by, "ranks_on_node": ranks_on_node, "cores": cores,
            "blas_threads": _blas()}


def _blas() -> int | None:
    return blas_threads()
