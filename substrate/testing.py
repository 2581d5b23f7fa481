"""Helpers for MPI tests (convention 7: collective assertions) and load experiments."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

__all__ = ["busy_loops", "collective_check"]


@contextmanager
def busy_loops(n: int = 2):
    """Run ``n`` Python processes spinning ``while True: pass`` for the enclosed block (the
    "beside busy processes" load of the timing checks); always ended and reaped."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def collective_check(comm, ok: bool, message: str = "") -> None:
    """Fail on every rank if the check failed on any rank.

    Allgathers ``(ok, message)`` over ``comm`` (a :class:`substrate.Comm` or an mpi4py
    communicator); if any rank reported ``False``, every rank raises ``AssertionError`` listing the
    failing ranks and their messages, so the job fails together instead of hanging.
    """
    mpi = getattr(comm, "mpi", comm)
    verdicts = mpi.allgather((bool(ok), str(message)))
    bad = [(r, m) for r, (v, m) in enumerate(verdicts) if not v]
    if bad:
        lines = "; ".join(f"rank {r}: {m}" for r, m in bad)
        raise AssertionError(f"check failed on {len(bad)} of {len(verdicts)} ranks: {lines}")
