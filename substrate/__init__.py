"""spardist substrate: topology, ledger-recording communicators, α–β cost model, simulated clock,
array backend and results.  Everything else in spardist stands on this package; nothing outside
it calls an mpi4py communication method directly.
"""

from .backend import Backend, array_module, cupy_available, get_backend
from .cli import CommonConfig, Run, add_common_args, main_guard, start_run
from .clock import SimClock
from .comm import BucketPlan, Comm, Request, bucketed_allreduce
from .costmodel import INTER, INTRA, CostModel
from .ledger import Ledger
from .results import Checkpointer, RunWriter, atomic_write_json
from .testing import collective_check
from .topology import Level, Topology, TopologyError

__all__ = [
    "Backend", "array_module", "cupy_available", "get_backend",
    "CommonConfig", "Run", "add_common_args", "main_guard", "start_run",
    "SimClock", "BucketPlan", "Comm", "Request", "bucketed_allreduce",
    "INTER", "INTRA", "CostModel", "Ledger",
    "Checkpointer", "RunWriter", "atomic_write_json", "collective_check",
    "Level", "Topology", "TopologyError",
]
