"""PacTrain (paper 002): serial pieces against NumPy references, MPI checks, trainer runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from mpi_helpers import JobBatch, assert_fails_on_every_rank, run_mpi

from commvol.predict import predict
from commvol.systems import pactrain_plan
from dataparallel.pactrain import (
    DEFAULT_WARMUP_STEPS,
    MaskTracker,
    PacTrainOptions,
    grasp_score,
    hessian_vector_fd,
    pack_2bit,
    prune_importance,
    prune_mask,
    save_init,
    ternarize,
    ternary_uniforms,
    unpack_2bit,
)
from dataparallel.strategy import options_from_args
from dataparallel.train import build_parser
from models import build_model, load_digits
from models.params import ParamLayout, ParamSpec
from substrate.calls import Placement, bytes_by_phase
from volume.dataparallel import ddp_step_bytes
from volume.pactrain import (
    dense_allreduce_bytes,
    grasp_score_bytes,
    packed_allreduce_bytes,
    packed_chunks,
    pactrain_step_bytes,
    ternary_bytes,
)

LAYOUT = ParamLayout([
    ParamSpec("conv.weight", "conv", (4, 2, 3, 3)),
    ParamSpec("conv.bias", "bias", (4,)),
    ParamSpec("bn.weight", "bn", (4,)),
    ParamSpec("fc.weight", "fc", (5, 7)),
    ParamSpec("fc.bias", "bias", (5,)),
])


# -- ternary quantizer and 2-bit codes ----------------------------------------------------------
def test_ternarize_is_unbiased_with_the_seeded_streams():
    g = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    g[:3] = 0.0
    s = float(np.abs(g).max())
    n = 4000
    draws = np.stack([ternarize(g, s, ternary_uniforms(11, 2, t, g.size)) for t in range(n)])
    assert set(np.unique(draws)) <= {-1, 0, 1} and draws.dtype == np.int8
    est = s * draws.mean(axis=0)
    sigma = np.sqrt(np.maximum(s * np.abs(g) - g.astype(np.float64) ** 2, 0) / n)
    assert np.all(np.abs(est - g) <= 5 * sigma + 1e-12)         # E[s·t] = g (eq. 3)
    assert not draws[:, :3].any()                                # zero stays zero
    # the entry with |g| = s is always sent
    top = int(np.argmax(np.abs(g)))
    assert np.all(draws[:, top] == np.sign(g[top]))


def test_ternarize_per_element_scale_and_zero_scale():
    rng = np.random.default_rng(1)
    g = rng.standard_normal(30)
    s = np.repeat([np.abs(g[:10]).max(), np.abs(g[10:]).max(), 0.0], 10)
    g[20:] = 0.0
    u = rng.random((20000, 30))
    est = (s * ternarize(g, s, u)).mean(axis=0)
    sigma = np.sqrt(np.maximum(s * np.abs(g) - g ** 2, 0) / 20000)
    assert np.all(np.abs(est - g) <= 5 * sigma + 1e-12)
    assert not ternarize(g, 0.0, u[0]).any()


def test_ternary_streams_are_reproducible_and_distinct():
    a = ternary_uniforms(5, 1, 7, 100)
    assert np.array_equal(a, ternary_uniforms(5, 1, 7, 100)) and a.dtype == np.float32
    assert not np.array_equal(a, ternary_uniforms(5, 2, 7, 100))      # other rank
    assert not np.array_equal(a, ternary_uniforms(5, 1, 8, 100))      # other step
    assert not np.array_equal(a, ternary_uniforms(6, 1, 7, 100))      # other run seed


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 1001])
def test_pack_2bit_round_trip(n):
    codes = np.random.default_rng(n).integers(-1, 2, n).astype(np.int8)
    packed = pack_2bit(codes)
    assert packed.dtype == np.uint8 and packed.shape == (math.ceil(n / 4),)
    assert np.array_equal(unpack_2bit(packed, n), codes)
    out = np.empty_like(packed)
    assert pack_2bit(codes, out=out) is out and np.array_equal(out, packed)
    rows = np.stack([packed, pack_2bit(-codes)])                  # 2-D: one row per rank
    assert np.array_equal(unpack_2bit(rows, n), np.stack([codes, -codes]))


def test_pack_2bit_layout():
    # value i at bits 2(i % 4) of byte i // 4; 0 -> 00, +1 -> 01, -1 -> 11
    packed = pack_2bit(np.array([1, -1, 0, 1, -1], dtype=np.int8))
    assert packed.tolist() == [0b01_00_11_01, 0b11]


# -- mask tracker ---------------------------------------------------------------------------------
def test_mask_tracker_switches_after_window_and_back_on_change():
    a = np.array([1, 0, 1, 1], dtype=bool)
    b = np.array([1, 0, 0, 1], dtype=bool)
    seq = [a] * 6 + [b] * 5 + [a] * 2
    t = MaskTracker(3)
    got = [t.observe(m.copy()) for m in seq]
    assert got == ([False] * 3 + [True] * 3      # stable after 3 unchanged comparisons
                   + [False] * 3 + [True] * 2    # change -> dense, then stable again
                   + [False] * 2)
    assert t.version == 3
    t0 = MaskTracker(0)
    assert [t0.observe(m) for m in (a, a, b)] == [True, True, True]
    assert t0.version == 2
    with pytest.raises(ValueError, match="--stable-window must be >= 0"):
        MaskTracker(-1)


# -- pruning --------------------------------------------------------------------------------------
def test_prune_mask_is_per_layer_on_conv_and_fc_only():
    rng = np.random.default_rng(3)
    imp = rng.random(LAYOUT.total)
    zero = np.zeros(LAYOUT.total, dtype=bool)
    zero[LAYOUT.offsets["fc.weight"] + 2] = True        # an exact zero goes first
    m = prune_mask(imp, LAYOUT, 0.3, zero)
    for name in LAYOUT.names:
        sl = LAYOUT.slice(name)
        if LAYOUT.kind(name) in ("bias", "bn"):
            assert m[sl].all()
            continue
        n = sl.stop - sl.start
        seg_imp = np.where(zero[sl], -np.inf, imp[sl])
        assert m[sl].sum() == n - math.floor(0.3 * n)
        assert seg_imp[m[sl]].min() > seg_imp[~m[sl]].max()
    assert not m[LAYOUT.offsets["fc.weight"] + 2]
    assert prune_mask(imp, LAYOUT, 0.0).all()


def test_grasp_rule_removes_the_highest_scores():
    """GraSP [45] removes the weights of highest S = -theta * Hg (eq. 4); grasp-abs keeps the
    largest |S|, magnitude the largest |theta|."""
    layout = ParamLayout([ParamSpec("fc.weight", "fc", (2, 3))])
    theta = np.array([1.0, -2.0, 0.5, 3.0, -1.5, 0.25])
    hv = np.array([2.0, 1.0, -4.0, 0.0, 3.0, -8.0])
    S = grasp_score(theta, hv)
    assert S.tolist() == [-2.0, 2.0, 2.0, 0.0, 4.5, 2.0]
    keep = {k: prune_mask(prune_importance(k, theta, S), layout, 0.5)
            for k in ("grasp", "grasp-abs", "magnitude")}
    # remove the 3 highest S: 4.5 (index 4) and two of the 2.0s (ties: the higher index goes)
    assert keep["grasp"].tolist() == [True, True, False, True, False, False]
    assert keep["grasp-abs"].tolist() == [True, True, False, False, True, False]
    assert keep["magnitude"].tolist() == [False, True, False, True, True, False]
    with pytest.raises(ValueError, match="needs the GraSP score"):
        prune_importance("grasp", theta)
    with pytest.raises(ValueError, match="--prune-score 'snip' unknown"):
        prune_importance("snip", theta, S)


def test_hessian_vector_fd_is_exact_on_a_quadratic():
    rng = np.random.default_rng(4)
    B = rng.standard_normal((20, 20))
    A = B + B.T
    c = rng.standard_normal(20)
    theta, v = rng.standard_normal(20), rng.standard_normal(20)
    hv = hessian_vector_fd(lambda th: A @ th + c, theta, v, 1e-2)   # ∇(½θᵀAθ + cᵀθ)
    assert np.allclose(hv, A @ v, rtol=1e-9, atol=1e-9)
    assert np.allclose(grasp_score(theta, hv), -theta * (A @ v))     # eq. 4
    with pytest.raises(ValueError, match="step must be > 0"):
        hessian_vector_fd(lambda th: th, theta, v, 0.0)


# -- options and CLI ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    ({"prune_ratio": 1.0}, r"--prune-ratio must be in \[0, 1\)"),
    ({"prune_ratio": -0.1}, r"--prune-ratio must be in \[0, 1\)"),
    ({"stable_window": -1}, "--stable-window must be >= 0"),
    ({"warmup_steps": -2}, "--warmup-steps must be >= 0"),
    ({"prune_score": "snip"}, "--prune-score 'snip' unknown"),
    ({"ternary_scale": "row"}, "--ternary-scale 'row' unknown"),
    ({"ternary_wait": "never"}, "--ternary-wait 'never' unknown"),
    ({"init": "/nonexistent/x.npz"}, "--init /nonexistent/x.npz: no such file"),
    ({"bucket_mib": 0}, "--bucket-mib must be > 0"),
    ({"mask_scope": "layer"}, "--mask-scope 'layer' unknown"),
    ({"warmup_steps": 1.5}, "--warmup-steps takes a whole number"),
    ({"stable_window": 2.5}, "--stable-window takes a whole number"),
])
def test_bad_options_raise_with_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        PacTrainOptions(**kw)


def test_options_become_cli_flags(tmp_path):
    init = tmp_path / "w.npz"
    np.savez(init, params=np.zeros(3))
    args = build_parser().parse_args([
        "--method", "pactrain", "--prune-ratio", "0.7", "--prune-score", "grasp",
        "--stable-window", "2", "--warmup-steps", "3", "--ternary", "--init", str(init),
        "--mask-scope", "global"])
    o = options_from_args(PacTrainOptions, args)
    assert (o.prune_ratio, o.prune_score, o.stable_window, o.warmup_steps, o.ternary,
            o.init, o.ternary_scale, o.mask_scope) == (0.7, "grasp", 2, 3, True, str(init),
                                                       "tensor", "global")
    d = options_from_args(PacTrainOptions, build_parser().parse_args([]))
    assert d == PacTrainOptions()
    # the paper's pipeline: the GraSP score, per-bucket masks, a pre-trained model to prune
    assert (d.prune_score, d.mask_scope, d.warmup) == ("grasp-abs", "bucket",
                                                       DEFAULT_WARMUP_STEPS)
    assert DEFAULT_WARMUP_STEPS > 0
    assert PacTrainOptions(init=str(init)).warmup == 0           # --init: prune it at once
    assert PacTrainOptions(init=str(init), warmup_steps=4).warmup == 4


# -- closed forms ---------------------------------------------------------------------------------
def test_closed_forms():
    M, P, p = 2, 2, 4
    assert packed_chunks(10, 4) == [4, 4, 2] and packed_chunks(0, 4) == []
    K = 1000                                              # p divides K: the canonical forms
    pk = packed_allreduce_bytes(M=M, P=P, kept=K, bucket_elems=1 << 20)
    assert pk["intra"] + pk["inter"] == 2 * (p - 1) * 4 * K
    assert pk["inter"] == M * 2 * (p - 1) * 4 * K // p
    # chunking does not change the total of a ring all-reduce
    chunked = packed_allreduce_bytes(M=M, P=P, kept=K, bucket_elems=300)
    assert chunked["intra"] + chunked["inter"] == 2 * (p - 1) * 4 * K
    t = ternary_bytes(M=M, P=P, kept=K + 1, scales=5)
    assert t["ternary_allgather"] == {"intra": (p - M) * (p - 1) * 251,
                                      "inter": M * (p - 1) * 251}
    assert sum(t["ternary_scale"].values()) == 2 * (p - 1) * 4 * 5
    sizes = [650, 37632]
    dense = pactrain_step_bytes(M=M, P=P, mode="dense", bucket_sizes=sizes, kept=0,
                                bucket_elems=1)
    assert dense == {"dense_allreduce": ddp_step_bytes(M=M, P=P,
                                                       bucket_sizes=sizes)["grad_allreduce"]}
    assert dense["dense_allreduce"] == dense_allreduce_bytes(M=M, P=P, bucket_sizes=sizes)
    g = pactrain_step_bytes(M=M, P=P, mode="packed", bucket_sizes=sizes, kept=K,
                            bucket_elems=1 << 20, grasp_total=400)
    assert g["grasp_allreduce"]["inter"] == 2 * (M * 2 * (p - 1) * 4 * 400 // p)
    with pytest.raises(ValueError, match="unknown PacTrain step mode"):
        pactrain_step_bytes(M=M, P=P, mode="sparse", bucket_sizes=sizes, kept=K,
                            bucket_elems=1)


# -- MPI ------------------------------------------------------------------------------------------
MPI_CHECKS = ["packed", "buckets", "ternary", "grasp"]
#: the 2 x 2 runs of the tests below: name -> flags
RUNS = {
    "p": ["--method", "pactrain", "--steps", 14, "--warmup-steps", 2, "--stable-window", 3,
          "--prune-score", "magnitude", "--bucket-mib", 0.01],
    "t": ["--method", "pactrain", "--steps", 8, "--warmup-steps", 1, "--stable-window", 2,
          "--ternary", "--prune-score", "grasp", "--compute-profile-out", "{root}/t.json"],
    "g": ["--method", "pactrain", "--steps", 3, "--warmup-steps", 0, "--stable-window", 1,
          "--ternary", "--prune-score", "grasp", "--eval-every", 1, "--compute-profile-out",
          "{root}/g.json"],
    "i": ["--method", "pactrain", "--steps", 4, "--stable-window", 0, "--init", "{root}/w.npz"],
    "ddp": ["--method", "ddp"],
    "pac": ["--method", "pactrain"],
}
#: the pre-trained model of run "i": 80 % of fc1's weights already zero
FC1_ZERO = 0.8


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The MPI checks and the runs of this module in one launch."""
    b = JobBatch(tmp_path_factory.mktemp("pactrain_jobs"))
    model = build_model("cnn", load_digits().train.input_shape, 10, seed=0)
    sl = model.layout.slice("fc1.weight")
    model.params.flat[sl.start:sl.start + int(FC1_ZERO * (sl.stop - sl.start))] = 0.0
    save_init(b.root / "w.npz", model)
    for check in MPI_CHECKS:
        b.add(check, 4, "dp_pactrain_checks.py", check)
    for name, args in RUNS.items():
        args = [str(a).format(root=b.root) for a in args]
        b.add(name, 4, "dataparallel", "train", "--ranks-per-node", 2, "--out", b.root / name,
              *args)
    return b


