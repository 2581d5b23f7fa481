"""``commvol predict`` from model name + topology reproduces short MPI runs' measured traffic
(bytes per phase and link class, messages, modeled time), and ``report`` summarizes them; with
3 ranks per node (rings whose element counts the rank count does not divide) every system's
summary has measured == predicted and ``commvol predict`` reproduces it."""

import importlib.util
import json

import pytest
from mpi_helpers import assert_measured_equals_predicted, read_summary, run_mpi
from prediction_helpers import iteration_cost

from commvol.predict import predict, resolve_model
from commvol.report import comparison_table, fmt_time, load_run, write_plots
from commvol.systems import SYSTEMS, pactrain_kept, ssfusion_plan
from hsadmm.config import HSADMMConfig
from hsadmm.shrink import ShrinkPlan

pytestmark = pytest.mark.mpi

# one MPI launch for all runs (as commvol.compare does), 2 virtual nodes x 2 ranks
SCRIPT = """
import sys
from dataparallel.train import build_parser as dp_parser, train as dp_train
from hsadmm.train import build_parser as hs_parser, train as hs_train

out, shared = sys.argv[1], ["--ranks-per-node", "2"]
hs_train(hs_parser().parse_args(["--iters", "2", "--local-steps", "2", *shared,
                                 "--out", out + "/hsadmm"]))
for name, extra in (("ddp", []), ("topk", ["--method", "topk"]),
                    ("ddp-hierarchical", ["--allreduce", "hierarchical"])):
    dp_train(dp_parser().parse_args([*extra, "--steps", "3", "--eval-every", "1", *shared,
                                     "--out", out + "/" + name]))
for name, extra in (
        ("pactrain", ["--steps", "4", "--eval-every", "1", "--stable-window", "2",
                      "--prune-score", "grasp", "--warmup-steps", "0"]),
        ("pactrain-ternary", ["--steps", "4", "--eval-every", "1", "--ternary",
                              "--warmup-steps", "1", "--stable-window", "1"]),
        ("sdp", ["--steps", "3", "--eval-every", "2"]),
        ("sdp-block", ["--steps", "2", "--model", "resnet", "--sdp-mode", "block"]),
        ("sdp-block-backward", ["--steps", "2", "--model", "resnet",
                                "--sdp-mode", "block-backward"]),
        ("ssfusion-per-tensor", ["--steps", "3", "--fusion", "per-tensor",
                                 "--profile-steps", "1"]),
        ("ssfusion-multi-tensor", ["--steps", "2", "--fusion", "multi-tensor",
                                   "--profile-steps", "0", "--buffers", "3",
                                   "--fusion-policy", "count"]),
        ("ssfusion-selective", ["--steps", "4", "--profile-steps", "2", "--density", "0.05"])):
    method = name.split("-")[0]
    dp_train(dp_parser().parse_args(["--method", method, *extra, *shared,
                                     "--out", out + "/" + name]))
"""

