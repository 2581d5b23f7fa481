"""PacTrain's plan (:class:`dataparallel.pactrain.PacTrainPlan`): the bytes of its call records
(:meth:`~dataparallel.pactrain.PacTrainPlan.calls`) against the paper's closed forms
(:mod:`volume.pactrain`, written from Algorithm 1 and eqs. 1-3 without the plan code): odd
tensor shapes, several buckets, 3 ranks per node, uneven counts, both mask scopes, keep-rate
plans (predictions) and index-set plans (runs); the records' order and dependencies; and
``commvol predict`` against the closed forms and a count of the calls."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from commvol.predict import predict
from dataparallel.pactrain import PacTrainOptions, PacTrainPlan, prune_mask
from models import ModelSpec, ParamLayout, ParamSpec
from substrate.buckets import bucket_groups
from substrate.calls import Placement, Ready, bytes_by_phase
from volume.pactrain import (
    bucketed_step_bytes,
    grasp_score_bytes,
    is_dense_step,
    kept_count,
    packed_chunks,
)

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
TOPOLOGIES = [(2, 2), (2, 3), (3, 3), (1, 3), (1, 6), (3, 1), (4, 2)]
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


def record_bytes(plan, M, P, modes=None, grasp=False):
    """``{phase: {"intra", "inter"}}`` of the plan's records of one step, node-major."""
    where = Placement.node_major(M, P)
    return bytes_by_phase(plan.calls(where, modes, grasp), where)


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
                assert record_bytes(plan, M, P, (mode,) * units) == want, (mode, ternary_scale)
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
        where = Placement.node_major(M, P)
        got = bytes_by_phase(plan.calls_at(where, step), where)
        assert got.pop("grasp_allreduce", None) == want_grasp, step
        assert got == want, step


def test_grasp_bytes_are_two_rings_of_T():
    plan = PacTrainPlan.build(LAYOUT, 2, 3, PacTrainOptions(warmup_steps=0))
    got = record_bytes(plan, 2, 3, grasp=True)
    assert got.pop("grasp_allreduce") == grasp_score_bytes(M=2, P=3, total=LAYOUT.total)
    assert got == record_bytes(plan, 2, 3)


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
    assert record_bytes(b, 2, 3, ("packed",)) != record_bytes(a, 2, 3, ("packed",))


@pytest.mark.parametrize("w,scope,ternary", [(0, "bucket", False), (2, "bucket", True),
                                             (3, "global", False), (0, "global", True)])
def test_records_run_in_the_strategys_order_after_their_gradients(w, scope, ternary):
    """One stream: every record after the previous one; the first record of a bucket (dense) or
    a unit (packed, ternary scale) also after the backward wrote its gradients; the ternary
    all-gather after its scales; GraSP's two all-reduces before the first step's records when
    pruning precedes it (``w = 0``), else after step ``w - 1``'s."""
    opts = PacTrainOptions(prune_ratio=0.5, warmup_steps=w, stable_window=1, mask_scope=scope,
                           bucket_mib=BUCKETS_MIB[1], ternary=ternary, prune_score="grasp")
    plan = PacTrainPlan.build(LAYOUT, 2, 3, opts)
    where = Placement.node_major(2, 3)
    U = plan.num_units
    for modes in (("dense",) * U, (plan.packed_mode,) * U):
        calls = plan.calls(where, modes, grasp=True)
        phases = [c.phase for c in calls]
        grasp = [i for i, ph in enumerate(phases) if ph == "grasp_allreduce"]
        assert grasp == ([0, 1] if w == 0 else [len(calls) - 2, len(calls) - 1])
        for i, c in enumerate(calls):
            assert c.group == where.world and c.itemsize == (1 if c.algorithm == "allgather"
                                                             else 4)
            idx = [d for d in c.after if isinstance(d, int)]
            ready = [d for d in c.after if isinstance(d, Ready)]
            assert idx == ([i - 1] if i else []), (i, c.phase)
            if c.phase == "dense_allreduce":
                assert [(r.lo, r.hi) for r in ready] == [plan.buckets[len(
                    [x for x in phases[:i] if x == "dense_allreduce"])]]
            elif c.phase in ("packed_allreduce", "ternary_scale"):
                # one unit: the first chunk waits for all of it (global scope: the whole T)
                first = phases[:i].count(c.phase) == 0 or scope == "bucket"
                assert bool(ready) == first, (i, c.phase)
            else:
                assert not ready
        ops = {c.phase: c.op for c in calls}
        assert ops.get("ternary_scale", "max") == "max"
        assert ops.get("ternary_allgather") is None
        assert all(ops[ph] == "avg" for ph in ops if ph.endswith("allreduce"))
    with pytest.raises(ValueError, match="modes for"):
        plan.calls(where, ("dense",) * (U + 1))


@pytest.mark.parametrize("kw", [{}, {"ternary": True, "mask_scope": "global"},
                                # per-bucket survivors 31, 72, 158, 15, 68: 2-bit codes that
                                # do not fill their last byte
                                {"ternary": True, "mask_scope": "bucket",
                                 "bucket_mib": BUCKETS_MIB[1]},
                                {"prune_score": "magnitude", "stable_window": 0,
                                 "warmup_steps": 0, "bucket_mib": BUCKETS_MIB[1]}])
def test_commvol_predicts_the_papers_bytes_and_calls(kw):
    """``commvol predict``'s bytes per step equal the paper's closed forms
    (:mod:`volume.pactrain`: DDP's buckets while dense, then every bucket's survivors or
    TernGrad's scales and codes, GraSP's two rings of ``T`` at the pruning step) and its
    messages a count of the calls Algorithm 1 makes (a ring all-reduce over ``p`` ranks sends
    ``p 2 (p-1)`` messages, a ring all-gather ``p (p-1)``): the plan is on neither side."""
    opts = PacTrainOptions(**kw)
    M, P = 2, 3
    p = M * P
    pred = predict("pactrain", spec=SPEC, nodes=M, gpus_per_node=P, **kw)
    buckets = paper_buckets(LAYOUT, opts.bucket_mib, opts.prune_ratio)
    chunk = int(opts.bucket_mib * (1 << 20)) // 4
    K_b = [sum(kept_count(n, r) for n, r in b) for b in buckets]
    units = len(buckets) if opts.mask_scope == "bucket" else 1
    w, W = opts.warmup, opts.stable_window
    for step in range(w + W + 3):
        mode = ("dense" if is_dense_step(step, w, W) else
                "ternary" if opts.ternary else "packed")
        want = bucketed_step_bytes(M=M, P=P, buckets=buckets, mode=mode,
                                   scope=opts.mask_scope, bucket_elems=chunk,
                                   per_tensor_scales=opts.ternary_scale == "tensor")
        grasp = opts.prune_score != "magnitude" and step == max(w - 1, 0)
        if grasp:
            want["grasp_allreduce"] = grasp_score_bytes(M=M, P=P, total=LAYOUT.total)
        got = pred.per_iteration(step)
        assert got.phases == want, step
        if mode == "dense":
            calls = {"dense_allreduce": len(buckets)}
        elif mode == "packed":
            calls = {"packed_allreduce": sum(k > 0 for k in K_b) if units > 1 else
                     len(packed_chunks(sum(K_b), chunk))}
        else:
            calls = {"ternary_scale": units, "ternary_allgather": units}
        if grasp:
            calls["grasp_allreduce"] = 2
        assert got.messages == {ph: n * p * (p - 1) * (1 if ph == "ternary_allgather" else 2)
                                for ph, n in calls.items()}, step
