"""Substrate behaviour under real MPI: 1, 2 and 4 ranks, virtual nodes, launched with a timeout."""

import json

import pytest
from mpi_helpers import JobBatch, run_mpi

pytestmark = pytest.mark.mpi

# (ranks, ranks per node): one rank; 2 nodes x 1; 2 nodes x 2 (the embedded default); 4 x 1
LAYOUTS = [(1, 1), (2, 1), (4, 2), (4, 1)]
CHECKS = ["topo_2x2", "ring_inter", "p2p", "mask_or", "bucketed", "gathers"]


RACK_LAYOUTS = [(4, 1), (4, 2)]
# -- collectives modes: exact point-to-point algorithms vs the library's -------------
MODE_LAYOUTS = [(4, 2), (6, 3), (3, 3), (5, 1)]  # 2x2, 2 nodes x 3, one node of 3, 5 x 1
SENT_LAYOUTS = [(4, 2), (6, 3), (5, 1)]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """Every passing ``substrate_checks.py`` check of this module: one launch per world size."""
    b = JobBatch(tmp_path_factory.mktemp("substrate_checks"))
    for check, layouts in [*((c, LAYOUTS) for c in CHECKS), ("racks", RACK_LAYOUTS),
                           ("exact_vs_native", MODE_LAYOUTS),
                           ("exact_sent_equals_formula", SENT_LAYOUTS),
                           ("records_price_the_ledger", MODE_LAYOUTS)]:
        for n, R in layouts:
            b.add(f"{check}-{n}x{R}", n, "substrate_checks.py", check, R)
    return b


@pytest.mark.parametrize("n,R", LAYOUTS, ids=[f"{n}x{R}" for n, R in LAYOUTS])
@pytest.mark.parametrize("check", CHECKS)
def test_substrate_check(checks, check, n, R):
    assert f"OK {check}" in checks.stdout(f"{check}-{n}x{R}")


@pytest.mark.parametrize("n,R", RACK_LAYOUTS)
def test_rack_level(checks, n, R):
    assert "OK racks" in checks.stdout(f"racks-{n}x{R}")


def test_collective_check_fails_every_rank_without_hanging():
    res = run_mpi("substrate_checks.py", 4, "collective_fail", 2, timeout=60, expect_fail=True)
    assert "deliberate failure on rank 1" in res.stderr
    assert "check failed on 1 of 4 ranks" in res.stderr


@pytest.mark.parametrize("n,R", [(1, 1), (2, 1), (4, 2)])
def test_probe_ledger_matches_model(n, R, tmp_path):
    res = run_mpi(None, n, "--ranks-per-node", R, "--out", tmp_path / "probe",
                  module="runner.probe", timeout=90)
    report = json.loads(res.stdout)
    assert report["topology"]["nodes"] == n // R
    assert report["topology"]["ranks_per_node"] == R
    assert report["collectives_correct"] is True
    assert report["ledger_matches_model"] is True, report["mismatches"]
    summary = json.loads((tmp_path / "probe" / "summary.json").read_text())
    assert summary["traffic"]["measured"]["inter_node_bytes"] == \
        summary["traffic"]["predicted"]["inter_node_bytes"]
    for key in ("system", "method", "config", "versions", "topology", "traffic", "metrics",
                "timing", "clock"):
        assert key in summary
    # the clock is the job simulation: its reading beside the alpha-beta bound, and its source
    assert set(summary["timing"]) == {"wall_s", "compute_s", "comm_modeled_s", "sim_s", "steps"}
    assert summary["clock"]["model"].startswith("job simulation")
    assert summary["clock"]["compute_source"].startswith(("cpu", "wall", "cuda"))


def test_world_not_multiple_of_ranks_per_node_errors_on_every_rank(tmp_path):
    res = run_mpi(None, 3, "--ranks-per-node", 2, "--out", tmp_path / "x",
                  module="runner.probe", timeout=60, expect_fail=True)
    assert "not a multiple of --ranks-per-node 2" in res.stderr
    assert "spardist: error on rank" in res.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_bad_ranks_per_node_value_errors(tmp_path):
    res = run_mpi(None, 2, "--ranks-per-node", 0, "--out", tmp_path / "x",
                  module="runner.probe", timeout=60, expect_fail=True)
    assert "--ranks-per-node must be a positive integer" in res.stderr


@pytest.mark.parametrize("n,R", MODE_LAYOUTS, ids=[f"{n}x{R}" for n, R in MODE_LAYOUTS])
def test_exact_collectives_match_library_and_booking(checks, n, R):
    """Same results as the library's collectives; exact mode's per-destination sends equal the
    native mode's closed-form booking on every rank, phase and field."""
    assert "OK exact_vs_native" in checks.stdout(f"exact_vs_native-{n}x{R}")


@pytest.mark.parametrize("n,R", SENT_LAYOUTS, ids=["4x2", "6x3", "5x1"])
def test_exact_ring_sends_what_the_ring_books(checks, n, R):
    assert "OK exact_sent_equals_formula" in checks.stdout(f"exact_sent_equals_formula-{n}x{R}")


@pytest.mark.parametrize("n,R", MODE_LAYOUTS, ids=[f"{n}x{R}" for n, R in MODE_LAYOUTS])
def test_call_records_price_what_the_exact_collectives_sent(checks, n, R):
    assert "OK records_price_the_ledger" in checks.stdout(f"records_price_the_ledger-{n}x{R}")


def _collectives_block(tmp_path, *extra, env_drop=()):
    import os
    import subprocess

    from runner.launch import launch_command, mpi_env

    out = tmp_path / "probe"
    cmd = launch_command(4, "runner.probe", ["--ranks-per-node", "2", "--out", str(out),
                                                *extra])
    env = mpi_env(4)
    for k in env_drop:
        env.pop(k, None)
    env.pop("SPARDIST_COLLECTIVES", None)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), check=False)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "summary.json").read_text())["collectives"], res.stderr


def test_summary_says_exact_mode_by_default(tmp_path):
    block, err = _collectives_block(tmp_path)
    assert block["mode"] == "exact" and block["verified"] is True
    assert "warning" not in err


def test_native_mode_unpinned_is_booked_not_verified(tmp_path):
    from substrate.pinning import MPICH_PINNING

    block, err = _collectives_block(tmp_path, "--collectives", "native",
                                    env_drop=tuple(MPICH_PINNING))
    assert block["mode"] == "native" and block["verified"] is False
    assert block["status"].startswith("booked, not verified")
    assert "booked, not verified" in err  # said on stderr too, not only in the file


def test_native_mode_pinned_by_the_launcher(tmp_path):
    block, _ = _collectives_block(tmp_path, "--collectives", "native")
    assert block["mode"] == "native" and block["pinned"] is True
    if block["family"] == "mpich" and block["library"].split()[-1].startswith("5.0"):
        assert block["verified"] is True


def test_bad_collectives_mode_is_a_clear_error(tmp_path):
    res = run_mpi(None, 2, "--collectives", "ring", "--out", tmp_path / "x",
                  module="runner.probe", timeout=60, expect_fail=True)
    assert "--collectives" in res.stderr and "exact" in res.stderr
    assert not (tmp_path / "x").exists()
