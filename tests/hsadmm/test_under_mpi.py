"""H-SADMM under MPI (2 virtual nodes x 2 ranks): serial reference, freezing, traffic, errors,
compact export, checkpoint/resume; every iteration's recorded program is the one generated from
its plan (2 x 2, 1 x 3, 2 x 3, round-robin)."""

import dataclasses
import json

import numpy as np
import pytest
from mpi_helpers import (
    JobBatch,
    assert_measured_equals_predicted,
    assert_one_error_from_every_rank,
    read_summary,
    run_mpi,
)

from hsadmm.config import HSADMMConfig
from hsadmm.penalty import penalty_groups
from hsadmm.plan import FlatADMMPlan, HSADMMPlan, iteration_program
from hsadmm.shrink import MaskCodec, pruned_names
from models import build_model
from substrate.calls import Placement
from substrate.program import normalize, steps

pytestmark = pytest.mark.mpi


SOLVER_CHECKS = ["one_iteration", "one_iteration_theta_decay", "freezing", "checkpoint",
                 "flat_freezing"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The checks and runs of this module that succeed: one MPI launch per world size."""
    b = JobBatch(tmp_path_factory.mktemp("hsadmm_jobs"))
    for check in SOLVER_CHECKS:
        b.add(check, 4, "hsadmm_checks.py", check)
    for (n, R), name in zip(LAYOUTS, LAYOUT_IDS):
        b.add(f"accounting-{name}", n, "hsadmm_checks.py", "accounting", R)
    for name, (n, node_map) in PROGRAM_PLACEMENTS.items():
        b.add(f"programs-{name}", n, "hsadmm_checks.py", "programs", b.root / f"programs-{name}",
              node_map)
    b.add("digits", 4, "hsadmm", "train", "--ranks-per-node", 2, "--out", b.root / "digits")
    return b


@pytest.mark.parametrize("check", SOLVER_CHECKS)
def test_solver_check(jobs, check):
    assert f"OK {check}" in jobs.stdout(check)


#: (ranks, ranks per node or node map): 2 x 2, 1 x 6, 4 x 2 node-major and nodes holding ranks
#: (0, 3), (1, 2), (4, 5).  On 2 x 3, 1 x 3 and round-robin the recorded-program runs below
#: (both trainers) hold the calls that ran to the records and the records' bytes to the ledger,
#: and tests/hsadmm/test_plan.py the records' bytes to the closed forms
LAYOUTS = [(4, 2), (6, 6), (8, 2), (6, "0,1,1,0,2,2")]
LAYOUT_IDS = ["2x2", "1x6", "4x2", "map-0,1,1,0,2,2"]


@pytest.mark.parametrize("n,R", LAYOUTS, ids=LAYOUT_IDS)
def test_every_iteration_runs_its_plan_and_books_the_closed_form(jobs, n, R):
    """Per iteration, H-SADMM (masks synced then frozen, several compact buckets) and flat
    ADMM: the calls that ran are the plan's records (``Recorder.account``), whose bytes equal
    the ledgers of all ranks and (node-major layouts) :mod:`volume.hsadmm`'s closed forms; a
    wrong plan is refused (tests/mpi/hsadmm_checks.py ``accounting``)."""
    assert "OK accounting" in jobs.stdout(f"accounting-{LAYOUT_IDS[LAYOUTS.index((n, R))]}")


def test_digits_run_accuracy_and_traffic_match_closed_form(jobs):
    out = jobs.run("digits")
    s = read_summary(out)
    assert s["metrics"]["final_test_accuracy"] >= 0.90
    assert s["config"]["keep"] == 0.5 and s["config"]["sparsity"] == "channel"
    assert_measured_equals_predicted(s)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == s["config"]["iters"]
    # masks are synchronized until the freeze (default: after iteration 4), never after
    assert [x["mask_synced"] for x in lines] == [True] * 4 + [False] * (len(lines) - 4)
    assert all(x["mask_drift"] == 0 for x in lines if not x["mask_synced"])
    # the compact inter-node payload is smaller than the dense one
    assert all(x["compact_elems"] < x["dense_elems"] for x in lines)
    # the physically compact export evaluates to the masked model's accuracy
    m = s["metrics"]
    assert m["compact_test_accuracy"] == m["final_test_accuracy"]
    assert 0 < m["compact_conv_params"] < m["dense_conv_params"]
    assert s["compact_export"]["compact_conv_params"] == m["compact_conv_params"]
    assert (out / "compact_model.npz").is_file()


#: placements of the recorded-program runs: ranks and ``--node-map`` (2 x 2, one node of 3,
#: 2 x 3, round-robin)
PROGRAM_PLACEMENTS = {"2x2": (4, "block:2"), "1x3": (3, "block:3"), "2x3": (6, "block:3"),
                      "round-robin": (4, "round-robin:2")}


@pytest.fixture(params=sorted(PROGRAM_PLACEMENTS))
def program_runs(request, jobs):
    n, node_map = PROGRAM_PLACEMENTS[request.param]
    assert "OK programs" in jobs.stdout(f"programs-{request.param}")
    return jobs.root / f"programs-{request.param}", n, node_map


def _iteration_records(method, summary, line, layout, placement):
    """An iteration's records rebuilt from the run's configuration and its metrics line (the
    masks decide the compact buckets: the line's ``compact_buckets``)."""
    fields = {f.name for f in dataclasses.fields(HSADMMConfig)}
    cfg = HSADMMConfig(**{k: v for k, v in summary["config"].items() if k in fields})
    L = len(penalty_groups(layout, cfg.rho_scope)[0])
    if method == "flat-admm":
        return FlatADMMPlan(layout.total, L).records(placement), cfg
    mask_bytes = MaskCodec([layout.shape(n) for n in pruned_names(layout)]).nbytes
    plan = HSADMMPlan(layout.total, tuple(line["compact_buckets"]), mask_bytes, L)
    return plan.records(placement, mask_synced=line["mask_synced"]), cfg


@pytest.mark.parametrize("method", ["hsadmm", "flat-admm"])
def test_recorded_program_is_the_plans(program_runs, method):
    """A run that records its program (``--compute-profile-out``) verified every iteration
    against the program it ran, booked its records' bytes, and its recording is the program
    generated from the plan alone (:func:`hsadmm.plan.iteration_program`), rank by rank and
    iteration by iteration: masks synchronized, then frozen, several compact buckets."""
    out, n, node_map = program_runs
    summary = read_summary(out / method)
    lines = [json.loads(x) for x in (out / method / "metrics.jsonl").read_text().splitlines()]
    assert summary["metrics"]["program_steps_verified"] == len(lines) == 2
    assert_measured_equals_predicted(summary)
    if method == "hsadmm":
        assert [x["mask_synced"] for x in lines] == [True, False]
        assert all(len(x["compact_buckets"]) > 1 for x in lines)
    doc = json.loads((out / f"{method}.json").read_text())
    placement = Placement.parse(node_map, n)
    model = build_model("cnn", (1, 8, 8), 10)
    for k, line in enumerate(lines):
        records, cfg = _iteration_records(method, summary, line, model.layout, placement)
        for r in range(n):
            step = steps(normalize(doc["programs"][r]))[k]
            want = normalize(iteration_program(records, model.compute_units(), cfg.local_steps,
                                               placement, r, overlap=True))
            if step != want:
                i = next((i for i, (a, b) in enumerate(zip(step, want)) if a != b),
                         min(len(step), len(want)))
                pytest.fail(f"{method} on {node_map}: rank {r} iteration {k} entry {i}: "
                            f"recorded {step[i] if i < len(step) else None}, generated "
                            f"{want[i] if i < len(want) else None}")


def _train(out, *args, expect_fail=False, n=4):
    return run_mpi(None, n, "train", "--ranks-per-node", 2, "--local-steps", 5,
                   "--out", out, *args, module="hsadmm", timeout=180, expect_fail=expect_fail)


def test_resume_matches_uninterrupted_run(tmp_path):
    """4 iterations in one go == 2 iterations, then --resume to 4 (5 local steps per iteration
    do not divide the 12-batch epoch, so the run resumes mid-epoch)."""
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a, "--iters", 4, "--checkpoint-every", 2)
    _train(b, "--iters", 2, "--checkpoint-every", 2)
    _train(b, "--iters", 4, "--checkpoint-every", 2, "--resume")
    for r in range(4):  # every rank's full solver state after iteration 4, bit for bit
        with np.load(a / "checkpoints" / f"ckpt-r{r}-s00000004.npz") as x, \
                np.load(b / "checkpoints" / f"ckpt-r{r}-s00000004.npz") as y:
            assert x.files == y.files
            # measured times differ run to run
            timed = ("run/clock", "run/metrics", "loop/timing")
            assert [k for k in x.files if k not in timed
                    and not np.array_equal(x[k], y[k])] == [], r
    with np.load(a / "compact_model.npz") as x, np.load(b / "compact_model.npz") as y:
        assert all(np.array_equal(x[k], y[k]) for k in x.files)
    la, lb = ([json.loads(t) for t in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (a, b))
    assert [x["iteration"] for x in lb] == [0, 1, 2, 3]  # earlier lines kept
    for x, y in zip(la, lb):
        assert (x["loss"], x["test_accuracy"], x["rho1"]) == (y["loss"], y["test_accuracy"],
                                                              y["rho1"])
    sa, sb = read_summary(a), read_summary(b)
    assert sb["metrics"]["resumed_from_iteration"] == 2
    assert sb["metrics"]["final_test_accuracy"] == sa["metrics"]["final_test_accuracy"]
    assert_measured_equals_predicted(sb)
    assert sb["traffic"] == sa["traffic"]  # the whole run's bytes, calls and modeled time


def test_resume_without_checkpoint_errors_on_every_rank(tmp_path):
    res = _train(tmp_path / "x", "--resume", expect_fail=True, n=2)
    assert_one_error_from_every_rank(res.stderr, "ValueError: --resume: no checkpoint", 2)
    assert str(tmp_path / "x" / "checkpoints") in res.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_fresh_run_refuses_stale_checkpoints(tmp_path):
    ck = tmp_path / "x" / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "ckpt-r0-s00000002.npz").write_bytes(b"")
    res = _train(tmp_path / "x", "--checkpoint-every", 2, expect_fail=True, n=2)
    assert "pass --resume to continue it" in res.stderr


@pytest.mark.parametrize("args,message", [
    (["--keep", "1.5"], "keep rate must be in (0, 1]"),
    (["--keep", "0"], "keep rate must be in (0, 1]"),
    (["--sparsity", "chanel"], "unknown sparsity 'chanel'"),
    (["--method", "admm"], "unknown --method 'admm'"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
])
def test_bad_input_errors_on_every_rank(tmp_path, args, message):
    res = run_mpi(None, 2, "train", *args, "--out", tmp_path / "x", module="hsadmm",
                  timeout=120, expect_fail=True)
    assert message in res.stderr
    assert "spardist: error on rank" in res.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_world_not_multiple_of_ranks_per_node(tmp_path):
    res = run_mpi(None, 3, "train", "--ranks-per-node", 2, "--out", tmp_path / "x",
                  module="hsadmm", timeout=120, expect_fail=True)
    assert "not a multiple of --ranks-per-node 2" in res.stderr
