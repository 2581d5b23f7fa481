"""SDP predictions (paper 003) from the run's own plan, :meth:`dataparallel.sdp.SDPPlan.for_model`.

``SystemModel.Options`` is the strategy's :class:`~dataparallel.sdp.SDPOptions`; the two run
settings SDP's traffic also depends on and that are not SDP options, the run seed (block order)
and the trainer's ``--eval-every`` (every evaluation assembles the model on rank 0), are
:class:`SDPAssumptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataparallel.sdp import BCAST, GATED, SDPOptions, SDPPlan
from models import MODELS, build_model
from models.specs import SPEC_LAYERS, spec_layers
from substrate.calls import Call, Placement, price
from substrate.options import option

from ..specs import SPEC_ARCH, build_trainable
from .core import ITEMSIZE, IterCost, Prediction, SystemModel, _check_topology, register

__all__ = ["SDPAssumptions", "predict_sdp", "sdp_plan"]


@dataclass(frozen=True)
class SDPAssumptions:
    """What an SDP prediction takes from the run beyond :class:`SDPOptions`."""

    seed: int = option(0, "run seed (SDP: block order)", cli=False)  # predict's own --seed
    eval_every: int = option(
        0, "SDP: the trainer's --eval-every; every evaluation assembles the full model on rank "
           "0 (after every eval-every-th step and after the last). 0 here: after the last step "
           "only (the trainer's 0 means once per epoch: pass ceil(shard / batch-size))")

    def __post_init__(self) -> None:
        if not isinstance(self.eval_every, (int, np.integer)) or self.eval_every < 0:
            raise ValueError(f"--eval-every must be an integer >= 0 (steps between evaluations; "
                             f"0: only after the last step), got {self.eval_every!r}")


@dataclass(frozen=True)
class _ShapeModel:
    """What SDP's plan reads of a model (:func:`dataparallel.sdp.plan_masks`): the layer tree,
    the flat layout and the buffers (none in a transformer), nothing allocated; the planning
    model of a paper-scale transformer spec (LLaMA-134M, Swin-T, ...)."""

    name: str
    root: object
    layout: object
    buffers: dict


def _planning_model(spec):
    """The model of ``spec``'s name whose layer tree SDP's masks follow (a shape-only spec
    lacks one): the trainable model of a CIFAR ResNet or of the trainers, the declared layer
    tree of a transformer spec (:func:`models.specs.spec_layers`); its layout must be the
    spec's."""
    if spec.name in SPEC_ARCH:
        model = build_trainable(spec.name)
    elif spec.name in MODELS:
        model = build_model(spec.name, spec.input_shape, spec.num_classes)
    elif spec.name in SPEC_LAYERS:
        model = _ShapeModel(spec.name, spec_layers(spec.name), spec.layout, {})
    else:
        names = sorted(set(MODELS) | set(SPEC_ARCH) | set(SPEC_LAYERS))
        raise ValueError(f"--system sdp plans its masks on the model's layers; model "
                         f"{spec.name!r} has none: use one of {names}")
    if [(n, model.layout.shape(n)) for n in model.layout.names] != \
            [(n, spec.layout.shape(n)) for n in spec.layout.names]:
        raise ValueError(f"model {spec.name!r} built from its name does not match the given "
                         "spec; pass the spec of the trainer's model (resolve_model)")
    return model


def sdp_plan(spec, nodes: int, gpus_per_node: int, options: SDPOptions,
             seed: int = 0) -> SDPPlan:
    """The plan the strategy builds for ``spec``'s model on ``nodes`` x ``gpus_per_node``."""
    return SDPPlan.for_model(_planning_model(spec), nodes, gpus_per_node, options, seed)


