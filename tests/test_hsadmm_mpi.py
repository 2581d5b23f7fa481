"""H-SADMM under MPI (2 virtual nodes x 2 ranks): serial reference, freezing, traffic, errors."""

import json

import pytest

from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("check", ["one_iteration", "freezing"])
def test_solver_check(check):
    assert f"OK {check}" in run_mpi("hsadmm_checks.py", 4, check, timeout=180).stdout


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def _assert_measured_equals_predicted(s):
    measured, predicted = s["traffic"]["measured"], s["traffic"]["predicted"]
    assert measured["inter_node_bytes"] == predicted["inter_node_bytes"] > 0
    assert measured["intra_node_bytes"] == predicted["intra_node_bytes"] > 0
    for phase, want in predicted["by_phase"].items():
        got = measured["by_phase"][phase]
        assert (got["intra_bytes"], got["inter_bytes"]) == (want["intra_bytes"],
                                                            want["inter_bytes"]), phase
    assert set(measured["by_phase"]) == set(predicted["by_phase"])


def test_digits_run_accuracy_and_traffic_match_closed_form(tmp_path):
    out = tmp_path / "hs"
    run_mpi(None, 4, "train", "--ranks-per-node", 2, "--out", out, module="hsadmm",
            timeout=240)
    s = _summary(out)
    assert s["metrics"]["final_test_accuracy"] >= 0.90
    assert s["config"]["keep"] == 0.5 and s["config"]["sparsity"] == "channel"
    _assert_measured_equals_predicted(s)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == s["config"]["iters"]
    # masks are synchronized until the freeze (default: after iteration 4), never after
    assert [x["mask_synced"] for x in lines] == [True] * 4 + [False] * (len(lines) - 4)
    assert all(x["mask_drift"] == 0 for x in lines if not x["mask_synced"])
    # the compact inter-node payload is smaller than the dense one
    assert all(x["compact_elems"] < x["dense_elems"] for x in lines)


def test_flat_admm_traffic_matches_closed_form(tmp_path):
    out = tmp_path / "flat"
    run_mpi(None, 4, "train", "--method", "flat-admm", "--iters", 2, "--ranks-per-node", 2,
            "--out", out, module="hsadmm", timeout=240)
    _assert_measured_equals_predicted(_summary(out))


@pytest.mark.parametrize("args,message", [
    (["--keep", "1.5"], "keep rate must be in (0, 1]"),
    (["--keep", "0"], "keep rate must be in (0, 1]"),
    (["--sparsity", "chanel"], "unknown sparsity 'chanel'"),
    (["--method", "admm"], "unknown --method 'admm'"),
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
