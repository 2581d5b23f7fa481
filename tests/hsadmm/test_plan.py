"""The H-SADMM and flat-ADMM records against eq. 15 written from the paper (no MPI), the solver's
options as flags, keep counts and penalty groups.

The records of one iteration (:meth:`hsadmm.plan.HSADMMPlan.calls` with the buckets of
:class:`hsadmm.shrink.ShrinkPlan`, :meth:`hsadmm.plan.FlatADMMPlan.calls`) are what the run
executes and accounts and what ``commvol`` prices.  The second sources are
:func:`volume.hsadmm.hsadmm_eq15_iteration_bytes` (bytes per phase from layer shapes and keep
rates alone: ``|K_out| |K_in| K_H K_W`` per conv weight, every other tensor whole,
``B = ceil(conv numel / 8)``), :func:`volume.hsadmm.hsadmm_iteration_bytes` /
:func:`volume.hsadmm.flat_admm_iteration_bytes` (ring and tree closed forms) and Algorithm 1's
order of phases, written out here; none of them shares code with the plan.
"""

import dataclasses
import itertools

import numpy as np
import pytest
from prediction_helpers import iteration_cost
from traffic_reference import simulated_bcast, simulated_ring

from commvol.predict import predict
from hsadmm.config import PAPER_DEFAULTS, HSADMMConfig
from hsadmm.penalty import increase_penalty, penalty_groups
from hsadmm.plan import FlatADMMPlan, HSADMMPlan, iteration_program, iteration_programs
from hsadmm.projection import keep_count, parse_sparsity, structured_mask
from hsadmm.shrink import ShrinkPlan, kept_indices
from hsadmm.train import TrainConfig, build_parser, solver_config
from models import ModelSpec, ParamSpec, build_model
from substrate.calls import Placement, bytes_by_phase, calls_of_rank
from substrate.options import option_flags
from substrate.program import rebase
from volume.hsadmm import (
    RESIDUALS_PER_LAYER,
    eq15_compact_elems,
    eq15_kept_sets,
    flat_admm_iteration_bytes,
    hsadmm_eq15_iteration_bytes,
    hsadmm_iteration_bytes,
    kept_groups,
)

# odd shapes: 3, 5, 7, 9 channels, 1x1 and 3x3 and 5x3 kernels, an FC and BN tensors
ODD = ModelSpec("odd", (3, 8, 8), 10, (
    ParamSpec("c1.weight", "conv", (5, 3, 3, 3)), ParamSpec("c1.bias", "bias", (5,)),
    ParamSpec("bn1.weight", "bn", (5,)), ParamSpec("bn1.bias", "bn", (5,)),
    ParamSpec("c2.weight", "conv", (7, 5, 1, 1)),
    ParamSpec("c3.weight", "conv", (9, 7, 5, 3)), ParamSpec("c3.bias", "bias", (9,)),
    ParamSpec("fc.weight", "fc", (10, 9)), ParamSpec("fc.bias", "bias", (10,))), 0)
SPARSITIES = ["channel", "filter", "filter+channel", "shape", "channel+shape"]


def _layers(layout):
    return [(n, layout.kind(n), layout.shape(n)) for n in layout.names]


def _groups(layout, cfg):
    return len(penalty_groups(layout, cfg.rho_scope)[0])


def _records(plan, layout, cfg, placement, synced):
    """The records of one iteration: what the run executes and commvol prices."""
    return HSADMMPlan.from_shrink(plan, _groups(layout, cfg)).calls(placement,
                                                                     mask_synced=synced)


def _plan_bytes(plan, layout, cfg, M, P, synced):
    """What the run books and commvol predicts: the records' bytes on ``M x P`` (node-major)."""
    p = Placement.node_major(M, P)
    return bytes_by_phase(_records(plan, layout, cfg, p, synced), p)


def _eq15_bytes(layout, cfg, M, P, synced, overrides=None):
    return hsadmm_eq15_iteration_bytes(M=M, P=P, layers=_layers(layout), keep=cfg.keep,
                                       sparsity=cfg.sparsity, mask_synced=synced,
                                       num_groups=_groups(layout, cfg), keep_overrides=overrides)


#: node-major layouts M x P: the trainers' 2 x 2, 3 ranks per node, one node, one rank per node
LAYOUTS = [(2, 2), (2, 3), (1, 3), (1, 6), (4, 2), (3, 1), (3, 5)]