def predict_sdp(spec, nodes, gpus_per_node, options: SDPOptions, cost=None,
                assumptions: SDPAssumptions | None = None) -> Prediction:
    """SDP: per step a ring all-reduce of every holder set of the plan on its own
    sub-communicator, B_b-SDP's parameter broadcasts and, at the trainer's evaluations (after
    every ``eval_every``-th step and the last; 0: the last only), the assembly of the model on
    rank 0 -- the records of :meth:`~dataparallel.sdp.SDPPlan.calls` (and
    :meth:`~dataparallel.sdp.SDPPlan.assembly_calls`), built exactly as the run builds them
    (``assumptions.seed``: the run seed), priced by the generic rule: every rank's time is
    the sum of its own calls' (:attr:`IterCost.rank_s`)."""
    _check_topology(nodes, gpus_per_node)
    assumptions = assumptions or SDPAssumptions()
    seed, eval_every = assumptions.seed, assumptions.eval_every
    M, P = nodes, gpus_per_node
    placement = Placement.node_major(M, P)
    plan = sdp_plan(spec, M, P, options, seed)
    T, counts = plan.total, plan.counts

    held = ITEMSIZE * sum(int(counts[s] * plan.degrees[s]) for s in plan.reduce_sets)
    step = IterCost.from_calls(plan.calls(placement, ITEMSIZE), placement, cost,
                               round(held / plan.n), ITEMSIZE * T)
    senders = plan.assemble_counts
    evaluation = None
    if senders:
        evaluation = IterCost.from_calls(plan.assembly_calls(placement, ITEMSIZE), placement,
                                         cost)
    hist = ", ".join(f"{c:,} on {d}" for d, c in plan.degree_histogram().items())
    what = (f"coverage {plan.coverage} (every masked parameter on p = {plan.detail['p']} of "
            f"n = {plan.n}: {', '.join(plan.detail['masked'])})" if plan.mode == "neuron" else
            f"{plan.detail['b']}/{plan.detail['d']} residual blocks per worker, block degrees "
            f"{plan.detail['block_degrees']} (order from --seed {seed})")
    gated_wire, bcast_wire = (sum(step.phases.get(ph, {}).values()) for ph in (GATED, BCAST))
    ddp = price([Call("ddp", "allreduce", placement.world, ITEMSIZE * T, ITEMSIZE)], placement)
    ddp_wire = ddp.intra + ddp.inter
    notes = [(f"--sdp-mode {plan.mode}: {what}; degrees: {hist} parameters "
              f"(realized coverage {float(plan.coverage_realized):.4f}); "
              f"plan of dataparallel.sdp.SDPPlan.for_model"),
             f"{len(plan.reduce_sets)} holder set(s) with >= 2 holders, each one ring all-reduce "
             f"of its coordinates on its own sub-communicator per step (gated average): "
             f"{gated_wire:,} wire bytes"
             + (f" = {gated_wire / ddp_wire:.4f} of DDP's world ring" if ddp_wire else ""),
             "payload / sender: mean bytes a rank feeds into the gated all-reduces"]
    if plan.bcast_groups:
        notes.append(f"B_b-SDP: {len(plan.bcast_groups)} binomial broadcast(s) per step of the "
                     f"updated parameters from each set's lowest holder to its non-holders: "
                     f"{bcast_wire:,} wire bytes"
                     + (f"; with the gated average {(gated_wire + bcast_wire) / ddp_wire:.4f} "
                        f"of DDP's" if ddp_wire else ""))
    if evaluation is not None:
        when = (f"every {eval_every} step(s) and after the last" if eval_every
                else "after the last step only (--eval-every 0)")
        notes.append(f"evaluation: {len(senders)} rank(s) send rank 0 the parameters and "
                     f"BatchNorm statistics it lacks (one message each), {when}")
    elif plan.mode != "block-backward":
        notes.append("evaluation: rank 0 holds every coordinate, no assembly")
    notes.append(f"--flop-match multiplies the steps by f = {float(plan.flop_factor()):.4f}, not "
                 "a step's traffic: pass --iters accordingly")
    notes.append("modeled time: busiest rank over all phases (ranks sit in different holder "
                 "sets)")
    return Prediction("sdp", spec.name, M, P, "1 step", ((None, step),), notes=tuple(notes),
                      num_params=T, evaluation=evaluation, eval_every=eval_every)


register(SystemModel("sdp", predict_sdp, SDPOptions, Assumptions=SDPAssumptions,
                     description="SDP: gated all-reduce of every holder set on its own "
                                 "sub-communicator (+ B_b-SDP bcast, evaluation assembly)"))
