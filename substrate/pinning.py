"""Environment variables that pin an MPI library's collectives to the algorithms spardist books.

Pure data (imports no MPI): the launcher (:mod:`runner.launch`) sets these before ``MPI_Init``;
:func:`substrate.collectives.describe` checks on every rank whether they are in force.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_MODE", "MODES", "MPICH_PINNING", "OPENMPI_PINNING", "WIRE_VERIFIED",
           "check_mode", "default_mode", "pinning_env"]

#: how collectives run (``--collectives``, env ``SPARDIST_COLLECTIVES``): spardist's own
#: point-to-point algorithms, or the MPI library's pinned to them (:mod:`substrate.collectives`)
MODES = ("exact", "native")
DEFAULT_MODE = "exact"


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is a known collectives mode, else raise naming the fix."""
    if mode not in MODES:
        raise ValueError(f"unknown collectives mode {mode!r}: use --collectives exact (own "
                         f"point-to-point algorithms, the default) or --collectives native "
                         f"(the MPI library's, pinned where known); SPARDIST_COLLECTIVES sets "
                         f"the default")
    return mode


def default_mode() -> str:
    """``SPARDIST_COLLECTIVES`` if set, else ``exact``."""
    return check_mode(os.environ.get("SPARDIST_COLLECTIVES", DEFAULT_MODE) or DEFAULT_MODE)

#: MPICH (4.x/5.x) control variables that make its collectives the booked algorithms.  Without
#: ``DEVICE_COLLECTIVES=none`` the ch4 device runs its own node-aware compositions and the
#: ``*_INTRA_ALGORITHM`` choices below are never consulted.
MPICH_PINNING = {
    "MPIR_CVAR_DEVICE_COLLECTIVES": "none",
    "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
    "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM": "ring",
    "MPIR_CVAR_ALLGATHERV_INTRA_ALGORITHM": "ring",
    "MPIR_CVAR_BCAST_INTRA_ALGORITHM": "binomial",
    "MPIR_CVAR_ALLTOALLV_INTRA_ALGORITHM": "scattered",
    "MPIR_CVAR_BARRIER_INTRA_ALGORITHM": "k_dissemination",
}

#: Open MPI ``coll_tuned`` forced algorithms (ring, ring, ring, binomial, pairwise, bruck) with the
#: higher-priority hierarchical components excluded so ``tuned`` is the one that runs.
OPENMPI_PINNING = {
    "OMPI_MCA_coll": "^han,hcoll,ucc,acoll,xhc",
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
    "OMPI_MCA_coll_tuned_allgather_algorithm": "4",
    "OMPI_MCA_coll_tuned_allgatherv_algorithm": "3",
    "OMPI_MCA_coll_tuned_bcast_algorithm": "6",
    "OMPI_MCA_coll_tuned_bcast_algorithm_segmentsize": "0",
    "OMPI_MCA_coll_tuned_alltoallv_algorithm": "2",
    "OMPI_MCA_coll_tuned_barrier_algorithm": "4",
}

#: Library family -> (version prefix, what was checked): native pinning checked on the wire
#: (the wire lab, ``python -m lab``: real/booked within 2 % for every system).  Nothing else is
#: claimed.
WIRE_VERIFIED = {"mpich": ("5.0", "MPICH 5.0 (PyPI wheel, ch4:ucx over TCP, 2x2 and 4x2 hosts)")}


def pinning_env(flavor: str) -> dict:
    """Environment variables that pin ``flavor``'s (``"mpich"``, ``"openmpi"``...) collectives to
    the booked algorithms; empty for a library spardist does not know how to pin."""
    if flavor == "mpich":
        return dict(MPICH_PINNING)
    if flavor.startswith("openmpi"):
        return dict(OPENMPI_PINNING)
    return {}
