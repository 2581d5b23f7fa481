"""H-SADMM and flat consensus ADMM (PruneX): predictions from the solver's own shrink plan.

The options are the solver's :class:`hsadmm.config.HSADMMConfig` (``flat-admm``) and
:class:`HSADMMAssumptions` (``hsadmm``: the config plus one prediction-only input, a run's
measured compact sizes).  The plan is :meth:`hsadmm.shrink.ShrinkPlan.from_keep_rates`, the
plan the solver builds (:meth:`~hsadmm.shrink.ShrinkPlan.for_layout`) for masks with the support
sizes eq. 10 keeps; the bytes come from :func:`volume.hsadmm.hsadmm_iteration_bytes` with that
plan's buckets, as the run's ``predicted`` block does.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsadmm.config import HSADMMConfig, read_keep_file
from hsadmm.penalty import penalty_groups
from hsadmm.shrink import ShrinkPlan, keep_rate_mask
from substrate.costmodel import CostModel
from substrate.options import option
from volume.hsadmm import RESIDUALS_PER_LAYER, flat_admm_iteration_bytes, hsadmm_iteration_bytes

from .core import (
    ITEMSIZE,
    CallCost,
    IterCost,
    Prediction,
    SystemModel,
    _admm_units_per_epoch,
    _check_topology,
    _int_list,
    register,
)

__all__ = ["HSADMMAssumptions", "keep_rate_mask", "hsadmm_plan", "predict_hsadmm",
           "predict_flat_admm"]


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


def hsadmm_plan(spec, keep: float, sparsity: str, bucket_mib: float):
    """The solver's shrink plan for keep-rate masks on ``spec``'s conv weights.

    Returns ``(plan, mask_bytes, num_layers, has_masks)``: the
    :class:`hsadmm.shrink.ShrinkPlan` of :meth:`~hsadmm.shrink.ShrinkPlan.from_keep_rates`, its
    packed mask bytes ``B``, the tensor count and whether any layer is pruned.
    """
    cfg = HSADMMConfig(keep=keep, sparsity=sparsity, bucket_mib=bucket_mib)
    plan = ShrinkPlan.from_keep_rates(spec.layout, cfg)
    return plan, plan.mask_bytes, len(spec.layout), plan.mask_bytes > 0


def _hsadmm_cost(M, P, T, buckets, mask_bytes, synced, L, cost) -> IterCost:
    phases = hsadmm_iteration_bytes(M=M, P=P, total_params=T, compact_sizes=buckets,
                                    mask_bytes=mask_bytes, mask_synced=synced, num_layers=L,
                                    itemsize=ITEMSIZE)
    C = int(sum(buckets))
    calls = CallCost(M, P, cost)
    calls.allreduce("intra_allreduce", ITEMSIZE * T, "intra")
    if synced:  # the solver packs and syncs even an empty mask buffer
        calls.allreduce("mask_sync", mask_bytes, "inter")
        calls.bcast("mask_bcast", mask_bytes, "intra")
    for n in buckets:
        calls.allreduce("inter_allreduce", ITEMSIZE * n, "inter")
    calls.bcast("bcast_z", ITEMSIZE * C, "intra")
    calls.allreduce("residuals", 8 * RESIDUALS_PER_LAYER * L, "world")
    return calls.finish(phases, ITEMSIZE * C, ITEMSIZE * T)


def predict_hsadmm(spec, nodes: int, gpus_per_node: int, options: HSADMMConfig,
                   cost: CostModel | None = None,
                   assumptions: HSADMMAssumptions | None = None) -> Prediction:
    """H-SADMM (PruneX Algorithm 1): bytes from :func:`volume.hsadmm.hsadmm_iteration_bytes`
    with the buckets of the solver's shrink plan for keep-rate masks (eq. 15)."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    overrides = read_keep_file(options.keep_file)
    plan = ShrinkPlan.from_keep_rates(spec.layout, options, overrides)
    B = plan.mask_bytes
    L = len(penalty_groups(spec.layout, options.rho_scope)[0])
    T = spec.layout.total
    fz = options.freeze_iter
    notes = [f"compact [K_out, K_in] slices of eq. 15 from keep-rate masks ({options.sparsity}, "
             f"keep {options.keep}): compact/dense = {plan.compact_size}/{plan.dense_size} = "
             f"{plan.ratio:.4f} (conv layers pruned; FC, BN and biases travel whole)",
             "all nodes agree on the masks (the OR of eq. 14 keeps nothing extra)",
             f"masks synchronized in iterations 0..{fz - 1}, frozen after" if fz
             else "masks never frozen (synchronized every iteration)",
             f"{len(plan.buckets)} compact bucket(s) of <= {options.bucket_mib:g} MiB",
             f"residuals: {RESIDUALS_PER_LAYER} float64 per penalty group ({L} groups, "
             f"--rho-scope {options.rho_scope})",
             "PruneX Fig. 6 reports compact ~ 0.40 of dense at keep 0.5 (ResNet-18/152, "
             "WRN-50-2); eq. 15 with per-layer masks gives 0.50 at keep 0.5 and 0.40 at keep 0.4 "
             "(channel), which reproduces Fig. 6b's totals (e.g. ResNet-152 13.00 -> 5.21 GiB)"]
    buckets = [b - a for a, b in plan.buckets]

    def one(synced, bk=buckets):
        return _hsadmm_cost(M, P, T, bk, B, synced, L, cost)

    compact_elems = (assumptions or HSADMMAssumptions()).compact_elems
    if compact_elems is not None:
        nb = len(buckets)
        stages = []
        for k, c in enumerate(compact_elems):
            bk = [int(c) // nb + (1 if j < int(c) % nb else 0) for j in range(nb)]
            stages.append((1, one(not fz or k < fz, bk)))
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
    """Flat consensus ADMM: one dense world all-reduce of ``θ + u`` per iteration
    (:func:`volume.hsadmm.flat_admm_iteration_bytes`); every rank projects the same ``z``, so
    masks cost nothing on the wire."""
    _check_topology(nodes, gpus_per_node)
    M, P = nodes, gpus_per_node
    T = spec.layout.total
    L = len(penalty_groups(spec.layout, options.rho_scope)[0])
    phases = flat_admm_iteration_bytes(M=M, P=P, total_params=T, num_layers=L,
                                       itemsize=ITEMSIZE)
    calls = CallCost(M, P, cost)
    calls.allreduce("world_allreduce", ITEMSIZE * T, "world")
    calls.allreduce("residuals", 8 * RESIDUALS_PER_LAYER * L, "world")
    it = calls.finish(phases, ITEMSIZE * T, ITEMSIZE * T)
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
