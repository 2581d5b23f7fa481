"""One option set and one run context for every ``python -m <package> ...`` command.

>>> parser = argparse.ArgumentParser(); add_common_args(parser)
>>> args = parser.parse_args(argv)
>>> run = start_run(args, system="hsadmm", method="hsadmm", config=cfg)
>>> run.log(iteration=0, loss=1.2)
>>> summary = run.finish(metrics={"final_test_accuracy": 0.97})
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from . import collectives as coll
from . import costmodel as cm
from .backend import Backend, get_backend
from .clock import SimClock
from .costmodel import CostModel
from .ledger import Ledger
from .results import RunWriter, to_jsonable
from .topology import Topology

__all__ = ["add_common_args", "CommonConfig", "Run", "start_run", "main_guard", "versions",
           "check_world_size", "expected_world_size"]


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every spardist command shares (results, seed, device, topology, cost)."""
    g = parser.add_argument_group("run (shared by every spardist command)")
    g.add_argument("--out", type=Path, default=None,
                   help="results directory (default: results/<system>_<method>)")
    g.add_argument("--seed", type=int, default=0, help="run seed (shared randomness)")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="array backend: NumPy (cpu) or CuPy (gpu)")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="simulate nodes of R consecutive ranks (default: real shared-memory "
                        "nodes)")
    g.add_argument("--collectives", choices=coll.MODES, default=None,
                   help="exact: spardist's own point-to-point collectives, the bytes booked are "
                        "the bytes sent on any MPI; native: the MPI library's, pinned to the "
                        "booked algorithm where known (default: $SPARDIST_COLLECTIVES or exact)")
    c = parser.add_argument_group("cost model (alpha-beta per link class)")
    c.add_argument("--intra-bw", type=float, default=cm.DEFAULT_INTRA_GBPS, metavar="GBPS",
                   help="intra-node bandwidth in Gbit/s (default %(default)s: NVLink-class)")
    c.add_argument("--inter-bw", type=float, default=cm.DEFAULT_INTER_GBPS, metavar="GBPS",
                   help="inter-node bandwidth in Gbit/s (default %(default)s: InfiniBand-class)")
    c.add_argument("--intra-lat", type=float, default=cm.DEFAULT_INTRA_LAT_US, metavar="US",
                   help="intra-node latency in microseconds (default %(default)s)")
    c.add_argument("--inter-lat", type=float, default=cm.DEFAULT_INTER_LAT_US, metavar="US",
                   help="inter-node latency in microseconds (default %(default)s)")
    return parser


@dataclass(frozen=True)
class CommonConfig:
    """The shared options, frozen (written into ``summary.json``)."""

    out: str | None = None
    seed: int = 0
    device: str = "cpu"
    ranks_per_node: int | None = None
    collectives: str | None = None
    intra_bw: float = cm.DEFAULT_INTRA_GBPS
    inter_bw: float = cm.DEFAULT_INTER_GBPS
    intra_lat: float = cm.DEFAULT_INTRA_LAT_US
    inter_lat: float = cm.DEFAULT_INTER_LAT_US

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CommonConfig":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
        if kw.get("out") is not None:
            kw["out"] = str(kw["out"])
        if kw.get("collectives") is None:
            kw["collectives"] = coll.default_mode()
        return cls(**kw)

    def cost_model(self) -> CostModel:
        return CostModel.from_cli(self.intra_bw, self.inter_bw, self.intra_lat, self.inter_lat)


def versions() -> dict:
    import scipy  # noqa: PLC0415

    try:
        from importlib.metadata import version  # noqa: PLC0415

        spardist = version("spardist")
    except Exception:
        spardist = "unknown"
    import mpi4py  # noqa: PLC0415

    return {"spardist": spardist, "python": platform.python_version(), "numpy": np.__version__,
            "scipy": scipy.__version__, "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}


class Run:
    """Everything a command needs: topology, communicators, ledger, cost model, clock, backend,
    results writer.  Built by :func:`start_run`."""

    def __init__(self, *, system: str, method: str, common: CommonConfig, config,
                 topo: Topology, backend: Backend, writer: RunWriter) -> None:
        self.system, self.method = system, method
        self.common = common
        self.config = config
        self.topo = topo
        self.world = topo.world
        self.rank = topo.rank
        self.size = topo.size
        self.backend = backend
        self.xp = backend.xp
        self.ledger = topo.ledger
        self.cost = topo.cost
        self.clock = SimClock(self.ledger, sync=backend.synchronize if backend.is_gpu else None)
        self.writer = writer
        self.out = writer.out
        self._t0 = time.time()
        self.finished = False
        #: which collectives ran and whether the wire carries what the ledger books (collective)
        self.collectives = coll.describe(self.world.mode, self.world.mpi)

    def log(self, **record) -> None:
        """One ``metrics.jsonl`` line (written by rank 0; pass values already reduced)."""
        self.writer.log(record)

    def finish(self, metrics: dict | None = None, predicted: dict | None = None,
               extra: dict | None = None) -> dict:
        """Reduce the ledger and timers over all ranks and publish ``summary.json`` (collective).

        Returns the summary dict on every rank.
        """
        measured = self.ledger.totals(self.world)
        t = self.clock.as_dict()
        timing = {k: float(self.world.mpi.allreduce(v, op=MPI.MAX)) for k, v in t.items()}
        summary = {
            "system": self.system,
            "method": self.method,
            "config": _config_dict(self.config),
            "common": dataclasses.asdict(self.common),
            "versions": versions(),
            "topology": self.topo.describe(),
            "cost_model": self.cost.describe(),
            "collectives": self.collectives,
            "traffic": {"measured": measured, "predicted": predicted or {}},
            "metrics": metrics or {},
            "timing": timing,
        }
        if extra:
            summary.update(extra)
        summary = to_jsonable(summary)
        self.writer.finish(summary)
        if self.rank == 0 and not self.collectives["verified"]:
            print(f"spardist: warning: traffic is {self.collectives['status']}", file=sys.stderr,
                  flush=True)
        self.finished = True
        return summary


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)


