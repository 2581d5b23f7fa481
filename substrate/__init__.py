"""spardist substrate: topology, ledger-recording communicators, α–β cost model,
array backend and results.  Everything else in spardist stands on this package; nothing outside
it calls an mpi4py communication method directly.

Names are resolved lazily (PEP 562): importing ``substrate`` or ``runner.launch`` does not
import ``mpi4py.MPI``, so the launcher never initialises MPI itself (an MPI singleton in the
launcher would leak its environment into the ``mpiexec`` it starts).
"""

from __future__ import annotations

import importlib

#: public name -> submodule that defines it
_EXPORTS = {
    "Backend": "backend", "array_module": "backend", "cupy_available": "backend",
    "get_backend": "backend",
    "BucketPlan": "buckets", "bucket_groups": "buckets",
    "Call": "calls", "Placement": "calls", "Ready": "calls",
    "Comm": "comm", "Request": "comm", "Waiting": "comm", "bucketed_allreduce": "comm",
    "INTER": "costmodel", "INTRA": "costmodel", "CostModel": "costmodel",
    "Ledger": "ledger",
    "Handle": "recorder", "Recorder": "recorder",
    "Checkpointer": "results", "RunWriter": "results", "atomic_write_json": "results",
    "collective_check": "testing",
    "Level": "topology", "Topology": "topology", "TopologyError": "topology",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the lazy exports above are the one list)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'substrate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
