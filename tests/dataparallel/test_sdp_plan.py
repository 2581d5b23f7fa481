"""SDP's plan (:class:`dataparallel.sdp.SDPPlan`): the bytes of its call records
(:meth:`~dataparallel.sdp.SDPPlan.calls`) against the paper's closed forms
(:func:`volume.sdp.neuron_sdp_bytes`, :func:`volume.sdp.block_sdp_bytes`) on node-major and
round-robin placements, and the records' groups and dependencies.

The closed-form side is computed here from the layer shapes by the paper's definitions only:
N-SDP at coverage ``p/n`` puts every masked parameter on exactly ``p`` of the ``n`` workers (§4),
the masked layers being hidden layers no two of which are adjacent (§3.2 masks a layer's
outputs with the next layer's inputs), chosen to mask the most parameters (enumerated here by
brute force); B-SDP deals ``b`` of ``d`` blocks to every worker.  A wrong plan (an extra holder,
a coordinate in the wrong group) changes the degrees or the bytes and fails here.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
from sdp_reference import neuron_layers

from commvol.predict import predict
from dataparallel.program import OPTIMIZER, UPDATED, step_program
from dataparallel.sdp import ASSEMBLE, BCAST, GATED, SDPOptions, SDPPlan
from models import build_model, cnn, resnet
from substrate.calls import Call, Placement, Ready, Work, bytes_by_phase
from substrate.costmodel import CostModel
from volume import collectives as cm
from volume import sdp as vsdp
from volume.sdp import block_sdp_bytes, neuron_sdp_bytes

SHAPE = (1, 8, 8)


def _models():
    """name -> model: the digits CNN, the small ResNet and odd widths (uneven chunks)."""
    return {"cnn": build_model("cnn", SHAPE, 10),
            "resnet": build_model("resnet", SHAPE, 10),
            "cnn-odd": cnn(SHAPE, 10, channels=(5, 7), hidden=11),
            "cnn-wide-conv2": cnn(SHAPE, 10, channels=(2, 60), hidden=3),  # masks conv2 only
            "resnet-odd": resnet(SHAPE, 10, depths=(2, 1), planes=(5, 7))}


MODELS = _models()


def block_sizes(model):
    L = model.layout
    blocks = sorted({".".join(n.split(".")[:2]) for n in L.names if n.startswith("layer")})
    sizes = [sum(L.sizes[n] for n in L.names if n.startswith(b + ".") and ".shortcut." not in n)
             for b in blocks]
    return sizes, L.total - sum(sizes)


def _wire(b):
    return b["intra"] + b["inter"]


ZERO = {"intra": 0, "inter": 0}


def records(plan, where, **kw):
    """``{phase: {"intra", "inter"}}`` of one step's records and of the assembly."""
    step = bytes_by_phase(plan.calls(where, **kw), where)
    return step, bytes_by_phase(plan.assembly_calls(where), where).get(ASSEMBLE, ZERO)