@pytest.mark.mpi
@pytest.mark.parametrize("check", MPI_CHECKS)
def test_mpi_check(jobs, check):
    assert f"OK {check}" in jobs.stdout(check)


def _train(jobs, name):
    return json.loads((jobs.run(name) / "summary.json").read_text())


def _assert_measured_equals_predicted(s):
    measured, predicted = s["traffic"]["measured"], s["traffic"]["predicted"]
    assert measured["inter_node_bytes"] == predicted["inter_node_bytes"] > 0
    assert measured["intra_node_bytes"] == predicted["intra_node_bytes"] > 0
    assert set(measured["by_phase"]) == set(predicted["by_phase"])
    for phase, want in predicted["by_phase"].items():
        got = measured["by_phase"][phase]
        assert (got["intra_bytes"], got["inter_bytes"]) == (want["intra_bytes"],
                                                            want["inter_bytes"]), phase


def _plan_total(summary, steps):
    """Bytes per phase of ``steps`` steps of the keep-rate plan commvol predicts from."""
    o = summary["config"]["options"]
    model = build_model("cnn", load_digits().train.input_shape, 10)
    plan = pactrain_plan(model, 2, 2, PacTrainOptions(**o))
    where = Placement.node_major(2, 2)
    total = {}
    for k in range(steps):
        for phase, v in bytes_by_phase(plan.calls_at(where, k), where).items():
            e = total.setdefault(phase, {"intra_bytes": 0, "inter_bytes": 0})
            e["intra_bytes"] += v["intra"]
            e["inter_bytes"] += v["inter"]
    return total


