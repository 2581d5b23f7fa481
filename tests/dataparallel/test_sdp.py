"""SDP (paper 003): masks, gated average, spectral gap, memory, FLOP matching, closed-form bytes,
bad flags.  MPI checks live in ``tests/mpi/dp_sdp_checks.py`` (4 ranks, 2 virtual nodes)."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from mpi_helpers import (
    JobBatch,
    assert_fails_on_every_rank,
    assert_measured_equals_predicted,
    read_summary,
)
from scipy.linalg import null_space

from commvol.predict import predict
from dataparallel.sdp import (
    SDPOptions,
    SDPPlan,
    _check_connected,
    parse_active_blocks,
    parse_fraction,
    plan_masks,
    spectral_gap,
    window_sets,
    worker_memory,
)
from models import build_model
from substrate.options import flag_of
from volume import collectives as cm
from volume.dataparallel import world_ring_bytes
from volume.sdp import (
    assemble_bytes,
    gated_allreduce_bytes,
    neuron_sdp_bytes,
    param_bcast_bytes,
    sdp_step_bytes,
)

SHAPE = (1, 8, 8)


@pytest.fixture(scope="module")
def cnn():
    return build_model("cnn", SHAPE, 10)


@pytest.fixture(scope="module")
def resnet():
    return build_model("resnet", SHAPE, 10)


def _members(bits):
    return {r for r in range(bits.bit_length()) if bits >> r & 1}


# -- flags ---------------------------------------------------------------------------------------
def test_parse_coverage_and_active_blocks():
    assert parse_fraction("2/4") == Fraction(1, 2)
    assert parse_fraction("0.75") == Fraction(3, 4)
    assert parse_fraction(" 1 ") == 1
    assert parse_active_blocks("2/3") == (2, 3)
    assert parse_active_blocks("2") == (2, None)
    assert parse_active_blocks("") is None


def test_paper_defaults_and_named_deviation():
    """The paper evaluates the assembled model as is: weight scaling is an opt-in flag."""
    o = SDPOptions()
    assert o.eval_rescale is False and flag_of(SDPOptions, "eval_rescale") == "--eval-rescale"
    assert (o.sdp_mode, o.coverage, o.flop_match) == ("neuron", "3/4", False)


@pytest.mark.parametrize("kw,message", [
    ({"coverage": "1.5"}, "--coverage must be in (0, 1]"),
    ({"coverage": "0"}, "--coverage must be in (0, 1]"),
    ({"coverage": "5/4"}, "--coverage must be in (0, 1]"),
    ({"coverage": "-1/4"}, "--coverage must be in (0, 1]"),
    ({"coverage": "abc"}, "--coverage 'abc' is malformed; write p/n"),
    ({"coverage": "3/0"}, "--coverage '3/0' is malformed"),
    ({"coverage": "1/2/3"}, "--coverage '1/2/3' is malformed"),
    ({"sdp_mode": "block", "active_blocks": "4/3"}, "b = 4 exceeds the d = 3 blocks"),
    ({"sdp_mode": "block", "active_blocks": "0/3"}, "needs b >= 1 active block"),
    ({"sdp_mode": "block", "active_blocks": "two"}, "--active-blocks 'two' is malformed"),
    ({"sdp_mode": "neuron", "active_blocks": "2/3"}, "--active-blocks applies to --sdp-mode"),
    ({"sdp_mode": "neurons"}, "--sdp-mode 'neurons' unknown"),
])
def test_bad_flags_raise_value_error(kw, message):
    with pytest.raises(ValueError) as e:
        SDPOptions(**kw)
    assert message in str(e.value)


def test_plan_rejects_masks_without_holders(cnn, resnet):
    with pytest.raises(ValueError, match=r"p = 1.33333.*use --coverage p/4"):
        plan_masks(cnn, "neuron", 4, coverage=Fraction(1, 3))
    with pytest.raises(ValueError, match="has none; use --model resnet or --sdp-mode neuron"):
        plan_masks(cnn, "block", 4, coverage=Fraction(3, 4))
    with pytest.raises(ValueError, match=r"has d = 3 residual blocks; use --active-blocks b/3"):
        plan_masks(resnet, "block", 4, coverage=Fraction(1), active_blocks=(2, 4))
    with pytest.raises(ValueError, match=r"n b = 2 < d = 3\); use b >= 2"):
        plan_masks(resnet, "block-backward", 2, coverage=Fraction(1), active_blocks=(1, 3))


def test_disconnected_masks_are_rejected():
    """Two workers that share no coordinate never agree (paper §3.1 assumes connectivity)."""
    kw = {"mode": "neuron", "buffer_ids": {}, "scale": np.ones(4), "coverage": Fraction(1, 2),
              "detail": {}}
    split = SDPPlan(n=4, sets=(0b1111, 0b0011, 0b1100), set_id=np.array([1, 1, 2, 2]), **kw)
    with pytest.raises(ValueError, match="raise p in --coverage p/4"):
        _check_connected(split, Fraction(1, 2))
    _check_connected(SDPPlan(n=4, sets=(0b1111, 0b0011, 0b1100),
                             set_id=np.array([0, 1, 2, 2]), **kw), Fraction(1, 2))


# -- masks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 13))
def test_window_family(n):
    for p in range(1, n + 1):
        win = window_sets(n, p)
        assert all(len(_members(s)) == p for s in win)
        assert [sum(s >> r & 1 for s in win) for r in range(n)] == [p] * n  # balanced


@pytest.mark.parametrize("n,p", [(4, 1), (4, 2), (4, 3), (4, 4), (8, 3), (8, 4), (8, 6), (6, 3)])
def test_neuron_masks_give_every_parameter_degree_p_or_n(cnn, n, p):
    """Paper §4: every masked θ_j on exactly p of the n workers (conv1 and fc1 with the next
    layers' input columns on the digits CNN; conv2's bias and fc2's bias on all)."""
    plan = plan_masks(cnn, "neuron", n, coverage=Fraction(p, n))
    m = np.array([plan.mask(r) for r in range(n)])
    L = cnn.layout
    for name in ("conv1.weight", "conv1.bias", "conv2.weight", "fc1.weight", "fc1.bias",
                 "fc2.weight"):
        assert (m[:, L.slice(name)].sum(axis=0) == p).all(), name
    for name in ("conv2.bias", "fc2.bias"):
        assert (m[:, L.slice(name)].sum(axis=0) == n).all(), name
    assert plan.degree_histogram() == ({p: L.total - 42, n: 42} if p < n else {n: L.total})
    if p == n:
        assert (plan.counts[1:] == 0).all()                       # C = 1: plain DDP


def test_neuron_masks_on_resnet_mask_inner_channels_only(resnet):
    plan = plan_masks(resnet, "neuron", 4, coverage=Fraction(1, 2))
    m = np.array([plan.mask(r) for r in range(4)])
    L = resnet.layout
    assert m.sum(axis=0).min() >= 1
    for name in L.names:
        deg = m[:, L.slice(name)].sum(axis=0)
        inner = ".conv1." in name or ".bn1." in name or ".conv2." in name
        if name.startswith("layer") and ".shortcut." not in name and inner:
            assert (deg == 2).all(), name                         # p = 2 holders per channel
        else:
            assert (deg == 4).all(), name                         # residual stream: everyone


def test_block_masks_whole_blocks(resnet):
    plan = plan_masks(resnet, "block", 4, coverage=Fraction(1), active_blocks=(2, 3), seed=5)
    assert plan.detail["b"] == 2 and sorted(plan.detail["block_degrees"]) == [2, 3, 3]
    m = np.array([plan.mask(r) for r in range(4)])
    assert m.sum(axis=0).min() >= 1
    again = plan_masks(resnet, "block", 4, coverage=Fraction(1), active_blocks=(2, 3), seed=5)
    assert np.array_equal(plan.set_id, again.set_id)             # same seed, same mask
    # default b from the coverage: round(3/4 * 3) = 2
    assert plan_masks(resnet, "block", 4, coverage=Fraction(3, 4)).detail["b"] == 2


# -- memory --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,p", [(4, 2), (4, 3), (8, 4), (8, 6)])
def test_neuron_memory_counts_only_the_subnetwork(cnn, n, p):
    plan = plan_masks(cnn, "neuron", n, coverage=Fraction(p, n))
    L, C = cnn.layout, p / n
    # every worker holds a fraction C of conv1's and fc1's rows and of their consumers' columns
    frac = {"conv1.weight": C, "conv1.bias": C, "conv2.weight": C, "conv2.bias": 1.0,
            "fc1.weight": C, "fc1.bias": C, "fc2.weight": C, "fc2.bias": 1.0}
    want = round(sum(frac[nm] * L.sizes[nm] for nm in L.names))
    mem = worker_memory(plan, 4, momentum=True)
    assert [plan.held(r) for r in range(n)] == [want] * n
    assert mem["memory_bytes"] == [3 * 4 * want] * n and mem["memory_ddp_bytes"] == 12 * L.total
    # ≈ C × DDP (paper §3.2), plus the 42 biases on every worker
    assert mem["memory_ratio_max"] == pytest.approx(C + (1 - C) * 42 / L.total)


def test_block_memory_is_coverage_times_ddp_plus_the_remainder(resnet):
    L = resnet.layout
    blocks = ["layer1.0.", "layer2.0.", "layer3.0."]
    size = {b: sum(L.sizes[nm] for nm in L.names if nm.startswith(b) and "shortcut" not in nm)
            for b in blocks}
    rest = L.total - sum(size.values())
    plan = plan_masks(resnet, "block", 3, coverage=Fraction(1), active_blocks=(2, 3))
    m = np.array([plan.mask(r) for r in range(3)])
    for r in range(3):
        kept = [b for b in blocks if m[r, L.slice(b + "conv1.weight")][0]]
        assert len(kept) == 2 and plan.held(r) == rest + sum(size[b] for b in kept)
    mem = worker_memory(plan, 4, momentum=True)
    # n b / d = 2 holders per block: mean memory is exactly C × (masked part) + remainder
    assert mem["memory_ratio_mean"] == pytest.approx((rest + 2 / 3 * sum(size.values())) / L.total)
    bb = plan_masks(resnet, "block-backward", 3, coverage=Fraction(1), active_blocks=(2, 3))
    memb = worker_memory(bb, 4, momentum=True)
    assert memb["memory_bytes"] == [4 * (L.total + 2 * bb.held(r)) for r in range(3)]
    assert worker_memory(bb, 4, momentum=False)["memory_ddp_bytes"] == 8 * L.total


# -- spectral gap --------------------------------------------------------------------------------
def _dense_gap(m):
    """σ_max of the literal operator g -> m̄(g) (|J| x n|J|) on {g: Σ_i g_ij = 0 for all j}."""
    n, J = m.shape
    d = m.sum(axis=0)
    K = np.zeros((J, n * J))
    Cst = np.zeros((J, n * J))
    for i in range(n):
        for j in range(J):
            K[j, i * J + j] = m[i, j] / d[j]
            Cst[j, i * J + j] = 1.0
    return np.linalg.svd(K @ null_space(Cst), compute_uv=False)[0]


def test_spectral_gap_hand_computed():
    # columns (1,1,0), (1,1,1), (1,0,0): d = 2, 3, 1.  Column 3 alone: m̄(u) = u_1 with
    # u ⊥ 1, |u| <= 1, maximised by u = (2,-1,-1)/√6: ρ = 2/√6 = sqrt(1 - 1/3)
    m = np.array([[1, 1, 1], [1, 1, 0], [0, 1, 0]])
    assert spectral_gap(m) == pytest.approx(math.sqrt(2 / 3))
    assert _dense_gap(m) == pytest.approx(math.sqrt(2 / 3))
    assert spectral_gap(np.ones((4, 5))) == pytest.approx(0.0, abs=1e-12)   # m_uni: ρ = 0
    with pytest.raises(ValueError, match="d_j >= 1"):
        spectral_gap(np.array([[1, 0], [1, 0]]))


def test_spectral_gap_equals_literal_operator_on_random_masks():
    rng = np.random.default_rng(3)
    for _ in range(5):
        m = rng.random((4, 6)) < 0.5
        m[rng.integers(0, 4, 6), np.arange(6)] = True
        assert spectral_gap(m) == pytest.approx(_dense_gap(m), rel=1e-9)
        assert spectral_gap(m) == pytest.approx(math.sqrt(1 / m.sum(0).min() - 1 / 4))


def test_spectral_gap_of_n_sdp_masks(cnn):
    # min_j d_j = p: ρ = sqrt(1/p - 1/n)
    plan = plan_masks(cnn, "neuron", 4, coverage=Fraction(2, 4))
    assert spectral_gap(plan.distinct_mask()) == pytest.approx(math.sqrt(1 / 2 - 1 / 4))
    plan = plan_masks(cnn, "neuron", 8, coverage=Fraction(4, 8))
    assert spectral_gap(plan.distinct_mask()) == pytest.approx(math.sqrt(1 / 4 - 1 / 8))


# -- FLOP matching -------------------------------------------------------------------------------
def test_flop_factor_follows_the_paper():
    # 8 workers, coordinate j held by 4 of them: every worker holds half of the model
    sets = tuple([(1 << 8) - 1] + [sum(1 << ((c + k) % 8) for k in range(4)) for c in range(8)])
    set_id = np.arange(1, 9, dtype=np.int32)
    kw = {"n": 8, "sets": sets, "set_id": set_id, "buffer_ids": {}, "scale": np.ones(8),
              "coverage": Fraction(1, 2), "detail": {}}
    assert SDPPlan(mode="neuron", **kw).flop_factor() == 2          # "C = 4/8 doubles"
    assert SDPPlan(mode="block-backward", **kw).flop_factor() == Fraction(3, 2)  # "1.5x"


# -- closed forms --------------------------------------------------------------------------------
def test_closed_forms_reduce_to_known_collectives():
    node_of = np.arange(4) // 2
    assert gated_allreduce_bytes([[0, 1, 2, 3]], [1001], node_of) == \
        world_ring_bytes(1001, 4, 2, 2)
    assert gated_allreduce_bytes([[2], [0, 1]], [50, 0], node_of) == {"intra": 0, "inter": 0}
    # a pair on one node: 2 (p-1) n bytes, all intra; across nodes: all inter
    assert gated_allreduce_bytes([[0, 1]], [10], node_of) == {"intra": 80, "inter": 0}
    assert gated_allreduce_bytes([[1, 2]], [10], node_of) == {"intra": 0, "inter": 80}
    assert cm.bcast_split(100, node_of, 0) == cm.bcast_wire_bytes(100, 2, 2)
    # broadcast from rank 2 over {0, 2, 3}: tree 2->3 (intra), 2->0 (inter)
    assert param_bcast_bytes([([0, 2, 3], 2)], [5], node_of) == {"intra": 20, "inter": 20}
    assert assemble_bytes({1: 3, 2: 4, 3: 0}, node_of) == {"intra": 12, "inter": 16}
    step = sdp_step_bytes(gated={"intra": 1, "inter": 2}, syncs=3,
                          bcast={"intra": 5, "inter": 0}, refreshes=1,
                          assemble={"intra": 0, "inter": 0})
    assert step == {"sdp_gated_allreduce": {"intra": 3, "inter": 6},
                    "sdp_param_bcast": {"intra": 5, "inter": 0}}


# -- MPI: gated average, training, traffic, errors ------------------------------------------------
GATED = [("neuron", "3/4"), ("neuron", "2/4"), ("block", "2/3"), ("block-backward", "2/3")]
TRAINED = [("neuron", "3/4", ""), ("neuron", "2/4", "rescale"), ("block", "2/3", ""),
           ("block", "2/3", "rescale"), ("block-backward", "2/3", "")]
CLI_RUNS = [
    ["--model", "cnn", "--sdp-mode", "neuron", "--coverage", "3/4", "--steps", "6"],
    ["--model", "resnet", "--sdp-mode", "block", "--active-blocks", "2/3", "--steps", "3"],
    ["--model", "resnet", "--sdp-mode", "block-backward", "--coverage", "0.75", "--steps", "5",
     "--flop-match"],
]
#: the 2 x 3 runs: (flags, commvol predict options)
THREE_PER_NODE = [
    (["--model", "cnn", "--coverage", "2/3"], {"coverage": "2/3"}),
    (["--model", "resnet", "--sdp-mode", "block-backward", "--active-blocks", "2/3"],
     {"sdp_mode": "block-backward", "active_blocks": "2/3"}),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The MPI checks and runs of this module that succeed: one launch per world size."""
    b = JobBatch(tmp_path_factory.mktemp("sdp_jobs"))
    for mode, coverage in GATED:
        b.add(f"gated-{mode}-{coverage}", 4, "dp_sdp_checks.py", "gated", mode, coverage)
    for mode, coverage, rescale in TRAINED:
        b.add(f"train-{mode}-{coverage}-{rescale}", 4, "dp_sdp_checks.py", "train", mode,
              coverage, *([rescale] if rescale else []))
    for i, args in enumerate(CLI_RUNS):
        b.add(f"cli-{i}", 4, "dataparallel", "train", "--method", "sdp", "--ranks-per-node", 2,
              "--eval-every", 2, "--out", b.root / f"cli-{i}", *args, "--compute-profile-out",
              b.root / f"cli-{i}.json")
    for i, (args, _) in enumerate(THREE_PER_NODE):
        b.add(f"2x3-{i}", 6, "dataparallel", "train", "--method", "sdp", "--ranks-per-node", 3,
              "--steps", 2, "--eval-every", 1, "--out", b.root / f"2x3-{i}", *args)
    b.add("4x2", 8, "dataparallel", "train", "--method", "sdp", "--ranks-per-node", 2,
          "--steps", 2, "--eval-every", 1, "--coverage", "3/8", "--out", b.root / "4x2")
    return b


@pytest.mark.mpi
@pytest.mark.parametrize("mode,coverage", GATED)
def test_gated_average_equals_serial_formula(jobs, mode, coverage):
    assert f"OK gated {mode} {coverage}" in jobs.stdout(f"gated-{mode}-{coverage}")


@pytest.mark.mpi
@pytest.mark.parametrize("mode,coverage,rescale", TRAINED)
def test_training_keeps_holders_identical_and_assembles_eval_model(jobs, mode, coverage,
                                                                   rescale):
    args = [mode, coverage] + ([rescale] if rescale else [])
    assert f"OK train {' '.join(args)}" in jobs.stdout(f"train-{mode}-{coverage}-{rescale}")


@pytest.mark.mpi
@pytest.mark.parametrize("i", range(len(CLI_RUNS)))
def test_cli_measured_bytes_equal_closed_form(jobs, i):
    args = CLI_RUNS[i]
    out = jobs.run(f"cli-{i}")
    s = read_summary(out)
    assert_measured_equals_predicted(s)
    m = s["metrics"]
    # every step ran its generated program (the assembly and B_b's broadcasts in it)
    assert m["program_steps_verified"] == m["steps"]
    assert m["memory_ratio_max"] < 1 and m["degree_min"] >= 1
    assert m["spectral_gap"] == pytest.approx(m["spectral_gap_closed_form"])
    phases = set(s["traffic"]["measured"]["by_phase"])
    mode = args[args.index("--sdp-mode") + 1]
    # the summary's coverage is the measured one: Σ_j d_j / (n T) from the degree histogram
    hist = {int(d): c for d, c in m["degree_histogram"].items()}
    T = sum(hist.values())
    assert Fraction(m["coverage"]) == Fraction(sum(d * c for d, c in hist.items()), 4 * T)
    if mode == "neuron":  # N-SDP 3/4 on the cnn: conv1/fc1 (+ consumers) on 3, 42 biases on 4
        assert hist == {3: T - 42, 4: 42} and m["coverage_nominal"] == "3/4"
    # payload_ratio: every byte a step puts on the wire (gated + B_b's broadcasts) / DDP's
    by = s["traffic"]["measured"]["by_phase"]
    step_bytes = sum(by[ph]["intra_bytes"] + by[ph]["inter_bytes"]
                     for ph in ("sdp_gated_allreduce", "sdp_param_bcast") if ph in by)
    assert m["payload_ratio"] == pytest.approx(step_bytes / m["steps"] / (2 * 3 * 4 * T))
    assert m["eval_rescale"] is False                          # the paper's evaluation
    assert "sdp_gated_allreduce" in phases
    assert ("sdp_param_bcast" in phases) == (mode == "block-backward")
    assert ("sdp_assemble" in phases) == (mode != "block-backward")
    if "--flop-match" in args:
        f = Fraction(m["flop_factor_exact"])
        assert m["steps"] == math.floor(m["budget_steps"] * f) > m["budget_steps"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines][-1] == m["steps"]
    if mode != "block-backward":  # the model is assembled exactly at the trainer's evaluations
        assert s["traffic"]["measured"]["by_phase"]["sdp_assemble"]["calls"] == len(lines)


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (["--coverage", "1.5"], "--coverage must be in (0, 1]"),
    (["--sdp-mode", "block"], "has none; use --model resnet or --sdp-mode neuron"),
])
def test_bad_flags_fail_on_every_rank(tmp_path, args, message):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "sdp", *args], message,
                               tmp_path / "x")


@pytest.mark.mpi
@pytest.mark.parametrize("i", range(len(THREE_PER_NODE)))
def test_run_executes_the_plan_on_3_ranks_per_node(jobs, i):
    """6 ranks as 2 nodes x 3 (rings whose chunks the counts do not divide): the run's ledger
    equals ``commvol predict`` from the same SDPPlan, phase by phase, and the summary reports
    the plan's degrees (N-SDP 2/3 on 6: every masked parameter on exactly 4)."""
    args, kw = THREE_PER_NODE[i]
    s = read_summary(jobs.run(f"2x3-{i}"))
    pred = predict("sdp", args[1], nodes=2, gpus_per_node=3, eval_every=1, **kw).total(2)
    m = s["traffic"]["measured"]
    assert (m["inter_node_bytes"], m["intra_node_bytes"], m["messages"]) == \
        (pred.inter, pred.intra, pred.total_messages)
    for phase, e in m["by_phase"].items():
        assert (e["intra_bytes"], e["inter_bytes"]) == (pred.phases[phase]["intra"],
                                                        pred.phases[phase]["inter"]), phase
    if args[1] == "cnn":
        assert s["metrics"]["degree_histogram"] == {"4": 38240, "6": 42}


@pytest.mark.mpi
def test_run_executes_the_plan_on_4_nodes_of_2(jobs):
    """8 ranks as 4 nodes x 2, N-SDP 3/8 (windows of 3 that cross up to two node boundaries):
    the trainer held every step to the plan's records (it raises otherwise), and the ledger's
    bytes, messages and modeled time equal ``commvol predict``'s (gated average every step,
    assembly at every evaluation) and the paper's closed form."""
    s = read_summary(jobs.run("4x2"))
    assert_measured_equals_predicted(s)
    pred = predict("sdp", "cnn", nodes=4, gpus_per_node=2, coverage="3/8", eval_every=1)
    total = pred.total(2)
    m = s["traffic"]["measured"]
    assert (m["inter_node_bytes"], m["intra_node_bytes"], m["messages"]) == \
        (total.inter, total.intra, total.total_messages)
    assert s["timing"]["comm_modeled_s"] == pytest.approx(total.time_s, rel=1e-9)
    from sdp_reference import neuron_layers  # the closed form's inputs, from the shapes

    layers, rest = neuron_layers(build_model("cnn", SHAPE, 10))
    closed = neuron_sdp_bytes(layers, rest, 3, np.arange(8) // 2)
    for phase, part in (("sdp_gated_allreduce", "gated"), ("sdp_assemble", "assemble")):
        e = m["by_phase"][phase]
        assert (e["intra_bytes"], e["inter_bytes"]) == (2 * closed[part]["intra"],
                                                        2 * closed[part]["inter"]), phase
