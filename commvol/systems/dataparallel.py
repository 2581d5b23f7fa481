"""Dense DDP (flat, two-level) and Top-K/DGC predictions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dataparallel.ddp import DDPOptions, DDPPlan
from dataparallel.topk import TopKOptions, TopKPlan
from substrate.calls import Placement
from substrate.options import option

from .core import (
    ITEMSIZE,
    IterCost,
    Prediction,
    SystemModel,
    _check_topology,
    register,
)

__all__ = ["DPAssumptions", "predict_ddp", "predict_ddp_hierarchical", "predict_topk"]


@dataclass(frozen=True)
class DPAssumptions:
    """What a data-parallel prediction assumes beyond the strategy's options."""

    steps_per_iter: int = option(
        1, "data-parallel optimizer steps per iteration: 1 = one synchronization of the model "
        "per iteration (PruneX Fig. 6b's Dense DDP), or the steps of the local epochs of one "
        "ADMM iteration (ceil(samples per rank / batch) x local epochs)",
        flag="--ddp-steps-per-iter")

    def __post_init__(self) -> None:
        if not isinstance(self.steps_per_iter, (int, np.integer)) or self.steps_per_iter < 1:
            raise ValueError(f"--ddp-steps-per-iter must be an integer >= 1, got "
                             f"{self.steps_per_iter}")



# ---------------------------------------------------------------------------------------------
# data parallel: DDP (ring / hierarchical), Top-K
# ---------------------------------------------------------------------------------------------
def _unit(steps: int) -> str:
    return f"{steps} step" + ("s" if steps > 1 else "")


def _predict_ddp(spec, nodes, gpus_per_node, options: DDPOptions, cost,
                 assumptions: DPAssumptions | None) -> Prediction:
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    placement = Placement.node_major(M, P)
    plan = DDPPlan.for_layout(spec.layout, options, ITEMSIZE)
    T = spec.layout.total
    step = IterCost.from_calls(plan.calls(placement), placement, cost, ITEMSIZE * T,
                               ITEMSIZE * T)
    if options.allreduce == "hierarchical":
        name = "ddp-hierarchical"
        how = "per bucket: SUM ring all-reduce in each node, leaders' ring, binomial bcast"
    else:
        name = "ddp"
        how = "per bucket: one ring all-reduce over all ranks (node-major)"
    s = (assumptions or DPAssumptions()).steps_per_iter
    notes = (f"{len(plan.buckets)} gradient bucket(s) of <= {options.bucket_mib:g} MiB; {how}",
             f"one iteration = {_unit(s)} (--ddp-steps-per-iter {s})")
    return Prediction(name, spec.name, M, P, _unit(s), ((None, step.times(s)),), notes=notes,
                      num_params=T)


def predict_ddp(spec, nodes, gpus_per_node, options: DDPOptions, cost=None,
                assumptions: DPAssumptions | None = None) -> Prediction:
    """Dense DDP with a ring all-reduce per bucket (:func:`volume.dataparallel.ddp_step_bytes`)."""
    if options.allreduce != "ring":
        raise ValueError("--system ddp is the ring all-reduce; use --system ddp-hierarchical")
    return _predict_ddp(spec, nodes, gpus_per_node, options, cost, assumptions)


def predict_ddp_hierarchical(spec, nodes, gpus_per_node, options: DDPOptions, cost=None,
                             assumptions: DPAssumptions | None = None) -> Prediction:
    """DDP with the two-level all-reduce (:func:`volume.dataparallel.hierarchical_step_bytes`)."""
    options = dataclasses.replace(options, allreduce="hierarchical")
    return _predict_ddp(spec, nodes, gpus_per_node, options, cost, assumptions)


def predict_topk(spec, nodes, gpus_per_node, options: TopKOptions, cost=None,
                 assumptions: DPAssumptions | None = None) -> Prediction:
    """Top-K: ring all-gather of ``K`` values + indices (:func:`volume.dataparallel.topk_k`,
    :func:`volume.dataparallel.topk_step_bytes`)."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    placement = Placement.node_major(M, P)
    layout = spec.layout
    plan = TopKPlan.for_layout(layout, options)
    K = plan.K
    step = IterCost.from_calls(plan.calls(placement), placement, cost, 8 * K,
                               ITEMSIZE * layout.total)
    s = (assumptions or DPAssumptions()).steps_per_iter
    notes = ((f"K = sum_l max(1, ceil({options.density:g} n_l)) = {K} of {layout.total} "
             f"(float32 value + int32 index each: payload ratio {2 * K / layout.total:.4f})"),
             f"one iteration = {_unit(s)} (--ddp-steps-per-iter {s})")
    return Prediction("topk", spec.name, M, P, _unit(s), ((None, step.times(s)),), notes=notes,
                      num_params=layout.total)


register(SystemModel("ddp", predict_ddp, DDPOptions, Assumptions=DPAssumptions,
                     description="dense DDP, ring all-reduce per bucket"))
register(SystemModel("ddp-hierarchical", predict_ddp_hierarchical, DDPOptions,
                     Assumptions=DPAssumptions,
                     description="dense DDP, two-level all-reduce per bucket"))
register(SystemModel("topk", predict_topk, TopKOptions, Assumptions=DPAssumptions,
                     description="Top-K (DGC) gradient sparsification, all-gather"))


