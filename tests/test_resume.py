"""Checkpoint/resume of every trainer under MPI (4 ranks as 2 virtual nodes x 2): a resumed
run equals an uninterrupted one bit for bit (see ``tests/mpi/resume_checks.py``)."""

import pytest
from mpi_helpers import run_mpi

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
