"""Substrate behaviour under real MPI: 1, 2 and 4 ranks, virtual nodes, launched with a timeout."""

import json

import pytest

from mpi_helpers import run_mpi

pytestmark = pytest.mark.mpi

# (ranks, ranks per node): one rank; 2 nodes x 1; 2 nodes x 2 (the embedded default); 4 x 1
LAYOUTS = [(1, 1), (2, 1), (4, 2), (4, 1)]
CHECKS = ["topo_2x2", "ring_inter", "p2p", "mask_or", "bucketed", "gathers"]


@pytest.mark.parametrize("n,R", LAYOUTS, ids=[f"{n}x{R}" for n, R in LAYOUTS])
@pytest.mark.parametrize("check", CHECKS)
def test_substrate_check(check, n, R):
    res = run_mpi("substrate_checks.py", n, check, R, timeout=90)
    assert f"OK {check}" in res.stdout


@pytest.mark.parametrize("n,R", [(4, 1), (4, 2)])
def test_rack_level(n, R):
    assert "OK racks" in run_mpi("substrate_checks.py", n, "racks", R, timeout=60).stdout


def test_collective_check_fails_every_rank_without_hanging():
    res = run_mpi("substrate_checks.py", 4, "collective_fail", 2, timeout=60, expect_fail=True)
    assert "deliberate failure on rank 1" in res.stderr
    assert "check failed on 1 of 4 ranks" in res.stderr


@pytest.mark.parametrize("n,R", [(1, 1), (2, 1), (4, 2)])
def test_probe_ledger_matches_model(n, R, tmp_path):
    res = run_mpi(None, n, "--ranks-per-node", R, "--out", tmp_path / "probe",
                  module="substrate.probe", timeout=90)
    report = json.loads(res.stdout)
    assert report["topology"]["nodes"] == n // R
    assert report["topology"]["ranks_per_node"] == R
    assert report["collectives_correct"] is True
    assert report["ledger_matches_model"] is True, report["mismatches"]
    summary = json.loads((tmp_path / "probe" / "summary.json").read_text())
    assert summary["traffic"]["measured"]["inter_node_bytes"] == \
        summary["traffic"]["predicted"]["inter_node_bytes"]
    for key in ("system", "method", "config", "versions", "topology", "traffic", "metrics",
                "timing"):
        assert key in summary
    assert set(summary["timing"]) == {"wall_s", "compute_s", "comm_modeled_s", "sim_s"}


def test_world_not_multiple_of_ranks_per_node_errors_on_every_rank(tmp_path):
    res = run_mpi(None, 3, "--ranks-per-node", 2, "--out", tmp_path / "x",
                  module="substrate.probe", timeout=60, expect_fail=True)
    assert "not a multiple of --ranks-per-node 2" in res.stderr
    assert "spardist: error on rank" in res.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_bad_ranks_per_node_value_errors(tmp_path):
    res = run_mpi(None, 2, "--ranks-per-node", 0, "--out", tmp_path / "x",
                  module="substrate.probe", timeout=60, expect_fail=True)
    assert "--ranks-per-node must be a positive integer" in res.stderr