@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("keep", [0.3, 0.45, 0.5, 0.7])
@pytest.mark.parametrize("M,P", LAYOUTS, ids=[f"{M}x{P}" for M, P in LAYOUTS])
def test_plan_bytes_equal_eq15_on_odd_shapes(sparsity, keep, M, P):
    cfg = HSADMMConfig(keep=keep, sparsity=sparsity, bucket_mib=0.0005)  # several buckets
    plan = ShrinkPlan.from_keep_rates(ODD.layout, cfg)
    assert len(plan.buckets) > 1
    for synced in (True, False):
        got = _plan_bytes(plan, ODD.layout, cfg, M, P, synced)
        assert got == _eq15_bytes(ODD.layout, cfg, M, P, synced)
        # and the ring / tree closed forms with the plan's bucket sizes
        assert got == hsadmm_iteration_bytes(
            M=M, P=P, total_params=ODD.layout.total,
            compact_sizes=[b - a for a, b in plan.buckets], mask_bytes=plan.mask_bytes,
            mask_synced=synced, num_layers=_groups(ODD.layout, cfg))


@pytest.mark.parametrize("M,P", LAYOUTS, ids=[f"{M}x{P}" for M, P in LAYOUTS])
def test_flat_admm_records_equal_the_closed_form(M, P):
    """One dense world ring of theta + u and the residuals, split per link class by the
    node-major ring's chunks (T = 1,239 elements: 4, 6, 8 and 15 ranks cut it unevenly)."""
    T, L = ODD.layout.total, _groups(ODD.layout, HSADMMConfig())
    assert T == 1239
    p = Placement.node_major(M, P)
    calls = FlatADMMPlan(T, L).calls(p)
    assert bytes_by_phase(calls, p) == flat_admm_iteration_bytes(M=M, P=P, total_params=T,
                                                                 num_layers=L)
    assert [(c.phase, c.group, c.nbytes, c.itemsize, c.op, c.after) for c in calls] == [
        ("world_allreduce", tuple(range(M * P)), 4 * T, 4, "sum", ("local",)),
        ("residuals", tuple(range(M * P)), 8 * RESIDUALS_PER_LAYER * L, 8, "sum", (0,))]


def _add(*parts):
    return {k: sum(x[k] for x in parts) for k in ("intra", "inter")}


@pytest.mark.parametrize("placement", [Placement.round_robin(2, 3), Placement.round_robin(3, 2),
                                       Placement.from_sizes([1, 3, 2]),
                                       Placement((1, 0, 1, 0, 2, 2))],
                         ids=lambda p: p.describe())
def test_records_bytes_on_any_placement_equal_simulated_rings_and_trees(placement):
    """Off the node-major layouts :mod:`volume.hsadmm` has no closed form; the records' bytes
    equal a walk of every ring (in communicator order: a node's ranks, the leaders, the world)
    and every binomial tree over the nodes the placement gives its members."""
    cfg = HSADMMConfig(keep=0.5, bucket_mib=0.0005)
    shrink = ShrinkPlan.from_keep_rates(ODD.layout, cfg)
    L, T = _groups(ODD.layout, cfg), ODD.layout.total
    nodes = np.asarray(placement.node_of)
    members = [nodes[list(placement.members(m))] for m in range(placement.num_nodes)]
    leaders = nodes[list(placement.leaders)]
    buckets = [b - a for a, b in shrink.buckets]
    C, B = sum(buckets), shrink.mask_bytes
    want = {"intra_allreduce": _add(*(simulated_ring(T, 4, g) for g in members)),
            "mask_sync": simulated_ring(B, 1, leaders),
            "mask_bcast": _add(*(simulated_bcast(B, g) for g in members)),
            "inter_allreduce": _add(*(simulated_ring(n, 4, leaders) for n in buckets)),
            "bcast_z": _add(*(simulated_bcast(4 * C, g) for g in members)),
            "residuals": simulated_ring(RESIDUALS_PER_LAYER * L, 8, nodes)}
    got = bytes_by_phase(_records(shrink, ODD.layout, cfg, placement, True), placement)
    assert got == want
    assert got["intra_allreduce"]["inter"] == got["bcast_z"]["inter"] == 0
    flat = bytes_by_phase(FlatADMMPlan(T, L).calls(placement), placement)
    assert flat == {"world_allreduce": simulated_ring(T, 4, nodes),
                    "residuals": want["residuals"]}


