"""Checkpoint/resume of every trainer under MPI (4 ranks as 2 virtual nodes x 2): a resumed
run equals an uninterrupted one bit for bit (see ``tests/mpi/resume_checks.py``)."""

import pytest
from mpi_helpers import assert_one_error_from_every_rank, run_mpi

from substrate.testing import busy_loops

pytestmark = pytest.mark.mpi


def test_dataparallel_resume_equals_uninterrupted_run(tmp_path):
    res = run_mpi("resume_checks.py", 4, "dataparallel", tmp_path, timeout=400)
    for name in ("ddp", "topk", "pactrain", "sdp", "ssfusion", "fallback",
                 "refuses fewer steps"):
        assert f"OK resume {name}" in res.stdout, res.stdout + res.stderr
    # the fallback says which file is damaged and where it resumes from
    assert "spardist: warning: damaged checkpoint(s): " in res.stderr
    assert "ckpt-r1-s00000006.npz" in res.stderr and "resuming from step 4" in res.stderr


def test_sparse_sgd_resume_equals_uninterrupted_run(tmp_path):
    res = run_mpi("resume_checks.py", 4, "sparse", tmp_path, timeout=300)
    assert "OK resume sparse_sgd" in res.stdout, res.stdout + res.stderr


def test_sparse_sgd_resume_on_the_gpu_equals_uninterrupted_run(tmp_path):
    """``sparse_sgd train --device gpu`` on the strict CuPy stand-in: checkpoints written from
    host copies of the device rows, a resume restores them onto the device, bit for bit."""
    from strict_backend import strict_env

    res = run_mpi("resume_checks.py", 4, "sparse-gpu", tmp_path, timeout=300,
                  env=strict_env())
    assert "OK resume sparse_sgd on the GPU" in res.stdout, res.stdout + res.stderr


def test_resume_reuses_the_timing_derived_plan_under_load(tmp_path):
    """SSFusion's plan (Cupcake buffers and selective sparsification, decided from the warm-up
    timings) is kept in the checkpoint: resumed beside two busy loops, a run equals the
    uninterrupted one in every call (count and digest), byte, message and metric but measured
    times, 10 times out of 10 (``tests/mpi/resume_plan_checks.py``)."""
    with busy_loops(2):
        res = run_mpi("resume_plan_checks.py", 2, tmp_path, 10, timeout=400)
    for i in range(10):
        assert f"OK plan repeat {i}" in res.stdout, res.stdout + res.stderr
    assert "PLANS " in res.stdout


def test_resume_of_a_run_started_with_epochs_names_epochs(tmp_path):
    """A data-parallel run started with ``--epochs`` (2 ranks, 23 steps an epoch): a resume
    refused for its total names ``--epochs`` and the total the run was started with, not the
    ``--steps`` that counts its units, whichever option the resume passes."""
    out = tmp_path / "run"
    base = ["train", "--model", "mlp", "--arch", "hidden=16", "--progress-every", "0",
            "--checkpoint-every", "2", "--out", str(out)]
    run_mpi(None, 2, *base, "--epochs", "0.2", module="dataparallel", timeout=300)
    for fewer, asked in ((["--epochs", "0.1"], "--epochs 0.1 (3 steps)"),
                         (["--steps", "4"], "--steps 4")):
        res = run_mpi(None, 2, *base, *fewer, "--resume", module="dataparallel", timeout=300,
                      expect_fail=True)
        assert_one_error_from_every_rank(
            res.stderr, f"--resume: {asked} is smaller than the 5 steps already done", 2)
        assert_one_error_from_every_rank(
            res.stderr, "pass --epochs 0.2 or more (the 5 steps it was started with) to "
                        "continue, or start afresh with --overwrite", 2)
