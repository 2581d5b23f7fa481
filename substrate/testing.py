"""Helpers for MPI tests (convention 7: collective assertions)."""

from __future__ import annotations

__all__ = ["collective_check"]


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