#: the predict options of the runs above: (system, model, options)
RUNS = {"pactrain": ("pactrain", "cnn", {"stable_window": 2, "prune_score": "grasp",
                                         "warmup_steps": 0}),
        "pactrain-ternary": ("pactrain", "cnn", {"ternary": True, "warmup_steps": 1,
                                                 "stable_window": 1}),
        "sdp": ("sdp", "cnn", {"eval_every": 2}),
        "sdp-block": ("sdp", "resnet", {"sdp_mode": "block"}),  # digits' epoch > 2 steps
        "sdp-block-backward": ("sdp", "resnet", {"sdp_mode": "block-backward"}),
        # Cupcake's fusion buffers (the default policy) follow the profiled timings too
        "ssfusion-per-tensor": ("ssfusion", "cnn", {"fusion": "per-tensor", "profile_steps": 1,
                                                    "selection_from": True}),
        "ssfusion-multi-tensor": ("ssfusion", "cnn", {"fusion": "multi-tensor",
                                                      "profile_steps": 0, "buffers": 3,
                                                      "fusion_policy": "count"}),
        # the selective run's dense/sparse selection follows its profiled timings: reproduced
        # from the selection it recorded (selection_from is filled in with the run directory)
        "ssfusion-selective": ("ssfusion", "cnn", {"profile_steps": 2, "density": 0.05,
                                                   "selection_from": True})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("commvol_runs")
    script = root / "runs.py"
    script.write_text(SCRIPT)
    run_mpi(script, 4, root, timeout=300)
    return root


def _assert_reproduced(summary, pred):
    m = summary["traffic"]["measured"]
    assert (m["inter_node_bytes"], m["intra_node_bytes"]) == (pred.inter, pred.intra)
    assert m["messages"] == pred.total_messages
    for phase, e in m["by_phase"].items():
        assert (e["intra_bytes"], e["inter_bytes"]) == (pred.phases[phase]["intra"],
                                                        pred.phases[phase]["inter"]), phase
        assert e["messages"] == pred.messages[phase], phase
        assert e["modeled_s"] == pytest.approx(pred.modeled_s[phase], rel=1e-9), phase
    assert summary["timing"]["comm_modeled_s"] == pytest.approx(pred.time_s, rel=1e-9)


@pytest.mark.parametrize("system", ["ddp", "topk", "ddp-hierarchical"])
def test_data_parallel_runs_are_reproduced(runs, system):
    s = read_summary(runs / system)
    pred = predict(system, "cnn", nodes=2, gpus_per_node=2).total(s["metrics"]["steps"])
    _assert_reproduced(s, pred)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_pactrain_sdp_ssfusion_runs_are_reproduced(runs, name):
    """From the model name, the topology and the strategy's options: the run's bytes per phase
    and link class, messages and modeled time, and the bytes of every logged interval."""
    system, model, options = RUNS[name]
    s = read_summary(runs / name)
    n = s["metrics"]["steps"]
    if options.get("selection_from"):
        options = {**options, "selection_from": str(runs / name)}
    pred = predict(system, model, nodes=2, gpus_per_node=2, **options)
    _assert_reproduced(s, pred.total(n))
    per_step = [c for a, b, c in pred.schedule(n) for _ in range(a, b + 1)]
    done = 0
    for line in load_run(runs / name).lines:  # one line per evaluation
        k = line["step"]
        assert line["inter_node_bytes"] == sum(c.inter for c in per_step[done:k]), (name, k)
        assert line["intra_node_bytes"] == sum(c.intra for c in per_step[done:k]), (name, k)
        done = k
    assert done == n
    if system == "pactrain":  # packing starts where the strategy's mask tracker says
        first_packed = next(k for k in range(n)
                            if "dense_allreduce" not in iteration_cost(pred, k).phases)
        assert s["metrics"]["mask_stable_step"] == first_packed
        assert s["metrics"]["kept"] == pactrain_kept(resolve_model(model).layout, 0.5)
    if system == "ssfusion":  # the run's own closed form (its summary's predicted block) too
        pb = s["traffic"]["predicted"]["by_phase"]
        assert {p: (e["intra_bytes"], e["inter_bytes"]) for p, e in pb.items()} == \
            {p: (v["intra"], v["inter"]) for p, v in pred.total(n).phases.items()}
        sel = s["metrics"]["selection"]
        sm = SYSTEMS["ssfusion"]
        opts, assumptions = sm.split(options)
        plan, _ = ssfusion_plan(resolve_model(model), 4, "inter", opts, assumptions)
        assert plan.counts() == (sel["allreduce_elements"], sel["allgather_dense_elements"],
                                 sel["sparse_elements"])


def test_hsadmm_run_is_reproduced(runs):
    s = read_summary(runs / "hsadmm")
    lines = load_run(runs / "hsadmm").lines
    n = s["metrics"]["iterations"]
    # with the run's own compact sizes (the OR of the nodes' masks, eq. 14): exact
    measured_c = [ln["compact_elems"] for ln in lines]
    _assert_reproduced(s, predict("hsadmm", "cnn", nodes=2, gpus_per_node=2,
                                  compact_elems=measured_c).total(n))
    # from keep rates alone: exact when the nodes agreed on the masks, else a lower bound
    plan = ShrinkPlan.from_keep_rates(resolve_model("cnn").layout,
                                      HSADMMConfig(keep=0.5, sparsity="channel", bucket_mib=32.0))
    from_keep = predict("hsadmm", "cnn", nodes=2, gpus_per_node=2).total(n)
    assert min(measured_c) >= plan.compact_size
    if all(c == plan.compact_size for c in measured_c):
        _assert_reproduced(s, from_keep)
    else:
        assert from_keep.inter < s["traffic"]["measured"]["inter_node_bytes"]


def test_report_of_the_runs(runs, tmp_path):
    dirs = [runs / m for m in ("hsadmm", "ddp", "topk")]
    text = comparison_table(dirs, target=0.0)
    rows = [ln for ln in text.splitlines() if ln.startswith(("| hsadmm", "| ddp", "| topk"))]
    assert len(rows) == 3 and all(r.rstrip(" |").endswith("yes") for r in rows)
    first_sim = json.loads((runs / "ddp" / "metrics.jsonl").read_text().splitlines()[0])["sim_s"]
    ddp_row = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert ddp_row[10] == fmt_time(first_sim) and ddp_row[11] == "1.000"
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: plots not checked")
    paths = write_plots(dirs, tmp_path)
    assert {p.name for p in paths} == {"payload.png", "accuracy_vs_bytes.png",
                                       "comm_breakdown.png", "residuals.png"}
    assert all(p.stat().st_size > 5000 for p in paths)


def test_headline_comparison(tmp_path):
    """The default job (``./run_mpi.sh`` = ``commvol.compare`` on 2 virtual nodes x 2): every
    system runs with its defaults and appears in one table with measured = predicted."""
    from commvol.compare import SYSTEM_RUNS
    from runner.launch import DEFAULT_JOB

    assert DEFAULT_JOB[DEFAULT_JOB.index("commvol.compare") - 2:] == \
        ["--ranks-per-node", "2", "commvol.compare", "--overwrite"]
    res = run_mpi(None, 4, "--ranks-per-node", 2, "--out", tmp_path, module="commvol.compare",
                  timeout=300)
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
            for ln in res.stdout.splitlines() if ln.startswith("| ") and "---" not in ln}
    rows.pop("method")
    assert set(rows) == set(SYSTEM_RUNS)
    assert all(r[-1] == "yes" for r in rows.values())
    for method in SYSTEM_RUNS:
        assert read_summary(tmp_path / method)["metrics"]["final_test_accuracy"] >= 0.85, method