@pytest.mark.mpi
def test_short_run_bytes_match_closed_form(jobs):
    """Five buckets, one mask tracker each: the ledger equals the strategy's plan and the
    keep-rate plan ``commvol predict`` uses, step by step."""
    s = _train(jobs, "p")
    _assert_measured_equals_predicted(s)
    m = s["metrics"]
    measured = s["traffic"]["measured"]["by_phase"]
    assert set(measured) == {"dense_allreduce", "packed_allreduce"}
    assert m["mask_units"] == 5
    assert measured["packed_allreduce"]["calls"] == 5 * (14 - 5)
    assert measured["dense_allreduce"]["calls"] == 5 * 5
    assert (m["prune_step"], m["mask_stable_step"], m["mask_changes"]) == (2, 5, 0)
    assert m["packed_fraction"] == pytest.approx(9 / 14)
    assert m["prunable_density"] == 0.5 and m["payload_ratio"] == pytest.approx(m["density"])
    assert 0.5 < m["density"] < 0.51
    assert s["config"]["options"]["prune_ratio"] == 0.5
    plan = _plan_total(s, 14)
    assert {p: (v["intra_bytes"], v["inter_bytes"]) for p, v in measured.items()} == \
        {p: (v["intra_bytes"], v["inter_bytes"]) for p, v in plan.items()}


