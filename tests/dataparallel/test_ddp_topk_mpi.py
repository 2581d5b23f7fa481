"""Data-parallel trainer and the DDP / Top-K strategies under MPI (2 virtual nodes x 2 ranks)."""

import json

import pytest
from mpi_helpers import (
    assert_fails_on_every_rank,
    assert_measured_equals_predicted,
    read_summary,
    run_mpi,
)

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("check", [("ddp", "ring"), ("ddp", "hierarchical"), ("topk",)])
def test_strategy_matches_serial_reference_and_closed_form(check):
    assert f"OK {' '.join(check)}" in run_mpi("dp_checks.py", 4, *check, timeout=180).stdout


@pytest.mark.parametrize("method,extra", [("ddp", []), ("topk", ["--density", "0.02"])])
def test_train_run_traffic_equals_prediction(tmp_path, method, extra):
    out = tmp_path / method
    run_mpi(None, 4, "train", "--method", method, "--steps", 6, "--eval-every", 3,
            "--ranks-per-node", 2, "--out", out, *extra, module="dataparallel", timeout=180)
    s = read_summary(out)
    assert_measured_equals_predicted(s)
    assert s["traffic"]["measured"]["inter_node_bytes"] > 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [3, 6]
    # one metrics schema for every command: unit, index, bytes of the interval, step wall time
    for x in lines:
        assert x["unit"] == "step" and x["index"] == x["step"]
        assert x["intra_node_bytes"] >= 0 and x["step_wall_s"] > 0
    assert sum(x["inter_node_bytes"] for x in lines) == s["traffic"]["measured"][
        "inter_node_bytes"]
    assert 0 <= s["metrics"]["final_test_accuracy"] <= 1


@pytest.mark.parametrize("args,message", [
    (["--method", "topk", "--density", "0"], "--density must be in (0, 1]"),
    (["--method", "nope"], "unknown --method 'nope'"),
    (["--method", "ddp", "--bucket-mib", "-1"], "--bucket-mib must be > 0"),
])
def test_bad_flags_error_on_every_rank(tmp_path, args, message):
    assert_fails_on_every_rank("dataparallel", ["train", *args], message, tmp_path / "x")
