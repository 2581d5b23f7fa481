"""A system's job at any scale, simulated: every rank's program generated from the plan (no MPI
run) and run together on a cluster (:class:`simulation.jobsim.JobSim`).

The programs are the ones a run executes: for a data-parallel system one optimizer step
(:func:`dataparallel.program.step_program`: the model's units, the strategy plan's records at
their ready points, the optimizer); for H-SADMM and flat ADMM one outer iteration
(:func:`hsadmm.plan.iteration_program`: the local epochs, then the plan's calls and compute
items); for H-SGD and SGD (paper 001) one training step of the sparse net
(:func:`sparse_sgd.program.step_programs`: per layer the SpFF exchange of Alg. 2 between its
pack, local and remote products, then SpBP of Alg. 3 with the update) from the plan
:func:`sparse_sgd.plan.plan_partition` builds for a RadiX-Net (:class:`commvol.hsgd.
RadixNetSpec`).  They are generated for ``M`` nodes x ``P`` ranks, each block costs what the
device model says (:class:`commvol.workload.DeviceModel`; an H-SGD block its FLOPs and
compulsory memory traffic, :func:`sparse_sgd.program.block_work`, on one core), and the calls
move their schedules' messages on the cluster's links.  ``python -m commvol simulate`` runs a
recorded job the same way; this runs a job nobody recorded.

An H-SGD step of L layers at paper scale holds ~10^7 messages (SGD at P = 512, N = 65536:
~511 a rank a layer and direction), too many to simulate in minutes; :func:`sparse_step`
simulates windows of the network's first layers instead (one and two periods of the
partition) and extends the second period's cost over the remaining layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time

import numpy as np

from dataparallel.program import FORWARD_BACKWARD, OPTIMIZER, step_program
from hsadmm.plan import LOCAL_SGD, iteration_program
from partition.metrics import partition_metrics
from partition.partitioners import Partition
from simulation.cluster import Cluster
from simulation.jobsim import JobSim, JobSimOptions
from sparse_sgd.activations import ACT_FLOPS
from sparse_sgd.plan import HSGDPlan
from sparse_sgd.program import block_work, layer_counts, step_programs
from sparse_sgd.radixnet import radixnet
from substrate.calls import Placement, Work, price
from substrate.program import rebase

from .systems import get_system
from .workload import DeviceModel

__all__ = ["PARTITION_OF", "Job", "job_step", "sparse_network", "sparse_step"]

#: the row partition of each sparse-SGD system (H-SGD paper §6.1: "H-SGD if the proposed
#: hypergraph partitioning model is used ... SGD to denote that random partitioning is utilized")
PARTITION_OF = {"hsgd": "hypergraph", "sgd": "random"}
#: the activation of the paper's runs (§6.1: "We used sigmoid function")
SPARSE_ACTIVATION = "sigmoid"


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
        Samples of a rank's step; ADMM: of each SGD step of the local epochs, in order; H-SGD:
        the input vectors of a mini-batch (an integer).
    steps : int
        Steps simulated one after the other (the last one is the steady step).
    window : int, optional
        H-SGD: simulate the network's first ``window`` layers only (default: all of
        ``spec.layers``), partitioned as the whole network is (:func:`sparse_network`).
    loss : bool
        H-SGD: the trainer's class scores and loss all-reduce end the step (default); False:
        Alg. 1's step alone, what the paper times (:func:`sparse_sgd.program.step_program`).
    """

    def __init__(self, system: str, spec, M: int, P: int, options, units, device: DeviceModel,
                 batch, *, steps: int = 2, overlap: bool = True, assumptions=None,
                 window: int | None = None, loss: bool = True) -> None:
        sm = get_system(system)
        self.system, self.loop = system, sm.loop
        if self.loop not in ("dp", "admm", "hsgd"):
            raise ValueError(f"--system {system}: its programs at scale are not generated yet "
                             "(data-parallel systems, ADMM and H-SGD are)")
        self.device, self.steps = device, steps
        if self.loop == "hsgd":
            self._sparse(spec, M, P, options, batch, steps, overlap, window, loss)
            return
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
        self.programs = _repeat(one, steps)
        self._seconds = self._block_seconds()

    def _sparse(self, spec, M, P, options, batch, steps, overlap, window, loss) -> None:
        """H-SGD / SGD: every rank's step (:func:`sparse_sgd.program.step_programs`) of the
        network's first ``window`` layers, each block costed from its FLOPs and bytes."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"an H-SGD step takes a batch of >= 1 input vectors, got {batch!r}")
        net = sparse_network(self.system, spec, M, P, options)
        L = net.layers if window is None else int(window)
        if not 1 <= L <= net.layers:
            raise ValueError(f"window {window!r}: the network has {net.layers} layers; use 1 <= "
                             f"window <= {net.layers}")
        plan, counts = net.window(L)
        self.placement = pl = Placement.node_major(M, P)
        self.layers, self.plan, self.counts = L, plan, counts
        records = plan.tagged_calls(pl, int(batch), options.itemsize)
        self.records = [c for c, t in records if loss or t is not None]
        self.batches = [float(batch)]
        one = step_programs(records, L, pl, overlap=overlap, loss=loss)
        self.programs = _repeat(one, steps)
        act = ACT_FLOPS[SPARSE_ACTIVATION]
        self._rank_seconds = [
            {label: self.device.seconds(f, b) for label, (f, b) in
             block_work(counts, r, int(batch), options.itemsize, act).items()}
            for r in range(pl.size)]

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

    def charges(self) -> list:
        """The job simulation's charge of every rank (H-SGD: each rank its own blocks)."""
        if self.loop != "hsgd":
            return [self.charge] * len(self.programs)
        return [functools.partial(_lookup, table) for table in self._rank_seconds]

    def compute_s(self, rank: int) -> float:
        """H-SGD: the seconds of ``rank``'s blocks in one step (its compute alone)."""
        return float(sum(self._rank_seconds[rank].values()))

    def run(self, cluster: Cluster, options: JobSimOptions | None = None) -> dict:
        """Simulate the steps on ``cluster``: ``{"step_s", "steps_s", "bytes", "seconds"}``
        (the steady step: the last one, the slowest rank's; every step; bytes moved per link
        class in all; the simulator's own wall time)."""
        t0 = time.perf_counter()
        options = options or JobSimOptions()
        sim = JobSim(self.programs, self.placement.node_of, cluster, self.charges(),
                     **options.kwargs())
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


