"""A system's step at any scale, simulated as a job: every rank's program generated from the
plan (no MPI run) and run together on the simulated network (:class:`substrate.jobsim.JobSim`).

The programs are the ones a run executes (:func:`dataparallel.program.step_program`: the model's
units, the strategy plan's records at their ready points, the optimizer), generated from a
shape-only model spec for ``M`` nodes x ``P`` ranks; each block costs what the compute model
says (:class:`commvol.timeline_scale.ComputeModel`: a unit's forward and backward FLOPs at the
device's rate, a plan's compute item and the optimizer on the roofline), the calls move their
schedules' messages on the network.  ``python -m commvol simulate`` runs a recorded job the
same way; this runs a job nobody recorded.
"""

from __future__ import annotations

import time

from dataparallel.program import FORWARD_BACKWARD, OPTIMIZER, step_program
from substrate.calls import Work
from substrate.costmodel import CostModel
from substrate.jobsim import JobSim, job_steps

from .systems import get_system
from .timeline_scale import ComputeModel, _step_records

__all__ = ["dp_job_step", "dp_programs"]


def dp_programs(system: str, spec, M: int, P: int, options, cost: CostModel,
                compute: ComputeModel, batch: float, overlap: bool = True):
    """Every rank's program of one optimizer step of ``system`` on ``M x P`` ranks
    (node-major), and the charge of its blocks: ``(programs, node_of, charge)``."""
    if get_system(system).loop != "dp":
        raise ValueError(f"--system {system} is not data-parallel")
    it = _step_records(system, spec, M, P, options, cost)
    pl = it.placement
    programs = [step_program(compute.units, it.calls, pl, r, overlap=overlap)
                for r in range(pl.size)]
    seconds = {FORWARD_BACKWARD: 0.0, OPTIMIZER: compute.optimizer_s(spec.layout.total),
               "forward:loss": 0.0}
    rate = compute.rate_tflops * 1e12
    for u in compute.units:
        seconds[f"forward:{u.name}"] = batch * u.forward_flops / rate
        seconds[f"backward:{u.name}"] = batch * u.backward_flops / rate
    for w in it.calls:
        if isinstance(w, Work):
            seconds[w.label] = compute.work_s(w.flops, w.nbytes)

    def charge(key, k):
        return seconds.get(key, 0.0)

    return programs, pl.node_of, charge


def dp_job_step(system: str, spec, M: int, P: int, options, cost: CostModel,
                compute: ComputeModel, batch: float, *, overlap: bool = True,
                link_sharing: str = "fifo") -> dict:
    """One optimizer step of the job: ``{"step_s", "bytes", "seconds"}`` (the slowest rank's
    step, the bytes the simulation moved per link class, the simulator's own wall time)."""
    t0 = time.perf_counter()
    programs, node_of, charge = dp_programs(system, spec, M, P, options, cost, compute,
                                            batch, overlap)
    sim = JobSim(programs, node_of, cost, [charge] * len(programs),
                 link_sharing=link_sharing)
    ends = sim.run()
    step = max(job_steps(ends, r)[0] for r in range(len(programs)))
    return {"step_s": step, "bytes": dict(sim.moved), "seconds": time.perf_counter() - t0}