@pytest.mark.mpi
def test_short_ternary_grasp_run_bytes_match_closed_form(jobs):
    s = _train(jobs, "t")
    _assert_measured_equals_predicted(s)
    # every step ran its generated program, GraSP after step 0's update included
    assert s["metrics"]["program_steps_verified"] == 8
    phases = s["traffic"]["measured"]["by_phase"]
    assert set(phases) == {"dense_allreduce", "grasp_allreduce", "ternary_scale",
                           "ternary_allgather"}
    assert phases["grasp_allreduce"]["calls"] == 2 and phases["ternary_allgather"]["calls"] == 5
    m = s["metrics"]
    assert (m["prune_step"], m["mask_stable_step"]) == (1, 3)
    assert m["payload_ratio"] < 0.05 and m["wire_ratio"] < 0.1


@pytest.mark.mpi
def test_grasp_at_once_is_a_set_up_accounted_before_the_first_step(jobs):
    """``--warmup-steps 0``: GraSP's two all-reduces run as the strategy's set-up records
    (before the first step, on its executor), held to what ran and accounted in the first
    metrics line; the recorded program of the set-up and of every step is the generated one."""
    s = _train(jobs, "g")
    _assert_measured_equals_predicted(s)
    assert s["traffic"]["measured"]["by_phase"]["grasp_allreduce"]["calls"] == 2
    assert s["metrics"]["program_steps_verified"] == 3 + 1
    lines = [json.loads(x) for x in (jobs.root / "g" / "metrics.jsonl").read_text()
             .splitlines()]
    T = build_model("cnn", load_digits().train.input_shape, 10).layout.total
    grasp = grasp_score_bytes(M=2, P=2, total=T)
    dense = dense_allreduce_bytes(M=2, P=2, bucket_sizes=[T])
    assert lines[0]["inter_node_bytes"] == grasp["inter"] + dense["inter"]


