"""A system's job at any scale, simulated: every rank's program generated from the plan (no MPI
run) and run together on a cluster (:class:`substrate.jobsim.JobSim`).

The programs are the ones a run executes: for a data-parallel system one optimizer step
(:func:`dataparallel.program.step_program`: the model's units, the strategy plan's records at
their ready points, the optimizer); for H-SADMM and flat ADMM one outer iteration
(:func:`hsadmm.plan.iteration_program`: the local epochs, then the plan's calls and compute
items).  They are generated from a shape-only model spec for ``M`` nodes x ``P`` ranks, each
block costs what the device model says (:class:`commvol.workload.DeviceModel`), and the calls
move their schedules' messages on the cluster's links.  ``python -m commvol simulate`` runs a
recorded job the same way; this runs a job nobody recorded.
"""

from __future__ import annotations

import time

from dataparallel.program import FORWARD_BACKWARD, OPTIMIZER, step_program
from hsadmm.plan import LOCAL_SGD, iteration_program
from substrate.calls import Work
from substrate.cluster import Cluster
from substrate.jobsim import JobSim, JobSimOptions
from substrate.program import rebase

from .systems import get_system
from .workload import DeviceModel

__all__ = ["Job", "job_step"]


class Job:
    """One kind of step of ``system`` on ``M x P`` ranks (node-major): its programs and the
    cost of every block.

    Parameters
    ----------
    system : str
        A registered system (:func:`commvol.systems.get_system`).
    spec : models.ModelSpec
    M, P : int
        Nodes and ranks per node.
    options
        The system's options (``system.split(...)``).
    units : sequence of :class:`commvol.workload.Unit`
        The model's units in forward order (:func:`commvol.workload.units_for_spec`).
    device : DeviceModel
    batch : float or sequence of float
        Samples of a rank's step; ADMM: of each SGD step of the local epochs, in order.
    steps : int
        Steps simulated one after the other (the last one is the steady step).
    """

    def __init__(self, system: str, spec, M: int, P: int, options, units, device: DeviceModel,
                 batch, *, steps: int = 2, overlap: bool = True, assumptions=None) -> None:
        sm = get_system(system)
        self.system, self.loop = system, sm.loop
        if self.loop not in ("dp", "admm"):
            raise ValueError(f"--system {system}: its programs at scale are not generated yet "
                             "(data-parallel systems and ADMM are)")
        pred = sm.predict(spec, M, P, options) if sm.Assumptions is None else \
            sm.predict(spec, M, P, options, None, assumptions)
        it = pred.steady
        self.placement = pl = it.placement
        self.records = it.calls
        self.units, self.device = list(units), device
        self.batches = [float(b) for b in (batch if hasattr(batch, "__len__") else [batch])]
        if not self.batches or min(self.batches) <= 0:
            raise ValueError(f"a step needs a batch of > 0 samples, got {batch!r}")
        if self.loop == "dp" and len(self.batches) != 1:
            raise ValueError("a data-parallel step has one batch")
        self.params = spec.layout.total
        if self.loop == "dp":
            one = [step_program(self.units, it.calls, pl, r, overlap=overlap)
                   for r in range(pl.size)]
        else:
            one = [iteration_program(it.calls, self.units, len(self.batches), pl, r,
                                     overlap=overlap) for r in range(pl.size)]
        self.programs = [[e for s in range(steps) for e in rebase(p, -s * len(p))]
                         for p in one]
        self.steps = steps
        self._seconds = self._block_seconds()

    def _block_seconds(self) -> dict:
        """``{label: seconds}`` of every block kind (a layer's forward/backward at the full
        batch, the plan's compute items, the optimizer)."""
        dev = self.device
        out = {FORWARD_BACKWARD: 0.0, "forward:loss": 0.0,
               OPTIMIZER: dev.optimizer(self.params)}
        for w in self.records:
            if isinstance(w, Work):
                out[w.label] = dev.work(w)
        return out

    def _layer(self, key: str, k: int) -> float | None:
        """A layer block's seconds: its ``k``-th occurrence in the step (one a local step of
        an ADMM iteration, on that step's batch)."""
        phase, _, name = key.partition(":")
        u = self._unit.get(name)
        if u is None or phase not in ("forward", "backward"):
            return None
        batch = self.batches[k % len(self.batches)]
        return self.device.forward(u, batch) if phase == "forward" else \
            self.device.backward(u, batch)

    def charge(self, key, k) -> float:
        """The seconds the job simulation charges block ``(key, k)``."""
        if not hasattr(self, "_unit"):
            self._unit = {u.name: u for u in self.units}
        t = self._layer(key, k)
        if t is not None:
            return t
        if key == LOCAL_SGD:   # the local epochs' own rest: an optimizer update a local step
            layers = sum(self.device.forward(u, b) + self.device.backward(u, b)
                         for u in self.units for b in self.batches)
            return layers + len(self.batches) * self.device.optimizer(self.params)
        return self._seconds.get(key, 0.0)

    def run(self, cluster: Cluster, options: JobSimOptions | None = None) -> dict:
        """Simulate the steps on ``cluster``: ``{"step_s", "steps_s", "bytes", "seconds"}``
        (the steady step: the last one, the slowest rank's; every step; bytes moved per link
        class in all; the simulator's own wall time)."""
        t0 = time.perf_counter()
        options = options or JobSimOptions()
        sim = JobSim(self.programs, self.placement.node_of, cluster,
                     [self.charge] * len(self.programs), **options.kwargs())
        ends = sim.run()
        steps = [max(e[s] - (e[s - 1] if s else 0.0) for e in ends) for s in range(self.steps)]
        return {"step_s": steps[-1], "steps_s": steps,
                "bytes": {k: v / self.steps for k, v in sim.moved.items()},
                "seconds": time.perf_counter() - t0}


def job_step(system: str, spec, M: int, P: int, options, units, device: DeviceModel,
             cluster: Cluster, batch: float, **kw) -> dict:
    """The steady step of :class:`Job` on ``cluster`` (see :meth:`Job.run`)."""
    jobsim = kw.pop("jobsim", None)
    return Job(system, spec, M, P, options, units, device, batch, **kw).run(cluster, jobsim)

