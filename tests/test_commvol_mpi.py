"""``commvol predict`` from model name + topology reproduces short MPI runs' measured traffic
(bytes per phase and link class, messages, modeled time), and ``report`` summarizes them."""

import importlib.util
import json

import pytest

from commvol.predict import predict, resolve_model
from commvol.report import comparison_table, load_run, write_plots
from commvol.systems import SYSTEMS, hsadmm_plan, pactrain_kept, ssfusion_plan
from mpi_helpers import read_summary, run_mpi

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
                      "--prune-score", "grasp"]),
        ("pactrain-ternary", ["--steps", "4", "--eval-every", "1", "--ternary",
                              "--warmup-steps", "1", "--stable-window", "1"]),
        ("sdp", ["--steps", "3", "--eval-every", "2"]),
        ("sdp-block", ["--steps", "2", "--model", "resnet", "--sdp-mode", "block"]),
        ("sdp-block-backward", ["--steps", "2", "--model", "resnet",
                                "--sdp-mode", "block-backward"]),
        ("ssfusion-per-tensor", ["--steps", "3", "--fusion", "per-tensor",
                                 "--profile-steps", "1"]),
        ("ssfusion-multi-tensor", ["--steps", "2", "--fusion", "multi-tensor",
                                   "--profile-steps", "0", "--buffers", "3"]),
        ("ssfusion-selective", ["--steps", "4", "--profile-steps", "2", "--density", "0.05"])):
    method = name.split("-")[0]
    dp_train(dp_parser().parse_args(["--method", method, *extra, *shared,
                                     "--out", out + "/" + name]))
"""

#: the predict options of the runs above: (system, model, options)
RUNS = {"pactrain": ("pactrain", "cnn", {"stable_window": 2, "prune_score": "grasp"}),
        "pactrain-ternary": ("pactrain", "cnn", {"ternary": True, "warmup_steps": 1,
                                                 "stable_window": 1}),
        "sdp": ("sdp", "cnn", {"eval_every": 2}),
        "sdp-block": ("sdp", "resnet", {"sdp_mode": "block"}),  # digits' epoch > 2 steps
        "sdp-block-backward": ("sdp", "resnet", {"sdp_mode": "block-backward"}),
        "ssfusion-per-tensor": ("ssfusion", "cnn", {"fusion": "per-tensor", "profile_steps": 1}),
        "ssfusion-multi-tensor": ("ssfusion", "cnn", {"fusion": "multi-tensor",
                                                      "profile_steps": 0, "buffers": 3}),
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
                            if "dense_allreduce" not in pred.per_iteration(k).phases)
        assert s["metrics"]["mask_stable_step"] == first_packed
        assert s["metrics"]["kept"] == pactrain_kept(resolve_model(model).layout, 0.5)
    if system == "ssfusion":  # the run's own closed form (its summary's predicted block) too
        pb = s["traffic"]["predicted"]["by_phase"]
        assert {p: (e["intra_bytes"], e["inter_bytes"]) for p, e in pb.items()} == \
            {p: (v["intra"], v["inter"]) for p, v in pred.total(n).phases.items()}
        sel = s["metrics"]["selection"]
        plan = ssfusion_plan(resolve_model(model), 4, "inter", SYSTEMS["ssfusion"].Options(
            **options))
        assert (plan["ar"], plan["agd"], plan["ks"]) == (
            sel["allreduce_elements"], sel["allgather_dense_elements"], sel["sparse_elements"])


def test_hsadmm_run_is_reproduced(runs):
    s = read_summary(runs / "hsadmm")
    lines = load_run(runs / "hsadmm").lines
    n = s["metrics"]["iterations"]
    # with the run's own compact sizes (the OR of the nodes' masks, eq. 14): exact
    measured_c = [ln["compact_elems"] for ln in lines]
    _assert_reproduced(s, predict("hsadmm", "cnn", nodes=2, gpus_per_node=2,
                                  compact_elems=measured_c).total(n))
    # from keep rates alone: exact when the nodes agreed on the masks, else a lower bound
    plan, *_ = hsadmm_plan(resolve_model("cnn"), 0.5, "channel", 32.0)
    from_keep = predict("hsadmm", "cnn", nodes=2, gpus_per_node=2).total(n)
    assert min(measured_c) >= plan.compact_size
    if all(c == plan.compact_size for c in measured_c):
        _assert_reproduced(s, from_keep)
    else:
        assert from_keep.inter < s["traffic"]["measured"]["inter_node_bytes"]


def test_report_of_the_runs(runs, tmp_path):
    dirs = [runs / m for m in ("hsadmm", "ddp", "topk")]
    text = comparison_table(dirs, target=0.0)
    rows = [ln for ln in text.splitlines() if ln.startswith("| hsadmm") or
            ln.startswith("| ddp") or ln.startswith("| topk")]
    assert len(rows) == 3 and all(r.rstrip(" |").endswith("yes") for r in rows)
    first_sim = json.loads((runs / "ddp" / "metrics.jsonl").read_text().splitlines()[0])["sim_s"]
    ddp_row = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert ddp_row[10] == f"{first_sim:.3f}" and ddp_row[11] == "1.000"
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: plots not checked")
    paths = write_plots(dirs, tmp_path)
    assert {p.name for p in paths} == {"payload.png", "accuracy_vs_bytes.png",
                                       "comm_breakdown.png", "residuals.png"}
    assert all(p.stat().st_size > 5000 for p in paths)


def test_headline_comparison(tmp_path):
    """The default job (``./run_mpi.sh`` = ``commvol.compare`` on 2 virtual nodes x 2): every
    system runs with its defaults and appears in one table with measured = predicted."""
    from commvol.compare import SYSTEM_RUNS  # noqa: PLC0415
    from substrate.launch import DEFAULT_JOB  # noqa: PLC0415

    assert DEFAULT_JOB[-1] == "commvol.compare"
    res = run_mpi(None, 4, "--ranks-per-node", 2, "--out", tmp_path, module="commvol.compare",
                  timeout=300)
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
            for ln in res.stdout.splitlines() if ln.startswith("| ") and "---" not in ln}
    rows.pop("method")
    assert set(rows) == set(SYSTEM_RUNS)
    assert all(r[-1] == "yes" for r in rows.values())
    for method in SYSTEM_RUNS:
        assert read_summary(tmp_path / method)["metrics"]["final_test_accuracy"] >= 0.85, method
