"""Run a module as ``__main__`` and record this process's peak resident memory when it ends.

    python -m mpi4py -m bench.rss_probe MODULE [ARGS...]      (one line per rank)

Used by :mod:`bench.bench_memory` under ``mpiexec``: every rank runs ``MODULE`` (e.g. ``hsadmm``)
exactly as ``python -m MODULE ARGS`` would, then appends one JSON line to
``$SPARDIST_RSS_DIR/rss.<rank>.json``: the rank, ``VmHWM`` (peak resident set, KiB, from
``/proc/self/status``), ``VmRSS`` at the end, ``ru_maxrss`` (``resource.getrusage``, KiB) and
the resident set when the probe started (the interpreter + mpi4py, before ``MODULE`` is
imported).  Nothing in the measured package is changed.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys


def _status_kib(field: str) -> int:
    """``field`` (``VmHWM``, ``VmRSS``) of ``/proc/self/status`` in KiB (-1 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m bench.rss_probe MODULE [ARGS...]", file=sys.stderr)
        return 2
    start_rss = _status_kib("VmRSS")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the module's own exit status
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        out = os.environ.get("SPARDIST_RSS_DIR")
        if out:
            rank = _rank()
            rec = {"rank": rank, "module": module, "exit": code,
                   "vmhwm_kib": _status_kib("VmHWM"), "vmrss_kib": _status_kib("VmRSS"),
                   "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   "start_rss_kib": start_rss,
                   "modules": sorted(m for m in ("scipy", "numba", "sklearn", "tqdm",
                                                 "matplotlib", "mtkahypar", "kahypar", "torch")
                                     if m in sys.modules)}
            with open(os.path.join(out, f"rss.{rank}.json"), "a") as f:
                f.write(json.dumps(rec) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
