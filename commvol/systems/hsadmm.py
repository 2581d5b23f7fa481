"""H-SADMM and flat consensus ADMM (PruneX): predictions priced from the solver's own records.

The options are the solver's :class:`hsadmm.config.HSADMMConfig` (``flat-admm``) and
:class:`HSADMMAssumptions` (``hsadmm``: the config plus one prediction-only input, a run's
measured compact sizes).  The shrink plan is :meth:`hsadmm.shrink.ShrinkPlan.from_keep_rates`,
the plan the solver builds (:meth:`~hsadmm.shrink.ShrinkPlan.for_layout`) for masks with the
support sizes eq. 10 keeps; every number comes from the records of one iteration
(:meth:`hsadmm.plan.HSADMMPlan.calls`, :meth:`hsadmm.plan.FlatADMMPlan.calls`: what the solver
executes) priced by :meth:`IterCost.from_calls`, one stage per kind of iteration (masks
synchronized, masks frozen, or one per measured compact size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hsadmm.config import HSADMMConfig, read_keep_file
from hsadmm.penalty import penalty_groups
from hsadmm.plan import RESIDUAL_ROWS, FlatADMMPlan, HSADMMPlan
from hsadmm.shrink import ShrinkPlan, keep_rate_mask
from substrate.calls import Placement
from substrate.costmodel import CostModel
from substrate.options import option

from .core import (
    ITEMSIZE,
    IterCost,
    Prediction,
    SystemModel,
    _admm_units_per_epoch,
    _check_topology,
    _int_list,
    register,
)

__all__ = ["HSADMMAssumptions", "keep_rate_mask", "predict_flat_admm", "predict_hsadmm"]


@dataclass(frozen=True)
class HSADMMAssumptions:
    """What only a prediction needs beside the solver's options: a run's measured compact sizes
    (the OR of eq. 14 over the nodes' masks can keep more than keep-rate masks)."""

    compact_elems: tuple | None = option(
        None, "H-SADMM: measured compact elements per iteration (a run's metrics.jsonl "
              "compact_elems, comma-separated) instead of keep-rate masks", type=_int_list,
        group="H-SADMM prediction")

    def __post_init__(self) -> None:
        if self.compact_elems is not None:
            ce = _int_list(self.compact_elems)
            if not ce or min(ce) < 1:
                raise ValueError("--compact-elems needs positive integers, one per iteration")
            object.__setattr__(self, "compact_elems", ce)


def _stage(plan: HSADMMPlan, placement: Placement, cost, synced: bool) -> IterCost:
    """One iteration priced from its records; payload: one leader's compact buffer."""
    return IterCost.from_calls(plan.calls(placement, mask_synced=synced), placement, cost,
                               ITEMSIZE * plan.compact_size, ITEMSIZE * plan.total)


def predict_hsadmm(spec, nodes: int, gpus_per_node: int, options: HSADMMConfig,
                   cost: CostModel | None = None,
                   assumptions: HSADMMAssumptions | None = None) -> Prediction:
    """H-SADMM (PruneX Algorithm 1): the records of :class:`hsadmm.plan.HSADMMPlan` with the
    buckets of the solver's shrink plan for keep-rate masks (eq. 15), or with a run's measured
    compact sizes split over those buckets; one stage while masks are synchronized, one after
    the freeze."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    placement = Placement.node_major(M, P)
    overrides = read_keep_file(options.keep_file)
    shrink = ShrinkPlan.from_keep_rates(spec.layout, options, overrides)
    L = len(penalty_groups(spec.layout, options.rho_scope)[0])
    plan = HSADMMPlan.from_shrink(shrink, L)
    T = spec.layout.total
    fz = options.freeze_iter
    notes = [(f"compact [K_out, K_in] slices of eq. 15 from keep-rate masks ({options.sparsity}, "
              f"keep {options.keep}): compact/dense = {shrink.compact_size}/{shrink.dense_size} "
              f"= {shrink.ratio:.4f} (conv layers pruned; FC, BN and biases travel whole)"),
             "all nodes agree on the masks (the OR of eq. 14 keeps nothing extra)",
             f"masks synchronized in iterations 0..{fz - 1}, frozen after" if fz
             else "masks never frozen (synchronized every iteration)",
             f"{len(plan.bucket_sizes)} compact bucket(s) of <= {options.bucket_mib:g} MiB",
             (f"residuals: {RESIDUAL_ROWS} float64 per penalty group ({L} groups, "
              f"--rho-scope {options.rho_scope})"),
             ("PruneX Fig. 6 reports compact ~ 0.40 of dense at keep 0.5 (ResNet-18/152, "
              "WRN-50-2); eq. 15 with per-layer masks gives 0.50 at keep 0.5 and 0.40 at keep "
              "0.4 (channel), which reproduces Fig. 6b's totals (e.g. ResNet-152 13.00 -> "
              "5.21 GiB)")]

    def one(synced, p=plan):
        return _stage(p, placement, cost, synced)

    compact_elems = (assumptions or HSADMMAssumptions()).compact_elems
    if compact_elems is not None:
        nb = len(plan.bucket_sizes)
        stages = []
        for k, c in enumerate(compact_elems):
            bk = tuple(n for n in (int(c) // nb + (1 if j < int(c) % nb else 0)
                                   for j in range(nb)) if n)
            stages.append((1, one(not fz or k < fz, dataclasses.replace(plan, bucket_sizes=bk))))
        notes[0] = (f"compact sizes given per iteration ({len(stages)} values; the last repeats); "
                    f"split over the keep-rate plan's {nb} bucket(s) for messages and time")
        notes[1] = "measured compact sizes include the OR of the nodes' masks (eq. 14)"
    elif fz:
        stages = [(fz, one(True)), (None, one(False))]
    else:
        stages = [(None, one(True))]
    return Prediction("hsadmm", spec.name, M, P, "iteration", tuple(stages), notes=tuple(notes),
                      num_params=T)


def predict_flat_admm(spec, nodes: int, gpus_per_node: int, options: HSADMMConfig,
                      cost: CostModel | None = None) -> Prediction:
    """Flat consensus ADMM: the records of :class:`hsadmm.plan.FlatADMMPlan`, one dense world
    all-reduce of ``θ + u`` and the residuals per iteration; every rank projects the same ``z``,
    so masks cost nothing on the wire."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    placement = Placement.node_major(M, P)
    T = spec.layout.total
    L = len(penalty_groups(spec.layout, options.rho_scope)[0])
    plan = FlatADMMPlan(T, L, ITEMSIZE)
    it = IterCost.from_calls(plan.calls(placement), placement, cost, ITEMSIZE * T,
                             ITEMSIZE * T)
    return Prediction("flat-admm", spec.name, M, P, "iteration", ((None, it),),
                      notes=("dense world all-reduce of theta+u, no hierarchy, no shrinkage",),
                      num_params=T)


register(SystemModel("hsadmm", predict_hsadmm, HSADMMConfig, Assumptions=HSADMMAssumptions,
                     description="PruneX H-SADMM: intra all-reduce, mask OR-sync, compact "
                                 "inter-node all-reduce, bcast",
                     units_per_epoch=_admm_units_per_epoch, loop="admm"))
register(SystemModel("flat-admm", predict_flat_admm, HSADMMConfig,
                     description="flat consensus ADMM (PruneX (AR)): dense world all-reduce",
                     units_per_epoch=_admm_units_per_epoch, loop="admm"))
