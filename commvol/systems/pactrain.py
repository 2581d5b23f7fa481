"""PacTrain predictions (paper 002): the strategy's own :class:`~dataparallel.pactrain.
PacTrainPlan`, built from the keep rate at any scale, priced with the cost model; and the
paper's FP16 all-reduce baseline (:mod:`dataparallel.fp16`, :mod:`volume.fp16`)."""

from __future__ import annotations

from dataparallel.fp16 import FP16_ITEMSIZE, FP16Options, FP16Plan
from dataparallel.pactrain import PacTrainOptions, PacTrainPlan
from substrate.calls import Placement

from .core import ITEMSIZE, IterCost, Prediction, SystemModel, _check_topology, register

__all__ = ["pactrain_kept", "pactrain_plan", "predict_fp16", "predict_pactrain"]


def pactrain_plan(spec, nodes: int, gpus_per_node: int,
                  options: PacTrainOptions) -> PacTrainPlan:
    """The plan a run of ``spec`` on ``nodes`` × ``gpus_per_node`` ranks executes, with ``K``
    from the keep rate (:meth:`PacTrainPlan.build` with ``kept_index=None``)."""
    return PacTrainPlan.build(spec.layout, nodes, gpus_per_node, options, itemsize=ITEMSIZE)


def pactrain_kept(layout, prune_ratio: float) -> int:
    """``K`` of the keep-rate plan: every conv/fc tensor keeps ``n - floor(r n)`` entries,
    biases and BatchNorm parameters all of theirs."""
    return PacTrainPlan.build(layout, 1, 1, PacTrainOptions(prune_ratio=prune_ratio,
                                                            warmup_steps=0)).kept


def _step(plan: PacTrainPlan, modes, grasp: bool, cost) -> IterCost:
    """A step running ``modes``: the plan's records (:meth:`PacTrainPlan.calls`) on the
    node-major placement, priced by the generic rule."""
    placement = Placement.node_major(plan.nodes, plan.ranks_per_node)
    w = plan.itemsize
    dense = w * plan.total
    if all(m == "dense" for m in modes):
        payload = dense
    elif plan.packed_mode == "packed":
        payload = w * plan.kept
    else:
        payload = sum(-(-k // 4) for k in plan.unit_kept) + w * plan.num_scales
    return IterCost.from_calls(plan.calls(placement, modes, grasp), placement, cost, payload,
                               dense)


def predict_pactrain(spec, nodes, gpus_per_node, options: PacTrainOptions,
                     cost=None) -> Prediction:
    """PacTrain: dense all-reduce of DDP's buckets until the masks are stable, then every
    bucket's packed survivors (or TernGrad's scales and 2-bit codes): the stages of
    :meth:`PacTrainPlan.calls_at`."""
    _check_topology(nodes, gpus_per_node)
    plan = pactrain_plan(spec, nodes, gpus_per_node, options)
    D, g = plan.dense_steps, plan.grasp_step
    dense_modes, packed_modes = plan.modes_at(0), (plan.packed_mode,) * plan.num_units
    dense, packed = _step(plan, dense_modes, False, cost), _step(plan, packed_modes, False, cost)
    if g is None:
        stages = [(D, dense), (None, packed)]
    elif g < D:
        stages = [(g, dense), (1, _step(plan, dense_modes, True, cost)), (D - g - 1, dense),
                  (None, packed)]
    else:                                            # w = W = 0: packed from the first step
        stages = [(1, _step(plan, packed_modes, True, cost)), (None, packed)]
    stages = [(c, s) for c, s in stages if c != 0]
    T, K, w, W = plan.total, plan.kept, plan.warmup_steps, plan.dense_steps - plan.warmup_steps
    how = (f"packed ring all-reduce of each bucket's survivors ({plan.num_units} mask unit(s), "
           f"--mask-scope {options.mask_scope}; no indices travel)"
           if plan.packed_mode == "packed" else
           f"TernGrad per mask unit: ring MAX all-reduce of {plan.num_scales} scale(s) in all "
           f"(--ternary-scale {options.ternary_scale}) + ring all-gather of the 2-bit codes")
    notes = [(f"K = {K} of T = {T} entries kept ({K / T:.4f}): every conv/fc weight tensor "
              f"keeps n - floor({options.prune_ratio:g} n) (per-layer pruning), biases and "
              "BatchNorm parameters travel whole"),
             (f"dense all-reduce of DDP's {len(plan.buckets)} bucket(s) in steps 0..{D - 1} "
              f"({w} warm-up step(s) + --stable-window {W} steps of mask tracking)"
              if D else "no dense step (--warmup-steps 0, --stable-window 0)"),
             f"from step {D} (the run's mask_stable_step): {how}",
             ("the masks stay stable once pruned (pruned weights stay exactly zero); a "
              "surviving weight that reaches exactly 0 would re-plan and send its bucket "
              "densely for --stable-window steps (not modeled), and --init weights that are "
              "already zero would lower K")]
    if g is not None:
        notes.append(f"GraSP score (eq. 4): two ring all-reduces of the T-element gradient "
                     f"(grad and H grad) in step {g}")
    return Prediction("pactrain", spec.name, plan.nodes, plan.ranks_per_node, "1 step",
                      tuple(stages), notes=tuple(notes), num_params=T)


register(SystemModel("pactrain", predict_pactrain, PacTrainOptions,
                     description="PacTrain: prune a warmed-up model, dense all-reduce until a "
                                 "bucket's mask is stable, then its packed (or ternary) "
                                 "survivors"))


def predict_fp16(spec, nodes, gpus_per_node, options: FP16Options, cost=None) -> Prediction:
    """FP16 all-reduce (PacTrain's quantization baseline): DDP's buckets, each one ring
    all-reduce of half-precision values (:class:`dataparallel.fp16.FP16Plan`; closed form
    :func:`volume.fp16.fp16_step_bytes`)."""
    _check_topology(nodes, gpus_per_node)
    placement = Placement.node_major(nodes, gpus_per_node)
    plan = FP16Plan.for_layout(spec.layout, options, ITEMSIZE)
    sizes = [b - a for a, b in plan.buckets]
    T = spec.layout.total
    step = IterCost.from_calls(plan.calls(placement), placement, cost, FP16_ITEMSIZE * T,
                               ITEMSIZE * T)
    notes = ((f"{len(sizes)} gradient bucket(s) of <= {options.bucket_mib:g} MiB of float32, "
              "each cast to fp16 (2 bytes per entry) and summed by one ring all-reduce"),)
    return Prediction("fp16", spec.name, nodes, gpus_per_node, "1 step", ((None, step),),
                      notes=notes, num_params=T)


register(SystemModel("fp16", predict_fp16, FP16Options,
                     description="FP16 all-reduce of DDP's buckets (PacTrain's baseline)"))
