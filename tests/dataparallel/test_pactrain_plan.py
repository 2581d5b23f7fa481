"""PacTrain's plan (:class:`dataparallel.pactrain.PacTrainPlan`): the bytes of its call records
(:meth:`~dataparallel.pactrain.PacTrainPlan.calls`) against the paper's closed forms
(:mod:`volume.pactrain`, written from Algorithm 1 and eqs. 1-3 without the plan code): odd
tensor shapes, several buckets, 3 ranks per node, uneven counts, both mask scopes, keep-rate
plans (predictions) and index-set plans (runs); the records' order and dependencies; and
``commvol predict`` against the closed forms and a count of the calls."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from prediction_helpers import iteration_cost

from commvol.predict import predict
from dataparallel.pactrain import PacTrainOptions, PacTrainPlan, prune_mask
from dataparallel.program import FORWARD_BACKWARD, OPTIMIZER, UPDATED, step_program
from models import ModelSpec, ParamLayout, ParamSpec
from substrate.buckets import bucket_groups
from substrate.calls import Call, Placement, Ready, Work, bytes_by_phase
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


def _units_of(layout):
    """Compute units of one tensor each, in forward order (what a step program walks)."""
    return [SimpleNamespace(name=n, lo=layout.offsets[n], hi=layout.offsets[n] + layout.sizes[n])
            for n in reversed(layout.names)]


@pytest.mark.parametrize("scope,ternary,wait", [
    ("bucket", False, "bucket"), ("bucket", True, "bucket"), ("bucket", True, "backward"),
    ("global", True, "bucket"), ("global", False, "bucket")])
@pytest.mark.parametrize("gse", [False, True])
def test_run_records_are_the_calls_with_the_codecs_compute(scope, ternary, wait, gse):
    """The records a run's step program is generated from: the calls of :meth:`calls`, the
    same in the same order, and the codec's compute items where the strategy computes them:
    eq. 2 before a dense bucket's all-reduce (once pruned), a unit's packing before its first
    call, a ternary unit's encoding between its scales and its codes (at the next unit's
    gradients with ``--ternary-wait bucket``, after the backward otherwise), every unpacking
    after the calls; GraSP's set-up after the update."""
    opts = PacTrainOptions(prune_ratio=0.5, warmup_steps=2, stable_window=1, mask_scope=scope,
                           bucket_mib=BUCKETS_MIB[1], ternary=ternary, ternary_wait=wait)
    plan = PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=run_index(LAYOUT, 0.5, 5))
    where = Placement.node_major(2, 3)
    U = plan.num_units
    mixed = tuple("dense" if u % 2 else plan.packed_mode for u in range(U))
    for modes in (("dense",) * U, (plan.packed_mode,) * U, mixed):
        recs = plan.records(where, modes, gse=gse, ternary_wait=wait)
        calls = [r for r in recs if isinstance(r, Call)]
        want = plan.calls(where, modes)
        assert [c.key() for c in calls] == [c.key() for c in want]
        assert [(c.label, c.wait) for c in calls] == [(c.label, c.wait) for c in want]
        assert all(not c.wait for c in calls)               # the stream, during the backward
        work = {r.label: i for i, r in enumerate(recs) if isinstance(r, Work)}
        label = {r.label: i for i, r in enumerate(recs) if isinstance(r, Call)}
        first_unpack = min((i for lb, i in work.items() if "unpack" in lb), default=len(recs))
        assert all(isinstance(r, Work) for r in recs[first_unpack:])
        assert max(label.values()) < first_unpack
        for u, mode in enumerate(modes):
            if mode == "dense":
                for bi in plan.unit_buckets[u]:
                    i = label[f"dense_allreduce[{bi}]"]
                    assert (f"pactrain_gse[{bi}]" in work) == gse
                    if gse:
                        assert work[f"pactrain_gse[{bi}]"] in recs[i].after
                assert f"pactrain_unpack[{u}]" not in work
                continue
            pack = work[f"pactrain_pack[{u}]"]
            assert recs[pack].after == (Ready(*plan.units[u]),)
            first = label[f"ternary_scale[{u}]" if mode == "ternary" else
                          f"packed_allreduce[{u}.0]"] if plan.unit_kept[u] or mode == \
                "ternary" else None
            if first is not None:
                assert pack in recs[first].after and pack < first
            unpack = recs[work[f"pactrain_unpack[{u}]"]]
            if mode == "ternary":
                scale, gather = label[f"ternary_scale[{u}]"], label[f"ternary_allgather[{u}]"]
                enc = work[f"pactrain_encode[{u}]"]
                assert scale < enc < gather and recs[gather].after == (scale, enc)
                nxt = u + 1 < U and wait == "bucket"
                at = [t for t in recs[enc].after if isinstance(t, Ready)]
                assert recs[enc].after[0] == scale
                assert at == ([Ready(*plan.buckets[plan.unit_buckets[u + 1][0]])] if nxt
                              else [])
                assert gather in unpack.after
            else:
                assert set(unpack.after) == {pack, *(label[f"packed_allreduce[{u}.{c}]"]
                                                     for c in range(len(plan.chunks[u])))}
    grasp = plan.records(where, ("dense",) * U, grasp=True)
    assert [getattr(r, "phase", None) or r.label for r in grasp[-5:]] == [
        "pactrain_grasp_grad", "grasp_allreduce", "pactrain_grasp_hvp", "grasp_allreduce",
        "pactrain_grasp_score"]
    assert grasp[-5].after == (UPDATED,) and all(c.wait for c in grasp[-4::2])
    setup = plan.grasp_records(where)
    assert [getattr(r, "phase", None) or r.label for r in setup] == \
        [getattr(r, "phase", None) or r.label for r in grasp[-5:]] and setup[0].after == ()


