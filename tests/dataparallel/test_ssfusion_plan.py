"""SSFusion's plan (:func:`dataparallel.ssfusion.plan_ssfusion`, executed by the run and used by
``commvol`` to predict): the bytes of its records (:meth:`SSFusionPlan.calls`, priced by
:func:`substrate.calls.bytes_by_phase`) against the second source written from the paper
(:mod:`volume.ssfusion`: what each buffer sends from tensor sizes, density and the dense set),
the records' order and dependencies against §IV-D, and the selection against references written
here from §IV-B: eq. 2's selection and density-aware counts.

Several models (the digits CNN and ResNet, the CIFAR ResNet-18 spec, an odd synthetic layout),
odd topologies (3 ranks per node, one node, one rank per node) and every fusion mode.  The
records are the program the run executes: SSFusion-O's worker items on the offload stream where
the backward writes their tensors, the phase names the second source's.
"""

import dataclasses
import math

import numpy as np
import pytest

from commvol.predict import resolve_model
from commvol.systems.ssfusion import SSFusionAssumptions, predict_ssfusion
from dataparallel.program import step_program
from dataparallel.ssfusion import SSFusionOptions, plan_ssfusion
from dataparallel.ssfusion import plan as ssf_plan
from models import build_model
from substrate.calls import Call, Placement, Ready, Work, bytes_by_phase, messages
from substrate.costmodel import CostModel
from volume import collectives as cm
from volume import ssfusion as cv
from volume.dataparallel import world_allgather_bytes, world_ring_bytes

COST = CostModel()
#: odd sizes: a 1-entry tensor, primes, one tensor far larger than the rest
ODD = [7, 1, 333, 12, 5, 1001, 3, 64, 17, 40_961, 2, 9]
MODELS = {"cnn": None, "resnet": None, "resnet18": None, "odd": ODD}
TOPOLOGIES = [(2, 2), (2, 3), (1, 3), (1, 6), (4, 2), (3, 3), (5, 1)]


def _sizes(name):
    if MODELS[name] is not None:
        return list(MODELS[name])
    layout = resolve_model(name).layout
    return [int(layout.sizes[n]) for n in layout.names]


def _bytes(plan, M, P, kind="sparse", decided=False):
    """Bytes per phase and link class of the plan's records of one step, node-major."""
    p = Placement.node_major(M, P)
    return bytes_by_phase(plan.calls(p, kind, decided), p)


