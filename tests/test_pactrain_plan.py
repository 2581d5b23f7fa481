"""PacTrain's plan (:class:`dataparallel.pactrain.PacTrainPlan`) against the paper's closed
forms (:mod:`volume.pactrain`, written from Algorithm 1 and eqs. 1-3 without the plan code):
odd tensor shapes, several buckets, 3 ranks per node, uneven counts, both mask scopes, keep-rate
plans (predictions) and index-set plans (runs); and ``commvol predict`` from the same plan."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from commvol.predict import predict
from commvol.systems import pactrain_plan
from dataparallel.pactrain import PacTrainOptions, PacTrainPlan, prune_mask
from models import ModelSpec, ParamLayout, ParamSpec
from substrate.buckets import bucket_groups
from volume.pactrain import bucketed_step_bytes, grasp_score_bytes, is_dense_step, kept_count

# odd shapes; flat order is backward order (the last spec comes first)
SPECS = (
    ParamSpec("conv1.weight", "conv", (5, 3, 3, 3)),     # 135
    ParamSpec("conv1.bias", "bias", (5,)),
    ParamSpec("bn1.weight", "bn", (5,)),
    ParamSpec("bn1.bias", "bn", (5,)),
    ParamSpec("conv2.weight", "conv", (7, 5, 3, 3)),     # 315
    ParamSpec("fc1.weight", "fc", (11, 13)),             # 143
    ParamSpec("fc1.bias", "bias", (11,)),
    ParamSpec("fc2.weight", "fc", (3, 11)),              # 33
    ParamSpec("fc2.bias", "bias", (3,)),
)
LAYOUT = ParamLayout(SPECS)
SPEC = ModelSpec("odd", (3, 8, 8), 3, SPECS, 0)
TOPOLOGIES = [(2, 3), (3, 3), (1, 3), (3, 1), (4, 2)]
#: bucket sizes in MiB: one bucket for all, and ~130 floats (several buckets, a tensor larger
#: than a bucket gets its own)
BUCKETS_MIB = [32.0, 520 / (1 << 20)]


def paper_buckets(layout, bucket_mib, ratio, itemsize=4):
    """DDP's buckets as ``[(n_l, r_l), ...]`` (``r_l = 0`` for biases and BN), from
    :func:`substrate.comm.bucket_groups` on the tensors' bytes in flat order."""
    names = list(layout.names)
    sizes = [layout.sizes[n] for n in names]
    groups = bucket_groups([s * itemsize for s in sizes], int(bucket_mib * (1 << 20)))
    return [[(sizes[i], ratio if layout.kind(names[i]) in ("conv", "fc") else 0.0)
             for i in g] for g in groups]


def run_index(layout, ratio, seed):
    """A run's kept index set: per-layer pruning of random scores."""
    imp = np.random.default_rng(seed).random(layout.total)
    return np.flatnonzero(prune_mask(imp, layout, ratio))