@contextlib.contextmanager
def _no_gc():
    """No cyclic garbage collection inside: a job of 10^6 messages allocates millions of
    objects, none in a cycle, and every full collection walks all of them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _repeat(programs, steps: int) -> list:
    """Every rank's program ``steps`` times, one step after the other."""
    return [[e for s in range(steps) for e in rebase(p, -s * len(p))] for p in programs]


def _lookup(table: dict, key, k) -> float:
    return table.get(key, 0.0)


# -- H-SGD at paper scale -------------------------------------------------------------------------
class SparseNetwork:
    """A RadiX-Net partitioned for ``M x P`` ranks as ``sparse_sgd train`` partitions it
    (:func:`sparse_sgd.plan.plan_partition`), and the plan of any window of its first layers.

    Attributes
    ----------
    weights : list
        W^1 .. W^L of the spec.
    partition : partition.Partition
    period : int
        Layers after which the partition's communication repeats: the RadiX-Net's radices
        (the tiled hypergraph partition repeats one period, :func:`partition.
        hypergraph_partition`); 1 for random rows (every layer drawn alike).
    """

    def __init__(self, system: str, spec, M: int, P: int, options) -> None:
        if system not in PARTITION_OF:
            raise ValueError(f"--system {system} is not a sparse-SGD system "
                             f"({', '.join(PARTITION_OF)})")
        network = spec.config()
        self.weights = _radixnet(spec)
        self.plan = HSGDPlan.build(self.weights, M, P, PARTITION_OF[system], options,
                                   seed=spec.seed, network=network)
        self.partition = self.plan.partition
        self.layers = len(self.weights)
        self.period = len(network.radices) if PARTITION_OF[system] == "hypergraph" else 1

    @functools.lru_cache(maxsize=4)  # noqa: B019  (a few windows of one network)
    def window(self, layers: int):
        """``(HSGDPlan, LayerCounts)`` of the first ``layers`` layers (their owners as the
        whole network's partition gives them)."""
        if layers == self.layers:
            plan = self.plan
        else:
            part = self.partition
            cut = Partition(owners=part.owners[:layers + 1], parts=part.parts,
                            method=part.method, seconds=part.seconds, info=part.info)
            plan = HSGDPlan(cut, partition_metrics(self.weights[:layers], cut))
        return plan, layer_counts(self.weights[:layers], plan.partition, plan.metrics)