@pytest.mark.parametrize("wait", ["bucket", "backward"])
def test_step_program_waits_for_the_scales_where_the_records_say(wait):
    """In the step's program (``--overlap on``) a ternary unit's encoding follows a wait for
    its scales' all-reduce: at the next unit's backward with ``--ternary-wait bucket`` (the
    backward waits there, the later units' calls still go out during it), after the backward
    with ``backward`` (no call after the first unit's scales goes out during the backward);
    the unpacking after the backward; GraSP after the optimizer."""
    opts = PacTrainOptions(prune_ratio=0.5, warmup_steps=0, stable_window=0,
                           bucket_mib=BUCKETS_MIB[1], ternary=True, ternary_wait=wait)
    plan = PacTrainPlan.build(LAYOUT, 2, 3, opts, kept_index=run_index(LAYOUT, 0.5, 5))
    where = Placement.node_major(2, 3)
    U = plan.num_units
    assert U >= 3
    recs = plan.records(where, ("ternary",) * U, gse=True, ternary_wait=wait, grasp=True)
    prog = step_program(_units_of(LAYOUT), recs, where, 0, overlap=True)
    blocks = {e[2]: i for i, e in enumerate(prog) if e[0] == "B"}
    depth, end_fb = 0, None                 # the forward+backward block's end
    for i in range(blocks[FORWARD_BACKWARD], len(prog)):
        depth += {"B": 1, "E": -1}.get(prog[i][0], 0)
        if depth == 0:
            end_fb = i
            break
    calls = {e[1].label: i for i, e in enumerate(prog) if e[0] == "C"}
    for u in range(U):
        enc = blocks[f"pactrain_encode[{u}]"]
        scale = calls[f"ternary_scale[{u}]"]
        assert ["W", scale] in prog[scale:enc]
        during = enc < end_fb
        assert during == (wait == "bucket" and u + 1 < U), (u, enc, end_fb)
        assert blocks[f"pactrain_unpack[{u}]"] > end_fb
    sent_during = [lb for lb, i in calls.items() if i < end_fb]
    if wait == "bucket":
        assert len(sent_during) == 2 * U - 1               # the last unit's codes after it
    else:
        assert sent_during == ["ternary_scale[0]"]
    opt = blocks[OPTIMIZER]
    assert blocks["pactrain_grasp_grad"] > opt and prog[blocks["pactrain_grasp_grad"]][4] == \
        [opt]
    assert calls["grasp_allreduce[0]"] > opt and prog[calls["grasp_allreduce[0]"]][2] is None


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
        got = iteration_cost(pred, step)
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