# ---------------------------------------------------------------------------------------------
# 3 ranks per node: 2 nodes x 3 and 1 node x 3 (tests/mpi/uneven_checks.py, one launch each)
# ---------------------------------------------------------------------------------------------
#: (ranks, ranks per node)
UNEVEN_LAYOUTS = [(6, 3), (3, 3)]  # 2 nodes x 3 (a world ring of 6), 1 x 3

#: run name in uneven_checks.py -> (system, model, predict options) matching its flags
UNEVEN_RUNS = {
    "hsadmm": ("hsadmm", "cnn", {"freeze_iter": 1}),
    "flat-admm": ("flat-admm", "cnn", {}),
    "ddp": ("ddp", "cnn", {}),
    "ddp-hierarchical": ("ddp-hierarchical", "cnn", {}),
    "topk": ("topk", "cnn", {}),
    "pactrain": ("pactrain", "cnn", {"stable_window": 1, "warmup_steps": 1,
                                     "prune_score": "grasp"}),
    "pactrain-ternary": ("pactrain", "cnn", {"ternary": True, "stable_window": 1,
                                             "warmup_steps": 0}),
    "sdp": ("sdp", "cnn", {"coverage": "2/3", "eval_every": 1}),
    "sdp-block-backward": ("sdp", "resnet", {"sdp_mode": "block-backward", "eval_every": 1}),
    "ssfusion-per-tensor": ("ssfusion", "cnn", {"fusion": "per-tensor", "profile_steps": 1,
                                                "selection_from": True}),
    "ssfusion-selective": ("ssfusion", "cnn", {"profile_steps": 2, "density": 0.05,
                                               "selection_from": True}),
    "sparse_sgd": ("sgd", None, {"batch_size": 7}),
}