def expected_world_size(env=None) -> tuple[int, str] | None:
    """The rank count the launcher asked for, and who said so, or ``None`` when unknown.

    In order: ``SPARDIST_NP`` (set by ``run_mpi.sh`` / ``substrate.launch``), the process
    manager's own size (``PMI_SIZE``: Hydra and PMI-1/2 launchers; ``OMPI_COMM_WORLD_SIZE``:
    Open MPI's mpirun), and last the Slurm step's task count (``SLURM_STEP_NUM_TASKS``), read only when no process manager variable is set:
    under Hydra's Slurm launcher the step's tasks are the per-node proxies, not the ranks.
    """
    import os  # noqa: PLC0415

    env = os.environ if env is None else env
    for var in ("SPARDIST_NP", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if env.get(var, "").isdigit():
            return int(env[var]), var
    if env.get("SLURM_STEP_NUM_TASKS", "").isdigit() and not any(
            k.startswith(("PMI_", "PMIX_", "OMPI_")) for k in env):
        return int(env["SLURM_STEP_NUM_TASKS"]), "SLURM_STEP_NUM_TASKS"
    return None


def check_world_size(size: int, env=None) -> None:
    """Stop when MPI's world is not the one the launcher started (e.g. ``srun`` without a PMI
    the MPI library speaks starts N single-rank worlds that would race on one results folder).

    Raises
    ------
    ValueError
        Naming the expected and actual size and the fix.
    """
    want = expected_world_size(env)
    if want is None or want[0] == size:
        return
    n, var = want
    raise ValueError(
        f"the launcher started {n} ranks ({var}={n}) but MPI sees a world of {size}: the ranks "
        f"did not find each other (singletons). Under Slurm with the MPICH wheel use "
        f"SPARDIST_LAUNCHER='srun --mpi=pmi2' (or plain mpiexec inside the allocation); with a "
        f"site MPI use the srun --mpi plugin it was built for (srun --mpi=list); make sure "
        f"mpiexec and mpi4py come from the same MPI library")


def start_run(args, *, system: str, method: str, config=None, comm=None) -> Run:
    """Build the run context from parsed common args (collective over ``comm``).

    Works serially too: without ``mpiexec`` the world has one rank.  Stops with a clear error
    (:func:`check_world_size`) when the launcher started more ranks than MPI connected.
    """
    common = args if isinstance(args, CommonConfig) else CommonConfig.from_args(args)
    if comm is None:
        check_world_size(MPI.COMM_WORLD.Get_size())
    cost = common.cost_model()
    topo = Topology.from_comm(comm if comm is not None else MPI.COMM_WORLD,
                              ranks_per_node=common.ranks_per_node, cost=cost,
                              collectives=common.collectives)
    backend = get_backend(common.device, topo.gpu_index)
    topo.bind_backend(backend)
    out = Path(common.out) if common.out else Path("results") / f"{system}_{method}"
    writer = RunWriter(out, enabled=topo.rank == 0)
    return Run(system=system, method=method, common=common, config=config, topo=topo,
               backend=backend, writer=writer)


def main_guard(main):
    """Wrap a CLI ``main(argv)`` so an exception on any rank ends the whole job cleanly.

    The failing rank prints ``spardist: error on rank R: ...`` to stderr and, in a multi-rank
    job, aborts the job (no rank is left waiting in a collective).  Exit status is non-zero.
    """

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001
            world = MPI.COMM_WORLD
            msg = f"spardist: error on rank {world.Get_rank()}: {type(exc).__name__}: {exc}"
            print(msg, file=sys.stderr, flush=True)
            if not isinstance(exc, ValueError):
                import traceback  # noqa: PLC0415

                traceback.print_exc()
            if world.Get_size() > 1:
                time.sleep(0.5)  # let ranks that fail the same way print their message too
                world.Abort(1)
            sys.exit(1)

    return wrapped