def _algorithm1(rank, placement, buckets, synced):
    """Algorithm 1's calls as one rank takes part in them, in order (phase, group): its node's
    SUM of theta + u (line 9); while masks are synchronized the leaders' OR (eq. 14) and the
    node's mask broadcast; the leaders' average per compact bucket (line 23); the node's
    broadcast of z (line 24); the world's residual sums."""
    node = placement.members(placement.node(rank))
    lead = placement.leaders if rank in placement.leaders else None
    out = [("intra_allreduce", node)]
    if synced:
        out += [("mask_sync", lead)] * (lead is not None) + [("mask_bcast", node)]
    out += [("inter_allreduce", lead)] * (len(buckets) if lead is not None else 0)
    return out + [("bcast_z", node), ("residuals", placement.world)]


@pytest.mark.parametrize("placement", [Placement.node_major(2, 3), Placement.node_major(4, 2),
                                       Placement.node_major(1, 3), Placement.round_robin(2, 3),
                                       Placement.from_sizes([1, 3, 2])],
                         ids=lambda p: p.describe())
@pytest.mark.parametrize("synced", [True, False])
def test_records_follow_algorithm_1_on_any_placement(placement, synced):
    """Every rank's records in order are Algorithm 1's on its own node's group and the leaders'
    (round-robin and unequal nodes included: the plan takes the placement's groups); sizes,
    ops and roots are the solver's buffers; ``after`` chains the phases as the solver runs
    them: the local epochs, then each phase after every call of the phase before it, bucket
    after bucket."""
    cfg = HSADMMConfig(keep=0.5, bucket_mib=0.0005)
    shrink = ShrinkPlan.from_keep_rates(ODD.layout, cfg)
    L = _groups(ODD.layout, cfg)
    calls = _records(shrink, ODD.layout, cfg, placement, synced)
    buckets = [b - a for a, b in shrink.buckets]
    assert len(buckets) > 1
    for r in range(placement.size):
        mine = [(c.phase, c.group) for c in calls if c.involves(r)]
        assert mine == _algorithm1(r, placement, buckets, synced), r
    layers = _layers(ODD.layout)
    T, C = ODD.layout.total, eq15_compact_elems(layers, 0.5, "channel")
    B = -(-sum(int(np.prod(s)) for _, k, s in layers if k == "conv") // 8)
    M = placement.num_nodes
    want = {"intra_allreduce": (M, 4 * T, 4, "sum"), "mask_sync": (1, B, 1, "bor"),
            "mask_bcast": (M, B, 1, None), "bcast_z": (M, 4 * C, 4, None),
            "residuals": (1, 8 * RESIDUALS_PER_LAYER * L, 8, "sum")}
    for phase, (n, nbytes, itemsize, op) in want.items():
        got = [c for c in calls if c.phase == phase]
        if phase.startswith("mask") and not synced:
            assert got == []
            continue
        assert len(got) == n, phase
        assert {(c.nbytes, c.itemsize, c.op, c.root) for c in got} == \
            {(nbytes, itemsize, op, 0)}, phase
    inter = [c for c in calls if c.phase == "inter_allreduce"]
    assert [c.nbytes for c in inter] == [4 * n for n in buckets]
    assert sum(c.nbytes for c in inter) == 4 * C
    assert all(c.op == "avg" and c.group == placement.leaders for c in inter)
    # dependencies: every call waits for all the calls of the phase before it
    steps: list = []
    for i, c in enumerate(calls):
        key = c.phase if c.phase != "inter_allreduce" else f"inter_allreduce {i}"
        if not steps or steps[-1][0] != key:
            steps.append((key, []))
        steps[-1][1].append(i)
    assert all(calls[i].after == ("local",) for i in steps[0][1])
    for (_, before), (_, now) in itertools.pairwise(steps):
        for i in now:
            assert calls[i].after == tuple(before), (calls[i].phase, calls[i].after, before)
    assert [k for k, _ in steps][-2:] == ["bcast_z", "residuals"]
    for r in range(placement.size):  # every rank waits for the whole chain before residuals
        assert calls_of_rank(calls, r)[-1] == len(calls) - 1


#: the solver's compute blocks in the order Algorithm 1 runs them (masks synchronized or not)
BLOCKS = {True: ["local_sgd", "z_update", "mask_update", "shrink", "expand_duals", "penalties"],
          False: ["local_sgd", "z_update", "shrink", "expand_duals", "penalties"]}


@pytest.mark.parametrize("placement", [Placement.node_major(2, 3), Placement.node_major(1, 3),
                                       Placement.round_robin(2, 2)],
                         ids=lambda p: p.describe())
@pytest.mark.parametrize("synced", [True, False])
def test_iteration_program_runs_algorithm_1_in_two_parts(placement, synced):
    """A rank's program of one H-SADMM iteration: the local epochs (2 steps of the model's
    units), then Algorithm 1's calls as the rank takes part in them, the leaders' calls as
    waits on a follower (after the compute before them), the solver's blocks between them after
    the calls whose results they read; cut before the shrink (the mask update can rebuild the
    shrink plan), the second part after everything before it, ending the step.  Flat ADMM's is
    one part."""
    cfg = HSADMMConfig(keep=0.5, bucket_mib=0.0005)
    shrink = ShrinkPlan.from_keep_rates(ODD.layout, cfg)
    L = _groups(ODD.layout, cfg)
    records = HSADMMPlan.from_shrink(shrink, L).records(placement, mask_synced=synced)
    units = build_model("cnn", (1, 8, 8), 10).compute_units()
    buckets = [b - a for a, b in shrink.buckets]
    for r in range(placement.size):
        head, tail = iteration_programs(records, units, 2, placement, r, overlap=True)
        whole = head + rebase(tail, -len(head))
        assert whole == iteration_program(records, units, 2, placement, r, overlap=True)
        layers = [e[2] for e in head if e[:2] == ["B", "layer"]]
        assert layers == 2 * ([f"forward:{u.name}" for u in units] + ["forward:loss"]
                              + [f"backward:{u.name}" for u in reversed(units)])
        assert [e[2] for e in whole if e[:2] == ["B", "clock"]] == BLOCKS[synced]
        assert tail[0][:3] == ["B", "clock", "shrink"] and tail[0][4] == []
        assert "S" not in [e[0] for e in head] and tail[-1] == ["S"]
        calls = [(e[1].phase, e[1].group) for e in whole if e[0] == "C" and e[3]]
        assert calls == _algorithm1(r, placement, buckets, synced)
        waits = [(i, e[1].phase, e[2]) for i, e in enumerate(whole) if e[0] == "C" and not e[3]]
        if r in placement.leaders:
            assert waits == []
            continue
        block = {e[2]: i for i, e in enumerate(whole) if e[:2] == ["B", "clock"]}
        sync = [("mask_sync", [block["z_update"]])] if synced else []
        assert [(ph, a) for _, ph, a in waits][:len(sync) + 1] == [
            *sync, ("inter_allreduce", [block["shrink"]])]
        inter = [(i, a) for i, ph, a in waits if ph == "inter_allreduce"]
        assert len(inter) == len(buckets)
        assert all(a == [i0] for (i0, _), (_, a) in itertools.pairwise(inter))
    flat = FlatADMMPlan(ODD.layout.total, L).records(placement)
    (whole,) = iteration_programs(flat, units, 1, placement, 0, overlap=True)
    assert [e[2] if e[0] == "B" else e[1].phase for e in whole
            if e[:2] == ["B", "clock"] or e[0] == "C"] == [
        "local_sgd", "world_allreduce", "z_update", "residuals", "penalties"]


@pytest.mark.parametrize("model", ["cnn", "resnet"])
@pytest.mark.parametrize("sparsity", ["channel", "filter+channel", "shape"])
def test_predicted_iterations_equal_eq15_for_the_trainers_models(model, sparsity):
    """``commvol predict``'s per-iteration bytes (before and after the freeze) for the digits
    models on 2 nodes x 3 ranks equal eq. 15's, also with a per-layer keep file."""
    spec = build_model(model, (1, 8, 8), 10).spec()
    pred = predict("hsadmm", spec=spec, nodes=2, gpus_per_node=3, keep=0.5, sparsity=sparsity,
                   freeze_iter=2)
    cfg = HSADMMConfig(keep=0.5, sparsity=sparsity)
    assert iteration_cost(pred, 0).phases == _eq15_bytes(spec.layout, cfg, 2, 3, True)
    assert iteration_cost(pred, 5).phases == _eq15_bytes(spec.layout, cfg, 2, 3, False)


def test_keep_file_overrides_reach_the_plan(tmp_path):
    spec = build_model("resnet", (1, 8, 8), 10).spec()
    over = {"layer2.0.conv1.weight": 0.25, "layer3.0.conv2.weight": 0.75}
    path = tmp_path / "keep.json"
    path.write_text(__import__("json").dumps(over))
    cfg = HSADMMConfig(keep=0.5, keep_file=str(path))
    pred = predict("hsadmm", spec=spec, nodes=3, gpus_per_node=3, keep=0.5, keep_file=str(path))
    assert iteration_cost(pred, 0).phases == _eq15_bytes(spec.layout, cfg, 3, 3, True, over)
    assert iteration_cost(pred, 0).phases != _eq15_bytes(spec.layout, cfg, 3, 3, True)


@pytest.mark.parametrize("sparsity", ["channel", "filter", "filter+channel"])
def test_eq15_sets_are_those_of_the_real_projection(sparsity):
    """|K_out|, |K_in| of the closed form = those of the projection of a random weight."""
    rng = np.random.default_rng(3)
    for shape in [(5, 3, 3, 3), (9, 7, 5, 3), (4, 9, 1, 1)]:
        w = rng.standard_normal(shape)
        ko, ki = kept_indices(structured_mask(w, parse_sparsity(sparsity), 0.5))
        assert (ko.size, ki.size) == eq15_kept_sets(shape, 0.5, sparsity)


def test_keep_count_rounds_to_nearest_ties_up():
    # keep 0.5 of 9 keeps 5 (not Python's round-half-to-even 4), of 11 keeps 6
    assert [keep_count(0.5, n) for n in (1, 2, 3, 9, 11)] == [1, 1, 2, 5, 6]
    assert keep_count(0.4, 64) == 26 and keep_count(0.01, 10) == 1 and keep_count(1.0, 7) == 7
    for n in range(1, 40):
        for keep in (0.1, 0.25, 0.3, 0.5, 0.7, 0.9):
            assert keep_count(keep, n) == kept_groups(keep, n)


def test_penalty_groups_are_layers():
    layout = build_model("resnet", (1, 8, 8), 10).layout
    groups, of = penalty_groups(layout, "layer")
    names = list(layout.names)
    # a layer's tensors share one group; BatchNorm's scale and shift are one layer
    assert of[names.index("layer1.0.bn1.weight")] == of[names.index("layer1.0.bn1.bias")]
    assert of[names.index("fc.weight")] == of[names.index("fc.bias")]
    assert of[names.index("layer1.0.bn1.weight")] != of[names.index("layer1.0.conv1.weight")]
    assert len(groups) == len({n.rsplit(".", 1)[0] for n in names}) < len(names)
    per_tensor, of_t = penalty_groups(layout, "tensor")
    assert per_tensor == names and list(of_t) == list(range(len(names)))


def test_train_flags_come_from_the_dataclasses():
    p = build_parser()
    text = p.format_help()
    for cls in (TrainConfig, HSADMMConfig):
        for name, flag in option_flags(cls).items():
            assert f"{flag} " in text or f"{flag}\n" in text, (name, flag)
    assert "--iters ITERS" in text and "--batch-size BATCH_SIZE" in text
    assert "--batch " not in text and "--iterations" not in text
    args = p.parse_args(["--rho-scope", "tensor", "--theta-weight-decay", "--keep", "0.3"])
    cfg = solver_config(args)
    assert (cfg.rho_scope, cfg.theta_weight_decay, cfg.keep) == ("tensor", True, 0.3)


def test_paper_defaults_fill_only_options_not_given():
    p = build_parser()
    cfg = solver_config(p.parse_args(["--paper-defaults", "--rho1", "0.5"]))
    assert cfg.rho1 == 0.5  # given on the command line
    want = {k: v for k, v in PAPER_DEFAULTS.items() if k != "rho1"}
    assert {k: getattr(cfg, k) for k in want} == want
    assert dataclasses.replace(cfg, rho1=0.05) != HSADMMConfig()


@pytest.mark.parametrize("bad,message", [
    ({"rho_scope": "model"}, "--rho-scope 'model' unknown"),
    ({"freeze_patience": -1}, "--freeze-patience must be >= 0"),
    ({"keep": 0.0}, "keep rate must be in (0, 1]"),
])
def test_bad_options_name_the_flag(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HSADMMConfig(**bad)


def test_increase_penalty_doubles_to_the_cap():
    """--rho-update increase: PruneX §5.1.5's rho1 = 1.5e-3 reaches the cap 10 after 13
    doublings; the scaled duals are rescaled by rho_old / rho_new."""
    rho, steps = np.array([1.5e-3, 20.0]), 0
    while rho[0] < 10:
        new, scale = increase_penalty(rho, rho_max=10.0)
        assert np.allclose(scale * new, rho) and new[1] == 20.0  # above the cap: left alone
        rho, steps = new, steps + 1
    assert steps == 13 and rho[0] == 10.0
    with pytest.raises(ValueError, match="tau > 1"):
        increase_penalty(rho, tau=1.0)
    with pytest.raises(ValueError, match="--rho-update 'grow' unknown"):
        HSADMMConfig(rho_update="grow")