@pytest.fixture(scope="module", params=UNEVEN_LAYOUTS,
                ids=[f"{n}x{R}" for n, R in UNEVEN_LAYOUTS])
def uneven_runs(request, tmp_path_factory):
    n, R = request.param
    root = tmp_path_factory.mktemp(f"uneven_{n}x{R}")
    run_mpi("uneven_checks.py", n, root, R, timeout=600)
    return root, n // R, R


def test_uneven_layout_really_has_uneven_rings(uneven_runs):
    """The digits CNN's parameter count (one DDP bucket, the ADMM rings) is not a multiple of
    3 or 6, so the rings' chunks differ: a ``2 (p-1) n // p`` per-link formula is off."""
    from volume import collectives as cm

    root, M, P = uneven_runs
    T = resolve_model("cnn").layout.total
    assert T % 3 and T % 6
    intra = read_summary(root / "hsadmm")["traffic"]["measured"]["by_phase"]["intra_allreduce"]
    assert intra["intra_bytes"] == 2 * M * 2 * (P - 1) * 4 * T  # two iterations, exactly
    assert intra["intra_bytes"] != 2 * M * P * (2 * (P - 1) * 4 * T // P)
    if M > 1:
        ddp = read_summary(root / "ddp")["traffic"]["measured"]["by_phase"]["grad_allreduce"]
        p = M * P
        assert ddp["inter_bytes"] == cm.ring_allreduce_wire_bytes(4 * T, p, M, 4)["inter"]
        assert ddp["inter_bytes"] != M * (2 * (p - 1) * 4 * T // p)


@pytest.mark.parametrize("name", sorted([*UNEVEN_RUNS, "probe"]))
def test_uneven_layout_measured_equals_predicted(uneven_runs, name):
    """Every system's own closed form (its summary's predicted block) equals the ledger, in
    total and per phase and link class."""
    root, _M, _P = uneven_runs
    s = read_summary(root / name)
    assert_measured_equals_predicted(s)
    if name == "probe":  # also messages and calls of every wrapped call
        assert s["metrics"] == {"collectives_correct": True, "ledger_matches_model": True}


@pytest.mark.parametrize("name", sorted(UNEVEN_RUNS))
def test_uneven_layout_is_reproduced_by_commvol_predict(uneven_runs, name):
    """``commvol predict`` from the model name, the options and M x 3: bytes per phase and link
    class and messages exactly, modeled time to rounding."""
    root, M, P = uneven_runs
    system, model, options = UNEVEN_RUNS[name]
    s = read_summary(root / name)
    lines = load_run(root / name).lines
    if system in ("hsadmm", "flat-admm"):
        n = s["metrics"]["iterations"]
    else:
        n = s["metrics"]["steps"]
    if system == "hsadmm":  # the run's own compact sizes (the OR of the nodes' masks)
        options = {**options, "compact_elems": [ln["compact_elems"] for ln in lines]}
    if options.get("selection_from"):
        options = {**options, "selection_from": str(root / name)}
    shape = {"neurons": 1024, "layers": 3} if model is None else {}
    pred = predict(system, model, nodes=M, gpus_per_node=P, **shape, **options).total(n)
    _assert_reproduced(s, pred)