@functools.lru_cache(maxsize=1)
def _radixnet(spec) -> list:
    """The weights of ``spec`` (H-SGD and SGD of one network share them)."""
    return radixnet(spec.config())


@functools.lru_cache(maxsize=2)
def sparse_network(system: str, spec, M: int, P: int, options) -> SparseNetwork:
    """The :class:`SparseNetwork` of ``spec`` on ``M x P`` ranks (built once a process)."""
    return SparseNetwork(system, spec, M, P, options)


def sparse_step(system: str, spec, M: int, P: int, options, device: DeviceModel,
                cluster: Cluster, batch: int = 1, *, jobsim: JobSimOptions | None = None,
                loss: bool = True, exact: bool = False, steps: int = 1) -> dict:
    """One training step of H-SGD or SGD on ``spec`` (L layers) over ``M x P`` ranks.

    With ``exact`` (or when L <= 2p + 1, p the partition's period) every layer is simulated.
    Otherwise the network's first ``2p + 1`` layers are built and partitioned as the whole
    network is (a RadiX-Net's first layers and its partition do not depend on the layers
    after them), windows of its first ``p`` and ``2p`` layers are simulated and the step is

        T(L) = T(p) + (L - p) / p x (T(2p) - T(p)),

    the second period's cost (its SpFF and SpBP exchanges, products and updates, and the
    start-up it adds nothing to) extended over the remaining periods: exact when every later
    period costs what the second does (the tiled partition repeats it up to a relabelling of
    the parts; random rows draw every layer alike).  ``steps`` steps run one after the other
    (the last is the one reported; one by default: a step has no barrier but its chain of
    exchanges, so the next one only starts earlier on ranks that finish early).

    Returns ``{"step_s", "compute_s", "bound_s", "windows": {layers: step_s}, "bytes",
    "seconds", "layers", "period", "table1"}``: ``compute_s`` the slowest rank's blocks alone,
    ``bound_s`` that plus the α–β time of the busiest rank's calls (nothing overlapped), both
    extended the same way; ``table1`` the partition's Table-1 metrics over the layers built
    (:meth:`partition.PartitionMetrics.table1`: SpFF words and messages a processor a layer).
    """
    t0 = time.perf_counter()
    L = int(spec.layers)
    period = 1 if PARTITION_OF.get(system) == "random" else len(spec.config().radices)
    short = exact or L <= 2 * period + 1
    built = spec if short else dataclasses.replace(spec, layers=2 * period + 1)
    windows = (L,) if short else (period, 2 * period)
    out = {}
    with _no_gc():
        for w in windows:
            job = Job(system, built, M, P, options, None, device, batch, window=w, loss=loss,
                      steps=steps)
            r = job.run(cluster, jobsim)
            compute = max(job.compute_s(q) for q in range(job.placement.size))
            comm = max(price(job.records, job.placement, cluster.cost_model()).rank_s,
                       default=0.0)
            out[w] = (r, compute, compute + comm)
            del job
    if short:
        (r, comp, bound), = out.values()
        step, compute, moved = r["step_s"], comp, r["bytes"]
    else:
        (r1, c1, b1), (r2, c2, b2) = out[period], out[2 * period]
        reps = (L - period) / period

        def extend(a, b):
            return a + reps * (b - a)

        step, compute, bound = extend(r1["step_s"], r2["step_s"]), extend(c1, c2), extend(b1, b2)
        moved = {k: extend(r1["bytes"][k], r2["bytes"][k]) for k in r1["bytes"]}
    table1 = sparse_network(system, built, M, P, options).plan.metrics.table1()
    return {"step_s": step, "compute_s": compute, "bound_s": bound, "bytes": moved,
            "layers": L, "period": period,
            "windows": {w: r["step_s"] for w, (r, _, _) in out.items()},
            "table1": table1, "seconds": time.perf_counter() - t0}

