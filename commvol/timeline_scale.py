"""One iteration of each system on the event timeline, at paper scale (``commvol scale``).

The trainers' simulated clock schedules a step of one rank on a
:class:`substrate.timeline.Timeline`; this module declares the same kind of step without running
anything, from a shape-only model spec, so that ``commvol scale`` times 8..64 GPUs of ResNet-152
with the engine the runs use (no second scheduler):

* **compute**: one forward event per compute unit (stem layers, residual blocks, head: the units
  of :func:`models.network.compute_units`) in forward order, then one backward event per unit in
  reverse order, recorded through :class:`substrate.compute.LayerEvents` exactly as a model with
  a ``recorder`` reports them, timed by a :class:`substrate.compute.FlopSource`:
  ``seconds = batch x FLOPs per sample / rate`` with backward FLOPs = 2 x forward
  (:data:`models.network.BACKWARD_FLOP_FACTOR`).  The rate is ``--device-tflops``, or, when the
  compute time per sample is given or measured, the rate that reproduces it
  (``rate = (forward + backward FLOPs per sample) / t_s``): the FLOP counts then only distribute
  ``t_s`` over the layers.
* **gradient-ready order**: the backward event of a unit makes its flat-gradient slice ready
  (:meth:`LayerEvents.grads_ready`); a transfer of ``flat[a:b]`` waits for
  :meth:`LayerEvents.ready_event` ``(a, b)``.
* **communication**: the records of the system's plan, the ones its trainer executes
  (``plan.calls()``, carried by the prediction: :attr:`commvol.systems.core.IterCost.calls`),
  laid on rank 0's timeline by the one generic rule :func:`substrate.calls.declare`: each call
  after what its ``after`` names (the backward event that writes its gradients, the previous
  call on its stream, the local epochs of an ADMM iteration), on the link class the ledger books
  it on, so its standalone time is the cost model's.  Nothing here knows a system.
* **compute items of the plan** (:class:`substrate.calls.Work`: Top-K's selection and decoding)
  and the optimizer update cost their roofline (``max(FLOPs / rate, bytes / --device-gbs)``).

An iteration's time is the timeline's critical path (:attr:`StepTiming.step_s`) and its
no-overlap time the additive clock's sum (:attr:`StepTiming.no_overlap_s`) over the same events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from models import MODELS, build_model
from models.network import BACKWARD_FLOP_FACTOR, compute_units
from models.zoo import resnet_layers
from substrate.calls import Ready, declare
from substrate.compute import FlopSource, LayerEvents
from substrate.costmodel import CostModel
from substrate.timeline import StepTiming, Timeline

from .specs import DATASET_SHAPES, MODEL_ALIASES, SPEC_ARCH
from .systems import ITEMSIZE, get_system
from .systems.core import IterCost

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "OPTIMIZER_FLOPS_PER_PARAM",
    "ComputeModel",
    "Unit",
    "admm_iteration",
    "dp_step",
    "epoch_timing",
    "units_for_spec",
]

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
    def from_seconds_per_sample(cls, units, seconds: float, device_gbs: float) -> ComputeModel:
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

    def work_s(self, flops: float, nbytes: float) -> float:
        """Roofline of a plan's compute item (:class:`substrate.calls.Work`)."""
        return max(float(flops) / (self.rate_tflops * 1e12), self.memory_s(nbytes))

    def optimizer_s(self, num_params: int) -> float:
        """Roofline of the SGD-with-momentum update of ``num_params`` parameters."""
        return max(OPTIMIZER_FLOPS_PER_PARAM * num_params / (self.rate_tflops * 1e12),
                   self.memory_s(OPTIMIZER_BYTES_PER_PARAM * num_params))


def _step_records(system: str, spec, M: int, P: int, options, cost: CostModel) -> IterCost:
    """The steady iteration of ``system``'s prediction on ``M`` x ``P`` ranks, node-major: its
    priced records (:attr:`commvol.systems.core.IterCost.calls`, the plan's ``calls()``)."""
    sm = get_system(system)
    pred = sm.predict(spec, M, P, options, cost) if sm.Assumptions is None else \
        sm.predict(spec, M, P, options, cost, None)
    it = pred.steady
    if not it.calls:
        raise ValueError(f"--system {system}: its prediction carries no call records")
    return it


def _declare(tl: Timeline, it: IterCost, compute: ComputeModel, resolve) -> list:
    """Lay the records of rank 0 (a node leader: it takes part in, or waits for, every phase)
    on ``tl`` (:func:`substrate.calls.declare`); compute items cost their roofline."""
    return declare(tl, it.calls, it.placement, 0, resolve=resolve,
                   work=lambda w: compute.work_s(w.flops, w.nbytes))


def _check(M: int, P: int, batch) -> None:
    for name, v in (("nodes", M), ("--gpus-per-node", P)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not (isinstance(batch, (int, float)) and math.isfinite(batch) and batch > 0):
        raise ValueError(f"--batch-size must be > 0 samples, got {batch!r}")


def dp_step(system: str, spec, M: int, P: int, options, cost: CostModel,
            compute: ComputeModel, batch: float, keep_events: bool = False) -> StepTiming:
    """Schedule one data-parallel optimizer step of ``batch`` samples on one rank: the layers'
    forward and backward events, the plan's records (each call after the backward event that
    writes its gradients, :class:`substrate.calls.Ready`), then the update after every
    transfer."""
    _check(M, P, batch)
    sm = get_system(system)
    if sm.loop != "dp":
        raise ValueError(f"--system {system} is not data-parallel; use admm_iteration")
    it = _step_records(system, spec, M, P, options, cost)
    tl = Timeline(cost, keep_events=keep_events, keep_steps=0)
    rec = LayerEvents(tl, compute.source())
    for u in compute.units:
        with rec.layer("forward", u.name, batch * u.forward_flops):
            pass
    for u in reversed(compute.units):
        with rec.layer("backward", u.name, batch * u.backward_flops):
            pass
        rec.grads_ready(u.name, u.lo, u.hi)

    def resolve(token):
        if isinstance(token, Ready):
            return rec.ready_event(token.lo, token.hi)
        raise ValueError(f"--system {system}: a data-parallel record waits for {token!r}")

    _declare(tl, it, compute, resolve)
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
    the shard (one compute event per epoch, the last batch partial), then the plan's consensus
    records after it (the token ``"local"``)."""
    _check(M, P, batch)
    if get_system(system).loop != "admm":
        raise ValueError(f"--system {system} is data-parallel; use dp_step")
    it = _step_records(system, spec, M, P, options, cost)
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

    def resolve(token):
        if token == "local":
            return ev
        raise ValueError(f"--system {system}: an ADMM record waits for {token!r}")

    _declare(tl, it, compute, resolve)
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
    if get_system(system).loop == "admm":
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