@pytest.mark.mpi
def test_init_checkpoint_is_the_starting_point(jobs):
    """``--init`` is the pre-trained model: pruned at once (no warm-up by default)."""
    model = build_model("cnn", load_digits().train.input_shape, 10, seed=0)
    sl = model.layout.slice("fc1.weight")
    n = sl.stop - sl.start
    s = _train(jobs, "i")
    _assert_measured_equals_predicted(s)
    m = s["metrics"]
    layout = model.layout
    kept = sum(layout.sizes[k] - math.floor(0.5 * layout.sizes[k]) for k in layout.names
               if layout.kind(k) in ("conv", "fc") and k != "fc1.weight")
    kept += n - int(FC1_ZERO * n) + sum(layout.sizes[k] for k in layout.names
                                   if layout.kind(k) not in ("conv", "fc"))
    assert m["kept"] == kept and m["packed_fraction"] == 1.0 and m["mask_stable_step"] == 0
    assert m["prune_step"] == 0


@pytest.mark.mpi
def test_digits_accuracy_close_to_ddp(jobs):
    ddp, pac = _train(jobs, "ddp"), _train(jobs, "pac")
    _assert_measured_equals_predicted(pac)
    a_ddp = ddp["metrics"]["final_test_accuracy"]
    a_pac = pac["metrics"]["final_test_accuracy"]
    assert a_pac >= a_ddp - 0.03 and a_pac >= 0.9, (a_pac, a_ddp)
    # after stabilization the packed all-reduce moves about half of DDP's bytes
    per_step_ddp = ddp["traffic"]["measured"]["inter_node_bytes"] / ddp["metrics"]["steps"]
    packed = pac["traffic"]["measured"]["by_phase"]["packed_allreduce"]
    assert packed["inter_bytes"] / packed["calls"] / per_step_ddp == pytest.approx(
        pac["metrics"]["inter_wire_ratio"])
    assert pac["metrics"]["inter_wire_ratio"] < 0.51


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (["--prune-ratio", "1.0"], "--prune-ratio must be in [0, 1)"),
    (["--stable-window", "-1"], "--stable-window must be >= 0"),
    (["--warmup-steps", "-3"], "--warmup-steps must be >= 0"),
    (["--init", "/nonexistent/w.npz"], "--init /nonexistent/w.npz: no such file"),
])
def test_bad_flags_error_on_every_rank(tmp_path, args, message):
    assert_fails_on_every_rank("dataparallel", ["train", "--method", "pactrain", *args], message,
                               tmp_path / "x")