def placements(M, P):
    """The node-major placement and, with several nodes of several ranks, the round-robin one,
    each with its node ids for the closed forms."""
    out = [(Placement.node_major(M, P), np.arange(M * P) // P)]
    if M > 1 and P > 1:
        out.append((Placement.round_robin(M, P), np.arange(M * P) % M))
    return out


def test_phase_names_are_the_closed_forms():
    assert (GATED, BCAST, ASSEMBLE) == (vsdp.GATED, vsdp.BCAST, vsdp.ASSEMBLE)


# -- N-SDP ---------------------------------------------------------------------------------------
SHAPES = ((2, 2), (2, 3), (3, 3), (1, 3), (1, 6), (4, 2))
NEURON_CASES = [(name, M, P, p) for name in MODELS for M, P in SHAPES
                for p in range(1, M * P + 1)]


@pytest.mark.parametrize("name,M,P,p", NEURON_CASES)
def test_neuron_plan_equals_paper_closed_form(name, M, P, p):
    model = MODELS[name]
    n = M * P
    plan = SDPPlan.for_model(model, M, P, SDPOptions(coverage=f"{p}/{n}"), seed=0)
    layers, rest = neuron_layers(model)
    masked = model.layout.total - rest
    # every masked parameter on exactly p workers, everything else on all n (paper §4)
    want_hist = {p: masked, n: rest} if p < n else {n: model.layout.total}
    assert plan.degree_histogram() == want_hist
    assert plan.coverage_realized == Fraction(p * masked + n * rest, n * model.layout.total)
    for where, node_of in placements(M, P):
        closed = neuron_sdp_bytes(layers, rest, p, node_of)
        step, assembly = records(plan, where)
        assert step.get(GATED, ZERO) == closed["gated"], where.describe()
        assert assembly == closed["assemble"], where.describe()
        # §3.2: each parameter is all-reduced among its holders, 2 (d - 1) floats per parameter
        assert _wire(step.get(GATED, ZERO)) == 8 * ((p - 1) * masked + (n - 1) * rest)
        assert set(step) <= {GATED}            # forward masking: no broadcast
        with_eval = bytes_by_phase(plan.calls(where, assemble=True), where)
        assert with_eval.get(ASSEMBLE, ZERO) == closed["assemble"]


def test_digits_cnn_masks_conv1_and_fc1():
    """Hand count (38,282 parameters): conv1 (16 x 9 + 16) with conv2's input columns
    (32 x 16 x 9) and fc1 (64 x 512 + 64) with fc2's columns (10 x 64) are masked; conv2's
    bias (32) and fc2's bias (10) stay on every worker."""
    layers, rest = neuron_layers(MODELS["cnn"])
    assert layers == [(16, 10 + 288, 0), (64, 513 + 10, 0)] and rest == 42
    plan = SDPPlan.for_model(MODELS["cnn"], 2, 2, SDPOptions(coverage="2/4"))
    assert plan.detail["masked"] == ["conv1", "fc1"]
    # the reported case: at 2/4 the gated traffic is (p-1)/(n-1) = 1/3 of DDP's, not 0.008
    ddp = 8 * 3 * 38282
    gated = records(plan, Placement.node_major(2, 2))[0][GATED]
    assert _wire(gated) / ddp == pytest.approx((38240 / 3 + 42) / 38282)


# -- B-SDP / B_b-SDP -----------------------------------------------------------------------------
BLOCK_CASES = [(name, mode, M, P, b, seed)
               for name in ("resnet", "resnet-odd") for mode in ("block", "block-backward")
               for M, P in SHAPES for b in (1, 2, 3) for seed in (0, 7)]


@pytest.mark.parametrize("name,mode,M,P,b,seed", BLOCK_CASES)
def test_block_plan_equals_paper_closed_form(name, mode, M, P, b, seed):
    model = MODELS[name]
    n = M * P
    sizes, rest = block_sizes(model)
    d = len(sizes)
    if n * b < d:
        pytest.skip("blocks without holders")
    plan = SDPPlan.for_model(model, M, P, SDPOptions(sdp_mode=mode, active_blocks=f"{b}/{d}"),
                             seed=seed)
    order = plan.detail["order"]
    assert sorted(order) == list(range(d))
    for where, node_of in placements(M, P):
        closed = block_sdp_bytes(sizes, rest, b, order, node_of,
                                 backward=mode == "block-backward")
        step, assembly = records(plan, where)
        assert step.get(GATED, ZERO) == closed["gated"], where.describe()
        if closed["bcast"] is None:
            assert BCAST not in step
        else:
            assert step.get(BCAST, ZERO) == closed["bcast"], where.describe()
            # the refresh is the strategy's after_step: left out when it did not run
            assert BCAST not in records(plan, where, refresh=False)[0]
        # B-SDP: rank 0 lacks the blocks it dropped; B_b-SDP holds the full model everywhere
        assert (assembly == ZERO) == (mode == "block-backward" or plan.held(0) == plan.total)
    # every worker runs exactly b blocks (paper §4: A = b/d)
    L = model.layout
    firsts = [next(nm for nm in L.names if nm.startswith(blk + ".") and ".shortcut." not in nm)
              for blk in plan.detail["blocks"]]
    masks = np.array([plan.mask(r) for r in range(n)])
    assert [int(sum(masks[r, L.slice(nm).start] for nm in firsts)) for r in range(n)] == [b] * n
    assert sum(plan.detail["block_degrees"]) == n * b


# -- the prediction uses the same plan -----------------------------------------------------------
@pytest.mark.parametrize("model,kw,M,P", [("cnn", {"coverage": "2/6"}, 2, 3),
                                          ("resnet", {"sdp_mode": "block-backward",
                                                      "active_blocks": "2/3"}, 3, 3)])
def test_prediction_is_the_closed_form(model, kw, M, P):
    pred = predict("sdp", model, nodes=M, gpus_per_node=P, **kw)
    m = build_model(model, SHAPE, 10)
    n = M * P
    if model == "cnn":
        layers, rest = neuron_layers(m)
        node_of = np.arange(n) // P
        closed = neuron_sdp_bytes(layers, rest, 2, node_of)
        assert pred.steady.phases == {"sdp_gated_allreduce": closed["gated"]}
        assert pred.evaluation.phases == {"sdp_assemble": closed["assemble"]}
        # N-SDP 2/6 by hand: the world ring of the rest (6 x 2 x 5 messages) and 6 windows
        # {c, c+1} of 2 (2 x 2 x 1 each); windows 1..4 lack rank 0, one message each
        assert pred.steady.messages == {GATED: 60 + 6 * 4}
        assert pred.evaluation.messages == {ASSEMBLE: 4}
        # every rank's modeled time is its own calls': the world ring and its 2 windows
        cost = CostModel()
        per_window = sum(np.array([len(a) for a in np.array_split(np.arange(w), n)]) * per
                         for w, per, _ in layers)
        link = [cm.INTRA if node_of[c] == node_of[(c + 1) % n] else cm.INTER for c in range(n)]
        window_s = [cost.ring_allreduce_time(4 * int(per_window[c]), 2, link[c])
                    for c in range(n)]
        world_s = cost.ring_allreduce_time(4 * rest, n, cm.INTER)
        assert pred.steady.rank_s == pytest.approx(
            [world_s + window_s[r] + window_s[(r - 1) % n] for r in range(n)], rel=1e-12)
        assert pred.evaluation.rank_s == pytest.approx(
            [0.0] + [cost.p2p_time(4 * int(per_window[c]), cm.INTRA if node_of[c] == 0 else
                                   cm.INTER) for c in range(1, n - 1)] + [0.0], rel=1e-12)
    else:
        sizes, rest = block_sizes(m)
        order = SDPPlan.for_model(m, M, P, SDPOptions(**kw)).detail["order"]
        closed = block_sdp_bytes(sizes, rest, 2, order, np.arange(n) // P, backward=True)
        assert pred.steady.phases == {"sdp_gated_allreduce": closed["gated"],
                                      "sdp_param_bcast": closed["bcast"]}


@pytest.mark.parametrize("name,M,P,kw", [
    ("cnn", 2, 3, {"coverage": "2/6"}), ("resnet-odd", 4, 2, {"coverage": "3/8"}),
    ("resnet", 2, 2, {"sdp_mode": "block-backward", "active_blocks": "1/3"}),
    ("resnet", 1, 3, {"sdp_mode": "block", "active_blocks": "2/3"})])
def test_records_are_the_holder_groups_in_each_ranks_order(name, M, P, kw):
    """Per holder set with two or more holders one SUM all-reduce over its members (ascending
    world ranks, the sub-communicator's order) of its coordinates, after the backward wrote
    them; B_b-SDP's broadcasts from the set's lowest holder; the assembly's messages to rank 0.
    Each record waits for exactly the previous record of each of its members (every rank runs
    its calls one after another; disjoint groups overlap)."""
    model = MODELS[name]
    plan = SDPPlan.for_model(model, M, P, SDPOptions(**kw), seed=3)
    where = Placement.round_robin(M, P)
    calls = plan.calls(where, assemble=True)
    n = M * P
    sets = {}
    for s_ in range(len(plan.sets)):
        idx = np.flatnonzero(plan.set_id == s_)
        if idx.size:
            sets[tuple(r for r in range(n) if plan.sets[s_] >> r & 1)] = idx
    gated = [c for c in calls if c.phase == GATED]
    assert {c.group: c.nbytes // 4 for c in gated} == {g: idx.size for g, idx in sets.items()
                                                       if len(g) >= 2}
    last = {}
    for i, c in enumerate(calls):
        members = c.pairs[:, 0].tolist() if c.algorithm == "p2p" else c.group
        deps = sorted({last[r] for r in members if r in last})
        assert [d for d in c.after if not isinstance(d, Ready)] == deps, (i, c.phase)
        ready = [d for d in c.after if isinstance(d, Ready)]
        if c.phase == GATED:
            idx = sets[c.group]
            assert c.op == "sum" and ready == [Ready(int(idx[0]), int(idx[-1]) + 1)]
        else:
            assert not ready
        if c.phase == BCAST:
            holders = next(g for g in sets if g[0] == c.group[c.root] and len(g) < n
                           and sets[g].size * 4 == c.nbytes)
            assert set(c.group) == {holders[0]} | (set(range(n)) - set(holders))
        if c.phase == ASSEMBLE:
            assert c.group == where.world and set(c.pairs[:, 1].tolist()) == {0}
        if c.algorithm != "p2p":
            for r in members:
                last[r] = i
    assert (BCAST in {c.phase for c in calls}) == (kw.get("sdp_mode") == "block-backward")
    with pytest.raises(ValueError, match="on a placement of"):
        plan.calls(Placement.node_major(1, n + 1))


@pytest.mark.parametrize("name,M,P,kw", [
    ("cnn", 2, 2, {"coverage": "3/4"}), ("cnn", 2, 3, {"coverage": "2/6"}),
    ("resnet", 2, 2, {"sdp_mode": "block-backward", "active_blocks": "1/3"}),
    ("resnet", 1, 3, {"sdp_mode": "block", "active_blocks": "2/3"})])
def test_run_records_are_the_calls_with_each_ranks_compute(name, M, P, kw):
    """A rank's records of a step (what its step program is generated from): the calls of
    :meth:`SDPPlan.calls` in the same order (the gated all-reduces on the communication
    stream; the assembly only before an evaluation), each held set's packing before its
    all-reduce and its unpacking after every call, the mask after the unpackings; B_b-SDP's
    broadcasts and the assembly after the update, and rank 0 places what it received."""
    model = MODELS[name]
    plan = SDPPlan.for_model(model, M, P, SDPOptions(**kw), seed=3)
    where = Placement.round_robin(M, P) if M > 1 and P > 1 else Placement.node_major(M, P)
    for rank in range(M * P):
        for evaluate in (False, True):
            recs = plan.records(where, rank, evaluate=evaluate)
            calls = [r for r in recs if not isinstance(r, Work)]
            want = plan.calls(where, assemble=evaluate)
            assert [c.key() for c in calls] == [c.key() for c in want]
            assert [c.wait for c in calls] == [c.phase != GATED for c in want]
            assert (ASSEMBLE in {c.phase for c in calls}) == (evaluate and bool(
                plan.assemble_counts))
            work = {r.label: i for i, r in enumerate(recs) if isinstance(r, Work)}
            held = [j for j, s_ in enumerate(plan.reduce_sets) if rank in plan.members(s_)]
            assert sorted(k for k in work if k.startswith("sdp_pack")) == \
                sorted(f"sdp_pack[{j}]" for j in held)
            gated = [i for i, r in enumerate(recs) if getattr(r, "phase", None) == GATED]
            for j, i in enumerate(gated):
                if j in held:
                    pack = work[f"sdp_pack[{j}]"]
                    assert pack == i - 1 and pack in recs[i].after
                    assert recs[work[f"sdp_unpack[{j}]"]].after == (i,)
                    assert work[f"sdp_unpack[{j}]"] > gated[-1]
            assert recs[work["sdp_mask"]].after[1:] == tuple(work[f"sdp_unpack[{j}]"]
                                                             for j in held)
            for i, r in enumerate(recs):
                if getattr(r, "phase", None) in (BCAST, ASSEMBLE):
                    assert r.after[0] == UPDATED and i > work["sdp_mask"]
            assert ("sdp_assemble" in work) == (rank == 0 and ASSEMBLE in {
                c.phase for c in calls})
            # the rank's program: only its own calls (a holder set that is the node leaders'
            # is no leaders' phase), the broadcasts and the assembly after the update
            prog = step_program(model.compute_units(), recs, where, rank, leader_waits=False)
            entries = [e for e in prog if e[0] == "C"]
            assert all(e[3] for e in entries)
            want = []
            for c in calls:
                if c.algorithm == "p2p":           # a sender's messages, one entry each
                    want += [Call(c.phase, "p2p", c.group, pairs=row[None]).key()
                             for row in c.pairs if row[0] == rank]
                elif c.involves(rank):
                    want.append(c.key())
            assert [e[1].key() for e in entries] == want
            opt = next(i for i, e in enumerate(prog) if e[0] == "B" and e[2] == OPTIMIZER)
            for i, e in enumerate(prog):
                if e[0] == "C" and e[1].phase in (BCAST, ASSEMBLE):
                    assert i > opt
                if e[0] == "B" and e[2] == "sdp_assemble":
                    assert i > opt and rank == 0


def test_closed_forms_hand_computed():
    """N-SDP 2/4 on 2 x 2, one masked layer of 4 neurons with 3 parameters each, 5 others:
    windows {0,1} {1,2} {2,3} {3,0} carry 3 parameters each; rings of 2 send 2 x 3 floats each
    way: {0,1} and {2,3} intra, {1,2} and {0,3} inter; the world ring of 5 floats sends
    2 x 3 x 5 floats, half across the 2 node-crossing links.  Rank 0 lacks windows 1 and 2."""
    node_of = np.array([0, 0, 1, 1])
    out = neuron_sdp_bytes([(4, 3, 0)], 5, 2, node_of)
    world = cm.ring_allreduce_split(5, 4, node_of)
    assert out["gated"] == {"intra": 2 * 2 * 3 * 4 + world["intra"],
                            "inter": 2 * 2 * 3 * 4 + world["inter"]}
    assert out["assemble"] == {"intra": 3 * 4, "inter": 3 * 4}
    # blocks of 10 and 20 on 2 workers with b = 1, order (1, 0): worker 0 keeps block 1
    blk = block_sdp_bytes([10, 20], 0, 1, [1, 0], np.array([0, 1]), backward=True)
    assert blk == {"gated": {"intra": 0, "inter": 0},
                   "bcast": {"intra": 0, "inter": 4 * (10 + 20)}}
    assert math.isclose(_wire(neuron_sdp_bytes([(4, 3, 0)], 0, 4, node_of)["gated"]),
                        8 * 3 * 12)