@pytest.mark.parametrize("M,P", TOPOLOGIES)
@pytest.mark.parametrize("bucket_mib", BUCKETS_MIB)
@pytest.mark.parametrize("scope", ["bucket", "global"])
@pytest.mark.parametrize("ratio", [0.0, 0.37, 0.5, 0.9])
def test_plan_bytes_equal_the_papers_closed_form(M, P, bucket_mib, scope, ratio):
    buckets = paper_buckets(LAYOUT, bucket_mib, ratio)
    chunk = max(1, int(bucket_mib * (1 << 20)) // 4)
    for ternary_scale in ("tensor", "global"):
        opts = PacTrainOptions(prune_ratio=ratio, mask_scope=scope, bucket_mib=bucket_mib,
                               ternary_scale=ternary_scale, warmup_steps=0)
        plans = [PacTrainPlan.build(LAYOUT, M, P, opts),                         # prediction
                 PacTrainPlan.build(LAYOUT, M, P, opts, kept_index=run_index(LAYOUT, ratio, 7))]
        for plan in plans:
            units = len(buckets) if scope == "bucket" else 1
            assert plan.num_units == units
            for mode in ("dense", "packed", "ternary"):
                want = bucketed_step_bytes(M=M, P=P, buckets=buckets, mode=mode, scope=scope,
                                           bucket_elems=chunk,
                                           per_tensor_scales=ternary_scale == "tensor")
                assert plan.step_bytes((mode,) * units) == want, (mode, ternary_scale)
            # K against the paper's count
            assert plan.kept == sum(kept_count(n, r) for b in buckets for n, r in b)


@pytest.mark.parametrize("M,P", [(2, 3), (3, 3)])
@pytest.mark.parametrize("w,W,score", [(0, 0, "grasp"), (0, 3, "magnitude"), (4, 2, "grasp"),
                                       (3, 0, "grasp-abs"), (1, 5, "magnitude")])
def test_schedule_is_dense_until_stable(M, P, w, W, score):
    opts = PacTrainOptions(prune_ratio=0.5, warmup_steps=w, stable_window=W, prune_score=score,
                           bucket_mib=BUCKETS_MIB[1], ternary=True)
    plan = PacTrainPlan.build(LAYOUT, M, P, opts)
    buckets = paper_buckets(LAYOUT, BUCKETS_MIB[1], 0.5)
    T = LAYOUT.total
    for step in range(w + W + 3):
        mode = "dense" if is_dense_step(step, w, W) else "ternary"
        want = bucketed_step_bytes(M=M, P=P, buckets=buckets, mode=mode)
        want_grasp = (grasp_score_bytes(M=M, P=P, total=T)       # GraSP at the pruning step
                      if score != "magnitude" and step == max(w - 1, 0) else None)
        got = plan.bytes_at(step)
        assert got.pop("grasp_allreduce", None) == want_grasp, step
        assert got == want, step


def test_grasp_bytes_are_two_rings_of_T():
    plan = PacTrainPlan.build(LAYOUT, 2, 3, PacTrainOptions(warmup_steps=0))
    assert plan.grasp_bytes() == {"grasp_allreduce": grasp_score_bytes(M=2, P=3,
                                                                       total=LAYOUT.total)}


@pytest.mark.parametrize("scope", ["bucket", "global"])
def test_run_plan_index_sets_follow_the_mask(scope):
    ratio = 0.37
    idx = run_index(LAYOUT, ratio, 3)
    opts = PacTrainOptions(prune_ratio=ratio, mask_scope=scope, bucket_mib=BUCKETS_MIB[1],
                           warmup_steps=0)
    plan = PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=idx)
    assert np.array_equal(np.concatenate(plan.index), idx)
    for (a, b), ix, k in zip(plan.units, plan.index, plan.unit_kept):
        assert ix.size == k and (ix.size == 0 or (ix[0] >= a and ix[-1] < b))
    # per tensor: the survivors of the mask, = n - floor(r n) on conv/fc
    for name, n, k in zip(LAYOUT.names, plan.tensor_sizes, plan.tensor_kept):
        sl = LAYOUT.slice(name)
        assert k == ((idx >= sl.start) & (idx < sl.stop)).sum()
        assert k == (n - math.floor(ratio * n) if LAYOUT.kind(name) in ("conv", "fc") else n)
    # TernGrad segments: one per tensor of the unit, covering the packed vector
    for segs, k in zip(plan.segments, plan.unit_kept):
        assert segs[0][0] == 0 and segs[-1][1] == k
        assert all(a1 == b0 for (_, b0), (a1, _) in itertools.pairwise(segs))
    with pytest.raises(ValueError, match="sorted, unique flat indices"):
        PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=idx[::-1])


def test_a_changed_mask_changes_the_bytes():
    """One extra kept element (a run whose mask keeps one more entry) moves the packed bytes:
    the plan follows the index set, not the keep rate."""
    opts = PacTrainOptions(prune_ratio=0.5, warmup_steps=0)
    idx = run_index(LAYOUT, 0.5, 1)
    extra = np.union1d(idx, [int(np.setdiff1d(np.arange(LAYOUT.total), idx)[0])])
    a = PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=idx)
    b = PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=extra)
    assert b.kept == a.kept + 1
    assert b.step_bytes(("packed",)) != a.step_bytes(("packed",))


@pytest.mark.parametrize("kw", [{}, {"ternary": True, "mask_scope": "global"},
                                {"prune_score": "magnitude", "stable_window": 0,
                                 "warmup_steps": 0, "bucket_mib": BUCKETS_MIB[1]}])
def test_commvol_predicts_from_the_same_plan(kw):
    """``commvol predict``'s bytes per step are the plan's :meth:`~PacTrainPlan.bytes_at`."""
    opts = PacTrainOptions(**kw)
    pred = predict("pactrain", spec=SPEC, nodes=2, gpus_per_node=3, **kw)
    plan = pactrain_plan(SPEC, 2, 3, opts)
    n = plan.dense_steps + 3
    for step in range(n):
        assert pred.per_iteration(step).phases == plan.bytes_at(step), step
