"""Run a spardist module on the strict CuPy stand-in and record the host syncs of every step.

    mpiexec -n 4 python -m mpi4py tests/strictcupy/run_counted.py OUT_DIR MODULE [ARGS...]

(with ``tests/strictcupy`` on ``PYTHONPATH``).  Each step's syncs are the counter's growth
between two calls of :meth:`simulation.clock.SimClock.step` (every trainer calls it once per
step or iteration); ``OUT_DIR/rank<r>.json`` gets the per-step counts (all threads, the main
thread, by call site) and the whole run's totals.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    out, module, *args = sys.argv[1:]
    import cupy

    if not hasattr(cupy, "_strict"):
        raise SystemExit("run_counted.py needs the strict stand-in first on PYTHONPATH")
    from mpi4py import MPI

    from simulation import clock as clock_mod

    rank = MPI.COMM_WORLD.Get_rank()
    counter = cupy._strict
    steps: list[dict] = []
    last = [counter.snapshot()]
    original = clock_mod.SimClock.step

    def step(self):
        res = original(self)
        now = counter.snapshot()
        prev = last[0]
        sites = {k: v - prev["by_site"].get(k, 0) for k, v in now["by_site"].items()
                 if v != prev["by_site"].get(k, 0)}
        steps.append({"syncs": now["syncs"] - prev["syncs"],
                      "main_syncs": now["main_syncs"] - prev["main_syncs"],
                      "d2h_copies": now["d2h_copies"] - prev["d2h_copies"],
                      "h2d_copies": now["h2d_copies"] - prev["h2d_copies"],
                      "by_site": sites})
        last[0] = now
        return res

    clock_mod.SimClock.step = step

    def write() -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(
            {"steps": steps, "total": counter.snapshot(), "argv": [module, *args]}, indent=1))

    atexit.register(write)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