@pytest.mark.mpi
def test_run_executes_the_plan_on_4_nodes_of_2(tmp_path):
    """8 ranks as 4 nodes x 2, TernGrad after GraSP pruning: the trainer held every step to
    the plan's records (it raises otherwise); the ledger equals ``commvol predict`` (bytes,
    messages, modeled time) and the paper's closed forms step by step."""
    out = tmp_path / "p"
    run_mpi(None, 8, "train", "--ranks-per-node", 2, "--out", out, "--method", "pactrain",
            "--steps", 4, "--warmup-steps", 1, "--stable-window", 1, "--ternary",
            "--prune-score", "grasp", module="dataparallel", timeout=400)
    s = json.loads((out / "summary.json").read_text())
    _assert_measured_equals_predicted(s)
    kw = {"warmup_steps": 1, "stable_window": 1, "ternary": True, "prune_score": "grasp"}
    total = predict("pactrain", "cnn", nodes=4, gpus_per_node=2, **kw).total(4)
    m = s["traffic"]["measured"]
    assert (m["inter_node_bytes"], m["intra_node_bytes"], m["messages"]) == \
        (total.inter, total.intra, total.total_messages)
    assert s["timing"]["comm_modeled_s"] == pytest.approx(total.time_s, rel=1e-9)
    # the paper's closed forms: steps 0, 1 dense (GraSP at step 0), steps 2, 3 ternary
    layout = build_model("cnn", load_digits().train.input_shape, 10).layout
    sizes = [layout.sizes[n] for n in layout.names]
    ratio = [0.5 if layout.kind(n) in ("conv", "fc") else 0.0 for n in layout.names]
    K = sum(n - math.floor(r * n) for n, r in zip(sizes, ratio))
    dense = dense_allreduce_bytes(M=4, P=2, bucket_sizes=[sum(sizes)])
    tern = ternary_bytes(M=4, P=2, kept=K, scales=len(sizes))
    grasp = grasp_score_bytes(M=4, P=2, total=sum(sizes))
    want = {"dense_allreduce": {k: 2 * v for k, v in dense.items()},
            "grasp_allreduce": grasp,
            **{ph: {k: 2 * v for k, v in b.items()} for ph, b in tern.items()}}
    assert {ph: {"intra": e["intra_bytes"], "inter": e["inter_bytes"]}
            for ph, e in m["by_phase"].items()} == want
