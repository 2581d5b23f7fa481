"""One iteration of each system on the event timeline, at paper scale (``commvol scale``).

The trainers' simulated clock schedules a step of one rank on a
:class:`substrate.timeline.Timeline`; this module declares the same kind of step without running
anything, from a shape-only model spec, so that ``commvol scale`` times 8..64 GPUs of ResNet-152
with the engine the runs use (no second scheduler):

* **compute**: one forward event per compute unit (stem layers, residual blocks, head: the units
  of :func:`models.network.compute_units`) in forward order, then one backward event per unit in
  reverse order, recorded through :class:`substrate.timeline.LayerEvents` exactly as a model with
  a ``recorder`` reports them, timed by a :class:`substrate.timeline.FlopSource`:
  ``seconds = batch x FLOPs per sample / rate`` with backward FLOPs = 2 x forward
  (:data:`models.network.BACKWARD_FLOP_FACTOR`).  The rate is ``--device-tflops``, or, when the
  compute time per sample is given or measured, the rate that reproduces it
  (``rate = (forward + backward FLOPs per sample) / t_s``): the FLOP counts then only distribute
  ``t_s`` over the layers.
* **gradient-ready order**: the backward event of a unit makes its flat-gradient slice ready
  (:meth:`LayerEvents.grads_ready`); a transfer of ``flat[a:b]`` waits for
  :meth:`LayerEvents.ready_event` ``(a, b)``.
* **communication**: every call of the system's plan (the plans its trainer builds:
  :class:`dataparallel.ddp.DDPPlan`, :class:`dataparallel.topk.TopKPlan`,
  :class:`hsadmm.shrink.ShrinkPlan`) is a :meth:`Timeline.transfer` with the dependencies the
  plan dictates (:data:`PLANS`), on the link class the ledger books it on, so its standalone time
  is the cost model's.  Systems without a declared plan have their predicted phases
  (:mod:`commvol.systems`) appended serially after the backward: the clock's rule for
  undeclared communication, never less than the additive clock.
* **memory-bound events** without a FLOP model (Top-K selection and decoding, the optimizer
  update) cost ``bytes / --device-gbs``.

An iteration's time is the timeline's critical path (:attr:`StepTiming.step_s`) and its
no-overlap time the additive clock's sum (:attr:`StepTiming.no_overlap_s`) over the same events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from dataparallel.ddp import DDPPlan
from dataparallel.topk import TopKPlan
from hsadmm.config import read_keep_file
from hsadmm.penalty import penalty_groups
from hsadmm.shrink import ShrinkPlan
from models import MODELS, build_model
from models.network import BACKWARD_FLOP_FACTOR, compute_units
from models.zoo import resnet_layers
from substrate.costmodel import INTER, INTRA, CostModel
from substrate.timeline import FlopSource, LayerEvents, StepTiming, Timeline
from volume.hsadmm import RESIDUALS_PER_LAYER

from .specs import DATASET_SHAPES, MODEL_ALIASES, SPEC_ARCH
from .systems import ITEMSIZE, get_system

__all__ = ["Unit", "ComputeModel", "units_for_spec", "PLANS", "SELECT_PASSES",
           "OPTIMIZER_FLOPS_PER_PARAM", "OPTIMIZER_BYTES_PER_PARAM", "dp_step",
           "admm_iteration", "epoch_timing"]

#: Passes over the ``T`` float32 gradient entries of Top-K's selection (an assumption): error
#: feedback ``acc = residual + g`` (read 2, write 1), a radix select of the per-tensor threshold
#: over ``|acc|`` (2 reads), and the residual update (1 write).  A sort-based selection costs
#: more (``log`` passes).
SELECT_PASSES = 6
#: SGD with momentum and weight decay per parameter: ``d = g + wd θ``, ``v = μ v + d``,
#: ``θ -= lr v`` (6 FLOPs), reading ``θ, g, v`` and writing ``θ, v`` (5 float32).
OPTIMIZER_FLOPS_PER_PARAM = 6
OPTIMIZER_BYTES_PER_PARAM = 5 * ITEMSIZE


@dataclass(frozen=True)
class Unit:
    """A compute unit of the FLOP model: name, its flat-gradient slice ``[lo, hi)`` (backward
    order) and forward/backward FLOPs per sample."""

    name: str
    lo: int
    hi: int
    forward_flops: float
    backward_flops: float


def units_for_spec(spec, model: str, dataset: str = "digits") -> tuple[list[Unit], str]:
    """Per-unit FLOPs of ``spec`` and how they were obtained.

    The ResNet specs (``resnet18``, ``resnet152``, ``wide_resnet50_2``) and the trainable models
    are rebuilt as layer trees (shapes only) and split by :func:`models.network.compute_units`
    (conv/fc ``2 x MACs``, BatchNorm, ReLU, pooling, residual additions).  Other specs
    (transformers, ImageNet variants) have no layer tree here: one unit per parameter tensor, the
    spec's forward FLOPs split in proportion to the tensor sizes (an assumption, stated).
    """
    canon = MODEL_ALIASES.get(model, model)
    root = None
    if canon in SPEC_ARCH and spec.name == canon:
        root = resnet_layers(spec.input_shape, spec.num_classes, **SPEC_ARCH[canon])
    elif model in MODELS and dataset in DATASET_SHAPES:
        shape, classes = DATASET_SHAPES[dataset]
        root = build_model(model, shape, classes).root
    layout = spec.layout
    if root is not None:
        us = compute_units(root, spec.input_shape, ITEMSIZE, layout=layout)
        units = [Unit(u.name, u.lo, u.hi, float(u.forward_flops), float(u.backward_flops))
                 for u in us]
        if sum(u.hi - u.lo for u in units) == layout.total:
            return units, ("per compute unit from the layer tree (models.network.compute_units: "
                           "conv/fc 2 x MACs, BN 7, ReLU 1 per element, ...), backward "
                           f"{BACKWARD_FLOP_FACTOR:g} x forward")
    total = float(spec.flops_per_sample)
    units = []
    for p in spec.params:   # forward order
        lo = layout.offsets[p.name]
        f = total * p.size / layout.total
        units.append(Unit(p.name, lo, lo + p.size, f, BACKWARD_FLOP_FACTOR * f))
    return units, ("no layer tree for this spec: the spec's forward FLOPs split over its "
                   f"{len(units)} parameter tensors in proportion to their sizes, backward "
                   f"{BACKWARD_FLOP_FACTOR:g} x forward")


@dataclass(frozen=True)
class ComputeModel:
    """How long the compute events of one rank take.

    Attributes
    ----------
    units : tuple of Unit
        In forward order.
    rate_tflops : float
        FLOP rate of the layer events (``--device-tflops``, or the rate that reproduces a given
        or measured time per sample).
    device_gbs : float
        Memory bandwidth (GB/s) of the memory-bound events (Top-K selection and decoding, the
        optimizer update).
    """

    units: tuple
    rate_tflops: float
    device_gbs: float

    def __post_init__(self) -> None:
        for name, v in (("--device-tflops (or the compute time per sample)", self.rate_tflops),
                        ("--device-gbs", self.device_gbs)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must give a finite rate > 0, got {v!r}")
        if not self.units:
            raise ValueError("the FLOP model needs at least one compute unit")

    @classmethod
    def from_seconds_per_sample(cls, units, seconds: float, device_gbs: float) -> "ComputeModel":
        """The rate at which forward + backward of one sample takes ``seconds``."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"--compute-s-per-sample must be a finite number > 0, got "
                             f"{seconds!r}")
        flops = sum(u.forward_flops + u.backward_flops for u in units)
        return cls(tuple(units), flops / seconds / 1e12, device_gbs)

    @property
    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample."""
        return float(sum(u.forward_flops + u.backward_flops for u in self.units))

    @property
    def seconds_per_sample(self) -> float:
        return self.flops_per_sample / (self.rate_tflops * 1e12)

    def source(self) -> FlopSource:
        return FlopSource(self.rate_tflops)

    def memory_s(self, nbytes: float) -> float:
        return float(nbytes) / (self.device_gbs * 1e9)

    def optimizer_s(self, num_params: int) -> float:
        """Roofline of the SGD-with-momentum update of ``num_params`` parameters."""
        return max(OPTIMIZER_FLOPS_PER_PARAM * num_params / (self.rate_tflops * 1e12),
                   self.memory_s(OPTIMIZER_BYTES_PER_PARAM * num_params))


@dataclass(frozen=True)
class Context:
    """What a plan declares its communication from."""

    spec: object
    M: int
    P: int
    options: object
    cost: CostModel
    compute: ComputeModel

    @property
    def p(self) -> int:
        return self.M * self.P

    @property
    def world_link(self) -> str:
        """A ring over all ranks crosses nodes (the ledger's ``slowest``) when ``M > 1``."""
        return INTER if self.M > 1 else INTRA

    @property
    def leaders_link(self) -> str:
        return INTER if self.M > 1 else INTRA


# -- data-parallel plans: compute of one step, then the transfers ------------------------------
def _ddp(tl: Timeline, rec: LayerEvents, c: Context) -> None:
    """Dense DDP, ring all-reduce per bucket over all ranks, each bucket starting when the
    backward has written its gradients (PyTorch DDP's overlap; ``dataparallel.ddp.DDP.sync``)."""
    plan = DDPPlan.for_layout(c.spec.layout, c.options, ITEMSIZE)
    for k, (a, b) in enumerate(plan.buckets):
        tl.transfer("grad_allreduce", c.world_link, ITEMSIZE * (b - a), algorithm="allreduce",
                    p=c.p, deps=rec.ready_event(a, b), label=f"grad_allreduce[{k}]")


def _ddp_hierarchical(tl: Timeline, rec: LayerEvents, c: Context) -> None:
    """DDP with the two-level all-reduce per bucket: SUM ring in the node -> leaders' ring ->
    binomial bcast in the node, chained per bucket (``dataparallel.ddp.DDP.sync``)."""
    plan = DDPPlan.for_layout(c.spec.layout, c.options, ITEMSIZE)
    for k, (a, b) in enumerate(plan.buckets):
        n = ITEMSIZE * (b - a)
        ev = tl.transfer("intra_allreduce", INTRA, n, algorithm="allreduce", p=c.P,
                         deps=rec.ready_event(a, b), label=f"intra_allreduce[{k}]")
        ev = tl.transfer("inter_allreduce", c.leaders_link, n, algorithm="allreduce", p=c.M,
                         deps=ev, label=f"inter_allreduce[{k}]")
        tl.transfer("intra_bcast", INTRA, n, algorithm="bcast", p=c.P, deps=ev,
                    label=f"intra_bcast[{k}]")


def _topk(tl: Timeline, rec: LayerEvents, c: Context) -> None:
    """Top-K (DGC): selection over every tensor after the whole backward (compute stream), one
    ring all-gather of ``K`` values + indices per rank, then the scatter-add of the ``p K``
    gathered entries into the dense gradient (``dataparallel.topk.TopK.sync``)."""
    plan = TopKPlan.for_layout(c.spec.layout, c.options)
    T, K = c.spec.layout.total, plan.K
    sel = tl.compute("topk_select", c.compute.memory_s(SELECT_PASSES * ITEMSIZE * T),
                     deps=rec.ready_event(0, T))
    ag = tl.transfer("topk_allgather", c.world_link, c.p * 8 * K, algorithm="allgather",
                     p=c.p, deps=sel)
    tl.compute("topk_decode", c.compute.memory_s(c.p * 8 * K + ITEMSIZE * T), deps=ag)


@lru_cache(maxsize=8)
def _shrink_plan(spec, options) -> tuple[ShrinkPlan, int]:
    """The solver's shrink plan for keep-rate masks and the penalty-group count (cached: the
    plan of ResNet-152 takes seconds and does not depend on the GPU count)."""
    plan = ShrinkPlan.from_keep_rates(spec.layout, options, read_keep_file(options.keep_file))
    return plan, len(penalty_groups(spec.layout, options.rho_scope)[0])


def _hsadmm(tl: Timeline, local, c: Context) -> None:
    """H-SADMM (PruneX Algorithm 1) after local training: dense intra-node all-reduce of
    ``θ + u`` (line 9) -> [mask OR-sync and bcast while not frozen] -> compact inter-node
    all-reduce per bucket (line 23) -> bcast of ``z`` in the node (line 24) -> residual norms
    (world), chained as the solver calls them (the shrink plan of ``predict_hsadmm``)."""
    o = c.options
    T = c.spec.layout.total
    plan, L = _shrink_plan(c.spec, o)
    ev = tl.transfer("intra_allreduce", INTRA, ITEMSIZE * T, algorithm="allreduce", p=c.P,
                     deps=local)
    if not o.freeze_iter:   # masks synchronized every iteration (never frozen)
        ev = tl.transfer("mask_sync", c.leaders_link, plan.mask_bytes, algorithm="allreduce",
                         p=c.M, deps=ev)
        ev = tl.transfer("mask_bcast", INTRA, plan.mask_bytes, algorithm="bcast", p=c.P,
                         deps=ev)
    inter = [tl.transfer("inter_allreduce", c.leaders_link, ITEMSIZE * (b - a),
                         algorithm="allreduce", p=c.M, deps=ev, label=f"inter_allreduce[{k}]")
             for k, (a, b) in enumerate(plan.buckets)]
    C = sum(b - a for a, b in plan.buckets)
    ev = tl.transfer("bcast_z", INTRA, ITEMSIZE * C, algorithm="bcast", p=c.P, deps=inter)
    tl.transfer("residuals", c.world_link, 8 * RESIDUALS_PER_LAYER * L, algorithm="allreduce",
                p=c.p, deps=ev)


def _flat_admm(tl: Timeline, local, c: Context) -> None:
    """Flat consensus ADMM (PruneX (AR)): one dense world all-reduce of ``θ + u``, then the
    residual norms."""
    T = c.spec.layout.total
    L = len(penalty_groups(c.spec.layout, c.options.rho_scope)[0])
    ev = tl.transfer("world_allreduce", c.world_link, ITEMSIZE * T, algorithm="allreduce",
                     p=c.p, deps=local)
    tl.transfer("residuals", c.world_link, 8 * RESIDUALS_PER_LAYER * L, algorithm="allreduce",
                p=c.p, deps=ev)


@dataclass(frozen=True)
class Plan:
    """How a system's iteration is laid on the timeline: ``kind`` ``"dp"`` (one optimizer step:
    forward, backward, ``declare(tl, rec, ctx)``, update) or ``"admm"`` (local epochs of SGD,
    then ``declare(tl, local_event, ctx)``)."""

    kind: str
    declare: Callable
    overlap: str


#: Systems whose communication is declared call by call with its dependencies.
PLANS = {
    "ddp": Plan("dp", _ddp, "buckets all-reduced as soon as the backward has written them"),
    "ddp-hierarchical": Plan("dp", _ddp_hierarchical, "per bucket intra -> inter -> bcast, "
                             "each bucket as soon as the backward has written it"),
    "topk": Plan("dp", _topk, "none: selection after the whole backward, then the all-gather"),
    "hsadmm": Plan("admm", _hsadmm, "none: consensus phases chained after local training"),
    "flat-admm": Plan("admm", _flat_admm, "none: world all-reduce after local training"),
}


def _serial_predicted(tl: Timeline, after, system: str, c: Context) -> None:
    """A system without a plan here: its predicted steady phases (``commvol.systems``), one
    transfer each, serially after ``after`` (the clock's rule for undeclared communication)."""
    sm = get_system(system)
    pred = sm.predict(c.spec, c.M, c.P, c.options, c.cost) if sm.Assumptions is None else \
        sm.predict(c.spec, c.M, c.P, c.options, c.cost, None)
    it = pred.steady
    ev = after
    for phase, secs in it.modeled_s.items():
        link = INTER if it.phases.get(phase, {}).get(INTER, 0) else INTRA
        ev = tl.transfer_seconds(phase, link, 0.0, float(secs), deps=ev,
                                 label=f"{phase} (serial)")


def _check(M: int, P: int, batch) -> None:
    for name, v in (("nodes", M), ("--gpus-per-node", P)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not (isinstance(batch, (int, float)) and math.isfinite(batch) and batch > 0):
        raise ValueError(f"--batch-size must be > 0 samples, got {batch!r}")


def dp_step(system: str, spec, M: int, P: int, options, cost: CostModel,
            compute: ComputeModel, batch: float, keep_events: bool = False) -> StepTiming:
    """Schedule one data-parallel optimizer step of ``batch`` samples on one rank."""
    _check(M, P, batch)
    tl = Timeline(cost, keep_events=keep_events, keep_steps=0)
    rec = LayerEvents(tl, compute.source())
    for u in compute.units:
        with rec.layer("forward", u.name, batch * u.forward_flops):
            pass
    for u in reversed(compute.units):
        with rec.layer("backward", u.name, batch * u.backward_flops):
            pass
        rec.grads_ready(u.name, u.lo, u.hi)
    ctx = Context(spec, M, P, options, cost, compute)
    plan = PLANS.get(system)
    if plan is None:
        _serial_predicted(tl, rec.last, system, ctx)
    elif plan.kind != "dp":
        raise ValueError(f"--system {system} is not data-parallel; use admm_iteration")
    else:
        plan.declare(tl, rec, ctx)
    tl.compute("optimizer", compute.optimizer_s(spec.layout.total),
               deps=[e for e in tl.open_events if e.kind != "compute"] or None)
    return tl.step()


def _batches(samples_per_rank: float, batch: int) -> tuple[int, float]:
    """``(steps, samples of the last step)`` of one pass over a shard (last batch partial)."""
    steps = max(1, math.ceil(samples_per_rank / batch - 1e-12))
    return steps, samples_per_rank - (steps - 1) * batch


def admm_iteration(system: str, spec, M: int, P: int, options, cost: CostModel,
                   compute: ComputeModel, samples_per_rank: float, batch: int,
                   keep_events: bool = False) -> StepTiming:
    """Schedule one outer ADMM iteration on one rank: ``local_epochs`` passes of local SGD over
    the shard (one compute event per epoch, the last batch partial), then the consensus
    communication of :data:`PLANS`."""
    _check(M, P, batch)
    plan = PLANS[system]
    if plan.kind != "admm":
        raise ValueError(f"--system {system} is data-parallel; use dp_step")
    E = float(options.local_epochs)
    steps, _ = _batches(samples_per_rank, batch)
    epoch_s = (samples_per_rank * compute.seconds_per_sample
               + steps * compute.optimizer_s(spec.layout.total))
    tl = Timeline(cost, keep_events=keep_events, keep_steps=0)
    ev, left, k = None, E, 0
    while left > 1e-12:
        frac = min(1.0, left)
        ev = tl.compute(f"local SGD epoch {k + 1}", frac * epoch_s, deps=ev)
        left -= frac
        k += 1
    plan.declare(tl, ev, Context(spec, M, P, options, cost, compute))
    return tl.step()


def epoch_timing(system: str, spec, M: int, P: int, options, cost: CostModel,
                 compute: ComputeModel, samples_per_rank: float, batch: int) -> dict:
    """Time of one pass over the data (strong scaling: ``samples_per_rank = D / p``) on the
    timeline and its no-overlap sum.

    Data parallel: ``steps = ceil(samples / batch)`` optimizer steps, the last one on the
    remaining samples.  ADMM: one outer iteration divided by ``local_epochs``.

    Returns ``{iterations_per_epoch, step_s, no_overlap_step_s, time_s, no_overlap_time_s,
    compute_s, comm_s, exposed_comm_s}`` (``step_s``: one full-batch step, or one outer
    iteration).
    """
    keys = ("step_s", "no_overlap_s", "compute_s", "offload_s", "comm_s", "exposed_comm_s")
    plan = PLANS.get(system)
    if plan is not None and plan.kind == "admm":
        t = admm_iteration(system, spec, M, P, options, cost, compute, samples_per_rank, batch)
        E = float(options.local_epochs)
        tot = {k: getattr(t, k) / E for k in keys}
        units, one = 1.0 / E, t
    else:
        steps, last = _batches(samples_per_rank, batch)
        full = dp_step(system, spec, M, P, options, cost, compute, batch)
        tail = full if last == batch else dp_step(system, spec, M, P, options, cost, compute,
                                                  last)
        tot = {k: (steps - 1) * getattr(full, k) + getattr(tail, k) for k in keys}
        units, one = float(steps), full
    return {"iterations_per_epoch": units, "step_s": one.step_s,
            "no_overlap_step_s": one.no_overlap_s, "step_exposed_comm_s": one.exposed_comm_s,
            "time_s": tot["step_s"], "no_overlap_time_s": tot["no_overlap_s"],
            "compute_s": tot["compute_s"] + tot["offload_s"], "comm_s": tot["comm_s"],
            "exposed_comm_s": tot["exposed_comm_s"]}