def _equal_count_cut(L, n):
    """``n`` buffers of equal tensor count, the first ``L mod n`` one tensor longer."""
    q, r = divmod(L, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _profile(sizes, backward_ns=20.0, sparsify_ns=50.0):
    n = np.asarray(sizes, dtype=np.float64)
    return (backward_ns * 1e-9 * n, sparsify_ns * 1e-9 * n, sparsify_ns * 1e-9 * n)


def _given_dense(sizes, counts, density, floor):
    """A dense set written here: in buffer ``i`` (0-based) up to ``i`` of its smallest tensors,
    while the paper's floor lets the others compensate (cv.compensable); returns indices and
    splits (the first dense tensor of each buffer goes to Buffer_AR)."""
    dense, splits, t0 = [], [], 0
    for i, c in enumerate(counts):
        local = []
        for j in sorted(range(c), key=lambda j: (sizes[t0 + j], j))[:i]:
            if not cv.compensable(sizes[t0:t0 + c], local + [j], density, floor):
                break
            local.append(j)
        dense += [t0 + j for j in local]
        splits.append(min(local) + 1 if local else 0)
        t0 += c
    return dense, splits


@pytest.mark.parametrize("M,P", TOPOLOGIES)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fusion", ["per-tensor", "multi-tensor", "selective"])
def test_plan_bytes_equal_the_second_source(model, fusion, M, P):
    """Per phase and link class, one sparse step of the plan equals volume.ssfusion's
    per-mode bytes from tensor sizes, density and the dense set; warm-up and decision too."""
    sizes = _sizes(model)
    L, p = len(sizes), M * P
    link = cm.INTER if M > 1 else cm.INTRA
    nb = min(4, L)
    d, floor = 0.05, 0.001
    o = SSFusionOptions(density=d, density_floor=floor, fusion=fusion, fusion_policy="count",
                        buffers=nb)
    counts = _equal_count_cut(L, nb)
    kw = {}
    dense, splits = [], None
    if fusion == "selective":
        dense, splits = _given_dense(sizes, counts, d, floor)
        assert dense, "the fixture should leave some tensor dense"
        kw = {"dense": dense, "split": splits}
    plan = plan_ssfusion(sizes, p, link, o, COST, profile=_profile(sizes), **kw)
    assert [t1 - t0 for t0, t1 in plan.buffers] == counts
    assert _bytes(plan, M, P) == cv.mode_step_bytes(
        M=M, P=P, sizes=sizes, buffer_tensor_counts=counts, density=d, fusion=fusion,
        dense=dense, splits=splits)
    assert plan.dense() == sorted(dense)
    # the elements behind the bytes, buffer by buffer (ar, agd, sparse)
    t0 = 0
    for (n_ar, n_agd, k), c, lp in zip(zip(*plan.counts()), counts, splits or [0] * nb):
        local = {j - t0 for j in dense if t0 <= j < t0 + c}
        assert (n_ar, n_agd, k) == cv.buffer_elements(sizes[t0:t0 + c], d, fusion, local, lp)
        t0 += c
    # warm-up all-reduces and the decision (selective: profile MAX + plan broadcast)
    ring = [world_ring_bytes(sum(sizes[a:a + c]), 4, M, P)
            for a, c in zip(np.cumsum([0] + counts[:-1]), counts)]
    warm = _bytes(plan, M, P, "warmup", decided=True)
    assert warm[cv.WARMUP] == {k: sum(r[k] for r in ring) for k in ("intra", "inter")}
    assert (cv.SELECT in warm) == (fusion == "selective")
    if fusion == "selective":
        assert {ph: warm[ph] for ph in (cv.PROFILE, cv.SELECT)} == cv.selection_bytes(
            M=M, P=P, num_tensors=L)
    assert _bytes(plan, M, P, "warmup") == {cv.WARMUP: warm[cv.WARMUP]}


@pytest.mark.parametrize("M,P", [(3, 3), (2, 3)])
@pytest.mark.parametrize("model", list(MODELS))
def test_cupcake_plans_send_what_the_paper_says(model, M, P):
    """The default (Cupcake) buffers: whatever the cut, every buffer sends K_i (per-tensor,
    multi-tensor) or K_i - n_D sparse entries around its dense tensors (selective)."""
    sizes = _sizes(model)
    for fusion in ("per-tensor", "multi-tensor", "selective"):
        o = SSFusionOptions(fusion=fusion, density=0.02)
        plan = plan_ssfusion(sizes, M * P, cm.INTER, o, COST, profile=_profile(sizes))
        counts = [t1 - t0 for t0, t1 in plan.buffers]
        assert sum(counts) == len(sizes) and plan.profiled
        assert _bytes(plan, M, P) == cv.mode_step_bytes(
            M=M, P=P, sizes=sizes, buffer_tensor_counts=counts, density=0.02, fusion=fusion,
            dense=plan.dense() if fusion == "selective" else (), splits=plan.split)


def _eq2_reference(sizes, counts, T_b, T_sp, d, floor, p, link):
    """§IV-B Step 2 without interleaving, written from the paper: buffer i >= 2 leaves its
    smallest tensors dense until T_cm^{i-1} >= Σ (T_b + T_sp of the sparse ones) (eq. 2) or the
    floor stops the compensation; T_cm^{i-1} is the previous buffer's all-gather of its dense
    values (4 B) and K - n_D sparse pairs (8 B), eq. 3: (p-1) α + (p-1) D β."""
    a, b = COST.alpha(link), COST.beta(link)
    dense, t0, t_cm = [], 0, 0.0
    for i, c in enumerate(counts):
        sz = sizes[t0:t0 + c]
        local = []
        if i:
            comp = sum(T_b[t0:t0 + c]) + sum(T_sp[t0:t0 + c])
            for j in sorted(range(c), key=lambda j: (sz[j], j)):
                if t_cm >= comp or not cv.compensable(sz, local + [j], d, floor):
                    break
                local.append(j)
                comp -= T_sp[t0 + j]
        n_d = sum(sz[j] for j in local)
        block = 4 * n_d + 8 * (cv.buffer_target(sz, d) - n_d)
        t_cm = (p - 1) * a + (p - 1) * block * b if p > 1 else 0.0
        dense += [t0 + j for j in local]
        t0 += c
    return sorted(dense)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("backward_ns,sparsify_ns", [(20.0, 50.0), (0.1, 0.2), (2e3, 1e4)])
def test_selection_follows_eq2(model, backward_ns, sparsify_ns):
    sizes = _sizes(model)
    M, P = 2, 3
    link = cm.INTER
    nb = min(4, len(sizes))
    o = SSFusionOptions(fusion_policy="count", buffers=nb, interleave=False, density=0.05)
    prof = _profile(sizes, backward_ns, sparsify_ns)
    plan = plan_ssfusion(sizes, M * P, link, o, COST, profile=prof)
    want = _eq2_reference(sizes, _equal_count_cut(len(sizes), nb), prof[0], prof[1], 0.05, 0.001,
                          M * P, link)
    assert plan.dense() == want
    assert plan.split == (0,) * nb


@pytest.mark.parametrize("model", list(MODELS))
def test_density_aware_counts_are_the_adjusted_density(model):
    """§IV-B density-aware sparsification: the sparse tensors of a buffer with dense tensors
    send at one common density, to within one element, except those held at the floor
    ``max(1, ⌈d_min n⌉)`` (or whole), and the buffer sends K_i elements in all; with no tensor
    held that density is d'_i = (K_i - n_D) / n_S."""
    sizes = _sizes(model)
    nb = min(4, len(sizes))
    counts = _equal_count_cut(len(sizes), nb)
    d, floor = 0.05, 0.001
    dense, splits = _given_dense(sizes, counts, d, floor)
    plan = plan_ssfusion(sizes, 6, cm.INTER, SSFusionOptions(
        fusion_policy="count", buffers=nb, density=d), COST, profile=_profile(sizes),
        dense=dense, split=splits)
    t0 = 0
    for c in counts:
        sz = sizes[t0:t0 + c]
        local = {j - t0 for j in dense if t0 <= j < t0 + c}
        k = {j: plan.k[t0 + j] for j in range(c)}
        assert all(k[j] == -1 for j in local)
        if not local:  # nothing to compensate: per-tensor sparsification, max(1, ⌈d n⌉)
            assert [k[j] for j in range(c)] == [max(1, math.ceil(d * n)) for n in sz]
            t0 += c
            continue
        lo = {j: max(1, math.ceil(floor * sz[j])) for j in range(c)}
        assert all(lo[j] <= k[j] <= sz[j] for j in range(c) if j not in local)
        held = [j for j in range(c) if j not in local and k[j] in (lo[j], sz[j])]
        free = [j for j in range(c) if j not in local and j not in held]
        n_d = sum(sz[j] for j in local)
        assert n_d + sum(k[j] for j in range(c) if j not in local) == cv.buffer_target(sz, d)
        if free:
            common = (cv.buffer_target(sz, d) - n_d - sum(k[j] for j in held)) \
                / sum(sz[j] for j in free)
            assert all(abs(k[j] - common * sz[j]) < 1 + 1e-9 for j in free), (k, common)
            if not held:
                assert common == pytest.approx(cv.adjusted_density(sz, local, d))
        t0 += c


def test_prediction_is_the_plan():
    """commvol's prediction of a selective run with a given selection prices the plan's
    records: its bytes equal volume.ssfusion's closed forms step for step (warm-up, decision,
    sparse), its messages the rings' counts, and the records it carries are the plan's."""
    spec = resolve_model("resnet")
    names = list(spec.layout.names)
    sizes = [int(spec.layout.sizes[n]) for n in names]
    o = SSFusionOptions(fusion_policy="count", buffers=5, profile_steps=3, density=0.05)
    counts = _equal_count_cut(len(sizes), 5)
    dense, splits = _given_dense(sizes, counts, 0.05, 0.001)
    a = SSFusionAssumptions(dense_tensors=[names[l] for l in dense], interleave_split=splits)
    pred = predict_ssfusion(spec, 3, 3, o, COST, a)
    want = cv.mode_step_bytes(M=3, P=3, sizes=sizes, buffer_tensor_counts=counts, density=0.05,
                              fusion="selective", dense=dense, splits=splits)
    assert pred.steady.phases == want
    total = pred.total(7).phases
    ar, agd, ks = [], [], []
    t0 = 0
    for c, lp in zip(counts, splits):
        e = cv.buffer_elements(sizes[t0:t0 + c], 0.05, "selective",
                               {j - t0 for j in dense if t0 <= j < t0 + c}, lp)
        ar.append(e[0])
        agd.append(e[1])
        ks.append(e[2])
        t0 += c
    wsizes = [sum(sizes[a:a + c]) for a, c in zip(np.cumsum([0] + counts[:-1]), counts)]
    assert total == cv.run_bytes(M=3, P=3, steps=7, warmup_steps=3, warmup_buffer_sizes=wsizes,
                                 ar_counts=ar, ag_dense_counts=agd, ag_sparse_counts=ks,
                                 num_tensors=len(sizes))
    # every buffer gathers; the all-gather carries 4 n_AGd + 8 k bytes a rank
    assert sum(pred.steady.phases[cv.SPARSE].values()) == sum(
        sum(world_allgather_bytes(4 * n + 8 * k, 3, 3).values()) for n, k in zip(agd, ks))
    # messages of the rings over p = 9 ranks, one call per non-empty part
    p = 9
    assert pred.steady.messages == {cv.DENSE: sum(1 for n in ar if n) * p * 2 * (p - 1),
                                    cv.SPARSE: len(counts) * p * (p - 1)}
    # the prediction carries the plan's records, in the order the run executes them
    calls = [c for c in pred.steady.calls if isinstance(c, Call)]
    order = []
    for n in ar:
        order += ([cv.DENSE] if n else []) + [cv.SPARSE]
    assert [c.phase for c in calls] == order
    assert [messages(c) for c in calls] == [p * 2 * (p - 1) if ph == cv.DENSE else p * (p - 1)
                                            for ph in order]


@pytest.mark.parametrize("fusion", ["selective", "per-tensor", "multi-tensor"])
def test_sparse_step_records_follow_the_interleaved_pipeline(fusion):
    """§IV-D, Fig. 10, written from the paper: per fusion buffer the all-reduce of Buffer_AR
    waits for the tensors before the split l'_i (backward and sparsification: T1) and for the
    previous buffer's communication (one channel); the all-gather of Buffer_AG waits for the
    whole buffer and for the all-reduce (T2 = max(T_AR, rest) + T_AG); the sparsification is a
    compute item after the backward wrote its tensors; decoding follows each call."""
    sizes = ODD
    counts = _equal_count_cut(len(sizes), 4)
    kw = {}
    if fusion == "selective":
        dense, splits = _given_dense(sizes, counts, 0.05, 0.001)
        kw = {"dense": dense, "split": splits}
    else:
        splits = [0] * 4
    o = SSFusionOptions(fusion=fusion, fusion_policy="count", buffers=4, density=0.05)
    plan = plan_ssfusion(sizes, 6, cm.INTER, o, COST, profile=_profile(sizes), **kw)
    items = plan.calls(Placement.node_major(2, 3), momentum=True)
    off = np.concatenate(([0], np.cumsum(sizes)))
    t0, prev, seen = 0, None, 0
    calls = [i for i, c in enumerate(items) if isinstance(c, Call)]
    ar_counts = plan.counts()[0]
    for b, (c, lp) in enumerate(zip(counts, splits)):
        a, cut, end = int(off[t0]), int(off[t0 + lp]), int(off[t0 + c])
        if ar_counts[b]:
            i = calls[seen]
            seen += 1
            call = items[i]
            assert call.phase == cv.DENSE and call.op == "avg"
            assert Ready(a, cut) in call.after and (prev is None or prev in call.after)
            heads = [d for d in call.after if isinstance(d, int) and isinstance(items[d], Work)]
            assert [items[d].after for d in heads] == [(Ready(a, cut),)]
            prev_ar = i
            prev = i
        else:
            prev_ar = None
        i = calls[seen]
        seen += 1
        call = items[i]
        assert call.phase == cv.SPARSE and Ready(a, end) in call.after
        assert prev is None or prev in call.after
        assert prev_ar is None or prev_ar in call.after
        parts = sorted((r.lo, r.hi) for d in call.after
                       if isinstance(d, int) and isinstance(items[d], Work)
                       for r in items[d].after)
        # the compute parts cover the buffer: [a, cut) and [cut, end)
        assert parts == [(lo, hi) for lo, hi in ((a, cut), (cut, end)) if hi > lo]
        prev = i
        t0 += c
    assert seen == len(calls)
    # decoding: one compute item after each call, at the end of the list
    tail = items[len(items) - len(calls):]
    assert all(isinstance(w, Work) and w.after == (j,) for w, j in zip(tail, calls))
    assert all(w.flops > 0 and w.nbytes > 0 for w in items if isinstance(w, Work))


def test_warmup_records():
    """Warm-up: per warm-up buffer an average all-reduce after its gradients (and the profiling
    when the plan is profiled), chained; the decision's profile MAX all-reduce (3L + 2 float64)
    after the last one and the plan's broadcast from rank 0 (4L int64) after that."""
    sizes = ODD
    o = SSFusionOptions(fusion_policy="count", buffers=3, density=0.05)
    plan = plan_ssfusion(sizes, 4, cm.INTER, o, COST, profile=_profile(sizes))
    items = plan.calls(Placement.node_major(2, 2), "warmup", decided=True)
    L, off = len(sizes), np.concatenate(([0], np.cumsum(sizes)))
    assert isinstance(items[0], Work) and items[0].after == (Ready(0, int(off[-1])),)
    warm = items[1:4]
    for j, (t0, t1) in enumerate(_pairs(_equal_count_cut(L, 3))):
        c = warm[j]
        assert (c.phase, c.algorithm, c.op, c.nbytes) == (cv.WARMUP, "allreduce", "avg",
                                                          4 * int(off[t1] - off[t0]))
        assert c.after[0] == Ready(int(off[t0]), int(off[t1])) and 0 in c.after
        assert j == 0 or j in c.after
    prof, sel = items[4], items[5]
    assert (prof.phase, prof.op, prof.nbytes, prof.itemsize) == (cv.PROFILE, "max",
                                                                  8 * (3 * L + 2), 8)
    assert 3 in prof.after and 0 in prof.after
    assert (sel.phase, sel.algorithm, sel.root, sel.nbytes, sel.after) == (
        cv.SELECT, "bcast", 0, 8 * 4 * L, (4,))
    assert len(items) == 6
    # not the deciding step: no decision; a plan fixed by its options profiles nothing
    assert [c.phase for c in plan.calls(Placement.node_major(2, 2), "warmup")
            if isinstance(c, Call)] == [cv.WARMUP] * 3
    fixed = plan_ssfusion(sizes, 4, cm.INTER, SSFusionOptions(
        fusion="per-tensor", fusion_policy="count", buffers=3), COST)
    assert not any(isinstance(c, Work) for c in fixed.calls(Placement.node_major(2, 2),
                                                             "warmup", decided=True))
    with pytest.raises(ValueError, match="step kind 'dense' unknown"):
        plan.calls(Placement.node_major(2, 2), "dense")


def _pairs(counts):
    out, t = [], 0
    for c in counts:
        out.append((t, t + c))
        t += c
    return out


def test_bad_plan_inputs():
    sizes = [10, 640, 64, 32768]
    o = SSFusionOptions(fusion_policy="count", buffers=2)
    with pytest.raises(ValueError, match="depends on timings"):
        plan_ssfusion(sizes, 4, cm.INTER, o, COST)
    with pytest.raises(ValueError, match="cannot be compensated at --density-floor"):
        plan_ssfusion(sizes, 4, cm.INTER, o, COST, profile=_profile(sizes), dense=[1])
    with pytest.raises(ValueError, match="interleave split"):
        plan_ssfusion(sizes, 4, cm.INTER, o, COST, profile=_profile(sizes), dense=[2],
                      split=[0, 0, 0])
    with pytest.raises(ValueError, match="do not cut the 4 tensors"):
        plan_ssfusion(sizes, 4, cm.INTER, o, COST, profile=_profile(sizes),
                      buffers=[(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="--fusion selective selection"):
        plan_ssfusion(sizes, 4, cm.INTER, SSFusionOptions(fusion="per-tensor"), COST,
                      profile=_profile(sizes), dense=[2])
    with pytest.raises(ValueError, match="do not cut 4 tensors"):
        cv.mode_step_bytes(M=1, P=3, sizes=sizes, buffer_tensor_counts=[3], density=0.1,
                           fusion="per-tensor")


def test_phase_names_are_the_second_sources():
    """The plan names its phases and profile layout itself; volume.ssfusion, the independent
    closed forms, names them on its own: the two agree."""
    assert ssf_plan.PHASES == (cv.WARMUP, cv.PROFILE, cv.SELECT, cv.DENSE, cv.SPARSE)
    assert ssf_plan.PROFILE_FIELDS == cv.PROFILE_FIELDS
    assert all(ssf_plan.profile_length(L) == cv.profile_length(L) for L in (1, 8, 62))


def _offload_plan(sizes):
    """Selective on two count buffers of the digits CNN: fc1.bias dense in Buffer_AR (split 3),
    fc2.weight (before the split), fc1.weight (after it) and conv2.weight offloaded."""
    o = SSFusionOptions(fusion_policy="count", buffers=2, offload=True)
    plan = plan_ssfusion(sizes, 4, cm.INTER, o, COST, profile=_profile(sizes), dense=[2],
                         split=[3, 0])
    return (dataclasses.replace(plan, offload=(False,) * len(sizes)),
            dataclasses.replace(plan, offload=tuple(l in (1, 3, 5) for l in range(len(sizes)))))


def test_offloaded_segments_are_worker_items_the_gather_waits_for():
    """SSFusion-O (§IV-C) in the records: every offloaded segment is a compute item on the
    offload stream after the backward wrote its tensor, listed where that happens (before the
    buffer's split work when it lies before the split); the buffer's collection
    (ssf_offload_wait[i], no work of its own) waits for exactly those items and the
    all-gather waits for the collection; the compute stream's parts leave the offloaded
    segments' operations to the worker items."""
    model = build_model("cnn", (1, 8, 8), 10)
    names = list(model.layout.names)
    sizes = [int(model.layout.sizes[n]) for n in names]
    off = np.concatenate(([0], np.cumsum(sizes)))
    bare, plan = _offload_plan(sizes)
    pl = Placement.node_major(2, 2)
    items = plan.calls(pl, momentum=True)
    label = {getattr(c, "label", None) or c.phase: k for k, c in enumerate(items)}
    for l in (1, 3, 5):
        w = items[label[f"ssf_offload[{l}]"]]
        seg_k = plan.k[l]
        assert isinstance(w, Work) and w.stream == "offload"
        assert w.after == (Ready(int(off[l]), int(off[l + 1])),)
        assert w.flops == plan.segment_flops(sizes[l], seg_k, True) > 0
    assert label["ssf_offload[1]"] < label["ssf_sparsify_ar[0]"] < label["ssf_dense_allreduce[0]"] \
        < label["ssf_offload[3]"] < label["ssf_sparsify[0]"] < label["ssf_offload_wait[0]"] \
        < label["ssf_sparse_allgather[0]"]
    for i, offloaded in ((0, (1, 3)), (1, (5,))):
        wait = items[label[f"ssf_offload_wait[{i}]"]]
        assert wait.stream == "compute" and wait.flops == 0
        assert wait.after == tuple(label[f"ssf_offload[{l}]"] for l in offloaded)
        gather = items[label[f"ssf_sparse_allgather[{i}]"]]
        assert label[f"ssf_offload_wait[{i}]"] in gather.after
        assert not any(label[f"ssf_offload[{l}]"] in gather.after for l in offloaded)
    # the work moves to the worker: the same element operations in all
    def ops(records):
        return sum(w.flops for w in records if isinstance(w, Work)
                   and w.label.startswith(("ssf_sparsify", "ssf_offload")))
    assert ops(items) == pytest.approx(ops(bare.calls(pl, momentum=True)), rel=1e-12)
    assert not any(isinstance(w, Work) and w.stream == "offload"
                   for w in bare.calls(pl, momentum=True))
    # the traffic does not change
    assert bytes_by_phase(items, pl) == bytes_by_phase(bare.calls(pl, momentum=True), pl)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_program_hands_offloaded_segments_over_during_the_backward(overlap):
    """In the step's program (:func:`dataparallel.program.step_program`) each worker item is an
    offload-stream block right after the backward of the unit that writes its tensor (the
    backward goes on while the worker sparsifies), and the collection waits for those blocks;
    without overlap every record follows the backward."""
    model = build_model("cnn", (1, 8, 8), 10)
    sizes = [int(model.layout.sizes[n]) for n in model.layout.names]
    _, plan = _offload_plan(sizes)
    pl = Placement.node_major(2, 2)
    units = model.compute_units()
    entries = step_program(units, plan.calls(pl, momentum=True), pl, 1, overlap=overlap)
    layer = {e[2]: i for i, e in enumerate(entries) if e[0] == "B" and e[1] == "layer"}
    unit_of = {l: next(u.name for u in units if u.lo <= int(np.sum(sizes[:l])) < u.hi)
               for l in (1, 3, 5)}
    blocks = {e[2]: (i, e) for i, e in enumerate(entries) if e[0] == "B" and e[1] == "clock"}
    last = max(layer.values())
    for l, unit in unit_of.items():
        i, e = blocks[f"ssf_offload[{l}]"]
        assert e[5] == "offload" and e[4] == [layer[f"backward:{unit}"]]
        if overlap:   # right after that unit's backward, before the next unit's
            assert layer[f"backward:{unit}"] < i < min(
                [j for j in layer.values() if j > layer[f"backward:{unit}"]] + [len(entries)])
        else:
            assert i > last
    for i, offloaded in ((0, (1, 3)), (1, (5,))):
        _, e = blocks[f"ssf_offload_wait[{i}]"]
        assert e[5] == "compute"
        assert e[4] == [blocks[f"ssf_offload[{l}]"][0] for l in offloaded]
